"""Fixtures: a simulator with the CRDs the scenarios use, and a started KubeSource."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.kube.client import KubeClient
from proxy.kube.source import KubeSource
from tests.kubesim import KubeSim
from tests.kubesim.resources import KARTA, RAY_CLUSTER, RAY_JOB, RESOURCE_INTERFACE

Obj = dict[str, Any]


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    s = KubeSim(bookmark_interval=0.2, max_watch_seconds=3.0)
    s.register(RAY_JOB, RAY_CLUSTER, KARTA, RESOURCE_INTERFACE)
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def client(sim: KubeSim) -> AsyncIterator[KubeClient]:
    """A KubeClient on the simulator, for the tests of one piece (a watcher, discovery)."""
    c = await KubeClient.connect(KubeSettings(kubeconfig=str(sim.write_kubeconfig())))
    yield c
    await c.close()


SourceFactory = Callable[..., Awaitable[KubeSource]]


@pytest.fixture
async def make_source(sim: KubeSim) -> AsyncIterator[SourceFactory]:
    started: list[KubeSource] = []

    async def make(*, engine: Engine | None = None, **settings: Any) -> KubeSource:
        """``engine``: one built otherwise than by default (no ghosts, as with
        ``karta.tombstone_seconds: 0``), else a default one."""
        kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()),
                            resync_backoff_max_seconds=0.5, **settings)
        source = KubeSource(kube, engine if engine is not None else Engine(), PodIndex(),
                            metrics_registry=CollectorRegistry(),
                            watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5)
        started.append(source)
        await asyncio.wait_for(source.start(), 10)
        return source

    yield make
    for s in started:
        await s.stop()
    # the sync freezes what it builds and never unfreezes: the next test's collections
    # see this one's objects again once they are garbage
    gc.unfreeze()


async def eventually(cond: Callable[[], object], timeout: float = 10.0) -> float:
    """Wait until ``cond()`` is truthy; returns the seconds it took. (10 s by default: the
    wait ends as soon as it holds, and a loaded machine may take more than the few
    tenths it usually does.)

    Checked at every turn of the event loop, not every 10 ms: a test that waits for one
    condition and then asserts another that the code under test reaches a turn or two
    later (another await, the end of a list after its items) passed nearly always with
    a 10 ms poll, by which time the rest had run, and failed once in a while on a
    loaded machine: CI failed so at 5185f98. Checked at every turn, such a test fails
    every time. The suite's Kubernetes tests run as fast this way (152 s against 157)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0)
    return time.monotonic() - t0


def labels(source: KubeSource, ns: str, pod: str) -> dict[str, str] | None:
    pairs = source.index.lookup(ns.encode(), pod.encode())
    return None if pairs is None else dict(pairs)


def owner(obj: Obj) -> list[Obj]:
    return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"],
             "name": obj["metadata"]["name"], "uid": obj["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}]


def pod(name: str, ns: str = "default", *, owner_obj: Obj | None = None, node: str = "n1",
        labels: dict[str, str] | None = None) -> Obj:
    md: Obj = {"name": name, "namespace": ns, "labels": labels or {}}
    if owner_obj is not None:
        md["ownerReferences"] = owner(owner_obj)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md,
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "img"}]},
            "status": {"phase": "Running"}}


def deployment(sim: KubeSim, name: str, ns: str = "default", replicas: int = 2,
               rev: str = "1", node: str = "n1") -> tuple[Obj, Obj, list[Obj]]:
    """A Deployment, its ReplicaSet of revision ``rev``, and its pods."""
    try:
        dep = sim.get("apps/v1", "Deployment", name, ns)
    except Exception:
        dep = sim.create({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}}},
        })
    rs = sim.create({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{name}-{rev}", "namespace": ns, "ownerReferences": owner(dep),
                     "labels": {"app": name}},
        "spec": {"replicas": replicas},
    })
    pods = [sim.create(pod(f"{name}-{rev}-{i}", ns, owner_obj=rs, node=node,
                           labels={"app": name}))
            for i in range(replicas)]
    return dep, rs, pods


def metric(source: KubeSource, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the source's registry (0 when absent)."""
    return source.registry.get_sample_value(name, labels or {}) or 0.0
