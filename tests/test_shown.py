"""proxy.shown: how refusals and relayed error texts show what they did not make."""

from __future__ import annotations

import pytest

from proxy.shown import SHOWN, hidden_query, one_line, shown


@pytest.mark.parametrize(("text", "line"), [
    ("a\r\n  b\tc\u2028d\x85e", "a b c d e"),  # every whitespace run one space
    ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),  # a terminal's escapes, shown
    ("nul\x00bs\x08del\x7fcsi\x9b", "nul\\x00bs\\x08del\\x7fcsi\\x9b"),
    ("é ünïcode ✓", "é ünïcode ✓"),  # printable text as it is
    ("  ", ""),
])
def test_one_line_folds_whitespace_and_shows_other_controls(text: str, line: str) -> None:
    assert one_line(text) == line


def test_shown_cuts_and_escapes_bytes() -> None:
    assert shown(b'a"\\\xff') == "a\\x22\\x5c\\xff"
    assert shown(b"x" * (SHOWN + 1)) == "x" * SHOWN + "..."


def test_hidden_query_hides_each_credential_parameters_value_and_nothing_else() -> None:
    """One rule for a URL (``shown_url``) and a request line a refusal quotes: a value
    ends at ``&``, ``#`` or whitespace (the line's `` HTTP/1.1`` stays)."""
    assert hidden_query("POST /w?tenant=a&api_key=K1:x\\x01&X-Auth-Token=T HTTP/1.1") == \
        "POST /w?tenant=a&api_key=(hidden)&X-Auth-Token=(hidden) HTTP/1.1"
    assert hidden_query("/w?token=T#frag") == "/w?token=(hidden)#frag"
    assert hidden_query("/w?extra_label=cluster=prod&token") == \
        "/w?extra_label=cluster=prod&token"  # no credential name; a name with no value
    assert hidden_query("Invalid char in url query") == "Invalid char in url query"
