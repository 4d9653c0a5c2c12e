"""KubeSource's reconcile, mode-switch, health and tombstone logic at the watcher seam.

A ``FakeCluster`` stands in for discovery and the watchers: watchers list when started
and get every change pushed synchronously, and a test drives the follower one round at
a time (``refresh_kinds``), so nothing here sleeps or waits for a condition. The watch
protocol itself is tested against the simulator in test_source.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.karta.model import GroupKind
from proxy.karta.results import ChangeSet
from proxy.kube.source import RESTORE_INTERVAL, SERVED_HINT_INTERVAL, KubeSource
from tests.clock import ManualClock
from tests.karta.descriptions import JOBSET_KARTA, RAYCLUSTER_KARTA, RAYJOB_KARTA
from tests.karta.runs import record_runs
from tests.kube.conftest import labels, metric, owner, pod
from tests.kube.fake_watcher import (
    BUILTIN,
    JOB_SET,
    RAY_CLUSTER,
    RAY_JOB,
    FakeCluster,
    FakeWatcher,
)

Obj = dict[str, Any]
RAY_JOB_GK = GroupKind("ray.io", "RayJob")
RAY_CLUSTER_GK = GroupKind("ray.io", "RayCluster")

@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(*BUILTIN, RAY_JOB, RAY_CLUSTER)


@pytest.fixture
def clock() -> ManualClock:
    """The index's clock (tombstone expiry) and the source's (retries of refused kinds)."""
    return ManualClock(1000.0)


Synced = Callable[..., Awaitable[KubeSource]]


@pytest.fixture
async def synced(cluster: FakeCluster, clock: ManualClock) -> AsyncIterator[Synced]:
    """A source over the fake cluster after its initial sync, with no follower task."""
    made: list[KubeSource] = []

    async def make(**settings: Any) -> KubeSource:
        source = KubeSource(KubeSettings(**settings), Engine(),
                            PodIndex(tombstone_seconds=60, clock=clock),
                            metrics_registry=CollectorRegistry(),
                            watchers=cluster, discovery=cluster, clock=clock)
        made.append(source)
        await source.sync()
        return source

    yield make
    for s in made:
        await s.stop()


def deployment(cluster: FakeCluster, name: str, ns: str = "default", replicas: int = 2,
               node: str = "n1") -> list[Obj]:
    dep = cluster.create({"apiVersion": "apps/v1", "kind": "Deployment",
                          "metadata": {"name": name, "namespace": ns},
                          "spec": {"replicas": replicas}})
    rs = cluster.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                         "metadata": {"name": f"{name}-1", "namespace": ns,
                                      "ownerReferences": owner(dep)}})
    return [cluster.create(pod(f"{name}-1-{i}", ns, owner_obj=rs, node=node))
            for i in range(replicas)]


def ray_cluster(cluster: FakeCluster, name: str = "rc", ns: str = "ml") -> Obj:
    """A RayCluster with a head and two workers of group ``gpu``."""
    rc = cluster.create({
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"workerGroupSpecs": [{"groupName": "gpu", "replicas": 3}]},
        "status": {"state": "ready"},
    })
    cluster.create(pod(f"{name}-head", ns, owner_obj=rc, labels={"ray.io/node-type": "head"}))
    for i in range(2):
        cluster.create(pod(f"{name}-gpu-{i}", ns, owner_obj=rc,
                           labels={"ray.io/node-type": "worker", "ray.io/group": "gpu"}))
    return rc


def modes(source: KubeSource) -> dict[str, str]:
    return {gk.kind: mode for gk, (mode, _) in source.watchers.items()}


def watchers_of(source: KubeSource, gk: GroupKind) -> list[FakeWatcher]:
    ws = source.watchers[gk][1]
    assert all(isinstance(w, FakeWatcher) for w in ws)
    return [w for w in ws if isinstance(w, FakeWatcher)]


async def test_sync_watches_what_the_engine_needs(cluster: FakeCluster,
                                                  synced: Synced) -> None:
    deployment(cluster, "web")
    source = await synced()
    assert source.index.ready and not source.index.stale
    got = labels(source, "default", "web-1-0")
    assert got is not None and got["karta_workload"] == "web"
    assert modes(source) == {k: "full" for k in (
        "Pod", "Karta", "ResourceInterface", "ReplicaSet", "Deployment", "StatefulSet",
        "DaemonSet", "Job", "CronJob")}
    assert all(w.started and w.synced.is_set() for w in cluster.watchers)
    assert len(source.index.pods) == 2
    assert "pods" in source.index.freshness
    assert metric(source, "karta_proxy_watch_last_current_timestamp_seconds",
                  {"resource": "pods"}) > 0
    assert not source.unserved_kinds
    # nothing described changed: a follower round starts and stops nothing
    before = list(cluster.watchers)
    assert await source.refresh_kinds() == 0
    assert cluster.watchers == before and all(w.live for w in before)


async def test_owner_kind_switches_to_full_and_back(cluster: FakeCluster,
                                                    synced: Synced) -> None:
    """An owner kind is read metadata-only until a description names it; the switch
    stops the old watcher and hands its held objects to the new one (whose relist
    diffs against them), and losing the description switches back and retracts."""
    rc = ray_cluster(cluster)
    uid = rc["metadata"]["uid"]
    source = await synced()
    assert modes(source)["RayCluster"] == "metadata"
    [meta] = watchers_of(source, RAY_CLUSTER_GK)
    assert meta.metadata_only and meta.held == {uid: "ml/rc"}
    assert uid not in source.index.workloads

    karta = cluster.create(RAYCLUSTER_KARTA)
    assert source.kinds_pending  # the description asks for a new mode
    assert await source.refresh_kinds() == 0
    assert not source.kinds_pending
    assert modes(source)["RayCluster"] == "full"
    [full] = watchers_of(source, RAY_CLUSTER_GK)
    assert meta.stopped and full.live and not full.metadata_only
    assert full.held_at_start == {uid: "ml/rc"}
    facts = source.index.workloads[uid]
    assert facts.phase.lower() == "running"
    replicas = {(r.component, r.instance): (r.desired, r.observed) for r in facts.replicas}
    assert replicas == {("worker", "gpu"): (3, 2), ("head", ""): (1, 1)}
    assert (labels(source, "ml", "rc-gpu-1") or {}).get("karta_instance") == "gpu"

    rc["status"] = {"state": "failed"}
    cluster.update(rc)
    assert source.index.workloads[uid].phase.lower() == "failed"

    cluster.delete(karta)
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayCluster"] == "metadata"
    assert full.stopped
    assert uid not in source.index.workloads
    assert labels(source, "ml", "rc-head") is None


async def test_description_added_after_its_workloads_then_deleted(
        cluster: FakeCluster, synced: Synced) -> None:
    """Pods under a RayCluster under a RayJob: unattributed until a description names
    RayJob, attributed to it while it exists, unattributed again once it is deleted."""
    job = cluster.create({
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"rayClusterSpec": {"headGroupSpec": {"template": {}},
                                    "workerGroupSpecs": [{"groupName": "gpu",
                                                          "template": {}}]}},
        "status": {"jobStatus": "RUNNING"},
    })
    rc = cluster.create({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                         "metadata": {"name": "train-rc", "namespace": "ml",
                                      "ownerReferences": owner(job)}})
    cluster.create(pod("train-head", "ml", owner_obj=rc, labels={"ray.io/node-type": "head"}))
    cluster.create(pod("train-gpu-0", "ml", owner_obj=rc,
                       labels={"ray.io/node-type": "worker", "ray.io/group": "gpu"}))
    source = await synced()
    assert labels(source, "ml", "train-head") is None  # nothing describes RayJob yet
    assert modes(source)["RayJob"] == "metadata"  # seen as an owner on the chain
    karta = cluster.create(RAYJOB_KARTA)
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayJob"] == "full"
    worker = labels(source, "ml", "train-gpu-0") or {}
    assert (worker.get("karta_kind"), worker.get("karta_workload")) == ("RayJob", "train")
    assert worker.get("karta_component") == "worker" and worker.get("karta_instance") == "gpu"
    cluster.delete(karta)
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayJob"] == "metadata"
    assert labels(source, "ml", "train-head") is None
    assert source.index.ready


async def test_a_description_change_after_the_sync_is_given_in_slices_by_the_follower(
        cluster: FakeCluster, synced: Synced) -> None:
    """A description object's change re-attributes nothing in its watch event's slice
    (one slice for every pod of the kind held the loop for seconds at scale): what it
    owes is given by the follower's next round, in slices. During the sync it is given
    at once, before the index is ready."""
    karta = cluster.create(RAYCLUSTER_KARTA)
    for i in range(700):
        ray_cluster(cluster, f"rc{i}")
    source = await synced()
    assert (labels(source, "ml", "rc5-gpu-1") or {}).get("karta_workload") == "rc5"
    runs = record_runs(source.engine)  # type: ignore[arg-type]
    cluster.delete(karta)
    # owed, not given yet: the pods keep their attribution, and the follower is woken
    assert (labels(source, "ml", "rc5-gpu-1") or {}).get("karta_workload") == "rc5"
    assert source.kinds_pending and not runs
    assert await source.refresh_kinds() == 0
    assert labels(source, "ml", "rc5-gpu-1") is None
    assert labels(source, "ml", "rc699-head") is None
    # the 700 RayClusters, each with its 3 pods; slices start at 16 and at most double
    assert sum(runs) == 700 and len(runs) >= 6, runs


async def test_an_engine_failure_in_a_slice_owed_loses_only_its_culprit(
        cluster: FakeCluster, synced: Synced, caplog: pytest.LogCaptureFixture) -> None:
    """Only the owed object whose re-attribution fails keeps, with what lies below it,
    its old attribution (counted and logged); the rest of its slice is given."""
    karta = cluster.create(RAYCLUSTER_KARTA)
    bad = ray_cluster(cluster, "a")["metadata"]["uid"]
    ray_cluster(cluster, "b")
    ray_cluster(cluster, "c")
    source = await synced()
    real = source.engine.reattribute

    def failing(uids: Iterable[str]) -> ChangeSet:
        uids = list(uids)
        if bad in uids:
            raise RuntimeError("engine bug")
        return real(uids)

    source.engine.reattribute = failing  # type: ignore[method-assign]
    # the kind stays described (a deleted description would re-attribute its objects
    # again as their watch changes mode): only the owed re-attribution moves the labels
    renamed = json.loads(json.dumps(karta).replace('"name": "worker"', '"name": "gpu"'))
    cluster.update(renamed)
    with caplog.at_level(logging.ERROR):
        assert await source.refresh_kinds() == 0
    assert source.object_errors == 1
    # the batch's traceback once, the culprit in one line
    failures = [r for r in caplog.records if "engine failed" in r.getMessage()]
    assert [r.exc_info is not None for r in failures] == [True, False], failures
    assert bad in failures[1].getMessage() and "engine bug" in failures[1].getMessage()
    for rc, component in (("a", "worker"), ("b", "gpu"), ("c", "gpu")):
        assert (labels(source, "ml", f"{rc}-gpu-0") or {}).get("karta_component") == component


async def test_mode_switch_relist_retracts_what_vanished_meanwhile(
        cluster: FakeCluster, synced: Synced) -> None:
    kept = ray_cluster(cluster, "kept")
    lost = cluster.create({"apiVersion": "ray.io/v1", "kind": "RayCluster",  # no pods
                           "metadata": {"name": "lost", "namespace": "ml"}})
    source = await synced()
    cluster.delete_quietly(lost)  # the metadata watch missed this deletion
    cluster.create(RAYCLUSTER_KARTA)
    assert await source.refresh_kinds() == 0
    [full] = watchers_of(source, RAY_CLUSTER_GK)
    assert lost["metadata"]["uid"] in full.held_at_start
    assert set(full.held) == {kept["metadata"]["uid"]}
    assert set(source.index.workloads) >= {kept["metadata"]["uid"]}
    assert lost["metadata"]["uid"] not in source.index.workloads


async def test_a_description_gone_and_back_before_the_round_lists_its_kind_whole_again(
        cluster: FakeCluster, synced: Synced) -> None:
    """A kind's description deleted and created again between two follower rounds: its
    watch stays full throughout, but what came meanwhile was kept without its body
    (the kind was not described then). The round lists the kind again whole; the
    RayCluster changed in the gap read ``workload_object_missing`` (phase Undefined, no
    desired replicas) until its next change otherwise (found by
    tests/kube/test_source_stateful.py)."""
    karta = cluster.create(RAYCLUSTER_KARTA)
    rc = ray_cluster(cluster)
    uid = rc["metadata"]["uid"]
    source = await synced()
    [full] = watchers_of(source, RAY_CLUSTER_GK)
    cluster.delete(karta)
    rc["status"] = {"state": "failed"}
    cluster.update(rc)  # the kind is not described now: kept without its body
    cluster.create(RAYCLUSTER_KARTA)
    assert await source.refresh_kinds() == 0
    facts = source.index.workloads[uid]
    assert (facts.phase.lower(), facts.phase_reason) == ("failed", "")
    replicas = {(r.component, r.instance): (r.desired, r.observed) for r in facts.replicas}
    assert replicas == {("worker", "gpu"): (3, 2), ("head", ""): (1, 1)}
    assert modes(source)["RayCluster"] == "full"
    [again] = watchers_of(source, RAY_CLUSTER_GK)
    assert full.stopped and again.live and again.held_at_start == {uid: "ml/rc"}
    # a round with nothing lapsed lists nothing again
    assert await source.refresh_kinds() == 0
    assert watchers_of(source, RAY_CLUSTER_GK) == [again]


async def test_kind_no_longer_needed_is_dropped_and_retracted(cluster: FakeCluster,
                                                              synced: Synced) -> None:
    job = cluster.create({
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"rayClusterSpec": {"headGroupSpec": {"template": {}}}},
        "status": {"jobStatus": "RUNNING"},
    })
    source = await synced()
    assert "RayJob" not in modes(source)  # nothing needs it: no pod, no description
    karta = cluster.create(RAYJOB_KARTA)
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayJob"] == "full" and modes(source)["RayCluster"] == "metadata"
    [w] = watchers_of(source, RAY_JOB_GK)
    assert job["metadata"]["uid"] in source.index.workloads
    w.fail()
    assert source.index.stale
    cluster.delete(karta)
    assert await source.refresh_kinds() == 0
    assert "RayJob" not in modes(source) and "RayCluster" not in modes(source)
    assert w.stopped and not w.held
    assert job["metadata"]["uid"] not in source.index.workloads
    assert not source.index.stale  # a dropped watch no longer counts as cut off


async def test_deleted_pod_is_a_tombstone_until_it_expires(
        cluster: FakeCluster, synced: Synced, clock: ManualClock) -> None:
    old = deployment(cluster, "web", replicas=2)
    source = await synced()
    cluster.delete(old[0])
    assert source.index.tombstones() == 1
    assert {a.pod for a in source.index.pods.values()} == {"web-1-1"}
    kept = labels(source, "default", "web-1-0")
    assert kept is not None and kept["karta_workload"] == "web"  # late samples still match
    clock.now += 59
    source.index.expire()
    assert labels(source, "default", "web-1-0") == kept
    clock.now += 2
    source.index.expire()
    assert labels(source, "default", "web-1-0") is None
    assert source.index.tombstones() == 0


async def test_name_reused_by_a_new_pod_owns_it_not_the_tombstone(
        cluster: FakeCluster, synced: Synced) -> None:
    [old] = deployment(cluster, "db", replicas=1)
    source = await synced()
    cluster.delete(old)
    new = dict(old, metadata={k: v for k, v in old["metadata"].items() if k != "uid"})
    new = cluster.create(new)
    assert new["metadata"]["uid"] in source.index.pods
    assert old["metadata"]["uid"] not in source.index.pods
    assert source.index.tombstones() == 0
    assert labels(source, "default", "db-1-0") is not None


async def test_relist_diff_deletion_is_a_tombstone(cluster: FakeCluster,
                                                   synced: Synced) -> None:
    """A pod deleted while the watch was down comes back as a relist deletion: the
    source treats it as any deletion (a tombstone, not a lost name)."""
    pods = deployment(cluster, "web", replicas=2)
    source = await synced()
    [w] = watchers_of(source, GroupKind("", "Pod"))
    cluster.delete_quietly(pods[0])
    await w.stop()
    relist = cluster(w.resource, source, metadata_only=False, namespace=None,
                     field_selector="", held=w.held)
    relist.start()
    assert source.index.tombstones() == 1
    assert labels(source, "default", "web-1-0") is not None


async def test_unserved_kind_is_reported_then_picked_up(cluster: FakeCluster,
                                                        synced: Synced) -> None:
    cluster.create(JOBSET_KARTA)
    source = await synced()
    gk = JOB_SET.group_kind
    assert source.unserved_kinds == {gk: "not served by the cluster"}
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}) == 1
    assert source.index.ready  # never held hostage by a missing CRD
    assert await source.refresh_kinds() == 0  # still missing: no watch, asked again
    assert gk not in source.watchers and cluster.invalidations == 1
    cluster.serve(JOB_SET)  # the CRD is installed
    assert await source.refresh_kinds() == 0
    assert cluster.invalidations == 2
    assert modes(source)["JobSet"] == "full" and not source.unserved_kinds
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(gk)}) == 0


async def test_an_object_naming_an_unserved_kind_asks_again_at_most_every_5_s(
        cluster: FakeCluster, synced: Synced, clock: ManualClock) -> None:
    """A Job naming a JobSet (its CRD installed since) wakes the follower at once; more
    objects naming it (a deleted CRD's objects' Jobs and pods, for as long as they run)
    wake it at most once every SERVED_HINT_INTERVAL, each round a discovery request."""
    cluster.create(JOBSET_KARTA)
    source = await synced()
    gk = JOB_SET.group_kind
    assert gk in source.unserved_kinds
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": "js", "namespace": "ml", "uid": "js-uid"}}
    assert not source.kinds_pending
    cluster.create({"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "js-0", "namespace": "ml",
                                 "ownerReferences": owner(jobset)}})
    assert source.kinds_pending
    assert await source.refresh_kinds() == 0  # not listed yet: still unserved
    assert gk in source.unserved_kinds
    cluster.create({"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "js-1", "namespace": "ml",
                                 "ownerReferences": owner(jobset)}})
    assert not source.kinds_pending  # asked 0 s ago
    clock.now += SERVED_HINT_INTERVAL
    cluster.serve(JOB_SET)
    cluster.create({"apiVersion": "batch/v1", "kind": "Job",
                    "metadata": {"name": "js-2", "namespace": "ml",
                                 "ownerReferences": owner(jobset)}})
    assert source.kinds_pending
    assert await source.refresh_kinds() == 0
    assert modes(source)["JobSet"] == "full" and not source.unserved_kinds


async def test_forbidden_watch_is_reported_dropped_and_retried(cluster: FakeCluster,
                                                               synced: Synced,
                                                               clock: ManualClock) -> None:
    cluster.create(RAYJOB_KARTA)
    source = await synced()
    [w] = watchers_of(source, RAY_JOB_GK)
    assert not source.kinds_pending
    w.refuse(403)
    assert source.unserved_kinds == {RAY_JOB_GK: "forbidden (RBAC)"}
    assert source.kinds_pending  # the follower is woken to drop it
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(RAY_JOB_GK)}) == 1
    assert await source.refresh_kinds() == 0
    assert w.stopped and RAY_JOB_GK not in source.watchers
    # discovery still lists it (RBAC forbids, it does not unserve): no new watch before
    # the recheck interval, however often the follower runs (it was a tight loop)
    clock.now += 29.0
    for _ in range(3):
        assert await source.refresh_kinds() == 0
    assert RAY_JOB_GK not in source.watchers
    assert source.unserved_kinds == {RAY_JOB_GK: "forbidden (RBAC)"}
    clock.now += 1.0
    assert await source.refresh_kinds() == 0  # retried (RBAC fixed: it lists)
    [again] = watchers_of(source, RAY_JOB_GK)
    assert again is not w and again.live
    assert not source.unserved_kinds
    assert metric(source, "karta_proxy_watch_unserved", {"resource": str(RAY_JOB_GK)}) == 0


async def test_unreachable_watch_marks_the_index_stale(cluster: FakeCluster,
                                                       synced: Synced) -> None:
    deployment(cluster, "web", replicas=1)
    source = await synced()
    [pods] = watchers_of(source, GroupKind("", "Pod"))
    [rs] = watchers_of(source, GroupKind("apps", "ReplicaSet"))
    pods.fail()
    rs.fail()
    assert source.index.stale
    assert labels(source, "default", "web-1-0") is not None  # served as last known
    pods.recover()
    assert source.index.stale  # one watch is still cut off
    rs.recover()
    assert not source.index.stale


def _outage_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(level, message) of the source's outage lines: warnings, and info lines of an
    outage's end."""
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "proxy.kube.source" and (
                (r.levelno == logging.WARNING and r.getMessage().startswith("watch "))
                or (r.levelno == logging.INFO and " after " in r.getMessage()))]


async def test_an_outage_after_a_kind_failing_for_good_is_warned_and_its_end_logged(
        cluster: FakeCluster, synced: Synced, caplog: pytest.LogCaptureFixture) -> None:
    """A kind failing for good (a conversion webhook's 500), then the API server going
    away: that is a warning of its own, and its end a line. Keyed on "no watcher failing
    -> some", the second failure was debug only, and no line said it was over."""
    deployment(cluster, "web", replicas=1)
    source = await synced()
    [pods] = watchers_of(source, GroupKind("", "Pod"))
    [rs] = watchers_of(source, GroupKind("apps", "ReplicaSet"))
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    rs.fail("API error 500", "API error 500 InternalError: conversion webhook")
    pods.fail("unreachable", "API server unreachable: connection refused")
    pods.recover()
    assert _outage_lines(caplog) == [
        ("WARNING", "watch replicasets.apps: API error 500 InternalError: conversion "
                    "webhook; every watch failing so retries with its backoff (the others "
                    "failing so are logged at debug level)"),
        ("WARNING", "watch pods: API server unreachable: connection refused; every watch "
                    "failing so retries with its backoff (the others failing so are logged "
                    "at debug level)"),
        ("INFO", "API server answers again: every watch is back after 0.0 s"),
    ]
    assert source.index.stale  # the 500 goes on
    rs.recover()
    assert _outage_lines(caplog)[-1] == (
        "INFO", "watches failing with API error 500: none left after 0.0 s (the last, "
                "replicasets.apps, is back)")
    assert not source.index.stale


async def test_a_new_way_of_failing_during_an_outage_is_warned(
        cluster: FakeCluster, synced: Synced, clock: ManualClock,
        caplog: pytest.LogCaptureFixture) -> None:
    """The API server goes away; it comes back, but one kind answers 500 now. The 500 is
    a warning (it was debug: an outage was already on), the others coming back end the
    outage with its line, and a watcher moving from one way of failing to another moves
    from one outage to the other."""
    deployment(cluster, "web", replicas=1)
    source = await synced()
    [pods] = watchers_of(source, GroupKind("", "Pod"))
    [rs] = watchers_of(source, GroupKind("apps", "ReplicaSet"))
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    pods.fail()
    rs.fail()
    clock.now += 5.0
    rs.fail("API error 500")
    pods.recover()
    lines = _outage_lines(caplog)
    assert [level for level, _ in lines] == ["WARNING", "WARNING", "INFO"]
    assert lines[0][1].startswith("watch pods: unreachable")
    assert lines[1][1].startswith("watch replicasets.apps: API error 500 (fake); ")
    assert lines[2][1] == "API server answers again: every watch is back after 5.0 s"
    assert source.index.stale and source._unhealthy == {"replicasets.apps": "API error 500"}


async def test_the_last_watch_cut_off_answering_with_an_error_ends_the_outage(
        cluster: FakeCluster, synced: Synced, clock: ManualClock,
        caplog: pytest.LogCaptureFixture) -> None:
    """The last watcher cut off from the API server hears from it again, but a 500: the
    server answers (that line), and the 500 is an outage of its own (a warning)."""
    deployment(cluster, "web", replicas=1)
    source = await synced()
    [pods] = watchers_of(source, GroupKind("", "Pod"))
    [rs] = watchers_of(source, GroupKind("apps", "ReplicaSet"))
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    pods.fail()
    rs.fail()
    clock.now += 3.0
    pods.recover()
    rs.fail("API error 500")
    assert _outage_lines(caplog)[1:] == [
        ("INFO", "API server answers again after 3.0 s (the last watch cut off, "
                 "replicasets.apps, fails otherwise now: API error 500)"),
        ("WARNING", "watch replicasets.apps: API error 500 (fake); every watch failing so "
                    "retries with its backoff (the others failing so are logged at debug "
                    "level)"),
    ]


async def test_a_failing_watch_dropped_or_replaced_ends_its_outage_with_a_line(
        cluster: FakeCluster, synced: Synced, clock: ManualClock,
        caplog: pytest.LogCaptureFixture) -> None:
    """A watcher failing alone that is dropped (its kind no longer needed) or replaced
    (a mode switch) ends its outage: one info line, and the next failure is warned again.
    It was discarded without a line, and a later failure of that kind stayed at debug
    level as long as another watcher failed."""
    source = await synced()
    caplog.set_level(logging.DEBUG, logger="proxy.kube")
    karta = cluster.create(RAYJOB_KARTA)
    assert await source.refresh_kinds() == 0
    [job] = watchers_of(source, RAY_JOB_GK)
    job.fail("API error 500")
    clock.now += 2.0
    cluster.delete(karta)
    assert await source.refresh_kinds() == 0
    assert RAY_JOB_GK not in source.watchers and not source.index.stale
    assert _outage_lines(caplog)[-1] == (
        "INFO", "watches failing with API error 500: none left after 2.0 s (the last, "
                "rayjobs.ray.io, is no longer watched)")
    # replaced: a RayCluster watch, metadata-only for the RayJob's pods, failing; then a
    # RayCluster description makes it a full watch
    cluster.create(RAYJOB_KARTA)
    assert await source.refresh_kinds() == 0
    [meta] = watchers_of(source, RAY_CLUSTER_GK)
    assert meta.metadata_only
    meta.fail("API error 500")
    assert _outage_lines(caplog)[-1][0] == "WARNING"  # a new outage: warned again
    cluster.create(RAYCLUSTER_KARTA)
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayCluster"] == "full" and not source.index.stale
    assert _outage_lines(caplog)[-1] == (
        "INFO", "watches failing with API error 500: none left after 0.0 s (the last, "
                "rayclusters.ray.io, was replaced (mode switch))")
    assert not source._outages


async def test_the_first_page_after_an_outage_wakes_the_others_once(
        cluster: FakeCluster, synced: Synced) -> None:
    """The API server unreachable for every watcher: the first page of one's next list
    (``answered``) wakes the others failing at once, not at the end of that list (the
    pods' at 37.5k pods takes seconds); only once until it recovers or fails otherwise
    (a list cut at every retry's second page does not cut everyone's backoff at every
    retry); its recovery wakes those still failing, as before."""
    source = await synced()
    ws = [w for _, group in source.watchers.values() for w in group]
    assert all(isinstance(w, FakeWatcher) for w in ws) and len(ws) > 2
    fakes = [w for w in ws if isinstance(w, FakeWatcher)]
    for w in fakes:
        w.fail()
    [pods] = watchers_of(source, GroupKind("", "Pod"))
    others = [w for w in fakes if w is not pods]
    pods.answer()
    assert [w.woken for w in others] == [1] * len(others) and pods.woken == 0
    pods.answer()  # the next retry's first page: the others were told
    assert [w.woken for w in others] == [1] * len(others)
    others[0].recover()  # one back: those still failing are woken (not pods: it is too)
    assert others[0].woken == 1 and [w.woken for w in others[1:]] == [2] * len(others[1:])
    assert pods.woken == 1
    pods.fail("API error 500")  # failing otherwise now: its next answer wakes again
    pods.answer()
    assert [w.woken for w in others[1:]] == [3] * len(others[1:]) and others[0].woken == 1
    pods.recover()
    assert [w.woken for w in others[1:]] == [4] * len(others[1:])
    others[0].answer()  # a healthy watcher's page says nothing of an outage
    assert [w.woken for w in others[1:]] == [4] * len(others[1:])


async def test_discovery_failure_is_counted_and_retried(cluster: FakeCluster,
                                                        synced: Synced) -> None:
    source = await synced()
    cluster.create(RAYJOB_KARTA)
    cluster.discovery_error = OSError("connection refused")
    assert await source.refresh_kinds() == 2  # RayJob and RayCluster
    assert "RayJob" not in modes(source)
    cluster.discovery_error = None
    assert await source.refresh_kinds() == 0
    assert modes(source)["RayJob"] == "full"


async def test_namespaces_and_node_name_shape_the_watches(cluster: FakeCluster,
                                                          synced: Synced) -> None:
    deployment(cluster, "a-here", ns="team-a", node="n1")
    deployment(cluster, "a-there", ns="team-a", node="n2")
    deployment(cluster, "b-here", ns="team-b", node="n1")
    deployment(cluster, "c-here", ns="team-c", node="n1")
    source = await synced(namespaces=["team-a", "team-b"], node_name="n1")
    pod_watches = watchers_of(source, GroupKind("", "Pod"))
    assert sorted(w.name for w in pod_watches) == ["team-a/pods", "team-b/pods"]
    assert {w.field_selector for w in pod_watches} == {"spec.nodeName=n1"}
    rs_watches = watchers_of(source, GroupKind("apps", "ReplicaSet"))
    assert {w.field_selector for w in rs_watches} == {""} and len(rs_watches) == 2
    [karta] = watchers_of(source, GroupKind("run.ai", "Karta"))
    assert karta.namespace is None  # cluster-scoped: one watch
    assert {(a.namespace, a.pod) for a in source.index.pods.values()} == {
        ("team-a", "a-here-1-0"), ("team-a", "a-here-1-1"),
        ("team-b", "b-here-1-0"), ("team-b", "b-here-1-1")}
    assert {"team-a/pods", "team-b/pods"} <= set(source.index.freshness)


async def test_descriptions_off_watches_no_description_kinds(cluster: FakeCluster,
                                                             synced: Synced) -> None:
    deployment(cluster, "web", replicas=1)
    source = await synced(watch_descriptions=False)
    assert "Karta" not in modes(source) and "ResourceInterface" not in modes(source)
    assert labels(source, "default", "web-1-0") is not None


async def test_a_restore_one_watcher_sees_has_every_other_relist_once(
        synced: Synced, cluster: FakeCluster, clock: ManualClock) -> None:
    """The Deployments watcher saw the API server's store go back: every other watcher
    of the source is told to relist, once. Findings of the same restore by watchers told
    already (their list of the new store not through yet) tell nobody again and are not
    new; once a watcher has listed the new store, a finding of it is a restore of its
    own. The other watchers kept their old objects before (``new_history`` told the
    owner fetcher alone): here a pod the restore took back."""
    deployment(cluster, "web", replicas=1)
    source = await synced()
    (deployments,) = cluster.live("Deployment")
    (pods,) = cluster.live("Pod")
    others = [w for w in cluster.watchers if w.live and w is not deployments]
    assert len(others) >= 3 and not any(w.history_pending for w in cluster.watchers)
    (gone,) = cluster.objects(GroupKind("", "Pod"))
    cluster.delete_quietly(gone)  # not in the restored store: no event says so

    assert source.new_history(deployments) is True
    assert [w.told_to_relist for w in others] == [1] * len(others)
    assert all(w.history_pending for w in others) and deployments.told_to_relist == 0
    deployments.history_pending = True  # as the watcher does after asking: its relist
    for w in others:  # the same restore found again before their lists: coalesced
        assert source.new_history(w) is False
    assert [w.told_to_relist for w in [deployments, *others]] == [0] + [1] * len(others)
    assert gone["metadata"]["uid"] in source.index.pods

    for w in [deployments, *others]:
        w.relist()
    assert gone["metadata"]["uid"] not in source.index.pods
    assert not any(w.history_pending for w in cluster.watchers)
    # after its list: another restore; within RESTORE_INTERVAL of the first, the watcher
    # that saw it relists alone (a kind whose versions keep going back must not relist
    # every watcher each time)
    clock.now += RESTORE_INTERVAL - 1
    assert source.new_history(pods) is False  # the source's warning is the line
    assert [w.told_to_relist for w in [deployments, *others]] == [0] + [1] * len(others)
    clock.now += 1
    assert source.new_history(pods) is True
    assert pods.told_to_relist == 1 and deployments.told_to_relist == 1
    assert [w.told_to_relist for w in others if w is not pods] == [2] * (len(others) - 1)
