"""proxy.shown: how refusals and relayed error texts show what they did not make."""

from __future__ import annotations

import pytest

from proxy.shown import SHOWN, one_line, shown


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
