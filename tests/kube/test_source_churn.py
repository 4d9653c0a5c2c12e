"""Churn through the simulator and a real KubeSource: objects re-created under their
names, description objects of both forms sharing a name, owner cycles."""

from __future__ import annotations

import asyncio
import copy

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import contract
from proxy.config import FactSettings
from proxy.facts import FactsCollector, FactWriter
from proxy.karta.engine import Engine
from proxy.kube.source import KubeSource
from tests.karta.descriptions import raycluster_karta
from tests.kube.conftest import Obj, SourceFactory, deployment, eventually, labels, pod
from tests.kubesim import KubeSim

remote_pb2 = pytest.importorskip("proxy.pb.prometheus.remote_pb2")


def engine(source: KubeSource) -> Engine:
    assert isinstance(source.engine, Engine)
    return source.engine


async def test_a_karta_replacing_a_resourceinterface_of_its_name_stays_in_force(
    sim: KubeSim, make_source: SourceFactory
) -> None:
    """Migrating a kind's description from a ResourceInterface to a Karta of the same
    name, then deleting the ResourceInterface: the Karta stays in force (the two shared
    one source key, and the deletion took the Karta's description with it until the
    Karta was next edited)."""
    rc = sim.create({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                     "metadata": {"name": "rc", "namespace": "ml"},
                     "spec": {"workerGroupSpecs": [{"groupName": "gpu"}]}})
    sim.create(pod("rc-head", "ml", owner_obj=rc, labels={"ray.io/node-type": "head"}))
    k = raycluster_karta("raycluster")
    ri = copy.deepcopy(k)
    ri["apiVersion"], ri["kind"] = "optimization.nvidia.com/v1alpha1", "ResourceInterface"
    sim.create(ri)
    source = await make_source(watch_descriptions=True)
    await eventually(lambda: (labels(source, "ml", "rc-head") or {}).get("karta_kind")
                     == "RayCluster")
    sim.create(k)
    await eventually(lambda: any(e.source == "api:ResourceInterface/raycluster"
                                 for e in engine(source).description_errors))
    sim.delete(ri)
    await eventually(lambda: not engine(source).description_errors)
    await asyncio.sleep(0.3)  # what a wrong deletion would undo would be undone by now
    assert (labels(source, "ml", "rc-head") or {}).get("karta_component") == "head"
    assert any(gk.kind == "RayCluster" for gk in engine(source).descriptions())


def _owned_by_an_unseen_kind(name: str) -> Obj:
    """A pod whose controller is of an undescribed kind never seen: ``owner_missing``."""
    p = pod(name)
    p["metadata"]["ownerReferences"] = [{"apiVersion": "example.com/v1", "kind": "Foo",
                                         "name": "f", "uid": "foo-uid", "controller": True}]
    return p


async def test_a_relist_keeps_the_reason_of_a_pod_recreated_under_its_name(
    sim: KubeSim, make_source: SourceFactory
) -> None:
    """Pods deleted and re-created (new uids) while the watch is away, then a 410 and a
    relist: the new uid is given first, the old one retracted after. The names must read
    the new pods' ``owner_missing``, not ``pod_unknown`` (the old uid's retraction took
    the reason whatever uid it belonged to)."""
    _, rs, _ = deployment(sim, "web", replicas=1)
    sim.create(_owned_by_an_unseen_kind("p-unattr"))
    sim.create(pod("p-mixed", owner_obj=rs, labels={"app": "web"}))
    source = await make_source()
    index = source.index
    assert index.answer(b"default", b"p-unattr") == "owner_missing"
    assert labels(source, "default", "p-mixed") is not None
    old = {a.uid for a in index.pods.values()}
    await sim.stop()
    for name in ("p-unattr", "p-mixed"):
        sim.delete(sim.get("v1", "Pod", name, "default"))
        sim.create(_owned_by_an_unseen_kind(name))
    sim.compact()  # the watch's resourceVersion is gone: 410, relist
    await sim.start()
    await eventually(lambda: sum(a.pod.startswith("p-") for a in index.pods.values()) == 2
                     and not old & {a.uid for a in index.pods.values() if a.pod != "web-1-0"},
                     timeout=8)
    for key in (b"p-unattr", b"p-mixed"):
        assert index.answer(b"default", key) == "owner_missing"
        assert index.reason(b"default", key) == "owner_missing"


def _controlled_by(kind: str, name: str, uid: str) -> list[Obj]:
    return [{"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid,
             "controller": True}]


async def test_an_owner_cycle_of_described_kinds_makes_no_phantom_workload(
    sim: KubeSim, make_source: SourceFactory
) -> None:
    """A Deployment and a ReplicaSet controlling each other: the pod ends in
    ``hop_limit`` (docs/karta-attribution.md) and neither object is a workload (a
    ReplicaSet workload with 0 pods and phase facts of its own came with the hop count's
    parity)."""
    source = await make_source()
    sim.create({"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "dcyc", "namespace": "o", "uid": "dcyc",
                             "ownerReferences": _controlled_by("ReplicaSet", "rcyc", "rcyc")},
                "spec": {"replicas": 1}})
    sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": "rcyc", "namespace": "o", "uid": "rcyc",
                             "ownerReferences": _controlled_by("Deployment", "dcyc", "dcyc")},
                "spec": {"replicas": 1}})
    q = pod("dcyc-0", "o")
    q["metadata"]["ownerReferences"] = _controlled_by("ReplicaSet", "rcyc", "rcyc")
    sim.create(q)
    index = source.index
    await eventually(lambda: index.answer(b"o", b"dcyc-0") == "hop_limit")
    await asyncio.sleep(0.3)
    assert [w.ref.name for w in index.workloads.values() if w.ref.namespace == "o"] == []
    # the cycle broken: the Deployment is the workload of its ReplicaSet's pod again
    d = sim.get("apps/v1", "Deployment", "dcyc", "o")
    del d["metadata"]["ownerReferences"]
    sim.update(d)
    await eventually(lambda: (labels(source, "o", "dcyc-0") or {}).get("karta_workload")
                     == "dcyc")
    assert sorted((w.ref.kind, w.ref.name) for w in index.workloads.values()
                  if w.ref.namespace == "o") == [("Deployment", "dcyc")]


async def test_a_deployment_recreated_while_its_orphans_remain_is_one_workload_in_the_facts(
    sim: KubeSim, make_source: SourceFactory
) -> None:
    """A Deployment deleted with its ReplicaSet and pods orphaned, and created again under
    its name: two workloads of one identity in the engine. /metrics and the fact writer
    describe one, the one whose object is present, each label set once."""
    dep, rs, pods = deployment(sim, "web", replicas=2)
    source = await make_source()
    index = source.index
    sim.delete(dep, cascade=False)  # orphan: the ReplicaSet and pods stay
    await eventually(lambda: any(w.phase_reason == "workload_object_missing"
                                 for w in index.workloads.values()))
    deployment(sim, "web", replicas=1, rev="2")  # same name, a new uid
    await eventually(lambda: len(index.workloads) == 2 and len(index.shadowed) == 1)
    (served,) = index.fact_workloads().values()
    assert served.phase_reason != "workload_object_missing"
    assert served.ref.uid == sim.get("apps/v1", "Deployment", "web", "default")["metadata"]["uid"]
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    samples = [(s.name, tuple(sorted(s.labels.items())), s.value)
               for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples]
    keys = [(name, labels) for name, labels, _ in samples]
    assert len(keys) == len(set(keys)), "a label set served twice"
    phases = {dict(lb)["phase"]: v for name, lb, v in samples
              if name == contract.FACT_WORKLOAD_PHASE and dict(lb)["karta_workload"] == "web"}
    assert phases[served.phase] == 1.0 and phases["Undefined"] == 0.0
    bodies: list[bytes] = []

    async def send(body: bytes) -> None:
        bodies.append(body)

    await FactWriter(FactSettings(), index, send).write_once()
    written: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for body in bodies:
        req = remote_pb2.WriteRequest()
        req.ParseFromString(body)
        for ts in req.timeseries:
            written.setdefault(tuple((lb.name, lb.value) for lb in ts.labels), []).extend(
                s.value for s in ts.samples)
    assert all(len(v) == 1 for v in written.values())
    wphase = {dict(k)["phase"]: v[0] for k, v in written.items()
              if dict(k)["__name__"] == contract.FACT_WORKLOAD_PHASE
              and dict(k)["karta_workload"] == "web"}
    assert wphase == phases
    # the orphans go: one workload, nothing shadowed
    for p in pods:
        sim.delete(sim.get("v1", "Pod", p["metadata"]["name"], "default"))
    sim.delete(rs)
    await eventually(lambda: len(index.workloads) == 1 and not index.shadowed)
