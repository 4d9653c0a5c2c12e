"""Karta engine at cluster scale: full build, per-event updates, memory per pod.

A synthetic cluster of ``--pods`` pods (default 100k) in ``--workloads`` workloads
(default 2k) of mixed kinds: Deployments (-> ReplicaSets, current + an old one),
StatefulSets, Jobs, CronJobs (-> Jobs), DaemonSets, bare pods, and RayClusters under a
description of the benchmark's own (head + worker groups as component instances, i.e.
selectors with instance checks). Pods carry the labels their controllers set, a couple
of annotations, a container spec and a status, as the API serves them.

Printed, all measured in the same run:

- full build: owners then pods through ``upsert_many`` (a snapshot load), the same as
  one ``upsert`` call per object (a watch source's initial list), and pods first (every
  owner arrives late and re-attributes its dependents);
- per-event update (median, p99, max) of: a new pod in an existing ReplicaSet, a pod
  relabelled (re-attribution), a pod deleted, a pod status-only update, a workload status
  update; against the baseline of one libjq selector evaluation on the same pod (what each
  selector would cost without the engine's plain-lookup path);
- memory per pod (tracemalloc): what the engine allocates beyond the input objects (the
  objects are built before tracing starts and stay alive), and what stays allocated once
  the caller drops its objects (engine + the metadata maps it shares with them).

With ``--jq-sandbox`` every jq expression is evaluated in the proxy's sandbox child
(``proxy.karta.jq_sandbox``, as the proxy runs them) instead of in-process (the default,
the engine's own cost).

    python3 benchmarks/engine_bench.py [--pods 100000] [--workloads 2000] [--events 5000]
        [--jq-sandbox]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.karta.description import parse_description
from proxy.karta.engine import Engine
from proxy.karta.jqexpr import JqExpr, outputs_equal
from tests.karta.descriptions import raycluster_karta

NS_COUNT = 40

#: the RayCluster description of the kube source tests, named for the benchmark
RAY = raycluster_karta("bench-raycluster")


class Gen:
    """Builds the cluster as lists of plain dicts (what a JSON decoder hands over)."""

    def __init__(self, pods: int, workloads: int, seed: int = 7) -> None:
        self.rnd = random.Random(seed)
        self.owners: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.rs: list[dict[str, Any]] = []  # ReplicaSets that own pods (for new-pod events)
        self.workload_objs: list[dict[str, Any]] = []
        self.n = 0
        kinds = ["Deployment"] * 40 + ["StatefulSet"] * 15 + ["Job"] * 10 + ["CronJob"] * 5 \
            + ["DaemonSet"] * 5 + ["RayCluster"] * 20 + ["Pod"] * 5
        plan = [kinds[i % len(kinds)] for i in range(workloads)]
        bare = plan.count("Pod")
        per, extra = divmod(max(0, pods - bare), max(1, workloads - bare))
        for i, kind in enumerate(plan):
            count = 1
            if kind != "Pod":
                count, extra = per + (1 if extra > 0 else 0), extra - 1
            getattr(self, f"_{kind.lower()}")(f"w{i}", f"ns-{i % NS_COUNT}", count)

    def uid(self) -> str:
        self.n += 1
        return f"{self.n:08x}-5c1e-4a7b-9d2e-{self.n:012x}"

    @staticmethod
    def ref(o: dict[str, Any]) -> dict[str, Any]:
        md = o["metadata"]
        return {"apiVersion": o["apiVersion"], "kind": o["kind"], "name": md["name"],
                "uid": md["uid"], "controller": True, "blockOwnerDeletion": True}

    def obj(self, api: str, kind: str, name: str, ns: str, owner: dict[str, Any] | None,
            spec: dict[str, Any], status: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
        md: dict[str, Any] = {
            "name": name, "namespace": ns, "uid": self.uid(), "resourceVersion": "123456",
            "generation": 1, "creationTimestamp": "2026-11-30T10:00:00Z", "labels": labels,
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                               "apiVersion": api, "fieldsType": "FieldsV1",
                               "fieldsV1": {"f:status": {"f:replicas": {}}}}],
        }
        if owner is not None:
            md["ownerReferences"] = [self.ref(owner)]
        o = {"apiVersion": api, "kind": kind, "metadata": md, "spec": spec, "status": status}
        self.owners.append(o)
        return o

    def pod(self, name: str, ns: str, owner: dict[str, Any] | None,
            labels: dict[str, str]) -> dict[str, Any]:
        md: dict[str, Any] = {
            "name": name, "namespace": ns, "uid": self.uid(), "resourceVersion": "654321",
            "creationTimestamp": "2026-11-30T10:00:05Z", "labels": labels,
            "annotations": {"kubectl.kubernetes.io/default-container": "main",
                            "prometheus.io/scrape": "true"},
        }
        if owner is not None:
            md["ownerReferences"] = [self.ref(owner)]
        p = {
            "apiVersion": "v1", "kind": "Pod", "metadata": md,
            "spec": {"nodeName": f"node-{self.rnd.randrange(500)}", "containers": [{
                "name": "main", "image": "registry.example.com/team/app:1.2.3",
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                "ports": [{"containerPort": 8080, "protocol": "TCP"}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }
        self.pods.append(p)
        return p

    def _template(self) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": "main", "image": "x"}]}}

    def _deployment(self, name: str, ns: str, n: int) -> None:
        d = self.obj("apps/v1", "Deployment", name, ns, None,
                     {"replicas": n, "template": self._template()},
                     {"observedGeneration": 1, "replicas": n, "updatedReplicas": n,
                      "readyReplicas": n,
                      "conditions": [{"type": "Available", "status": "True"}]}, {"app": name})
        self.workload_objs.append(d)
        self.obj("apps/v1", "ReplicaSet", f"{name}-old", ns, d, {"replicas": 0}, {}, {"app": name})
        rs = self.obj("apps/v1", "ReplicaSet", f"{name}-7d9c5", ns, d,
                      {"replicas": n, "template": self._template()}, {"replicas": n},
                      {"app": name, "pod-template-hash": "7d9c5"})
        self.rs.append(rs)
        for i in range(n):
            self.pod(f"{name}-7d9c5-{i:05d}", ns, rs, {"app": name, "pod-template-hash": "7d9c5"})

    def _statefulset(self, name: str, ns: str, n: int) -> None:
        s = self.obj("apps/v1", "StatefulSet", name, ns, None,
                     {"replicas": n, "template": self._template()},
                     {"observedGeneration": 1, "replicas": n, "readyReplicas": n,
                      "updatedReplicas": n, "currentRevision": "r1", "updateRevision": "r1"},
                     {"app": name})
        self.workload_objs.append(s)
        for i in range(n):
            self.pod(f"{name}-{i}", ns, s, {"app": name, "controller-revision-hash": "r1",
                                            "statefulset.kubernetes.io/pod-name": f"{name}-{i}"})

    def _job(self, name: str, ns: str, n: int, owner: dict[str, Any] | None = None) -> None:
        j = self.obj("batch/v1", "Job", name, ns, owner,
                     {"parallelism": n, "template": self._template()}, {"active": n},
                     {"job-name": name})
        if owner is None:
            self.workload_objs.append(j)
        for i in range(n):
            self.pod(f"{name}-{i:05d}", ns, j, {"job-name": name, "batch.kubernetes.io/job-name":
                                                 name, "controller-uid": j["metadata"]["uid"]})

    def _cronjob(self, name: str, ns: str, n: int) -> None:
        c = self.obj("batch/v1", "CronJob", name, ns, None,
                     {"schedule": "0 * * * *", "jobTemplate": {"spec": {"parallelism": n}}},
                     {"active": [{"name": f"{name}-1"}]}, {})
        self.workload_objs.append(c)
        self._job(f"{name}-1", ns, n, owner=c)

    def _daemonset(self, name: str, ns: str, n: int) -> None:
        d = self.obj("apps/v1", "DaemonSet", name, ns, None, {"template": self._template()},
                     {"observedGeneration": 1, "desiredNumberScheduled": n,
                      "updatedNumberScheduled": n, "numberReady": n}, {"app": name})
        self.workload_objs.append(d)
        for i in range(n):
            self.pod(f"{name}-{i:05d}", ns, d, {"app": name, "controller-revision-hash": "6d5c",
                                                "pod-template-generation": "1"})

    def _raycluster(self, name: str, ns: str, n: int) -> None:
        groups = ["cpu", "gpu"]
        r = self.obj("ray.io/v1", "RayCluster", name, ns, None,
                     {"headGroupSpec": {"template": self._template()},
                      "workerGroupSpecs": [{"groupName": g, "replicas": (n - 1) // 2,
                                            "template": self._template()} for g in groups]},
                     {"state": "ready"}, {})
        self.workload_objs.append(r)
        for i in range(n):
            typ = "head" if i == 0 else "worker"
            labels = {"ray.io/cluster": name, "ray.io/node-type": typ,
                      "ray.io/group": "headgroup" if i == 0 else groups[i % 2],
                      "ray.io/is-ray-node": "yes"}
            self.pod(f"{name}-{typ}-{i:05d}", ns, r, labels)

    def _pod(self, name: str, ns: str, n: int) -> None:
        self.pod(name, ns, None, {"run": name})


def new_engine() -> Engine:
    e = Engine(clock=lambda: 0.0)
    e.add_descriptions([parse_description(RAY, "bench")], source="bench")
    return e


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def per_call(call: Callable[[Any], Any], objs: Iterable[Any]) -> list[float]:
    """Seconds of each ``call(obj)``, one object after the other."""
    samples = []
    for o in objs:
        t0 = time.perf_counter()
        call(o)
        samples.append(time.perf_counter() - t0)
    return samples


def build(feed: Callable[[Engine], Any]) -> tuple[Engine, float]:
    eng = new_engine()
    t = time.perf_counter()
    feed(eng)
    return eng, time.perf_counter() - t


def line(label: str, seconds: float, pods: int) -> None:
    print(f"  {label:<36} {seconds:6.2f} s  ({seconds / pods * 1e6:5.1f} us/pod)")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def per_event(label: str, samples: list[float], baseline: float) -> None:
    med = statistics.median(samples)
    print(f"  {label:<34} median {med * 1e6:7.1f} us   p99 {pct(samples, 0.99) * 1e6:7.1f} us"
          f"   max {max(samples) * 1e6:8.1f} us   median/jq-call {med / baseline:5.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--workloads", type=int, default=2_000)
    ap.add_argument("--events", type=int, default=5_000)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--jq-sandbox", action="store_true",
                    help="evaluate jq in the sandbox child, as the proxy does")
    args = ap.parse_args()
    sandbox = None
    if args.jq_sandbox:
        from proxy.karta.jq_sandbox import JqSandbox
        from proxy.karta.jqexpr import install_runner

        sandbox = JqSandbox()
        install_runner(sandbox)
        print("jq: evaluated in the sandbox child (karta.jq_sandbox)")

    t = time.perf_counter()
    g = Gen(args.pods, args.workloads)
    print(f"cluster: {len(g.pods)} pods, {len(g.owners)} owner objects, "
          f"{len(g.workload_objs)} workload objects + bare pods "
          f"(generated in {time.perf_counter() - t:.1f} s)")
    everything = [*g.owners, *g.pods]

    # -- baseline: one libjq selector call on a pod ----------------------------------
    expr = JqExpr('.metadata.labels["ray.io/node-type"]')
    sample_pod = g.pods[len(g.pods) // 2]
    reps = 2000
    outputs_equal(expr.all(sample_pod), "worker")  # the sandbox's child started untimed
    jq_t = timed(lambda: [outputs_equal(expr.all(sample_pod), "worker")
                          for _ in range(reps)]) / reps
    print(f"baseline: one libjq selector evaluation = {jq_t * 1e6:.1f} us")

    # -- full build -------------------------------------------------------------------
    print("full build:")
    gc.collect()
    e, b1 = build(lambda eng: eng.upsert_many(everything))
    line("owners then pods, upsert_many", b1, len(g.pods))
    _, b2 = build(lambda eng: [eng.upsert(o) for o in everything])
    line("owners then pods, upsert per object", b2, len(g.pods))
    late, b3 = build(lambda eng: eng.upsert_many([*g.pods, *g.owners]))
    line("pods first, owners late", b3, len(g.pods))
    same = {a.uid: a for a in late.pods()} == {a.uid: a for a in e.pods()}
    print(f"  same attribution either order: {same}")
    del late
    attributed = sum(1 for a in e.pods() if a.workload is not None)
    print(f"  attributed {attributed}/{len(g.pods)} pods to {len(list(e.workloads()))} workloads")
    gc.collect()

    # -- per-event updates --------------------------------------------------------------
    rnd = random.Random(11)
    n = args.events
    print(f"per event ({n} events each, engine holding the full cluster):")

    def new_pod(i: int) -> dict[str, Any]:
        rs = rnd.choice(g.rs)
        return g.pod(f"{rs['metadata']['name']}-new{i}", rs["metadata"]["namespace"], rs,
                     {"app": "x", "pod-template-hash": "7d9c5"})

    def relabelled(p: dict[str, Any]) -> dict[str, Any]:
        labels = dict(p["metadata"]["labels"])
        labels["ray.io/group"] = "gpu" if labels["ray.io/group"] == "cpu" else "cpu"
        return {**p, "metadata": {**p["metadata"], "labels": labels}}

    def status_touched(w: dict[str, Any]) -> dict[str, Any]:
        return {**w, "status": {**w.get("status", {}), "observedGeneration": rnd.randrange(3)}}

    new_pods = [new_pod(i) for i in range(n)]  # added, then deleted again
    ray_pods = [p for p in g.pods if "ray.io/node-type" in p["metadata"]["labels"]]
    # the other events' objects are made as the timing goes (generators), outside its calls
    per_event("new pod (ReplicaSet)", per_call(e.upsert, new_pods), jq_t)
    relabels = (relabelled(rnd.choice(ray_pods)) for _ in range(n))
    per_event("pod relabelled (RayCluster worker)", per_call(e.upsert, relabels), jq_t)
    status_only = ({**p, "status": {"phase": "Running", "podIP": "10.0.0.2"}}
                   for p in (rnd.choice(g.pods) for _ in range(n)))
    per_event("pod status-only update", per_call(e.upsert, status_only), jq_t)
    per_event("pod deleted", per_call(e.delete, new_pods), jq_t)
    workload_updates = (status_touched(rnd.choice(g.workload_objs)) for _ in range(min(n, 2000)))
    per_event("workload status update", per_call(e.upsert, workload_updates), jq_t)
    del e
    gc.collect()

    # -- memory -------------------------------------------------------------------------
    if not args.skip_memory:
        print("memory (tracemalloc):")
        tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        e = new_engine()
        e.upsert_many(everything)
        gc.collect()
        engine_bytes = tracemalloc.get_traced_memory()[0] - before
        print(f"  engine beyond the input objects: {engine_bytes / 2**20:7.1f} MiB = "
              f"{engine_bytes / len(g.pods):6.0f} B/pod")
        tracemalloc.stop()
        del e
        gc.collect()

        # inputs built under tracing, then dropped: what the engine keeps alive in total
        tracemalloc.start()
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        g2 = Gen(args.pods, args.workloads)
        objs = [*g2.owners, *g2.pods]
        with_inputs = tracemalloc.get_traced_memory()[0] - base
        e = new_engine()
        e.upsert_many(objs)
        del g2, objs
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        print(f"  the input objects themselves:    {with_inputs / 2**20:7.1f} MiB = "
              f"{with_inputs / len(g.pods):6.0f} B/pod")
        print(f"  retained once the caller drops them (engine + shared metadata): "
              f"{retained / 2**20:.1f} MiB = {retained / len(g.pods):.0f} B/pod")
        del e
    if sandbox is not None:
        print(f"jq sandbox restarts: {sandbox.restarts}")
        sandbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
