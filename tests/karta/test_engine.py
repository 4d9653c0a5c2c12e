"""The engine's incremental behaviour: what each call changes, and only that."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import snapshot
from proxy.karta import engine as engine_module
from proxy.karta.description import load_description_file, parse_description
from proxy.karta.engine import Engine
from proxy.karta.jq_sandbox import QUARANTINE_STRIKES, JqSandbox
from proxy.karta.jqexpr import JqExpr, install_runner, remove_runner
from proxy.karta.model import Description, GroupKind
from proxy.karta.packed import Packed
from proxy.karta.results import (
    JQ_ERROR_SELECTOR,
    JQ_ERROR_STATUS,
    JQ_ERROR_WORKLOAD,
    STAT_AMBIGUOUS_COMPONENT,
    STAT_INSTANCE_NOT_LISTED,
    STAT_INVALID_OBJECT,
    STAT_JQ_RETRY,
    STAT_SELECTOR_UNKEPT_FIELD,
    ChangeSet,
    PodAttribution,
    WorkloadFacts,
)
from proxy.karta.status import object_text
from proxy.snapshot import load_snapshot
from tests.clock import ManualClock
from tests.karta import descriptions

NS = "team-a"


def obj(
    api: str, kind: str, name: str, owner: dict[str, Any] | None = None, **rest: Any
) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"{kind.lower()}-{name}"}
    md.update(rest.pop("metadata", {}))
    if owner is not None:
        md["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "cm-1"},
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            },
        ]
    return {"apiVersion": api, "kind": kind, "metadata": md, **rest}


def _jq_errors(e: Engine, where: str) -> int:
    """The engine's jq errors at ``where``, of every description."""
    return sum(n for (w, _), n in e.jq_errors.items() if w == where)


def pod(name: str, owner: dict[str, Any] | None = None, **labels: str) -> dict[str, Any]:
    return obj(
        "v1", "Pod", name, owner,
        metadata={"labels": dict(labels)},
        spec={"containers": [{"name": "c", "image": "x"}]},
        status={"phase": "Running"},
    )


def karta(kind: dict[str, str], children: list[dict[str, Any]], **root: Any) -> dict[str, Any]:
    """A description of ``kind`` (group and kind) whose root component is named ``root``."""
    return descriptions.karta(f"test-{kind['kind'].lower()}",
                              {"name": "root", "kind": {"version": "v1", **kind}, **root},
                              children)


def describe(raw: dict[str, Any]) -> Description:
    return parse_description(raw, "test")


#: the kube source tests' RayCluster description, but for a head without replicas
RAY_KARTA = descriptions.raycluster_karta(head_replicas=False)


def raycluster(name: str, groups: list[str], state: str = "ready") -> dict[str, Any]:
    return obj(
        "ray.io/v1", "RayCluster", name,
        spec={"workerGroupSpecs": [{"groupName": g, "replicas": 1} for g in groups]},
        status={"state": state},
    )


def deployment(name: str, replicas: int = 2, ready: int = 2) -> dict[str, Any]:
    return obj(
        "apps/v1", "Deployment", name,
        metadata={"generation": 1},
        spec={"replicas": replicas},
        status={"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                "readyReplicas": ready,
                "conditions": [{"type": "Available", "status": "True"}]},
    )


def replicaset(name: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    return obj("apps/v1", "ReplicaSet", name, owner, spec={"replicas": 2})


def P(src: Engine | ChangeSet, uid: str) -> PodAttribution:
    att = src.pod(uid) if isinstance(src, Engine) else src.pods[uid]
    assert att is not None
    return att


def W(src: Engine | ChangeSet, uid: str) -> WorkloadFacts:
    facts = src.workload(uid) if isinstance(src, Engine) else src.workloads[uid]
    assert facts is not None
    return facts


def wname(att: PodAttribution) -> str:
    assert att.workload is not None
    return att.workload.name


# -- order of arrival ------------------------------------------------------------------


def test_pod_before_its_owners_is_reattributed_when_they_arrive() -> None:
    e = Engine(clock=ManualClock(100.0))
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    p1, p2 = pod("web-1-a", rs), pod("web-1-b", rs)

    cs = e.upsert(p1)
    att = cs.pods["pod-web-1-a"]
    assert att is not None and att.workload is not None
    # the ReplicaSet is described (bare ReplicaSets are workloads): known from the reference
    assert (att.workload.kind, att.workload.name) == ("ReplicaSet", "web-1")
    assert W(e, "replicaset-web-1").phase_reason == "workload_object_missing"

    cs = e.upsert(rs)  # now the chain reaches the Deployment (still unseen)
    assert set(cs.pods) == {"pod-web-1-a"}
    assert cs.workloads["replicaset-web-1"] is None
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase == "Undefined" and w.replicas[0].observed == 1

    cs = e.upsert(dep)  # same workload uid: pods unchanged, facts now from the object
    assert cs.pods == {}
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase == "Running" and w.replicas[0].desired == 2

    cs = e.upsert(p2)
    assert set(cs.pods) == {"pod-web-1-b"}
    assert W(cs, "deployment-web").replicas[0].observed == 2


def test_unchanged_and_status_only_updates_touch_nothing_or_only_facts() -> None:
    clock = ManualClock(100.0)
    e = Engine(clock=clock)
    dep = deployment("web", replicas=2, ready=0)
    rs = replicaset("web-1", dep)
    e.upsert_many([dep, rs, pod("web-1-a", rs), pod("web-1-b", rs)])
    assert W(e, "deployment-web").phase == "Initializing"
    since = W(e, "deployment-web").phase_since

    assert not e.upsert(pod("web-1-a", rs))  # a resync of the same pod
    p = pod("web-1-a", rs)
    p["status"]["phase"] = "Succeeded"  # status of an owned pod: not read by the engine
    assert not e.upsert(p)
    assert not e.upsert(rs)  # an owner that is not the workload: nothing to redo

    clock.now = 200.0
    cs = e.upsert(deployment("web", replicas=2, ready=2))
    assert cs.pods == {} and set(cs.workloads) == {"deployment-web"}
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase == "Running" and w.phase_since == 200.0 > since
    clock.now = 300.0
    cs = e.upsert(deployment("web", replicas=3, ready=3))  # same phase, new desired
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase_since == 200.0 and w.replicas[0].desired == 3


def test_deleting_owners_reattributes_dependents() -> None:
    ghost_clock = ManualClock(0.0)
    e = Engine(ghost_clock=ghost_clock)
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    e.upsert_many([dep, rs, pod("web-1-a", rs)])

    cs = e.delete(dep)  # the ReplicaSet still names it: the workload stays, object gone
    assert cs.pods == {}
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase_reason == "workload_object_missing"

    # the ReplicaSet's ghost still names the Deployment: the pod keeps it (a cascade
    # delete, which removes the pods last)
    cs = e.delete(rs)
    assert cs.pods == {} and "replicaset-web-1" not in cs.workloads
    att = e.pod("pod-web-1-a")
    assert att is not None and att.workload is not None and att.workload.kind == "Deployment"

    ghost_clock.now += 601  # the ghost expires: only the pod's reference is left
    cs = e.expire_ghosts()
    att = cs.pods["pod-web-1-a"]
    assert att is not None and att.workload is not None and att.workload.kind == "ReplicaSet"
    assert cs.workloads == {
        "deployment-web": None, "replicaset-web-1": e.workload("replicaset-web-1")
    }

    cs = e.delete({"apiVersion": "v1", "kind": "Pod", "metadata": {"uid": "pod-web-1-a"}})
    assert cs.pods == {"pod-web-1-a": None} and cs.workloads == {"replicaset-web-1": None}
    assert list(e.pods()) == [] and list(e.workloads()) == []


def test_owner_change_moves_the_pod() -> None:
    e = Engine()
    a, b = deployment("a"), deployment("b")
    rsa, rsb = replicaset("a-1", a), replicaset("b-1", b)
    e.upsert_many([a, b, rsa, rsb, pod("p", rsa)])
    cs = e.upsert(pod("p", rsb))
    assert wname(P(cs, "pod-p")) == "b"
    assert W(cs, "deployment-a").replicas[0].observed == 0
    assert W(cs, "deployment-b").replicas[0].observed == 1
    cs = e.upsert(pod("p"))  # orphaned: now a bare pod, its own workload
    att = cs.pods["pod-p"]
    assert att is not None and att.workload is not None
    assert (att.workload.kind, att.workload.uid, att.component) == ("Pod", "pod-p", "pod")
    assert W(cs, "pod-p").phase == "Running"


def test_reparenting_an_owner_moves_its_whole_subtree() -> None:
    e = Engine()
    a, b = deployment("a"), deployment("b")
    rs = replicaset("r", a)
    pods = [pod(f"r-{i}", rs) for i in range(3)]
    e.upsert_many([a, b, rs, *pods])
    cs = e.upsert(replicaset("r", b))
    assert set(cs.pods) == {"pod-r-0", "pod-r-1", "pod-r-2"}
    assert {wname(P(cs, uid)) for uid in cs.pods} == {"b"}


def in_namespace(o: dict[str, Any], namespace: str) -> dict[str, Any]:
    o["metadata"]["namespace"] = namespace
    return o


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_an_owner_in_another_namespace_is_absent(order: tuple[int, ...]) -> None:
    """A pod in team-b whose controller reference carries the uid of a ReplicaSet in
    team-a: Kubernetes disallows cross-namespace owners (its garbage collector treats
    such an owner as absent), so the pod is not stamped with team-a's Deployment nor
    counted in its facts, in whatever order the objects arrive, one by one or at once."""
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    intruder = in_namespace(pod("intruder", rs), "team-b")
    objs = [dep, rs, intruder]
    for batch in (True, False):
        e = Engine()
        ordered = [objs[i] for i in order]
        if batch:
            e.upsert_many(ordered)
        else:
            for o in ordered:
                e.upsert(o)
        att = P(e, "pod-intruder")
        assert (att.workload, att.reason) == (None, "owner_missing")
        assert [(w.ref.namespace, w.ref.name) for w in e.workloads()] == [(NS, "web")]
        assert W(e, "deployment-web").replicas[0].observed == 0
        explained = e.explain("team-b", "intruder")
        assert explained is not None and explained.walk_end == "owner_missing"
        assert [(link.name, link.seen) for link in explained.chain] == [("web-1", False)]
    # the ReplicaSet gone, its ghost is team-a's still: absent to the intruder as the
    # object was (the ghost keeps what the pod had while the chain was whole)
    ghost_clock = ManualClock(0.0)
    e._graph._clock = ghost_clock
    cs = e.delete(rs)
    assert "pod-intruder" not in cs.pods
    assert P(e, "pod-intruder").reason == "owner_missing"
    # once the ghost expired, the reference names an owner not seen: as before (the
    # ReplicaSet kind is described, so it is the workload, known from the reference)
    ghost_clock.now += 601
    cs = e.expire_ghosts()
    assert P(cs, "pod-intruder").workload is not None
    w = P(e, "pod-intruder").workload
    assert w is not None and (w.namespace, w.kind) == ("team-b", "ReplicaSet")


def test_a_cluster_scoped_owner_is_followed_from_any_namespace() -> None:
    e = Engine()
    e.add_descriptions([describe(karta({"group": "example.com", "kind": "Fleet"}, []))])
    fleet = in_namespace(obj("example.com/v1", "Fleet", "f"), "")
    rs = replicaset("f-1", fleet)
    e.upsert_many([fleet, rs, pod("p", rs)])
    w = P(e, "pod-p").workload
    assert w is not None and (w.namespace, w.kind, w.name) == ("", "Fleet", "f")
    # but a namespaced owner above a cluster-scoped one is not (nor is it from one)
    e2 = Engine(builtins=False)
    e2.add_descriptions([describe(karta({"group": "example.com", "kind": "Fleet"}, []))])
    top = obj("example.com/v1", "Fleet", "top")
    mid = in_namespace(obj("example.com/v1", "Link", "mid", top), "")
    e2.upsert_many([top, mid, pod("q", mid)])
    assert P(e2, "pod-q").reason == "owner_missing"


# -- reasons ----------------------------------------------------------------------------


def test_reasons_without_builtins() -> None:
    e = Engine(builtins=False)
    node = obj("v1", "Node", "n1")
    widget_ref = obj("example.com/v1", "Widget", "w")
    cs = e.upsert_many([
        pod("bare"),
        node,
        pod("static", node),
        pod("orphan", widget_ref),
        pod("rs-pod", replicaset("r", None)),
        pod("executor", pod("bare")),
    ])
    reasons = {a.pod: a.reason for a in cs.pods.values() if a is not None}
    assert reasons == {
        "bare": "no_controller_owner",
        "static": "no_controller_owner",  # a mirror pod is a bare pod to the engine
        "executor": "no_described_owner",  # the Pod description is what places it
        "orphan": "owner_missing",
        "rs-pod": "owner_missing",
    }
    assert all(a.workload is None for a in e.pods())
    assert list(e.workloads()) == []


def test_hop_limit() -> None:
    e = Engine(max_owner_hops=3)
    top = raycluster("rc", ["g"])
    chain = [obj("example.com/v1", "Link", f"l{i}") for i in range(4)]
    chain[3] = obj("example.com/v1", "Link", "l3", top)
    for i in range(3):
        chain[i] = obj("example.com/v1", "Link", f"l{i}", chain[i + 1])
    e.add_descriptions([describe(RAY_KARTA)])
    e.upsert_many([top, *chain, pod("p", chain[0], **{"ray.io/node-type": "head"})])
    assert P(e, "pod-p").reason == "hop_limit"
    e2 = Engine(max_owner_hops=5)
    e2.add_descriptions([describe(RAY_KARTA)])
    e2.upsert_many([top, *chain, pod("p", chain[0], **{"ray.io/node-type": "head"})])
    assert wname(P(e2, "pod-p")) == "rc"


@pytest.mark.parametrize("order", ["top first", "pods first", "one by one"])
def test_a_described_owner_below_the_hop_limit_goes_where_its_own_walk_goes(
        order: str) -> None:
    """pod -> ReplicaSet -> Deployment -> Link -> Link -> RayCluster, at most 4 hops: the
    pod's walk stops at the limit above the Deployment, whose own walk (from higher up)
    reaches the RayCluster. The pod goes where the Deployment goes: one workload, not
    the Deployment a workload of its pods and a member of the RayCluster at once."""
    top = raycluster("rc", ["g"])
    l2 = obj("example.com/v1", "Link", "l2", top)
    l1 = obj("example.com/v1", "Link", "l1", l2)
    dep = obj("apps/v1", "Deployment", "d", l1, spec={"replicas": 1})
    rs = replicaset("d-1", dep)
    objs = [top, l2, l1, dep, rs, pod("p", rs)]
    e = Engine(max_owner_hops=4)
    e.add_descriptions([describe(RAY_KARTA)])
    if order == "one by one":
        for o in objs:
            e.upsert(o)
    else:
        e.upsert_many(objs if order == "top first" else objs[::-1])
    assert wname(P(e, "pod-p")) == "rc"
    assert [w.ref.name for w in e.workloads()] == ["rc"]
    assert W(e, "raycluster-rc").replicas[-1].observed == 1
    # the link to the RayCluster broken: the Deployment is the top, pods and object
    e.upsert(obj("example.com/v1", "Link", "l2"))
    assert wname(P(e, "pod-p")) == "d"
    assert sorted(w.ref.name for w in e.workloads()) == ["d", "rc"]
    assert W(e, "deployment-d").replicas[0].observed == 1
    # an invalid description of the kind above, past the pod's limit: the same answer
    # for the pod as for the Deployment (no workload below it)
    e.upsert(obj("example.com/v1", "Link", "l2", top))
    e.upsert(jobset_karta(ownerless=True))
    e.upsert(in_kind(top, "jobset.x-k8s.io/v1alpha2", "JobSet"))
    assert P(e, "pod-p").reason == "description_error"
    assert list(e.workloads()) == []


def in_kind(o: dict[str, Any], api: str, kind: str) -> dict[str, Any]:
    return {**o, "apiVersion": api, "kind": kind}


def test_owner_cycle_is_bounded() -> None:
    e = Engine(builtins=False)
    a = obj("example.com/v1", "Loop", "a")
    b = obj("example.com/v1", "Loop", "b", a)
    a = obj("example.com/v1", "Loop", "a", b)
    cs = e.upsert_many([a, b, pod("p", a)])
    assert P(cs, "pod-p").reason == "hop_limit"
    ghost_clock = ManualClock(0.0)
    e._graph._clock = ghost_clock
    cs = e.delete(a)  # a's ghost still names b: the cycle is walked as before
    assert "pod-p" not in cs.pods and P(e, "pod-p").reason == "hop_limit"
    ghost_clock.now += 601
    cs = e.expire_ghosts()
    assert P(cs, "pod-p").reason == "owner_missing"


@pytest.mark.parametrize("hops", [4, 5, 6, 7])
@pytest.mark.parametrize("order", ["deployment first", "replicaset first"])
def test_an_owner_cycle_of_described_kinds_makes_no_workload(hops: int, order: str) -> None:
    """Deployment <-> ReplicaSet (both described by the built-ins): the pod is
    ``hop_limit`` and neither object is a workload (a ReplicaSet workload with 0 pods
    and phase facts of its own came and went with the hop count's parity). Broken,
    the cycle leaves the ordinary chain."""
    e = Engine(max_owner_hops=hops)
    d = obj("apps/v1", "Deployment", "dcyc", spec={"replicas": 1})
    rs = replicaset("rcyc", d)
    d = obj("apps/v1", "Deployment", "dcyc", rs, spec={"replicas": 1})
    p = pod("p", rs)
    objs = [d, rs, p] if order == "deployment first" else [rs, d, p]
    e.upsert_many(objs)
    assert P(e, "pod-p").reason == "hop_limit"
    assert list(e.workloads()) == []
    # the same, one object at a time
    e2 = Engine(max_owner_hops=hops)
    for o in objs:
        e2.upsert(o)
    assert P(e2, "pod-p").reason == "hop_limit" and list(e2.workloads()) == []
    explained = e2.explain(NS, "p")
    assert explained is not None and explained.walk_end == "hop_limit"
    assert [link.name for link in explained.chain] == ["rcyc", "dcyc"]
    assert not any(link.workload for link in explained.chain)
    # the Deployment loses its owner: Deployment -> ReplicaSet -> pod again
    cs = e2.upsert(obj("apps/v1", "Deployment", "dcyc", spec={"replicas": 1}))
    assert wname(P(cs, "pod-p")) == "dcyc"
    assert [w.ref.name for w in e2.workloads()] == ["dcyc"]
    assert W(e2, "deployment-dcyc").replicas[0].observed == 1


@pytest.mark.parametrize("source", ["api", "files", "snapshot"])
def test_an_invalid_description_above_a_nested_kind_makes_no_workload_below_it(
        source: str, tmp_path: Path) -> None:
    """A JobSet whose only description is invalid may be the topmost workload of its
    Jobs: a pod under a Job (described by the built-ins) reads ``description_error``
    as one owned by the JobSet directly does, and no Job becomes a workload of its own
    (each Job of the JobSet was one, with phase and replica facts). Fixed, the JobSet
    is the one workload. The same whatever the description came from: an API object, a
    description file, a snapshot file (from a file each Job was a workload)."""
    e = Engine()
    js = obj("jobset.x-k8s.io/v1alpha2", "JobSet", "js", spec={"replicatedJobs": []})
    job = obj("batch/v1", "Job", "js-workers-0", js, spec={"parallelism": 1})
    objs = [js, job, pod("w", job), pod("d", js)]
    f = tmp_path / "jobset.yaml"
    f.write_text(yaml.safe_dump(jobset_karta(ownerless=True)))
    if source == "api":
        e.upsert(jobset_karta(ownerless=True))
    elif source == "files":
        descs, errors = load_description_file(f)
        assert descs == [] and len(errors) == 1 and errors[0].kind == JOBSET
        e.add_descriptions(descs, errors=errors)
    else:
        with f.open("a") as out:
            out.write("---\n" + yaml.safe_dump_all(objs))
        load_snapshot(f, e)
    assert len(e.description_errors) == 1
    # nothing of it in force, from any source (karta_proxy_description_errors)
    assert e.description_problems() == {"invalid": 1, "held_last_valid": 0,
                                        "not_in_force": 0}
    if source != "snapshot":
        e.upsert_many(objs)
    assert P(e, "pod-w").reason == "description_error"
    assert P(e, "pod-d").reason == "description_error"
    assert list(e.workloads()) == []
    if source == "api":
        cs = e.upsert(jobset_karta(ownerless=False))
    else:
        source_name = "files" if source == "files" else snapshot.DESCRIPTION_SOURCE
        cs = e.add_descriptions([describe(jobset_karta(ownerless=False))], source=source_name)
    assert e.description_errors == []
    assert set(e.description_problems().values()) == {0}
    assert {wname(P(cs, "pod-w")), wname(P(cs, "pod-d"))} == {"js"}
    assert [w.ref.name for w in e.workloads()] == ["js"]


def test_an_invalid_edit_of_a_description_object_keeps_its_last_valid_version(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Karta object edited into an invalid description: the version in force stays (as
    a reload's invalid file keeps the files in force), the error reported beside it. It
    was dropped: every pod of the kind read ``description_error``, each of its series
    changing label set, until the next edit. Deleted, it goes as before."""
    e = Engine()
    js = obj("jobset.x-k8s.io/v1alpha2", "JobSet", "js", spec={"replicatedJobs": []})
    job = obj("batch/v1", "Job", "js-workers-0", js, spec={"parallelism": 1})
    e.upsert(jobset_karta(ownerless=False))
    e.upsert_many([js, job, pod("w", job)])
    assert wname(P(e, "pod-w")) == "js"
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    cs = e.upsert(jobset_karta(ownerless=True))
    assert "pod-w" not in cs.pods and wname(P(e, "pod-w")) == "js"
    assert [err.kind for err in e.description_errors] == [JOBSET]
    assert e.description_problems() == {"invalid": 0, "held_last_valid": 1,
                                        "not_in_force": 0}
    assert [w.ref.name for w in e.workloads()] == ["js"]
    assert any("its last valid version stays in force" in r.getMessage()
               for r in caplog.records), caplog.text
    e.upsert(jobset_karta(ownerless=False))  # mended
    assert e.description_errors == [] and wname(P(e, "pod-w")) == "js"
    e.upsert(jobset_karta(ownerless=True))
    e.delete(jobset_karta(ownerless=True))
    assert e.description_errors == []
    assert wname(P(e, "pod-w")) == "js-workers-0"  # the Job, JobSet described no more


JOBSET = GroupKind("jobset.x-k8s.io", "JobSet")


def jobset_karta(*, ownerless: bool) -> dict[str, Any]:
    """The test JobSet description, made invalid by a child whose component owner
    (``ownerRef``) does not exist when ``ownerless``."""
    raw = copy.deepcopy(descriptions.JOBSET_KARTA)
    raw["spec"]["structureDefinition"]["childComponents"] = [{
        "name": "workers", "ownerRef": "nope" if ownerless else "jobset",
        "specDefinition": {"podTemplateSpecPath": ".spec.template"}}]
    return raw


def test_invalid_objects_are_counted_not_raised() -> None:
    e = Engine()
    for bad in [
        "not a mapping",
        {"kind": "Pod"},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "no-uid"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": "x"},
    ]:
        assert not e.upsert(bad)  # type: ignore[arg-type]
        assert not e.delete(bad)  # type: ignore[arg-type]
    assert e.stats[STAT_INVALID_OBJECT] == 8
    weird = pod("weird")
    weird["metadata"]["labels"] = ["not", "a", "map"]
    weird["metadata"]["ownerReferences"] = [{"controller": True}, "junk"]
    cs = e.upsert(weird)
    assert P(cs, "pod-weird").workload is not None  # malformed refs ignored: a bare pod


# -- descriptions -----------------------------------------------------------------------


def test_adding_and_removing_a_description_reattributes_its_kind_only() -> None:
    e = Engine()
    rc = raycluster("rc", ["cpu"])
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    e.upsert_many([rc, dep, rs, pod("web-1-a", rs),
                   pod("head", rc, **{"ray.io/node-type": "head"}),
                   pod("w1", rc, **{"ray.io/node-type": "worker", "ray.io/group": "cpu"})])
    assert P(e, "pod-head").reason == "no_described_owner"
    assert GroupKind("ray.io", "RayCluster") in e.required_kinds()  # an owner kind seen

    cs = e.add_descriptions([describe(RAY_KARTA)], source="files")
    assert set(cs.pods) == {"pod-head", "pod-w1"}
    assert cs.kinds_changed and e.required_kinds()[GroupKind("ray.io", "RayCluster")] == "full"
    # the RayCluster was seen before its kind was described, so its object was not kept:
    # its instance ids are unknown and the pod's id is taken unchecked
    assert (P(cs, "pod-w1").component, P(cs, "pod-w1").instance) == ("worker", "cpu")
    w = cs.workloads["raycluster-rc"]
    assert w is not None and w.phase_reason == "workload_object_missing"
    cs = e.upsert(rc)  # the relist a source does on kinds_changed
    w = cs.workloads["raycluster-rc"]
    assert w is not None and w.phase == "Running"

    cs = e.add_descriptions([], source="files")
    assert set(cs.pods) == {"pod-head", "pod-w1"} and cs.kinds_changed
    assert cs.workloads == {"raycluster-rc": None}
    assert P(e, "pod-w1").reason == "no_described_owner"


def _ray_cluster_engine(e: Engine, *clusters: str) -> list[str]:
    """RayClusters (``rc`` when none is named), each with a head and five workers; the
    uids of their pods (``pod-head``, ``pod-w0``...; ``pod-rc2-w0``... for the others)."""
    uids = []
    for name in clusters or ("rc",):
        rc, prefix = raycluster(name, ["cpu"]), "" if name == "rc" else f"{name}-"
        pods = [pod(f"{prefix}head", rc, **{"ray.io/node-type": "head"}),
                *(_ray_worker(f"{prefix}w{i}", rc) for i in range(5))]
        e.upsert_many([rc, *pods])
        uids += [p["metadata"]["uid"] for p in pods]
    return uids


def _ray_worker(name: str, rc: dict[str, Any]) -> dict[str, Any]:
    return pod(name, rc, **{"ray.io/node-type": "worker", "ray.io/group": "cpu"})


def test_a_description_read_again_unchanged_reattributes_nothing() -> None:
    """Every configuration reload reads the description files again: equal descriptions
    (their jq programs compiled anew) keep the plan in force, and nothing is redone."""
    e = Engine()
    _ray_cluster_engine(e)
    assert set(e.add_descriptions([describe(RAY_KARTA)]).pods) >= {"pod-head", "pod-w0"}
    again = describe(RAY_KARTA)
    assert again == describe(RAY_KARTA) and hash(again) == hash(describe(RAY_KARTA))
    change = e.change_descriptions([again])
    assert change.owed == [] and not change.changes
    assert not e.add_descriptions([describe(RAY_KARTA)])
    # a changed one is a change
    other = descriptions.raycluster_karta(head_replicas=True)
    assert e.change_descriptions([describe(other)]).owed


def test_a_description_change_reattributed_in_runs_ends_as_at_once() -> None:
    """``change_descriptions`` owes the objects of the kinds it changes; until
    ``reattribute`` gets to one, it and what lies below it keep their attribution, and in
    runs the end is what ``add_descriptions`` gives."""
    at_once, in_runs = Engine(clock=ManualClock(100.0)), Engine(clock=ManualClock(100.0))
    for e in (at_once, in_runs):
        uids = _ray_cluster_engine(e, "rc", "rc2", "rc3")
    whole = at_once.add_descriptions([describe(RAY_KARTA)], source="files")

    change = in_runs.change_descriptions([describe(RAY_KARTA)], source="files")
    assert change.changes.kinds_changed and not change.changes.pods
    # the RayCluster objects: what lies below each is found as it is given
    assert change.owed == ["raycluster-rc", "raycluster-rc2", "raycluster-rc3"]
    assert P(in_runs, "pod-w1").reason == "no_described_owner"  # not re-attributed yet
    merged = ChangeSet()
    merged.merge(change.changes)
    for uid in change.owed:
        run = in_runs.reattribute([uid])
        assert len(run.pods) == 6  # its pods, each once
        merged.merge(run)
    assert merged.pods == whole.pods
    assert {u: in_runs.pod(u) for u in uids} == {u: at_once.pod(u) for u in uids}
    assert list(in_runs.workloads()) == list(at_once.workloads())

    gone = in_runs.change_descriptions(None, source="files")
    in_runs.delete(pod("w1"))  # gone before its run: skipped
    rest = in_runs.reattribute(gone.owed)
    assert P(rest, "pod-w0").reason == "no_described_owner" and "pod-w1" not in rest.pods


def test_pods_that_join_leave_or_move_between_the_runs_end_as_at_once() -> None:
    """What lies below an owed object is found when its run comes: a pod that joined it
    meanwhile, left it, or moved to an object already given ends as if the change had been
    made at once, before those events."""
    at_once, in_runs = Engine(clock=ManualClock(100.0)), Engine(clock=ManualClock(100.0))
    for e in (at_once, in_runs):
        uids = _ray_cluster_engine(e, "rc", "rc2", "rc3")
    at_once.add_descriptions([describe(RAY_KARTA)], source="files")
    change = in_runs.change_descriptions([describe(RAY_KARTA)], source="files")
    first, *later = change.owed
    assert first == "raycluster-rc"
    in_runs.reattribute([first])
    rc, rc2 = raycluster("rc", ["cpu"]), raycluster("rc2", ["cpu"])
    for e in (at_once, in_runs):
        e.upsert(_ray_worker("rc2-w9", rc2))  # joins an object not given yet
        e.delete(pod("rc2-w1"))  # leaves it
        e.upsert(_ray_worker("rc3-w0", rc))  # moves to the object given already
    assert P(in_runs, "pod-rc2-w0").reason == "no_described_owner"  # still owed
    in_runs.reattribute(later)
    present = [u for u in [*uids, "pod-rc2-w9"] if u != "pod-rc2-w1"]
    assert {u: in_runs.pod(u) for u in present} == {u: at_once.pod(u) for u in present}
    moved = P(in_runs, "pod-rc3-w0").workload
    assert moved is not None and moved.name == "rc"
    assert in_runs.pod("pod-rc2-w1") is None
    assert list(in_runs.workloads()) == list(at_once.workloads())


def test_a_change_of_nested_kinds_owes_each_object_once_under_its_topmost() -> None:
    """Builtins off changes Deployment, ReplicaSet and Pod at once: a ReplicaSet below an
    owed Deployment is given with it, not owed again, so each pod is re-attributed once."""
    # what the end must be: an engine that never had builtins
    at_once, in_runs = Engine(builtins=False), Engine(clock=ManualClock(100.0))
    dep, lone = deployment("web"), replicaset("lone-1", None)
    rs = replicaset("web-1", dep)
    objs = [dep, rs, lone, pod("a", rs), pod("b", rs), pod("c", lone), pod("bare")]
    for e in (at_once, in_runs):
        e.upsert_many(objs)
    change = in_runs.change_descriptions(None, source="builtin")
    uids = [o["metadata"]["uid"] for o in objs]
    assert sorted(change.owed) == sorted([dep["metadata"]["uid"], lone["metadata"]["uid"],
                                          "pod-bare"])
    given = [u for uid in change.owed for u in in_runs.reattribute([uid]).pods]
    assert sorted(given) == ["pod-a", "pod-b", "pod-bare", "pod-c"]  # each once
    assert {u: in_runs.pod(u) for u in uids} == {u: at_once.pod(u) for u in uids}
    assert P(in_runs, "pod-a").reason == "no_described_owner"


def test_a_description_object_upserted_with_owed_leaves_its_reattribution_to_the_caller(
        ) -> None:
    """``upsert_many(..., owed=)``: the objects a description object's change touches go
    to the list; given with ``reattribute``, the end is what the upsert alone gives."""
    karta_obj = {**RAY_KARTA, "metadata": {**RAY_KARTA["metadata"], "uid": "karta-1"}}
    at_once, owing = Engine(clock=ManualClock(100.0)), Engine(clock=ManualClock(100.0))
    for e in (at_once, owing):
        _ray_cluster_engine(e)
    whole = at_once.upsert(karta_obj)
    owed: list[str] = []
    cs = owing.upsert_many([karta_obj], owed=owed)
    assert owed == ["raycluster-rc"] and not cs.pods and cs.kinds_changed
    assert P(owing, "pod-w1").reason == "no_described_owner"
    cs.merge(owing.reattribute(owed))
    assert cs.pods == whole.pods
    assert list(owing.workloads()) == list(at_once.workloads())
    owed.clear()
    assert not owing.delete_many([karta_obj], owed=owed).pods and owed == ["raycluster-rc"]
    assert not owing.upsert_many([pod("w9")], owed=owed).kinds_changed  # no description


def test_instances_of_a_map_get_their_own_desired_counts() -> None:
    """Instances listed by a map's keys (``keys[]``, sorted) and desired counts by its
    values (``.[]``): gojq iterates the map in key order, so the counts line up with the
    ids; libjq on the map as written gave the worker the frontend's count."""
    graph = karta({"group": "example.com", "kind": "Graph"}, [{
        "name": "service", "ownerRef": "root",
        "specDefinition": {"podTemplateSpecPath": ".spec.services[]"},
        "scaleDefinition": {"replicasPath": ".spec.services[] | (.replicas // 1)"},
        "instanceIdPath": ".spec.services | keys[]",
        "podSelector": {"componentInstanceSelector": {"idPath": '.metadata.labels["svc"]'}},
    }])
    e = Engine()
    e.add_descriptions([describe(graph)])
    g = obj("example.com/v1", "Graph", "g",
            spec={"services": {"worker": {"replicas": 4}, "frontend": {"replicas": 1}}})
    e.upsert_many([g, pod("f-0", g, svc="frontend"),
                   *(pod(f"w-{i}", g, svc="worker") for i in range(4))])
    rows = {(r.instance, r.desired, r.observed) for r in W(e, "graph-g").replicas}
    assert rows == {("frontend", 1.0, 1), ("worker", 4.0, 4)}


def test_an_id_too_long_or_with_control_characters_is_not_stamped(
        caplog: pytest.LogCaptureFixture) -> None:
    """Instance and replica ids are label values: one read from what a pod's author
    writes (an annotation, up to 256 KiB) or from the workload object, over 1024 bytes or
    holding a control character, is refused as a jq error of its path: the pod placed
    without it (its series never stamped with 100,000 bytes that an upstream refuses
    with the whole write), counted, logged once per workload, the value cut."""
    graph = karta({"group": "example.com", "kind": "Graph"}, [{
        "name": "service", "ownerRef": "root",
        "specDefinition": {"podTemplateSpecPath": ".spec.services[]"},
        "scaleDefinition": {"replicasPath": ".spec.services[] | .replicas"},
        "instanceIdPath": ".spec.services | keys[]",
        "podSelector": {
            "componentInstanceSelector": {"idPath": '.metadata.annotations["svc"]'},
            "replicaSelector": {"keyPath": '.metadata.annotations["n"]'}},
    }])
    e = Engine()
    e.add_descriptions([describe(graph)])
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    long_id = "s" * 100_000
    g = obj("example.com/v1", "Graph", "g",
            spec={"services": {"ok": {"replicas": 2}, "bad\nline": {"replicas": 1}}})
    h = obj("example.com/v1", "Graph", "h", spec={"services": {long_id: {"replicas": 1}}})

    def annotated(name: str, owner: dict[str, Any], **ann: str) -> dict[str, Any]:
        p = pod(name, owner)
        p["metadata"]["annotations"] = ann
        return p

    e.upsert_many([g, h,
                   annotated("ok-0", g, svc="ok", n="0"),
                   annotated("ok-1", g, svc="ok", n="x" * 100_000),
                   annotated("nl-0", g, svc="bad\nline", n="a\x7fb"),
                   annotated("long-0", h, svc=long_id, n="0")])
    assert (P(e, "pod-ok-0").instance, P(e, "pod-ok-0").replica) == ("ok", "0")
    assert (P(e, "pod-ok-1").instance, P(e, "pod-ok-1").replica) == ("ok", "")
    assert (P(e, "pod-nl-0").component, P(e, "pod-nl-0").instance) == ("service", "")
    assert P(e, "pod-nl-0").replica == ""
    assert (P(e, "pod-long-0").instance, P(e, "pod-long-0").replica) == ("", "0")
    # the workloads' instance ids: g lists one it cannot stamp, h only one: both unknown,
    # the rows named by the pods
    for uid in ("graph-g", "graph-h"):
        for r in W(e, uid).replicas:
            assert len(r.instance.encode()) <= 1024 and "\n" not in r.instance, uid
    assert {r.instance for r in W(e, "graph-g").replicas} == {"ok", ""}
    # counted: three pod selectors (ok-1's replica, nl-0's instance and replica, long-0's
    # instance), two workload paths
    assert _jq_errors(e, JQ_ERROR_SELECTOR) == 4
    assert _jq_errors(e, JQ_ERROR_WORKLOAD) == 2
    lines = [r.getMessage() for r in caplog.records if "jq error" in r.getMessage()]
    assert lines and all(len(line) < 1000 for line in lines), [len(x) for x in lines]
    assert any("id refused: 100000 bytes, over the 1024 bytes" in line for line in lines)
    assert any("id refused: holds a control character: bad\\x0aline" in line
               for line in lines)


def test_jq_runtime_errors_are_logged_once_per_workload_and_expression_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """A status path, a scale path and a pod selector failing at run time (``.[]`` on
    null): each counted every time, logged once per workload and expression, naming the
    description, the workload and jq's message."""
    thing = karta({"group": "example.com", "kind": "Thing"}, [
        {"name": "a", "ownerRef": "root",
         "specDefinition": {"podTemplateSpecPath": ".spec.template"},
         "podSelector": {"componentTypeSelector": {
             "keyPath": ".metadata.labels | to_entries[] | .value[]", "value": "x"}}},
        {"name": "b", "ownerRef": "root",
         "specDefinition": {"podTemplateSpecPath": ".spec.template"}},
    ], scaleDefinition={"replicasPath": ".spec.groups[].replicas"},
        statusDefinition={"phaseDefinition": {"path": ".status.items[].phase"},
                          "statusMappings": {"running": [{"byPhase": "Running"}]}})
    e = Engine()
    e.add_descriptions([describe(thing)])
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    things = [obj("example.com/v1", "Thing", f"t{i}", spec={"groups": None},
                  status={"items": None}) for i in range(2)]
    e.upsert_many([*things, *(pod(f"p{i}-{j}", things[i], role="x")
                              for i in range(2) for j in range(3))])
    assert W(e, "thing-t0").phase_reason.startswith("jq_error: Cannot iterate over null")
    assert P(e, "pod-p0-0").component == "b"  # the selector failed: the default took it
    assert _jq_errors(e, JQ_ERROR_STATUS) == 2 and _jq_errors(e, JQ_ERROR_WORKLOAD) == 2
    assert _jq_errors(e, JQ_ERROR_SELECTOR) == 6
    # the same, by where and by the description whose expression failed
    assert e.jq_errors == {("status", "test-thing"): 2, ("workload", "test-thing"): 2,
                           ("selector", "test-thing"): 6}
    lines = [r.getMessage() for r in caplog.records if "jq error" in r.getMessage()]
    assert len(lines) == 6, lines  # per workload: status, scale path, selector
    for what in ("status of description test-thing", "workload path '.spec.groups[].replicas'",
                 "pod selector '.metadata.labels | to_entries[] | .value[]'"):
        assert sum(what in line for line in lines) == 2, what
    assert all("Thing team-a/t" in line and "Cannot iterate over" in line for line in lines)
    # a new version of the object, failing again: counted, not logged again
    caplog.clear()
    e.upsert(obj("example.com/v1", "Thing", "t0", spec={"groups": None},
                 status={"items": None, "x": 1}))
    assert _jq_errors(e, JQ_ERROR_STATUS) == 3
    assert e.jq_errors[("status", "test-thing")] == 3
    assert not [r for r in caplog.records if "jq error" in r.getMessage()]


def test_a_selector_failing_on_some_pods_names_the_pod_and_spares_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica path that fails on one pod only (a label the others have, a value it
    refuses): that pod loses its replica, every other keeps its place, and the warning
    names the pod as well as the description and the workload (it named the workload
    alone: which of its pods was to be guessed)."""
    thing = karta({"group": "example.com", "kind": "Thing"}, [
        {"name": "w", "ownerRef": "root",
         "specDefinition": {"podTemplateSpecPath": ".spec.template"},
         "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "w"}},
                         "replicaSelector": {"keyPath": '.metadata.labels.idx | '
                                             'if . == "1" then error("no") else . end'}}},
        {"name": "ps", "ownerRef": "root",
         "specDefinition": {"podTemplateSpecPath": ".spec.ps"},
         "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "ps"}}}},
    ])
    e = Engine()
    e.add_descriptions([describe(thing)])
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    t = obj("example.com/v1", "Thing", "t")
    e.upsert_many([t, *(pod(f"p{i}", t, role="w", idx=str(i)) for i in range(3))])
    assert [(P(e, f"pod-p{i}").component, P(e, f"pod-p{i}").replica)
            for i in range(3)] == [("w", "0"), ("w", ""), ("w", "2")]
    assert _jq_errors(e, JQ_ERROR_SELECTOR) == 1
    [line] = [r.getMessage() for r in caplog.records if "jq error" in r.getMessage()]
    assert "description test-thing" in line and "Thing team-a/t, pod team-a/p1:" in line


def test_a_scale_path_of_the_wrong_type_is_counted_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """``replicasPath: .spec.workers`` (the object where its ``.replicas`` was meant): the
    desired count was unknown without a word or a count; now it is a workload jq error,
    the pods attributed as before."""
    thing = karta({"group": "example.com", "kind": "Thing"}, [
        {"name": "w", "ownerRef": "root",
         "specDefinition": {"podTemplateSpecPath": ".spec.template"},
         "scaleDefinition": {"replicasPath": ".spec.workers"}}])
    e = Engine()
    e.add_descriptions([describe(thing)])
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    t = obj("example.com/v1", "Thing", "t", spec={"workers": {"replicas": 2}})
    e.upsert_many([t, pod("p0", t)])
    assert P(e, "pod-p0").component == "w"
    assert [r.desired for r in W(e, "thing-t").replicas] == [None]
    assert _jq_errors(e, JQ_ERROR_WORKLOAD) == 1
    [line] = [r.getMessage() for r in caplog.records if "jq error" in r.getMessage()]
    assert ("workload path '.spec.workers'" in line
            and 'yielded an object, not a number' in line), line


def test_instance_ids_checked_against_the_workload_and_followed() -> None:
    e = Engine()
    e.add_descriptions([describe(RAY_KARTA)])
    rc = raycluster("rc", ["cpu"])
    p_cpu = pod("a", rc, **{"ray.io/node-type": "worker", "ray.io/group": "cpu"})
    p_gpu = pod("b", rc, **{"ray.io/node-type": "worker", "ray.io/group": "gpu"})
    e.upsert_many([rc, p_cpu, p_gpu])
    assert P(e, "pod-a").instance == "cpu"
    assert P(e, "pod-b").instance == ""
    assert e.stats[STAT_INSTANCE_NOT_LISTED] >= 1
    rows = {(r.component, r.instance): (r.desired, r.observed)
            for r in W(e, "raycluster-rc").replicas}
    assert rows == {("head", ""): (None, 0), ("worker", "cpu"): (1, 1), ("worker", ""): (None, 1)}

    cs = e.upsert(raycluster("rc", ["cpu", "gpu"]))  # a group added: its pods follow
    assert set(cs.pods) == {"pod-b"} and P(cs, "pod-b").instance == "gpu"
    rows = {(r.component, r.instance): (r.desired, r.observed)
            for r in W(cs, "raycluster-rc").replicas}
    assert rows == {("head", ""): (None, 0), ("worker", "cpu"): (1, 1), ("worker", "gpu"): (1, 1)}


def test_a_null_or_empty_instance_id_keeps_its_place_for_the_desired_counts() -> None:
    """The replicas line up with the ids by position: ids ["", "b"] with replicas [5, 1]
    gave "b" 5 (the empty id was dropped, and its place with it). Now "b" is 1 and the
    empty id has no row; the same where the rows are not templated (another component's
    ids unknown: its path fails)."""
    groups = {"name": "a", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
              "instanceIdPath": ".spec.groups[].name",
              "scaleDefinition": {"replicasPath": ".spec.groups[].replicas"},
              "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "a"}},
                              "componentInstanceSelector": {"idPath": '.metadata.labels["g"]'}}}
    broken = {"name": "z", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.z"},
              "instanceIdPath": ".spec.none[]",  # .[] on null: a jq error, ids unknown
              "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "z"}},
                              "componentInstanceSelector": {"idPath": '.metadata.labels["g"]'}}}
    for children in ([groups], [groups, broken]):
        e = Engine()
        e.add_descriptions([describe(karta({"group": "example.com", "kind": "Thing"},
                                           children))])
        for name, first in (("t", {"name": ""}), ("u", {})):
            thing = obj("example.com/v1", "Thing", name, spec={"groups": [
                {**first, "replicas": 5}, {"name": "b", "replicas": 1}]})
            e.upsert_many([thing, pod(f"{name}-p", thing, role="a", g="b")])
            rows = {(r.component, r.instance): r.desired for r in W(e, f"thing-{name}").replicas
                    if r.component == "a"}
            assert rows == {("a", "b"): 1.0}, (children, name)
            assert P(e, f"pod-{name}-p").instance == "b"


def test_component_choice_ambiguous_fallback_and_errors() -> None:
    sel = '.metadata.labels["role"]'
    raw = karta(
        {"group": "example.com", "kind": "Thing"},
        [
            {"name": "a", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
             "podSelector": {"componentTypeSelector": {"keyPath": sel}}},  # any role
            {"name": "b", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.b"},
             "podSelector": {"componentTypeSelector": {"matchLabels": {"role": "b"}}}},
            {"name": "c", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.c"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": '.metadata.labels | if .boom then error("boom") else .role end',
                 "value": "c"}}},
        ],
    )
    e = Engine()
    e.add_descriptions([describe(raw)])
    thing = obj("example.com/v1", "Thing", "t")
    e.upsert_many([
        thing,
        pod("both", thing, role="b"),  # a and b accept: the first declared wins, counted
        pod("none", thing),  # no selector accepts: still the workload's, component ""
        pod("err", thing, boom="1"),  # c fails with a jq error: counted, not accepted
    ])
    comp = {a.pod: a.component for a in e.pods()}
    assert comp == {"both": "a", "none": "", "err": ""}
    assert e.stats[STAT_AMBIGUOUS_COMPONENT] == 1 and _jq_errors(e, JQ_ERROR_SELECTOR) == 1
    assert all(a.workload is not None for a in e.pods())
    rows = {(r.component, r.observed) for r in W(e, "thing-t").replicas}
    assert rows == {("a", 1), ("b", 0), ("c", 0), ("", 2)}


def test_match_labels_accept_a_pod_only_when_every_label_is_equal() -> None:
    """The newer type selector's ``matchLabels``: every label must be equal (one missing
    or different, the pod is not accepted), and beside a ``keyPath`` both must hold."""
    raw = karta(
        {"group": "example.com", "kind": "Thing"},
        [
            {"name": "labels", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
             "podSelector": {"componentTypeSelector": {
                 "matchLabels": {"role": "a", "tier": "x"}}}},
            {"name": "both", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.b"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": ".metadata.labels.kind", "value": "b",
                 "matchLabels": {"role": "b"}}}},
        ],
    )
    e = Engine()
    e.add_descriptions([describe(raw)])
    thing = obj("example.com/v1", "Thing", "t")
    e.upsert_many([
        thing,
        pod("all", thing, role="a", tier="x"),
        pod("one-missing", thing, role="a"),
        pod("one-different", thing, role="a", tier="y"),
        pod("key-and-labels", thing, role="b", kind="b"),
        pod("labels-only", thing, role="b"),
        pod("key-only", thing, kind="b"),
    ])
    got = {a.pod: a.component for a in e.pods()}
    assert got == {"all": "labels", "one-missing": "", "one-different": "",
                   "key-and-labels": "both", "labels-only": "", "key-only": ""}
    assert e.stats[STAT_AMBIGUOUS_COMPONENT] == 0


def test_the_only_pod_bearing_component_owns_every_pod_without_running_its_selector(
) -> None:
    """With exactly one pod-bearing component (upstream's single leaf) every pod of the
    workload is in it: its type selector is not run, so one that would refuse the pod,
    or fail, changes nothing."""
    raw = karta(
        {"group": "example.com", "kind": "Thing"},
        [{"name": "group", "ownerRef": "root"},  # a logical grouping carries no pods
         {"name": "only", "ownerRef": "group", "specDefinition": {"podSpecPath": ".spec.a"},
          "podSelector": {"componentTypeSelector": {
              "keyPath": '.metadata.labels | if .boom then error("boom") else .role end',
              "value": "worker"}}}],
    )
    e = Engine()
    e.add_descriptions([describe(raw)])
    thing = obj("example.com/v1", "Thing", "t")
    e.upsert_many([thing, pod("worker", thing, role="worker"), pod("other", thing, role="x"),
                   pod("failing", thing, boom="1")])
    assert {a.pod: a.component for a in e.pods()} == {
        "worker": "only", "other": "only", "failing": "only"}
    assert _jq_errors(e, JQ_ERROR_SELECTOR) == 0


def test_a_description_without_a_pod_bearing_component_keeps_its_pods_in_the_workload(
) -> None:
    """No component carries pods (no ``specDefinition`` anywhere): no selector can accept
    a pod, so each is the workload's with component "" (workload sums stay complete),
    counted on the ("", "") row."""
    raw = karta({"group": "example.com", "kind": "Thing"},
                [{"name": "group", "ownerRef": "root"}],
                scaleDefinition={"replicasPath": ".spec.replicas"})
    e = Engine()
    e.add_descriptions([describe(raw)])
    thing = obj("example.com/v1", "Thing", "t", spec={"replicas": 2})
    e.upsert_many([thing, pod("p", thing), pod("q", thing)])
    assert {(wname(a), a.component, a.instance) for a in e.pods()} == {("t", "", "")}
    rows = [(r.component, r.desired, r.observed) for r in W(e, "thing-t").replicas]
    assert rows == [("root", 2.0, 0), ("", None, 2)]


def test_selectors_compare_as_upstream_json_equality_and_count_every_output() -> None:
    """A type selector's ``value`` matches a string output equal to it, not a number 0
    or a boolean true whose text is "0" or "true"; an instance id path yielding
    [null, "x"] yields two results, so no id (it was "x")."""
    raw = karta(
        {"group": "example.com", "kind": "Thing"},
        [
            {"name": "zero", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": ".metadata.labels.idx | tonumber", "value": "0"}}},
            {"name": "flag", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.b"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": ".metadata.labels.idx | tonumber > 0", "value": "true"}}},
            {"name": "text", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.c"},
             "instanceIdPath": ".spec.ids[]",
             "podSelector": {"componentTypeSelector": {"keyPath": ".metadata.labels.kind",
                                                       "value": "t"},
                             "componentInstanceSelector": {
                                 "idPath": '.metadata.labels["g"], .metadata.labels["h"]'}}},
        ],
    )
    e = Engine()
    e.add_descriptions([describe(raw)])
    thing = obj("example.com/v1", "Thing", "t", spec={"ids": ["x"]})
    e.upsert_many([thing, pod("p0", thing, idx="0"), pod("p1", thing, idx="1"),
                   pod("one", thing, kind="t", h="x"), pod("two", thing, kind="t", g="y", h="x")])
    got = {a.pod: (a.component, a.instance) for a in e.pods()}
    assert got == {"p0": ("", ""), "p1": ("", ""), "one": ("text", ""), "two": ("text", "")}


def test_a_description_taking_effect_changing_or_replacing_a_builtin_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Karta replacing the built-in Deployment description took over without a line,
    and 400 edits of a description logged nothing: an info line when the description in
    force for a kind changes, edits of one description at most one a minute (the rest
    counted in the next), another description taking over at once; the built-ins at the
    start are not news."""
    clock = ManualClock(1000.0)
    caplog.set_level(logging.INFO, logger="proxy.karta.engine")
    wall = ManualClock(1_800_000_000.0)
    e = Engine(clock=wall, retry_clock=clock)

    def lines() -> list[str]:
        out = [r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO and "attributed again" in r.getMessage()]
        caplog.clear()
        return out

    assert lines() == []  # the built-ins
    dep = descriptions.karta("my-deploy", descriptions.component("web", "apps", "Deployment"))
    e.upsert(dep)
    assert lines() == [
        "karta engine: description my-deploy (api:Karta/my-deploy) replaces the built-in "
        "description builtin-apps-deployment of Deployment.apps; its objects and pods are "
        "attributed again"]
    for i in range(400):  # a controller rewriting it in a loop
        edited = copy.deepcopy(dep)
        edited["spec"]["structureDefinition"]["rootComponent"]["name"] = f"web{i}"
        e.upsert(edited)
    assert lines() == []  # within the minute: held back
    clock.now += 61
    wall.now -= 3600  # an NTP step back: the minute is on the monotonic clock (on the
    # wall clock, every line of this description was held back for the hour)
    e.upsert(dep)
    assert lines() == [
        "karta engine: description my-deploy (api:Karta/my-deploy) of Deployment.apps "
        "changed; its objects and pods are attributed again (400 earlier change(s) in the "
        "last 60 s not logged)"]
    # a burst's last edits, with none after them: told once their minute is over
    for i in range(5):
        edited = copy.deepcopy(dep)
        edited["spec"]["structureDefinition"]["rootComponent"]["name"] = f"late{i}"
        e.upsert(edited)
    e.log_held_changes()
    assert lines() == []  # the minute is not over
    clock.now += 61
    e.log_held_changes()
    e.log_held_changes()  # once
    held = [r.getMessage() for r in caplog.records if "not logged then" in r.getMessage()]
    caplog.clear()
    assert held == [
        "karta engine: 5 more change(s) of the description in force for Deployment.apps in "
        "the minute after the last line, not logged then; description my-deploy "
        "(api:Karta/my-deploy) of Deployment.apps is in force"]
    thing = karta({"group": "example.com", "kind": "Thing"}, [])
    e.upsert(thing)
    assert lines() == ["karta engine: description test-thing (api:Karta/test-thing) takes "
                       "effect for Thing.example.com; its objects and pods are attributed "
                       "again"]
    e.delete(dep)  # the built-in again, at once
    e.delete(thing)
    assert lines() == [
        "karta engine: built-in description builtin-apps-deployment (builtin:"
        "builtin-apps-deployment) replaces description my-deploy (api:Karta/my-deploy) for "
        "Deployment.apps; its objects and pods are attributed again",
        "karta engine: Thing.example.com is no longer described (description test-thing "
        "(api:Karta/test-thing) left); its objects and pods are attributed again"]


def test_a_pod_selector_reading_what_the_engine_does_not_keep_is_told_at_load(
        caplog: pytest.LogCaptureFixture) -> None:
    """Selectors see only the pod metadata the engine keeps: one reading ``.spec`` or
    other metadata saw null there, silently. It is now named at load time (a warning,
    counted, listed in ``description_warnings``); the description stays in force."""
    raw = karta(
        {"group": "example.com", "kind": "Thing"},
        [
            {"name": "sched", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.a"},
             "podSelector": {"componentTypeSelector": {"keyPath": ".spec.schedulerName",
                                                       "value": "volcano"}}},
            {"name": "gen", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.b"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": '.metadata.generateName | startswith("w-")', "value": "true"}}},
            {"name": "fine", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.c"},
             "podSelector": {"componentTypeSelector": {
                 "keyPath": ".metadata.labels.idx | tonumber > 0", "value": "true"}}},
        ],
    )
    e = Engine()
    assert e.description_warnings == [] and not e.stats[STAT_SELECTOR_UNKEPT_FIELD]
    with caplog.at_level(logging.WARNING, logger="proxy.karta.engine"):
        e.add_descriptions([describe(raw)])
    assert e.description_warnings == [
        "test (test-thing): component 'sched': componentTypeSelector.keyPath "
        "'.spec.schedulerName' reads .spec.schedulerName",
        "test (test-thing): component 'gen': componentTypeSelector.keyPath "
        "'.metadata.generateName | startswith(\"w-\")' reads .metadata.generateName",
    ]
    assert e.stats[STAT_SELECTOR_UNKEPT_FIELD] == 2
    assert "description test-thing (test): component 'sched'" in caplog.text
    assert GroupKind("example.com", "Thing") in e.descriptions()  # still in force
    e.add_descriptions([describe(raw)])  # the same again: not told twice
    assert e.stats[STAT_SELECTOR_UNKEPT_FIELD] == 2
    e.remove_descriptions("files")
    assert e.description_warnings == []


def test_description_objects_from_the_api() -> None:
    e = Engine()
    rc = raycluster("rc", ["cpu"])
    e.upsert_many([rc, pod("h", rc, **{"ray.io/node-type": "head"})])
    raw = dict(RAY_KARTA)
    cs = e.upsert(raw)
    assert cs.kinds_changed and P(cs, "pod-h").component == "head"
    assert not e.upsert(raw)  # a resync of the same object changes nothing
    cs = e.delete({"apiVersion": "run.ai/v1alpha1", "kind": "Karta",
                   "metadata": {"name": "test-raycluster"}})
    assert cs.kinds_changed and P(cs, "pod-h").reason == "no_described_owner"


def test_a_description_another_wins_over_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two descriptions of one kind: the loser is reported (docs/karta.md), in the log
    once, from any source; a resync or a re-read changes nothing, a new loser is told."""
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    e = Engine()

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "not in force" in r.getMessage()]

    zzz, aaa = copy.deepcopy(RAY_KARTA), copy.deepcopy(RAY_KARTA)
    zzz["metadata"] = {"name": "zzz-team", "uid": "z"}
    aaa["metadata"] = {"name": "aaa-platform", "uid": "a"}
    e.upsert(zzz)
    assert told() == []
    e.upsert(aaa)
    assert len(told()) == 1 and "(zzz-team)" in told()[0] and "'aaa-platform'" in told()[0]
    assert [x.name for x in e.selection_losers()] == ["zzz-team"]
    e.upsert(aaa)  # a resync
    e.add_descriptions([describe(RAY_KARTA)], source="files")  # a third, from a file
    assert len(told()) == 2 and "test-raycluster" in told()[1]
    e.add_descriptions([describe(RAY_KARTA)], source="files")  # read again
    assert len(told()) == 2
    assert sorted(x.name for x in e.selection_losers()) == ["test-raycluster", "zzz-team"]


def test_an_invalid_edit_is_held_only_while_its_last_valid_version_is_in_force() -> None:
    """``held_last_valid`` says what a restart changes: a Karta object edited invalid
    whose last valid version lost to another description of its kind changes nothing at
    a restart (the winner stays), so it is ``invalid``; the winner edited invalid is
    held. The counts add up to ``description_errors`` (the loser held is also
    ``not_in_force``)."""
    e = Engine()
    zzz, aaa = copy.deepcopy(RAY_KARTA), copy.deepcopy(RAY_KARTA)
    zzz["metadata"] = {"name": "zzz-team", "uid": "z"}
    aaa["metadata"] = {"name": "aaa-platform", "uid": "a"}
    e.upsert_many([zzz, aaa])

    def broken(raw: dict[str, Any]) -> dict[str, Any]:
        raw = copy.deepcopy(raw)
        del raw["spec"]["structureDefinition"]["rootComponent"]["name"]
        return raw

    e.upsert(broken(zzz))
    assert e.description_problems() == {"invalid": 1, "held_last_valid": 0,
                                        "not_in_force": 1}
    e.upsert(broken(aaa))  # the one in force
    assert e.description_problems() == {"invalid": 1, "held_last_valid": 1,
                                        "not_in_force": 1}
    assert sum(e.description_problems().values()) == len(e.description_errors)
    e.upsert_many([zzz, aaa])  # mended
    assert e.description_problems() == {"invalid": 0, "held_last_valid": 0,
                                        "not_in_force": 1}


def test_a_karta_and_a_resourceinterface_of_one_name_are_two_descriptions() -> None:
    """Two resources, two objects: migrating a kind from a ResourceInterface to a Karta
    of the same name, then deleting the ResourceInterface, leaves the Karta in force
    (both were keyed ``api:<name>``: each replaced the other, and the deletion took the
    Karta's description with it)."""
    e = Engine()
    rc = raycluster("rc", ["cpu"])
    e.upsert_many([rc, pod("h", rc, **{"ray.io/node-type": "head"})])
    ri = dict(RAY_KARTA, apiVersion="optimization.nvidia.com/v1alpha1",
              kind="ResourceInterface")
    assert P(e.upsert(ri), "pod-h").component == "head"
    e.upsert(RAY_KARTA)  # the same name, the current form
    assert {gk.kind for gk in e.descriptions()} >= {"RayCluster"}
    # the RI loses to the Karta (rule 2); both are known, neither replaced the other
    assert [err.source for err in e.description_errors] == [
        "api:ResourceInterface/test-raycluster"]
    cs = e.delete({"apiVersion": "optimization.nvidia.com/v1alpha1",
                   "kind": "ResourceInterface", "metadata": {"name": "test-raycluster"}})
    assert not cs.pods  # the Karta describes RayCluster as before
    assert P(e, "pod-h").component == "head"
    assert GroupKind("ray.io", "RayCluster") in e.descriptions()
    assert e.description_errors == []
    # and the other way round: the Karta deleted, a ResourceInterface of its name returns
    e.upsert(ri)
    e.delete({"apiVersion": "run.ai/v1alpha1", "kind": "Karta",
              "metadata": {"name": "test-raycluster"}})
    assert GroupKind("ray.io", "RayCluster") in e.descriptions()
    assert P(e, "pod-h").component == "head"


def test_user_description_overrides_builtin_and_builtins_can_be_off() -> None:
    raw = karta({"group": "apps", "kind": "Deployment"}, [],
                specDefinition={"podTemplateSpecPath": ".spec.template"})
    e = Engine()
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    e.upsert_many([dep, rs, pod("a", rs)])
    assert P(e, "pod-a").description == "builtin-apps-deployment"
    cs = e.add_descriptions([describe(raw)])
    assert P(cs, "pod-a").description == "test-deployment"
    assert P(cs, "pod-a").component == "root"
    off = Engine(builtins=False)
    off.upsert_many([dep, rs, pod("a", rs)])
    assert P(off, "pod-a").reason == "no_described_owner"
    assert GroupKind("", "Pod") in off.required_kinds()


def test_required_kinds_follow_owner_chains() -> None:
    e = Engine()
    w = obj("example.com/v1", "Widget", "w")
    cs = e.upsert(pod("p", w))
    assert cs.kinds_changed and e.required_kinds()[GroupKind("example.com", "Widget")] == "metadata"
    cs = e.delete(pod("p", w))
    assert cs.kinds_changed and GroupKind("example.com", "Widget") not in e.required_kinds()


def test_owned_pods_keep_no_spec_or_status() -> None:
    e = Engine()
    dep = deployment("web")
    rs = replicaset("r", dep)
    e.upsert_many([dep, rs, pod("a", rs)])
    rec = e._pods["pod-a"]
    assert rec.obj is None and rec.cache is None
    assert set(rec.jq_input()["metadata"]) == {"name", "namespace", "uid", "labels",
                                               "ownerReferences"}
    assert e._graph.objects["replicaset-r"].obj is not None  # described kind: kept
    assert e._graph.objects["deployment-web"].obj is not None


def test_a_kept_object_is_its_jq_text_evaluated_without_a_parse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A described object is kept as the text jq reads, handed to jq as it is: an update
    serialises it once and parses nothing back in Python. Kept as other JSON, it was
    written three times and parsed twice per update (a check of the kept text, then a
    parse and a sorted serialisation per evaluation): ~50 ms of the event loop for a
    1.7 MB Argo Workflow, whose status changes every second or two while it runs."""
    e = Engine()
    dep = deployment("web")
    e.upsert(dep)
    assert W(e, "deployment-web").phase == "Running"
    rolled = copy.deepcopy(dep)
    rolled["status"]["readyReplicas"] = 1  # keys written out of jq's order: sorted once
    rolled["metadata"]["annotations"] = {"z": "1", "a": "2"}

    def parsed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the kept object was parsed back")

    monkeypatch.setattr(json, "loads", parsed)
    cs = e.upsert(rolled)
    monkeypatch.undo()
    assert W(cs, "deployment-web").phase == "Degraded"
    kept = e._graph.objects["deployment-web"].obj
    assert isinstance(kept, Packed) and kept.text == object_text(rolled)


@pytest.mark.parametrize("builtins", [True, False])
def test_construction(builtins: bool) -> None:
    e = Engine(builtins=builtins)
    assert e.description_errors == []
    assert list(e.pods()) == [] and list(e.workloads()) == []
    assert (GroupKind("apps", "Deployment") in e.required_kinds()) is builtins


# -- pods controlled by a bare pod; static pods; phase times from the object ------------


def spark_pod(name: str, role: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod as spark-submit makes it: the driver without a controller, executors with the
    driver pod as controller."""
    return pod(name, owner, **{"spark-app-selector": "spark-1a2b", "spark-role": role})


def test_a_bare_pod_is_the_workload_of_the_pods_it_controls() -> None:
    e = Engine()
    driver = spark_pod("pi-driver", "driver")
    execs = [spark_pod(f"pi-exec-{i}", "executor", driver) for i in (1, 2)]
    # executors before their driver (a watch may deliver them so): missing owner first
    e.upsert_many(execs)
    assert P(e, "pod-pi-exec-1").reason == "owner_missing"
    cs = e.upsert(driver)
    assert {uid: (wname(a), a.component) for uid, a in cs.pods.items() if a} == {
        "pod-pi-driver": ("pi-driver", "pod"),
        "pod-pi-exec-1": ("pi-driver", "controlled"),
        "pod-pi-exec-2": ("pi-driver", "controlled"),
    }
    a = P(e, "pod-pi-exec-1")
    assert a.workload is not None and (a.workload.kind, a.workload.group) == ("Pod", "")
    w = W(e, "pod-pi-driver")
    assert [(r.component, r.desired, r.observed) for r in w.replicas] == [
        ("pod", 1.0, 1), ("controlled", None, 2)]

    cs = e.delete(execs[0])
    assert [(r.component, r.observed) for r in W(cs, "pod-pi-driver").replicas] == [
        ("pod", 1), ("controlled", 1)]
    cs = e.delete(driver)  # the executors' owner is gone (the GC deletes them next)
    assert P(cs, "pod-pi-exec-2").reason == "owner_missing"
    assert cs.workloads["pod-pi-driver"] is None


def test_a_bare_pods_phase_follows_a_status_change_that_came_with_new_labels() -> None:
    """A bare pod is its own workload, its phase read from its status. An update that
    changed its labels (or annotations) and its status at once (a relist after missed
    events gives both in one) kept the old phase: only a status-only update settled its
    workload again, so the phase stayed Initializing until the pod's next change (found
    by tests/kube/test_source_stateful.py: a fresh index said Running)."""
    e = Engine(clock=lambda: 0.0)
    pending = pod("solo")
    pending["status"]["phase"] = "Pending"
    e.upsert(pending)
    assert W(e, "pod-solo").phase == "Initializing"
    cs = e.upsert(pod("solo", app="web"))  # Running, and a label
    assert W(cs, "pod-solo").phase == "Running"
    fresh = Engine(clock=lambda: 0.0)
    fresh.upsert(pod("solo", app="web"))
    assert W(e, "pod-solo") == W(fresh, "pod-solo")


def test_a_described_owner_above_the_driver_wins() -> None:
    """spark-operator: the SparkApplication controls the driver; once it is described,
    driver and executors are its components, not a Pod workload."""
    app = obj("sparkoperator.k8s.io/v1beta2", "SparkApplication", "pi",
              status={"applicationState": {"state": "RUNNING"}})
    driver = spark_pod("pi-driver", "driver", app)
    execs = [spark_pod(f"pi-exec-{i}", "executor", driver) for i in (1, 2)]
    e = Engine()
    e.upsert_many([app, driver, *execs])
    assert {P(e, f"pod-{n}").reason for n in ("pi-driver", "pi-exec-1")} == {
        "no_described_owner"}
    role = '.metadata.labels["spark-role"]'
    spark = describe(karta(
        {"group": "sparkoperator.k8s.io", "kind": "SparkApplication"},
        [{"name": "driver", "ownerRef": "root", "specDefinition": {"podSpecPath": ".spec.driver"},
          "podSelector": {"componentTypeSelector": {"keyPath": role, "value": "driver"}}},
         {"name": "executor", "ownerRef": "root",
          "specDefinition": {"podSpecPath": ".spec.executor"},
          "podSelector": {"componentTypeSelector": {"keyPath": role, "value": "executor"}}}],
    ))
    cs = e.add_descriptions([spark])
    assert {a.pod: (wname(a), a.component) for a in cs.pods.values() if a} == {
        "pi-driver": ("pi", "driver"), "pi-exec-1": ("pi", "executor"),
        "pi-exec-2": ("pi", "executor")}
    assert "pod-pi-driver" not in e._wl
    cs = e.remove_descriptions("files")
    assert {a.pod: a.reason for a in cs.pods.values() if a} == {
        "pi-driver": "no_described_owner", "pi-exec-1": "no_described_owner",
        "pi-exec-2": "no_described_owner"}


def test_a_driver_that_gains_a_controller_takes_its_executors_along() -> None:
    e = Engine()
    driver = spark_pod("pi-driver", "driver")
    ex = spark_pod("pi-exec-1", "executor", driver)
    e.upsert_many([driver, ex])
    assert wname(P(e, "pod-pi-exec-1")) == "pi-driver"
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    e.upsert_many([dep, rs])
    cs = e.upsert(spark_pod("pi-driver", "driver", rs))
    assert {a.pod: (wname(a), a.component) for a in cs.pods.values() if a} == {
        "pi-driver": ("web", "deployment"), "pi-exec-1": ("web", "deployment")}
    assert cs.workloads["pod-pi-driver"] is None


def test_pods_below_a_bare_pod_through_other_objects_are_controlled_too() -> None:
    """Any chain that ends at a bare pod: pod -> (undescribed) Widget -> bare pod."""
    e = Engine()
    top = pod("operator")
    widget = obj("example.com/v1", "Widget", "w", top)
    e.upsert_many([top, widget, pod("w-0", widget)])
    a = P(e, "pod-w-0")
    assert (wname(a), a.component) == ("operator", "controlled")
    assert [(r.component, r.observed) for r in W(e, "pod-operator").replicas] == [
        ("pod", 1), ("controlled", 1)]


def test_switching_the_pod_description_replaces_controlled_pods_too() -> None:
    e = Engine()
    driver = spark_pod("pi-driver", "driver")
    e.upsert_many([driver, spark_pod("pi-exec-1", "executor", driver)])
    mine = describe(karta({"group": "", "kind": "Pod"}, [],
                          specDefinition={"podSpecPath": ".spec"}))
    cs = e.add_descriptions([mine])
    assert {a.pod: (wname(a), a.component) for a in cs.pods.values() if a} == {
        "pi-driver": ("pi-driver", "root"), "pi-exec-1": ("pi-driver", "root")}


def mirror_pod(name: str, node: str = "cp-1", **status: Any) -> dict[str, Any]:
    """A static pod as the kubelet mirrors it: its Node as controller."""
    p = obj("v1", "Pod", name, obj("v1", "Node", node), status={"phase": "Running", **status},
            metadata={"labels": {"component": name.rsplit("-", 2)[0], "tier": "control-plane"},
                      "annotations": {"kubernetes.io/config.mirror": "3c1a",
                                      "kubernetes.io/config.source": "file"}},
            spec={"nodeName": node, "containers": [{"name": "c", "image": "x"}]})
    p["metadata"]["ownerReferences"][-1]["apiVersion"] = "v1"
    return p


def test_static_pods_are_their_own_workloads_and_nodes_are_not_watched() -> None:
    e = Engine()
    cs = e.upsert_many([mirror_pod("kube-apiserver-cp-1"), mirror_pod("etcd-cp-1")])
    assert {a.pod: (a.workload.kind if a.workload else a.reason, a.component)
            for a in cs.pods.values() if a} == {
        "kube-apiserver-cp-1": ("Pod", "pod"), "etcd-cp-1": ("Pod", "pod")}
    assert GroupKind("", "Node") not in e.required_kinds()
    assert W(e, "pod-etcd-cp-1").phase == "Running"


def test_slim_pod_keeps_mirror_pods_whole() -> None:
    from proxy.karta.slim import slim_pod

    p = mirror_pod("etcd-cp-1", conditions=[{"type": "Ready", "status": "True"}])
    assert slim_pod(p)["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    owned = pod("web-1-a", replicaset("web-1", None))
    owned["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert "conditions" not in slim_pod(owned)["status"]


def _cond(ctype: str, status: str, when: str, **rest: str) -> dict[str, str]:
    return {"type": ctype, "status": status, "lastTransitionTime": when, **rest}


T0 = "2026-11-30T09:00:02Z"
T0_UNIX = 1796029202.0


def test_phase_since_comes_from_the_matched_condition_and_survives_a_restart() -> None:
    """Two engines on the same objects at different times (a restart, a new leader) give
    the same phase time when the object says it; the observation fallback is labelled."""
    def objects() -> list[dict[str, Any]]:
        dep = deployment("web")
        dep["status"]["conditions"] = [
            _cond("Available", "True", T0, reason="MinimumReplicasAvailable"),
            _cond("Progressing", "True", "2026-11-01T00:00:00Z", reason="NewReplicaSetAvailable"),
        ]
        job = obj("batch/v1", "Job", "train", spec={"parallelism": 1},
                  status={"succeeded": 1, "conditions": [
                      _cond("SuccessCriteriaMet", "True", "2026-11-30T10:00:00Z"),
                      _cond("Complete", "True", "2026-11-30T10:00:01Z")]})
        sts = obj("apps/v1", "StatefulSet", "db", metadata={"generation": 1},
                  spec={"replicas": 1},
                  status={"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                          "readyReplicas": 1, "currentRevision": "r1", "updateRevision": "r1"})
        bare = pod("debug")
        bare["status"]["conditions"] = [_cond("Initialized", "True", "2026-11-30T08:00:00Z"),
                                        _cond("Ready", "False", "2026-11-30T08:05:00Z")]
        return [dep, job, sts, bare]

    got = []
    for now in (100.0, 5000.0):
        e = Engine(clock=functools.partial(float, now))
        e.upsert_many(objects())
        got.append({f.ref.name: (f.phase, f.phase_since, f.phase_since_source)
                    for f in e.workloads()})
    first, second = got
    assert first["web"] == second["web"] == ("Running", T0_UNIX, "object")
    # dated by SuccessCriteriaMet, when the outcome was decided (Complete follows it)
    assert first["train"] == second["train"] == ("Completed", T0_UNIX + 3598.0, "object")
    assert first["debug"] == second["debug"] == ("Running", T0_UNIX - 3602.0, "object")
    # a StatefulSet has no conditions: only the proxy's observation, and it says so
    assert (first["db"], second["db"]) == (("Running", 100.0, "observed"),
                                           ("Running", 5000.0, "observed"))


def test_time_in_running_restarts_after_a_rollout_that_left_available_true() -> None:
    # Available stays True through a rollout (its lastTransitionTime unchanged): Running
    # -> Initializing -> Running was dated from when Available went True, weeks before,
    # while karta_workload_phase showed the workload had left Running seconds ago
    weeks = T0_UNIX + 30 * 86400
    clock = ManualClock(weeks)
    e = Engine(clock=clock)
    dep = deployment("web")
    dep["status"]["conditions"] = [_cond("Available", "True", T0)]
    assert W(e.upsert(dep), "deployment-web").phase_since == T0_UNIX  # the object's
    clock.now = weeks + 100
    rolling = deployment("web")
    rolling["metadata"]["generation"] = 2
    rolling["status"]["conditions"] = [_cond("Available", "True", T0)]
    w = W(e.upsert(rolling), "deployment-web")
    assert (w.phase, w.phase_since, w.phase_since_source) == (
        "Initializing", weeks + 100, "observed")
    clock.now = weeks + 130
    done = deployment("web")
    done["metadata"]["generation"] = 2
    done["status"]["observedGeneration"] = 2
    done["status"]["conditions"] = [_cond("Available", "True", T0)]
    w = W(e.upsert(done), "deployment-web")
    assert (w.phase, w.phase_since, w.phase_since_source) == ("Running", weeks + 130, "observed")
    # a condition that did move with the change still dates it
    clock.now = weeks + 200
    failing = deployment("web")
    failing["metadata"]["generation"] = 2
    failing["status"]["observedGeneration"] = 2
    failing["status"]["conditions"] = [
        _cond("Available", "True", T0),
        _cond("Progressing", "False", "2026-12-30T09:03:00Z", reason="ProgressDeadlineExceeded")]
    w = W(e.upsert(failing), "deployment-web")
    assert w.phase == "Failed" and w.phase_since_source == "object", w


def test_a_rollouts_end_dates_running_alike_before_and_after_a_restart() -> None:
    # the Deployment controller records a rollout's end as Progressing's reason
    # NewReplicaSetAvailable, dated by lastUpdateTime (lastTransitionTime stays: the
    # status was True throughout). The process that saw the rollout dated Running by its
    # sighting (source observed) and one started after it by Available's time, 14 days
    # before (source object): two series, two ages, for one workload
    available = "2026-11-16T09:00:02Z"
    ended = T0_UNIX + 30 * 86400 + 130

    def settled(generation: int, progressing_updated: str) -> dict[str, Any]:
        dep = deployment("web")
        dep["metadata"]["generation"] = generation
        dep["status"]["observedGeneration"] = generation
        dep["status"]["conditions"] = [
            _cond("Available", "True", available, lastUpdateTime=available),
            _cond("Progressing", "True", available, reason="NewReplicaSetAvailable",
                  lastUpdateTime=progressing_updated)]
        return dep

    clock = ManualClock(T0_UNIX + 30 * 86400)
    seen = Engine(clock=clock)
    w = W(seen.upsert(settled(1, available)), "deployment-web")
    assert (w.phase, w.phase_since_source) == ("Running", "object")
    clock.now += 100
    rolling = settled(2, available)
    rolling["status"]["observedGeneration"] = 2
    rolling["status"]["updatedReplicas"] = 0
    rolling["status"]["conditions"][1].update(reason="ReplicaSetUpdated")
    assert W(seen.upsert(rolling), "deployment-web").phase == "Initializing"
    clock.now = ended + 1
    done = settled(2, datetime.fromtimestamp(ended, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    before = W(seen.upsert(done), "deployment-web")
    restarted = Engine(clock=ManualClock(ended + 500))
    after = W(restarted.upsert(done), "deployment-web")
    assert (before.phase, before.phase_since, before.phase_since_source) == (
        "Running", ended, "object")
    assert (after.phase, after.phase_since, after.phase_since_source) == (
        "Running", ended, "object")


def test_a_workload_seen_before_its_object_keeps_the_objects_time() -> None:
    # pods before their Deployment at a start: Undefined (object missing) -> Running is
    # the object arriving, not a change this proxy saw; the object's time stands
    clock = ManualClock(T0_UNIX + 86400)
    e = Engine(clock=clock)
    rs = replicaset("web-1", deployment("web"))
    e.upsert_many([pod("web-1-a", rs), rs])
    assert W(e, "deployment-web").phase == "Undefined"
    clock.now += 1
    dep = deployment("web")
    dep["status"]["conditions"] = [_cond("Available", "True", T0)]
    w = W(e.upsert(dep), "deployment-web")
    assert (w.phase, w.phase_since, w.phase_since_source) == ("Running", T0_UNIX, "object")


def test_phase_since_follows_the_object_and_falls_back_when_evidence_goes() -> None:
    clock = ManualClock(100.0)
    e = Engine(clock=clock)
    dep = deployment("web")
    dep["status"]["conditions"] = [_cond("Available", "True", T0)]
    e.upsert(dep)
    assert (W(e, "deployment-web").phase_since, W(e, "deployment-web").phase_since_source) == (
        T0_UNIX, "object")
    clock.now = 2000.0  # a rollout: not settled, no condition dates it
    rolling = deployment("web")
    rolling["metadata"]["generation"] = 2
    rolling["status"]["conditions"] = [_cond("Available", "True", T0)]
    w = W(e.upsert(rolling), "deployment-web")
    assert (w.phase, w.phase_since, w.phase_since_source) == ("Initializing", 2000.0, "observed")
    # a time the object does not spell as RFC 3339 is no evidence
    odd = deployment("web")
    odd["status"]["conditions"] = [_cond("Available", "True", "yesterday")]
    clock.now = 3000.0
    w = W(e.upsert(odd), "deployment-web")
    assert (w.phase, w.phase_since, w.phase_since_source) == ("Running", 3000.0, "observed")


# -- re-evaluations after jq failures that may pass ------------------------------------------

#: a Thing whose phase and pod selector both go to jq (no plain lookup)
RETRIED_THING = karta({"group": "example.com", "kind": "Thing"}, [
    {"name": "a", "ownerRef": "root",
     "specDefinition": {"podTemplateSpecPath": ".spec.template"},
     "podSelector": {"componentTypeSelector": {
         "keyPath": ".metadata.labels.role | ascii_downcase", "value": "a"}}},
    {"name": "b", "ownerRef": "root",
     "specDefinition": {"podTemplateSpecPath": ".spec.template"}},
], statusDefinition={"phaseDefinition": {"path": ".status.phase | ascii_downcase"},
                     "statusMappings": {"running": [{"byPhase": "running"}]}})


@pytest.fixture
def sandboxes() -> Iterator[list[JqSandbox]]:
    """The sandboxes a test installs (as the proxy does: every expression through it),
    removed and closed at its end."""
    boxes: list[JqSandbox] = []
    try:
        yield boxes
    finally:
        for box in boxes:
            remove_runner(box)
            box.close()


def _installed(boxes: list[JqSandbox], box: JqSandbox) -> JqSandbox:
    boxes.append(box)
    install_runner(box)
    return box


def test_a_sandbox_that_cannot_start_is_retried_with_a_backoff_until_it_can(
        sandboxes: list[JqSandbox]) -> None:
    """Evaluations the sandbox failed (its child could not start): the workload's phase
    and the pod's place are evaluated again by ``retry_due`` 1 s later, then 2 s after
    that, ...: no object event needed; once the sandbox works, right, and nothing more
    is owed."""
    clock = ManualClock(1000.0)
    e = Engine(retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    broken = _installed(sandboxes, JqSandbox(command=["/nonexistent/python"]))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    e.upsert_many([thing, pod("p", thing, role="A")])
    assert W(e, "thing-t").phase == "Undefined"
    assert "jq sandbox child cannot start" in W(e, "thing-t").phase_reason
    assert P(e, "pod-p").component == "b"  # the selector failed: the default took it
    assert e.retries_owed() == 2 and not e.retries_due()
    clock.now += 0.9
    assert not e.retry_due(100, 10.0) and e.stats[STAT_JQ_RETRY] == 0
    clock.now += 0.1
    assert e.retries_due()
    e.retry_due(100, 10.0)  # failed again: owed 2 s later
    assert e.stats[STAT_JQ_RETRY] == 2 and e.retries_owed() == 2
    clock.now += 1.9
    e.retry_due(100, 10.0)
    assert e.stats[STAT_JQ_RETRY] == 2
    remove_runner(broken)
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    clock.now += 0.1
    cs = e.retry_due(1, 10.0)  # at most one a call
    assert e.stats[STAT_JQ_RETRY] == 3
    cs.merge(e.retry_due(100, 10.0))
    assert e.stats[STAT_JQ_RETRY] == 4 and e.retries_owed() == 0
    assert W(e, "thing-t").phase == "Running" and W(cs, "thing-t").phase == "Running"
    assert P(e, "pod-p").component == "a" and P(cs, "pod-p").component == "a"
    clock.now += 3600
    assert not e.retries_due() and e.stats[STAT_JQ_RETRY] == 4


def test_a_placed_pod_keeps_its_place_while_its_selectors_fail_for_now(
        sandboxes: list[JqSandbox]) -> None:
    """A pod in component ``a`` whose place is evaluated again (its labels changed) while
    the sandbox cannot run keeps ``a`` until the retry settles it, rather than falling to
    the default ``b`` for the outage and back: every such pod's series were stored under
    a second label set (``karta_component="b"``) in the TSDB, then a third-time-lucky
    return to the first. A change the retry finds (the role changed for real) moves it
    then; a new pod, which has no place to keep, takes the default as before."""
    clock = ManualClock(1000.0)
    e = Engine(retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    good = _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    e.upsert_many([thing, pod("p", thing, role="A")])
    assert P(e, "pod-p").component == "a"
    remove_runner(good)
    broken = _installed(sandboxes, JqSandbox(command=["/nonexistent/python"]))
    cs = e.upsert(pod("p", thing, role="A", tier="gold"))  # a label the engine reads
    assert P(e, "pod-p").component == "a" and "pod-p" not in cs.pods
    assert P(e.upsert(pod("q", thing, role="A")), "pod-q").component == "b"
    # the role changed for real meanwhile: the retry, once the sandbox works, moves it
    e.upsert(pod("p", thing, role="B", tier="gold"))
    assert P(e, "pod-p").component == "a"
    remove_runner(broken)
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    clock.now += 1
    cs = e.retry_due(100, 10.0)
    assert P(cs, "pod-p").component == "b" and P(cs, "pod-q").component == "a"
    assert e.retries_owed() == 0
    observed = {r.component: r.observed for r in W(e, "thing-t").replicas}
    assert observed == {"a": 1, "b": 1}


def test_the_expressions_own_jq_error_is_not_retried(sandboxes: list[JqSandbox]) -> None:
    clock = ManualClock(1000.0)
    e = Engine(retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": 1})
    e.upsert_many([thing, pod("p", thing, role="A"), pod("q", thing)])
    assert W(e, "thing-t").phase_reason.startswith("jq_error: ")
    assert P(e, "pod-q").component == "b"  # null | ascii_downcase: a jq error
    assert e.retries_owed() == 0
    clock.now += 3600
    assert not e.retry_due(100, 10.0) and e.stats[STAT_JQ_RETRY] == 0


def _killed_during(box: JqSandbox, event: Callable[[], object]) -> None:
    """``event`` runs while the sandbox's child is stopped, and the child is killed
    (SIGKILL) 0.3 s into it: the evaluation in flight fails."""
    assert box.run(JqExpr("."), "1") == [1]  # a child running
    pid = box.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        event()
    finally:
        killer.join()


def test_a_workload_failed_by_a_quarantine_is_evaluated_again_when_it_ends(
        sandboxes: list[JqSandbox]) -> None:
    """The status expression quarantined (three evaluations took the child down: killed
    during each): the phase reads the quarantine's jq error, retried at the backoff to
    no avail, and evaluated again once the quarantine's hour is over, though the object
    has not changed since."""
    clock = ManualClock(1000.0)
    hour = ManualClock(5000.0)
    e = Engine(retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    box = _installed(sandboxes, JqSandbox(timeout_seconds=10.0, clock=hour))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    e.upsert(thing)
    assert W(e, "thing-t").phase == "Running"
    for n in range(QUARANTINE_STRIKES):
        thing["metadata"]["generation"] = n + 1  # an object event: evaluated again
        _killed_during(box, lambda: e.upsert(thing))
        assert "killed by SIGKILL" in W(e, "thing-t").phase_reason
    assert box.is_quarantined(".status.phase | ascii_downcase")
    assert e.retries_owed() == 1
    clock.now += 1
    e.retry_due(100, 10.0)
    assert "quarantined for 1 h" in W(e, "thing-t").phase_reason
    assert e.stats[STAT_JQ_RETRY] == 1
    clock.now += 1800
    hour.now += 1800
    e.retry_due(100, 10.0)
    assert e.stats[STAT_JQ_RETRY] == 1  # owed at the quarantine's end
    clock.now += 1800
    hour.now += 1800
    e.retry_due(100, 10.0)
    assert e.stats[STAT_JQ_RETRY] == 2 and e.retries_owed() == 0
    assert W(e, "thing-t").phase == "Running"


def _failed_for_now(e: Engine, clock: ManualClock, sandboxes: list[JqSandbox],
                    thing: dict[str, Any]) -> None:
    """``thing`` updated (same phase) 100 s on while the sandbox cannot start; then the
    sandbox works again."""
    broken = _installed(sandboxes, JqSandbox(command=["/nonexistent/python"]))
    thing["metadata"]["generation"] = 2
    clock.now += 100
    w = W(e.upsert(thing), "thing-t")
    assert w.phase == "Undefined" and "cannot run" in w.phase_reason
    assert w.phase_since == clock.now and w.phase_since_source == "observed"
    remove_runner(broken)
    sandboxes.remove(broken)
    broken.close()
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))


def test_a_failure_that_may_pass_does_not_restart_the_time_in_phase(
        sandboxes: list[JqSandbox]) -> None:
    """Undefined while the sandbox could not evaluate is a gap in the evidence, not a
    phase the object was in: the Running after it goes on from the Running before it.
    It restarted at the gap's end before (one sandbox restart reset time-in-phase of
    every workload updated meanwhile)."""
    clock = ManualClock(1000.0)
    e = Engine(clock=clock, retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    assert W(e.upsert(thing), "thing-t").phase_since == 1000.0
    _failed_for_now(e, clock, sandboxes, thing)
    clock.now += 1
    w = W(e.retry_due(100, 10.0), "thing-t")  # the same object, evaluated again
    assert (w.phase, w.phase_since, w.phase_since_source) == ("Running", 1000.0, "observed")
    # and a change of phase later is dated as ever: the proxy's sighting
    clock.now += 50
    thing["status"] = {"phase": "Pending"}
    thing["metadata"]["generation"] = 3
    w = W(e.upsert(thing), "thing-t")
    assert (w.phase, w.phase_since) == ("Undefined", clock.now)  # no status matches
    assert e.retries_owed() == 0


def test_a_new_phase_after_a_failure_that_may_pass_begins_when_it_is_seen(
        sandboxes: list[JqSandbox]) -> None:
    """A different phase after the gap: first seen at the gap's end, and its object's
    evidence is judged against the phase before the gap (the gap is no phase)."""
    clock = ManualClock(1000.0)
    e = Engine(clock=clock, retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    _installed(sandboxes, JqSandbox(timeout_seconds=5.0))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    e.upsert(thing)
    _failed_for_now(e, clock, sandboxes, thing)
    clock.now += 1
    thing["status"] = {"phase": "Pending"}
    thing["metadata"]["generation"] = 3
    w = W(e.upsert(thing), "thing-t")
    assert (w.phase, w.phase_since, w.phase_reason) == ("Undefined", 1101.0,
                                                        "no_status_matched")
    # Running again: a real stretch of another phase lay between, so it begins now
    clock.now += 10
    thing["status"] = {"phase": "Running"}
    thing["metadata"]["generation"] = 4
    w = W(e.upsert(thing), "thing-t")
    assert (w.phase, w.phase_since) == ("Running", 1111.0)
    assert e.retries_owed() == 0


def test_jq_error_lines_are_capped_per_window_and_the_rest_counted_in_one_line(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the once-each set's size its pairs are forgotten and logged again: with the
    re-evaluations of a sandbox that cannot start (every pair again each backoff) an
    audit saw ~313 lines a second at 6,000 workloads. At most 20 lines a minute now, the
    rest in one line after it; every error still counted."""
    monkeypatch.setattr(engine_module, "_JQ_LOGGED_MAX", 10)
    now = [1000.0]
    monkeypatch.setattr(engine_module.time, "monotonic", lambda: now[0])
    e = Engine()
    e.add_descriptions([describe(RETRIED_THING)])
    caplog.set_level(logging.WARNING, logger="proxy.karta.engine")
    things = [obj("example.com/v1", "Thing", f"t{i}", status={"phase": 1}) for i in range(30)]
    e.upsert_many(things)
    for round_ in range(3):  # each version fails again: the 30 pairs past the set's 10
        e.upsert_many([obj("example.com/v1", "Thing", f"t{i}",
                           status={"phase": 1, "v": round_}) for i in range(30)])
    assert _jq_errors(e, JQ_ERROR_STATUS) == 120
    lines = [r.getMessage() for r in caplog.records if "jq error" in r.getMessage()]
    assert len(lines) == 20, len(lines)
    caplog.clear()
    now[0] += 60.0
    # a workload never logged (which 10 pairs the set holds depends on their order)
    e.upsert(obj("example.com/v1", "Thing", "t99", status={"phase": 1}))
    messages = [r.getMessage() for r in caplog.records]
    # 120 errors: 20 logged, 30 not logged again (the 10 pairs the set holds, in each of
    # the 3 later rounds), the other 70 held for the cap
    assert messages[0].startswith("karta engine: 70 more jq errors were not logged in the "
                                  "last 60 s"), messages
    assert len(messages) == 2 and "jq error in status" in messages[1]


def test_the_retry_heap_is_made_anew_when_stale_entries_pile_up(
        sandboxes: list[JqSandbox], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod deleted while it owes a retry left its heap entry (an hour away during a
    quarantine): under pod churn an audit saw 11,289 entries for 100 owed. The heap now
    stays within twice what is owed plus a slack."""
    monkeypatch.setattr(engine_module, "_RETRY_HEAP_SLACK", 8)
    clock = ManualClock(1000.0)
    e = Engine(retry_clock=clock)
    e.add_descriptions([describe(RETRIED_THING)])
    _installed(sandboxes, JqSandbox(command=["/nonexistent/python"]))
    thing = obj("example.com/v1", "Thing", "t", status={"phase": "Running"})
    e.upsert(thing)
    for i in range(200):
        p = pod(f"p{i}", thing, role="A")
        e.upsert(p)  # its selector failed for now: a retry owed
        e.delete(p)
    assert e.retries_owed() == 1  # the Thing's own
    assert len(e._retry_heap) <= 2 * e.retries_owed() + 8 + 1
    clock.now += 1.0
    e.retry_due(100, 10.0)
    assert e.stats[STAT_JQ_RETRY] == 1
