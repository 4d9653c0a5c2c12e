"""Engine.explain: the owner chain walked again agrees with the engine's own answer."""

from __future__ import annotations

from typing import Any

from proxy.demo import BUNDLED_SNAPSHOT
from proxy.karta.engine import Engine
from proxy.karta.explain import (
    END_HOP_LIMIT,
    END_NO_CONTROLLER,
    END_OWNER_MISSING,
    END_TOP,
)
from proxy.snapshot import load_snapshot
from tests.karta.test_engine import obj, pod


def test_every_demo_pod_explained_as_the_engine_placed_it() -> None:
    """The workload link is the engine's workload, and nothing above it is described
    (the topmost described owner wins); unattributed pods have no workload link."""
    e = Engine()
    load_snapshot(BUNDLED_SNAPSHOT, e)
    atts = list(e.pods())
    assert len(atts) == 16
    for att in atts:
        ex = e.explain(att.namespace, att.pod)
        assert ex is not None
        assert ex.attribution == e.pod(att.uid) == att
        tops = [i for i, link in enumerate(ex.chain) if link.workload]
        if att.workload is None or att.workload.uid == att.uid:
            assert tops == [], att
            continue
        assert len(tops) == 1, att
        top = ex.chain[tops[0]]
        assert (top.kind, top.group, top.name) == (
            att.workload.kind, att.workload.group, att.workload.name)
        assert top.description == att.description
        assert not any(link.described for link in ex.chain[tops[0] + 1:]), att


def test_demo_chains_read_as_documented() -> None:
    e = Engine()
    load_snapshot(BUNDLED_SNAPSHOT, e)
    ex = e.explain("web", "frontend-6d8f7b9c5d-4xkqp")
    assert ex is not None and ex.walk_end == END_TOP
    assert [(link.kind, link.name, link.description, link.workload) for link in ex.chain] == [
        ("ReplicaSet", "frontend-6d8f7b9c5d", "builtin-apps-replicaset", False),
        ("Deployment", "frontend", "builtin-apps-deployment", True),
    ]
    ex = e.explain("ml", "allreduce-bench-worker-0")
    assert ex is not None and ex.attribution.reason == "no_described_owner"
    assert [(link.kind, link.described, link.workload) for link in ex.chain] == [
        ("MPIJob", False, False)]
    ex = e.explain("default", "debug-shell")
    assert ex is not None and ex.chain == () and ex.walk_end == END_NO_CONTROLLER
    assert ex.attribution.workload is not None and ex.attribution.workload.kind == "Pod"
    assert e.explain("web", "no-such-pod") is None
    assert e.explain("ml", "frontend-6d8f7b9c5d-4xkqp") is None  # namespace counts


def _chain(n: int) -> list[dict[str, Any]]:
    """``n`` undescribed owners, each controlling the next, the last a pod's."""
    objs: list[dict[str, Any]] = []
    owner = None
    for i in range(n):
        o = obj("example.com/v1", "Thing", f"t{i}", owner)
        objs.append(o)
        owner = o
    objs.append(pod("p", owner))
    return objs


def test_hop_limit_and_missing_owner_end_the_walk() -> None:
    e = Engine(max_owner_hops=3)
    e.upsert_many(_chain(5))
    ex = e.explain("team-a", "p")
    assert ex is not None
    assert ex.attribution.reason == "hop_limit" and ex.walk_end == END_HOP_LIMIT
    assert [link.name for link in ex.chain] == ["t4", "t3", "t2"]
    assert ex.max_owner_hops == 3

    e = Engine()
    objs = _chain(2)
    e.upsert_many([objs[0], objs[2]])  # t1, the pod's owner, not seen
    ex = e.explain("team-a", "p")
    assert ex is not None
    assert ex.attribution.reason == "owner_missing" and ex.walk_end == END_OWNER_MISSING
    assert [(link.name, link.seen) for link in ex.chain] == [("t1", False)]


def test_explain_changes_nothing() -> None:
    e = Engine()
    load_snapshot(BUNDLED_SNAPSHOT, e)
    before = (sorted(map(repr, e.pods())), sorted(map(repr, e.workloads())), dict(e.stats))
    for att in list(e.pods()):
        e.explain(att.namespace, att.pod)
    assert (sorted(map(repr, e.pods())), sorted(map(repr, e.workloads())),
            dict(e.stats)) == before
