"""Churn through the simulator and a real KubeSource: objects re-created under their
names, description objects of both forms sharing a name, owner cycles."""

from __future__ import annotations

import asyncio
import copy

from proxy.karta.engine import Engine
from proxy.kube.source import KubeSource
from tests.karta.descriptions import raycluster_karta
from tests.kube.conftest import Obj, SourceFactory, deployment, eventually, labels, pod
from tests.kubesim import KubeSim


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
