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
