"""Issue 11 field cases end to end: through karta-proxy (in process, on a snapshot) into a
real Prometheus receiver, queried with PromQL.

* Spark on Kubernetes via spark-submit: executor pods controlled by a bare driver pod.
  Their series used to arrive unstamped (``no_described_owner``); now they carry the
  driver's workload (kind ``Pod``) and component ``controlled``, so a per-component sum
  separates driver from executors.
* Static pods: a kubelet mirror pod (controller: its Node) is a workload of its own.
* The phase transition time survives a restart: a second proxy on the same snapshot
  writes the same ``karta_workload_phase_transition_timestamp_seconds`` (``source="object"``)
  for workloads whose objects date their phase; only ``source="observed"`` ones move.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.config import Settings
from proxy.sender import Series, send_series
from tests.peers.conftest import Peer, Peers, proxy_settings, query, wait_until
from tests.test_e2e_kube import start_proxy

pytestmark = pytest.mark.peers

PROBE = "e2e_cpu_seconds"
NS = "spark-jobs"
DRIVER = "spark-pi-3f9a1c8e2b7d4a60-driver"
EXECUTORS = [f"spark-pi-3f9a1c8e2b7d4a60-exec-{i}" for i in (1, 2, 3)]
APISERVER = "kube-apiserver-cp-1"
#: the driver's Initialized condition and the Deployment's Available condition
DRIVER_SINCE = "2026-11-30T09:00:02Z"
WEB_SINCE = "2026-11-29T12:30:00Z"

Obj = dict[str, Any]


def _ref(kind: str, name: str, uid: str, api: str = "v1") -> list[Obj]:
    return [{"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": True,
             "blockOwnerDeletion": True}]


def _cond(ctype: str, status: str, when: str) -> Obj:
    return {"type": ctype, "status": status, "lastTransitionTime": when}


def _pod(name: str, ns: str, uid: str, labels: dict[str, str], *,
         owner: list[Obj] | None = None, annotations: dict[str, str] | None = None,
         conditions: list[Obj] | None = None) -> Obj:
    md: Obj = {"name": name, "namespace": ns, "uid": uid, "labels": labels}
    if owner:
        md["ownerReferences"] = owner
    if annotations:
        md["annotations"] = annotations
    status: Obj = {"phase": "Running"}
    if conditions:
        status["conditions"] = conditions
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md,
            "spec": {"nodeName": "cp-1", "containers": [{"name": "main", "image": "img"}]},
            "status": status}


def cluster() -> list[Obj]:
    """The objects as the API serves them (spark-submit's labels, the kubelet's mirror)."""
    spark = {"spark-app-selector": "spark-6d1e0c2f9b3a4e57", "spark-app-name": "spark-pi",
             "spark-version": "3.5.1"}
    driver = _pod(DRIVER, NS, "uid-driver", {**spark, "spark-role": "driver"}, conditions=[
        _cond("PodScheduled", "True", "2026-11-30T09:00:00Z"),
        _cond("Initialized", "True", DRIVER_SINCE),
        _cond("Ready", "True", "2026-11-30T09:00:09Z")])
    execs = [
        _pod(n, NS, f"uid-exec-{i}", {**spark, "spark-role": "executor", "spark-exec-id": str(i),
                                      "spark-exec-resourceprofile-id": "0"},
             owner=_ref("Pod", DRIVER, "uid-driver"))
        for i, n in enumerate(EXECUTORS, 1)
    ]
    mirror = _pod(APISERVER, "kube-system", "uid-apiserver",
                  {"component": "kube-apiserver", "tier": "control-plane"},
                  owner=_ref("Node", "cp-1", "uid-node-cp-1"),
                  annotations={"kubernetes.io/config.mirror": "3c1ae5b2",
                               "kubernetes.io/config.hash": "3c1ae5b2",
                               "kubernetes.io/config.source": "file"},
                  conditions=[_cond("Initialized", "True", "2026-11-02T07:12:41Z")])
    web = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "web", "namespace": "shop", "uid": "uid-web", "generation": 2},
           "spec": {"replicas": 1},
           "status": {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1,
                      "readyReplicas": 1, "availableReplicas": 1,
                      "conditions": [_cond("Available", "True", WEB_SINCE),
                                     _cond("Progressing", "True", "2026-11-01T00:00:00Z")]}}
    db = {"apiVersion": "apps/v1", "kind": "StatefulSet",  # no conditions: observed
          "metadata": {"name": "db", "namespace": "shop", "uid": "uid-db", "generation": 1},
          "spec": {"replicas": 1},
          "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                     "readyReplicas": 1, "currentRevision": "db-1", "updateRevision": "db-1"}}
    return [driver, *execs, mirror, web, db]


def settings(snapshot: Path, upstream: str) -> Settings:
    s = proxy_settings(snapshot, upstream)
    s.facts.enabled = True
    s.facts.interval_seconds = 0.5
    return s


async def transition_times(tsdb: Peer, after: float) -> dict[str, tuple[str, float]]:
    """workload -> (source, value) of the newest transition samples written after ``after``."""
    name = "karta_workload_phase_transition_timestamp_seconds"
    got = await query(tsdb.base_url, f"{name} and timestamp({name}) > {after}")
    return {r["metric"]["karta_workload"]: (r["metric"]["source"], float(r["value"][1]))
            for r in got}


async def all_dated(tsdb: Peer, after: float, what: str) -> dict[str, tuple[str, float]]:
    """Wait until every workload of the cluster has a transition sample written after
    ``after``; returns them as ``transition_times`` does."""
    got: dict[str, tuple[str, float]] = {}

    async def every_workload() -> bool:
        got.update(await transition_times(tsdb, after))
        return {DRIVER, APISERVER, "web", "db"} <= set(got)

    await wait_until(every_workload, timeout=15, what=what)
    return got


def unix(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339).timestamp()


async def test_spark_static_pods_and_phase_times_through_a_restart(
    peers: Peers, tmp_path: Path
) -> None:
    snap = tmp_path / "cluster.yaml"
    snap.write_text(yaml.safe_dump_all(cluster()))
    tsdb = await peers.prometheus_receiver()
    write = tsdb.base_url + "/api/v1/write"
    t_first = time.time()
    proxy = await start_proxy(settings(snap, write))
    try:
        series = [Series({"__name__": PROBE, "namespace": ns, "pod": pod}, [(
            int(time.time() * 1000), value)])
            for ns, pod, value in [(NS, DRIVER, 1.0), *((NS, e, 10.0) for e in EXECUTORS),
                                   ("kube-system", APISERVER, 5.0)]]
        async with aiohttp.ClientSession() as session:
            status, _, _ = await send_series(f"http://127.0.0.1:{proxy.port}/api/v1/write",
                                             series, session=session, timeout=10)
        assert status == 204

        # the executors' series carry the driver's workload, in their own component
        by_comp = await query(tsdb.base_url, f'sum by (karta_kind, karta_group, karta_workload,'
                              f' karta_component) ({PROBE}{{namespace="{NS}"}})')
        assert {(r["metric"].get("karta_kind"), r["metric"].get("karta_workload"),
                 r["metric"].get("karta_component"), float(r["value"][1])) for r in by_comp} == {
            ("Pod", DRIVER, "pod", 1.0), ("Pod", DRIVER, "controlled", 30.0)}
        (api,) = await query(tsdb.base_url, f'{PROBE}{{pod="{APISERVER}"}}')
        # (the core group is "": an empty label, which Prometheus does not store)
        assert {k: v for k, v in api["metric"].items() if k.startswith("karta_")} == {
            "karta_namespace": "kube-system", "karta_kind": "Pod", "karta_workload": APISERVER,
            "karta_component": "pod"}

        async def observed_pods() -> bool:
            got = await query(tsdb.base_url, "karta_component_observed_pods"
                              f'{{karta_workload="{DRIVER}"}}')
            return {r["metric"]["karta_component"]: float(r["value"][1]) for r in got} == {
                "pod": 1.0, "controlled": 3.0}

        await wait_until(observed_pods, timeout=15, what="the driver workload's replica facts")

        first = await all_dated(tsdb, t_first, "transition times of every workload")
    finally:
        await proxy.stop()
    assert first[DRIVER] == ("object", unix(DRIVER_SINCE))
    assert first["web"] == ("object", unix(WEB_SINCE))
    assert first[APISERVER][0] == "object"
    assert first["db"][0] == "observed" and first["db"][1] >= t_first - 1

    # a restart (a rollout of the proxy, a new leader): same snapshot, a later clock
    await asyncio.sleep(1.5)
    t_second = time.time()
    proxy = await start_proxy(settings(snap, write))
    try:
        second = await all_dated(tsdb, t_second, "transition times after the restart")
    finally:
        await proxy.stop()
    for w in (DRIVER, APISERVER, "web"):
        assert second[w] == first[w], w  # the object's time: the restart does not move it
    assert second["db"][0] == "observed" and second["db"][1] >= t_second - 1 > first["db"][1]
    # over the whole run, the object-dated series never changed value
    moved = await query(tsdb.base_url, "changes(karta_workload_phase_transition_timestamp_seconds"
                        '{source="object"}[5m])')
    assert moved and all(float(r["value"][1]) == 0.0 for r in moved), moved
