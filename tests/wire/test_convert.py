"""RW 2.0 -> 1.0 conversion for 1.0-only upstreams."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import types_pb2
from proxy.sender import Series, build_v1, build_v2
from proxy.wire.convert import v2_to_v1
from tests.upstream_proto import upstream_v1
from tests.wire_fixtures import TS, is_stale, labels_of, parse_v1, request_v2

RequestV2: Any = cast(Any, v2).Request


def test_v2_to_v1_converts_everything() -> None:
    raw = request_v2({"__name__": "g", "pod": "p"}, {"__name__": "h", "x": "y"},
                     histograms=1, exemplars=1, metadata=True)
    req = parse_v1(v2_to_v1(raw))
    first, second = req.timeseries
    assert labels_of(first) == [("__name__", "g"), ("pod", "p")]
    assert (first.samples[0].value, first.samples[0].timestamp) == (2.5, TS)
    assert is_stale(first.samples[1].value)
    assert len(first.histograms) == 1 and first.histograms[0].count_float == 2.0
    assert first.histograms[0].positive_counts == [2.0]
    assert [labels_of(e) for e in first.exemplars] == [[("trace_id", "t0")]]
    assert labels_of(second)[0] == ("__name__", "h")
    meta = {(m.metric_family_name, m.type, m.help, m.unit) for m in req.metadata}
    assert meta == {("g", types_pb2.MetricMetadata.GAUGE, "a gauge", "bytes"),
                    ("h", types_pb2.MetricMetadata.GAUGE, "a gauge", "bytes")}
    # no start_timestamp survives (1.0 has no field for it)
    assert b"start" not in v2_to_v1(raw)


def test_v2_to_v1_parses_with_upstream_protos(tmp_path: Path) -> None:
    up = upstream_v1(tmp_path)
    raw = request_v2({"__name__": "g", "pod": "p"}, histograms=2, exemplars=1, metadata=True)
    req = up["prometheus.WriteRequest"]()
    req.ParseFromString(v2_to_v1(raw))
    assert len(req.timeseries) == 1
    assert len(req.timeseries[0].histograms) == 2
    # nothing unknown to upstream left over
    assert req.SerializeToString() == v2_to_v1(raw)


def test_v2_to_v1_empty() -> None:
    assert v2_to_v1(request_v2()) == b""


def test_v2_metadata_becomes_one_family_per_histogram_or_summary() -> None:
    # RW 2.0 carries metadata per series, RW 1.0 per family: a histogram's _bucket, _sum
    # and _count series are one family, rpc_seconds (a store keyed by family, Mimir's,
    # got three wrong families and no rpc_seconds). The project's own RW 1.0 sender,
    # independent of this code, names the family so too.
    sent = [Series({"__name__": f"rpc_seconds{s}", "pod": "p"}, [(TS, 1.0)],
                   metric_type="histogram", help="latency") for s in ("_bucket", "_sum", "_count")]
    sent.append(Series({"__name__": "up_total", "pod": "p"}, [(TS, 1.0)],
                       metric_type="counter", help="ups"))
    converted = parse_v1(v2_to_v1(build_v2(sent)))
    direct = parse_v1(build_v1(sent))
    families = {(m.metric_family_name, m.type, m.help) for m in converted.metadata}
    assert families == {(m.metric_family_name, m.type, m.help) for m in direct.metadata}
    assert families == {("rpc_seconds", types_pb2.MetricMetadata.HISTOGRAM, "latency"),
                        ("up_total", types_pb2.MetricMetadata.COUNTER, "ups")}


def test_v2_metadata_of_nothing_but_empty_strings_is_no_metadata() -> None:
    # help_ref / unit_ref pointing at another "" than symbol 0 say nothing
    req = RequestV2()
    req.symbols.extend(["", "__name__", "m1", ""])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2])
    ts.samples.add(value=1.0, timestamp=TS)
    ts.metadata.help_ref = 3
    ts.metadata.unit_ref = 3
    assert list(parse_v1(v2_to_v1(req.SerializeToString())).metadata) == []
