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
            sim.create(_pod(f"{name}-{i}", ns, owner, i))
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
        await reader.readline()
    await sim.close()


# -- parent: the proxy side -----------------------------------------------------------------


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
         "--churn-seconds", str(args.churn_seconds)],
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
    print(json.dumps(r))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
