"""A workload's whole life as a user reads it back from the TSDB: the facts one proxy
writes (every 0.5 s) into a real Prometheus 2.42 while a Deployment on the API simulator
is created with its pods Pending, becomes ready, loses a ready pod, is scaled up and is
deleted, read with ``query_range`` at the fact interval's step through the queries
docs/metrics.md gives (``karta_workload_phase == 1``, the desired and observed replicas)
and checked at every step against the scripted truth, allowing the delay the contract
states (the next write) plus a loaded machine's slack.

What the other fact tests check at one instant, this checks over a timeline: exactly one
phase at every step while the workload exists, each value one the workload had within
the delay, and nothing of it left after its deletion: a series not ended by a stale
marker would answer instant queries as alive for the 5-minute lookback (docs/operations.md,
"Restarts and handovers: the facts as a user queries them", has the audit's longer run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.kube.conftest import owner
from tests.kubesim import KubeSim
from tests.peers.conftest import Peers, query, query_range
from tests.test_e2e_kube import kube_settings, start_proxy

NS, APP = "shop", "web"
#: the fact interval kube_settings sets, and the query step
INTERVAL = 0.5
#: how long each scripted state holds: several writes each
HOLD = 2.0
#: how late a step may show a state: the next write (the contract's delay) plus the
#: watch, on a loaded machine
DELAY = 1.5

Obj = dict[str, Any]


@dataclass(frozen=True)
class State:
    """What the workload is from ``at`` on: ``phase`` None once it is gone."""

    at: float
    phase: str | None
    desired: int = 0
    observed: int = 0


class Controllers:
    """What the Deployment and ReplicaSet controllers and the kubelet would write."""

    def __init__(self, sim: KubeSim) -> None:
        self.sim = sim
        self.dep: Obj = {}
        self.rs: Obj = {}
        self.pods: list[str] = []

    def create(self, replicas: int) -> None:
        self.dep = self.sim.create({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": APP, "namespace": NS},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": APP}},
                     "template": {"metadata": {"labels": {"app": APP}}}}})
        self.rs = self.sim.create({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": f"{APP}-1", "namespace": NS, "labels": {"app": APP},
                         "ownerReferences": owner(self.dep)},
            "spec": {"replicas": replicas}})
        for _ in range(replicas):
            self.add_pod()

    def add_pod(self) -> str:
        name = f"{APP}-1-{len(self.pods)}"
        self.sim.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": APP},
                         "ownerReferences": owner(self.rs)},
            "spec": {"containers": [{"name": "main", "image": "img"}]},
            "status": {"phase": "Pending"}})
        self.pods.append(name)
        return name

    def ready(self, name: str, ready: bool) -> None:
        p = self.sim.get("v1", "Pod", name, NS)
        p["spec"]["nodeName"] = "n1"
        p["status"] = {"phase": "Running", "conditions": [
            {"type": "Ready", "status": str(ready), "lastTransitionTime": rfc3339()}]}
        self.sim.update(p)

    def status(self, ready: int) -> None:
        """The Deployment's status with the current spec observed and every pod updated."""
        d = self.sim.get("apps/v1", "Deployment", APP, NS)
        now = rfc3339()
        d["status"] = {
            "observedGeneration": d["metadata"]["generation"], "replicas": len(self.pods),
            "updatedReplicas": len(self.pods), "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                 "lastTransitionTime": now, "lastUpdateTime": now},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                 "lastTransitionTime": now, "lastUpdateTime": now}]}
        self.sim.update(d)

    def scale(self, replicas: int) -> None:
        d = self.sim.get("apps/v1", "Deployment", APP, NS)
        d["spec"]["replicas"] = replicas
        self.sim.update(d)

    def delete(self) -> None:
        """The Deployment, then what the garbage collector deletes below it."""
        self.sim.delete(self.dep)


def rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(bookmark_interval=0.2, max_watch_seconds=5.0) as s:
        yield s


def in_force(truth: list[State], t: float) -> list[State]:
    """The states the workload was in at some instant of [t - DELAY, t]."""
    first = max((i for i, s in enumerate(truth) if s.at <= t - DELAY), default=0)
    return [s for s in truth[first:] if s.at <= t]


def by_step(rows: list[dict[str, Any]]) -> dict[float, list[tuple[dict[str, str], float]]]:
    out: dict[float, list[tuple[dict[str, str], float]]] = {}
    for r in rows:
        for ts, v in r["values"]:
            out.setdefault(round(float(ts), 3), []).append((r["metric"], float(v)))
    return out


async def test_a_workloads_life_reads_back_step_by_step(peers: Peers, sim: KubeSim) -> None:
    tsdb = await peers.prometheus_receiver()
    settings = kube_settings(sim, tsdb.base_url + "/api/v1/write")
    assert settings.facts.interval_seconds == INTERVAL
    proxy = await start_proxy(settings)
    c = Controllers(sim)
    truth = [State(0.0, None)]
    try:
        c.create(2)
        truth.append(State(time.time(), "Initializing", 2, 2))  # the spec not observed
        await asyncio.sleep(HOLD)
        for name in c.pods:
            c.ready(name, True)
        c.status(ready=2)
        truth.append(State(time.time(), "Running", 2, 2))
        await asyncio.sleep(HOLD)
        c.ready(c.pods[0], False)
        c.status(ready=1)
        truth.append(State(time.time(), "Degraded", 2, 2))
        await asyncio.sleep(HOLD)
        c.ready(c.pods[0], True)
        c.scale(3)
        c.ready(c.add_pod(), True)
        c.status(ready=3)
        truth.append(State(time.time(), "Running", 3, 3))
        await asyncio.sleep(HOLD)
        c.delete()
        truth.append(State(time.time(), None))
        await asyncio.sleep(DELAY + INTERVAL)
    finally:
        await proxy.stop()
    # whole milliseconds: the steps' timestamps as the API answers them
    start, end = round(truth[1].at, 3), round(time.time(), 3)
    who = f'karta_namespace="{NS}",karta_kind="Deployment",karta_workload="{APP}"'
    phases = by_step(await query_range(
        tsdb.base_url, f"karta_workload_phase{{{who}}} == 1", start, end, INTERVAL))
    desired = by_step(await query_range(
        tsdb.base_url, f"karta_component_desired_replicas{{{who}}}", start, end, INTERVAL))
    observed = by_step(await query_range(
        tsdb.base_url, f"karta_component_observed_pods{{{who}}}", start, end, INTERVAL))
    wrong: list[str] = []
    for k in range(int((end - start) / INTERVAL) + 1):
        t = round(start + k * INTERVAL, 3)
        states = in_force(truth, t)
        live = [s for s in states if s.phase is not None]
        shown = [m["phase"] for m, _ in phases.get(t, [])]
        d = [v for _, v in desired.get(t, [])]
        o = [v for _, v in observed.get(t, [])]
        at = f"{t - start:5.1f} s {[s.phase for s in states]}"
        if len(shown) > 1 or len(d) > 1 or len(o) > 1:
            wrong.append(f"{at}: two values at once: {shown} {d} {o}")
        elif not live and (shown or d or o):
            wrong.append(f"{at}: still shown after the deletion: {shown} {d} {o}")
        elif len(live) == len(states) and not (shown and d and o):
            wrong.append(f"{at}: missing while it exists: {shown} {d} {o}")
        elif ((shown and shown[0] not in {s.phase for s in live})
              or (d and d[0] not in {s.desired for s in live})
              or (o and o[0] not in {s.observed for s in live})):
            wrong.append(f"{at}: not a state of the last {DELAY} s: {shown} {d} {o}")
    assert not wrong, "\n".join(wrong)
    # nothing of it answers an instant query later on: each series ended with a stale
    # marker, where one left to the lookback answered as alive for 5 minutes
    assert await query(tsdb.base_url, f'{{__name__=~"karta_.+",{who}}}', at=end + 60) == []
