"""Long owner chains: what an owner's change costs is bounded by what it can affect.

Anyone who may create ReplicaSets (or any kind a description names) in a namespace sets
ownerReferences freely, so a tenant can make a chain of thousands of objects. A walk
stops at ``max_owner_hops``, so an object more than that many references above another
cannot change the other's attribution (a pod's, whose walk may go on from a described
object it passed: twice that). An owner's change re-attributes what lies below it to that
depth only; every owner added to the bottom of a chain re-attributed the whole chain
below it before (quadratic: 2,000 ReplicaSets added one at a time took 34-52 s).

Checked here: the work (owner walks) per event is bounded, the whole chain linear, and
the results are those of the old fan-out to everything below (kept in the test) and of a
fresh engine fed the final state, over random histories of deep chains, re-parenting,
cycles, pods at every depth, deletions (ghosts) and object changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.karta.engine import Engine
from proxy.karta.owners import OwnerGraph
from proxy.karta.results import ChangeSet
from tests.clock import ManualClock
from tests.karta.test_engine_properties import KINDS, MID, TOP, _follow

NS = "ns"


class WalkCounter:
    """Counts the owner walks an engine makes (a hook on its graph's ``walk``); fails at
    once past ``limit``, so that quadratic work fails fast instead of running for
    minutes."""

    def __init__(self, engine: Engine, limit: int = 10**9) -> None:
        self.n = 0
        self.limit = limit
        graph = engine._graph
        walk = graph.walk

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            if self.n > self.limit:
                raise AssertionError(f"more than {self.limit} owner walks")
            return walk(*args, **kwargs)

        graph.walk = counted  # type: ignore[method-assign]


# -- the work: linear in the chain ----------------------------------------------------------


def _chain_object(i: int, n: int, kind: str) -> dict[str, Any]:
    api = "v1" if kind == "ConfigMap" else "apps/v1"
    md: dict[str, Any] = {"name": f"c{i}", "namespace": NS, "uid": f"C{i}"}
    if i < n - 1:
        md["ownerReferences"] = [{"apiVersion": api, "kind": kind, "name": f"c{i + 1}",
                                  "uid": f"C{i + 1}", "controller": True}]
    return {"apiVersion": api, "kind": kind, "metadata": md, "spec": {}}


def _chain_pods(kind: str, n: int = 50) -> list[dict[str, Any]]:
    api = "v1" if kind == "ConfigMap" else "apps/v1"
    return [{"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"p{j}", "namespace": NS, "uid": f"P{j}",
        "ownerReferences": [{"apiVersion": api, "kind": kind, "name": "c0", "uid": "C0",
                             "controller": True}]}, "spec": {}, "status": {}}
        for j in range(n)]


N_CHAIN = 2000
HOPS = 6
#: walks an event may cost in the tests' chains: the object itself and the objects up to
#: ``HOPS`` below it (a walk each), the 50 pods up to ``2 * HOPS`` below (two walks each,
#: when the first stops at the limit above a described object)
PER_EVENT = 1 + HOPS + 2 * 50


@pytest.mark.parametrize("kind", ["ReplicaSet", "ConfigMap"])
@pytest.mark.parametrize("batch", [False, True], ids=["events", "batch"])
def test_chain_added_bottom_up_costs_linear_work(kind: str, batch: bool) -> None:
    """A 2,000-object chain added from the pods' end up, one event at a time or in one
    batch: each owner added re-attributes what lies within reach below it, not the
    whole chain (2,000,000 walks before, ~N^2 / 2)."""
    e = Engine(max_owner_hops=HOPS)
    e.upsert_many(_chain_pods(kind))
    objs = [_chain_object(i, N_CHAIN, kind) for i in range(N_CHAIN)]
    # the first 2 * HOPS owners reach the pods; every owner reaches HOPS objects
    count = WalkCounter(e, limit=N_CHAIN * (1 + HOPS) + 2 * HOPS * 2 * 50)
    if batch:
        e.upsert_many(objs)
    else:
        for o in objs:
            before = count.n
            e.upsert(o)
            assert count.n - before <= PER_EVENT
    att = e.pod("P0")
    assert att is not None
    if kind == "ReplicaSet":  # the pod goes where c5 goes: c5's walk ends at c11
        assert att.workload is not None and att.workload.name == f"c{2 * HOPS - 1}"
    else:
        assert att.workload is None and att.reason == "hop_limit"

    # the chain's top deleted and added again (the end-to-end repro): a bounded event
    for _ in range(3):
        before = count.n
        e.delete(objs[-1])
        e.upsert(objs[-1])
        assert count.n - before <= 2 * (1 + HOPS)
    # one in the middle re-parented to nothing and back: what is within reach below it
    before = count.n
    mid = objs[N_CHAIN // 2]
    e.upsert({**mid, "metadata": {k: v for k, v in mid["metadata"].items()
                                  if k != "ownerReferences"}})
    e.upsert(mid)
    assert count.n - before <= 2 * (1 + HOPS)


def test_chain_added_top_down_is_linear_too() -> None:
    e = Engine(max_owner_hops=HOPS)
    count = WalkCounter(e, limit=3 * N_CHAIN + 2 * 50)
    e.upsert_many([_chain_object(i, N_CHAIN, "ReplicaSet")
                   for i in reversed(range(N_CHAIN))])
    e.upsert_many(_chain_pods("ReplicaSet"))
    assert count.n <= N_CHAIN + 2 * 50  # each object once, each pod's two walks
    att = e.pod("P0")
    assert att is not None and att.workload is not None
    assert att.workload.name == f"c{2 * HOPS - 1}"


# -- the results: as the old fan-out to everything below, as a fresh engine -------------------


def _unbounded(e: Engine) -> Engine:
    """The engine with the old fan-out: an owner's change re-attributes everything below
    it, however deep."""
    graph = e._graph

    def everything_below(uid: str, into: dict[str, None]) -> None:
        below: dict[str, None] = {uid: None}
        OwnerGraph.add_descendants(graph, uid, below)
        for u in below:
            if u != uid:
                into[u] = None

    graph.add_within_reach = everything_below  # type: ignore[method-assign]
    return e


def _engine(hops: int, ghost_clock: Callable[[], float]) -> Engine:
    e = Engine(max_owner_hops=hops, clock=lambda: 0.0, ghost_clock=ghost_clock)
    e.add_descriptions([TOP], source="top")
    e.add_descriptions([MID], source="mid")
    return e


def _state(e: Engine) -> tuple[Any, ...]:
    return (
        {a.uid: a for a in e.pods()},
        {f.ref.uid: f for f in e.workloads()},
        {uid: sorted(wl.objs) for uid, wl in e._wl.items()},
        {uid: rec.member for uid, rec in e._graph.objects.items()},
    )


def _ref(kind: str, name: str) -> dict[str, Any]:
    api = "v1" if kind == "Pod" else KINDS[kind]
    return {"apiVersion": api, "kind": kind, "name": name, "uid": f"u-{name}",
            "controller": True}


#: owner kinds: the properties test's (Top, Mid described with components and instance
#: ids, Link not described, Deployment / ReplicaSet / Job built-in)
OWNER_KINDS = sorted(KINDS)


@st.composite
def _object(draw: st.DrawFn, i: int, kinds: list[str], n_pod: int) -> dict[str, Any]:
    """Object ``o{i}``: owned (mostly) by the next one up, so chains run deep, or by any
    object (cycles, itself), a pod, or an owner never seen. Of its kind in ``kinds``
    (what references to it say), or now and then another."""
    n_obj = len(kinds)
    kind = kinds[i] if draw(st.integers(0, 4)) else draw(st.sampled_from(OWNER_KINDS))
    md: dict[str, Any] = {"name": f"o{i}", "namespace": NS, "uid": f"u-o{i}"}
    how = draw(st.sampled_from(["next", "next", "next", "any", "pod", "absent", "none"]))
    owner: tuple[str, str] | None = None
    if how == "next" and i + 1 < n_obj:
        owner = (kinds[i + 1], f"o{i + 1}")
    elif how == "any":
        k = draw(st.integers(0, n_obj - 1))
        owner = (kinds[k], f"o{k}")
    elif how == "pod" and n_pod:
        owner = ("Pod", f"p{draw(st.integers(0, n_pod - 1))}")
    elif how == "absent":
        k = draw(st.integers(0, 1))
        owner = (OWNER_KINDS[k], f"absent{k}")
    if owner is not None:
        md["ownerReferences"] = [_ref(*owner)]
    groups = draw(st.lists(st.sampled_from(["g1", "g2"]), max_size=2, unique=True))
    return {"apiVersion": KINDS[kind], "kind": kind, "metadata": md,
            "spec": {"a": draw(st.integers(0, 2)), "groups": [{"name": g, "n": 1}
                                                              for g in groups]},
            "status": {"phase": draw(st.sampled_from(["Up", "Down"]))}}


@st.composite
def _pod(draw: st.DrawFn, j: int, kinds: list[str], n_pod: int) -> dict[str, Any]:
    """Pod ``p{j}``: owned by any object (any depth of a chain), another pod, or none."""
    n_obj = len(kinds)
    md: dict[str, Any] = {"name": f"p{j}", "namespace": NS, "uid": f"u-p{j}",
                          "labels": draw(st.fixed_dictionaries({}, optional={
                              "role": st.sampled_from(["a", "b"]),
                              "group": st.sampled_from(["g1", "g2"])}))}
    how = draw(st.sampled_from(["object", "object", "object", "pod", "none"]))
    if how == "object" and n_obj:
        k = draw(st.integers(0, n_obj - 1))
        md["ownerReferences"] = [_ref(kinds[k], f"o{k}")]
    elif how == "pod" and n_pod > 1:
        md["ownerReferences"] = [_ref("Pod", f"p{draw(st.integers(0, n_pod - 1))}")]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md, "status": {"phase": "Running"}}


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """The hop limit, and events: objects and pods added in any order, then re-parented
    (a new version of an object or pod: any owner, kind, spec), deleted, added again."""
    hops = draw(st.integers(1, 3))
    # one kind per owner, which every reference to it names: references disagreeing
    # about an owner's kind are another matter (the newest wins, in event order)
    kinds = draw(st.lists(st.sampled_from(OWNER_KINDS), min_size=1, max_size=16))
    n_obj, n_pod = len(kinds), draw(st.integers(0, 6))
    first = [draw(_object(i, kinds, n_pod)) for i in range(n_obj)]
    first += [draw(_pod(j, kinds, n_pod)) for j in range(n_pod)]
    order = draw(st.permutations(range(len(first))))
    events = [("upsert", first[k]) for k in order]
    for _ in range(draw(st.integers(0, 25))):
        what = draw(st.sampled_from(["object", "object", "pod", "delete", "readd"]))
        if what == "object":
            events.append(("upsert", draw(_object(draw(st.integers(0, n_obj - 1)), kinds,
                                                  n_pod))))
        elif what == "pod" and n_pod:
            events.append(("upsert", draw(_pod(draw(st.integers(0, n_pod - 1)), kinds,
                                               n_pod))))
        elif what in ("delete", "readd"):
            events.append((what if what == "delete" else "upsert",
                           draw(st.sampled_from(first))))
    return hops, events


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_bounded_fan_out_equals_everything_below_and_a_rebuild(
        history: tuple[int, list[tuple[str, dict[str, Any]]]]) -> None:
    hops, events = history
    clock = ManualClock(0.0)
    e = _engine(hops, clock)
    old = _unbounded(_engine(hops, clock))
    mirror_pods: dict[str, Any] = {}
    mirror_wls: dict[str, Any] = {}

    def replay(cs: ChangeSet) -> None:
        _follow(mirror_pods, cs.pods, "pod")
        _follow(mirror_wls, cs.workloads, "workload")

    final: dict[str, dict[str, Any]] = {}
    for what, obj in events:
        uid = obj["metadata"]["uid"]
        if what == "upsert":
            final[uid] = obj
            replay(e.upsert(obj))
            old.upsert(obj)
        else:
            final.pop(uid, None)
            replay(e.delete(obj))
            old.delete(obj)
        assert _state(e) == _state(old)
        assert (mirror_pods, mirror_wls) == _state(e)[:2]

    # the ghosts of what was deleted expire: what walked through them is placed again
    clock.now += 10_000
    replay(e.expire_ghosts())
    old.expire_ghosts()
    assert _state(e) == _state(old)
    assert (mirror_pods, mirror_wls) == _state(e)[:2]

    fresh = _engine(hops, clock)
    fresh.upsert_many(list(final.values()))
    assert _state(fresh) == _state(e)
