"""CPU cost of converting an RW 2.0 request to RW 1.0 (for a 1.0-only upstream: Prometheus
2.x, VictoriaMetrics): the Python reference (``proxy/wire/convert.py``) against the native
conversion (``_convert.c`` through ``proxy.wire.native``), with the native splice of the
same request for scale.

Requests are built as Prometheus 3 sends them: every series with its metadata (type, help,
unit) and one sample, ~12 labels of ~600 bytes a series (cAdvisor / kube-state-metrics
shapes: namespace, pod, container, node, image, id, uid, ...), histogram families as their
``_bucket`` / ``_sum`` / ``_count`` series. Per size of request, each round runs, in turn:

- ``size pass``: what ``check_size`` costs (``convert.v1_form`` / the native count);
- ``conversion``: ``v2_to_v1`` given the size pass's size, as the proxy calls it (the
  native one writes once at that size, no second count);
- ``splice``: the native splice of the same RW 2.0 request (a pod of the table stamped).

CPU seconds are ``time.thread_time`` around each call (this thread only: the box may be
shared); printed are the medians over the rounds and reference / native ratios. The
native bytes are checked equal to the reference's once per size before timing.

``--nhcb SHARE``: that share of the series (0.1: ten of every hundred) are custom-bucket
native histograms instead (schema -53, 10 bounds, integer counts, a gap in the spans: what
a Prometheus 3 agent with ``convert_classic_histograms_to_nhcb`` sends), which the
conversion makes classic ``_bucket`` / ``_sum`` / ``_count`` series of; their series'
sample dropped, the series renamed ``http_request_duration_seconds``, type histogram.

``--stale SHARE``: that share of the histogram series (0.05: every twentieth; 1 with no
``--nhcb``: one marker on the first series) also end in a histogram staleness marker
(Prometheus' own: schema 0, no buckets, 15 s after the data), as every histogram series
of a deleted pod does; the conversion ends their classic series with it (a series
without custom-bucket data: a float stale marker).

    python3 benchmarks/convert_bench.py [--series 2000 500] [--rounds 20] [--nhcb 0.1]
        [--stale 0.05]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy import contract
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.sender import Series, build_v2
from proxy.wire import conversion, convert
from proxy.wire.native import Splicer, native_available
from proxy.wire.plan import PodPair, SplicePlan
from proxy.wire.primitives import STALE_NAN

_FAMILIES = [
    ("container_cpu_usage_seconds_total", "counter", "Cumulative cpu time consumed", "seconds"),
    ("container_memory_working_set_bytes", "gauge", "Current working set", "bytes"),
    ("container_network_receive_bytes_total", "counter", "Cumulative bytes received", "bytes"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)", ""),
    ("kube_pod_container_status_restarts_total", "counter",
     "The number of container restarts per container", ""),
    ("http_request_duration_seconds_bucket", "histogram", "Request latency", "seconds"),
    ("http_request_duration_seconds_sum", "histogram", "Request latency", "seconds"),
    ("http_request_duration_seconds_count", "histogram", "Request latency", "seconds"),
]


def build_request(series: int, seed: int = 0) -> bytes:
    """``series`` series of ~12 labels, ~600 label bytes each, metadata on every one."""
    out: list[Series] = []
    for i in range(series):
        name, mtype, help_, unit = _FAMILIES[i % len(_FAMILIES)]
        ns = f"team-{(i // 97) % 23}-production"
        pod = f"checkout-service-{(i * 7919 + seed) % 100_000:05d}-7d9f8b6c5d-{i % 89:02d}xkq"
        labels = {
            "__name__": name,
            "namespace": ns,
            "pod": pod,
            "container": f"checkout-api-server-{i % 5}",
            "instance": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:10250",
            "job": "kubernetes-nodes-cadvisor",
            "node": f"ip-10-42-{(i // 50) % 256}-{i % 200}.eu-west-1.compute.internal",
            "image": f"registry.example.com/platform/checkout-api-server:v1.{i % 40}.3-"
                     "8f2c1d0e9b7a6f5e4d3c2b1a",
            "id": f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{i:08x}"
                  f"_5f1e_4c2b_9a7d_3e6f8b2c1d0a.slice/cri-containerd-{i * 2654435761:016x}"
                  ".scope",
            "uid": f"{i:08x}-5f1e-4c2b-9a7d-3e6f8b2c{i % 4096:04x}",
            "service": "checkout-api-server-headless-metrics-monitoring",
            "endpoint": "https-metrics-kubelet-cadvisor",
        }
        if "_bucket" in name:
            labels["le"] = ("0.005", "0.05", "0.5", "5", "+Inf")[i % 5]
        out.append(Series(labels, [(1_767_000_000_000 + i, float(i))], metric_type=mtype,
                          help=help_, unit=unit))
    return build_v2(out)


def with_nhcb(raw: bytes, share: float) -> bytes:
    """``raw`` (``build_request``'s) with ``share`` of its series, spread evenly, made
    custom-bucket histograms (module docstring)."""
    req = v2.Request.FromString(raw)
    refs = {s: i for i, s in enumerate(req.symbols)}

    def ref(s: str) -> int:
        if s not in refs:
            refs[s] = len(req.symbols)
            req.symbols.append(s)
        return refs[s]

    every = 100
    chosen = round(share * every)
    for i, ts in enumerate(req.timeseries):
        if i % every >= chosen:
            continue
        labels = list(ts.labels_refs)
        kept = [x for k in range(0, len(labels), 2)
                for x in labels[k:k + 2] if req.symbols[labels[k]] != "le"]
        for k in range(0, len(kept), 2):
            if req.symbols[kept[k]] == "__name__":
                kept[k + 1] = ref("http_request_duration_seconds")
        del ts.labels_refs[:]
        ts.labels_refs.extend(kept)
        ts.ClearField("samples")
        ts.metadata.type = v2.Metadata.METRIC_TYPE_HISTOGRAM
        ts.metadata.help_ref = ref("Request latency")
        ts.metadata.unit_ref = ref("seconds")
        h = ts.histograms.add(count_int=100, sum=12.5, schema=-53,
                              timestamp=1_767_000_000_000 + i)
        h.custom_values.extend([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5])
        h.positive_spans.add(offset=0, length=6)
        h.positive_spans.add(offset=1, length=4)
        h.positive_deltas.extend([1, 2, 3, -1, 4, 5, -2, 1, 0, 3])
    return bytes(req.SerializeToString())


def with_stale(raw: bytes, share: float) -> bytes:
    """``raw`` with ``share`` of its histogram series (every series when it has none),
    spread evenly, ending in a staleness marker (module docstring); at least one."""
    req = v2.Request.FromString(raw)
    series = [ts for ts in req.timeseries if ts.histograms] or list(req.timeseries)
    every = max(1, round(1 / share)) if share < 1 else len(series)
    for k, ts in enumerate(series):
        if k % every == 0:
            at = ts.histograms[-1].timestamp if ts.histograms else ts.samples[-1].timestamp
            ts.histograms.add(sum=STALE_NAN, timestamp=at + 15_000)
    return bytes(req.SerializeToString())


def _cpu(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _splicer() -> Splicer:
    stamped = frozenset(n.encode() for n in contract.STAMPED_LABELS)
    sp = Splicer(SplicePlan(pairs=(PodPair(b"namespace", b"pod"),), stamped=stamped), "native")
    sp.table.set(b"team-0-production", b"checkout-service-00000-7d9f8b6c5d-00xkq",
                 (("karta_workload", "checkout"),))
    return sp


def bench(series: int, rounds: int, nhcb: float = 0.0, stale: float = 0.0
          ) -> dict[str, float | int]:
    raw = build_request(series)
    if nhcb:
        raw = with_nhcb(raw, nhcb)
    if stale:
        raw = with_stale(raw, stale)
    ref = convert.v2_to_v1(raw)
    assert conversion.v2_to_v1(raw) == ref, "native and reference conversions differ"
    assert conversion.v1_form(raw) == convert.v1_form(raw)
    size = conversion.v1_form(raw).size
    splicer = _splicer()
    steps: dict[str, Callable[[], object]] = {
        "size_ref": lambda: convert.v1_form(raw),
        "size_native": lambda: conversion.v1_form(raw),
        "convert_ref": lambda: convert.v2_to_v1(raw),
        "convert_native": lambda: conversion.v2_to_v1(raw, size),
        "splice": lambda: splicer.splice_v2(raw),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    gc.disable()
    try:
        for _ in range(rounds):  # alternating: each round runs every step once
            for k, fn in steps.items():
                times[k].append(_cpu(fn))
    finally:
        gc.enable()
    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, float | int] = {
        "series": series, "rounds": rounds, "nhcb": nhcb, "stale": stale,
        "request_bytes": len(raw),
        "converted_bytes": len(ref),
        **{f"{k}_ms": v * 1e3 for k, v in med.items()},
    }
    for what in ("size", "convert"):
        result[f"{what}_ratio"] = med[f"{what}_ref"] / max(med[f"{what}_native"], 1e-9)
    both_ref = med["size_ref"] + med["convert_ref"]
    both_native = med["size_native"] + med["convert_native"]
    result["both_ref_ms"], result["both_native_ms"] = both_ref * 1e3, both_native * 1e3
    result["both_ratio"] = both_ref / max(both_native, 1e-9)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--series", type=int, nargs="+", default=[2000, 500])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--nhcb", type=float, default=0.0, metavar="SHARE",
                   help="this share of the series custom-bucket histograms (0 to 1)")
    p.add_argument("--stale", type=float, default=0.0, metavar="SHARE",
                   help="this share of the histogram series end in a staleness marker")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    if not native_available():
        print("the native extension is not built: nothing to compare", file=sys.stderr)
        return 2
    results = []
    for n in args.series:
        r = bench(n, args.rounds, args.nhcb, args.stale)
        results.append(r)
        nhcb = f" ({args.nhcb:.0%} custom-bucket histograms)" if args.nhcb else ""
        if args.stale:
            nhcb += (" (one histogram series marked stale)" if args.stale >= 1 else
                     f" ({args.stale:.0%} of the histogram series marked stale)")
        print(f"{n} series{nhcb}: RW 2.0 request {r['request_bytes']:,} bytes, RW 1.0 form "
              f"{r['converted_bytes']:,} bytes; CPU ms per request, median of {args.rounds}")
        for what, label in (("size", "size pass"), ("convert", "conversion"),
                            ("both", "both")):
            print(f"  {label:<11} reference {r[f'{what}_ref_ms']:8.2f}   native "
                  f"{r[f'{what}_native_ms']:7.3f}   ratio {r[f'{what}_ratio']:6.0f}x")
        print(f"  splice      native    {r['splice_ms']:8.3f}   (the same request, for scale)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
