"""Cost of the fact series at scale: one write of 100k pods in 2k workloads.

Measures, in one run: a cold build (every series encoded), a warm build (nothing changed:
cached label bytes reused), a build after 1% of pods and workloads changed, the request
size (raw and snappy), and rendering the same facts for /metrics as the server writes
them (``proxy.exposition.chunks``).
Baseline in the same run: building the same request with the generated protobuf classes
(proxy/pb), the obvious alternative to the hand encoder.

    python benchmarks/facts_bench.py [--pods 100000] [--workloads 2000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import snappy
from prometheus_client import CollectorRegistry

from proxy import exposition
from proxy.config import FactSettings
from proxy.facts import FactsCollector, FactWriter, iter_facts
from proxy.index import PodIndex
from proxy.karta.results import (
    ChangeSet,
    PodAttribution,
    ReplicaFact,
    WorkloadFacts,
    WorkloadRef,
)
from proxy.server import SCRAPED_FACTS


def build_index(pods: int, workloads: int) -> PodIndex:
    index = PodIndex()
    cs = ChangeSet()
    per = pods // workloads
    for w in range(workloads):
        ref = WorkloadRef(f"ns-{w % 50}", "ray.io", "RayJob", f"job-{w}", f"w{w}")
        cs.workloads[ref.uid] = WorkloadFacts(
            ref, "rayjob", False, "Running", ("Running",), "", 1.7e9,
            (ReplicaFact("head", "", 1, None, None, 1),
             ReplicaFact("workers", "g0", per - 1, 1, per * 2, per - 1)),
        )
        for p in range(per):
            uid = f"p{w}-{p}"
            comp, inst = ("head", "") if p == 0 else ("workers", "g0")
            cs.pods[uid] = PodAttribution(ref.namespace, f"job-{w}-{p}", uid, ref, comp, inst)
    index.apply(cs)
    index.mark_fresh("pods")
    index.ready = True  # loaded: /metrics serves no fact before
    return index


def timed(fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def protobuf_build(index: PodIndex) -> bytes:
    from proxy.pb.prometheus import remote_pb2

    req = remote_pb2.WriteRequest()
    now = int(time.time() * 1000)
    for f in iter_facts(index):
        ts = req.timeseries.add()
        labels = sorted((*f.labels, ("__name__", f.name)))
        for k, v in labels:
            lb = ts.labels.add()
            lb.name, lb.value = k, v
        s = ts.samples.add()
        s.value, s.timestamp = f.value, now
    return bytes(req.SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--workloads", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    index = build_index(a.pods, a.workloads)

    async def nosend(body: bytes) -> None:
        return None

    w = FactWriter(FactSettings(), index, nosend)
    now = int(time.time() * 1000)
    t = time.perf_counter()
    body = w.build_request(now)
    w.commit()
    cold = time.perf_counter() - t
    warm = timed(lambda: w.build_request(now), a.repeat)
    w.commit()

    def churn() -> None:
        cs = ChangeSet()
        for uid in list(index.pods)[:: 100]:
            cs.pods[uid] = replace(index.pods[uid], replica="1")
        for uid in list(index.workloads)[:: 100]:
            cs.workloads[uid] = replace(index.workloads[uid], phase="Failed",
                                        statuses=("Failed",))
        index.apply(cs)

    churned = []
    for _ in range(a.repeat):
        churn()
        t = time.perf_counter()
        w.build_request(now)
        churned.append(time.perf_counter() - t)
        w.commit()
    # what a standby replica pays per interval to end the old leader's series on takeover
    standby = timed(lambda: w.track_standby(time.time()), a.repeat)
    compress = timed(lambda: snappy.compress(body), a.repeat)
    pb = timed(lambda: protobuf_build(index), max(1, a.repeat // 2))
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    scrape = timed(lambda: sum(map(len, exposition.chunks(registry))), max(1, a.repeat // 2))
    # a scrape asking for one operational series (name[]): the fact families left out
    named = timed(lambda: sum(map(len, exposition.chunks(registry, {"karta_build_info"}))),
                  a.repeat)
    # a scrape with facts=false (the shipped ServiceMonitor's): every fact family left out
    lean = timed(lambda: sum(map(len, exposition.chunks(
        registry, exposition.AllBut(SCRAPED_FACTS)))), a.repeat)
    med = statistics.median
    print(f"pods={a.pods} workloads={a.workloads} series={w.last_series}")
    print(f"request: {len(body) / 1e6:.1f} MB raw, "
          f"{len(snappy.compress(body)) / 1e6:.1f} MB snappy")
    print(f"build cold:            {cold * 1000:8.0f} ms")
    print(f"build warm (median):   {med(warm) * 1000:8.0f} ms")
    print(f"build 1% churn (med):  {med(churned) * 1000:8.0f} ms")
    print(f"standby walk (median): {med(standby) * 1000:8.0f} ms  "
          f"(a replica that does not write, per interval)")
    print(f"snappy (median):       {med(compress) * 1000:8.0f} ms")
    print(f"protobuf classes (med):{med(pb) * 1000:8.0f} ms  "
          f"(warm hand encoder is {med(pb) / med(warm):.1f}x faster)")
    print(f"/metrics render (med): {med(scrape) * 1000:8.0f} ms")
    print(f"/metrics?name[]=... :  {med(named) * 1000:8.1f} ms  "
          f"(one series asked for: the other fact families are not rendered)")
    print(f"/metrics?facts=false:  {med(lean) * 1000:8.1f} ms  "
          f"(the fact families left out, not rendered)")


if __name__ == "__main__":
    main()
