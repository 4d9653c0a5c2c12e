"""KubeSource end to end: simulator -> kubernetes-asyncio -> watchers -> engine -> index.

The watch protocol through the source (lists, watches, 410, disconnects, outages). The
reconcile, mode-switch and tombstone logic alone, without timing: test_source_reconcile.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from datetime import datetime

import pytest
from prometheus_client import CollectorRegistry

from proxy import contract, memory
from proxy.config import KubeSettings
from proxy.facts.model import process_facts
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.karta.model import GroupKind
from proxy.kube import source as source_module
from proxy.kube.source import POD, KubeSource
from tests.karta.descriptions import JOBSET_KARTA, RAYCLUSTER_KARTA, RAYJOB_KARTA
from tests.kube.conftest import (
    SourceFactory,
    deployment,
    eventually,
    labels,
    metric,
    owner,
    pod,
)
from tests.kubesim import KubeSim
from tests.kubesim.resources import (
    DEPLOYMENT,
    JOB_SET,
    RAY_CLUSTER,
    RAY_JOB,
    REPLICA_SET,
    RESOURCE_INTERFACE,
)
from tests.kubesim.resources import POD as POD_TYPE


def _has(source: KubeSource, name: str, ns: str = "default") -> Callable[[], object]:
    return lambda: labels(source, ns, name)


def rayjob(sim: KubeSim, name: str = "train", ns: str = "ml") -> list[str]:
    """A RayJob, the RayCluster it creates, a head and two workers; returns pod names."""
    job = sim.create({
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name, "namespace": ns},
        "spec": {"rayClusterSpec": {"headGroupSpec": {"template": {}},
                                    "workerGroupSpecs": [{"groupName": "gpu", "template": {}}]}},
        "status": {"jobStatus": "RUNNING"},
    })
    cluster = sim.create({
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": f"{name}-rc", "namespace": ns, "ownerReferences": owner(job)},
    })
    names = [f"{name}-head", f"{name}-gpu-0", f"{name}-gpu-1"]
    sim.create(pod(names[0], ns, owner_obj=cluster, labels={"ray.io/node-type": "head"}))
    for n in names[1:]:
        sim.create(pod(n, ns, owner_obj=cluster,
                       labels={"ray.io/node-type": "worker", "ray.io/group": "gpu"}))
    return names


async def test_initial_list_fills_index_and_metrics(sim: KubeSim,
                                                    make_source: SourceFactory) -> None:
    deployment(sim, "web", replicas=3)
    source = await make_source()
    assert source.index.ready and not source.index.stale
    got = labels(source, "default", "web-1-0")
    assert got is not None
    assert got["karta_workload"] == "web" and got["karta_kind"] == "Deployment"
    assert got["karta_namespace"] == "default"
    assert time.time() - source.index.freshness["pods"] < 5
    assert len(source.index.pods) == 3
    reg = source.registry
    assert reg.get_sample_value("karta_proxy_watch_last_current_timestamp_seconds",
                                {"resource": "pods"}) is not None
    # owners of pod chains are read metadata-only, described kinds in full
    accepts = {(path, accept) for _, path, q, accept in sim.requests if "watch" not in q}
    assert ("/apis/apps/v1/replicasets", "application/json") in accepts or any(
        "PartialObjectMetadataList" in a for p, a in accepts if p.endswith("replicasets"))


async def test_the_initial_sync_never_collects_the_whole_heap(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The sync freezes what it builds as it goes; its end collected the whole heap once
    (``memory.settle``: unfrozen, then one full pass: 0.27-0.57 s with the event loop
    held at 37.5k pods, and the listener open). Now every collection it makes walks only
    what is not frozen; what is garbage is still collected before each freeze."""
    from tests.garbage import cycle, whole_heap_collections

    deployment(sim, "web", replicas=3)
    with whole_heap_collections() as whole:
        gone = cycle()
        source = await make_source()
        assert source.index.ready and len(source.index.pods) == 3
        assert gone() is None, "a cycle already garbage was frozen"
    assert whole == [], whole


async def test_new_pod_attributed_within_a_second(sim: KubeSim,
                                                  make_source: SourceFactory) -> None:
    _, rs, _ = deployment(sim, "api", replicas=1)
    source = await make_source()
    sim.create(pod("api-1-new", owner_obj=rs))
    took = await eventually(lambda: labels(source, "default", "api-1-new"), timeout=1.0)
    assert took < 1.0
    added = {"resource": "pods", "type": "ADDED"}
    assert metric(source, "karta_proxy_watch_events_total", added) >= 1


async def test_rolling_update_keeps_tombstones(sim: KubeSim,
                                               make_source: SourceFactory) -> None:
    _, _, old_pods = deployment(sim, "web", replicas=2, rev="1")
    source = await make_source()
    deployment(sim, "web", replicas=2, rev="2")
    for p in old_pods:
        sim.delete(p)
    # a pod that arrives before its new ReplicaSet is named after the ReplicaSet until the
    # ReplicaSet's own event comes (the watches are separate streams): wait for both
    await eventually(lambda: all((labels(source, "default", p) or {}).get("karta_kind")
                                 == "Deployment" for p in ("web-2-0", "web-2-1"))
                     and source.index.tombstones() == 2)
    # deleted pods keep their labels (late samples, stale markers) ...
    old = labels(source, "default", "web-1-0")
    assert old is not None and old["karta_workload"] == "web"
    # ... and are gone from the live pods
    assert {a.pod for a in source.index.pods.values()} == {"web-2-0", "web-2-1"}
    assert labels(source, "default", "web-2-0") == old


async def test_rayjob_with_its_raycluster(sim: KubeSim, make_source: SourceFactory) -> None:
    sim.create(RAYJOB_KARTA)
    names = rayjob(sim)
    source = await make_source()
    head = labels(source, "ml", names[0])
    worker = labels(source, "ml", names[1])
    assert head is not None and worker is not None
    assert head["karta_workload"] == "train" and head["karta_kind"] == "RayJob"
    assert head["karta_group"] == "ray.io" and head["karta_component"] == "head"
    assert worker["karta_component"] == "worker" and worker["karta_instance"] == "gpu"
    # RayJob is read in full (status), RayCluster only as an owner on the chain
    modes = {str(gk): mode for gk, (mode, _) in source.watchers.items()}
    assert modes["RayJob.ray.io"] == "full"
    assert modes["RayCluster.ray.io"] == "metadata"
    meta = [q for _, path, q, a in sim.requests
            if path.endswith("/rayclusters") and "PartialObjectMetadata" in a]
    assert meta


async def test_compaction_410_relists_and_finds_deletions(
        sim: KubeSim, make_source: SourceFactory) -> None:
    _, rs, pods = deployment(sim, "web", replicas=3)
    source = await make_source()
    await sim.stop()
    sim.delete(pods[0])
    sim.create(pod("web-1-x", owner_obj=rs))
    sim.compact()  # the watchers' resourceVersions are gone now
    await sim.start()
    await eventually(lambda: labels(source, "default", "web-1-x"), timeout=5)
    await eventually(lambda: "web-1-0" not in {a.pod for a in source.index.pods.values()})
    assert source.index.tombstones() == 1  # the deletion found by the relist diff
    assert metric(source, "karta_proxy_watch_restarts_total",
                                {"resource": "pods", "reason": "gone"}) >= 1
    assert metric(source, "karta_proxy_watch_events_total",
                                {"resource": "pods", "type": "RELIST_DELETED"}) == 1


async def test_relists_hand_the_heap_back_once_they_are_through(
        sim: KubeSim, make_source: SourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relist after the first load left the heap holding what its lists freed (8 MiB
    at 37.5k pods, for the process's life): now one trim follows the relists of a burst,
    ``RELIST_TRIM_DELAY`` after the last, off the loop."""
    trims: list[float] = []

    def trim() -> bool:
        trims.append(time.monotonic())
        return True

    monkeypatch.setattr(memory, "trim", trim)
    _, rs, _ = deployment(sim, "web", replicas=3)
    source = await make_source()
    assert len(trims) == 1  # the initial sync's, before ready
    await sim.stop()
    sim.create(pod("web-1-x", owner_obj=rs))
    sim.compact()  # every watcher's resourceVersion gone: each relists
    await sim.start()
    await eventually(lambda: metric(source, "karta_proxy_watch_restarts_total",
                                    {"resource": "pods", "reason": "gone"}) >= 1)
    await eventually(lambda: len(trims) >= 2, timeout=5)
    # a burst of relists going through (a restore tells every watcher): one trim
    watchers = [w for _, ws in source.watchers.values() for w in ws]
    before = len(trims)
    monkeypatch.setattr(source_module, "RELIST_TRIM_DELAY", 0.2)
    for w in watchers * 3:  # a loop turn apart, as relists ending one after the other
        # (0.01 s sleeps apart, a single one stretched past the 0.2 s on a starved box
        # would end the burst early: two trims of one)
        source.relisted(w)
        await asyncio.sleep(0)
    await eventually(lambda: len(trims) > before, timeout=5)
    await asyncio.sleep(0.5)
    assert len(trims) == before + 1


async def test_disconnects_resume_without_loss(sim: KubeSim,
                                               make_source: SourceFactory) -> None:
    _, rs, _ = deployment(sim, "web", replicas=1)
    source = await make_source()
    for i in range(3):
        await eventually(lambda: sim.watch_count() >= len(source.watchers))
        sim.disconnect_watches()
        sim.create(pod(f"web-1-d{i}", owner_obj=rs))
    for i in range(3):
        await eventually(_has(source, f"web-1-d{i}"), timeout=5)
    why = {"resource": "pods", "reason": "disconnect"}
    assert metric(source, "karta_proxy_watch_restarts_total", why) >= 1
    assert not source.index.stale  # a stream the server answered broke: no outage


async def test_silent_stream_is_reconnected(sim: KubeSim, make_source: SourceFactory) -> None:
    """A watch that goes quiet without closing (half-open connection, stuck server) is
    given up after the idle timeout (1.5 s here; bookmarks come every 0.2 s), not after
    timeoutSeconds + 30 s (the server's timeoutSeconds is 2 s, ignored while hung)."""
    _, rs, _ = deployment(sim, "web", replicas=1)
    source = await make_source()
    await eventually(lambda: sim.watch_count() >= len(source.watchers))
    assert sim.hang_watches() >= 1
    sim.create(pod("web-1-quiet", owner_obj=rs))
    await asyncio.sleep(0.5)
    # the hung stream said nothing: the pod is known only once the watch was given up
    # (a loaded machine may take the 1.5 s before this look)
    idle = {"resource": "pods", "reason": "idle"}
    assert (labels(source, "default", "web-1-quiet") is None
            or metric(source, "karta_proxy_watch_restarts_total", idle) >= 1)
    await eventually(_has(source, "web-1-quiet"), timeout=6)
    why = {"resource": "pods", "reason": "idle"}
    assert metric(source, "karta_proxy_watch_restarts_total", why) >= 1
    assert not source.index.stale  # the server answers new requests: not an outage


async def test_outage_serves_last_index_stale_then_recovers(
        sim: KubeSim, make_source: SourceFactory) -> None:
    _, rs, _ = deployment(sim, "web", replicas=2)
    source = await make_source()
    await sim.stop()
    await eventually(lambda: source.index.stale, timeout=5)
    before = source.index.freshness["pods"]
    await asyncio.sleep(0.5)
    assert source.index.freshness["pods"] == before  # ages while cut off
    assert labels(source, "default", "web-1-0") is not None  # still served
    sim.create(pod("web-1-late", owner_obj=rs))  # happens during the outage
    await sim.start()
    await eventually(lambda: not source.index.stale and labels(source, "default", "web-1-late"),
                     timeout=5)
    assert source.index.freshness["pods"] > before
    why = {"resource": "pods", "reason": "unreachable"}
    assert metric(source, "karta_proxy_watch_restarts_total", why) >= 1


async def test_namespace_filter(sim: KubeSim, make_source: SourceFactory) -> None:
    deployment(sim, "a-app", ns="team-a", replicas=1)
    deployment(sim, "b-app", ns="team-b", replicas=1)
    source = await make_source(namespaces=["team-a"])
    deployment(sim, "a-two", ns="team-a", replicas=1)
    deployment(sim, "b-two", ns="team-b", replicas=1)
    await eventually(lambda: labels(source, "team-a", "a-two-1-0"))
    assert labels(source, "team-a", "a-app-1-0") is not None
    assert {a.namespace for a in source.index.pods.values()} == {"team-a"}
    pod_paths = {path for _, path, _, _ in sim.requests if path.endswith("/pods")}
    assert pod_paths == {"/api/v1/namespaces/team-a/pods"}
    assert "team-a/pods" in source.index.freshness


async def test_a_namespace_given_twice_is_watched_once(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """--namespace web --namespace web started two identical watchers per kind."""
    deployment(sim, "a-app", ns="team-a", replicas=1)
    source = await make_source(namespaces=["team-b", "team-a", "team-b"])
    assert [w.namespace for w in source.watchers[POD][1]] == ["team-b", "team-a"]


@pytest.mark.parametrize("scope", [{"namespaces": ["team-a", "nosuch"]},
                                   {"node_name": "no-such-node"}])
async def test_a_filter_whose_first_list_of_pods_is_empty_is_warned_once(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture,
        scope: dict[str, object]) -> None:
    """A namespace or node that does not exist lists nothing, without an error: the proxy
    reported ready, with nothing attributed and nothing said."""
    deployment(sim, "a-app", ns="team-a", replicas=1, node="n1")
    with caplog.at_level(logging.WARNING):
        await make_source(**scope)
    warned = [r.getMessage() for r in caplog.records
              if "the first list of pods" in r.getMessage()]
    where, key = (("namespace 'nosuch'", "namespaces") if "namespaces" in scope
                  else ("node 'no-such-node'", "node_name"))
    assert warned == [f"the first list of pods on {where} is empty: nothing there is "
                      f"attributed (is the kube.{key} right?)"], warned


async def test_no_warning_when_the_filter_finds_pods(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    deployment(sim, "a-app", ns="team-a", replicas=1, node="n1")
    with caplog.at_level(logging.WARNING):
        await make_source(namespaces=["team-a"], node_name="n1")
    assert "the first list of pods" not in caplog.text


async def test_a_namespace_rbac_refuses_leaves_the_others_watched(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """Namespaced mode, the proxy's RoleBinding missing in one of its namespaces (403
    there only): the pods of the others stay attributed, without a gap, while the
    refused namespace is retried once per recheck interval and reported (gauge, one
    warning naming it). The whole kind used to be dropped: every pod of every
    namespace retracted, put back by each retry's list and retracted again by its 403,
    so attribution flapped every interval."""
    deployment(sim, "a-app", ns="team-a", replicas=1)
    deployment(sim, "c-app", ns="team-c", replicas=1)
    sim.fail_resource(POD_TYPE, 403, namespace="team-c")
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    source = await make_source(namespaces=["team-a", "team-c"])
    assert source.index.ready
    gauge: set[float] = set()
    indexed: set[int] = set()
    for _ in range(200):  # 2 s: four recheck intervals
        # the index's pods, not lookups: a retracted pod's tombstone still answers those
        indexed.add(sum(a.namespace == "team-a" for a in source.index.pods.values()))
        gauge.add(metric(source, "karta_proxy_watch_unserved", {"resource": "Pod"}))
        await asyncio.sleep(0.01)
    assert indexed == {1}, indexed  # never retracted: absent 86% of the time before
    assert gauge == {1.0}
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 1
    assert labels(source, "team-c", "c-app-1-0") is None
    warned = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert len(warned) == 1 and "team-c" in warned[0], warned
    refused = sum(1 for _, path, _, _ in sim.requests
                  if path == "/api/v1/namespaces/team-c/pods")
    assert 2 <= refused <= 12, refused  # retried, once per 0.5-1 s
    assert "team-c/pods" not in source.index.freshness
    sim.fail_resource(POD_TYPE, None, namespace="team-c")  # the RoleBinding is created
    # the pods, then the gauge once the list has ended (a few awaits later: waited for,
    # it was seen still 1 on a loaded machine)
    await eventually(lambda: labels(source, "team-c", "c-app-1-0")
                     and metric(source, "karta_proxy_watch_unserved", {"resource": "Pod"}) == 0)
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 0
    assert "team-c/pods" in source.index.freshness
    assert labels(source, "team-a", "a-app-1-0") is not None


async def test_a_namespace_refused_after_it_was_served_retracts_only_its_pods(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """RBAC revoked in one namespace while watched: its pods leave the index (what the
    proxy can no longer see is not kept as if current), the other namespace's stay."""
    deployment(sim, "a-app", ns="team-a", replicas=1)
    deployment(sim, "c-app", ns="team-c", replicas=2)
    source = await make_source(namespaces=["team-a", "team-c"])

    def indexed(ns: str) -> int:
        return sum(a.namespace == ns for a in source.index.pods.values())

    assert (indexed("team-a"), indexed("team-c")) == (1, 2)
    sim.fail_resource(POD_TYPE, 403, namespace="team-c")
    sim.disconnect_watches()  # the next watch or list of team-c is refused
    # the pods retracted and the gauge set, and back: the gauge follows the pods within a
    # few awaits (it is cleared once the list has ended: waited for, not looked at once)
    await eventually(lambda: indexed("team-c") == 0 and metric(
        source, "karta_proxy_watch_unserved", {"resource": "Pod"}) == 1)
    assert indexed("team-a") == 1
    sim.fail_resource(POD_TYPE, None, namespace="team-c")
    await eventually(lambda: indexed("team-c") == 2 and metric(
        source, "karta_proxy_watch_unserved", {"resource": "Pod"}) == 0)


async def test_node_mode(sim: KubeSim, make_source: SourceFactory) -> None:
    deployment(sim, "here", replicas=2, node="n1")
    deployment(sim, "there", replicas=2, node="n2")
    source = await make_source(node_name="n1")
    assert {a.pod for a in source.index.pods.values()} == {"here-1-0", "here-1-1"}
    rs = sim.get("apps/v1", "ReplicaSet", "here-1", "default")
    pending = sim.create(pod("here-1-2", owner_obj=rs, node=""))
    await asyncio.sleep(0.2)
    assert labels(source, "default", "here-1-2") is None  # not on this node (yet)
    pending["spec"]["nodeName"] = "n1"
    sim.update(pending)  # scheduled here: arrives as ADDED on the filtered watch
    await eventually(lambda: labels(source, "default", "here-1-2"))
    assert all(q.get("fieldSelector") == "spec.nodeName=n1"
               for _, path, q, _ in sim.requests if path.endswith("/pods"))


async def test_unserved_kind_is_reported_not_fatal(sim: KubeSim,
                                                   make_source: SourceFactory) -> None:
    sim.create(JOBSET_KARTA)
    deployment(sim, "web", replicas=1)
    source = await make_source()
    assert source.index.ready and labels(source, "default", "web-1-0") is not None
    gk = next(gk for gk in source.unserved_kinds if gk.kind == "JobSet")
    assert source.registry.get_sample_value("karta_proxy_watch_unserved",
                                            {"resource": str(gk)}) == 1
    # a CRD not installed is no alert: nothing of the kind to miss
    assert source.registry.get_sample_value(contract.OP_WATCH_FORBIDDEN,
                                            {"resource": str(gk)}) == 0
    sim.register(JOB_SET)  # the CRD gets installed later: picked up by the recheck
    await eventually(lambda: gk in source.watchers and gk not in source.unserved_kinds,
                     timeout=5)


async def _slow_recheck_source(sim: KubeSim) -> KubeSource:
    """A source with the shipped recheck interval (30 s): what a test must beat without
    waiting for it."""
    kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()), resync_backoff_max_seconds=0.5)
    source = KubeSource(kube, Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                        watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=30)
    await asyncio.wait_for(source.start(), 10)
    return source


async def test_a_crd_served_at_another_version_is_followed_at_once(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """A CRD upgrade: RayJob and RayCluster served as v1alpha1, then v1 only (the old
    version's watches get 404). The kind is resolved again at once and watched at v1,
    handed what the old watch held: the pods stay attributed to their RayJob, its facts
    never read workload_object_missing, no "no longer served" warning. A 404 made the
    kind unserved for the recheck interval (30 s) without asking discovery again."""
    sim.serve_version(RAY_JOB, "v1alpha1")
    sim.serve_version(RAY_CLUSTER, "v1alpha1")
    sim.create(RAYJOB_KARTA)
    names = rayjob(sim)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    source = await _slow_recheck_source(sim)
    try:
        rj = GroupKind("ray.io", "RayJob")
        assert source.watchers[rj][1][0].resource.version == "v1alpha1"
        assert (labels(source, "ml", names[1]) or {}).get("karta_kind") == "RayJob"
        sim.serve_version(RAY_JOB, "v1")
        sim.serve_version(RAY_CLUSTER, "v1")
        seen: set[tuple[str | None, str]] = set()
        for _ in range(150):  # 1.5 s, far short of the 30 s recheck
            seen.add(((labels(source, "ml", names[1]) or {}).get("karta_kind"),
                      ",".join(sorted(f.phase_reason for f in source.index.workloads.values()
                                      if f.ref.kind == "RayJob"))))
            await asyncio.sleep(0.01)
        assert all(kind == "RayJob" and "workload_object_missing" not in why
                   for kind, why in seen), seen
        assert {w.resource.version for gk in (rj, GroupKind("ray.io", "RayCluster"))
                for w in source.watchers[gk][1]} == {"v1"}
        assert not source.unserved_kinds
        assert "no longer served" not in caplog.text
        assert "kind RayJob.ray.io is served as ray.io/v1/rayjobs now" in caplog.text
    finally:
        await source.stop()


async def test_an_unserved_kind_no_longer_described_is_forgotten(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """Its karta_proxy_watch_unserved child stayed at 1 for good once the description
    went (a false alert, one child per kind ever described: found by the soak audit)."""
    karta = sim.create(JOBSET_KARTA)
    source = await make_source()
    gk = next(gk for gk in source.unserved_kinds if gk.kind == "JobSet")
    assert source.registry.get_sample_value("karta_proxy_watch_unserved",
                                            {"resource": str(gk)}) == 1
    sim.delete(karta)
    await eventually(lambda: gk not in source.unserved_kinds, timeout=5)
    assert source.registry.get_sample_value("karta_proxy_watch_unserved",
                                            {"resource": str(gk)}) is None
    assert source.registry.get_sample_value(contract.OP_WATCH_FORBIDDEN,
                                            {"resource": str(gk)}) is None


async def test_description_of_an_owner_kind_switches_it_to_full_objects(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """RayClusters first seen as owners (metadata only) must be read in full once a
    description names their kind: phase and replica facts come from spec and status."""
    rc = sim.create({
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": "rc", "namespace": "ml"},
        "spec": {"workerGroupSpecs": [{"groupName": "gpu", "replicas": 3}]},
        "status": {"state": "ready"},
    })
    sim.create(pod("rc-head", "ml", owner_obj=rc, labels={"ray.io/node-type": "head"}))
    for i in range(2):
        sim.create(pod(f"rc-gpu-{i}", "ml", owner_obj=rc,
                       labels={"ray.io/node-type": "worker", "ray.io/group": "gpu"}))
    source = await make_source()
    uid = rc["metadata"]["uid"]

    def mode() -> str:
        return next((m for gk, (m, _) in source.watchers.items() if gk.kind == "RayCluster"), "")

    assert mode() == "metadata"  # an owner on pod chains, nothing describes it yet
    assert uid not in source.index.workloads
    karta = sim.create(RAYCLUSTER_KARTA)
    await eventually(lambda: mode() == "full" and uid in source.index.workloads
                     and source.index.workloads[uid].phase_reason == "", timeout=5)
    facts = source.index.workloads[uid]
    assert facts.phase.lower() == "running", facts
    replicas = {(r.component, r.instance): (r.desired, r.observed) for r in facts.replicas}
    assert replicas[("worker", "gpu")] == (3, 2)
    assert replicas[("head", "")] == (1, 1)
    assert (labels(source, "ml", "rc-gpu-1") or {}).get("karta_instance") == "gpu"
    full = [a for _, path, q, a in sim.requests
            if path.endswith("/rayclusters") and "watch" not in q and "as=" not in a]
    assert full, "RayClusters were not relisted as full objects"
    # the object changes in the cluster: the full watch follows it
    rc = sim.get("ray.io/v1", "RayCluster", "rc", "ml")
    rc["status"] = {"state": "failed"}
    sim.update(rc)
    await eventually(lambda: source.index.workloads[uid].phase.lower() == "failed")
    # the description goes away: back to metadata only, the workload is retracted
    sim.delete(karta)
    await eventually(lambda: mode() == "metadata" and uid not in source.index.workloads,
                     timeout=5)
    await eventually(lambda: labels(source, "ml", "rc-head") is None)


async def test_a_mode_switch_leaves_no_stale_mark_behind(sim: KubeSim,
                                                        make_source: SourceFactory) -> None:
    """A watcher that fails (500) and is then switched to the other mode takes its
    failure with it: the new watcher starts healthy and reports only a change, so the old
    one's mark kept ``index.stale`` True for good once everything had recovered."""
    rc = sim.create({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                     "metadata": {"name": "rc", "namespace": "ml"}})
    sim.create(pod("rc-head", "ml", owner_obj=rc, labels={"ray.io/node-type": "head"}))
    source = await make_source()

    def mode() -> str:
        return next((m for gk, (m, _) in source.watchers.items() if gk.kind == "RayCluster"), "")

    assert mode() == "metadata" and not source.index.stale
    # metadata-only reads of RayClusters fail (the full ones do not): the old watcher
    # stays failed until it is stopped
    sim.fail_resource(RAY_CLUSTER, 500, accept="as=PartialObjectMetadata")
    sim.disconnect_watches()
    await eventually(lambda: source.index.stale, timeout=5)
    sim.create(RAYCLUSTER_KARTA)  # RayCluster described: a full watch replaces it
    await eventually(lambda: mode() == "full"
                     and labels(source, "ml", "rc-head") is not None, timeout=5)
    await eventually(lambda: not source.index.stale, timeout=10)
    assert not source._unhealthy
    assert metric(source, "karta_proxy_watch_restarts_total",
                  {"resource": "rayclusters.ray.io", "reason": "error"}) >= 1


def _children(source: KubeSource, resource: str) -> set[str]:
    """The names of ``resource``'s per-resource watch counters that have a child."""
    return {s.name for family in source.registry.collect()
            if family.name in ("karta_proxy_watch_events", "karta_proxy_watch_restarts")
            for s in family.samples if s.labels.get("resource") == resource}


async def test_a_kind_no_longer_watched_leaves_no_freshness_behind(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """A kind that stops being watched (its description deleted) takes its freshness
    entry and its ``karta_proxy_watch_last_current_timestamp_seconds`` child with it:
    frozen, they read as a resource ever staler (``time() - min(...)``). Its event and
    restart counters' children go too: they stayed for the life of the process, one set
    for every kind ever described and dropped."""
    sim.create({"apiVersion": "ray.io/v1", "kind": "RayJob",  # no pods: owns nothing
                "metadata": {"name": "train", "namespace": "ml"},
                "status": {"jobStatus": "RUNNING"}})
    karta = sim.create(RAYJOB_KARTA)
    source = await make_source()
    gauge = "karta_proxy_watch_last_current_timestamp_seconds"
    assert "rayjobs.ray.io" in source.index.freshness
    sim.disconnect_watches()  # a restart child too
    await eventually(lambda: len(_children(source, "rayjobs.ray.io")) >= 2, timeout=5)
    assert metric(source, gauge, {"resource": "rayjobs.ray.io"}) > 0
    sim.delete(karta)
    # the kind leaves ``watchers`` when its drop begins; its freshness entry goes once
    # the watcher has stopped and retracted what it held (a few awaits later)
    await eventually(lambda: not any(gk.kind == "RayJob" for gk in source.watchers)
                     and "rayjobs.ray.io" not in source.index.freshness, timeout=5)
    assert source.registry.get_sample_value(gauge, {"resource": "rayjobs.ray.io"}) is None
    assert not _children(source, "rayjobs.ray.io"), "its event and restart counters stay"
    assert _children(source, "pods")
    resources = {dict(f.labels)[contract.FACT_LABEL_RESOURCE] for f in process_facts(source.index)
                 if f.name == contract.FACT_SOURCE_LAST_CURRENT}
    assert "rayjobs.ray.io" not in resources and "pods" in resources
    # every entry current: each renewed within a second (waited for: a loaded machine's
    # bookmarks may come late, but they come)
    await eventually(lambda: time.time() - min(source.index.freshness.values()) < 1.0,
                     timeout=15)


async def test_a_forbidden_kind_is_retried_once_per_recheck_interval(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """RBAC forbids ReplicaSets (403), while discovery lists them as a real server does:
    the kind stays unserved until its retry time (the recheck interval, 0.5 s here)
    passes, with one warning for the episode and no flapping of the gauge. Discovery
    alone re-served it at once: a tight loop of 471 refused requests in 2 s, and as
    many warnings."""
    sim.fail_resource(REPLICA_SET, 403)
    deployment(sim, "web", replicas=2)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    source = await make_source()
    gk = GroupKind("apps", "ReplicaSet")
    assert source.unserved_kinds.get(gk) == "forbidden (RBAC)"
    assert labels(source, "default", "web-1-0") is not None  # attributed without it

    def refused() -> int:
        return sum(1 for _, path, _, _ in sim.requests if path.endswith("/replicasets"))

    n0 = refused()
    gauge: set[float] = set()
    started = time.monotonic()
    for _ in range(40):
        gauge.add(metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}))
        await asyncio.sleep(0.05)
    n = refused() - n0
    elapsed = time.monotonic() - started  # 2 s, or longer on a loaded machine
    assert 1 <= n <= elapsed / 0.5 + 2, (n, elapsed)  # one per 0.5-1 s; was several
    # hundred in 2 s
    assert gauge == {1.0}
    # forbidden, not merely not served (KartaKindForbidden reads it)
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": str(gk)}) == 1
    assert sum("forbidden" in r.getMessage() for r in caplog.records) == 1
    assert "replicasets.apps" not in source.index.freshness
    sim.fail_resource(REPLICA_SET, None)  # RBAC fixed: picked up at the next retry
    await eventually(lambda: (labels(source, "default", "web-1-0") or {}).get("karta_kind")
                     == "Deployment", timeout=5)
    # served once the list goes through whole (``current``): its items reach the engine
    # page by page before that, so the stamp may change a step before the mark clears
    await eventually(lambda: gk not in source.unserved_kinds, timeout=5)
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}) == 0
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": str(gk)}) == 0
    assert "replicasets.apps" in source.index.freshness
    assert sum("served now" in r.getMessage() for r in caplog.records) == 1


async def test_pods_forbidden_at_start_hold_readiness_with_a_clear_line(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """RBAC refusing the pods (403) at start: not ready, one warning saying what RBAC is
    missing, the forbidden gauge of Pod 1; ready once the pods may be read. A 403 marked
    Pod unserved and released readiness: ready after 0.13 s with 0 pods, every series
    relayed unstamped, nothing said but "kind Pod is needed but forbidden"."""
    deployment(sim, "web", replicas=2)
    sim.fail_resource(POD_TYPE, 403)
    kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()), resync_backoff_max_seconds=0.5)
    source = KubeSource(kube, Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                        watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    task = asyncio.create_task(source.start())
    try:
        await asyncio.sleep(1.5)  # three retries
        assert not task.done() and not source.index.ready
        assert POD not in source.unserved_kinds  # not a kind to do without
        assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 1
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                  and "pods" in r.getMessage() and "RBAC" in r.getMessage()]
        assert len(warned) == 1, warned
        assert ("RBAC forbids the proxy's service account to list or watch pods "
                "cluster-wide: it needs get, list and watch on pods") in warned[0]
        assert "not ready until it may" in warned[0]
        sim.fail_resource(POD_TYPE, None)  # the ClusterRoleBinding created
        await asyncio.wait_for(task, 10)
        assert source.index.ready and labels(source, "default", "web-1-0") is not None
        await eventually(lambda: not source.index.stale, timeout=5)
        assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 0
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await source.stop()


async def test_pods_forbidden_at_runtime_keep_the_last_pods_stale(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The proxy's ClusterRoleBinding removed while it runs (pods 403): an outage, as an
    API server unreachable is. The last known pods stay (no retraction), the index is
    stale, the pods' freshness entry stays and ages; back: current again. The refused
    watcher was dropped and every pod retracted (nothing stamped once the tombstones
    expired), ready and not stale, the freshness entry deleted."""
    deployment(sim, "web", replicas=2)
    source = await make_source()
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    sim.fail_resource(POD_TYPE, 403)
    sim.disconnect_watches()
    await eventually(lambda: source.index.stale, timeout=5)
    before = source.index.freshness["pods"]
    await asyncio.sleep(1.2)  # two retries, refused
    assert len(source.index.pods) == 2 and labels(source, "default", "web-1-0") is not None
    assert source.index.stale and source.index.ready
    assert source.index.freshness["pods"] == before  # kept, ageing
    assert POD in source.watchers and POD not in source.unserved_kinds
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
              and "RBAC forbids" in r.getMessage()]
    assert len(warned) == 1 and "serving the last known 2 pods" in warned[0], warned
    rs = sim.get("apps/v1", "ReplicaSet", "web-1", "default")
    sim.create(pod("web-1-late", owner_obj=rs))  # made while refused
    sim.fail_resource(POD_TYPE, None)
    await eventually(lambda: not source.index.stale and labels(source, "default", "web-1-late"),
                     timeout=5)
    assert source.index.freshness["pods"] > before
    assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": "Pod"}) == 0


async def test_pods_listed_but_not_watched_stay_stale(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """RBAC allowing list but not watch on pods: each retry's list goes through, but the
    pods count as refused until a watch opens after it: stale throughout, one warning."""
    deployment(sim, "web", replicas=2)
    source = await make_source()
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    sim.fail_resource(POD_TYPE, 403, watch_only=True)
    sim.disconnect_watches()
    await eventually(lambda: source.index.stale, timeout=5)
    stale: set[bool] = set()
    for _ in range(150):  # 1.5 s: three retries, each list passing
        stale.add(source.index.stale)
        await asyncio.sleep(0.01)
    assert stale == {True}
    assert len(source.index.pods) == 2
    assert sum("RBAC forbids" in r.getMessage() for r in caplog.records) == 1
    assert not any("none left" in r.getMessage() for r in caplog.records)
    sim.fail_resource(POD_TYPE, None, watch_only=True)
    await eventually(lambda: not source.index.stale, timeout=5)


async def test_a_kind_listed_but_not_watched_stays_one_forbidden_episode(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """RBAC granting list and not watch on ReplicaSets, once they were watched: an
    outage of the kind (it held objects), each retry probing a watch before it lists, so
    the kind stays forbidden (gauges 1 throughout, one warning, the index stale, no
    "served now"), with no full relist and no ReplicaSet put back and retracted again.
    Each retry used to list every ReplicaSet, declare the kind served (an info line, the
    gauges 0), then retract them all at the watch's 403 and warn again."""
    deployment(sim, "web", replicas=2)
    source = await make_source()
    gk = GroupKind("apps", "ReplicaSet")
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    sim.fail_resource(REPLICA_SET, 403, watch_only=True)
    sim.disconnect_watches()
    await eventually(lambda: metric(source, contract.OP_WATCH_FORBIDDEN,
                                    {"resource": str(gk)}) == 1, timeout=5)
    n0 = len(sim.requests)
    gauges: set[tuple[float, float]] = set()
    kinds: set[str | None] = set()
    stale: set[bool] = set()
    for _ in range(200):  # 2 s: four retries
        gauges.add((metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}),
                    metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": str(gk)})))
        kinds.add((labels(source, "default", "web-1-0") or {}).get("karta_kind"))
        stale.add(source.index.stale)
        await asyncio.sleep(0.01)
    assert gauges == {(1.0, 1.0)}, gauges
    assert kinds == {"Deployment"}, kinds  # no flip to the ReplicaSet and back
    assert stale == {True}
    full_lists = [q for _, path, q, _ in list(sim.requests)[n0:]
                  if path.endswith("/replicasets") and not q.get("watch")
                  and q.get("limit") != "1"]
    assert full_lists == []
    assert not any("served now" in r.getMessage() for r in caplog.records)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
              and "forbid" in r.getMessage()]
    assert len(warned) == 1, warned
    assert ("RBAC forbids the proxy's service account to list or watch replicasets.apps "
            "cluster-wide: it needs get, list and watch on replicasets.apps") in warned[0]
    assert "serving the last known 1 replicasets.apps, the index stale" in warned[0]
    sim.fail_resource(REPLICA_SET, None, watch_only=True)
    await eventually(lambda: not source.index.stale and metric(
        source, contract.OP_WATCH_FORBIDDEN, {"resource": str(gk)}) == 0, timeout=5)
    assert (labels(source, "default", "web-1-0") or {}).get("karta_kind") == "Deployment"
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}) == 0


async def test_the_whole_binding_removed_keeps_every_attribution_stale(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The proxy's ClusterRoleBinding removed while it runs: every kind it watches 403.
    Each kind that held objects is an outage, as pods are: the last known objects stay,
    the series keep their attribution (a Deployment's pods stay the Deployment's), the
    index is stale; the binding back, all current again. The owner kinds were dropped
    and their objects retracted while the pods were kept, so every pod moved to the
    owner below it (``karta_kind`` ReplicaSet, new series) for as long as RBAC was off."""
    deployment(sim, "web", replicas=2)
    source = await make_source()
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    before = labels(source, "default", "web-1-0")
    assert before is not None and before.get("karta_kind") == "Deployment"
    for kind in (POD_TYPE, REPLICA_SET, DEPLOYMENT):
        sim.fail_resource(kind, 403)
    sim.disconnect_watches()
    await eventually(lambda: source.index.stale, timeout=5)
    seen: list[dict[str, str] | None] = []
    for _ in range(120):  # 1.2 s: two retries each, refused
        seen.append(labels(source, "default", "web-1-0"))
        await asyncio.sleep(0.01)
    assert all(x == before for x in seen), {str(x) for x in seen}
    assert source.index.stale and not source.unserved_kinds
    for res in map(str, (POD, GroupKind("apps", "ReplicaSet"), GroupKind("apps", "Deployment"))):
        assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": res}) == 1, res
    for kind in (POD_TYPE, REPLICA_SET, DEPLOYMENT):
        sim.fail_resource(kind, None)
    await eventually(lambda: not source.index.stale, timeout=5)
    assert labels(source, "default", "web-1-0") == before
    for res in map(str, (POD, GroupKind("apps", "ReplicaSet"), GroupKind("apps", "Deployment"))):
        assert metric(source, contract.OP_WATCH_FORBIDDEN, {"resource": res}) == 0, res


async def test_unreachable_at_start_retries_with_backoff(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """An API server that is down when the proxy starts is retried, never in a tight loop."""
    kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()), resync_backoff_max_seconds=0.5)
    await sim.stop()
    source = KubeSource(kube, Engine(), PodIndex(), metrics_registry=CollectorRegistry())
    caplog.set_level(logging.WARNING, logger="proxy.kube.source")
    started = time.monotonic()
    task = asyncio.create_task(source.start())
    await asyncio.sleep(1.5)
    # one warning per round; the backoff (base 0.2 s, cap 0.5 s here) allows about a dozen
    # rounds in 1.5 s (one per 0.1 s at the most), where a tight loop made ~180 (~1,600
    # lines, one per kind); the 1.5 s may be longer on a loaded machine
    rounds = sum("discovery of" in r.getMessage() for r in caplog.records)
    elapsed = time.monotonic() - started
    assert 1 <= rounds <= elapsed / 0.1 + 2, (rounds, elapsed)
    await sim.start()
    await asyncio.wait_for(task, 10)
    assert source.index.ready
    await source.stop()


async def test_phase_times_from_objects_survive_a_restart_of_the_source(
    sim: KubeSim, make_source: SourceFactory
) -> None:
    """Two sources one after the other on the same cluster (a rollout of the proxy, a new
    leader): a workload whose object dates its phase has the same transition time in
    both; one that does not is dated by each process's observation, and says so. Spark
    executors and a static pod are attributed as the API serves them."""
    when = "2026-11-29T12:30:00Z"
    sim.create({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "shop", "generation": 1},
        "spec": {"replicas": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                   "readyReplicas": 1, "conditions": [
                       {"type": "Available", "status": "True", "lastTransitionTime": when}]}})
    sim.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {"name": "db", "namespace": "shop", "generation": 1},
                "spec": {"replicas": 0},
                "status": {"observedGeneration": 1, "replicas": 0}})
    driver = pod("pi-driver", "spark", labels={"spark-role": "driver"})
    driver["status"]["conditions"] = [
        {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-30T09:00:02Z"}]
    driver = sim.create(driver)
    sim.create(pod("pi-exec-1", "spark", owner_obj=driver, labels={"spark-role": "executor"}))
    mirror = pod("etcd-cp-1", "kube-system", labels={"component": "etcd"})
    mirror["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "cp-1",
                                              "uid": "node-uid-cp-1", "controller": True}]
    mirror["status"]["conditions"] = [
        {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-02T07:12:41Z"}]
    sim.create(mirror)

    def times(source: KubeSource) -> dict[str, tuple[float, str]]:
        engine = source.engine
        assert isinstance(engine, Engine)
        return {f.ref.name: (f.phase_since, f.phase_since_source) for f in engine.workloads()}

    names = {"web", "db", "pi-driver", "etcd-cp-1"}
    first_source = await make_source()
    await eventually(lambda: names <= set(times(first_source)))
    first = times(first_source)
    assert labels(first_source, "spark", "pi-exec-1") == {
        "karta_namespace": "spark", "karta_kind": "Pod", "karta_workload": "pi-driver",
        "karta_component": "controlled"}
    assert labels(first_source, "kube-system", "etcd-cp-1") == {
        "karta_namespace": "kube-system", "karta_kind": "Pod", "karta_workload": "etcd-cp-1",
        "karta_component": "pod"}
    await first_source.stop()
    await asyncio.sleep(1.1)
    second_source = await make_source()
    await eventually(lambda: names <= set(times(second_source)))
    second = times(second_source)
    for name in ("web", "pi-driver", "etcd-cp-1"):
        assert first[name] == second[name] and first[name][1] == "object", name
    assert first["web"][0] == datetime.fromisoformat(when).timestamp()
    assert first["db"][1] == second["db"][1] == "observed"
    assert second["db"][0] >= first["db"][0] + 1.0


def _removed(engine: Engine, uid: str) -> bool:
    return uid not in engine._graph.objects


async def test_cascade_delete_leaves_the_pod_tombstone_with_its_jobset(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """Background propagation deletes the JobSet, then its Job, then the pod (which
    terminates meanwhile, and is scraped): the pod keeps the JobSet as its workload to
    the end, and its tombstone carries the JobSet, not the built-in Job description's
    ``Job pretrain-driver-0`` (the Job's ghost still names the JobSet)."""
    sim.register(JOB_SET)
    sim.create(JOBSET_KARTA)
    js = sim.create({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                     "metadata": {"name": "pretrain", "namespace": "ml"}, "spec": {}})
    job = sim.create({"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": "pretrain-driver-0", "namespace": "ml",
                                   "ownerReferences": owner(js)},
                      "spec": {"parallelism": 1}})
    p = sim.create(pod("pretrain-driver-0-0-bq9tw", "ml", owner_obj=job))
    source = await make_source()
    want = {"karta_kind": "JobSet", "karta_workload": "pretrain",
            "karta_group": "jobset.x-k8s.io", "karta_namespace": "ml"}

    def stamped() -> dict[str, str]:
        got = labels(source, "ml", "pretrain-driver-0-0-bq9tw") or {}
        return {k: v for k, v in got.items() if k in want}

    await eventually(lambda: stamped() == want, timeout=5)
    engine = source.engine
    assert isinstance(engine, Engine)
    for gone in (js, job):  # each deletion seen before the next, as a slow GC's
        sim.delete(gone, cascade=False)
        await eventually(functools.partial(_removed, engine, gone["metadata"]["uid"]),
                         timeout=5)
        assert stamped() == want
    assert {(w.ref.kind, w.ref.name) for w in engine.workloads()} == {
        ("JobSet", "pretrain")}  # no phantom Job workload
    sim.delete(p)
    await eventually(lambda: source.index.tombstones() == 1, timeout=5)
    assert p["metadata"]["uid"] not in source.index.pods
    assert stamped() == want  # the tombstone: what late samples and stale markers get


async def test_an_outage_is_warned_once_and_its_end_logged_once(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """An outage is one warning (the first watcher to fail, with its error), each retry
    of each watcher a debug line, and one info line when the last watcher is back, with
    how long it took; "current again" is info too. Every retry of every watcher was a
    warning: 92 lines in a 46 s outage."""
    deployment(sim, "web", replicas=1)
    source = await make_source()  # backoff cap 0.5 s
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    await sim.stop()
    why = {"resource": "pods", "reason": "unreachable"}
    await eventually(lambda: metric(source, "karta_proxy_watch_restarts_total", why) >= 3,
                     timeout=10)  # retried, and retried again
    await sim.start()
    await eventually(lambda: not source.index.stale, timeout=10)

    def logged(level: int, text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == level and text in r.getMessage()]

    assert len(source.watchers) >= 3
    assert len(logged(logging.WARNING, "API server unreachable:")) == 1
    assert not logged(logging.INFO, "API server unreachable:")
    assert len(logged(logging.DEBUG, "API server unreachable:")) >= 3
    [back] = logged(logging.INFO, "API server answers again")
    assert " after " in back
    assert logged(logging.INFO, "cluster index current again")
    assert not logged(logging.WARNING, "current again")


def _logged(caplog: pytest.LogCaptureFixture, level: int, text: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and text in r.getMessage()]


def _healthy_but(source: KubeSource, plural: str) -> bool:
    return all(w.name not in source._unhealthy for _, ws in source.watchers.values()
               for w in ws if plural not in w.name)


async def test_the_api_server_gone_while_a_kind_fails_for_good_is_warned(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """Deployments fail for good (a conversion webhook answering 500), then the API
    server goes away: a warning of its own, and a line when it answers again. Both were
    one outage ("no watcher failing -> some"): the second was debug only, its end not
    logged at all."""
    deployment(sim, "web", replicas=1)
    source = await make_source()
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    sim.fail_resource(DEPLOYMENT, 500)
    sim.disconnect_watches()
    await eventually(lambda: source.index.stale, timeout=10)
    assert len(_logged(caplog, logging.WARNING, "API error 500")) == 1
    await sim.stop()
    why = {"resource": "pods", "reason": "unreachable"}
    await eventually(lambda: metric(source, "karta_proxy_watch_restarts_total", why) >= 2,
                     timeout=10)
    [warned] = _logged(caplog, logging.WARNING, "API server unreachable:")
    assert warned.startswith("watch ")
    await sim.start()
    await eventually(lambda: _healthy_but(source, "deployments"), timeout=10)
    await eventually(lambda: _logged(caplog, logging.INFO, "API server answers again"),
                     timeout=5)
    assert source.index.stale  # the deployments still fail


async def test_a_500_after_an_outage_is_warned(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The API server goes away and comes back, but deployments answer 500 now: that
    is a warning, and the others coming back end the outage with its line. The 500 was
    logged at debug only, as a retry of the outage already warned of."""
    deployment(sim, "web", replicas=1)
    source = await make_source()
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    await sim.stop()
    why = {"resource": "deployments.apps", "reason": "unreachable"}
    await eventually(lambda: metric(source, "karta_proxy_watch_restarts_total", why) >= 1,
                     timeout=10)
    sim.fail_resource(DEPLOYMENT, 500)
    await sim.start()
    await eventually(lambda: _healthy_but(source, "deployments"), timeout=10)
    err = {"resource": "deployments.apps", "reason": "error"}
    await eventually(lambda: metric(source, "karta_proxy_watch_restarts_total", err) >= 2,
                     timeout=10)
    assert len(_logged(caplog, logging.WARNING, "API server unreachable:")) == 1
    [warned] = _logged(caplog, logging.WARNING, "API error 500")
    assert warned.startswith("watch deployments.apps: ")
    await eventually(lambda: _logged(caplog, logging.INFO, "API server answers again"),
                     timeout=5)
    assert source.index.stale
    sim.fail_resource(DEPLOYMENT, None)
    await eventually(lambda: not source.index.stale, timeout=10)
    [over] = _logged(caplog, logging.INFO, "watches failing with API error 500")
    assert "(the last, deployments.apps, is back)" in over
    # however the outage ended (the deployments may be the last cut off, leaving with
    # their 500): one line that the API server answers
    assert len(_logged(caplog, logging.INFO, "API server answers again")) == 1


async def test_malformed_answers_are_warned_once_and_their_end_logged(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """Something in front of the API server answers every watch and list with what is
    not JSON (a login page): one warning for all the watchers answered so, their retries
    at debug, the index stale meanwhile, and one line once the last lists again. Each
    retry of each watcher was a warning of its own."""
    deployment(sim, "web", replicas=1)
    source = await make_source()  # backoff cap 0.5 s
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    watches = sim.hold_watches()
    assert watches >= 3
    page = b"<html><body>Sign in</body></html>"
    sim.garbled_lists.extend([page] * (4 * watches))
    sim.flush_watches(raw=page + b"\n")
    await eventually(lambda: source.index.stale, timeout=10)
    await eventually(lambda: not sim.garbled_lists, timeout=20)  # each retried, again
    await eventually(lambda: not source.index.stale, timeout=10)
    [warned] = _logged(caplog, logging.WARNING, "malformed answer")
    assert warned.startswith("watch ") and "Sign in" in warned, warned
    assert len(_logged(caplog, logging.DEBUG, "malformed answer")) >= 2 * watches
    [over] = _logged(caplog, logging.INFO, "watches failing with a malformed answer")
    assert "none left after" in over and "is back" in over
    assert labels(source, "default", "web-1-0") is not None


async def on_a_long_history(sim: KubeSim, make_source: SourceFactory) -> KubeSource:
    """A source synced to a cluster whose resourceVersion is well above 30 (the store a
    restore from a backup then takes back below it), with a Deployment "old" of 3 pods."""
    _, rs, _ = deployment(sim, "old", "shop", replicas=3)
    for i in range(30):
        rs = sim.update(dict(rs, spec={"replicas": 3 + i % 2},
                             metadata={**rs["metadata"], "resourceVersion": ""}))
    source = await make_source()
    assert labels(source, "shop", "old-1-0") is not None
    return source


def _relisted_for_a_restore(source: KubeSource, resource: str) -> float:
    """How many times ``resource`` relisted for a store gone back: seen by its own
    watcher (``gone``, no 410 here) or by another (``restored``)."""
    return sum(metric(source, "karta_proxy_watch_restarts_total",
                      {"resource": resource, "reason": reason})
               for reason in ("gone", "restored"))


async def test_an_api_server_back_on_an_older_store_is_relisted(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The API server restarts on an etcd restored from a backup: resourceVersions
    below the watchers', other pods. Every watch from the old versions is accepted and
    silent (kube-apiserver sends nothing not newer than a watch's start version); once
    idle, a one-item list shows the store's version below the held one: the watchers
    relist and the index holds the restored store's pods, not stale. They resumed those
    watches forever: the old pods stayed for good."""
    source = await on_a_long_history(sim, make_source)
    await sim.stop()
    await eventually(lambda: source.index.stale, timeout=5)
    sim.reset_store(resource_version=1)
    deployment(sim, "new", "shop", replicas=2)
    assert sim.resource_version < 10
    await sim.start()

    def live() -> set[str]:
        return {a.pod for a in source.index.pods.values()}

    def workload(name: str) -> str | None:
        got = labels(source, "shop", name)
        return None if got is None else got.get("karta_workload")

    # each kind relists on its own: a pod may come back before its ReplicaSet, and
    # carry it as its workload until then
    await eventually(lambda: live() == {"new-1-0", "new-1-1"} and not source.index.stale
                     and workload("new-1-0") == workload("new-1-1") == "new", timeout=10)
    assert _relisted_for_a_restore(source, "pods") == 1


async def test_a_store_restored_under_open_watches_is_relisted_once_they_go_idle(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """An etcd restored from a backup (no --bump-revision) under a running API server:
    the open watches carry over and go silent, no bookmark either, as kube-apiserver's
    watch cache sends nothing not newer than a watch's start version. Within the idle
    timeout (1.5 s here, 150 s by default) each watcher finds the store's version below
    its own and relists: the index converges to the restored store's pods. They resumed
    the silent watch from the same version at every idle timeout, forever."""
    source = await on_a_long_history(sim, make_source)
    sim.reset_store(resource_version=1, keep_watches=True)
    deployment(sim, "new", "shop", replicas=2)
    assert sim.resource_version < 10

    def live() -> set[str]:
        return {a.pod for a in source.index.pods.values()}

    await eventually(lambda: live() == {"new-1-0", "new-1-1"} and not source.index.stale
                     and (labels(source, "shop", "new-1-0") or {}).get("karta_workload")
                     == "new", timeout=15)
    assert _relisted_for_a_restore(source, "pods") == 1
    assert any("restored or replaced" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


async def test_a_stop_in_the_turn_of_a_kinds_change_ends_the_follower(sim: KubeSim) -> None:
    """A change asking for the follower's round (``wake``, a change set) in the very turn
    ``stop`` cancels the follower: the follower ends, and so does ``stop``. Python 3.11's
    ``asyncio.wait_for`` returned the event's result and swallowed that cancel; ``stop``
    then waited for the follower for good, the watches still open (a CI run hung 20 min
    in this fixture's teardown, 6 connections to the simulator open)."""
    deployment(sim, "web", replicas=1)
    kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()), resync_backoff_max_seconds=0.5)
    # a long recheck interval: between rounds the follower waits for a change, no timeout
    source = KubeSource(kube, Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                        watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=60)
    await asyncio.wait_for(source.start(), 10)
    (follower,) = [t for t in asyncio.all_tasks() if t.get_name() == "kube kinds"]
    await eventually(lambda: not source.kinds_pending)
    await asyncio.sleep(0.2)  # its round over: it waits for the next change

    async def wake_and_stop() -> None:
        source.wake()
        await source.stop()

    stopping = asyncio.create_task(wake_and_stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    try:
        assert done, "stop() still waiting for the follower after 5 s"
        assert follower.cancelled()
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("watch ")]
    finally:
        for t in (follower, stopping):  # the old code's: not left to the next test
            t.cancel()
        await asyncio.wait({follower, stopping}, timeout=5)
        await source.stop()


async def a_restore_one_watcher_sees(sim: KubeSim, make_source: SourceFactory, *,
                                     keep_watches: bool) -> tuple[KubeSource, float]:
    """A cluster backed up, changed, then restored to the backup (no
    ``--bump-revision``), where only one watcher can tell: returns the source and when
    (monotonic) the restore was made.

    At the backup: Deployments ``web`` and ``api``, ReplicaSet ``web-1`` of ``web``, its
    pod ``web-1-0``. After it, in the old history: a pod ``extra`` (the pods watcher at
    that version), ``web-1`` adopted by ``api`` (the ReplicaSets watcher at that one),
    then 20 changes of ``api`` (the Deployments watcher well above both). The restored
    store is the backup, then a few Leases (a real etcd's revision moves on with leases
    and events): at a version at or above the pods' and ReplicaSets' watchers', below the
    Deployments'. No bookmark moves a watcher meanwhile (a real one comes about once a
    minute). Only the Deployments watcher ever sees the store go back."""
    sim.bookmark_interval = 60.0
    web, _, _ = deployment(sim, "web", replicas=1)
    api = sim.create({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "api", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "api"}},
                 "template": {"metadata": {"labels": {"app": "api"}}}},
    })
    rs = sim.get("apps/v1", "ReplicaSet", "web-1", "default")
    backup = [web, api, rs, sim.get("v1", "Pod", "web-1-0", "default")]
    source = await make_source()
    assert labels(source, "default", "web-1-0")["karta_workload"] == "web"  # type: ignore[index]
    sim.create(pod("extra", owner_obj=rs))
    sim.update({**rs, "metadata": {**rs["metadata"], "ownerReferences": owner(api),
                                   "resourceVersion": ""}})
    for i in range(20):
        api = sim.update({**api, "metadata": {**api["metadata"], "labels": {"n": str(i)},
                                              "resourceVersion": ""}})
    await eventually(lambda: labels(source, "default", "extra") is not None and labels(
        source, "default", "web-1-0")["karta_workload"] == "api")  # type: ignore[index]
    (deployments,) = source.watchers[GroupKind("apps", "Deployment")][1]
    await eventually(lambda: deployments.resource_version  # type: ignore[attr-defined]
                     == api["metadata"]["resourceVersion"])
    held = {w.resource.kind: int(w.resource_version)  # type: ignore[attr-defined]
            for _, ws in source.watchers.values() for w in ws
            if w.resource.kind in ("Pod", "ReplicaSet", "Deployment")}
    if not keep_watches:
        await sim.stop()
    sim.reset_store(resource_version=0, keep_watches=keep_watches)
    for obj in backup:
        sim.create({**obj, "metadata": {k: v for k, v in obj["metadata"].items()
                                        if k != "resourceVersion"}})
    while sim.resource_version < max(held["Pod"], held["ReplicaSet"]) + 2:
        sim.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": f"node-{sim.resource_version}",
                                 "namespace": "kube-node-lease"}})
    assert sim.resource_version < held["Deployment"], (held, sim.resource_version)
    if not keep_watches:
        await sim.start()
    return source, time.monotonic()


@pytest.mark.parametrize("keep_watches", [False, True])
async def test_a_restore_one_watcher_sees_relists_every_watcher(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture,
        keep_watches: bool) -> None:
    """An etcd restored to a backup that only the Deployments watcher can tell (its
    version above the restored store's): every watcher of the API server relists. The
    pods and ReplicaSets watchers, at versions the restored store had passed, resumed in
    the new history with their old objects: ``extra``, not in the backup, stayed in the
    index, and ``web-1-0`` stayed in ``api`` (its ReplicaSet's owner after the backup,
    not in it), for good."""
    source, restored = await a_restore_one_watcher_sees(sim, make_source,
                                                        keep_watches=keep_watches)

    def live() -> set[str]:
        return {a.pod for a in source.index.pods.values()}

    await eventually(lambda: live() == {"web-1-0"} and (labels(
        source, "default", "web-1-0") or {}).get("karta_workload") == "web", timeout=10)
    assert time.monotonic() - restored < 8
    assert metric(source, "karta_proxy_watch_restarts_total",
                  {"resource": "pods", "reason": "restored"}) == 1
    assert metric(source, "karta_proxy_watch_restarts_total",
                  {"resource": "replicasets.apps", "reason": "restored"}) == 1
    assert not source.index.stale and source.index.ready
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
              and "restored or replaced" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("watch deployments.apps: "), warned
    if keep_watches:  # nothing failed: the relists never made the index stale
        assert not any("STALE" in r.getMessage() for r in caplog.records)


def _kind_of(source: KubeSource, pod_name: str) -> str | None:
    return (labels(source, "ml", pod_name) or {}).get("karta_kind")


async def test_a_crd_installed_later_is_watched_once_a_pod_names_its_kind(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """RayJob described, its CRDs (RayJob, RayCluster) installed while the proxy runs, a
    RayJob and its pods created at once. The first pod owned by a RayCluster tells that
    the kind is served now: discovery is asked again then, not at the next 30 s recheck.
    Before, the pods were unknown to the index (their owner kind unwatched:
    owner_missing) and the RayJob had no facts for up to the recheck interval: 27 s in
    the audit's run, CRD installed 3 s after the last recheck."""
    sim.unregister(RAY_JOB, RAY_CLUSTER)
    sim.create(RAYJOB_KARTA)
    source = await _slow_recheck_source(sim)
    try:
        rj = GroupKind("ray.io", "RayJob")
        assert rj in source.unserved_kinds
        sim.register(RAY_JOB, RAY_CLUSTER)
        names = rayjob(sim)
        await eventually(lambda: _kind_of(source, names[1]) == "RayJob", timeout=5)
        await eventually(lambda: any(f.ref.kind == "RayJob" and f.phase == "Running"
                                     for f in source.index.workloads.values()), timeout=5)
        assert not source.unserved_kinds
        assert metric(source, "karta_proxy_watch_unserved", {"resource": str(rj)}) == 0
    finally:
        await source.stop()


async def test_a_crd_deleted_then_installed_again_is_watched_again_at_once(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """The RayJob and RayCluster CRDs deleted while watched (their objects deleted with
    them, the pods left running), then installed again and a new RayJob created. The
    running pods keep their RayJob (its ghost); the kinds are unserved with one warning
    each; the new RayJob's pods are attributed as soon as one names its RayCluster.
    Before, a kind whose watch got 404 and that discovery no longer listed was held
    unserved for the recheck interval whatever discovery said: the new RayJob's pods were
    unknown to the index for 25 s in the audit's run."""
    sim.create(RAYJOB_KARTA)
    names = rayjob(sim)
    source = await _slow_recheck_source(sim)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    try:
        rj, rc = GroupKind("ray.io", "RayJob"), GroupKind("ray.io", "RayCluster")
        assert _kind_of(source, names[1]) == "RayJob"
        sim.unregister(RAY_JOB, RAY_CLUSTER)
        await eventually(lambda: {rj, rc} <= source.unserved_kinds.keys(), timeout=5)
        assert _kind_of(source, names[1]) == "RayJob"  # running, its workload's ghost
        await asyncio.sleep(0.5)  # a few follower rounds: no more warnings
        sim.register(RAY_JOB, RAY_CLUSTER)
        names2 = rayjob(sim, "train2")
        await eventually(lambda: _kind_of(source, names2[1]) == "RayJob", timeout=5)
        assert labels(source, "ml", names2[1])["karta_workload"] == "train2"  # type: ignore[index]
        assert not source.unserved_kinds
        for gk in (rj, rc):
            assert len(_logged(caplog, logging.WARNING, f"kind {gk} is needed but")) == 1
    finally:
        await source.stop()


async def test_a_description_kind_not_installed_is_said_at_info_not_warned(
        sim: KubeSim, caplog: pytest.LogCaptureFixture) -> None:
    """Most clusters lack the older ResourceInterface CRD for good: no attribution goes
    through a description kind, so its absence is an info line, where it was warned
    "needed but not served; attribution through it is unavailable" at every start."""
    sim.unregister(RESOURCE_INTERFACE)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    source = await _slow_recheck_source(sim)
    try:
        ri = GroupKind("optimization.nvidia.com", "ResourceInterface")
        assert ri in source.unserved_kinds
        assert not _logged(caplog, logging.WARNING, str(ri)), caplog.text
        assert _logged(caplog, logging.INFO, f"kind {ri} is not served by the cluster: no "
                       "descriptions are read from its objects")
    finally:
        await source.stop()
