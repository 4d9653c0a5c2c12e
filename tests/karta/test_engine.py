"""The engine's incremental behaviour: what each call changes, and only that."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.karta.description import parse_description
from proxy.karta.engine import (
    STAT_AMBIGUOUS_COMPONENT,
    STAT_INSTANCE_NOT_LISTED,
    STAT_INVALID_OBJECT,
    STAT_SELECTOR_ERROR,
    Engine,
)
from proxy.karta.model import Description, GroupKind
from proxy.karta.results import ChangeSet, PodAttribution, WorkloadFacts

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


def pod(name: str, owner: dict[str, Any] | None = None, **labels: str) -> dict[str, Any]:
    return obj(
        "v1", "Pod", name, owner,
        metadata={"labels": dict(labels)},
        spec={"containers": [{"name": "c", "image": "x"}]},
        status={"phase": "Running"},
    )


def karta(kind: dict[str, str], children: list[dict[str, Any]], **root: Any) -> dict[str, Any]:
    return {
        "apiVersion": "run.ai/v1alpha1",
        "kind": "Karta",
        "metadata": {"name": f"test-{kind['kind'].lower()}"},
        "spec": {
            "structureDefinition": {
                "rootComponent": {"name": "root", "kind": {"version": "v1", **kind}, **root},
                "childComponents": children,
            }
        },
    }


def describe(raw: dict[str, Any]) -> Description:
    return parse_description(raw, "test")


RAY = {"group": "ray.io", "kind": "RayCluster"}
RAY_KARTA = karta(
    RAY,
    [
        {
            "name": "head",
            "ownerRef": "root",
            "specDefinition": {"podTemplateSpecPath": ".spec.headGroupSpec.template"},
            "podSelector": {
                "componentTypeSelector": {"keyPath": '.metadata.labels["ray.io/node-type"]',
                                          "value": "head"}
            },
        },
        {
            "name": "worker",
            "ownerRef": "root",
            "specDefinition": {"podTemplateSpecPath": ".spec.workerGroupSpecs[]?.template"},
            "scaleDefinition": {"replicasPath": ".spec.workerGroupSpecs[]?.replicas"},
            "instanceIdPath": ".spec.workerGroupSpecs[]?.groupName",
            "podSelector": {
                "componentTypeSelector": {"keyPath": '.metadata.labels["ray.io/node-type"]',
                                          "value": "worker"},
                "componentInstanceSelector": {"idPath": '.metadata.labels["ray.io/group"]'},
            },
        },
    ],
    statusDefinition={"phaseDefinition": {"path": ".status.state"},
                      "statusMappings": {"running": [{"byPhase": "ready"}]}},
)


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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- order of arrival ------------------------------------------------------------------


def test_pod_before_its_owners_is_reattributed_when_they_arrive() -> None:
    e = Engine(clock=Clock())
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
    clock = Clock()
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
    e = Engine()
    dep = deployment("web")
    rs = replicaset("web-1", dep)
    e.upsert_many([dep, rs, pod("web-1-a", rs)])

    cs = e.delete(dep)  # the ReplicaSet still names it: the workload stays, object gone
    assert cs.pods == {}
    w = cs.workloads["deployment-web"]
    assert w is not None and w.phase_reason == "workload_object_missing"

    cs = e.delete(rs)  # now only the pod's reference to the ReplicaSet is left
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
    ])
    reasons = {a.pod: a.reason for a in cs.pods.values() if a is not None}
    assert reasons == {
        "bare": "no_controller_owner",
        "static": "no_described_owner",
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


def test_owner_cycle_is_bounded() -> None:
    e = Engine(builtins=False)
    a = obj("example.com/v1", "Loop", "a")
    b = obj("example.com/v1", "Loop", "b", a)
    a = obj("example.com/v1", "Loop", "a", b)
    cs = e.upsert_many([a, b, pod("p", a)])
    assert P(cs, "pod-p").reason == "hop_limit"
    cs = e.delete(a)
    assert P(cs, "pod-p").reason == "owner_missing"


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
    assert e.stats[STAT_AMBIGUOUS_COMPONENT] == 1 and e.stats[STAT_SELECTOR_ERROR] == 1
    assert all(a.workload is not None for a in e.pods())
    rows = {(r.component, r.observed) for r in W(e, "thing-t").replicas}
    assert rows == {("a", 1), ("b", 0), ("c", 0), ("", 2)}


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


@pytest.mark.parametrize("builtins", [True, False])
def test_construction(builtins: bool) -> None:
    e = Engine(builtins=builtins)
    assert e.description_errors == []
    assert list(e.pods()) == [] and list(e.workloads()) == []
    assert (GroupKind("apps", "Deployment") in e.required_kinds()) is builtins
