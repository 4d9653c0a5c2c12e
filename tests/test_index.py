"""PodIndex: stamped labels by (namespace, pod), tombstones, name reuse, interning."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import contract
from proxy.index import PodIndex, identity, stamped_pairs
from proxy.karta.results import (
    PHASE_REASON_OBJECT_MISSING,
    ChangeSet,
    PodAttribution,
    WorkloadFacts,
    WorkloadRef,
)
from tests.clock import ManualClock

WL = WorkloadRef(namespace="ml", group="ray.io", kind="RayJob", name="train", uid="w1")


def att(uid: str, pod: str, *, workload: WorkloadRef | None = WL, **kw: str) -> PodAttribution:
    return PodAttribution(namespace="ml", pod=pod, uid=uid, workload=workload, **kw)


def test_stamped_pairs_sorted_and_empty_values_left_out() -> None:
    pairs = stamped_pairs(att("u1", "p", component="worker", instance="g1"))
    names = [n for n, _ in pairs]
    assert names == sorted(names)
    assert dict(pairs) == {
        contract.LABEL_COMPONENT: "worker",
        contract.LABEL_GROUP: "ray.io",
        contract.LABEL_INSTANCE: "g1",
        contract.LABEL_KIND: "RayJob",
        contract.LABEL_NAMESPACE: "ml",
        contract.LABEL_WORKLOAD: "train",
    }
    assert contract.LABEL_REPLICA not in dict(pairs)
    assert stamped_pairs(att("u2", "q", workload=None, reason="no_described_owner")) == ()


def test_lookup_and_interning() -> None:
    idx = PodIndex()
    idx.apply(
        ChangeSet(
            pods={"u1": att("u1", "a", component="head"), "u2": att("u2", "b", component="head")}
        )
    )
    a = idx.lookup(b"ml", b"a")
    b = idx.lookup(b"ml", b"b")
    assert a is not None and a == b
    assert a is b, "pods of one component instance share one interned tuple"
    assert idx.lookup(b"ml", b"missing") is None
    assert idx.lookup(b"other", b"a") is None


def test_unattributed_pod_has_reason_and_no_labels() -> None:
    idx = PodIndex()
    idx.apply(ChangeSet(pods={"u1": att("u1", "a", workload=None, reason="no_described_owner")}))
    assert idx.lookup(b"ml", b"a") is None
    assert idx.reason(b"ml", b"a") == "no_described_owner"
    assert idx.reason(b"ml", b"zzz") == "pod_unknown"


def test_deleted_pod_is_a_tombstone_until_expiry() -> None:
    clock = ManualClock(1000.0)
    idx = PodIndex(tombstone_seconds=600, clock=clock)
    idx.apply(ChangeSet(pods={"u1": att("u1", "a", component="head")}))
    heard: list[set[tuple[bytes, bytes]]] = []
    idx.subscribe_pods(lambda keys: heard.append(set(keys)))
    idx.apply(ChangeSet(pods={"u1": None}))
    assert heard == [{(b"ml", b"a")}]
    assert idx.lookup(b"ml", b"a") is not None, "late samples still get labels"
    assert idx.tombstones() == 1
    clock.now += 599
    assert idx.expire() == 0
    clock.now += 2
    assert idx.expire() == 1
    assert heard[-1] == {(b"ml", b"a")}, "expiry is heard too"
    assert idx.lookup(b"ml", b"a") is None
    assert idx.answer(b"ml", b"a") is None


def test_tombstones_expire_in_order_even_when_the_ttl_cache_expires_them_itself() -> None:
    # the TTL cache drops what is past its time inside an insert too: those must still
    # leave the index and be heard
    clock = ManualClock(1000.0)
    idx = PodIndex(tombstone_seconds=60, clock=clock)
    idx.apply(ChangeSet(pods={u: att(u, u, component="head") for u in ("a", "b", "c")}))
    heard: list[set[tuple[bytes, bytes]]] = []
    idx.subscribe_pods(lambda keys: heard.append(set(keys)))
    idx.apply(ChangeSet(pods={"a": None}))
    clock.now += 30
    idx.apply(ChangeSet(pods={"b": None}))
    clock.now += 31  # a is past its time, b is not
    idx.apply(ChangeSet(pods={"c": None}))  # an insert: the cache expires a on its own
    assert idx.tombstones() == 3  # a's expiry is pending until expire()
    assert idx.expire() == 1
    assert heard[-1] == {(b"ml", b"a")}
    assert idx.lookup(b"ml", b"a") is None and idx.lookup(b"ml", b"b") is not None
    assert idx.tombstones() == 2
    clock.now += 60
    assert idx.expire() == 2 and idx.tombstones() == 0 and len(idx) == 0


def test_name_reuse_with_new_uid_wins_over_tombstone() -> None:
    clock = ManualClock(1000.0)
    idx = PodIndex(clock=clock)
    idx.apply(ChangeSet(pods={"old": att("old", "a", component="head")}))
    idx.apply(ChangeSet(pods={"old": None}))
    idx.apply(ChangeSet(pods={"new": att("new", "a", component="worker")}))
    got = idx.lookup(b"ml", b"a")
    assert got is not None and dict(got)[contract.LABEL_COMPONENT] == "worker"
    clock.now += 10_000
    idx.expire()
    assert idx.lookup(b"ml", b"a") is not None, "the live pod is not expired"
    # a late delete of the old uid must not touch the new pod
    idx.apply(ChangeSet(pods={"old": None}))
    assert idx.lookup(b"ml", b"a") is not None


def test_new_unattributed_pod_replaces_tombstone_of_old() -> None:
    idx = PodIndex()
    idx.apply(ChangeSet(pods={"old": att("old", "a", component="head")}))
    idx.apply(ChangeSet(pods={"old": None}))
    idx.apply(ChangeSet(pods={"new": att("new", "a", workload=None, reason="no_described_owner")}))
    assert idx.lookup(b"ml", b"a") is None
    assert idx.reason(b"ml", b"a") == "no_described_owner"
    assert idx.tombstones() == 0


def test_a_late_delete_of_the_old_uid_keeps_the_new_pods_reason() -> None:
    """A relist gives a pod re-created under its name (new uid) first and retracts the
    old uid after: the old uid's deletion must leave the newcomer's reason (it took it,
    and the name read ``pod_unknown``), whether the old pod was attributed or not."""
    idx = PodIndex()
    table: dict[tuple[bytes, bytes], object] = {}
    idx.subscribe_pods(lambda keys: table.update({k: idx.answer(*k) for k in keys}))
    idx.apply(ChangeSet(pods={
        "u-a1": att("u-a1", "unattr", workload=None, reason="owner_missing"),
        "u-b1": att("u-b1", "mixed", component="head"),
    }))
    idx.apply(ChangeSet(pods={  # the relist's new uids, then the diff's deletions
        "u-a2": att("u-a2", "unattr", workload=None, reason="owner_missing"),
        "u-b2": att("u-b2", "mixed", workload=None, reason="owner_missing"),
    }))
    idx.apply(ChangeSet(pods={"u-a1": None, "u-b1": None}))
    for name in (b"unattr", b"mixed"):
        assert idx.lookup(b"ml", name) is None
        assert idx.reason(b"ml", name) == "owner_missing"
        assert idx.answer(b"ml", name) == "owner_missing"
        assert table[b"ml", name] == "owner_missing"  # what the splice's table holds
    assert sorted(n for _, n, _ in idx.answers()) == [b"mixed", b"unattr"]
    assert idx.tombstones() == 0
    # the newcomers' own deletion takes their reasons
    idx.apply(ChangeSet(pods={"u-a2": None, "u-b2": None}))
    assert idx.reason(b"ml", b"unattr") == "pod_unknown" and idx.answer(b"ml", b"mixed") is None
    assert list(idx.answers()) == []


@pytest.mark.parametrize("old_becomes", ["another workload", "unattributed"])
def test_a_change_to_the_old_uid_during_a_relist_leaves_the_name_to_the_new_pod(
    old_becomes: str,
) -> None:
    """A pod re-created under its name (new uid) while the pod watch relists: the new uid
    is given at once, the old one retracted after the last page. An engine change to the
    old uid meanwhile (its ReplicaSet deleted: re-placed under the ReplicaSet, or left
    unattributed) took the name from the live newcomer: its series read the old pod's
    labels, then, once the old uid's tombstone expired, none at all, for good (an
    auditor's repro against the API simulator). The name stays the newest pod's."""
    clock = ManualClock(1000.0)
    idx = PodIndex(clock=clock)
    table: dict[tuple[bytes, bytes], object] = {}
    idx.subscribe_pods(lambda keys: table.update({k: idx.answer(*k) for k in keys}))
    rs = replace(WL, kind="ReplicaSet", name="a-1", uid="rs-a")
    newest = replace(WL, name="b", uid="w-b")
    idx.apply(ChangeSet(pods={"old": att("old", "p", component="head")}))
    idx.apply(ChangeSet(pods={"new": att("new", "p", workload=newest, component="head")}))
    changed = (att("old", "p", workload=rs, component="replicaset")
               if old_becomes == "another workload"
               else att("old", "p", workload=None, reason="owner_missing"))
    idx.apply(ChangeSet(pods={"old": changed}))
    idx.apply(ChangeSet(pods={"old": None}))  # the relist's retraction
    clock.now += 10_000
    idx.expire()
    for answer in (idx.answer(b"ml", b"p"), table[b"ml", b"p"]):
        assert isinstance(answer, tuple) and dict(answer)[contract.LABEL_WORKLOAD] == "b"
    assert idx.uid_of("ml", "p") == "new" and idx.reason(b"ml", b"p") == "pod_unknown"
    assert idx.pods["new"].workload == newest and "old" not in idx.pods
    assert idx.unattributed_pods == 0 and idx.tombstones() == 0


def test_listeners_see_every_change_set() -> None:
    idx = PodIndex()
    seen: list[ChangeSet] = []
    idx.subscribe(seen.append)
    cs = ChangeSet(pods={"u1": att("u1", "a")})
    idx.apply(cs)
    idx.apply(ChangeSet())  # empty: not propagated
    assert seen == [cs]


def _facts(uid: str, name: str, present: bool) -> WorkloadFacts:
    return WorkloadFacts(
        replace(WL, uid=uid, name=name), "d", True,
        "Running" if present else "Undefined", ("Running",) if present else ("Undefined",),
        "" if present else PHASE_REASON_OBJECT_MISSING, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["u1", "u2", "u3", "u4"]),
                          st.sampled_from(["a", "b", None]), st.booleans()), max_size=30))
def test_fact_workloads_are_one_per_identity_the_present_object_first(
        steps: list[tuple[str, str | None, bool]]) -> None:
    """Workloads of one identity (re-created under a name while the old one's pods
    remain): the facts describe one, the one whose object is present, then the greater
    uid; whatever order they come, change and go in."""
    idx = PodIndex()
    for uid, name, present in steps:  # name None: the workload goes
        idx.apply(ChangeSet(workloads={uid: None if name is None else _facts(uid, name, present)}))
        served = idx.fact_workloads()
        assert set(served) <= set(idx.workloads) and set(served).isdisjoint(idx.shadowed)
        assert set(served) | idx.shadowed == set(idx.workloads)
        best: dict[tuple[str, str, str, str], WorkloadFacts] = {}
        for wf in idx.workloads.values():
            key = identity(wf.ref)
            rank = (wf.phase_reason != PHASE_REASON_OBJECT_MISSING, wf.ref.uid)
            had = best.get(key)
            if had is None or rank > (had.phase_reason != PHASE_REASON_OBJECT_MISSING,
                                      had.ref.uid):
                best[key] = wf
        assert sorted(served) == sorted(wf.ref.uid for wf in best.values())


def test_the_unattributed_pod_count_follows_every_change() -> None:
    """``unattributed_pods`` (the pages' "A attributed / N in all") is kept as pods come,
    change their attribution and go, not counted per view."""
    idx = PodIndex()

    def recount() -> int:
        return sum(1 for a in idx.pods.values() if a.workload is None)

    steps: list[dict[str, PodAttribution | None]] = [
        {"a": att("a", "a"), "b": att("b", "b", workload=None, reason="owner_missing")},
        {"a": att("a", "a", workload=None, reason="owner_missing")},  # loses its workload
        {"b": att("b", "b")},  # gains one
        {"c": att("c", "c", workload=None, reason="no_described_owner"), "a": None},
        {"c": None, "b": None, "zz": None},  # one never seen
    ]
    for pods in steps:
        idx.apply(ChangeSet(pods=pods))
        assert idx.unattributed_pods == recount(), pods
    assert idx.unattributed_pods == 0 and not idx.pods
