"""The owner graph on its own: controller references, edges both ways, the upward walk."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.karta.model import GroupKind
from proxy.karta.owners import (
    POD,
    REASON_DESCRIPTION_ERROR,
    REASON_HOP_LIMIT,
    REASON_NO_DESCRIBED_OWNER,
    REASON_OWNER_MISSING,
    ObjectRecord,
    OwnerGraph,
    OwnerRef,
    WalkResult,
    controller_ref,
    group_kind,
)

RS = GroupKind("apps", "ReplicaSet")
DEPLOY = GroupKind("apps", "Deployment")
JOB = GroupKind("batch", "Job")


#: the namespace of the test objects and pods
NS = "default"


class PodRecord:
    """What the graph reads of a pod record: its controller and namespace."""

    def __init__(self, owner: OwnerRef | None, namespace: str = NS) -> None:
        self.owner = owner
        self.namespace = namespace


def ref(uid: str, gk: GroupKind = RS, name: str = "") -> OwnerRef:
    api = f"{gk.group}/v1" if gk.group else "v1"
    return OwnerRef(uid, gk, name or uid, api)


def record(uid: str, gk: GroupKind, owner: OwnerRef | None = None) -> ObjectRecord:
    return ObjectRecord(uid, gk, NS, uid, owner, None)


def described_as(*kinds: GroupKind) -> Any:
    return lambda gk: gk.kind if gk in kinds else None


def never(gk: GroupKind) -> bool:
    return False


# -- controller_ref ------------------------------------------------------------------------


def test_controller_ref_picks_the_controller_and_skips_malformed_entries() -> None:
    refs = [
        "not a mapping",
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "a", "uid": "u-a"},
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "uid": "", "controller": True},
        {"apiVersion": "apps/v1", "kind": 3, "uid": "u-bad", "controller": True},
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "b", "uid": "u-b",
         "controller": True},
    ]
    got = controller_ref(refs)
    assert got is not None
    assert (got.uid, got.gk, got.name, got.api_version) == ("u-b", RS, "b", "apps/v1")


@pytest.mark.parametrize("refs", [None, {}, "x", [], [{"controller": "true", "uid": "u",
                                                          "kind": "K", "apiVersion": "v1"}]])
def test_no_controller_ref(refs: Any) -> None:
    assert controller_ref(refs) is None


def test_controller_ref_without_a_name_keeps_an_empty_one() -> None:
    got = controller_ref([{"apiVersion": "v1", "kind": "Pod", "uid": "p", "controller": True}])
    assert got is not None and got.name == "" and got.gk == POD


def test_group_kind_is_interned() -> None:
    assert group_kind("apps/v1", "ReplicaSet") is group_kind("apps/v1", "ReplicaSet")
    assert group_kind("apps/v1", "ReplicaSet") == RS
    assert group_kind("v1", "Pod") == POD


def test_same_compares_identity_not_api_version() -> None:
    a = OwnerRef("u", RS, "n", "apps/v1")
    assert a.same(OwnerRef("u", RS, "n", "apps/v1beta2"))
    assert not a.same(OwnerRef("u", RS, "other", "apps/v1"))
    assert not a.same(OwnerRef("u", DEPLOY, "n", "apps/v1"))
    assert not a.same(None)


# -- edges ---------------------------------------------------------------------------------


def test_topmost_drops_what_lies_below_another_but_never_a_whole_cycle() -> None:
    pods: dict[str, Any] = {"pod-1": PodRecord(ref("rs-1")), "pod-2": PodRecord(None)}
    g = OwnerGraph(max_hops=8, pods=pods)
    g.put(record("dep-1", DEPLOY))
    g.put(record("rs-1", RS, g.link("rs-1", ref("dep-1", DEPLOY))))
    g.put(record("rs-2", RS, g.link("rs-2", ref("gone", DEPLOY))))  # an absent owner
    g.link("pod-1", ref("rs-1"))
    assert g.topmost(["rs-1", "dep-1", "pod-1", "pod-2"]) == ["dep-1", "pod-2"]
    assert g.topmost(["rs-1", "pod-1"]) == ["rs-1"]  # its owner is not among them
    assert g.topmost(["rs-2", "gone"]) == ["gone"]
    # a cycle: each member reaches itself, so none is dropped for the other
    g.put(record("a", JOB, g.link("a", ref("b", JOB))))
    g.put(record("b", JOB, g.link("b", ref("a", JOB))))
    g.put(record("c", JOB, g.link("c", ref("a", JOB))))
    assert g.topmost(["a", "b", "c"]) == ["a", "b"]


def test_edges_to_an_absent_owner_are_kept_and_counted_by_kind() -> None:
    g = OwnerGraph(10, {})
    shared = g.link("pod-1", ref("rs-1"))
    assert g.link("pod-2", ref("rs-1")) is shared  # one OwnerRef per owner
    assert g.dependents("rs-1") == {"pod-1", "pod-2"}
    assert g.owner_kinds == {RS: 1} and g.kinds_touched
    assert g.absent_owners() == [("rs-1", RS)]
    g.put(record("rs-1", RS))
    assert g.absent_owners() == []  # present now
    g.remove("rs-1")
    g.kinds_touched = False
    g.unlink("pod-1", shared)
    assert g.owner_kinds == {RS: 1} and not g.kinds_touched
    g.unlink("pod-2", shared)
    assert g.dependents("rs-1") == set() and not g.owner_kinds and g.kinds_touched
    g.unlink("pod-2", shared)  # unknown edges are ignored


def test_children_disagreeing_about_the_owner_keep_the_newest() -> None:
    g = OwnerGraph(10, {})
    g.link("a", ref("o", RS, "x"))
    newest = g.link("b", ref("o", JOB, "x"))
    assert newest.gk == JOB and g.owner_kinds == {JOB: 1}


def test_put_moves_the_edge_when_the_owner_changes() -> None:
    g = OwnerGraph(10, {})
    assert g.put(record("rs", RS, ref("d1", DEPLOY))) is None
    same = g.put(record("rs", RS, ref("d1", DEPLOY)))
    assert same is not None and g.objects["rs"].owner is same.owner  # shared edge kept
    g.put(record("rs", RS, ref("d2", DEPLOY)))
    assert g.dependents("d1") == set() and g.dependents("d2") == {"rs"}
    removed = g.remove("rs")
    assert removed is not None and g.dependents("d2") == set() and not g.owner_kinds
    assert g.remove("rs") is None


def test_descendants_nearest_first_and_cycles_tolerated() -> None:
    g = OwnerGraph(10, {})
    g.put(record("rs", RS, ref("d", DEPLOY)))
    g.link("pod", ref("rs"))
    g.put(record("d", DEPLOY, ref("rs")))  # a cycle d -> rs -> d
    assert _descendants(g, "d") == ["rs", "pod"]  # d itself is not its own descendant
    assert _descendants(g, "pod") == []


def _descendants(g: OwnerGraph, uid: str) -> list[str]:
    """Every pod and object below ``uid``, nearest first, as the engine gathers them."""
    below: dict[str, None] = {uid: None}
    g.add_descendants(uid, below)
    return list(below)[1:]


# -- the walk ------------------------------------------------------------------------------


def chain(g: OwnerGraph) -> OwnerRef:
    """pod -> rs -> deployment, both present; returns the pod's controller ref."""
    g.put(record("d", DEPLOY))
    g.put(record("rs", RS, ref("d", DEPLOY)))
    return ref("rs")


def test_walk_takes_the_highest_described_owner() -> None:
    g = OwnerGraph(10, {})
    start = chain(g)
    top = g.walk(start, NS, described_as(RS, DEPLOY), never)
    assert (top.described, top.uid, top.reason) == ("Deployment", "d", "")
    assert top.obj is g.objects["d"]
    mid = g.walk(start, NS, described_as(RS), never)
    assert (mid.described, mid.uid) == ("ReplicaSet", "rs")


def test_walk_without_a_described_owner() -> None:
    g = OwnerGraph(10, {})
    got = g.walk(chain(g), NS, described_as(), never)
    assert (got.described, got.reason, got.root_pod) == (None, REASON_NO_DESCRIBED_OWNER, "")


def test_walk_to_an_absent_owner() -> None:
    g = OwnerGraph(10, {})
    g.put(record("rs", RS, ref("gone", DEPLOY)))
    got = g.walk(ref("rs"), NS, described_as(), never)
    assert got.reason == REASON_OWNER_MISSING
    # an absent owner of a described kind is the workload, named by the reference alone
    named = g.walk(ref("rs"), NS, described_as(DEPLOY), never)
    assert (named.described, named.uid, named.obj) == ("Deployment", "gone", None)
    assert named.ref is not None and named.ref.name == "gone"


def test_walk_hop_limit() -> None:
    g = OwnerGraph(2, {})
    got = g.walk(chain(g), NS, described_as(), never)
    assert got.reason == REASON_NO_DESCRIBED_OWNER  # two hops: rs, d
    g.put(record("d", DEPLOY, ref("top", JOB)))
    g.put(record("top", JOB))
    assert g.walk(ref("rs"), NS, described_as(JOB), never).reason == REASON_HOP_LIMIT


def test_walk_a_cycle_ends_at_the_hop_limit() -> None:
    g = OwnerGraph(5, {})
    g.put(record("a", RS, ref("b", DEPLOY)))
    g.put(record("b", DEPLOY, ref("a", RS)))
    assert g.walk(ref("a"), NS, described_as(), never).reason == REASON_HOP_LIMIT


@pytest.mark.parametrize("hops", [2, 3, 4, 5, 6, 7])
def test_walk_a_cycle_through_described_kinds_has_no_top_whatever_the_hop_count(
        hops: int) -> None:
    """Deployment <-> ReplicaSet: which one the limit stopped at depended on the hop
    count's parity; no owner on a cycle is the topmost, so nothing is, the caller's
    own ``top`` included (a described object walking from itself)."""
    g = OwnerGraph(hops, {})
    g.put(record("d", DEPLOY, ref("rs", RS)))
    g.put(record("rs", RS, ref("d", DEPLOY)))
    both = described_as(RS, DEPLOY)
    got = g.walk(ref("rs"), NS, both, never)
    assert (got.described, got.reason) == (None, REASON_HOP_LIMIT)
    d = g.objects["d"]
    from_itself = g.walk(d.owner, NS, both, never, WalkResult("Deployment", "d", d, None, ""))
    assert (from_itself.described, from_itself.reason) == (None, REASON_HOP_LIMIT)
    # one described kind on the cycle is enough, for what lies below it too
    assert g.walk(ref("rs"), NS, described_as(DEPLOY), never).described is None
    g.put(record("job", JOB, ref("rs", RS)))
    below = g.walk(ref("job", JOB), NS, described_as(JOB, DEPLOY), never)
    # (job, rs, d, rs: the cycle shows at the fourth; a limit before it is a long chain)
    assert below.described is None if hops >= 3 else below.uid == "job"


def test_walk_a_cycle_of_undescribed_kinds_above_a_described_one_keeps_it() -> None:
    g = OwnerGraph(6, {})
    g.put(record("job", JOB, ref("a", RS)))
    g.put(record("a", RS, ref("b", DEPLOY)))
    g.put(record("b", DEPLOY, ref("a", RS)))
    got = g.walk(ref("job", JOB), NS, described_as(JOB), never)
    assert got.uid == "job"


def test_walk_reports_a_kind_whose_description_is_broken() -> None:
    g = OwnerGraph(10, {})
    got = g.walk(chain(g), NS, described_as(), lambda gk: gk == DEPLOY)
    assert got.reason == REASON_DESCRIPTION_ERROR
    # a described owner above still wins
    g.put(record("d", DEPLOY, ref("j", JOB)))
    g.put(record("j", JOB))
    assert g.walk(ref("rs"), NS, described_as(JOB), lambda gk: gk == DEPLOY).uid == "j"


def test_walk_a_broken_description_above_a_described_owner_attributes_nothing() -> None:
    """The kind above may be the real topmost workload: the one below (and the caller's
    own ``top``, a described object walking from itself) is not made one of its own."""
    g = OwnerGraph(10, {})
    g.put(record("j", JOB, ref("js", DEPLOY)))
    g.put(record("js", DEPLOY))
    broken = lambda gk: gk == DEPLOY  # noqa: E731
    got = g.walk(ref("j", JOB), NS, described_as(JOB), broken)
    assert (got.described, got.reason) == (None, REASON_DESCRIPTION_ERROR)
    own = WalkResult("Job", "j", g.objects["j"], None, "")
    got = g.walk(ref("js", DEPLOY), NS, described_as(JOB), broken, own)
    assert (got.described, got.reason) == (None, REASON_DESCRIPTION_ERROR)
    # absent, known from the reference only: the same
    g.remove("js")
    assert g.walk(ref("j", JOB), NS, described_as(JOB), broken).reason == REASON_DESCRIPTION_ERROR


def test_walk_through_pods_and_ending_at_a_root_pod() -> None:
    pods = {"leader": PodRecord(None)}
    g = OwnerGraph(10, pods)
    g.put(record("sts", GroupKind("apps", "StatefulSet"), ref("leader", POD)))
    got = g.walk(ref("sts", GroupKind("apps", "StatefulSet")), NS, described_as(), never)
    assert (got.reason, got.root_pod) == (REASON_NO_DESCRIBED_OWNER, "leader")
    pods["leader"] = PodRecord(ref("lws", GroupKind("x.k8s.io", "LeaderWorkerSet")))
    g.put(record("lws", GroupKind("x.k8s.io", "LeaderWorkerSet")))
    top = g.walk(ref("sts", GroupKind("apps", "StatefulSet")), NS,
                 described_as(GroupKind("x.k8s.io", "LeaderWorkerSet")), never)
    assert top.uid == "lws"


def test_walk_keeps_the_callers_top_when_nothing_above_is_described() -> None:
    g = OwnerGraph(10, {})
    start = chain(g)
    mine = g.walk(None, NS, described_as(), never)
    assert mine.reason == REASON_NO_DESCRIBED_OWNER
    held = g.walk(start, NS, described_as(RS), never)
    again = g.walk(ref("d", DEPLOY), NS, described_as(), never, top=held)
    assert again is held


def test_walk_an_owner_in_another_namespace_is_absent_and_never_the_workload() -> None:
    """Kubernetes disallows cross-namespace owner references: a namespaced owner in
    another namespace than its dependent's is absent to it. It is not the workload even
    when its kind is described (its uid is that other object's); a cluster-scoped owner
    is followed from any namespace, but only to cluster-scoped owners above it."""
    pods = {"leader": PodRecord(None, namespace="other")}
    g = OwnerGraph(10, pods)
    start = chain(g)
    got = g.walk(start, "other", described_as(RS, DEPLOY), never)
    assert (got.described, got.reason) == (None, REASON_OWNER_MISSING)
    # a described owner below it is still the workload
    g.put(ObjectRecord("job", JOB, "other", "job", ref("rs"), None))
    got = g.walk(ref("job", JOB), "other", described_as(JOB, DEPLOY), never)
    assert (got.described, got.uid) == ("Job", "job")
    # a pod of another namespace as owner: the same
    g.put(record("sts", GroupKind("apps", "StatefulSet"), ref("leader", POD)))
    got = g.walk(ref("sts", GroupKind("apps", "StatefulSet")), NS, described_as(), never)
    assert (got.reason, got.root_pod) == (REASON_OWNER_MISSING, "")
    # cluster-scoped: followed from any namespace, then only to cluster-scoped owners
    g.put(ObjectRecord("c", DEPLOY, "", "c", ref("d", DEPLOY), None))
    g.put(record("x", RS, ref("c", DEPLOY)))
    got = g.walk(ref("x"), NS, described_as(DEPLOY), never)
    assert (got.described, got.uid) == ("Deployment", "c")
