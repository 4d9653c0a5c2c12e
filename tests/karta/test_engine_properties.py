"""Property tests: any cluster, any event order -> the same answer as a rebuild.

Random clusters mix described kinds (two of the test's own, nested, plus the built-ins),
undescribed links and owners that never arrive; random event orders add, change, delete
and re-add objects and switch a description on and off midway. Checked after every run:

* the incremental engine equals a fresh engine fed only the final state;
* the change sets, replayed, give exactly the engine's state, and report nothing that did
  not change;
* a pod is attributed iff its owner chain reaches a described kind (an independent
  reference walk), to the topmost one; workload pod counts add up to the pods.

An object or pod deleted while anything (held, or a ghost itself) pointed at it stays a
ghost until it is added again or expires: the reference walk passes through a ghost as
through an absent owner whose own reference is known. The run is checked with its
ghosts, then again once they expired, against the rebuild too (which never had any).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.karta.description import parse_description
from proxy.karta.engine import Engine
from proxy.karta.model import Description, GroupKind
from proxy.karta.results import ChangeSet
from tests.clock import ManualClock
from tests.karta.descriptions import component, karta

NS = "ns"
HOPS = 4


def _karta(kind: str, children: list[dict[str, Any]]) -> Description:
    status = {"phaseDefinition": {"path": ".status.phase"},
              "statusMappings": {"running": [{"byPhase": "Up"}]}}
    root = component("root", "example.com", kind, statusDefinition=status)
    return parse_description(karta(f"prop-{kind.lower()}", root, children), "prop")


TOP = _karta("Top", [
    {"name": "a", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
     "scaleDefinition": {"replicasPath": ".spec.a"},
     "podSelector": {"componentTypeSelector": {"keyPath": '.metadata.labels["role"]',
                                               "value": "a"}}},
    {"name": "b", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.b"},
     "scaleDefinition": {"replicasPath": ".spec.groups[]?.n"},
     "instanceIdPath": ".spec.groups[]?.name",
     "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "b"}},
                     "componentInstanceSelector": {"idPath": ".metadata.labels.group"}}},
])
MID = _karta("Mid", [
    {"name": "m", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec"},
     "podSelector": {"replicaSelector": {"keyPath": '.metadata.labels["idx"]'}}},
])

#: kind -> apiVersion; described: Top, Mid (test's), Deployment, ReplicaSet, Job (built-in)
KINDS = {
    "Top": "example.com/v1",
    "Mid": "example.com/v1",
    "Link": "example.com/v1",
    "Deployment": "apps/v1",
    "ReplicaSet": "apps/v1",
    "Job": "batch/v1",
}
BUILTIN_DESCRIBED = {"Deployment", "ReplicaSet", "Job"}


def _owner_ref(kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": KINDS[kind], "kind": kind, "name": name, "uid": f"u-{name}",
            "controller": True}


@st.composite
def clusters(draw: st.DrawFn) -> dict[str, Any]:
    """Objects (o0..), pods (p0..) and owners that may never arrive (named ``ghost-*``;
    not the engine's ghosts of removed owners, which the history's deletions make)."""
    n_obj = draw(st.integers(0, 7))
    names: list[tuple[str, str]] = []  # (kind, name) of possible owners, objects first
    objects: dict[str, dict[str, Any]] = {}
    for i in range(n_obj):
        kind = draw(st.sampled_from(sorted(KINDS)))
        name = f"o{i}"
        owner = draw(st.one_of(st.none(), st.sampled_from(names))) if names else None
        if owner is None and draw(st.booleans()):  # an owner that never arrives
            ghost = draw(st.sampled_from(sorted(KINDS)))
            owner = (ghost, f"ghost-{ghost.lower()}-{i}")
        md: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"u-{name}"}
        if owner is not None:
            md["ownerReferences"] = [_owner_ref(*owner)]
        groups = draw(st.lists(st.sampled_from(["g1", "g2", "g3"]), max_size=2, unique=True))
        objects[md["uid"]] = {
            "apiVersion": KINDS[kind], "kind": kind, "metadata": md,
            "spec": {"a": draw(st.integers(0, 3)),
                     "groups": [{"name": g, "n": 2} for g in groups]},
            "status": {"phase": draw(st.sampled_from(["Up", "Down"]))},
        }
        names.append((kind, name))
    pods: dict[str, dict[str, Any]] = {}
    for i in range(draw(st.integers(0, 10))):
        name = f"p{i}"
        owner = draw(st.one_of(st.none(), st.sampled_from(names))) if names else None
        if owner is None and draw(st.booleans()):  # shared by pods: one kind per uid
            ghost = draw(st.sampled_from(sorted(KINDS)))
            owner = (ghost, f"ghost-{ghost.lower()}")
        pods[f"u-{name}"] = _pod(name, owner, draw(_labels()))
    # an object may be owned by a pod (as LWS worker StatefulSets are)
    pod_owns_object: bool = draw(st.booleans())
    if pods and objects and pod_owns_object:
        uid = draw(st.sampled_from(sorted(objects)))
        puid = draw(st.sampled_from(sorted(pods)))
        objects[uid]["metadata"]["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Pod", "name": pods[puid]["metadata"]["name"],
            "uid": puid, "controller": True}]
    # a pod may be controlled by another pod (Spark executors by their driver)
    if len(pods) >= 2 and draw(st.booleans()):
        child, parent = draw(st.lists(st.sampled_from(sorted(pods)), min_size=2, max_size=2,
                                      unique=True))
        pods[child]["metadata"]["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Pod", "name": pods[parent]["metadata"]["name"],
            "uid": parent, "controller": True}]
    return {"objects": objects, "pods": pods}


def _labels() -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["a", "b", "c"]),
        "group": st.sampled_from(["g1", "g2", "zz"]),
        "idx": st.sampled_from(["0", "1"]),
    })


def _pod(name: str, owner: tuple[str, str] | None, labels: dict[str, str]) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"u-{name}", "labels": labels}
    if owner is not None:
        md["ownerReferences"] = [_owner_ref(*owner)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md,
            "status": {"phase": "Running"}}


@st.composite
def histories(draw: st.DrawFn) -> tuple[dict[str, Any], list[Any], dict[str, Any], bool]:
    """A cluster, a random event sequence over it, the final state, final MID switch."""
    c = draw(clusters())
    everything = {**c["objects"], **c["pods"]}
    uids = sorted(everything)
    order = draw(st.permutations(uids)) if uids else []
    events: list[Any] = [("upsert", everything[u]) for u in order]
    final: dict[str, Any] = dict(everything)
    mid_on = True
    for _ in range(draw(st.integers(0, 8))):
        what = draw(st.sampled_from(["delete", "readd", "relabel", "mid"]))
        if what == "mid":
            mid_on = not mid_on
            events.append(("mid", mid_on))
        elif not uids:
            continue
        else:
            u = draw(st.sampled_from(uids))
            if what == "delete":
                events.append(("delete", everything[u]))
                final.pop(u, None)
            elif what == "readd":
                events.append(("upsert", everything[u]))
                final[u] = everything[u]
            elif u in c["pods"]:
                p = everything[u]
                owner = p["metadata"].get("ownerReferences")
                new = _pod(p["metadata"]["name"], None, draw(_labels()))
                if owner is not None:
                    new["metadata"]["ownerReferences"] = owner
                events.append(("upsert", new))
                final[u] = new
    return c, events, final, mid_on


def _engine(mid_on: bool, ghost_clock: Callable[[], float] = lambda: 0.0) -> Engine:
    e = Engine(max_owner_hops=HOPS, clock=lambda: 0.0, ghost_clock=ghost_clock)
    e.add_descriptions([TOP], source="top")
    if mid_on:
        e.add_descriptions([MID], source="mid")
    return e


def _state(e: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    pods = {a.uid: a for a in e.pods()}
    wls = {f.ref.uid: f for f in e.workloads()}
    return pods, wls


def _ghosts_after(current: dict[str, Any], ghosts: dict[str, Any], uid: str) -> None:
    """``uid`` deleted: it stays a ghost if another held object or pod, or a ghost,
    names it as its controller (one pointing at itself only is no reason)."""
    gone = current.pop(uid, None)
    if gone is None:
        return  # not held: the engine ignores the deletion
    for u, o in (*current.items(), *ghosts.items()):
        refs = o["metadata"].get("ownerReferences")
        if u != uid and refs and refs[0]["uid"] == uid:
            ghosts[uid] = gone
            return


def _reference(final: dict[str, Any], mid_on: bool,
               ghosts: Mapping[str, Any] | None = None) -> dict[str, str | None]:
    """Independent walk: pod uid -> uid of the topmost described owner, or None (also
    when the chain loops through a described kind: a cycle has no topmost). A pod whose
    walk the hop limit stopped above a present described object goes where that
    object's own walk (``HOPS`` from it) goes. ``ghosts`` (deleted objects and pods,
    :func:`_ghosts_after`) are passed as absent owners whose own reference is known: a
    walk ending at one ends at an absent owner (a ghost pod is no bare pod)."""
    described = {"Top", *BUILTIN_DESCRIBED} | ({"Mid"} if mid_on else set())
    ghosts = ghosts or {}

    def walk(ref: dict[str, Any], top: str | None) -> tuple[str | None, bool]:
        """(top, cut): cut when the limit stopped the walk above a described owner
        passed on it."""
        passed: list[tuple[str, bool]] = []  # (uid, described) of each owner passed
        found = False
        for _ in range(HOPS + 1):
            uids = [u for u, _ in passed]
            if ref["uid"] in uids:  # a cycle: from its first pass to here
                if any(d for _, d in passed[uids.index(ref["uid"]):]):
                    return None, False
                break
            if len(passed) == HOPS:
                return top, found
            passed.append((ref["uid"], ref["kind"] in described))
            if ref["kind"] in described:
                top, found = ref["uid"], True
            owner = final.get(ref["uid"])
            held = owner is not None
            if owner is None:
                owner = ghosts.get(ref["uid"])
                if owner is None:
                    break
            nxt = owner["metadata"].get("ownerReferences")
            if not nxt:
                if top is None and owner["kind"] == "Pod" and held:
                    top = ref["uid"]  # a bare pod at the top of pods: their workload
                break
            ref = nxt[0]
        return top, False

    out: dict[str, str | None] = {}
    for uid, o in final.items():
        if o["kind"] != "Pod":
            continue
        refs = o["metadata"].get("ownerReferences")
        if not refs:
            out[uid] = uid  # a bare pod: the built-in Pod description
            continue
        top, cut = walk(refs[0], None)
        held = final.get(top) if top is not None else None
        if cut and held is not None:
            up = held["metadata"].get("ownerReferences")
            top = walk(up[0], top)[0] if up else top
        out[uid] = top
    return out


def _follow(mirror: dict[str, Any], changes: Mapping[str, Any], what: str) -> None:
    """Apply one part of a ChangeSet (pods or workloads) to a caller's mirror, as the index
    does: None retracts. An entry equal to what the mirror holds fails, as the engine
    reports only what changed."""
    for uid, value in changes.items():
        assert mirror.get(uid) != value, f"{what} {uid} reported without a change"
        if value is None:
            mirror.pop(uid)
        else:
            mirror[uid] = value


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_incremental_equals_rebuild(history: tuple[Any, ...]) -> None:
    _, events, final, mid_on = history
    ghost_clock = ManualClock(0.0)
    e = _engine(True, ghost_clock)
    mirror_pods: dict[str, Any] = {}
    mirror_wls: dict[str, Any] = {}

    def replay(cs: ChangeSet) -> None:
        _follow(mirror_pods, cs.pods, "pod")
        _follow(mirror_wls, cs.workloads, "workload")

    current: dict[str, Any] = {}
    ghosts: dict[str, Any] = {}
    for kind, arg in events:
        if kind == "upsert":
            current[arg["metadata"]["uid"]] = arg
            ghosts.pop(arg["metadata"]["uid"], None)
            replay(e.upsert(arg))
        elif kind == "delete":
            _ghosts_after(current, ghosts, arg["metadata"]["uid"])
            replay(e.delete(arg))
        else:
            full = {gk for gk, mode in e.required_kinds().items() if mode == "full"}
            cs = e.add_descriptions([MID], source="mid") if arg else e.remove_descriptions("mid")
            replay(cs)
            if cs.kinds_changed:  # what a source does: list again what it now needs in full
                now = {gk for gk, mode in e.required_kinds().items() if mode == "full"}
                for o in list(current.values()):
                    gk = GroupKind.from_api_version(o["apiVersion"], o["kind"])
                    if gk in now - full:
                        replay(e.upsert(o))

    assert set(e._graph.ghosts) == set(ghosts)
    pods, wls = _state(e)
    assert (mirror_pods, mirror_wls) == (pods, wls)
    _check_reference(e, pods, final, mid_on, ghosts)

    # the ghosts expire: what walked through them is placed again, as by a rebuild
    ghost_clock.now += 10_000
    replay(e.expire_ghosts())
    assert not e._graph.ghosts
    pods, wls = _state(e)
    assert (mirror_pods, mirror_wls) == (pods, wls)

    fresh = _engine(mid_on)
    fresh.upsert_many(list(final.values()))
    assert _state(fresh) == (pods, wls)
    assert fresh.required_kinds() == e.required_kinds()

    _check_reference(e, pods, final, mid_on, {})


def _check_reference(e: Engine, pods: dict[str, Any], final: dict[str, Any], mid_on: bool,
                     ghosts: dict[str, Any]) -> None:
    want = _reference(final, mid_on, ghosts)
    got = {uid: (a.workload.uid if a.workload is not None else None) for uid, a in pods.items()}
    assert got == want

    # every attributed pod is counted once, in its own workload
    for wuid, wl in e._wl.items():
        attributed = [a for a in pods.values() if a.workload and a.workload.uid == wuid]
        assert sum(wl.counts.values()) == len(attributed)
        assert sorted((a.component, a.instance) for a in attributed) == sorted(
            k for k, n in wl.counts.items() for _ in range(n)
        )
    assert {f.ref.uid for f in e.workloads()} == set(e._wl)
