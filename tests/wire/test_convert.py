"""RW 2.0 -> 1.0 conversion for 1.0-only upstreams."""

from __future__ import annotations

from pathlib import Path

from proxy.pb.prometheus import types_pb2
from proxy.wire.convert import v2_to_v1
from tests.upstream_proto import upstream_v1
from tests.wire_fixtures import TS, is_stale, labels_of, parse_v1, request_v2


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
