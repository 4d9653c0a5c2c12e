"""Small builders of remote-write bodies through the generated classes, for the wire tests."""

from __future__ import annotations

import math
import struct

from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, WorkloadRef
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2, types_pb2

STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
TS = 1_767_000_000_000

WL_TRAIN = WorkloadRef(namespace="ml", group="ray.io", kind="RayJob", name="train", uid="w1")
WL_WEB = WorkloadRef(namespace="web", group="apps", kind="Deployment", name="shop", uid="w2")


def index_with_pods() -> PodIndex:
    """ml/train-head (attributed), web/shop-abc (attributed), ml/lonely (unattributed)."""
    idx = PodIndex()
    idx.apply(
        ChangeSet(
            pods={
                "u1": PodAttribution("ml", "train-head", "u1", WL_TRAIN, "head", "train"),
                "u2": PodAttribution("web", "shop-abc", "u2", WL_WEB, "", "shop"),
                "u3": PodAttribution("ml", "lonely", "u3", None, reason="no_described_owner"),
            }
        )
    )
    return idx


def series_v1(
    labels: dict[str, str],
    samples: list[tuple[float, int]] | None = None,
    *,
    exemplars: int = 0,
    histograms: int = 0,
) -> types_pb2.TimeSeries:
    ts = types_pb2.TimeSeries()
    for k in sorted(labels):
        ts.labels.add(name=k, value=labels[k])
    for value, t in samples if samples is not None else [(1.5, TS)]:
        ts.samples.add(value=value, timestamp=t)
    for i in range(exemplars):
        ex = ts.exemplars.add(value=float(i), timestamp=TS + i)
        ex.labels.add(name="trace_id", value=f"abc{i}")
    for i in range(histograms):
        h = ts.histograms.add(count_int=10 + i, sum=3.5, schema=3, zero_threshold=1e-128,
                              zero_count_int=1, timestamp=TS + i)
        h.positive_spans.add(offset=-2, length=2)
        h.positive_deltas.extend([4, -1])
    return ts


def request_v1(*series: types_pb2.TimeSeries, metadata: bool = False) -> bytes:
    req = remote_pb2.WriteRequest()
    req.timeseries.extend(series)
    if metadata:
        req.metadata.add(type=types_pb2.MetricMetadata.COUNTER, metric_family_name="x_total",
                         help="help text", unit="seconds")
    return req.SerializeToString()


def parse_v1(raw: bytes) -> remote_pb2.WriteRequest:
    req = remote_pb2.WriteRequest()
    req.ParseFromString(raw)
    return req


def labels_of(ts: types_pb2.TimeSeries) -> list[tuple[str, str]]:
    return [(lb.name, lb.value) for lb in ts.labels]


class Symbols:
    """An RW 2.0 symbol table built the way a sender builds it: a string's index is fixed
    at its first use, after the ``preset`` ones (``""`` first, as the spec asks)."""

    def __init__(self, preset: list[str] | None = None) -> None:
        self.strings: list[str] = list(preset) if preset is not None else [""]
        self._where = {s: i for i, s in enumerate(self.strings)}

    def ref(self, s: str) -> int:
        if s not in self._where:
            self._where[s] = len(self.strings)
            self.strings.append(s)
        return self._where[s]


def request_v2(*series: dict[str, str], symbols: list[str] | None = None,
               histograms: int = 0, exemplars: int = 0, metadata: bool = False) -> bytes:
    req = v2.Request()
    table = Symbols(symbols)
    ref = table.ref
    for labels in series:
        ts = req.timeseries.add()
        for k in sorted(labels):
            ts.labels_refs.extend([ref(k), ref(labels[k])])
        ts.samples.add(value=2.5, timestamp=TS, start_timestamp=TS - 1000)
        ts.samples.add(value=STALE_NAN, timestamp=TS + 15000)
        for i in range(histograms):
            h = ts.histograms.add(count_float=2.0 + i, sum=1.0, schema=0, timestamp=TS,
                                  start_timestamp=TS - 5)
            h.positive_spans.add(offset=0, length=1)
            h.positive_counts.append(2.0)
        for i in range(exemplars):
            ex = ts.exemplars.add(value=float(i), timestamp=TS)
            ex.labels_refs.extend([ref("trace_id"), ref(f"t{i}")])
        if metadata:
            ts.metadata.type = v2.Metadata.METRIC_TYPE_GAUGE
            ts.metadata.help_ref = ref("a gauge")
            ts.metadata.unit_ref = ref("bytes")
    req.symbols.extend(table.strings)
    return req.SerializeToString()


def parse_v2(raw: bytes) -> v2.Request:
    req = v2.Request()
    req.ParseFromString(raw)
    return req


def labels_v2(req: v2.Request, ts: v2.TimeSeries) -> list[tuple[str, str]]:
    r = list(ts.labels_refs)
    return [(req.symbols[r[i]], req.symbols[r[i + 1]]) for i in range(0, len(r), 2)]


def is_stale(v: float) -> bool:
    return math.isnan(v) and struct.pack("<d", v) == struct.pack("<Q", 0x7FF0000000000002)


def amplifying_v2(symbol_bytes: int, series: int) -> bytes:
    """One long symbol named as a label value by every series: RW 2.0 holds it once, its
    RW 1.0 form once per series (the audit's 64 KiB x 4,000: 185 KB decoded, 23 KB snappy,
    263 MB converted)."""
    req = v2.Request()
    req.symbols.extend(["", "__name__", "amp", "namespace", "web", "pod",
                        "frontend-6d8f7b9c5d-4xkqp", "blob", "x" * symbol_bytes])
    for i in range(series):
        ts = req.timeseries.add()
        ts.labels_refs.extend([1, 2, 7, 8, 3, 4, 5, 6])
        ts.samples.add(value=1.0, timestamp=TS + i)
    body: bytes = req.SerializeToString()
    return body
