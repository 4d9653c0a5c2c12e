"""CPU cost of the splice per million samples: enrichment against plain relaying, in one
process (the native splice, two threads, the pure-Python splice, the protobuf reference).

Replays the relay benchmark's corpus (``relay/corpus.py``: a ~5k-pod cluster of
Deployments, StatefulSets, Jobs, CronJobs, DaemonSets and bare pods, with its cAdvisor
``container_*`` and DCGM series, ~95% of them naming a pod of the snapshot) as 2,000-series
RW 1.0 requests. The index is filled the way the product fills it: the cluster is written
as a snapshot file, loaded into a Karta ``Engine`` with ``proxy.snapshot.load_snapshot``
and its change set applied to the ``PodIndex``, so the benchmark also exercises the real
attribution. Each scrape round sends every series once, in the same requests; in the same
process and run:

- ``pass-through``: snappy decompress + compress, nothing else (the baseline);
- ``enrich``: decompress + ``Enricher.enrich_v1`` (the native splice) + compress. There
  is no per-series state, so the first sight of a series costs what the hundredth does;
- ``enrich-edit``: what the handler does for snappy in and out: decompress +
  ``Enricher.enrich_snappy``, whose output block is made from the sender's block
  (``_snappy_edit.c``), not compressed again;
- ``enrich-parts``: ``enrich-edit`` the way the handler does a big request alone in its worker
  pool (``handler.splice_in_parts``): cut in two at a series boundary, each half spliced
  and its block made on its own thread, the blocks joined; compare its wall columns
  with ``enrich``'s (the latency a request sees), its CPU with ``enrich``'s (the cost);
- ``enrich-churn``: the same while the cluster changes: one pod event is applied to the
  index (and through its listener to the pod table) before each request;
- ``enrich-v2``: the same corpus as RW 2.0 requests through ``Enricher.enrich_v2``;
- ``enrich-2-threads``: ``enrich`` on two threads at once (the splice and snappy release
  the GIL); CPU-s per M samples summed over both, and the wall-time speed-up printed;
- ``python-splice``: the pure-Python reference splice (what runs without the extension;
  a few requests only);
- ``reference``: decompress + the protobuf-class reference + compress (a few requests).

``--cluster NAME`` gives every series ``cluster="NAME"`` (an agent's external label) and
turns the splice's cluster check on against it (``enrich.cluster_label``, what the shipped
ConfigMap's ``facts.external_labels`` does): every series carries the label and passes
the check, so its cost is all there is to see beside a run without it.

CPU seconds come from ``time.process_time`` around each request (the whole process), wall
seconds from ``time.perf_counter``. Each
round replays every request once; printed are the median over rounds of CPU-s per
million samples, the p50/p99 per-request times, and ratios to pass-through computed per
round then medianed.

    python3 benchmarks/splice_bench.py [--rounds 5] [--pods 5000] [--series-per-request 2000]
                                      [--reference-requests 3] [--cluster NAME]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relay import corpus

from proxy.compression import compress, decompress
from proxy.config import EnrichSettings, UpstreamSettings
from proxy.enrichment import Enricher
from proxy.enrichment_reference import enrich_v1_reference
from proxy.handler import splice_in_parts
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.karta.results import ChangeSet, PodAttribution
from proxy.snapshot import load_snapshot
from proxy.wire.native import split_v1
from proxy.wire.primitives import Protocol

MAX_DECODED = 64 << 20


def _v1_to_v2(raw: bytes) -> bytes:
    """The same request as RW 2.0 (benchmark set-up only, through the generated classes)."""
    from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
    from proxy.pb.prometheus import remote_pb2

    src = remote_pb2.WriteRequest.FromString(raw)
    out = v2.Request()
    syms: dict[str, int] = {"": 0}
    for ts in src.timeseries:
        dst = out.timeseries.add()
        for lb in ts.labels:
            for s in (lb.name, lb.value):
                dst.labels_refs.append(syms.setdefault(s, len(syms)))
        for s in ts.samples:
            dst.samples.add(value=s.value, timestamp=s.timestamp)
    out.symbols.extend(syms)
    body: bytes = out.SerializeToString()
    return body


def _load_index(cluster: corpus.Cluster) -> tuple[PodIndex, str]:
    """The cluster through a snapshot file and the engine into an index, as the product's
    ``--snapshot`` start does; returns the index and a one-line summary of the load."""
    index = PodIndex()
    with tempfile.TemporaryDirectory(prefix="splice-bench-") as work:
        path = corpus.write_snapshot(cluster, Path(work) / "snapshot.yaml")
        report = load_snapshot(path, Engine())
    problems = report.problems()
    if problems:
        raise SystemExit(f"snapshot did not load cleanly: {problems[:3]}")
    index.apply(report.changes)
    index.ready = True
    return index, (
        f"{report.pods_attributed} pods attributed, {report.workloads} workloads, "
        f"loaded in {report.seconds:.1f}s"
    )


def _scrape_round(stream: corpus.SeriesStream, spr: int) -> list[bytes]:
    """Every series once, cut into requests of ``spr`` (the last one shorter): the stream
    starts each round at its first series, so every round holds the same label sets in the
    same requests, with new timestamps and values."""
    out = []
    for start in range(0, stream.universe, spr):
        out.append(stream.next_body(min(spr, stream.universe - start)))
    return out


def _run(
    bodies: list[bytes], samples: list[int], step: Callable[[bytes], object]
) -> tuple[float, list[float], list[float]]:
    """CPU-s per million samples over ``bodies``, each request's CPU seconds (of the whole
    process: a request in parts runs on two threads) and wall seconds."""
    times: list[float] = []
    walls: list[float] = []
    gc.collect()
    clock, wall = time.process_time, time.perf_counter
    for body in bodies:
        t0, w0 = clock(), wall()
        step(body)
        walls.append(wall() - w0)
        times.append(clock() - t0)
    return sum(times) / sum(samples) * 1e6, times, walls


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pods", type=int, default=5000)
    ap.add_argument("--series-per-request", type=int, default=2000)
    ap.add_argument("--reference-requests", type=int, default=3)
    ap.add_argument("--cluster", default="",
                    help="label every series cluster=NAME and check it (enrich.cluster_label)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.pods < 1 or args.series_per_request < 1:
        ap.error("--rounds, --pods and --series-per-request must be at least 1")

    t_setup = time.time()
    cluster = corpus.build_cluster(args.pods)
    index, loaded = _load_index(cluster)
    external = {"cluster": args.cluster} if args.cluster else None
    stream = corpus.SeriesStream(cluster, external_labels=external)
    spr = args.series_per_request
    # round 0 warms the cache; the measured rounds carry new samples for the same series.
    # Raw bodies are kept only as long as needed (a round is ~80 MB raw at 5k pods).
    rounds: list[list[bytes]] = []
    v2_rounds: list[list[bytes]] = []
    raw_bytes = 0
    for r in range(args.rounds + 1):
        raw_round = _scrape_round(stream, spr)
        rounds.append([compress(b, "snappy") for b in raw_round])
        if r < 2:
            v2_rounds.append([compress(_v1_to_v2(b), "snappy") for b in raw_round])
            raw_bytes = sum(map(len, raw_round))
        del raw_round
    n_req = len(rounds[0])
    counts = [min(spr, stream.universe - i * spr) for i in range(n_req)]  # one sample each
    print(
        f"corpus: {len(cluster.pods)} pods ({loaded}), {stream.universe} series "
        f"({stream.attributable / stream.universe:.1%} name a pod of the snapshot), "
        f"{n_req} requests of up to {spr} series per round ({raw_bytes / n_req / 1e6:.2f} MB "
        f"raw, {sum(map(len, rounds[0])) / n_req / 1e3:.0f} kB snappy each); "
        f"set-up {time.time() - t_setup:.1f}s"
    )

    settings = EnrichSettings()
    # the product's plan: the TSDB's label limit at its default too (a compare per series)
    limit = UpstreamSettings().max_labels_per_series
    check = ("cluster", args.cluster) if args.cluster else None
    enricher = Enricher(index, settings.pod_label_pairs, max_labels_per_series=limit,
                        cluster_check=check)
    slow = Enricher(index, settings.pod_label_pairs, implementation="python",
                    max_labels_per_series=limit, cluster_check=check)
    print(f"splice: {enricher.implementation}; cluster check: "
          f"{'cluster=' + args.cluster if check else 'off'}; pod table: "
          f"{len(enricher.table)} pods"
          + (f", {enricher.table.memory() / len(enricher.table):.0f} B per pod"
             if hasattr(enricher.table, "memory") and len(enricher.table) else ""))

    def passthrough(body: bytes) -> object:
        return compress(decompress(body, "snappy", max_decoded=MAX_DECODED), "snappy")

    def enrich(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return compress(enricher.enrich_v1(raw).body, "snappy")

    def enrich_edit(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return enricher.enrich_snappy(Protocol.V1, raw, body).body

    parts_pool = ThreadPoolExecutor(1, thread_name_prefix="parts")

    def enrich_parts(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        cuts = split_v1(raw, 2)
        return splice_in_parts(raw, body, cuts, partial(enricher.enrich_snappy, Protocol.V1),
                               parts_pool)[1]

    def enrich_v2(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return compress(enricher.enrich_v2(raw).body, "snappy")

    def python_splice(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return compress(slow.enrich_v1(raw).body, "snappy")

    def reference(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        res = enrich_v1_reference(raw, index, settings.pod_label_pairs, cluster_check=check)
        return compress(res.body, "snappy")

    stamped = 0
    for body in rounds[0]:  # warm-up: every label set seen once
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        stamped += enricher.enrich_v1(raw).attributed
    print(f"attributed by the index in the warm-up round: {stamped} series "
          f"({stamped / stream.universe:.1%})")
    events = iter(range(10**9))  # names of the churn rows' pod events
    for body in v2_rounds[0]:
        enrich_v2(body)

    results: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    speedups: list[float] = []

    def record(name: str, bodies: list[bytes], counts: list[int], step: Callable[[bytes], object]
               ) -> None:
        cpu, times, wall = _run(bodies, counts, step)
        results.setdefault(name, []).append(cpu)
        latencies.setdefault(name, []).extend(times)
        walls.setdefault(name, []).extend(wall)

    for r in range(1, args.rounds + 1):
        bodies = rounds[r]
        record("pass-through", bodies, counts, passthrough)
        record("enrich", bodies, counts, enrich)
        record("enrich-edit", bodies, counts, enrich_edit)
        record("enrich-parts", bodies, counts, enrich_parts)

        def enrich_churn(body: bytes) -> object:
            i = next(events)
            index.apply(ChangeSet(pods={f"churn-{i}": PodAttribution(
                "churn", f"pod-{i}", f"churn-{i}", None, reason="no_described_owner")}))
            return enrich(body)

        record("enrich-churn", bodies, counts, enrich_churn)
        record("enrich-v2", v2_rounds[1], counts, enrich_v2)
        cpu, wall1, wall2 = _two_threads(bodies, counts, enrich)
        results.setdefault("enrich-2-threads", []).append(cpu)
        latencies.setdefault("enrich-2-threads", []).append(wall2)
        speedups.append(wall1 / wall2)
        record("python-splice", bodies[:4], counts[:4], python_splice)
        k = args.reference_requests
        record("reference", bodies[:k], counts[:k], reference)

    base = results["pass-through"]
    print(f"\n{'path':<16}{'CPU-s/M samples':>16}{'p50 ms/req':>12}{'p99 ms/req':>12}"
          f"{'x pass-through':>16}{'wall p50 ms':>13}{'wall p99 ms':>13}")
    for name, cpus in results.items():
        ratio = statistics.median(c / b for c, b in zip(cpus, base, strict=True))
        lat = latencies[name]
        wall = walls.get(name)
        print(
            f"{name:<16}{statistics.median(cpus):>16.3f}{_pct(lat, 0.5) * 1e3:>12.2f}"
            f"{_pct(lat, 0.99) * 1e3:>12.2f}{ratio:>16.2f}"
            + (f"{_pct(wall, 0.5) * 1e3:>13.2f}{_pct(wall, 0.99) * 1e3:>13.2f}" if wall else "")
        )
    parts_pool.shutdown()
    print(f"\ntwo threads vs one, same requests: {statistics.median(speedups):.2f}x the "
          f"throughput (median over rounds; enrich-2-threads latency columns: wall s/round)")
    return 0


def _two_threads(bodies: list[bytes], counts: list[int], step: Callable[[bytes], object]
                 ) -> tuple[float, float, float]:
    """CPU-s per M samples of two threads each doing ``step`` over ``bodies``, the wall time
    of one thread doing them alone, and of the two together (twice the work)."""
    t0 = time.perf_counter()
    for b in bodies:
        step(b)
    wall1 = time.perf_counter() - t0
    c0 = time.process_time()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: [step(b) for b in bodies], range(2)))
    wall2 = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return cpu / (2 * sum(counts)) * 1e6, wall1, wall2 / 2


if __name__ == "__main__":
    sys.exit(main())
