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
    codec.parse_labels_v1(key)  # a miss must refuse what is not a label run
    return codec.make_entry(codec.ALWAYS, None, "x", len(key), None)


def _splice_identity(raw: bytes) -> tuple[bytes, Counts, list[str]]:
    return codec.splice_v1(raw, _EMPTY.get, _never)


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
        codec.parse_labels_v1(key)
        return codec.make_entry(codec.ALWAYS, None, "", len(key), key + stamp)

    return miss


ZZ = codec.encode_label_v1(b"zz", b"1")


def test_labels_after_samples_are_still_found() -> None:
    # valid protobuf: fields of a repeated message may come in any order
    ts = series_v1({"a": "1"})
    labels = ts.labels[0].SerializeToString()
    sample = ts.samples[0].SerializeToString()
    body = codec.len_field(2, sample) + codec.len_field(1, labels)
    raw = codec.len_field(1, body)
    out, counts, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ))
    (got,) = parse_v1(out).timeseries
    assert labels_of(got) == [("a", "1"), ("zz", "1")]
    assert got.samples == ts.samples
    assert counts.samples == 1


def test_long_series_and_long_labels() -> None:
    big = "v" * 5000  # label and series lengths need multi-byte varints
    raw = request_v1(series_v1({"a": big, "b": "x" * 200}), series_v1({"c": "d"}))
    out, _, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ))
    first, second = parse_v1(out).timeseries
    assert labels_of(first) == [("a", big), ("b", "x" * 200), ("zz", "1")]
    assert labels_of(second) == [("c", "d"), ("zz", "1")]


def test_unknown_fields_pass_through() -> None:
    extra = codec.len_field(15, b"future") + b"\xa0\x06\x01"  # field 100 varint
    raw = request_v1(series_v1({"a": "1"})) + extra
    out, _, _ = codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ))
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
        codec.splice_v1(raw, _EMPTY.get, _stamp_all(ZZ))
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
        codec.splice_v2(raw, _EMPTY_V2.get, _unchanged_v2)
    assert info.value.status == 400


_EMPTY_V2: dict[codec.LabelKey, tuple[object, ...]] = {}


def _unchanged_v2(key: codec.LabelKey) -> tuple[object, ...]:
    return (codec.ALWAYS, "r", codec.UNCHANGED, None, None)


def test_v2_unpacked_refs_accepted() -> None:
    # labels_refs sent one varint at a time (legal protobuf for a packed field)
    raw = (codec.len_field(4, b"") + codec.len_field(4, b"a") + codec.len_field(4, b"b")
           + codec.len_field(5, b"\x08\x01\x08\x02"))
    seen: list[codec.LabelKey] = []

    def miss(key: codec.LabelKey) -> tuple[object, ...]:
        seen.append(key)
        return (codec.ALWAYS, "", 0, (b"c", b"d"), None)

    out, counts, reasons = codec.splice_v2(raw, _EMPTY_V2.get, miss)
    assert seen == [(b"a", b"b")]
    assert (counts.series, counts.samples, reasons) == (1, 0, [])
    # the stamp goes in at pair 0, the refs are re-encoded packed, "c" and "d" appended
    assert out == (codec.len_field(4, b"") + codec.len_field(4, b"a") + codec.len_field(4, b"b")
                   + codec.len_field(4, b"c") + codec.len_field(4, b"d")
                   + codec.len_field(5, codec.len_field(1, b"\x03\x04\x01\x02")))


def test_v2_fast_layout_cuts_packed_refs_at_the_block() -> None:
    """Multi-byte refs: the stamp's refs go in after the k-th varint (s9 is ref 10)."""
    syms = [b"", *(b"s%d" % i for i in range(300))]
    refs = [5, 200, 150, 7, 299, 1]  # three pairs, two-byte varints among them
    packed = b"".join(codec.encode_uvarint(r) for r in refs)
    sample = codec.len_field(2, b"\x09" + b"\x00" * 8)
    raw = b"".join(codec.len_field(4, x) for x in syms) + codec.len_field(
        5, codec.len_field(1, packed) + sample)

    def miss(key: codec.LabelKey) -> tuple[object, ...]:
        assert key == tuple(syms[r] for r in refs)
        return (codec.ALWAYS, "", 2, (b"s9", b"new"), None)

    out, counts, _ = codec.splice_v2(raw, _EMPTY_V2.get, miss)
    new_refs = b"".join(codec.encode_uvarint(r) for r in [*refs[:4], 10, 301, *refs[4:]])
    assert out == (b"".join(codec.len_field(4, x) for x in syms) + codec.len_field(4, b"new")
                   + codec.len_field(5, codec.len_field(1, new_refs) + sample))
    assert counts.samples == 1


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
        codec.parse_labels_v1(key)
        ent = codec.make_entry(codec.ALWAYS, None, "", len(key), key + stamp)
        cache[key] = ent
        return ent

    codec.splice_v1(raw, cache.get, miss)
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
    out, counts, _ = codec.splice_v1(raw, cache.get, miss)
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
        out, counts, _ = codec.splice_v1(raw, cache.get, miss)
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


# -- the cheap read of a label run on a miss ------------------------------------------------


def _run(*labels: tuple[str, str]) -> bytes:
    return b"".join(codec.encode_label_v1(n.encode(), v.encode()) for n, v in labels)


def test_scan_labels_reads_wanted_values_and_the_block_position() -> None:
    key = _run(("__name__", "up"), ("id", "x" * 300), ("job", ""), ("pod", "p"), ("zone", "a"))
    got, at = codec.scan_labels_v1(key, {b"pod", b"job", b"__name__", b"nope"}) or ({}, -1)
    assert got == {b"pod": b"p", b"job": b"", b"__name__": b"up"}
    assert at == len(_run(("__name__", "up"), ("id", "x" * 300), ("job", "")))
    assert codec.scan_labels_v1(_run(("a", "1")), ()) == ({}, len(_run(("a", "1"))))
    assert codec.scan_labels_v1(b"", ()) == ({}, 0)


@pytest.mark.parametrize(
    "key",
    [
        _run(("b", "1"), ("a", "1")),  # unsorted
        _run(("a", "1"), ("a", "2")),  # duplicate
        _run(("a", "1"), ("karta_workload", "w")),  # the sender's own karta_ label
        _run(("n" * 200, "1")),  # long name
        codec.len_field(1, codec.len_field(2, b"v") + codec.len_field(1, b"n")),  # order
        codec.len_field(1, codec.len_field(1, b"n") + b"\x18\x01"),  # unknown field
        _run(("a", "1"))[:-1],  # truncated
        _run(("a", "1")) + b"\x12\x00",  # not a label field
    ],
)
def test_scan_labels_leaves_unusual_shapes_to_the_full_parse(key: bytes) -> None:
    assert codec.scan_labels_v1(key, {b"a", b"n"}) is None


def test_entries_share_their_heads_and_go_stale_with_their_cell() -> None:
    key = _run(("a", "1"))
    new = key + _run(("karta_workload", "w"))
    cell: list[object] = ["answer"]
    ent = codec.make_entry(cell, "answer", "", len(key), new)
    assert ent[1] == new and ent[4] == len(new) - len(key)
    assert ent[2] == codec.len_field(1, new + b"x" * 18)[: len(ent[2])]
    assert ent[2] is codec.make_entry(cell, None, "", 0, new)[2]  # one object per length
    with pytest.raises(ValueError):
        codec.make_entry(cell, None, "r", len(key), new)
    # splice: valid while cell[0] is the token; then the miss is asked again
    raw = request_v1(series_v1({"a": "1"}))
    cache: dict[bytes, tuple[object, ...]] = {}
    asked: list[bytes] = []

    def miss(key: bytes) -> tuple[object, ...]:
        codec.parse_labels_v1(key)
        asked.append(key)
        ent = codec.make_entry(cell, cell[0], "", len(key), key + ZZ)
        cache[key] = ent
        return ent

    for _ in range(2):
        codec.splice_v1(raw, cache.get, miss)
    assert len(asked) == 1
    cell[0] = "another answer"
    out, _, _ = codec.splice_v1(raw, cache.get, miss)
    assert len(asked) == 2
    assert labels_of(parse_v1(out).timeseries[0]) == [("a", "1"), ("zz", "1")]


@pytest.mark.parametrize("long", [False, True])
def test_scan_labels_checks_the_utf8_of_every_string(long: bool) -> None:
    pad = "x" * (200 if long else 3)  # a long value: two-byte lengths in the framing
    good = _run(("a", pad + "é€😀"), ("b", "\ufffd"), ("c", pad))
    assert codec.scan_labels_v1(_run(("a", pad + "é€😀"), ("c", pad)), ()) is not None
    # with long framing, a string that really holds U+FFFD is left to the full parse,
    # which accepts it
    assert (codec.scan_labels_v1(good, ()) is None) == long
    assert [lf[1] for lf in codec.parse_labels_v1(good)][1] == "\ufffd".encode()
    for bad in (b"\xff", b"\xe2\x82", b"\xc3"):
        key = _run(("a", pad), ("b", "v"), ("c", pad)).replace(b"\x01v", b"\x01" + bad[:1])
        key = key if len(bad) == 1 else _run(("a", pad), ("c", pad)) + codec.len_field(
            1, codec.len_field(1, b"d") + codec.len_field(2, bad))
        assert codec.scan_labels_v1(key, ()) is None
        with pytest.raises(DecodeError) as info:
            codec.parse_labels_v1(key)
        assert info.value.kind == "invalid_utf8"
