"""What the fact tests share: a small index (two workloads, four pods, two watched
resources), and the writer's requests decoded with the protobuf modules generated from
``proto/``, an independent decoder of the hand encoder's bytes."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from proxy import contract
from proxy.config import FactSettings
from proxy.facts import FactWriter
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, ReplicaFact, WorkloadFacts, WorkloadRef
from proxy.wire.primitives import STALE_NAN_BITS

remote_pb2 = pytest.importorskip("proxy.pb.prometheus.remote_pb2")
types_pb2 = pytest.importorskip("proxy.pb.prometheus.types_pb2")

RAY = WorkloadRef(namespace="ml", group="ray.io", kind="RayJob", name="train", uid="w-ray")
DEP = WorkloadRef(namespace="web", group="apps", kind="Deployment", name="api", uid="w-dep")
#: the identity labels of RAY and DEP, as their series carry them (sorted)
RAY_IDENT = (("karta_group", "ray.io"), ("karta_kind", "RayJob"), ("karta_namespace", "ml"),
             ("karta_workload", "train"))
DEP_IDENT = (("karta_group", "apps"), ("karta_kind", "Deployment"), ("karta_namespace", "web"),
             ("karta_workload", "api"))

#: the label of every fact that names no workload (process facts, unattributed pods)
WRITER = (contract.FACT_LABEL_WRITER, contract.WRITTEN_BY)


def ray_facts(**kw: Any) -> WorkloadFacts:
    base = WorkloadFacts(
        ref=RAY,
        description="rayjob",
        builtin=False,
        phase="Running",
        statuses=("Running", "Degraded"),
        phase_reason="",
        phase_since=1_700_000_000.5,
        replicas=(
            ReplicaFact("head", "", 1, None, None, 1),
            ReplicaFact("workers", "group-a", 4, 2, 8, 3),
        ),
    )
    return replace(base, **kw)


def dep_facts(**kw: Any) -> WorkloadFacts:
    base = WorkloadFacts(
        ref=DEP,
        description="deployment",
        builtin=True,
        phase="Undefined",
        statuses=("Undefined",),
        phase_reason="no_status_matched",
        phase_since=1_700_000_100.0,
        replicas=(ReplicaFact("", "", 2, None, None, 2),),
    )
    return replace(base, **kw)


PODS = {
    "p-head": PodAttribution("ml", "train-head", "p-head", RAY, "head", description="rayjob"),
    "p-w0": PodAttribution(
        "ml", "train-w0", "p-w0", RAY, "workers", "group-a", "0", description="rayjob"
    ),
    "p-api": PodAttribution("web", "api-7d9-x", "p-api", DEP, description="deployment"),
    "p-lost": PodAttribution("web", "loner", "p-lost", None, reason="no_described_owner"),
}


def small_index() -> PodIndex:
    """Two workloads (one custom with instances and replicas, one built-in Undefined),
    three attributed pods, one unattributed pod, two watched resources; loaded (ready)."""
    index = PodIndex()
    index.ready = True
    index.apply(
        ChangeSet(
            pods=dict(PODS),
            workloads={"w-ray": ray_facts(), "w-dep": dep_facts()},
        )
    )
    index.mark_fresh("pods", 1_700_000_500.0)
    index.mark_fresh("rayjobs.ray.io", 1_700_000_400.0)
    return index


Series = dict[tuple[tuple[str, str], ...], list[tuple[float, int]]]


def decode(body: bytes) -> Series:
    """labels (with __name__, in wire order) -> [(value, timestamp)]"""
    req = remote_pb2.WriteRequest()
    req.ParseFromString(body)
    out: Series = {}
    for ts in req.timeseries:
        labels = tuple((lb.name, lb.value) for lb in ts.labels)
        out.setdefault(labels, []).extend((s.value, s.timestamp) for s in ts.samples)
    return out


def by_name(series: Series, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(kv for kv in labels if kv[0] != "__name__"): samples[-1][0]
        for labels, samples in series.items()
        if ("__name__", name) in labels
    }


def is_stale(v: float) -> bool:
    return struct.unpack("<Q", struct.pack("<d", v))[0] == STALE_NAN_BITS


async def nosend(body: bytes) -> None:
    raise AssertionError("not sent in this test")


def writer(index: PodIndex, send: Callable[[bytes], Any] = nosend, **kw: Any) -> FactWriter:
    return FactWriter(FactSettings(**kw), index, send)


def stale_and_live(body: bytes) -> tuple[Series, Series]:
    series = decode(body)
    stale = {k: v for k, v in series.items() if is_stale(v[0][0])}
    return stale, {k: v for k, v in series.items() if k not in stale}


def coverage(series: Series) -> dict[tuple[str, str, str], float]:
    """(namespace, state, reason) -> pods, from the written karta_namespace_pods."""
    return {
        (d["karta_namespace"], d["state"], d.get("reason", "")): v
        for d, v in ((dict(k), v) for k, v in by_name(series, contract.FACT_NAMESPACE_PODS).items())
    }


def owner_refs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    md = obj["metadata"]
    return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": md["name"],
             "uid": md["uid"], "controller": True}]
