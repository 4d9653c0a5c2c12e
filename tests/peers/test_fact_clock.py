"""A proxy whose clock runs ahead must not poison the TSDB for every other writer.

The audit's repro, against a real Prometheus 2.42: the proxy's clock 2 h ahead for 2 s
(four fact writes at 0.5 s), then corrected. Before, the facts stamped 2 h ahead moved
the TSDB's head so far that it refused every sender's current samples, through the proxy
and direct alike, as ``out of bounds`` for about an hour. Now the writer reads the
upstream's clock from the Date of its answers and holds its writes while the two differ
by more than ``facts.max_clock_offset_seconds``."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import aiohttp

from proxy.config import Settings
from proxy.sender import Series, send_series
from proxy.upstream_clock import ClockReading
from tests.peers.conftest import InProcessProxy, Peers, query, wait_until


async def test_a_clock_ahead_holds_the_fact_writes_and_every_sender_keeps_writing(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    prom = await peers.prometheus_receiver()
    write = prom.base_url + "/api/v1/write"

    def facts_on(s: Settings) -> None:
        s.facts.enabled = True
        s.facts.interval_seconds = 0.5

    p = await make_proxy(write, facts_on)
    writer = p.proxy.facts
    assert writer is not None
    offset = [0.0]
    writer._clock = lambda: time.time() + offset[0]  # this host's wall clock
    ok = writer.writes_ok

    async def wrote_again() -> bool:
        return writer.writes_ok > ok + 1

    await wait_until(wrote_again, timeout=30, what="fact writes")
    assert abs(writer.clock_offset()) < 2.0  # from the Date of its answers
    failed = writer.writes_failed
    offset[0] = 7200.0

    async def held() -> bool:  # none sent: counted, not timed (how many writes a fixed
        return writer.writes_failed >= failed + 2  # 2 s sees depends on the load)

    await wait_until(held, timeout=30, what="two fact writes held")
    assert 7198 < writer.clock_offset() < 7202
    offset[0] = 0.0
    ok = writer.writes_ok  # read by wrote_again: the writes since the clock is back
    await wait_until(wrote_again, timeout=30, what="fact writes resume")

    async with aiohttp.ClientSession() as session:
        now = int(time.time() * 1000)
        for name, url in (("through_proxy", p.write_url), ("direct", write)):
            status, _, text = await send_series(
                url, [Series({"__name__": f"clock_probe_{name}", "job": "t"}, [(now, 1.0)])],
                session=session)
            assert status == 204, (name, status, text)
    # nothing of the proxy's stored ahead of the true time
    newest = await query(prom.base_url, "max(timestamp(karta_contract_info))")
    assert newest and float(newest[0]["value"][1]) < time.time() + 5


async def test_a_hold_on_an_old_reading_ends_at_the_next_write(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """The reading a hold is judged by ages (the TSDB's clock stepped right since, or this
    host suspended: its monotonic clock missed what its wall clock counted). The fact
    writes' answers were never read for their Date (only the start's check's was), and
    held writes sent nothing: a hold never ended. Now each fact write's Date is read, and
    a held write asks the TSDB's time with an empty write first (Prometheus 2.42: 204,
    its Date), then writes."""
    prom = await peers.prometheus_receiver()

    def facts_on(s: Settings) -> None:
        s.facts.enabled = True
        s.facts.interval_seconds = 0.5

    p = await make_proxy(prom.base_url + "/api/v1/write", facts_on)
    writer = p.proxy.facts
    assert writer is not None
    ok = writer.writes_ok

    async def wrote_again() -> bool:
        return writer.writes_ok > ok + 1

    await wait_until(wrote_again, timeout=30, what="fact writes")
    clock = p.proxy.upstream.clock
    clock.reading = None  # the start's check's: the fact writes' answers read since
    ok = writer.writes_ok
    await wait_until(wrote_again, timeout=10, what="fact writes")
    # an empty OwnHeaders (no facts.headers) was taken for a sender's: no Date read
    assert clock.reading is not None, "the fact writes' answers' Date was not read"
    # as if the TSDB's clock had read 2 h behind at the last answer, then been corrected
    clock.reading = ClockReading(clock.reading.upstream - 7200, clock.reading.monotonic)
    assert writer.clock_offset() > 7000
    ok = writer.writes_ok
    await wait_until(wrote_again, timeout=10, what="fact writes after a fresh Date")
    assert abs(writer.clock_offset()) < 2.0
    assert writer.writes_failed == 0
