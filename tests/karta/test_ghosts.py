"""Ghosts of removed owners: a cascade delete keeps the pods' workload.

Kubernetes' background propagation deletes the top owner first (Deployment, JobSet,
RayJob), then its dependents (ReplicaSet, Job, RayCluster), then the pods, which terminate
gracefully meanwhile. A pod must keep the workload it had while the chain was whole until
it is gone, whichever order the deletions arrive in, and be placed again once the ghost
it walks through expires.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from proxy.karta.engine import Engine
from proxy.karta.results import ChangeSet, PodAttribution
from tests.clock import ManualClock
from tests.karta.clusters import FIXTURES, SAMPLES, Cluster, load_cluster, uid_of
from tests.karta.test_samples import _engine as sample_engine

TTL = 600.0


def _load(fixture: str, names: list[str]) -> tuple[Engine, Cluster, ManualClock]:
    cluster = load_cluster(FIXTURES / fixture)
    if names and not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")
    clock = ManualClock(100.0)
    engine = sample_engine(cluster, names)
    # the same engine, with ghosts timed by the test's clock
    engine._graph._clock = clock
    engine._graph.ghost_seconds = TTL
    engine.upsert_many(cluster.everything)
    return engine, cluster, clock


def _by_name(cluster: Cluster, kind: str, name: str) -> dict[str, Any]:
    for o in cluster.everything:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"{kind}/{name}")


def _ident(att: PodAttribution | None) -> tuple[str, str, str, str, str] | None:
    if att is None or att.workload is None:
        return None
    w = att.workload
    return (w.kind, w.name, w.uid, att.component, att.instance)


#: (fixture, description set, top owner, intermediate owner, a pod below it)
CASCADES = [
    pytest.param("builtin-deployment.yaml", [], ("Deployment", "web"),
                 ("ReplicaSet", "web-5c7d9f8b6"), "web-5c7d9f8b6-4xk2p", id="deployment"),
    pytest.param("jobset.yaml", ["ri-jobset.yaml"], ("JobSet", "train"),
                 ("Job", "train-workers-0"), "train-workers-0-1-d3e4f", id="jobset"),
    pytest.param("rayjob.yaml", ["wm-rayjob.yaml"], ("RayJob", "etl"),
                 ("RayCluster", "etl-raycluster-k9x2m"), "etl-raycluster-k9x2m-head-p8q7r",
                 id="rayjob"),
    pytest.param("rayjob.yaml", ["wm-rayjob.yaml", "wm-raycluster.yaml"], ("RayJob", "etl"),
                 ("RayCluster", "etl-raycluster-k9x2m"), "etl-raycluster-k9x2m-head-p8q7r",
                 id="rayjob+raycluster"),
]

#: how the two deletions arrive: top first (the garbage collector's order), the
#: intermediate first (watches of two kinds deliver in any order), or in one batch
ORDERS: dict[str, Callable[[Engine, dict[str, Any], dict[str, Any]], ChangeSet]] = {
    "top_first": lambda e, top, mid: _merged(e.delete(top), e.delete(mid)),
    "intermediate_first": lambda e, top, mid: _merged(e.delete(mid), e.delete(top)),
    "batch": lambda e, top, mid: e.delete_many([top, mid]),
    "batch_reversed": lambda e, top, mid: e.delete_many([mid, top]),
}


def _merged(a: ChangeSet, b: ChangeSet) -> ChangeSet:
    a.merge(b)
    return a


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize(("fixture", "names", "top", "mid", "pod"), CASCADES)
def test_cascade_delete_keeps_the_pods_workload(
    fixture: str, names: list[str], top: tuple[str, str], mid: tuple[str, str], pod: str,
    order: str,
) -> None:
    e, cluster, clock = _load(fixture, names)
    uid = uid_of("Pod", pod)
    before = _ident(e.pod(uid))
    assert before is not None and before[:2] == top
    every = {a.uid: _ident(a) for a in e.pods()}

    cs = ORDERS[order](e, _by_name(cluster, *top), _by_name(cluster, *mid))

    assert _ident(e.pod(uid)) == before
    assert {a.uid: _ident(a) for a in e.pods()} == every  # not one pod moved
    assert not cs.pods  # nothing to tell the index
    # no phantom workload of the intermediate kind
    assert {(f.ref.kind, f.ref.name) for f in e.workloads()} == {top}
    assert e.ghosts() >= 1

    # the ghost expires: the pod is placed again, as after any owner change
    clock.now += TTL - 1
    assert not e.expire_ghosts()
    clock.now += 2
    cs = e.expire_ghosts()
    assert e.ghosts() == 0
    after = e.pod(uid)
    assert uid in cs.pods and cs.pods[uid] == after
    assert _ident(after) != before
    # the same as an engine that never saw the deleted owners
    fresh = sample_engine(cluster, names)
    gone = {uid_of(*top), uid_of(*mid)}
    fresh.upsert_many([o for o in cluster.everything if o["metadata"]["uid"] not in gone])
    assert {a.uid: a for a in e.pods()} == {a.uid: a for a in fresh.pods()}
    assert {f.ref.uid: f for f in e.workloads()} == {f.ref.uid: f for f in fresh.workloads()}


def test_top_owner_alive_intermediate_deleted() -> None:
    """A JobSet recreating a failed Job: the old Job's pods still belong to the JobSet."""
    e, cluster, _ = _load("jobset.yaml", ["ri-jobset.yaml"])
    uid = uid_of("Pod", "train-workers-0-0-a1b2c")
    before = _ident(e.pod(uid))
    assert before is not None and before[:2] == ("JobSet", "train")
    e.delete(_by_name(cluster, "Job", "train-workers-0"))
    assert _ident(e.pod(uid)) == before
    assert {(f.ref.kind, f.ref.name) for f in e.workloads()} == {("JobSet", "train")}


def test_pods_gone_then_the_ghost_is_not_needed_and_expires_quietly() -> None:
    e, cluster, clock = _load("builtin-deployment.yaml", [])
    e.delete(_by_name(cluster, "Deployment", "web"))
    e.delete(_by_name(cluster, "ReplicaSet", "web-5c7d9f8b6"))
    e.delete(_by_name(cluster, "ReplicaSet", "web-6f4b8c9d7"))
    e.delete_many([p for p in cluster.pods])
    assert list(e.workloads()) == []
    clock.now += TTL + 1
    cs = e.expire_ghosts()
    assert e.ghosts() == 0
    assert not cs.pods and list(e.workloads()) == []


def test_owner_without_dependents_leaves_no_ghost() -> None:
    e, cluster, _ = _load("builtin-deployment.yaml", [])
    # the scaled-down ReplicaSet has no pods: nothing walks through it
    e.delete(_by_name(cluster, "ReplicaSet", "web-6f4b8c9d7"))
    assert e.ghosts() == 0


def test_ghost_dropped_when_the_uid_comes_back() -> None:
    e, cluster, clock = _load("builtin-deployment.yaml", [])
    rs = _by_name(cluster, "ReplicaSet", "web-5c7d9f8b6")
    uid = uid_of("Pod", "web-5c7d9f8b6-4xk2p")
    before = _ident(e.pod(uid))
    e.delete(rs)
    assert e.ghosts() == 1
    e.upsert(rs)  # a relist found it after all
    assert e.ghosts() == 0
    assert _ident(e.pod(uid)) == before
    clock.now += TTL + 1
    assert not e.expire_ghosts()  # nothing left to expire: the object is back
    # its edge to the Deployment is the object's again: deleting the Deployment now is
    # the usual absent-owner case
    e.delete(_by_name(cluster, "Deployment", "web"))
    assert _ident(e.pod(uid)) == before


def test_orphan_propagation_places_the_pod_by_its_update() -> None:
    """Orphan deletion: the garbage collector strips the owner references of the
    dependents, and the pod's update places it anew."""
    e, cluster, _ = _load("builtin-deployment.yaml", [])
    rs = _by_name(cluster, "ReplicaSet", "web-5c7d9f8b6")
    p = _by_name(cluster, "Pod", "web-5c7d9f8b6-4xk2p")
    e.delete(_by_name(cluster, "Deployment", "web"))
    orphan_rs = {**rs, "metadata": {k: v for k, v in rs["metadata"].items()
                                    if k != "ownerReferences"}}
    e.upsert(orphan_rs)
    att = e.pod(p["metadata"]["uid"])
    assert att is not None and att.workload is not None
    assert (att.workload.kind, att.workload.name) == ("ReplicaSet", "web-5c7d9f8b6")


def test_ghost_of_another_namespace_is_absent() -> None:
    """The cross-namespace owner rule holds for ghosts: a pod naming the uid of another
    namespace's removed object does not join that object's workload."""
    e = Engine(ghost_clock=ManualClock(0.0))
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "web", "namespace": "a", "uid": "d-1"},
           "spec": {"replicas": 1}}
    rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
          "metadata": {"name": "web-1", "namespace": "a", "uid": "rs-1",
                       "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                            "name": "web", "uid": "d-1",
                                            "controller": True}]},
          "spec": {"replicas": 1}}

    def pod(ns: str, name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "uid": f"p-{ns}-{name}",
                             "ownerReferences": [{"apiVersion": "apps/v1",
                                                  "kind": "ReplicaSet", "name": "web-1",
                                                  "uid": "rs-1", "controller": True}]},
                "status": {"phase": "Running"}}

    e.upsert_many([dep, rs, pod("a", "mine"), pod("b", "intruder")])
    mine, intruder = e.pod("p-a-mine"), e.pod("p-b-intruder")
    assert mine is not None and mine.workload is not None
    assert mine.workload.kind == "Deployment"
    assert intruder is not None and intruder.workload is None
    assert intruder.reason == "owner_missing"  # another namespace's owner: absent to it
    e.delete_many([dep, rs])
    assert e.ghosts() >= 1
    assert e.pod("p-a-mine") == mine
    # the ghost is another namespace's too: the intruder neither passes through it into
    # namespace a's Deployment nor gets it as its workload
    assert e.pod("p-b-intruder") == intruder


def test_count_bound_drops_the_oldest_and_replaces_its_pods() -> None:
    clock = ManualClock(0.0)
    e = Engine(ghost_clock=clock, max_ghosts=1)

    def chain(i: int) -> list[dict[str, Any]]:
        ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"web{i}",
               "uid": f"d-{i}", "controller": True}
        rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
              "metadata": {"name": f"web{i}-1", "namespace": "a", "uid": f"rs-{i}",
                           "ownerReferences": [ref]}, "spec": {"replicas": 1}}
        p = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"web{i}-1-x", "namespace": "a", "uid": f"p-{i}",
                          "ownerReferences": [{"apiVersion": "apps/v1",
                                               "kind": "ReplicaSet", "name": f"web{i}-1",
                                               "uid": f"rs-{i}", "controller": True}]},
             "status": {"phase": "Running"}}
        return [rs, p]

    e.upsert_many([*chain(0), *chain(1)])
    for i in (0, 1):
        att = e.pod(f"p-{i}")
        assert att is not None and att.workload is not None
        assert att.workload.kind == "Deployment"
    e.delete(chain(0)[0])
    cs = e.delete(chain(1)[0])  # the second ghost pushes the first out
    assert e.ghosts() == 1
    first = e.pod("p-0")
    assert first is not None and first.workload is not None
    assert first.workload.kind == "ReplicaSet"  # placed again, as at an expiry
    assert cs.pods.get("p-0") == first
    second = e.pod("p-1")
    assert second is not None and second.workload is not None
    assert second.workload.kind == "Deployment"


def test_no_ghosts_when_switched_off() -> None:
    e = Engine(ghost_seconds=0)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "web", "namespace": "a", "uid": "d-1"}}
    rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
          "metadata": {"name": "web-1", "namespace": "a", "uid": "rs-1",
                       "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                            "name": "web", "uid": "d-1",
                                            "controller": True}]}}
    p = {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "web-1-x", "namespace": "a", "uid": "p-1",
                      "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                           "name": "web-1", "uid": "rs-1",
                                           "controller": True}]}}
    e.upsert_many([dep, rs, p])
    e.delete_many([dep, rs])
    assert e.ghosts() == 0
    att = e.pod("p-1")
    assert att is not None and att.workload is not None
    assert att.workload.kind == "ReplicaSet"


def test_explain_marks_the_links_walked_through_ghosts() -> None:
    e, cluster, _ = _load("jobset.yaml", ["ri-jobset.yaml"])
    e.delete(_by_name(cluster, "JobSet", "train"))
    e.delete(_by_name(cluster, "Job", "train-workers-0"))
    ex = e.explain("team-a", "train-workers-0-1-d3e4f")
    assert ex is not None
    assert [(link.kind, link.name, link.seen, link.ghost, link.workload)
            for link in ex.chain] == [
        ("Job", "train-workers-0", False, True, False),
        ("JobSet", "train", False, True, True),
    ]
    assert ex.walk_end == "owner_missing"  # ended at a ghost: at an absent owner
