"""End to end through a live (simulated) cluster: the proxy as ``proxy.runtime`` assembles it,
watching the Kubernetes API simulator, forwarding what the project's sender sends into a
real Prometheus receiver, queried with PromQL.

Scenarios: a Deployment's pods attributed in the TSDB; pods created while running are
attributed in forwarded series (the latency from ``sim.create`` to the first enriched
sample is measured and printed, bounded generously, never timed tightly); a deleted pod's
late samples keep their labels; an API-server outage keeps forwarding with the last
index while readiness stays green and the freshness fact ages; readiness before the
initial sync.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Settings
from proxy.runtime import Proxy
from proxy.sender import Series, send_series
from tests.kube.conftest import deployment
from tests.kube.conftest import owner as owner_refs
from tests.kube.conftest import pod as pod_object
from tests.kubesim import KubeSim
from tests.kubesim.resources import NAMESPACE, POD, REPLICA_SET
from tests.peers.conftest import Peer, Peers, query, wait_until
from tests.peers.conftest import peers as peers  # the shared fixture, reused

pytestmark = pytest.mark.peers

NS = "shop"
APP = "web"
PROBE = "e2e_probe"
LIVE_PODS = 50
#: generous: attribution normally takes milliseconds; this only catches "never"
LATENCY_BOUND_SECONDS = 10.0
STAMPED = {"karta_namespace": NS, "karta_group": "apps", "karta_kind": "Deployment",
           "karta_workload": APP, "karta_component": "deployment"}

Obj = dict[str, Any]


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    s = KubeSim(bookmark_interval=0.2, max_watch_seconds=5.0)
    yield s
    await s.close()


def kube_settings(sim: KubeSim, upstream_url: str) -> Settings:
    s = Settings()
    s.kube.kubeconfig = str(sim.write_kubeconfig())
    s.kube.resync_backoff_max_seconds = 0.5
    s.upstream.url = upstream_url
    s.upstream.timeout_seconds = 5.0
    s.upstream.connect_timeout_seconds = 2.0
    s.server.listen_address = "127.0.0.1:0"
    s.facts.interval_seconds = 0.5
    return s


async def start_proxy(settings: Settings, timeout: float = 15.0) -> Proxy:
    """A proxy started on ``settings``; stopped again when its start fails or outlasts
    ``timeout``, so no task of it outlives the test."""
    p = Proxy(settings)
    try:
        await asyncio.wait_for(p.start(), timeout)
    except BaseException:
        await p.stop()
        raise
    return p


def probe(pod: str, value: float = 1.0, ts_ms: int | None = None) -> Series:
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    return Series({"__name__": PROBE, "namespace": NS, "pod": pod}, [(ts, value)])


async def send(session: aiohttp.ClientSession, proxy: Proxy, series: Sequence[Series]) -> int:
    status, _, _ = await send_series(f"http://127.0.0.1:{proxy.port}/api/v1/write",
                                     list(series), session=session, timeout=10)
    return status


async def get(session: aiohttp.ClientSession, proxy: Proxy, path: str) -> tuple[int, str]:
    async with session.get(f"http://127.0.0.1:{proxy.port}{path}") as r:
        return r.status, await r.text()


async def probe_labels(tsdb: Peer, pod: str) -> list[dict[str, str]]:
    return [r["metric"] for r in await query(tsdb.base_url, f'{PROBE}{{pod="{pod}"}}')]


def stamped(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith("karta_")}


def families(text: str) -> dict[str, Any]:
    """Parse /metrics; a family served twice is an error (a scrape would reject it)."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"/metrics serves {fam.name} twice"
        out[fam.name] = fam
    return out


def sample(fams: dict[str, Any], name: str, **labels: str) -> float:
    family = name.removesuffix("_total")
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def test_live_cluster_through_the_proxy_into_prometheus(
    peers: Peers, sim: KubeSim
) -> None:
    _, rs, pods = deployment(sim, APP, NS, replicas=3)
    await sim.start()
    tsdb = await peers.prometheus_receiver()
    proxy = await start_proxy(kube_settings(sim, tsdb.base_url + "/api/v1/write"))
    try:
        async with aiohttp.ClientSession() as session:
            await _deployment_pods_attributed(session, proxy, tsdb, pods)
            await _live_pods_attributed_fast(session, proxy, tsdb, sim, rs)
            await _deleted_pod_keeps_labels(session, proxy, tsdb, sim)
            await _outage_keeps_forwarding(session, proxy, tsdb, sim, rs)
    finally:
        await proxy.stop()


async def _deployment_pods_attributed(session: aiohttp.ClientSession, proxy: Proxy,
                                      tsdb: Peer, pods: list[Obj]) -> None:
    names = [p["metadata"]["name"] for p in pods]
    assert await send(session, proxy, [probe(n) for n in names]) == 204
    for n in names:
        (labels,) = await probe_labels(tsdb, n)
        assert stamped(labels) == STAMPED, labels
        assert labels["namespace"] == NS and labels["pod"] == n

    # the fact writer shares the upstream: the workload's facts land beside its series
    async def facts_landed() -> bool:
        got = await query(tsdb.base_url, f'karta_workload_info{{karta_workload="{APP}"}}')
        return bool(got)

    await wait_until(facts_landed, timeout=10, what="fact series in the TSDB")


async def _live_pods_attributed_fast(session: aiohttp.ClientSession, proxy: Proxy, tsdb: Peer,
                                     sim: KubeSim, rs: Obj) -> None:
    """Create pods while a sender keeps naming them; the TSDB tells when each pod's
    series first arrived enriched. Sender, proxy and simulator share this event loop,
    so the figures include their contention (an upper bound of the proxy's share)."""
    names = [f"{APP}-live-{i}" for i in range(LIVE_PODS)]
    created: dict[str, float] = {}
    stop = asyncio.Event()
    sends = 0

    async def sender() -> None:
        nonlocal sends
        last = 0
        while not stop.is_set():
            now = max(int(time.time() * 1000), last + 1)  # strictly increasing per series
            last = now
            batch = [probe(n, ts_ms=now) for n in names if n in created]
            if batch:
                assert await send(session, proxy, batch) == 204
                sends += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(sender())
    try:
        for n in names:
            obj = pod_object(n, NS, owner_obj=rs, labels={"app": APP})
            created[n] = time.time()
            sim.create(obj)
            await asyncio.sleep(0.03)
        deadline = time.monotonic() + LATENCY_BOUND_SECONDS
        while not all(proxy.index.lookup(NS.encode(), n.encode()) for n in names):
            assert time.monotonic() < deadline, "live pods not attributed"
            await asyncio.sleep(0.02)
        # a few enriched sends of the last pod: two sends more, the second begun after its
        # attribution (counted, not slept for: a send of a loaded machine may take longer
        # than a fixed sleep, and the last pod then had no enriched sample)
        target = sends + 2
        while sends < target:
            assert time.monotonic() < deadline + 10, "no sends after the attribution"
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

    rows = await query(tsdb.base_url, f'{PROBE}{{karta_workload="{APP}",pod=~"{APP}-live-.*"}}[5m]')
    first: dict[str, float] = {}
    for r in rows:
        assert stamped(r["metric"]) == STAMPED, r["metric"]
        first[r["metric"]["pod"]] = min(float(t) for t, _ in r["values"])
    assert set(first) == set(names), set(names) - set(first)
    # sample timestamps are whole milliseconds: compare with the creation's millisecond
    latency = [first[n] - int(created[n] * 1000) / 1000 for n in names]
    assert all(0 <= x < LATENCY_BOUND_SECONDS for x in latency), latency
    print(f"\nattribution latency, sim.create -> first enriched forward ({LIVE_PODS} pods): "
          f"p50 {statistics.median(latency) * 1000:.0f} ms, "
          f"p99 {percentile(latency, 0.99) * 1000:.0f} ms, max {max(latency) * 1000:.0f} ms")


async def _deleted_pod_keeps_labels(session: aiohttp.ClientSession, proxy: Proxy, tsdb: Peer,
                                    sim: KubeSim) -> None:
    gone = f"{APP}-live-0"
    obj = sim.get("v1", "Pod", gone, NS)
    uid = obj["metadata"]["uid"]
    sim.delete(obj)
    deadline = time.monotonic() + 5
    while uid in proxy.index.pods:
        assert time.monotonic() < deadline, "pod deletion not seen"
        await asyncio.sleep(0.02)
    assert proxy.index.tombstones() >= 1
    late = Series({"__name__": f"{PROBE}_late", "namespace": NS, "pod": gone},
                  [(int(time.time() * 1000), 7.0)])
    assert await send(session, proxy, [late]) == 204
    (row,) = await query(tsdb.base_url, f'{PROBE}_late{{pod="{gone}"}}')
    assert stamped(row["metric"]) == STAMPED


async def _outage_keeps_forwarding(session: aiohttp.ClientSession, proxy: Proxy, tsdb: Peer,
                                   sim: KubeSim, rs: Obj) -> None:
    before = families((await get(session, proxy, "/metrics"))[1])
    assert sample(before, "karta_proxy_index_stale") == 0
    assert time.time() - sample(before, "karta_source_last_current_timestamp_seconds",
                                resource="pods") < 2

    await sim.stop()
    t_down = time.time()
    deadline = time.monotonic() + 5
    while not proxy.index.stale:
        assert time.monotonic() < deadline, "outage not noticed"
        await asyncio.sleep(0.02)
    # a pod appears while the proxy cannot see it: picked up after the outage
    sim.create(pod_object(f"{APP}-during-outage", NS, owner_obj=rs, labels={"app": APP}))
    await asyncio.sleep(1.5)

    status, text = await get(session, proxy, "/-/ready")
    assert status == 200 and "stale" in text
    survivor = f"{APP}-live-1"
    assert await send(session, proxy, [probe(survivor, 2.0)]) == 204
    rows = await query(tsdb.base_url, f'{PROBE}{{pod="{survivor}"}} == 2')
    assert [stamped(r["metric"]) for r in rows] == [STAMPED]

    during = families((await get(session, proxy, "/metrics"))[1])
    assert sample(during, "karta_proxy_index_stale") == 1
    age = time.time() - sample(during, "karta_source_last_current_timestamp_seconds",
                               resource="pods")
    assert age >= time.time() - t_down - 0.5 and age >= 1.0, age
    assert sample(during, "karta_proxy_index_ready") == 1

    # the written fact ages in the TSDB too (the writer keeps writing through the outage)
    async def fact_aged() -> bool:
        got = await query(tsdb.base_url, 'time() - karta_source_last_current_timestamp_seconds'
                          '{resource="pods"}')
        return bool(got) and float(got[0]["value"][1]) >= 1.0

    await wait_until(fact_aged, timeout=15, what="an aged freshness fact in the TSDB")

    await sim.start()
    deadline = time.monotonic() + 10
    while proxy.index.stale or not proxy.index.lookup(NS.encode(), f"{APP}-during-outage".encode()):
        assert time.monotonic() < deadline, "not current again after the outage"
        await asyncio.sleep(0.05)
    after = families((await get(session, proxy, "/metrics"))[1])
    assert sample(after, "karta_proxy_index_stale") == 0
    assert time.time() - sample(after, "karta_source_last_current_timestamp_seconds",
                                resource="pods") < 2


async def test_readiness_before_the_initial_sync(peers: Peers, sim: KubeSim) -> None:
    """API server away at start: 503 (and writes refused with Retry-After) until the first
    sync, unless forward_before_ready, which is ready at once and forwards unenriched."""
    _, _, pods = deployment(sim, APP, NS, replicas=1)
    name = pods[0]["metadata"]["name"]
    tsdb = await peers.prometheus_receiver()
    strict = Proxy(kube_settings(sim, tsdb.base_url + "/api/v1/write"))
    eager_settings = kube_settings(sim, tsdb.base_url + "/api/v1/write")
    eager_settings.server.forward_before_ready = True
    eager = Proxy(eager_settings)
    starts = [asyncio.create_task(p.start()) for p in (strict, eager)]
    try:
        deadline = time.monotonic() + 10
        while not (strict.port and eager.port):
            assert time.monotonic() < deadline, "not listening"
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            assert (await get(session, strict, "/-/healthy"))[0] == 200
            assert (await get(session, strict, "/-/ready"))[0] == 503
            status, text = await get(session, eager, "/-/ready")
            assert status == 200 and "unenriched" in text
            assert await send(session, strict, [probe(name, 1.0)]) == 503
            assert await send(session, eager, [probe(name, 1.0)]) == 204
            (labels,) = await probe_labels(tsdb, name)
            assert stamped(labels) == {}

            await sim.start()
            await asyncio.wait_for(asyncio.gather(*starts), 15)
            for p in (strict, eager):
                assert (await get(session, p, "/-/ready")) == (200, "ready\n")
            assert await send(session, strict, [probe(name, 2.0)]) == 204
            rows = await query(tsdb.base_url, f'{PROBE}{{pod="{name}"}} == 2')
            assert [stamped(r["metric"]) for r in rows] == [STAMPED]
    finally:
        for t in starts:
            t.cancel()
        await asyncio.gather(*starts, return_exceptions=True)
        for p in (strict, eager):
            await p.stop()


async def test_forward_before_ready_stamps_nothing_from_a_half_listed_cluster(
        peers: Peers, sim: KubeSim) -> None:
    """Pods are listed before their ReplicaSets: a write relayed meanwhile
    (forward_before_ready) is forwarded unstamped, where it was stamped from the pods
    already indexed, each named a workload of kind ReplicaSet (the owner not listed yet),
    then Deployment once ready: two label sets for every series over a start (an audit:
    6.9 s of them). The sender's karta_* labels are dropped as ever."""
    _, _, pods = deployment(sim, APP, NS, replicas=1)
    name = pods[0]["metadata"]["name"]
    await sim.start()
    sim.delay_resource(REPLICA_SET, 2.0)
    tsdb = await peers.prometheus_receiver()
    settings = kube_settings(sim, tsdb.base_url + "/api/v1/write")
    settings.server.forward_before_ready = True
    eager = Proxy(settings)
    start = asyncio.create_task(eager.start())
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 10
            while not eager.port or eager.index.uid_of(NS, name) is None:
                assert time.monotonic() < deadline, "the pod was never indexed"
                assert not start.done(), "ready before the ReplicaSets were listed"
                await asyncio.sleep(0.01)
            assert not eager.index.ready
            forged = probe(name, 1.0)
            forged.labels["karta_workload"] = "forged"
            assert await send(session, eager, [forged]) == 204
            (labels,) = await probe_labels(tsdb, name)
            assert stamped(labels) == {}
            # nor a scrape of it: no fact of a ReplicaSet "workload" (nor any fact)
            status, page = await get(session, eager, "/metrics")
            assert status == 200 and "karta_workload_info{" not in page
            assert (await get(session, eager, f"/api/v1/attribution?namespace={NS}&pod={name}")
                    )[0] == 503

            await asyncio.wait_for(start, 15)
            assert await send(session, eager, [probe(name, 2.0)]) == 204
            rows = await query(tsdb.base_url, f'{PROBE}{{pod="{name}"}} == 2')
            assert [stamped(r["metric"]) for r in rows] == [STAMPED]
    finally:
        sim.delay_resource(REPLICA_SET, None)
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await eager.stop()


async def test_a_rollout_while_the_replicaset_watch_fails_is_never_a_replicaset(
        peers: Peers, sim: KubeSim) -> None:
    """The audit's shape: the ReplicaSet watch fails (500) while a Deployment rolls out
    three new pods. A sender names every pod the proxy knows, every 0.2 s. Each new pod's
    series is stamped ``Deployment/web`` from its first request: one label set per pod in
    the TSDB, and no ``ReplicaSet`` workload in the facts (it was two label sets per new
    pod, and ``karta_workload_info`` of a made-up ``ReplicaSet/web-2``)."""
    dep, _, _ = deployment(sim, APP, NS, replicas=3, rev="1")
    await sim.start()
    tsdb = await peers.prometheus_receiver()
    settings = kube_settings(sim, tsdb.base_url + "/api/v1/write")
    proxy = await start_proxy(settings)
    t0 = time.time()
    sending = True

    async def sender(session: aiohttp.ClientSession) -> None:
        for _ in range(200):
            if not sending:
                return
            known = [p["metadata"]["name"] for p in sim.objects(POD)
                     if proxy.index.answer(NS.encode(), p["metadata"]["name"].encode())
                     is not None]
            if known:
                assert await send(session, proxy, [probe(n) for n in known]) == 204
            await asyncio.sleep(0.2)

    try:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(sender(session))
            await asyncio.sleep(0.5)
            sim.fail_resource(REPLICA_SET, 500, collections_only=True)
            sim.disconnect_watches()
            rs2 = sim.create({
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{APP}-2", "namespace": NS,
                             "ownerReferences": owner_refs(dep), "labels": {"app": APP}},
                "spec": {"replicas": 3}})
            for i in range(3):
                sim.create(pod_object(f"{APP}-2-{i}", NS, owner_obj=rs2,
                                      labels={"app": APP}))
                await asyncio.sleep(0.4)
                sim.delete(sim.get("v1", "Pod", f"{APP}-1-{i}", NS))
            await asyncio.sleep(1.5)
            sim.fail_resource(REPLICA_SET, None)
            await asyncio.sleep(1.5)
            sending = False
            await task
        t1 = time.time()
        for i in range(3):
            rows = await series(tsdb, f'{PROBE}{{pod="{APP}-2-{i}"}}', t0, t1 + 1)
            assert [stamped(r) for r in rows] == [STAMPED], rows
        kinds = {(r["karta_kind"], r["karta_workload"])
                 for r in await series(tsdb, '{__name__=~"karta_.+",karta_kind!=""}',
                                       t0, t1 + 1)}
        assert kinds == {("Deployment", APP)}, kinds
    finally:
        await proxy.stop()


async def series(tsdb: Peer, match: str, start: float, end: float) -> list[dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.get(
            tsdb.base_url + "/api/v1/series",
            params={"match[]": match, "start": str(start), "end": str(end)}) as r:
        data: list[dict[str, str]] = (await r.json())["data"]
        return data


ALERTS = Path(__file__).resolve().parents[1] / "config" / "rules" / "karta-proxy.alerts.yaml"


def alert_expr(name: str) -> str:
    """A shipped alert's expression, as the rules file has it."""
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return str(rule["expr"])
    raise AssertionError(f"no alert {name}")


@pytest.mark.parametrize("case", ["one name", "own names", "one name, B refused"])
async def test_two_clusters_under_one_name_are_told_by_their_uids(
        peers: Peers, case: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two clusters (two simulators, each its own kube-system uid) whose proxies write
    facts into one Prometheus: both named `same`, the shipped KartaClusterNameShared
    expression over what was stored finds two uids under it; named apart, nothing. B's
    service account refused the kube-system read: its facts are written all the same,
    without the label, B is ready, and one warning names the permission (the alert then
    cannot see B: documented, docs/deploy.md)."""
    names = {"one name": ("same", "same"), "own names": ("c-a", "c-b"),
             "one name, B refused": ("same", "same")}[case]
    tsdb = await peers.prometheus_receiver()
    sims = [KubeSim(bookmark_interval=0.2, max_watch_seconds=5.0, kube_system_uid=uid)
            for uid in ("uid-cluster-a", "uid-cluster-b")]
    proxies: list[Proxy] = []
    try:
        for sim, app in zip(sims, ("app-a", "app-b"), strict=True):
            deployment(sim, app, NS, replicas=1)
            await sim.start()
        if case == "one name, B refused":
            sims[1].fail_resource(NAMESPACE, 403)
        for sim, name in zip(sims, names, strict=True):
            s = kube_settings(sim, tsdb.base_url + "/api/v1/write")
            s.facts.external_labels = {"cluster": name}
            proxies.append(await start_proxy(s))
        want = {("same" if names[0] == names[1] else n, app)
                for n, app in zip(names, ("app-a", "app-b"), strict=True)}

        async def both_written() -> bool:
            rows = await query(tsdb.base_url, "karta_workload_info")
            return {(r["metric"]["cluster"], r["metric"]["karta_workload"])
                    for r in rows} == want

        await wait_until(both_written, timeout=20, what="both clusters' workload facts")
        uids = {"one name": {"uid-cluster-a", "uid-cluster-b"},
                "own names": {"uid-cluster-a", "uid-cluster-b"},
                "one name, B refused": {"uid-cluster-a", ""}}[case]

        async def contract_infos() -> bool:
            rows = await query(tsdb.base_url, 'karta_contract_info{karta_writer!=""}')
            return {r["metric"].get("karta_cluster_uid", "") for r in rows} == uids

        await wait_until(contract_infos, timeout=20, what=f"karta_contract_info with uids {uids}")
        shared = await query(tsdb.base_url, alert_expr("KartaClusterNameShared"))
        if case == "one name":
            assert [(r["metric"], r["value"][1]) for r in shared] == [({"cluster": "same"}, "2")]
        else:
            assert shared == []
        if case == "one name, B refused":
            async with aiohttp.ClientSession() as session:
                assert (await get(session, proxies[1], "/-/ready"))[0] == 200
            assert proxies[1].cluster_identity is not None
            assert proxies[1].cluster_identity.uid == ""
            assert proxies[1].cluster_identity.failures >= 1
            refused = [r.getMessage() for r in caplog.records
                       if r.name == "proxy.kube.cluster_identity"
                       and r.levelno >= logging.WARNING]
            assert len(refused) == 1 and "forbidden (403)" in refused[0]
            assert "get on namespaces" in refused[0]
    finally:
        for p in proxies:
            await p.stop()
        for sim in sims:
            await sim.close()
