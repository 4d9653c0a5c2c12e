"""The fact writer and clocks: writes held while this host's clock is off the upstream's
(by its Date headers), and timestamps that keep rising across a step of the clock back.

An audit (a real Prometheus 2.42): a proxy whose clock ran 2 h ahead for 2 s wrote facts
that made the TSDB refuse every sender's current samples as ``out of bounds`` for an hour;
a step of 30 s back made every fact write an out-of-order refusal, bisected into ~95
requests a write, until the clock was back where it had been."""

from __future__ import annotations

import email.utils
import logging
import math

import pytest

from proxy.config import FactSettings
from proxy.facts import FactWriter
from proxy.facts.collectors import sample_value
from proxy.karta.results import ChangeSet
from proxy.upstream_clock import UpstreamClock
from tests.facts.helpers import decode, small_index
from tests.facts.test_stepdown import _Elector
from tests.facts.test_writer import _Holder

#: the upstream's Date when the clocks agree (Unix 1_800_000_000, a Friday)
DATE = "Fri, 15 Jan 2027 08:00:00 GMT"
AGREED = 1_800_000_000.5


class Host:
    """This host's wall and monotonic clocks, and the true time, moved by the test."""

    def __init__(self) -> None:
        self.wall = AGREED
        self.mono = 0.0
        self.true = AGREED

    def tick(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds
        self.true += seconds


def writer(host: Host, sent: list[bytes], clock: UpstreamClock | None,
           limit: float = 60.0) -> FactWriter:
    async def send(body: bytes) -> None:
        sent.append(body)

    settings = FactSettings(interval_seconds=0.1, max_clock_offset_seconds=limit)
    return FactWriter(settings, small_index(), send, clock=lambda: host.wall,
                      monotonic=lambda: host.mono, upstream_clock=clock)


def upstream_clock(host: Host) -> UpstreamClock:
    clock = UpstreamClock(lambda: host.mono)
    clock.note(DATE)
    return clock


@pytest.mark.parametrize("step", [7200.0, -7200.0, 61.0, -61.0])
async def test_writes_are_held_while_the_clock_is_off_the_upstreams(
    step: float, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    host, sent = Host(), list[bytes]()
    w = writer(host, sent, upstream_clock(host))
    assert await w.write_once() and sent
    assert w.clock_offset() == 0.0
    host.tick(1.0)
    host.wall += step  # an NTP step, or a wrong hardware clock at boot
    written = len(sent)
    for _ in range(3):
        host.tick(0.1)
        assert not await w.write_once()
    assert not any(sent[written:])  # not one sample stamped so went out (empty writes
    # asked the upstream's time)
    assert w.writes_failed == 3
    assert sample_value(w.metrics.clock_offset) == pytest.approx(step)
    held = [r for r in caplog.records if r.getMessage().startswith("fact writes held")]
    assert len(held) == 1 and held[0].levelno == logging.ERROR  # the start, not each write
    assert ("ahead of" if step > 0 else "behind") in held[0].getMessage()
    host.wall -= step  # corrected
    host.tick(0.1)
    assert await w.write_once() and len(sent) > written
    assert any(r.getMessage().startswith("fact writes resume") for r in caplog.records)


async def test_within_the_limit_or_without_a_date_or_a_limit_nothing_is_held() -> None:
    host = Host()
    sent: list[bytes] = []
    within = writer(host, sent, upstream_clock(host))
    host.wall += 59.0  # the default limit is 60 s
    assert await within.write_once()
    no_date = writer(host, sent, UpstreamClock(lambda: host.mono))  # no answer yet
    host.wall += 7200
    assert await no_date.write_once()
    assert math.isnan(no_date.clock_offset())
    off = writer(host, sent, upstream_clock(host), limit=0)
    assert await off.write_once()


async def test_a_leader_whose_clock_stays_off_gives_the_lease_up() -> None:
    host, sent = Host(), list[bytes]()
    elector = _Elector()
    clock = upstream_clock(host)
    w = FactWriter(FactSettings(interval_seconds=0.1), small_index(),
                   lambda body: _append(sent, body), elector=elector,  # type: ignore[arg-type]
                   clock=lambda: host.wall, monotonic=lambda: host.mono, upstream_clock=clock)
    host.wall += 3600
    for _ in range(3):
        assert not await w.write_once()
        host.tick(0.6)
    assert elector.cooldowns == [2.0] and not any(sent)  # empty writes only
    assert sample_value(w.metrics.stepdowns.labels(reason="clock_offset")) == 1
    assert sample_value(w.metrics.stepdowns.labels(reason="writes_failing")) == 0


async def _append(sent: list[bytes], body: bytes) -> None:
    sent.append(body)


def _timestamps(bodies: list[bytes]) -> set[int]:
    return {ts for body in bodies for samples in decode(body).values() for _, ts in samples}


async def test_a_step_of_the_clock_back_keeps_each_writes_timestamps_rising() -> None:
    host, sent = Host(), list[bytes]()
    w = writer(host, sent, None)
    assert await w.write_once()
    first = _timestamps(sent)
    assert first == {int(AGREED * 1000)}
    host.wall -= 30.0  # an NTP step back, under the limit
    for i in range(1, 4):
        sent.clear()
        host.tick(0.1)
        assert await w.write_once()
        # 1 ms after the last write's, not 30 s before it: no out-of-order sample
        assert _timestamps(sent) == {int(AGREED * 1000) + i}
    host.wall += 40.0  # past where it had been: its own time again
    sent.clear()
    assert await w.write_once()
    assert _timestamps(sent) == {int(host.wall * 1000)}


def answering(host: Host, sent: list[bytes], clock: UpstreamClock,
              upstream_ahead: list[float]) -> FactWriter:
    """A writer whose upstream answers every request with its ``Date`` (the true time,
    plus ``upstream_ahead[0]``), as a real one does."""
    async def send(body: bytes) -> None:
        sent.append(body)
        clock.note(email.utils.formatdate(host.true + upstream_ahead[0], usegmt=True))

    return FactWriter(FactSettings(interval_seconds=0.1), small_index(), send,
                      clock=lambda: host.wall, monotonic=lambda: host.mono,
                      upstream_clock=clock)


@pytest.mark.parametrize("case", ["upstream_clock_corrected", "host_suspended"])
async def test_a_hold_ends_when_a_fresh_date_says_the_clocks_agree(case: str) -> None:
    """The reading the hold is judged by ages: the upstream's clock may have been stepped
    right since (the TSDB host's NTP), or this host's monotonic clock may have missed time
    its wall clock counted (a suspended VM resumed: CLOCK_MONOTONIC stops, the wall clock
    is set again). Held writes sent nothing, so no Date came and the hold lasted for ever
    (an audit: a TSDB 2 h behind at the last write, then corrected: no fact written for
    the next hour of the test's clock). Now a held write first asks the upstream's time
    again with an empty write (no sample), and writes when the clocks agree."""
    host, sent = Host(), list[bytes]()
    ahead = [0.0]
    clock = upstream_clock(host)
    w = answering(host, sent, clock, ahead)
    if case == "upstream_clock_corrected":
        ahead[0] = -7200.0  # the TSDB's clock 2 h behind when it answered
        host.tick(0.1)
        assert await w.write_once()  # its answer's Date: 2 h behind
        ahead[0] = 0.0  # the TSDB's clock stepped right
    else:
        assert await w.write_once()
        host.wall += 600.0  # 10 minutes suspended: the wall clock counted them, not mono
        host.true += 600.0
    for _ in range(3):
        host.tick(0.1)
        if await w.write_once():
            break
    else:
        pytest.fail(f"fact writes still held: offset {w.clock_offset():.0f} s")
    assert abs(w.clock_offset()) < 1.0
    assert b"" in sent  # the probe: an empty write, no sample stamped


async def test_a_hold_asks_the_upstreams_time_once_a_write_and_holds_while_it_differs(
) -> None:
    host, sent = Host(), list[bytes]()
    ahead = [0.0]
    w = answering(host, sent, upstream_clock(host), ahead)
    assert await w.write_once()
    written = len(sent)
    host.wall += 3600.0  # this host's clock stepped an hour ahead: the upstream says so
    for _ in range(3):
        host.tick(0.1)
        assert not await w.write_once()
    assert sent[written:] == [b""] * 3  # one empty write a held write, nothing stamped
    assert w.writes_failed == 3


async def test_a_standby_times_what_it_saw_on_the_monotonic_clock() -> None:
    """A standby remembers the series it saw, each with when it last saw it, so that a
    takeover ends what the old leader left. Timed on the wall clock, a step back of an
    hour kept every group seen before it for that hour (STANDBY_MEMORY is 300 s) and a
    takeover then sent and counted markers for series the old leader had ended long
    before; a step forward forgot what a takeover still owed. Now those times are ages on
    the monotonic clock, which no step moves."""
    wall, mono = [AGREED], [0.0]
    index = small_index()
    lease = _Holder(mono, False)  # its renewals on this replica's own (monotonic) clock

    async def send(body: bytes) -> None:
        pass

    w = FactWriter(FactSettings(), index, send, elector=lease,  # type: ignore[arg-type]
                   clock=lambda: wall[0], monotonic=lambda: mono[0])
    assert not await w.write_once()
    assert "p-head" in w._standby
    index.apply(ChangeSet(pods={"p-head": None}))  # gone; the leader ends it
    wall[0] -= 3600.0  # an NTP step back of an hour
    for _ in range(30):  # 450 s standing by, the holder renewing every interval
        mono[0] += 15
        wall[0] += 15
        lease.renewed = mono[0]
        assert not await w.write_once()
    # past the takeover window (90 s) before the holder's last renewal: forgotten
    assert "p-head" not in w._standby
    lease.is_leader = True
    assert await w.write_once()
    assert w.stale_markers_total == 0  # none counted for what the old leader ended
