"""Exchanges with the upstream that end without a clear answer, against Prometheus 2.42
and VictoriaMetrics behind a fault-injecting TCP relay (``tests/fault_relay.py``): what the
sender is told, what the receiver stored, and what the sender's resend does. The promise:
a 2xx only for what is stored, and a 5xx (sent again) rather than a 4xx (dropped) whenever
the proxy cannot know (docs/operations.md, "An exchange that ends without an answer")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from proxy.demo_exporter import FixtureExporter
from proxy.sender import Series, send_series
from tests.fault_relay import (
    CLOSE_AT_REQUEST,
    EMPTY_BODY,
    LOSE_ANSWER,
    PASS,
    RESET_IN_BODY,
    Fault,
    FaultRelay,
    on_writes,
)
from tests.peers.conftest import (
    InProcessProxy,
    Peer,
    Peers,
    agent_metrics,
    pod_sample_times,
    query,
    remote_write,
    scrape_configs,
    vm_flush,
    wait_until,
)

pytestmark = pytest.mark.peers

#: a pod of the demo snapshot: its series get stamped
POD = {"namespace": "web", "pod": "frontend-6d8f7b9c5d-4xkqp"}
SERIES = 10
#: the proxy's upstream.timeout_seconds here, and answers held just under and past it
TIMEOUT = 1.0
SLOW_IN, SLOW_OUT = Fault(PASS, TIMEOUT - 0.4), Fault(PASS, TIMEOUT + 0.4)

#: fault -> (the sender's first answer, that write stored)
CASES: dict[str, tuple[Fault, int, bool]] = {
    "answer-lost": (Fault(LOSE_ANSWER), 502, True),
    "reset-in-body": (Fault(RESET_IN_BODY), 502, False),
    "closed-at-request": (Fault(CLOSE_AT_REQUEST), 502, False),
    "slow-in-time": (SLOW_IN, 204, True),
    "slow-past-deadline": (SLOW_OUT, 504, True),
}


def batch(via: str, start_ms: int, steps: int = 1) -> list[Series]:
    """``steps`` samples of each series, one TimeSeries a sample, as Prometheus sends."""
    return [Series({"__name__": "ambiguous_probe", **POD, "container": f"c-{i:02d}",
                    "via": via}, [(start_ms + step * 1000, float(step))])
            for step in range(steps) for i in range(SERIES)]


async def stored(receiver: Peer, via: str, vm: bool) -> int:
    if vm:
        await vm_flush(receiver)
    r = await query(receiver.base_url,
                    f'sum(count_over_time(ambiguous_probe{{via="{via}"}}[5m]))')
    return int(float(r[0]["value"][1])) if r else 0


@pytest.mark.parametrize("receiver", ["prometheus", "victoria-metrics"])
async def test_what_the_sender_is_told_and_what_is_stored(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], receiver: str,
) -> None:
    """Each write that carries data meets one fault, then the sender sends it again (as
    it does after a 5xx; after a 2xx too, for the record). A 502 or 504 whenever the
    receiver may or may not have it; a 2xx only when it has it. Sent again, what was
    stored is taken again: Prometheus takes an identical sample again without a second
    copy, VictoriaMetrics (without ``-dedup.minScrapeInterval``) keeps a second copy."""
    vm = receiver == "victoria-metrics"
    peer = await (peers.victoria_metrics() if vm else peers.prometheus_receiver())
    start_ms = int(time.time() * 1000) - 60_000
    faults = {2 * n: fault for n, (fault, _, _) in enumerate(CASES.values())}
    async with FaultRelay(("127.0.0.1", peer.port), on_writes(faults)) as relay:
        proxy = await make_proxy(relay.url(), timeout_seconds=TIMEOUT)
        for name, (_, told, kept) in CASES.items():
            sent = batch(name, start_ms)
            first, _, text = await send_series(proxy.write_url, sent)
            assert first == told, (name, text)
            # past the deadline: the receiver answered at once, the relay held its answer
            assert await stored(peer, name, vm) == (SERIES if kept else 0), name
            again, _, text = await send_series(proxy.write_url, sent)
            assert again == 204, (name, text)
            twice = vm and kept
            assert await stored(peer, name, vm) == SERIES * (2 if twice else 1), name
    assert [e.fault for e in relay.events if e.body_bytes > EMPTY_BODY][::2] == [
        f.kind for f, _, _ in CASES.values()]


async def test_a_lost_answer_to_a_batch_of_several_samples_a_series(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """Prometheus stored the batch, its answer was lost (502), and the resend is refused
    as out of order: a 400 the sender drops, for a batch stored whole. Nothing is lost;
    the proxy cannot tell this 400 from any other."""
    prom = await peers.prometheus_receiver()
    start_ms = int(time.time() * 1000) - 60_000
    sent = batch("several", start_ms, steps=3)
    async with FaultRelay(("127.0.0.1", prom.port),
                          on_writes({0: Fault(LOSE_ANSWER)})) as relay:
        proxy = await make_proxy(relay.url(), timeout_seconds=TIMEOUT)
        first, _, _ = await send_series(proxy.write_url, sent)
        again, _, text = await send_series(proxy.write_url, sent)
    assert (first, again) == (502, 400)
    assert text.strip() == "out of order sample"
    assert await stored(prom, "several", vm=False) == 3 * SERIES


#: the faults a real sender meets through the proxy, by the number of its write (its
#: resends counted): an answer lost (stored), a reset in the body (not stored; a close
#: at the request is the same to it). Apart, as vmagent waits 1-2 s after a failure
SENDER_FAULTS = {1: Fault(LOSE_ANSWER), 3: Fault(RESET_IN_BODY)}
#: the senders' scrape interval (and vmagent's flush interval)
SCRAPE = "250ms"


async def samples(base: str, at: float) -> dict[tuple[str, str], set[float]]:
    """The timestamps of each pod's kubelet series, the fixture exporter's, stored by
    ``at``."""
    return {pod: set(times) for pod, times in (await pod_sample_times(base, at)).items()}


async def through_faults(peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
                         start_sender: Callable[[str, str], Awaitable[Peer]]
                         ) -> dict[str, float]:
    """A sender that ``start_sender`` (the proxy's write URL, a direct one) starts writes
    through the proxy, which meets ``SENDER_FAULTS``, and
    straight to a second Prometheus: every sample of the direct path is in the proxied
    one, once the sender stopped. The sender's
    ``prometheus_remote_storage_*`` counters before it stopped (none for vmagent)."""
    prom, direct = await asyncio.gather(peers.prometheus_receiver(),
                                        peers.prometheus_receiver("prom-direct"))
    plan = on_writes(SENDER_FAULTS)
    async with FaultRelay(("127.0.0.1", prom.port), plan) as relay:
        proxy = await make_proxy(relay.url())
        sender = await start_sender(proxy.write_url, direct.base_url + "/api/v1/write")

        async def writes() -> bool:
            return sum(e.body_bytes > EMPTY_BODY for e in relay.events) > max(SENDER_FAULTS) + 1

        await wait_until(writes, timeout=20, what="two writes after the last fault")
        counters = await agent_metrics(sender)
        assert await sender.astop() == 0
    at = time.time()
    got, want = await samples(prom.base_url, at), await samples(direct.base_url, at)
    assert want and got.keys() == want.keys()
    # up to the last sample the proxied path has: vmagent keeps a block it was backing off
    # from at its stop in its queue on disk, for its next start
    last = max(max(ts) for ts in got.values())
    assert all({t for t in want[k] if t <= last} <= got[k] for k in want), (
        "a sample the direct path has is missing")
    return counters


async def test_a_prometheus_agent_loses_nothing_to_answers_lost_and_resets(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """A Prometheus 2.42 agent: a resend after an answer lost of a batch holding a series
    twice is refused as out of order, and the agent counts it failed (dropped): stored
    all the same."""

    async def agent(url: str, direct: str) -> Peer:
        return await peers.prometheus_agent({
            "global": {"scrape_interval": SCRAPE},
            "scrape_configs": scrape_configs(exporter, SCRAPE)[1:2],  # kubelet resource
            "remote_write": [remote_write(url), remote_write(direct)],
        })

    counters = await through_faults(peers, make_proxy, agent)
    assert counters["samples_retried_total"] > 0


async def test_vmagent_with_one_queue_loses_nothing_to_answers_lost_and_resets(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """vmagent with one queue, as docs/operations.md asks in front of Prometheus (with
    several, its queues send out of order, and Prometheus refuses the older blocks even
    without a fault, on the direct path too)."""

    async def vmagent(url: str, direct: str) -> Peer:
        return await peers.vmagent(
            {"global": {"scrape_interval": SCRAPE},
             "scrape_configs": scrape_configs(exporter, SCRAPE)[1:2]},
            url, extra=[f"-remoteWrite.url={direct}", "-remoteWrite.queues=1",
                        f"-remoteWrite.flushInterval={SCRAPE}"])

    await through_faults(peers, make_proxy, vmagent)
