"""Prometheus 2.42 agent -> karta-proxy -> Prometheus 2.42 receiver / VictoriaMetrics, with a
direct path beside it for comparison; PromQL over the real HTTP APIs."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp
import pytest
import snappy
from aiohttp import web

from proxy import contract
from proxy.demo_exporter import FixtureExporter
from proxy.facts import FactWriter
from proxy.facts.collectors import sample_value
from proxy.handler import PART_DECODED_BYTES
from proxy.pb.prometheus import remote_pb2
from proxy.runtime import Proxy
from tests.peers.conftest import (
    WORKLOAD_KEY,
    InProcessProxy,
    Peer,
    Peers,
    close,
    expected_by_workload,
    free_port,
    query,
    remote_write,
    scalar_by,
    scrape_configs,
    series_set,
    vm_flush,
    wait_until,
)
from tests.wire.snappy_blocks import element_kinds, random_block

pytestmark = pytest.mark.peers
WriteRequest: Any = cast(Any, remote_pb2).WriteRequest

KARTA = "karta_"


def strip_karta(s: frozenset[tuple[str, str]]) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in s if not k.startswith(KARTA))


async def test_agent_through_proxy_into_prometheus_and_vm(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    enriched = await peers.prometheus_receiver("prom-enriched")
    direct = await peers.prometheus_receiver("prom-direct")
    vm = await peers.victoria_metrics()
    to_prom = await make_proxy(enriched.base_url + "/api/v1/write")
    to_vm = await make_proxy(vm.base_url + "/api/v1/write")
    start = time.time() - 5
    agent = await peers.prometheus_agent({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": scrape_configs(exporter),
        "remote_write": [remote_write(to_prom.write_url), remote_write(to_vm.write_url),
                         remote_write(direct.base_url + "/api/v1/write")],
    })
    expected = expected_by_workload(exporter, to_prom.proxy)
    n_pods = len(exporter.model.pods)

    async def landed() -> bool:
        got = await query(enriched.base_url, "count(pod_memory_working_set_bytes)")
        return bool(got) and int(float(got[0]["value"][1])) == n_pods

    await wait_until(landed, timeout=30, what="pod series in the receiving Prometheus")
    # a few more scrapes, then stop the agent: it flushes its queues on the way out
    seen = exporter.scrapes["resource"]
    await wait_until(lambda: _true_after(exporter, "resource", seen + 3), timeout=20,
                     what="3 more scrapes of /metrics/resource")
    stopping = time.time()
    assert await agent.astop() == 0
    end = time.time() + 5
    await vm_flush(vm)

    # -- per-workload sums: memory (kubelet resource) and GPU utilization (DCGM) ----------
    for base in (enriched.base_url, vm.base_url):
        mem = await scalar_by(base, "sum by (karta_namespace, karta_kind, karta_workload) "
                              "(pod_memory_working_set_bytes{karta_workload!=''})", WORKLOAD_KEY)
        assert mem.keys() == expected.memory.keys(), base
        for k, v in expected.memory.items():
            assert close(mem[k], v), (base, k, mem[k], v)
        util = await scalar_by(base, "sum by (karta_namespace, karta_kind, karta_workload) "
                               "(DCGM_FI_DEV_GPU_UTIL{karta_workload!=''})", WORKLOAD_KEY)
        assert util.keys() == expected.gpu_util.keys(), base
        for k, v in expected.gpu_util.items():
            assert close(util[k], v), (base, k, util[k], v)
        # DCGM series name the GPU's pod through exported_*; karta_namespace is its namespace,
        # while namespace stays the exporter's
        dcgm = await query(base, 'DCGM_FI_DEV_GPU_UTIL{exported_pod!="", karta_workload!=""}')
        assert dcgm and all(r["metric"]["karta_namespace"] == r["metric"]["exported_namespace"]
                            and r["metric"]["namespace"] == "gpu-monitoring" for r in dcgm)

    # -- nothing lost, added or merged: the enriched series minus karta_* labels are
    # exactly the direct path's series, and sample counts match ------------------------
    every = '{__name__=~".+"}'
    got = await series_set(enriched.base_url, every, start, end)
    want = await series_set(direct.base_url, every, start, end)
    assert len(got) == len(want)
    assert {strip_karta(s) for s in got} == want
    # unattributed series pass unchanged: those without karta labels are the direct path's
    # series of unattributed pods and of no pod at all
    plain = {s for s in got if not any(k.startswith(KARTA) for k, _ in s)}
    for s in plain:
        d = dict(s)
        if d["__name__"].startswith("DCGM_") and not d.get("exported_pod"):
            continue  # an idle GPU: only the exporter's own pod labels, left unattributed
        pod = (d.get("exported_namespace") or d.get("namespace", ""),
               d.get("exported_pod") or d.get("pod", ""))
        assert not pod[1] or pod in expected.unattributed_pods, d
    # idle GPUs reach the TSDB unchanged, charged to no workload (not to the exporter)
    idle = [g for g in exporter.model.gpus if not g.holder]
    assert idle, "the demo snapshot has idle GPUs"
    got_idle = await query(enriched.base_url,
                           'DCGM_FI_DEV_GPU_UTIL{exported_pod="", karta_workload=""}')
    assert len(got_idle) == len(idle)
    assert plain <= want
    # every raw sample, series by series: the same values at the same timestamps, up to
    # two scrape intervals before the agent was told to stop. Each of the agent's three
    # queues reads the WAL on its own, and on shutdown Prometheus sends what each queue
    # has read: the last scrape can reach one receiver and not another (seen once in
    # CI: the direct Prometheus had a last sample the proxy's queue never sent)
    at = time.time()
    settled = stopping - 2.0
    want_samples = await raw_samples(direct.base_url, every, at, until=settled)
    assert sum(len(v) for v in want_samples.values()) > 0
    got_samples = await raw_samples(enriched.base_url, every, at, until=settled)
    assert {strip_karta(k): v for k, v in got_samples.items()} == want_samples
    # VictoriaMetrics stores floats as decimals (about 12 significant digits)
    vm_samples = {strip_karta(k): v
                  for k, v in (await raw_samples(vm.base_url, every, at, until=settled)).items()}
    assert vm_samples.keys() == want_samples.keys()
    for series, want_v in want_samples.items():
        got_v = vm_samples[series]
        assert [t for t, _ in got_v] == [t for t, _ in want_v], dict(series)
        assert all(close(float(a), float(b), 1e-11) for (_, a), (_, b) in zip(got_v, want_v,
                                                                            strict=True))

    # the proxy counted what it saw
    m = to_prom.proxy.metrics.registry
    assert (m.get_sample_value("karta_proxy_series_attributed_total") or 0) > 0
    assert m.get_sample_value("karta_proxy_requests_total",
                              {"path": "/api/v1/write", "protocol": "v1", "code": "204"})


async def raw_samples(base: str, match: str, at: float, *, until: float | None = None,
                      ) -> dict[frozenset[tuple[str, str]], list[tuple[float, str]]]:
    """Every stored sample of the last 10 minutes, per series (a range-vector query);
    ``until``: only those stamped at or before it (a series with none left is left out)."""
    out = {}
    for r in await query(base, f"{match}[10m]", at):
        kept = [(float(t), v) for t, v in r["values"] if until is None or float(t) <= until]
        if kept:
            out[frozenset(r["metric"].items())] = kept
    return out


async def _true_after(exp: FixtureExporter, route: str, n: int) -> bool:
    return exp.scrapes[route] >= n


async def test_a_request_spliced_in_parts_is_stored_whole(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """A big RW 1.0 request alone in the worker pool goes out as one snappy block joined
    from parts compressed apart (``handler.splice_in_parts``): Prometheus' and
    VictoriaMetrics' own (Go) snappy decoders read it, and every series lands, stamped."""
    prom = await peers.prometheus_receiver()
    vm = await peers.victoria_metrics()
    pod = next(p for p in exporter.model.pods if p.containers)
    n = 3000
    at = int(time.time() * 1000)
    req = WriteRequest()
    for i in range(n):
        ts = req.timeseries.add()
        for k, v in sorted({"__name__": "parts_probe", "namespace": pod.namespace,
                            "pod": pod.name, "id": f"/kubepods/{i:06d}/" + "c" * 120}.items()):
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=float(i), timestamp=at)
    raw: bytes = req.SerializeToString()
    assert len(raw) > 2 * PART_DECODED_BYTES
    for base in (prom.base_url, vm.base_url):
        proxy = await make_proxy(base + "/api/v1/write")
        if proxy.proxy.handler.workers < 2:
            pytest.skip("one usable core: no request is spliced in parts")
        await post_snappy(proxy.write_url, snappy.compress(raw))
    stamp = dict(exporter_stamp(proxy.proxy, pod.namespace, pod.name))
    assert stamp
    workload = stamp["karta_workload"]
    await stored_whole(prom.base_url, vm, "parts_probe", workload, n, at)


async def test_sender_blocks_of_every_shape_are_stored_whole(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """The upstream's snappy block is made from the sender's (``_snappy_edit.c``): a
    sender block of every element shape (long literals, copy-1/2/4, overlapping copies,
    sources over 64 KiB back) comes out as a block whose copies reach as far, and
    Prometheus' and VictoriaMetrics' own (Go) decoders read it: every series lands,
    stamped, with its value."""
    prom = await peers.prometheus_receiver()
    vm = await peers.victoria_metrics()
    pod = next(p for p in exporter.model.pods if p.containers)
    n = 3000
    at = int(time.time() * 1000)
    rnd = random.Random(5)
    ids = [f"/kubepods/burstable/pod{rnd.getrandbits(128):032x}" for _ in range(n // 2)]
    req = WriteRequest()
    for i in range(n):
        ts = req.timeseries.add()
        # an id repeats ~100 KiB later (its series another): a copy-4 in the sender's block
        for k, v in sorted({"__name__": "shapes_probe", "namespace": pod.namespace,
                            "pod": pod.name, "id": ids[i % len(ids)],
                            "half": str(i // len(ids))}.items()):
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=float(i), timestamp=at)
    raw: bytes = req.SerializeToString()
    block = random_block(raw, rnd)
    assert element_kinds(block)["copy4"] > 100
    for base in (prom.base_url, vm.base_url):
        proxy = await make_proxy(base + "/api/v1/write")
        await post_snappy(proxy.write_url, block)
    workload = dict(exporter_stamp(proxy.proxy, pod.namespace, pod.name))["karta_workload"]
    await stored_whole(prom.base_url, vm, "shapes_probe", workload, n, at)


async def post_snappy(url: str, block: bytes) -> None:
    """One RW 1.0 write of a snappy block, answered 204."""
    async with aiohttp.ClientSession() as session, session.post(
            url, data=block, headers={"Content-Type": "application/x-protobuf",
                                      "Content-Encoding": "snappy"}) as resp:
        assert resp.status == 204, await resp.text()


async def stored_whole(prom_url: str, vm: Peer, metric: str, workload: str, n: int,
                       at: int) -> None:
    """``n`` series of ``metric``, values 0 .. n - 1 at ``at``, all stamped with
    ``workload``, in both the Prometheus receiver and VictoriaMetrics."""
    for base in (prom_url, vm.base_url):

        async def landed(base: str = base) -> bool:
            await vm_flush(vm)
            got = await query(base, f'count({metric}{{karta_workload="{workload}"}})',
                              at / 1000)
            return bool(got) and int(float(got[0]["value"][1])) == n

        await wait_until(landed, timeout=15, what=f"{n} stamped series at {base}")
        total = await query(base, f"sum({metric})", at / 1000)
        assert float(total[0]["value"][1]) == n * (n - 1) / 2


def exporter_stamp(proxy: Proxy, namespace: str, pod: str) -> tuple[tuple[str, str], ...]:
    return tuple(proxy.index.lookup(namespace.encode(), pod.encode()) or ())


async def test_a_scraped_application_cannot_name_another_namespaces_pod(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """A stock Prometheus agent (honor_labels: false) scrapes an application of web that
    exposes namespace/pod of an ml pod: Prometheus renames them exported_*, and the proxy
    stamps the series with the application's own pod (its target labels), not the ml pod's
    workload. A kube-state-metrics-shaped target's kube_pod_info, scraped the same way,
    still names the object's pod (the kube_ rule)."""
    ml_pod = "llm-finetune-raycluster-k7x2p-head-8jz5c"
    body = (f'app_gpu_seconds_total{{namespace="ml",pod="{ml_pod}"}} 1\n'
            f'kube_pod_info{{namespace="ml",pod="{ml_pod}",node="n1"}} 1\n')

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        rx = await peers.prometheus_receiver()
        to_rx = await make_proxy(rx.base_url + "/api/v1/write")
        common = {"scrape_interval": "1s", "scrape_timeout": "1s", "honor_labels": False,
                  "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                      "labels": {"namespace": "web", "pod": "postgres-0"}}]}
        await peers.prometheus_agent({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "app", **common}],
            "remote_write": [remote_write(to_rx.write_url)],
        })

        async def landed() -> bool:
            return len(await query(rx.base_url, '{__name__=~"app_gpu_seconds_total|'
                                                'kube_pod_info"}')) == 2

        await wait_until(landed, timeout=30, what="the application's two series")
        rows = {r["metric"]["__name__"]: r["metric"]
                for r in await query(rx.base_url,
                                     '{__name__=~"app_gpu_seconds_total|kube_pod_info"}')}
        forged = rows["app_gpu_seconds_total"]
        assert (forged["exported_namespace"], forged["exported_pod"]) == ("ml", ml_pod)
        assert (forged["karta_namespace"], forged["karta_workload"]) == ("web", "postgres")
        assert rows["kube_pod_info"]["karta_namespace"] == "ml"
    finally:
        await runner.cleanup()


async def test_a_sender_cannot_take_the_label_set_of_a_process_fact(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """A sender writes, through the proxy, the fact writer's very label sets of
    karta_contract_info and of the index's freshness, 10 minutes ahead. They carried no
    karta_* label, so the forged series was the writer's own: Prometheus refused each of
    its writes of it as out of order (the freshness read the forged value, every alert on
    it quiet, for as long). They now carry karta_writer, which the relay drops from what a
    sender writes: the forged series is stored beside the writer's, apart, and the
    writer's own lands on every write."""
    rx = await peers.prometheus_receiver()

    def facts_on(s: Any) -> None:
        s.facts.enabled = True
        s.facts.interval_seconds = 0.2
        s.facts.external_labels = {"cluster": "forged"}

    to_rx = await make_proxy(rx.base_url + "/api/v1/write", facts_on)
    writer = to_rx.proxy.facts
    assert isinstance(writer, FactWriter)
    now = time.time()
    ahead = int((now + 600) * 1000)
    writer_label = (contract.FACT_LABEL_WRITER, contract.WRITTEN_BY)
    req = WriteRequest()
    for name, label, value in (
        (contract.FACT_CONTRACT_INFO, ("version", contract.CONTRACT_VERSION), 1.0),
        (contract.FACT_SOURCE_LAST_CURRENT, ("resource", "snapshot"), 4e9),
    ):
        ts = req.timeseries.add()
        for k, v in sorted((("__name__", name), ("cluster", "forged"), writer_label, label)):
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=value, timestamp=ahead)
    await post_snappy(to_rx.write_url, snappy.compress(req.SerializeToString()))
    written = writer.writes_ok

    async def three_more() -> bool:
        return writer.writes_ok >= written + 3

    await wait_until(three_more, timeout=20, what="three fact writes after the forged samples")
    assert sample_value(writer.metrics.series_refused) == 0
    assert writer.writes_failed == 0
    at = time.time()
    own = await query(rx.base_url, 'karta_source_last_current_timestamp_seconds'
                                   '{cluster="forged",karta_writer="karta-proxy"}', at)
    assert [r["metric"]["resource"] for r in own] == ["snapshot"]
    assert now - 600 < float(own[0]["value"][1]) <= at  # the index's, not the forged 4e9
    assert await query(rx.base_url, 'karta_contract_info{cluster="forged",'
                                    'karta_writer="karta-proxy"}', at)
    # the sender's series are stored, not lost: under their own label sets
    later = await query(rx.base_url, '{cluster="forged",karta_writer=""}', now + 600)
    assert sorted(r["metric"]["__name__"] for r in later) == sorted(
        (contract.FACT_CONTRACT_INFO, contract.FACT_SOURCE_LAST_CURRENT))


def cluster_c1(s: Any) -> None:
    """A proxy of cluster c1 (the cluster check reads facts.external_labels)."""
    s.facts.external_labels = {"cluster": "c1"}


async def test_a_series_of_another_cluster_is_stored_unstamped(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cluster c1's proxy (facts.external_labels) gets two series of the same ml pod, one
    labelled cluster c1, one c2 (an agent of c2 pointed at c1's proxy): the Prometheus
    receiver and VictoriaMetrics store both, only c1's stamped; c2's is counted
    other_cluster and named in the warning, with the sender. Without the check c2's was
    stamped with c1's workload: attribution forged into c2."""
    caplog.set_level(logging.WARNING, logger="karta.handler")
    rx = await peers.prometheus_receiver()
    vm = await peers.victoria_metrics()

    to_rx = await make_proxy(rx.base_url + "/api/v1/write", cluster_c1)
    to_vm = await make_proxy(vm.base_url + "/api/v1/write", cluster_c1)
    ml_pod = "llm-finetune-raycluster-k7x2p-head-8jz5c"
    at = int(time.time() * 1000)
    req = WriteRequest()
    for cluster in ("c1", "c2"):
        ts = req.timeseries.add()
        for k, v in (("__name__", "gpu_seconds_total"), ("cluster", cluster),
                     ("namespace", "ml"), ("pod", ml_pod)):
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=1.0, timestamp=at)
    for proxy in (to_rx, to_vm):
        await post_snappy(proxy.write_url, snappy.compress(req.SerializeToString()))
    for base in (rx.base_url, vm.base_url):

        async def landed(base: str = base) -> bool:
            await vm_flush(vm)
            return len(await query(base, "gpu_seconds_total", at / 1000)) == 2

        await wait_until(landed, timeout=15, what=f"both series at {base}")
        rows = {r["metric"]["cluster"]: r["metric"]
                for r in await query(base, "gpu_seconds_total", at / 1000)}
        assert rows["c1"]["karta_namespace"] == "ml" and rows["c1"]["karta_workload"]
        assert rows["c2"] == {"__name__": "gpu_seconds_total", "cluster": "c2",
                              "namespace": "ml", "pod": ml_pod}
    for proxy in (to_rx, to_vm):
        p = proxy.proxy
        assert p.metrics.registry.get_sample_value(
            "karta_proxy_series_unattributed_total", {"reason": "other_cluster"}) == 1
        assert p.metrics.registry.get_sample_value("karta_proxy_series_attributed_total") == 1
    lines = [r.__dict__ for r in caplog.records if "another cluster" in r.getMessage()]
    assert [(x["label"], x["seen"], x["expected"], x["remote"]) for x in lines] == [
        ("cluster", "c2", "c1", "127.0.0.1")] * 2


async def test_an_extra_label_of_another_cluster_is_stored_unstamped(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """VictoriaMetrics sets ``?extra_label=cluster=...`` over the series' own label, the
    last of the URL as forwarded winning (upstream.url's, then the sender's): a sender's
    ``extra_label=cluster=c2`` through c1's proxy stored its series under c2 stamped with
    c1's workloads, unchecked and uncounted, the upstream URL stamping c1 or not. Now such
    a request is stored unstamped, counted other_cluster and named in a warning; one
    whose URL names c1 is stamped. The Prometheus receiver ignores the parameter: the
    series are stored under their own c1, unstamped all the same (docs/deploy.md)."""
    caplog.set_level(logging.WARNING, logger="karta.handler")
    vm = await peers.victoria_metrics()
    rx = await peers.prometheus_receiver()

    plain = await make_proxy(vm.base_url + "/api/v1/write", cluster_c1)
    url_c1 = await make_proxy(vm.base_url + "/api/v1/write?extra_label=cluster=c1",
                              cluster_c1)
    to_rx = await make_proxy(rx.base_url + "/api/v1/write", cluster_c1)
    ml_pod = "llm-finetune-raycluster-k7x2p-head-8jz5c"
    at = int(time.time() * 1000)
    cases = [  # name, proxy, the series' cluster, the sender's query, stored as, stamped
        ("no_label", plain, None, "?extra_label=cluster=c2", "c2", False),
        ("c1", plain, "c1", "?extra_label=cluster=c2", "c2", False),
        ("url_c1_sender_c2", url_c1, "c1", "?extra_label=cluster=c2", "c2", False),
        ("url_c1", url_c1, "c1", "", "c1", True),
        ("url_c1_no_label", url_c1, None, "", "c1", True),
        ("rx", to_rx, "c1", "?extra_label=cluster=c2", "c1", False),
    ]
    for name, proxy, cluster, sent_query, _, _ in cases:
        req = WriteRequest()
        ts = req.timeseries.add()
        labels = [("__name__", f"xl_{name}"), *([("cluster", cluster)] if cluster else []),
                  ("namespace", "ml"), ("pod", ml_pod)]
        for k, v in labels:
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=1.0, timestamp=at)
        await post_snappy(proxy.write_url + sent_query,
                          snappy.compress(req.SerializeToString()))
    for name, proxy, _, _, stored, stamped in cases:
        base = rx.base_url if proxy is to_rx else vm.base_url

        async def landed(base: str = base, name: str = name) -> bool:
            await vm_flush(vm)
            return len(await query(base, f"xl_{name}", at / 1000)) == 1

        await wait_until(landed, timeout=15, what=f"xl_{name}")
        (row,) = await query(base, f"xl_{name}", at / 1000)
        got = row["metric"]
        assert got["cluster"] == stored, name
        assert (got.get("karta_workload"), got.get("karta_namespace")) == (
            ("llm-finetune", "ml") if stamped else (None, None)), name
    counted = [p.proxy.metrics.registry.get_sample_value(
        "karta_proxy_series_unattributed_total", {"reason": "other_cluster"})
        for p in (plain, url_c1, to_rx)]
    assert counted == [2, 1, 1]
    lines = [r.__dict__ for r in caplog.records if "another cluster" in r.getMessage()]
    assert [(x["seen"], x["source"]) for x in lines if "count" not in x] == [
        ("c2", "extra_label=cluster=c2 in the sender's URL")] * 3
