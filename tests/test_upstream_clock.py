"""The upstream's clock by its Date headers: parsing every form RFC 9110 names, and the
offset following this host's monotonic clock between answers (a step of the wall clock
after an answer shows at once)."""

from __future__ import annotations

import pytest

from proxy.upstream_clock import UpstreamClock, parse_date

#: RFC 9110's example instant in its three forms
EXAMPLE = 784111777.0


@pytest.mark.parametrize("value", [
    "Sun, 06 Nov 1994 08:49:37 GMT",  # IMF-fixdate, what servers send
    "Sunday, 06-Nov-94 08:49:37 GMT",  # obsolete RFC 850
    "Sun Nov  6 08:49:37 1994",  # obsolete asctime: no zone, GMT by definition
])
def test_every_date_form_reads_as_the_same_instant(value: str) -> None:
    assert parse_date(value) == EXAMPLE


@pytest.mark.parametrize("value", [None, "", "yesterday", "Sun, 32 Nov 1994 08:49:37 GMT",
                                   "Sun, 06 Nov 1994 25:49:37 GMT", "\x00"])
def test_an_absent_or_unreadable_date_says_nothing(value: str | None) -> None:
    assert parse_date(value) is None
    clock = UpstreamClock()
    clock.note(value)
    assert clock.reading is None and clock.offset(EXAMPLE) is None


def test_the_offset_follows_the_monotonic_clock_since_the_answer() -> None:
    mono = [100.0]
    clock = UpstreamClock(lambda: mono[0])
    assert clock.offset(EXAMPLE) is None  # before any answer
    clock.note("Sun, 06 Nov 1994 08:49:37 GMT")
    # the middle of the header's whole second: at most 0.5 s off either way
    assert clock.offset(EXAMPLE + 0.5) == 0.0
    mono[0] += 30.0  # 30 s later by this host's monotonic clock
    assert clock.offset(EXAMPLE + 30.5) == 0.0
    # this host's wall clock stepped 2 h ahead meanwhile: seen without another answer
    assert clock.offset(EXAMPLE + 30.5 + 7200) == 7200.0
    assert clock.offset(EXAMPLE + 30.5 - 45) == -45.0
    # a later answer replaces the reading; one without a Date keeps it
    clock.note(None)
    assert clock.offset(EXAMPLE + 30.5) == 0.0
    clock.note("Sun, 06 Nov 1994 08:50:37 GMT")
    assert clock.offset(EXAMPLE + 60.5) == 0.0
