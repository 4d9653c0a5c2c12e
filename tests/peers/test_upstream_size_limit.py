"""A request that fits the upstream's size limit as the sender sent it, but not stamped:
through the proxy every sample is still stored (sent in parts), against a real
VictoriaMetrics with a small ``-maxInsertRequestSize`` (which answers such a request 400
"too big unpacked request", not 413)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
import snappy
from aiohttp import web

from proxy.aux_server import AuxServer
from proxy.sender import Series, build_v1, send_series
from proxy.upstream import WRITTEN_SAMPLES
from proxy.wire.primitives import Protocol
from tests.peers.conftest import InProcessProxy, Peers, query, vm_flush, wait_until

pytestmark = pytest.mark.peers

#: a pod of the demo snapshot: its series get stamped
POD = {"namespace": "web", "pod": "frontend-6d8f7b9c5d-4xkqp"}
SERIES = 200


def batch(via: str, now_ms: int) -> list[Series]:
    return [Series({"__name__": "split_probe", **POD, "container": f"c-{i:03d}",
                    "via": via}, [(now_ms, float(i))]) for i in range(SERIES)]


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_a_batch_over_the_limit_only_once_stamped_is_stored_whole(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], protocol: Protocol,
) -> None:
    """RW 2.0 goes to this 1.0-only receiver converted, and is cut so."""
    now_ms = int(time.time() * 1000)
    size = len(build_v1(batch("d", now_ms)))  # the decoded size VictoriaMetrics checks
    limit = size * 21 // 20  # 5% of room: the sender's batch fits, the stamped one does not
    vm = await peers.victoria_metrics(extra=[f"-maxInsertRequestSize={limit}"])
    status, _, text = await send_series(vm.base_url + "/api/v1/write", batch("d", now_ms))
    assert status == 204, text  # direct, the batch fits
    proxy = await make_proxy(vm.base_url + "/api/v1/write")
    status, headers, text = await send_series(proxy.write_url, batch("p", now_ms),
                                              protocol=protocol)
    assert status == 204, text
    if protocol is Protocol.V2:
        assert headers[WRITTEN_SAMPLES] == str(SERIES)
    m = proxy.proxy.metrics.registry
    # the stamped request was refused for its size, then stored in parts
    assert m.get_sample_value("karta_proxy_upstream_responses_total", {"code": "400"}) == 1
    assert m.get_sample_value("karta_proxy_upstream_split_requests_total",
                              {"result": "stored"}) == 1
    at = time.time()

    async def stored() -> bool:
        await vm_flush(vm)
        r = await query(vm.base_url, 'count(split_probe{via="p"})', at)
        return bool(r) and float(r[0]["value"][1]) == SERIES

    await wait_until(stored, timeout=20, what="every series sent through the proxy")
    stamped = await query(vm.base_url, 'split_probe{via="p", karta_workload!=""}', at)
    assert sorted(float(r["value"][1]) for r in stamped) == [float(i) for i in range(SERIES)]


# -- a batch sent in parts, sent again by its sender ------------------------------------------


class SizeLimitFront(AuxServer):
    """A size limit before a real receiver, as nginx's ``client_max_body_size`` or Mimir's
    ``distributor.max_recv_msg_size``: 413 for a body that decodes to more than ``limit``
    bytes, else the request forwarded and the receiver's answer relayed. ``lose``: the
    forwarded write (0-based, empty writes not counted) whose answer is lost after the
    receiver took it (the connection to the proxy reset instead), once. ``fail``: the
    write under the limit (0-based, counted as ``lose``'s) the front answers 503 itself,
    never forwarded (a load balancer whose backend is away), after ``hold`` seconds."""

    def __init__(self, target: str, limit: int, lose: int | None = None,
                 fail: int | None = None, hold: float = 0.0) -> None:
        self.target = target
        self.limit = limit
        self.lose = lose
        self.fail = fail
        self.hold = hold
        self.forwarded = 0
        self.fits = 0
        #: the receiver's status for every write forwarded, in order
        self.answers: list[int] = []
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        size = len(snappy.uncompress(body)) if body else 0
        if size > self.limit:
            return web.Response(status=413, text="request entity too large")
        if size:
            n, self.fits = self.fits, self.fits + 1
            if n == self.fail:
                await asyncio.sleep(self.hold)
                return web.Response(status=503, text="no healthy upstream")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "connection")}
        async with aiohttp.ClientSession() as session, session.post(
                self.target, data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            status, text = resp.status, await resp.read()
        if size == 0:
            return web.Response(status=status, body=text)
        n, self.forwarded = self.forwarded, self.forwarded + 1
        self.answers.append(status)
        if n == self.lose:
            assert request.transport is not None
            request.transport.abort()  # the receiver took it; the answer never arrives
        return web.Response(status=status, body=text)

    async def start(self) -> str:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/api/v1/write", self._handle)
        port = await self.serve(app, "127.0.0.1", 0, auto_decompress=False,
                                shutdown_timeout=0.5)
        self.url = f"http://127.0.0.1:{port}/api/v1/write"
        return self.url


#: series and samples of the batch sent twice: as Prometheus sends after a pause, one
#: TimeSeries a sample, every series at every step, the steps in order
RESEND_SERIES, RESEND_STEPS = 20, 12
#: the parts the stamped batch is cut in, under a limit of 9/10 of the sender's batch
#: (the stamp about doubles these small series: quarters, steps 0-2, 3-5, ... each)
RESEND_PARTS = 4


def repeated_batch(via: str, start_ms: int) -> list[Series]:
    return [Series({"__name__": "resend_probe", **POD, "container": f"c-{i:02d}", "via": via},
                   [(start_ms + step * 1000, float(step))])
            for step in range(RESEND_STEPS) for i in range(RESEND_SERIES)]


@pytest.mark.parametrize("lose", [None, 0, 1], ids=["answer-to-sender-lost",
                                                    "first-part-answer-lost",
                                                    "second-part-answer-lost"])
@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_a_batch_sent_in_parts_and_sent_again_is_stored_once(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], protocol: Protocol,
    lose: int | None,
) -> None:
    """Prometheus 2.42 refuses a sample older than what it holds of the series: a part
    sent again after a later part was stored is "out of order sample", a 400 the sender
    drops (the batch is stored whole). The resend skips the parts that got a 2xx, so a
    batch whose every answer but the proxy's own came gets 2xx again. A part whose answer
    was lost is sent again and refused as out of order: the sender gets that 400, said
    in one line, since only a 2xx says a part is stored (the lost send most likely
    stored it, and every sample is there once)."""
    prom = await peers.prometheus_receiver()
    start_ms = int(time.time() * 1000) - 60_000
    batch = repeated_batch("p", start_ms)
    front = SizeLimitFront(prom.base_url + "/api/v1/write",
                           limit=len(build_v1(batch)) * 9 // 10, lose=lose)
    async with front:
        proxy = await make_proxy(front.url)
        first, _, text = await send_series(proxy.write_url, batch, protocol=protocol)
        assert first == (204 if lose is None else 502), text
        # no part is sent after one without an answer (a 502: the sender retries)
        assert front.forwarded == (RESEND_PARTS if lose is None else lose + 1)
        assert all(s == 204 for s in front.answers)
        # the sender sends the batch again: its answer was lost, or it was a 502
        status, headers, text = await send_series(proxy.write_url, batch, protocol=protocol)
    total = RESEND_SERIES * RESEND_STEPS
    m = proxy.proxy.metrics.registry
    if lose is None:
        assert status == 204, text
        assert front.forwarded == RESEND_PARTS  # the resend: the whole refused, only
        if protocol is Protocol.V2:
            assert headers[WRITTEN_SAMPLES] == str(total)
    else:
        assert status == 400, text
        assert text.strip() == (
            f"part {lose + 1} of {RESEND_PARTS} refused as out of order after an earlier "
            "attempt of this batch got no 2xx for it (if that answer was lost, most likely "
            "stored then); the other parts are stored; upstream: out of order sample")
        # the part whose answer was lost, sent again; the parts after it sent and stored
        assert front.answers.count(400) == 1
        assert len(front.answers) == (lose + 1) + (RESEND_PARTS - lose)
        if protocol is Protocol.V2:  # what the other part stored, converted for Prometheus
            assert 0 < int(headers[WRITTEN_SAMPLES]) < total
    assert m.get_sample_value("karta_proxy_upstream_split_requests_total",
                              {"result": "stored"}) == (2 if lose is None else 0)
    # every sample stored, once
    r = await query(prom.base_url, 'sum(count_over_time(resend_probe{via="p"}[5m]))')
    assert r and float(r[0]["value"][1]) == total


@pytest.mark.parametrize("hold", [0.0, 7.0], ids=["front-503", "held-past-the-deadline"])
@pytest.mark.parametrize("other_at", [30_000, 10_000], ids=["out-of-order", "duplicate"])
async def test_a_part_never_stored_and_refused_on_the_resend_is_no_2xx(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], other_at: int,
    hold: float,
) -> None:
    """A part the receiver never saw (a front's own 503, or held past the proxy's
    deadline), and another writer (an HA twin, a backfill) then writes a later sample, or
    another value at a timestamp, of one of its series: Prometheus refuses the whole part
    on the resend. A 2xx would tell the sender its batch is stored while that part's
    other samples are not (the review of the record found it so: 181 of 240)."""
    prom = await peers.prometheus_receiver()
    start_ms = int(time.time() * 1000) - 60_000
    batch = repeated_batch("p", start_ms)
    front = SizeLimitFront(prom.base_url + "/api/v1/write",
                           limit=len(build_v1(batch)) * 9 // 10, fail=3, hold=hold)
    async with front:
        proxy = await make_proxy(front.url)
        first, _, text = await send_series(proxy.write_url, batch)
        assert first in (503, 504), text
        r = await query(prom.base_url, 'last_over_time(resend_probe{container="c-00"}[5m])')
        labels = {**r[0]["metric"], "__name__": "resend_probe"}
        status, _, text = await send_series(prom.base_url + "/api/v1/write",
                                            [Series(labels, [(start_ms + other_at, 99.0)])])
        assert status == 204, text
        again, _, text = await send_series(proxy.write_url, batch)
    assert again == 400, text
    assert front.answers[-1] == 400  # the part never stored, refused
    r = await query(prom.base_url, 'sum(count_over_time(resend_probe{via="p"}[5m]))')
    assert float(r[0]["value"][1]) - 1 < RESEND_SERIES * RESEND_STEPS  # the other writer's
