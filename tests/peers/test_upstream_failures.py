"""Failures on either side: upstream errors reach the sender with the right class, a
Prometheus agent rides through an upstream outage without losing a sample, and bad input
gets a 4xx from a real proxy process that lives on with bounded memory."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import snappy

from proxy.demo_exporter import DEMO_SNAPSHOT, FixtureExporter
from proxy.sender import Series, build_v1, build_v2, send, send_series
from proxy.wire.primitives import Protocol
from tests.peers.conftest import (
    InProcessProxy,
    Peers,
    agent_metrics,
    free_port,
    pod_sample_times,
    query,
    remote_write,
    scrape_configs,
    vm_flush,
    wait_until,
)
from tests.scripted import Reply, ScriptedUpstream

pytestmark = pytest.mark.peers

REPO = Path(__file__).resolve().parents[2]
POD = {"__name__": "pod_memory_working_set_bytes", "namespace": "web",
       "pod": "frontend-6d8f7b9c5d-4xkqp"}


@pytest.mark.parametrize(
    ("reply", "status", "retry_after"),
    [
        (Reply(400, body=b"err: out of order sample"), 400, None),
        (Reply(500, body=b"internal"), 502, None),
        (Reply(503, {"Retry-After": "12"}), 503, "12"),
        (Reply(429), 503, "1"),
        (Reply(408, body=b"timeout reading the body"), 503, "1"),
        (Reply(425), 503, "1"),
        (Reply(204, delay=3.0), 504, None),
    ],
)
@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_upstream_answers_keep_their_class(
    make_proxy: Callable[..., Awaitable[InProcessProxy]], reply: Reply, status: int,
    retry_after: str | None, protocol: Protocol,
) -> None:
    async with ScriptedUpstream(reply) as up:
        proxy = await make_proxy(up.url, timeout_seconds=1.0)
        got, headers, text = await send_series(
            proxy.write_url, [Series(POD, [(int(time.time() * 1000), 1.0)])],
            protocol=protocol, encoding="zstd",
        )
    assert got == status, text
    assert headers.get("Retry-After") == retry_after
    if reply.status == 400:
        assert "out of order sample" in text


async def test_refused_upstream_is_502_then_recovers(
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    port = free_port()
    proxy = await make_proxy(f"http://127.0.0.1:{port}/api/v1/write")
    series = [Series(POD, [(int(time.time() * 1000), 1.0)])]
    status, _, text = await send_series(proxy.write_url, series)
    assert status == 502 and "unreachable" in text
    async with ScriptedUpstream(port=port) as up:
        status, _, _ = await send_series(proxy.write_url, series)
    assert status == 204 and len(up.received) == 1


async def test_agent_rides_through_an_upstream_outage(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    port = free_port()
    vm = await peers.victoria_metrics("vm-outage", port=port)
    direct = await peers.victoria_metrics("vm-direct")
    proxy = await make_proxy(vm.base_url + "/api/v1/write")
    agent = await peers.prometheus_agent({
        # scrapes are what the test counts (4 during the outage, 3 after): at 500 ms it
        # waits half as long for the same story
        "global": {"scrape_interval": "500ms"},
        "scrape_configs": scrape_configs(exporter, "500ms")[1:2],  # kubelet resource only
        "remote_write": [remote_write(proxy.write_url),
                         remote_write(direct.base_url + "/api/v1/write")],
    })

    async def count_in(peer_url: str) -> float:
        got = await query(peer_url, "count(pod_memory_working_set_bytes)")
        return float(got[0]["value"][1]) if got else 0.0

    async def landed() -> bool:
        await vm_flush(vm)
        return await count_in(vm.base_url) > 0

    await wait_until(landed, timeout=30, what="first samples through the proxy")
    # outage: stop VictoriaMetrics by PID while the agent keeps scraping
    assert await vm.astop() == 0
    before = exporter.scrapes["resource"]
    await wait_until(_after(exporter, before + 4), timeout=20, what="scrapes during the outage")
    m = proxy.proxy.metrics.registry
    assert (m.get_sample_value("karta_proxy_upstream_responses_total",
                               {"code": "connect_error"}) or 0) > 0
    # recovery on the same port and data
    vm.start()
    await vm.wait_ready()
    before = exporter.scrapes["resource"]
    await wait_until(_after(exporter, before + 3), timeout=20, what="scrapes after recovery")
    assert await agent.astop() == 0  # flushes what is queued
    for peer in (vm, direct):
        await vm_flush(peer)
    at = time.time()

    async def samples(base: str) -> dict[tuple[str, str], list[float]]:
        return await pod_sample_times(base, at)

    async def complete() -> bool:
        return await samples(vm.base_url) == await samples(direct.base_url)

    try:
        await wait_until(complete, timeout=20, what="every sample after the outage")
    except AssertionError:  # say which samples differ, and what the agent said of them
        through, direct_ = await samples(vm.base_url), await samples(direct.base_url)
        differ = {k: (sorted(set(direct_.get(k, [])) - set(v)),
                      sorted(set(v) - set(direct_.get(k, []))))
                  for k, v in through.items() if v != direct_.get(k)}
        raise AssertionError(
            f"{len(differ)} of {len(direct_)} series differ through the proxy (only direct, "
            f"only through): {dict(list(differ.items())[:3])}; the agent's log: "
            f"{agent.log_tail(1500)}") from None
    got = await samples(vm.base_url)
    assert min(len(v) for v in got.values()) >= 6  # before, during and after the outage
    enriched = await query(vm.base_url, "pod_memory_working_set_bytes{karta_workload!=''}", at)
    attributed = [p for p in exporter.model.pods
                  if proxy.proxy.index.lookup(p.namespace.encode(), p.name.encode())]
    assert len(enriched) == len(attributed) > 0


async def test_agent_keeps_batches_an_upstream_408s(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # an upstream (or a load balancer before it) that times out reading bodies for a
    # while: passed on as a 408, Prometheus would drop every batch of that while
    # ("non-recoverable error"); as the 503 the proxy answers, it sends them again
    async with ScriptedUpstream(*[Reply(408, body=b"request timeout")] * 3, Reply(204)) as up:
        proxy = await make_proxy(up.url)
        agent = await peers.prometheus_agent({
            "global": {"scrape_interval": "500ms"},
            "scrape_configs": scrape_configs(exporter, "500ms")[1:2],  # kubelet resource
            "remote_write": [remote_write(proxy.write_url)],
        })

        async def sent() -> bool:
            return len(up.received) >= 6

        await wait_until(sent, timeout=30, what="writes past the upstream's 408s")
        metrics = await agent_metrics(agent)
        assert await agent.astop() == 0  # the loop keeps serving the proxy its last flush
    assert metrics["samples_failed_total"] == 0, metrics
    assert metrics["samples_retried_total"] > 0, metrics
    # the batches refused at first arrived again, whole
    refused = [r.raw for r in up.received[:3]]
    assert all(any(raw == later.raw for later in up.received[3:]) for raw in refused)


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_zstd_refused_by_the_upstream_goes_out_as_snappy(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], protocol: Protocol,
) -> None:
    # Debian's VictoriaMetrics 1.79 reads no zstd (400 "snappy: corrupt input"): with
    # upstream.encoding zstd every write was refused, and dropped by its sender
    vm = await peers.victoria_metrics()
    proxy = await make_proxy(vm.base_url + "/api/v1/write", encoding="zstd")
    upstream = proxy.proxy.upstream
    assert (await upstream.check()).outcome in ("rw1", "rw2")
    assert upstream.zstd_refused and upstream.out_encoding("zstd") == "snappy"
    metric = f"zstd_fallback_{protocol.name.lower()}"
    now = int(time.time() * 1000)
    status, _, text = await send_series(
        proxy.write_url, [Series({**POD, "__name__": metric}, [(now, 7.0)])],
        protocol=protocol, encoding="zstd")
    assert status == 204, text

    async def stored() -> bool:
        await vm_flush(vm)
        return bool(await query(vm.base_url, f"{metric}{{karta_workload!=''}}"))

    await wait_until(stored, timeout=15, what="the sample stored, stamped")




def _after(exp: FixtureExporter, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return exp.scrapes["resource"] >= n

    return check


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def test_bad_input_gets_4xx_and_the_process_lives_on() -> None:
    port = free_port()
    async with ScriptedUpstream() as up:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "--snapshot", str(DEMO_SNAPSHOT),
            "--upstream-url", up.url, "--listen-address", f"127.0.0.1:{port}", "--no-facts",
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        url = base + "/api/v1/write"
        try:
            async with aiohttp.ClientSession() as session:
                async def ready() -> bool:
                    async with session.get(base + "/-/ready") as r:
                        return r.status == 200

                await wait_until(ready, timeout=20, what="proxy process ready")
                good = build_v1([Series(POD, [(int(time.time() * 1000), 1.0)])])
                bomb = bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + b"\x00" * 64
                cases: list[tuple[bytes, str, int]] = [
                    (b"", "snappy", 400),                            # empty body
                    (snappy.compress(good)[:-7], "snappy", 400),     # truncated snappy
                    (b"\x93garbage snappy\xff" * 20, "snappy", 400),  # garbage snappy
                    (bomb, "snappy", 413),                           # snappy bomb
                    (b"\x28\xb5\x2f\xfd garbage", "zstd", 400),     # garbage zstd
                    (snappy.compress(b"\xff" * 200), "snappy", 400),  # garbage protobuf
                    (snappy.compress(good.replace(b"frontend", b"fr\xffntend")), "snappy", 400),
                    (snappy.compress(build_v2([Series(POD, [(1, 1.0)])])[:-3]), "snappy", 400),
                ]
                rss_before = _rss_kib(proc.pid)
                for _ in range(20):  # repeated: memory must not grow with bad input
                    for body, enc, status in cases:
                        got, _, text = await send(url, body, protocol=Protocol.V1, encoding=enc,
                                                  compressed=True, session=session)
                        assert got == status, (body[:20], text)
                rss_after = _rss_kib(proc.pid)
                async with session.get(url) as r:  # wrong method
                    assert r.status == 405
                async with session.get(base + "/-/healthy") as r:
                    assert r.status == 200
                got, _, _ = await send(url, good, protocol=Protocol.V1, session=session)
                assert got == 204
                async with session.get(base + "/metrics") as r:
                    metrics = await r.text()
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0
    assert rss_after - rss_before < 32 * 1024, (rss_before, rss_after)  # KiB
    for kind in ("empty_body", "snappy_corrupt", "too_large", "zstd_corrupt",
                 "protobuf_invalid", "invalid_utf8"):
        assert f'karta_proxy_decode_errors_total{{kind="{kind}"}}' in metrics, kind
    assert len(up.received) == 1
