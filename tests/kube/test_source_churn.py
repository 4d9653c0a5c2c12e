"""Churn through the simulator and a real KubeSource: objects re-created under their
names, description objects of both forms sharing a name, owner cycles."""

from __future__ import annotations

import asyncio
import copy

from proxy.karta.engine import Engine
from proxy.kube.source import KubeSource
from tests.karta.descriptions import raycluster_karta
from tests.kube.conftest import SourceFactory, eventually, labels, pod
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
