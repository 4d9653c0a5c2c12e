"""CPU cost of the wire layer per million samples: enrichment against plain relaying.

Replays a corpus of realistic 2,000-series RW 1.0 requests (cAdvisor container_* and DCGM
with exported_* labels, ~5k pods, ~92% of them in the index; see ``codec_corpus.py``)
through, in the same process and run:

- ``pass-through``: snappy decompress + compress, nothing else (the baseline);
- ``enrich``: decompress + ``Enricher.enrich_v1`` + compress, cache warm (steady state:
  every label set was seen once in a warm-up round, as after the first scrape interval);
- ``enrich-churn``: steady state while the cluster changes: one pod event (of a pod the
  series do not name) is applied to the index before each request, as in a live cluster
  where pods start and stop all the time (the index update, ~10 us, is in the figure);
- ``enrich-cold``: the same with an empty cache each round (the first scrape after start);
- ``enrich-v2``: the same corpus as RW 2.0 requests through ``Enricher.enrich_v2``, cache
  warm (its cache carries across requests, keyed by the resolved label strings);
- ``enrich-v2-cold``: the same with an empty cache each round;
- ``reference``: decompress + the pure-Python protobuf reference + compress (a few
  requests only: it is slow).

CPU seconds come from ``time.process_time`` around each request (single thread). Each
round replays every request once; printed are the median over rounds of CPU-s per
million samples, the p50/p99 per-request times, and ratios to pass-through computed per
round then medianed.

    python3 benchmarks/codec_bench.py [--rounds 5] [--pods 5000] [--reference-requests 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codec_corpus as corpus

from proxy.attribution import Enricher, enrich_v1_reference
from proxy.compression import compress, decompress
from proxy.config import EnrichSettings
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution

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


def _run(
    bodies: list[bytes], samples: list[int], step: Callable[[bytes], object]
) -> tuple[float, list[float]]:
    """CPU-s per million samples over ``bodies``, and each request's CPU seconds."""
    times: list[float] = []
    gc.collect()
    clock = time.process_time
    for body in bodies:
        t0 = clock()
        step(body)
        times.append(clock() - t0)
    return sum(times) / sum(samples) * 1e6, times


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pods", type=int, default=5000)
    ap.add_argument("--reference-requests", type=int, default=3)
    args = ap.parse_args(argv)

    t_setup = time.time()
    pods = corpus.make_pods(args.pods)
    index = PodIndex()
    corpus.fill_index(index, pods)
    labels = corpus.label_sets(pods)
    # round 0 warms the cache; the measured rounds carry new samples for the same series
    rounds_raw = corpus.build_requests(labels, args.rounds + 1)
    rounds = [[compress(r, "snappy") for r in rnd] for rnd in rounds_raw]
    v2_rounds = [[compress(_v1_to_v2(r), "snappy") for r in rnd] for rnd in rounds_raw[:2]]
    n_req = len(rounds[0])
    spr = corpus.SERIES_PER_REQUEST
    counts = [min(spr, len(labels) - i * spr) for i in range(n_req)]  # one sample each
    raw_mb = sum(map(len, rounds_raw[0])) / n_req / 1e6
    comp_kb = sum(map(len, rounds[0])) / n_req / 1e3
    print(
        f"corpus: {len(pods)} pods, {len(labels)} series, {n_req} requests of "
        f"{corpus.SERIES_PER_REQUEST} series per round ({raw_mb:.2f} MB raw, "
        f"{comp_kb:.0f} kB snappy each); set-up {time.time() - t_setup:.1f}s"
    )

    settings = EnrichSettings()
    enricher = Enricher(index, settings.pod_label_pairs, cache_size=settings.cache_size)

    def passthrough(body: bytes) -> object:
        return compress(decompress(body, "snappy", max_decoded=MAX_DECODED), "snappy")

    def enrich(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return compress(enricher.enrich_v1(raw).body, "snappy")

    def enrich_v2(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        return compress(enricher.enrich_v2(raw).body, "snappy")

    def reference(body: bytes) -> object:
        raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
        res = enrich_v1_reference(raw, index, settings.pod_label_pairs)
        return compress(res.body, "snappy")

    for body in rounds[0]:  # warm-up: every label set seen once
        enrich(body)
    events = iter(range(10**9))  # names of the churn rows' pod events
    for body in v2_rounds[0]:
        enrich_v2(body)

    results: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}

    def record(name: str, bodies: list[bytes], counts: list[int], step: Callable[[bytes], object]
               ) -> None:
        cpu, times = _run(bodies, counts, step)
        results.setdefault(name, []).append(cpu)
        latencies.setdefault(name, []).extend(times)

    for r in range(1, args.rounds + 1):
        bodies = rounds[r]
        record("pass-through", bodies, counts, passthrough)
        record("enrich", bodies, counts, enrich)

        def enrich_churn(body: bytes) -> object:
            i = next(events)
            index.apply(ChangeSet(pods={f"churn-{i}": PodAttribution(
                "churn", f"pod-{i}", f"churn-{i}", None, reason="no_described_owner")}))
            return enrich(body)

        record("enrich-churn", bodies, counts, enrich_churn)
        cold = Enricher(index, settings.pod_label_pairs, cache_size=settings.cache_size)

        def enrich_cold(body: bytes, cold: Enricher = cold) -> object:
            raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
            return compress(cold.enrich_v1(raw).body, "snappy")

        record("enrich-cold", bodies[:4], counts[:4], enrich_cold)
        record("enrich-v2", v2_rounds[1], counts, enrich_v2)
        cold2 = Enricher(index, settings.pod_label_pairs, cache_size=settings.cache_size)

        def enrich_v2_cold(body: bytes, cold: Enricher = cold2) -> object:
            raw = decompress(body, "snappy", max_decoded=MAX_DECODED)
            return compress(cold.enrich_v2(raw).body, "snappy")

        record("enrich-v2-cold", v2_rounds[1][:4], counts[:4], enrich_v2_cold)
        k = args.reference_requests
        record("reference", bodies[:k], counts[:k], reference)

    base = results["pass-through"]
    print(f"\n{'path':<16}{'CPU-s/M samples':>16}{'p50 ms/req':>12}{'p99 ms/req':>12}"
          f"{'x pass-through':>16}")
    for name, cpus in results.items():
        ratio = statistics.median(c / b for c, b in zip(cpus, base, strict=True))
        lat = latencies[name]
        print(
            f"{name:<16}{statistics.median(cpus):>16.3f}{_pct(lat, 0.5) * 1e3:>12.2f}"
            f"{_pct(lat, 0.99) * 1e3:>12.2f}{ratio:>16.2f}"
        )
    print(f"\ncache entries (1.0 + 2.0): {enricher.cache_len()}, misses after warm-up: "
          f"{enricher.misses - 2 * len(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
