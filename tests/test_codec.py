"""Wire-level scanning: protocols, counts, odd but valid layouts, garbage, 2.0 -> 1.0."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy import codec
from proxy.codec import Counts, Protocol, protocol_from_content_type, v2_to_v1
from proxy.compression import DecodeError
from proxy.pb.prometheus import types_pb2
from tests.upstream_proto import upstream_v1
from tests.wire_fixtures import (
    STALE_NAN,
    TS,
    is_stale,
    labels_of,
    parse_v1,
    request_v1,
    request_v2,
    series_v1,
)


@pytest.mark.parametrize(
    ("ct", "proto"),
    [
        ("application/x-protobuf", Protocol.V1),
        ("application/x-protobuf;proto=prometheus.WriteRequest", Protocol.V1),
        ("Application/X-Protobuf; proto=prometheus.WriteRequest", Protocol.V1),
        ("application/x-protobuf;proto=io.prometheus.write.v2.Request", Protocol.V2),
        ('application/x-protobuf; proto="io.prometheus.write.v2.Request"', Protocol.V2),
    ],
)
def test_protocol_from_content_type(ct: str, proto: Protocol) -> None:
    assert protocol_from_content_type(ct) is proto


@pytest.mark.parametrize(
    "ct", ["", "application/json", "text/plain", "application/x-protobuf;proto=foo.Bar"]
)
def test_unsupported_content_type_is_415(ct: str) -> None:
    with pytest.raises(DecodeError) as info:
        protocol_from_content_type(ct)
    assert info.value.status == 415


_EMPTY: dict[bytes, tuple[object, ...]] = {}


def _never(key: bytes) -> tuple[object, ...]:
    return (-1, None, 0, "x", None, None)


def _splice_identity(raw: bytes) -> tuple[bytes, Counts, list[str]]:
    return codec.splice_v1(raw, _EMPTY.get, _never, 0)


def test_counts_v1() -> None:
    raw = request_v1(
        series_v1({"a": "1"}, [(1.0, TS), (STALE_NAN, TS + 1)], exemplars=1),
        series_v1({"a": "2"}, [], histograms=3),
        metadata=True,
    )
    assert codec.count_v1(raw) == Counts(series=2, samples=2, histograms=3, exemplars=1)
    body, counts, reasons = _splice_identity(raw)
    assert body is raw
    assert counts == Counts(series=2, samples=2, histograms=3, exemplars=1)
    assert reasons == ["x", "x"]


def test_counts_v2() -> None:
    raw = request_v2({"a": "1"}, {"a": "2"}, histograms=1, exemplars=2)
    assert codec.count_v2(raw) == Counts(series=2, samples=4, histograms=2, exemplars=4)


def _stamp_all(stamp: bytes) -> codec.CacheMiss:
    def miss(key: bytes) -> tuple[object, ...]:
        return (-1, key + stamp, len(stamp), "", *codec.entry_heads(key + stamp))

    return miss


ZZ = codec.encode_label_v1(b"zz", b"1")


def test_labels_after_samples_are_still_found() -> None:
    # valid protobuf: fields of a repeated message may come in any order
    ts = series_v1({"a": "1"})
    labels = ts.labels[0].SerializeToString()
    sample = ts.samples[0].SerializeToString()
    body = codec.len_field(2, sample) + codec.len_field(1, labels)
    raw = codec.len_field(1, body)
    out, counts, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ), 0)
    (got,) = parse_v1(out).timeseries
    assert labels_of(got) == [("a", "1"), ("zz", "1")]
    assert got.samples == ts.samples
    assert counts.samples == 1


def test_long_series_and_long_labels() -> None:
    big = "v" * 5000  # label and series lengths need multi-byte varints
    raw = request_v1(series_v1({"a": big, "b": "x" * 200}), series_v1({"c": "d"}))
    out, _, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ), 0)
    first, second = parse_v1(out).timeseries
    assert labels_of(first) == [("a", big), ("b", "x" * 200), ("zz", "1")]
    assert labels_of(second) == [("c", "d"), ("zz", "1")]


def test_unknown_fields_pass_through() -> None:
    extra = codec.len_field(15, b"future") + b"\xa0\x06\x01"  # field 100 varint
    raw = request_v1(series_v1({"a": "1"})) + extra
    out, _, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ), 0)
    assert out.endswith(extra)


GARBAGE = [
    b"\x0a\x05abc",  # series longer than the body
    b"\x0a",  # truncated
    b"\x0b\x00",  # group start
    b"\x08",  # truncated varint field
    b"\xff" * 12,  # over-long varint
    b"\x00\x01",  # field number 0
    b"\x0a\x04\x0a\x05ab",  # label longer than its series
    b"\x0a\x02\x08\x01",  # label field with a varint wire type
    b"\x0a\x03\x12\x01\x00",  # sample field too short for ... fine: sample content unparsed
]


@pytest.mark.parametrize("raw", GARBAGE[:-1])
def test_garbage_v1_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ), 0)
    assert (info.value.status, info.value.kind) == (400, "protobuf_invalid")


def test_invalid_utf8_label_is_a_decode_error() -> None:
    label = codec.len_field(1, b"na\xffme") + codec.len_field(2, b"v")
    with pytest.raises(DecodeError) as info:
        codec.parse_labels_v1(codec.len_field(1, label))
    assert (info.value.status, info.value.kind) == (400, "invalid_utf8")


@pytest.mark.parametrize(
    "raw",
    [
        b"\x22\x01\xff",  # a symbol that is not UTF-8
        b"\x22\x01a",  # symbols not starting with ""
        b"\x22\x00\x2a\x04\x0a\x02\x00\x05",  # ref past the table
        b"\x22\x00\x2a\x03\x0a\x01\x00",  # odd number of refs
        b"\x2a\x05\x0a",  # truncated
    ],
)
def test_garbage_v2_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        codec.splice_v2(raw, lambda labels: (None, ""), frozenset())
    assert info.value.status == 400


def test_v2_unpacked_refs_accepted() -> None:
    # labels_refs sent one varint at a time (legal protobuf for a packed field)
    raw = (codec.len_field(4, b"") + codec.len_field(4, b"a") + codec.len_field(4, b"b")
           + codec.len_field(5, b"\x08\x01\x08\x02"))
    seen: list[list[tuple[bytes, bytes]]] = []

    def resolve(labels: list[tuple[bytes, bytes]]) -> tuple[None, str]:
        seen.append(labels)
        return None, "r"

    codec.splice_v2(raw, resolve, frozenset())
    assert seen == [[(b"a", b"b")]]


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


# -- the fast path's tail guess must never be trusted beyond what it proves ---------------


def _warm(raw: bytes) -> tuple[dict[bytes, tuple[object, ...]], codec.CacheMiss]:
    cache: dict[bytes, tuple[object, ...]] = {}
    stamp = ZZ

    def miss(key: bytes) -> tuple[object, ...]:
        ent = (-1, key + stamp, len(stamp), "", *codec.entry_heads(key + stamp))
        cache[key] = ent
        return ent

    codec.splice_v1(raw, cache.get, miss, 0)
    return cache, miss


@pytest.mark.parametrize(
    "samples",
    [
        [(0.0, TS), (0.0, TS + 1)],  # two 9-byte samples: 18 bytes that start like one
        [(0.0, TS)],  # one 9-byte sample
        [(1.0, TS)],  # one 18-byte sample
        [(1.0, TS), (2.0, TS + 1)],
        [(1.0, 5)],  # short timestamp
        [],
    ],
)
def test_warm_cache_counts_and_splices_exactly(samples: list[tuple[float, int]]) -> None:
    labels = {"namespace": "ml", "pod": "train-head"}
    cache, miss = _warm(request_v1(series_v1(labels)))  # the label run is now cached
    ts = series_v1(labels, samples, exemplars=0)
    raw = request_v1(ts)
    out, counts, _ = codec.splice_v1(raw, cache.get, miss, 0)
    assert counts.samples == len(samples)
    (got,) = parse_v1(out).timeseries
    assert labels_of(got) == [("namespace", "ml"), ("pod", "train-head"), ("zz", "1")]
    assert [s.SerializeToString() for s in got.samples] == [
        s.SerializeToString() for s in ts.samples]


def test_label_value_that_looks_like_a_sample_tail() -> None:
    # the last 9 bytes of this series are inside a label value, not a sample
    tricky = "x\x12\x07\x10abcdef"
    raw = request_v1(series_v1({"a": tricky}, []))
    cache, miss = _warm(raw)
    for _ in range(2):
        out, counts, _ = codec.splice_v1(raw, cache.get, miss, 0)
        assert counts.samples == 0
        assert labels_of(parse_v1(out).timeseries[0]) == [("a", tricky), ("zz", "1")]


def test_invalid_utf8_cannot_hide_behind_framing_bytes() -> None:
    # name ends with E2 82, then an unknown field 37 (varint) whose tag starts A8: "₨"
    unknown = bytes([0xA8, 0x02, 0x00])  # tag 0x128 = field 37, wire type 0; value 0
    label = codec.len_field(1, b"ab\xe2\x82") + unknown + codec.len_field(2, b"v")
    with pytest.raises(DecodeError) as info:
        codec.parse_labels_v1(codec.len_field(1, label))
    assert info.value.kind == "invalid_utf8"


def test_long_labels_are_still_checked_for_utf8() -> None:
    label = codec.len_field(1, b"id") + codec.len_field(2, b"x" * 200 + b"\xff")
    with pytest.raises(DecodeError) as info:
        codec.parse_labels_v1(codec.len_field(1, label))
    assert info.value.kind == "invalid_utf8"
