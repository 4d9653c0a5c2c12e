"""The proxy's ``Via`` entry and the loop it tells of (``proxy.via``)."""

from __future__ import annotations

import re

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy import via


def test_the_entry_is_a_pseudonym_of_this_process_not_a_host() -> None:
    assert re.fullmatch(r"1\.1 karta-proxy-[0-9a-f]{8}", via.ENTRY)
    assert via.PSEUDONYM in via.LOOP_SAID
    assert f"1.1 {via.PSEUDONYM}" == via.ENTRY  # what the cases below spell "1.1 {me}"


def _here(template: str) -> str:
    """``{me}`` in a case made this process's pseudonym. The cases name it so, not by value,
    so that every process (each pytest-xdist worker) collects the same test ids: the
    pseudonym is random per process."""
    return template.replace("{me}", via.PSEUDONYM)


@pytest.mark.parametrize(("incoming", "out"), [
    (None, "1.1 {me}"),
    ("", "1.1 {me}"),
    ("  ", "1.1 {me}"),
    ("1.1 ingress", "1.1 ingress, 1.1 {me}"),
    ("1.0 fred, 1.1 p.example.net (Apache/1.1)", "1.0 fred, 1.1 p.example.net (Apache/1.1), "
                                                 "1.1 {me}"),
    ("1.1 caf\u00e9", "1.1 caf\u00e9, 1.1 {me}"),  # UTF-8 text passes
    ("1.1 caf\udce9", "1.1 {me}"),  # a byte that is not UTF-8: the client cannot send it
])
def test_a_forwarded_request_carries_the_senders_hops_then_this_one(
        incoming: str | None, out: str) -> None:
    assert via.forwarded(incoming) == _here(out)


@pytest.mark.parametrize(("value", "here"), [
    ("1.1 {me}", True),
    ("1.1 ingress, 1.1 {me}", True),
    ("1.1 {me}, 1.1 karta-proxy-00000000", True),
    ("HTTP/1.1 {me} (karta-proxy)", True),
    ("1.1 ingress,1.1 {me}", True),
    ("1.1 karta-proxy-00000000", False),  # another replica
    ("1.1 {me}x", False),  # a longer name that begins as this one
    ("1.1 x{me}", False),
    ("1.1 ingress ({me})", False),  # named in a comment, not as a hop
    ("", False),
])
def test_a_loop_is_this_process_named_as_a_hop(value: str, here: bool) -> None:
    assert via.came_through_here(_here(value)) is here


def test_every_via_line_is_read() -> None:
    lines = CIMultiDict([("Via", "1.1 ingress"), ("via", via.ENTRY)])
    assert via.sent(CIMultiDictProxy(lines)) == f"1.1 ingress, {via.ENTRY}"
    assert via.sent(lines) == f"1.1 ingress, {via.ENTRY}"
    assert via.sent({"Via": "1.1 a"}) == "1.1 a"
    assert via.sent(CIMultiDictProxy(CIMultiDict())) is None
