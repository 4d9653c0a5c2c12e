"""vmagent (Debian 1.79, sends snappy RW 1.0) as the sender through karta-proxy: tenant and
auth headers reach the upstream; series land enriched in VictoriaMetrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from proxy.demo_exporter import FixtureExporter
from proxy.sender import decode_v1
from tests.peers.conftest import (
    WORKLOAD_KEY,
    InProcessProxy,
    Peers,
    close,
    expected_by_workload,
    query,
    scalar_by,
    scrape_configs,
    vm_flush,
    wait_until,
)
from tests.scripted import ScriptedUpstream

pytestmark = pytest.mark.peers


async def test_vmagent_headers_reach_the_upstream(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    async with ScriptedUpstream() as capture:
        proxy = await make_proxy(capture.url)
        await peers.vmagent(
            {"scrape_configs": scrape_configs(exporter)}, proxy.write_url,
            extra=["-remoteWrite.headers=X-Scope-OrgID: team-a^^Authorization: Bearer tok-1"
                   "^^THANOS-TENANT: tenant-b^^X-Private: nope"],
        )

        async def arrived() -> bool:
            return any(r.body for r in capture.received)

        await wait_until(arrived, timeout=30, what="vmagent's first request upstream")
    rec = next(r for r in capture.received if r.body)
    assert rec.headers["X-Scope-OrgID"] == "team-a"
    assert rec.headers["Authorization"] == "Bearer tok-1"
    assert rec.headers["THANOS-TENANT"] == "tenant-b"
    assert "X-Private" not in rec.headers  # not in forward_headers
    assert rec.headers["Content-Encoding"] == "snappy"
    assert "vmagent" in rec.headers.get("User-Agent", "")
    enriched = [s for r in capture.received if r.body for s in decode_v1(r.raw)
                if "karta_workload" in s.labels]
    assert enriched, "vmagent's series were enriched"


async def test_vmagent_through_proxy_into_victoria_metrics(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    vm = await peers.victoria_metrics()
    proxy = await make_proxy(vm.base_url + "/api/v1/write")
    await peers.vmagent({"scrape_configs": scrape_configs(exporter)}, proxy.write_url)
    expected = expected_by_workload(exporter, proxy.proxy)

    async def landed() -> bool:
        await vm_flush(vm)
        pods = await query(vm.base_url, "count(pod_memory_working_set_bytes)")
        gpus = await query(vm.base_url, "count(DCGM_FI_DEV_GPU_UTIL)")
        return (bool(pods) and int(float(pods[0]["value"][1])) == len(exporter.model.pods)
                and bool(gpus) and int(float(gpus[0]["value"][1])) == len(exporter.model.gpus))

    await wait_until(landed, timeout=30, what="pod series in VictoriaMetrics")
    mem = await scalar_by(vm.base_url, "sum by (karta_namespace, karta_kind, karta_workload) "
                          "(pod_memory_working_set_bytes{karta_workload!=''})", WORKLOAD_KEY)
    assert mem.keys() == expected.memory.keys()
    assert all(close(mem[k], v) for k, v in expected.memory.items())
    util = await scalar_by(vm.base_url, "sum by (karta_namespace, karta_kind, karta_workload) "
                           "(DCGM_FI_DEV_GPU_UTIL{karta_workload!=''})", WORKLOAD_KEY)
    assert util.keys() == expected.gpu_util.keys()
    assert all(close(util[k], v) for k, v in expected.gpu_util.items())
    # unattributed pods' series arrive without karta labels, unchanged
    plain = await query(vm.base_url, "pod_memory_working_set_bytes{karta_workload=''}")
    assert {(r["metric"]["namespace"], r["metric"]["pod"]) for r in plain} == \
        expected.unattributed_pods


async def test_vmagent_on_a_vminsert_tenant_path_reaches_the_same_tenant_upstream(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # a VictoriaMetrics cluster user points vmagent at the proxy as at vminsert
    async with ScriptedUpstream() as vminsert:
        base = vminsert.url.removesuffix("/api/v1/write")
        proxy = await make_proxy(base + "/insert/0/prometheus/api/v1/write")
        await peers.vmagent({"scrape_configs": scrape_configs(exporter)},
                            proxy.url + "/insert/42:7/prometheus/api/v1/write")

        async def arrived() -> bool:
            return any(r.body for r in vminsert.received)

        await wait_until(arrived, timeout=30, what="vmagent's first request upstream")
    paths = {r.path for r in vminsert.received if r.body}
    assert paths == {"/insert/42:7/prometheus/api/v1/write"}
    enriched = [s for r in vminsert.received if r.body for s in decode_v1(r.raw)
                if "karta_workload" in s.labels]
    assert enriched
