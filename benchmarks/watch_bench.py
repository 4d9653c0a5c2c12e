"""Watch-side benchmark: initial sync of a big cluster, then sustained pod churn.

The API simulator runs in a child process (so its CPU does not show up as our
event-loop lag); this process runs the real KubeSource -> Engine -> PodIndex through
kubernetes-asyncio, as the proxy does. Measures:

- initial sync: wall time (and CPU time) of ``KubeSource.start()`` and the RSS it added
  (index + engine);
- churn: event-loop lag (a 5 ms ticker's overshoot) p50 / p99, idle baseline first, and
  attribution latency (pod created in the simulator -> attributed in the index) p99.

Usage: python benchmarks/watch_bench.py [--pods 100000] [--workloads 2000]
       [--churn-rate 1000] [--churn-seconds 20]
Targets (issue #4): sync <= 20 s, index RSS <= 300 MiB, lag p99 <= 20 ms, attribution
p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("Deployment", "StatefulSet", "Job")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


# -- child: the simulator ------------------------------------------------------------------


def _owner_ref(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"], "controller": True,
             "name": obj["metadata"]["name"], "uid": obj["metadata"]["uid"]}]


def _pod(name: str, ns: str, owner: dict[str, Any], i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "ownerReferences": _owner_ref(owner),
                     "labels": {"app": owner["metadata"]["name"],
                                "apps.kubernetes.io/pod-index": str(i)}},
        "spec": {"nodeName": f"node-{i % 200}", "containers": [
            {"name": "main", "image": "registry.example/app:1.0",
             "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }


def _realistic(pod: dict[str, Any]) -> dict[str, Any]:
    """What a pod of a real cluster carries besides what attribution reads, ~5 KB as
    ``kubectl get -o json`` shows it: managedFields, tolerations, volumes, status
    conditions and container statuses. Lists and relists decode all of it."""
    md, spec = pod["metadata"], pod["spec"]
    md["managedFields"] = [
        {"manager": m, "operation": "Update", "apiVersion": "v1",
         "time": "2026-11-30T10:00:05Z", "fieldsType": "FieldsV1",
         "fieldsV1": {f"f:{k}": {f"f:{k2}": {} for k2 in ("a", "b", "c", "d", "e", "f")}
                      for k in ("metadata", "spec", "status", "labels", "containers")}}
        for m in ("kube-controller-manager", "kubelet")]
    md["generateName"] = md["name"].rsplit("-", 1)[0] + "-"
    md["creationTimestamp"] = "2026-11-30T10:00:05Z"
    c = spec["containers"][0]
    c.update({
        "env": [{"name": f"ENV_{i}", "value": f"value-{i}"} for i in range(8)],
        "volumeMounts": [{"name": "kube-api-access-x7k2p", "readOnly": True,
                          "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080},
                           "periodSeconds": 10, "failureThreshold": 3}})
    spec.update({
        "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default", "schedulerName": "default-scheduler",
        "terminationGracePeriodSeconds": 30, "priority": 0,
        "tolerations": [{"key": f"node.kubernetes.io/{k}", "operator": "Exists",
                         "effect": "NoExecute", "tolerationSeconds": 300}
                        for k in ("not-ready", "unreachable")],
        "volumes": [{"name": "kube-api-access-x7k2p", "projected": {"sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt",
                           "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}]})
    pod["status"].update({
        "hostIP": "10.1.2.3", "startTime": "2026-11-30T10:00:05Z", "qosClass": "Burstable",
        "conditions": [{"type": t, "status": "True", "lastProbeTime": None,
                        "lastTransitionTime": "2026-11-30T10:00:09Z"}
                       for t in ("PodReadyToStartContainers", "Initialized", "Ready",
                                 "ContainersReady", "PodScheduled")],
        "containerStatuses": [{
            "name": "main", "ready": True, "started": True, "restartCount": 0,
            "image": c["image"], "imageID": "registry.example/app@sha256:" + "0" * 64,
            "containerID": "containerd://" + "1" * 64,
            "state": {"running": {"startedAt": "2026-11-30T10:00:08Z"}},
            "lastState": {}}]})
    return pod


async def run_sim(args: argparse.Namespace) -> None:
    from tests.kubesim import KubeSim

    sim = KubeSim(port=args.port, bookmark_interval=5.0, max_log=50_000)
    per = max(1, args.pods // args.workloads)
    parents: list[tuple[str, dict[str, Any]]] = []  # (ns, direct pod owner)
    for w in range(args.workloads):
        ns = f"ns-{w % 20}"
        kind = KINDS[w % len(KINDS)]
        name = f"w{w}"
        if kind == "Deployment":
            dep = sim.create({"apiVersion": "apps/v1", "kind": "Deployment",
                              "metadata": {"name": name, "namespace": ns},
                              "spec": {"replicas": per}})
            owner = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                "metadata": {"name": f"{name}-abc", "namespace": ns,
                                             "ownerReferences": _owner_ref(dep)},
                                "spec": {"replicas": per}})
        elif kind == "StatefulSet":
            owner = sim.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                                "metadata": {"name": name, "namespace": ns},
                                "spec": {"replicas": per}})
        else:
            owner = sim.create({"apiVersion": "batch/v1", "kind": "Job",
                                "metadata": {"name": name, "namespace": ns},
                                "spec": {"parallelism": per}})
        parents.append((ns, owner))
        for i in range(per):
            pod = _pod(f"{name}-{i}", ns, owner, i)
            sim.create(_realistic(pod) if args.realistic_pods else pod)
    await sim.start()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cmd = await reader.readline()
    if cmd.strip() == b"churn":
        live: list[dict[str, Any]] = []
        tick = 0.02
        per_tick = max(1, int(args.churn_rate * tick / 2))  # creates + deletes
        seq = 0
        t_end = time.monotonic() + args.churn_seconds
        next_t = time.monotonic()
        while time.monotonic() < t_end:
            for _ in range(per_tick):
                ns, owner = parents[seq % len(parents)]
                created_ms = int(time.time() * 1000)
                live.append(sim.create(_pod(f"churn-{created_ms}-{seq}", ns, owner, seq)))
                seq += 1
                if len(live) > 200:
                    sim.delete(live.pop(0), cascade=False)
            next_t += tick
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
        print(f"churn-done {seq}", flush=True)
        cmd = await reader.readline()
    if cmd.strip() == b"relist":
        # what an API server restart or an etcd compaction does to a watcher that was
        # away: its resourceVersion is gone (410), and it lists everything again
        sim.compact()
        print(f"relist-started {sim.disconnect_watches()}", flush=True)
        await reader.readline()
    await sim.close()


# -- parent: the proxy side -----------------------------------------------------------------


@dataclass
class ListSpan:
    """One ``ResourceWatcher._list``: a watcher's initial list or a relist."""

    resource: str
    start: float
    end: float = float("nan")


def _time_lists() -> list[ListSpan]:
    """Record every list's span (loop time) by wrapping the watcher's ``_list``."""
    from proxy.kube.watcher import ResourceWatcher

    spans: list[ListSpan] = []
    listing = ResourceWatcher._list

    async def timed(self: ResourceWatcher) -> str:
        span = ListSpan(self.name, asyncio.get_running_loop().time())
        spans.append(span)
        try:
            return await listing(self)
        finally:
            span.end = asyncio.get_running_loop().time()

    ResourceWatcher._list = timed  # type: ignore[method-assign]
    return spans


async def _relist(child: subprocess.Popen[str], spans: list[ListSpan],
                  lag_probe: Callable[[float], Awaitable[list[float]]],
                  seconds: float) -> dict[str, Any]:
    """Compact the simulator's log and break every watch: each watcher gets 410 and
    lists again. Loop lag while they do, and how long the relists took."""
    assert child.stdin is not None and child.stdout is not None
    before = len(spans)
    loop = asyncio.get_running_loop()
    c0, t0 = time.process_time(), loop.time()
    child.stdin.write("relist\n")
    child.stdin.flush()
    lag = await lag_probe(seconds)
    cpu = time.process_time() - c0
    relists = spans[before:]
    done = [s for s in relists if s.end == s.end]
    pods = [s for s in done if s.resource.endswith("pods")]
    return {
        "relists": len(relists), "relists_done": len(done),
        "relist_pods_s": max((s.end - t0 for s in pods), default=float("nan")),
        "relist_all_s": max((s.end - t0 for s in done), default=float("nan")),
        "relist_cpu_s": cpu,
        "relist_lag_p50_ms": pct(lag, 50) * 1e3, "relist_lag_p99_ms": pct(lag, 99) * 1e3,
        "relist_lag_max_ms": max(lag, default=0.0) * 1e3,
    }


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from proxy.config import KubeSettings
    from proxy.index import PodIndex
    from proxy.karta.engine import Engine
    from proxy.karta.results import ChangeSet
    from proxy.kube.source import KubeSource
    from tests.kubesim import free_port

    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--sim", "--port", str(port), "--pods", str(args.pods),
         "--workloads", str(args.workloads), "--churn-rate", str(args.churn_rate),
         "--churn-seconds", str(args.churn_seconds),
         *(["--realistic-pods"] if args.realistic_pods else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        t_pop = time.monotonic()
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == "ready", line
        populate_s = time.monotonic() - t_pop
        kubeconfig = Path(f"/tmp/watch-bench-{port}.kubeconfig")
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "s", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "s", "user": {"token": "kubesim-token"}}],
            "contexts": [{"name": "s", "context": {"cluster": "s", "user": "s"}}],
            "current-context": "s"}))
        lists = _time_lists()
        rss0 = rss_mib()
        index = PodIndex()
        source = KubeSource(KubeSettings(kubeconfig=str(kubeconfig)), Engine(), index,
                            metrics_registry=CollectorRegistry())
        t0, c0 = time.monotonic(), time.process_time()
        await source.start()
        sync_s = time.monotonic() - t0
        sync_cpu_s = time.process_time() - c0
        rss1 = rss_mib()
        synced_pods = len(index.pods)

        latencies: list[float] = []

        def on_change(cs: ChangeSet) -> None:
            now = time.time()
            for att in cs.pods.values():
                if att is not None and att.workload is not None and att.pod.startswith("churn-"):
                    latencies.append(now - int(att.pod.split("-")[1]) / 1000)

        index.subscribe(on_change)

        async def lag_probe(seconds: float) -> list[float]:
            loop = asyncio.get_running_loop()
            out = []
            end = loop.time() + seconds
            while loop.time() < end:
                t = loop.time()
                await asyncio.sleep(0.005)
                out.append(max(0.0, loop.time() - t - 0.005))
            return out

        idle = await lag_probe(3.0)
        child.stdin.write("churn\n")
        child.stdin.flush()
        c1 = time.process_time()
        busy = await lag_probe(args.churn_seconds)
        churn_cpu_s = time.process_time() - c1
        done = await asyncio.to_thread(child.stdout.readline)
        await asyncio.sleep(1.0)  # the tail of the churn reaches the index
        relist = await _relist(child, lists, lag_probe, args.relist_seconds)
        await source.stop()
        return {
            "pods": args.pods, "workloads": args.workloads, "populate_s": populate_s,
            "sync_s": sync_s, "sync_cpu_s": sync_cpu_s, "synced_pods": synced_pods,
            "index_rss_mib": rss1 - rss0, "rss_total_mib": rss1,
            "churn_events": 2 * int(done.split()[1]) if done.startswith("churn-done") else 0,
            "churn_seconds": args.churn_seconds, "churn_cpu_s": churn_cpu_s,
            "lag_idle_p50_ms": pct(idle, 50) * 1e3, "lag_idle_p99_ms": pct(idle, 99) * 1e3,
            "lag_p50_ms": pct(busy, 50) * 1e3, "lag_p99_ms": pct(busy, 99) * 1e3,
            "lag_max_ms": max(busy, default=0.0) * 1e3,
            "attribution_n": len(latencies),
            "attribution_p50_ms": pct(latencies, 50) * 1e3,
            "attribution_p99_ms": pct(latencies, 99) * 1e3,
            "attribution_median_ms": (statistics.median(latencies) * 1e3
                                      if latencies else float("nan")),
            **relist,
        }
    finally:
        if child.poll() is None:
            try:
                child.stdin.write("\n")
                child.stdin.flush()
                child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--workloads", type=int, default=2_000)
    ap.add_argument("--churn-rate", type=int, default=1_000, help="pod events per second")
    ap.add_argument("--churn-seconds", type=float, default=20.0)
    ap.add_argument("--realistic-pods", action="store_true",
                    help="pods of ~5 KB as a real cluster lists them (managedFields, "
                    "status, volumes), not the ~0.6 KB that attribution reads")
    ap.add_argument("--relist-seconds", type=float, default=10.0,
                    help="how long to watch the loop after forcing every watcher to relist")
    ap.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sim:
        asyncio.run(run_sim(args))
        return
    r = asyncio.run(run_bench(args))
    print(f"initial sync: {r['synced_pods']} pods in {r['workloads']} workloads: "
          f"{r['sync_s']:.1f} s (target <= 20 s; {r['sync_cpu_s']:.1f} CPU-s here); "
          f"index+engine RSS "
          f"{r['index_rss_mib']:.0f} MiB (target <= 300 MiB); process RSS "
          f"{r['rss_total_mib']:.0f} MiB; simulator populate {r['populate_s']:.1f} s")
    print(f"churn: {r['churn_events']} pod events in {r['churn_seconds']:.0f} s, "
          f"{r['churn_cpu_s']:.1f} CPU-s in this process "
          f"({r['churn_cpu_s'] / max(r['churn_events'], 1) * 1e6:.0f} us per event)")
    print(f"event-loop lag: idle p50 {r['lag_idle_p50_ms']:.2f} ms p99 "
          f"{r['lag_idle_p99_ms']:.2f} ms | churn p50 {r['lag_p50_ms']:.2f} ms p99 "
          f"{r['lag_p99_ms']:.2f} ms max {r['lag_max_ms']:.1f} ms (target p99 <= 20 ms); "
          f"p99 ratio churn/idle {r['lag_p99_ms'] / max(r['lag_idle_p99_ms'], 1e-3):.1f}x")
    print(f"attribution latency ({r['attribution_n']} pods): p50 "
          f"{r['attribution_p50_ms']:.0f} ms p99 {r['attribution_p99_ms']:.0f} ms "
          f"(target p99 <= 1000 ms)")
    print(f"relist after 410 ({r['relists_done']} of {r['relists']} lists done in "
          f"{args.relist_seconds:.0f} s): pods in {r['relist_pods_s']:.2f} s, all in "
          f"{r['relist_all_s']:.2f} s, {r['relist_cpu_s']:.1f} CPU-s; event-loop lag "
          f"p50 {r['relist_lag_p50_ms']:.2f} ms p99 {r['relist_lag_p99_ms']:.2f} ms max "
          f"{r['relist_lag_max_ms']:.1f} ms")
    print(json.dumps(r))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
