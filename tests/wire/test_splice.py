"""The splices at the wire level, on both implementations: counts, odd but valid layouts,
what stays byte-exact, and garbage refused with the right error."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import snappy

from proxy.compression import DecodeError
from proxy.handler import splice_in_parts
from proxy.wire.native import Splicer, native_available, split_v1
from proxy.wire.plan import NO_LABELS_LEFT, LabelLimited, SplicePlan, SpliceResult
from proxy.wire.primitives import Counts, Protocol, encode_label_v1, encode_uvarint, len_field
from tests.wire.conftest import PLAN, STAMPED, MakeSplicer
from tests.wire_fixtures import (
    STALE_NAN,
    TS,
    labels_of,
    labels_v2,
    parse_v1,
    parse_v2,
    request_v1,
    request_v2,
    series_v1,
)

POD = {"namespace": "ml", "pod": "p"}
STAMPED_POD = [("karta_workload", "w"), ("namespace", "ml"), ("pod", "p")]


def test_counts_v1_and_unattributed_bytes_pass_through(splicer: Splicer) -> None:
    raw = request_v1(
        series_v1({"a": "1"}, [(1.0, TS), (STALE_NAN, TS + 1)], exemplars=1),
        series_v1({"namespace": "ml", "pod": "gone"}, [], histograms=3),
        metadata=True,
    )
    res = splicer.splice_v1(raw)
    assert res.body is raw
    assert res.counts == Counts(series=2, samples=2, histograms=3, exemplars=1)
    assert (res.attributed, res.unattributed) == (0, {"no_pod_label": 1, "pod_unknown": 1})


def test_counts_v2(splicer: Splicer) -> None:
    raw = request_v2({"a": "1"}, {"a": "2"}, histograms=1, exemplars=2)
    res = splicer.splice_v2(raw)
    assert res.body is raw
    assert res.counts == Counts(series=2, samples=4, histograms=2, exemplars=4)


def test_reasons_come_from_the_table(splicer: Splicer) -> None:
    splicer.table.set(b"ml", b"q", "no_described_owner")
    raw = request_v1(series_v1({"namespace": "ml", "pod": "q"}), series_v1(POD))
    res = splicer.splice_v1(raw)
    assert (res.attributed, res.unattributed) == (1, {"no_described_owner": 1})
    splicer.table.delete(b"ml", b"p")
    assert splicer.splice_v1(raw).unattributed == {"no_described_owner": 1, "pod_unknown": 1}


def test_labels_after_samples_are_still_found(splicer: Splicer) -> None:
    # valid protobuf: fields of a repeated message may come in any order
    ts = series_v1(POD)
    labels = b"".join(len_field(1, lb.SerializeToString()) for lb in ts.labels)
    sample = len_field(2, ts.samples[0].SerializeToString())
    raw = len_field(1, sample + labels)
    res = splicer.splice_v1(raw)
    (got,) = parse_v1(res.body).timeseries
    assert labels_of(got) == STAMPED_POD
    assert got.samples == ts.samples
    assert res.counts.samples == 1


def test_long_series_and_long_labels(splicer: Splicer) -> None:
    big = "v" * 20000  # label and series lengths need three-byte varints
    raw = request_v1(series_v1({**POD, "a": big, "b": "x" * 200}), series_v1(POD))
    first, second = parse_v1(splicer.splice_v1(raw).body).timeseries
    assert labels_of(first) == [("a", big), ("b", "x" * 200), *STAMPED_POD]
    assert labels_of(second) == STAMPED_POD


def test_unknown_fields_pass_through(splicer: Splicer) -> None:
    extra = len_field(15, b"future") + b"\xa0\x06\x01"  # field 100 varint
    inner = len_field(9, b"x")  # unknown field inside the series
    raw = len_field(1, series_v1(POD).SerializeToString() + inner) + extra
    out = splicer.splice_v1(raw).body
    assert out.endswith(inner + extra)
    assert labels_of(parse_v1(out).timeseries[0]) == STAMPED_POD


FORGED = {"karta_workload": "forged", "karta_extra": "x", "karta_kind": "Fake"}
KEEP_SENT = SplicePlan(pairs=PLAN.pairs, stamped=STAMPED, drop_sent=False)
KEEP_POLICY = SplicePlan(pairs=PLAN.pairs, stamped=STAMPED, keep_sent=True)


def test_sent_karta_labels_are_dropped_from_stamped_series(splicer: Splicer) -> None:
    raw = request_v1(series_v1({**POD, **FORGED}))
    res = splicer.splice_v1(raw)
    (got,) = parse_v1(res.body).timeseries
    assert labels_of(got) == STAMPED_POD
    assert (res.attributed, res.stripped) == (1, 1)


def test_exemplar_labels_pass_as_they_came_karta_ones_too(splicer: Splicer) -> None:
    """An exemplar's labels name a trace, not a series (docs/wire.md, "Label policy"): the
    drop of a sender's ``karta_*`` labels and the stamp are the series' only, in both
    protocols; its exemplars leave as they came."""
    ts = series_v1({**POD, **FORGED})
    ex = ts.exemplars.add(value=1.0, timestamp=TS)
    ex.labels.add(name="karta_workload", value="trace-side")
    ex.labels.add(name="trace_id", value="abc")
    (got,) = parse_v1(splicer.splice_v1(request_v1(ts)).body).timeseries
    assert labels_of(got) == STAMPED_POD
    assert got.exemplars == ts.exemplars

    req = parse_v2(request_v2({**POD, **FORGED}))
    req.symbols.append("trace-side")
    sent = req.timeseries[0].exemplars.add(value=1.0, timestamp=TS)
    sent.labels_refs.extend([list(req.symbols).index("karta_workload"), len(req.symbols) - 1])
    out = parse_v2(splicer.splice_v2(req.SerializeToString()).body)
    (one,) = out.timeseries
    assert labels_v2(out, one) == STAMPED_POD
    (back,) = one.exemplars
    refs = list(back.labels_refs)
    assert [out.symbols[r] for r in refs] == ["karta_workload", "trace-side"]
    assert (back.value, back.timestamp) == (1.0, TS)


def test_sender_karta_labels_keep_replaces_only_stamped_names(make_splicer: MakeSplicer
                                                              ) -> None:
    sp = make_splicer(KEEP_SENT)
    res = sp.splice_v1(request_v1(series_v1({**POD, **FORGED})))
    (got,) = parse_v1(res.body).timeseries
    assert labels_of(got) == [("karta_extra", "x"), *STAMPED_POD]
    assert res.stripped == 1  # the forged karta_workload was replaced
    unstamped = request_v1(series_v1({"a": "1", **FORGED}))
    res = sp.splice_v1(unstamped)
    assert res.body is unstamped and res.stripped == 0


@pytest.mark.parametrize("labels,reason", [
    ({"a": "1"}, "no_pod_label"),
    ({"namespace": "ml", "pod": "ghost"}, "pod_unknown"),
    ({"namespace": "ml", "pod": "q"}, "no_described_owner"),
    ({"namespace": "ml", "pod": "empty"}, ""),
])
def test_sent_karta_labels_are_dropped_from_unstamped_series_v1(
        make_splicer: MakeSplicer, labels: dict[str, str], reason: str) -> None:
    sp = make_splicer()
    sp.table.set(b"ml", b"q", "no_described_owner")
    sp.table.set(b"ml", b"empty", ())
    # labels after a sample and unsorted: they go out sorted, the data as it was
    ts = series_v1({})
    del ts.labels[:]
    sent = [*labels.items(), ("karta_workload", "victim"), ("b", "2"), ("karta_zz", "z")]
    for n, v in sent:
        ts.labels.add(name=n, value=v)
    inner = b"".join(len_field(1, lb.SerializeToString()) for lb in ts.labels)
    sample = len_field(2, ts.samples[0].SerializeToString())
    untouched = request_v1(series_v1({"x": "y"}))
    raw = untouched + len_field(1, sample + inner)
    res = sp.splice_v1(raw)
    _, got = parse_v1(res.body).timeseries
    assert res.body.startswith(untouched)
    assert labels_of(got) == sorted((n, v) for n, v in sent if not n.startswith("karta_"))
    assert got.samples == ts.samples
    assert res.stripped == 1
    expected = {"no_pod_label": 1}
    if reason:
        expected[reason] = expected.get(reason, 0) + 1
    assert (res.attributed, res.unattributed) == (0 if reason else 1, expected)


def test_sent_karta_labels_are_dropped_from_unstamped_series_v2(splicer: Splicer) -> None:
    raw = request_v2({"a": "1", "karta_workload": "victim", "karta_": "x"},
                     {"namespace": "ml", "pod": "ghost", "karta_kind": "Job"},
                     {"b": "2"})
    res = splicer.splice_v2(raw)
    req = parse_v2(res.body)
    assert [labels_v2(req, t) for t in req.timeseries] == [
        [("a", "1")], [("namespace", "ml"), ("pod", "ghost")], [("b", "2")]]
    before = parse_v2(raw)
    assert list(req.symbols) == list(before.symbols)  # the table keeps its strings
    # as bytes: a NaN sample equals itself only where protobuf compares messages by their
    # bytes (5.27 and later), not field by field (5.26, the bound)
    assert [[s.SerializeToString() for s in t.samples] for t in req.timeseries] == [
        [s.SerializeToString() for s in t.samples] for t in before.timeseries]
    assert res.stripped == 2
    # the untouched third series is the input's bytes
    assert res.body.endswith(before.timeseries[2].SerializeToString())


def test_keep_policy_lets_a_sent_workload_pass_and_drops_the_rest(make_splicer: MakeSplicer
                                                                  ) -> None:
    sp = make_splicer(KEEP_POLICY)
    chained = series_v1({**POD, "karta_workload": "from-first-proxy", "karta_kind": "K"})
    spoof = series_v1({"a": "1", "karta_kind": "K", "karta_workload": ""})
    res = sp.splice_v1(request_v1(chained, spoof))
    first, second = parse_v1(res.body).timeseries
    assert first.SerializeToString() == chained.SerializeToString()
    assert labels_of(second) == [("a", "1")]
    assert (res.attributed, res.stripped, res.unattributed) == (1, 1, {"no_pod_label": 1})
    raw2 = request_v2({**POD, "karta_workload": "from-first-proxy"}, {"a": "1", "karta_x": "y"})
    req = parse_v2(sp.splice_v2(raw2).body)
    assert [labels_v2(req, t) for t in req.timeseries] == [
        [("karta_workload", "from-first-proxy"), *POD.items()], [("a", "1")]]


def test_already_stamped_series_pass_through_byte_exact(splicer: Splicer) -> None:
    once = splicer.splice_v1(request_v1(series_v1(POD))).body
    again = splicer.splice_v1(once)
    assert again.body is once and again.attributed == 1


def test_unsorted_labels_are_sorted_when_stamped(splicer: Splicer) -> None:
    ts = series_v1({})
    del ts.labels[:]
    for n, v in (("pod", "p"), ("b", "2"), ("namespace", "ml"), ("a", "1")):
        ts.labels.add(name=n, value=v)
    (got,) = parse_v1(splicer.splice_v1(request_v1(ts)).body).timeseries
    assert [n for n, _ in labels_of(got)] == ["a", "b", "karta_workload", "namespace", "pod"]


def test_label_value_that_looks_like_a_sample_tail(splicer: Splicer) -> None:
    tricky = "x\x12\x07\x10abcdef"  # the last 9 bytes look like a 9-byte sample field
    raw = request_v1(series_v1({**POD, "a": tricky}, []))
    for _ in range(2):
        res = splicer.splice_v1(raw)
        assert res.counts.samples == 0
        assert labels_of(parse_v1(res.body).timeseries[0]) == [("a", tricky), *STAMPED_POD]


GARBAGE_V1 = [
    b"\x0a\x05abc",  # series longer than the body
    b"\x0a",  # truncated
    b"\x0b\x00",  # group start
    b"\x08",  # truncated varint field
    b"\xff" * 12,  # over-long varint
    b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint value
    b"\x00\x01",  # field number 0
    encode_uvarint(1 << 29 << 3) + b"\x00",  # field number 2^29
    b"\x0a\x04\x0a\x05ab",  # label longer than its series
    b"\x0a\x02\x08\x01",  # label field with a varint wire type
    b"\x08\x01",  # timeseries field with a varint wire type
    b"\x0a\x02\x10\x01",  # sample field with a varint wire type
    b"\x0a\x04\x0a\x02\x08\x01",  # label name with a varint wire type
]
#: a sample's bytes: value 1.0, then the timestamp's tag
_VALUE = b"\x09" + bytes(7) + b"\xf0"


def _stamped_series_v1(*data: bytes) -> bytes:
    """A series the table stamps, with these data fields: the splice copies them."""
    return len_field(1, series_v1(POD, []).SerializeToString() + b"".join(data))


#: payloads the splice copies without rewriting them, each refused as a protobuf reader
#: refuses it (docs/wire.md "Bad input")
BAD_PAYLOADS_V1 = {
    "11-byte varint timestamp": len_field(2, _VALUE + b"\x10" + b"\x80" * 10 + b"\x00"),
    "timestamp past 64 bits": len_field(2, _VALUE + b"\x10" + b"\xff" * 9 + b"\x02"),
    "sample field number 2^29": len_field(2, _VALUE + encode_uvarint(1 << 29 << 3) + b"\x00"),
    "sample value as varint": len_field(2, b"\x08\x01"),
    "sample timestamp as fixed64": len_field(2, _VALUE + b"\x11" + bytes(8)),
    "sample truncated": len_field(2, _VALUE[:5]),
    "histogram 11-byte varint": len_field(4, b"\x08" + b"\x80" * 10 + b"\x00"),
    "histogram group": len_field(4, b"\x43"),
    "histogram sum as varint": len_field(4, b"\x18\x01"),
    "histogram span as varint": len_field(4, b"\x58\x01"),
    "histogram span length as fixed32": len_field(4, len_field(11, b"\x08\x01\x15" + bytes(4))),
    "histogram span 11-byte varint": len_field(4, len_field(8, b"\x08" + b"\x80" * 10 + b"\x00")),
    "histogram packed deltas 11-byte varint": len_field(4, len_field(12, b"\x80" * 10 + b"\x00")),
    "histogram packed deltas truncated": len_field(4, len_field(9, b"\x02\x81")),
    "histogram deltas as fixed64": len_field(4, b"\x61" + bytes(8)),
    "histogram packed counts of 7 bytes": len_field(4, len_field(13, bytes(7))),
    "histogram count as fixed32": len_field(4, b"\x0d" + bytes(4)),
    "exemplar field number 0": len_field(3, b"\x00\x01"),
    "exemplar value as varint": len_field(3, b"\x10\x01"),
    "exemplar label as varint": len_field(3, b"\x08\x01"),
    "exemplar label name as varint": len_field(3, len_field(1, b"\x08\x01")),
}


@pytest.mark.parametrize("data", list(BAD_PAYLOADS_V1.values()), ids=list(BAD_PAYLOADS_V1))
@pytest.mark.parametrize("stamped", [True, False])
def test_garbage_in_copied_payloads_v1(splicer: Splicer, data: bytes, stamped: bool) -> None:
    raw = _stamped_series_v1(data) if stamped else len_field(1, data)
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(raw)
    assert (info.value.status, info.value.kind) == (400, "protobuf_invalid")


@pytest.mark.parametrize("where", ["name", "value"])
def test_invalid_utf8_in_an_exemplar_label(splicer: Splicer, where: str) -> None:
    label = _label(b"trace\xff", b"v") if where == "name" else _label(b"trace_id", b"\xed\xa0\x80")
    raw = _stamped_series_v1(len_field(3, label + b"\x11" + bytes(8)))
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(raw)
    assert (info.value.status, info.value.kind) == (400, "invalid_utf8")


def test_valid_payloads_pass_byte_exact(splicer: Splicer) -> None:
    """Unknown fields, non-minimal varints, start timestamps: valid, copied as they were."""
    sample = _VALUE + b"\x10" + b"\x81\x80\x80\x00" + len_field(9, b"x") + b"\x18\x05"
    exemplar = _label(b"trace_id", b"\xc3\xbc") + b"\x11" + bytes(8) + b"\x18\x01"
    # a histogram: deltas and counts packed and unpacked, a span, an unknown field
    histogram = (b"\x08\x01" + len_field(11, b"\x08\x03\x10\x02") + b"\x60\x04\x60\x01"
                 + len_field(13, bytes(16)) + b"\x69" + bytes(8) + b"\x88\x01\x02"
                 + len_field(16, bytes(8)) + b"\xa2\x01\x00")
    data = len_field(2, sample) + len_field(3, exemplar) + len_field(4, histogram)
    res = splicer.splice_v1(_stamped_series_v1(data))
    assert res.body.endswith(data)
    assert res.counts == Counts(series=1, samples=1, histograms=1, exemplars=1)


@pytest.mark.parametrize("labels", [
    [(b"a", b"1"), (b"a", b"2")],
    [(b"a", b"1"), (b"b", b"1"), (b"a", b"1")],
    [(b"", b"1")],
    [(b"", b"")],
])
@pytest.mark.parametrize("pod", [b"p", b"ghost", None])
def test_repeated_or_empty_label_names_are_refused(splicer: Splicer,
                                                   labels: list[tuple[bytes, bytes]],
                                                   pod: bytes | None) -> None:
    """In every series, stamped or not: a TSDB refuses them (Prometheus 2.42 with a 500,
    retried forever), and a stamp cannot choose between two values of a name."""
    pod_labels = [(b"namespace", b"ml"), (b"pod", pod)] if pod else []
    all_labels = [*labels, *pod_labels]
    raw = len_field(1, b"".join(_label(n, v) for n, v in all_labels))
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(raw)
    assert (info.value.status, info.value.kind) == (400, "invalid_labels")
    syms = sorted({s for nv in all_labels for s in nv} | {b""})
    ix = {s: i for i, s in enumerate(syms)}
    refs = bytes(ix[s] for nv in all_labels for s in nv)
    with pytest.raises(DecodeError) as info:
        splicer.splice_v2(_symbols(*syms) + len_field(5, len_field(1, refs)))
    assert (info.value.status, info.value.kind) == (400, "invalid_labels")


@pytest.mark.parametrize("raw", GARBAGE_V1)
def test_garbage_v1_is_a_decode_error(splicer: Splicer, raw: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(raw)
    assert (info.value.status, info.value.kind) == (400, "protobuf_invalid")


def _label(name: bytes, value: bytes) -> bytes:
    return len_field(1, len_field(1, name) + len_field(2, value))


@pytest.mark.parametrize(
    "bad",
    [b"\xff", b"\xe2\x82", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
     b"x" * 200 + b"\xff", b"\xe0\x80\xaf"],
)
@pytest.mark.parametrize("where", ["name", "value", "unattributed"])
def test_invalid_utf8_is_a_decode_error(splicer: Splicer, bad: bytes, where: str) -> None:
    labels = _label(b"namespace", b"ml") + _label(b"pod", b"p" if where != "unattributed"
                                                 else b"nobody")
    labels += _label(b"id" + bad, b"v") if where == "name" else _label(b"id", bad)
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(len_field(1, labels))
    assert (info.value.status, info.value.kind) == (400, "invalid_utf8")


def test_invalid_utf8_cannot_hide_behind_framing_bytes(splicer: Splicer) -> None:
    # name ends with E2 82, then an unknown field 37 (varint) whose tag starts A8: "₨"
    unknown = bytes([0xA8, 0x02, 0x00])
    label = len_field(1, b"ab\xe2\x82") + unknown + len_field(2, b"v")
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(len_field(1, len_field(1, label)))
    assert info.value.kind == "invalid_utf8"


def test_valid_multibyte_and_replacement_characters_pass(splicer: Splicer) -> None:
    raw = request_v1(series_v1({**POD, "a": "é€😀" + "x" * 300, "b": "\ufffd"}))
    (got,) = parse_v1(splicer.splice_v1(raw).body).timeseries
    assert dict(labels_of(got))["b"] == "\ufffd"


@pytest.mark.parametrize(
    "raw",
    [
        b"\x22\x01\xff",  # a symbol that is not UTF-8
        b"\x22\x01a",  # symbols not starting with ""
        b"\x22\x00\x2a\x04\x0a\x02\x00\x05",  # ref past the table
        b"\x22\x00\x2a\x03\x0a\x01\x00",  # odd number of refs
        b"\x2a\x05\x0a",  # truncated
        b"\x20\x01",  # symbols with a varint wire type
        # sample with a varint wire type, after a valid series (a label: one with none is
        # invalid_labels)
        b"\x22\x00\x22\x01a\x2a\x06\x0a\x02\x01\x01\x12\x00\x2a\x02\x10\x01",
        # the payloads the splice copies
        # exemplar ref past the table (it ended in a field number 0, refused for that)
        b"\x22\x00\x2a\x06\x22\x04\x0a\x02\x00\x01",
        b"\x22\x00\x2a\x05\x22\x03\x0a\x01\x00",  # exemplar refs odd (packed)
        b"\x22\x00\x2a\x04\x22\x02\x08\x00",  # exemplar refs unpacked, odd
        b"\x22\x00\x2a\x04\x2a\x02\x18\x01",  # metadata help_ref past the table
        b"\x22\x00\x2a\x04\x2a\x02\x20\x05",  # metadata unit_ref past the table
        b"\x22\x00\x2a\x04\x2a\x02\x19\x00",  # metadata help_ref as fixed64 (cut)
        b"\x22\x00\x2a\x05\x2a\x03\x08\x80\x80",  # metadata type truncated
        b"\x22\x00\x2a\x0e\x12\x0c" + _VALUE + b"\x10" + b"\x80\x80",  # cut sample
        # start_timestamp an 11-byte varint (its last byte was outside the series: a
        # top-level field number 0, refused for that)
        b"\x22\x00\x2a\x17\x12\x15" + _VALUE + b"\x18" + b"\x80" * 10 + b"\x00",
        b"\x22\x00\x2a\x04\x1a\x02\x00\x00",  # histogram field number 0
    ],
)
def test_garbage_v2_is_a_decode_error(splicer: Splicer, raw: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        splicer.splice_v2(raw)
    assert info.value.status == 400
    assert info.value.kind == ("invalid_utf8" if raw == b"\x22\x01\xff" else "protobuf_invalid")


def test_v2_payload_refs_inside_the_table_pass(splicer: Splicer) -> None:
    syms = _symbols(b"", b"namespace", b"ml", b"pod", b"p", b"trace_id", b"abc")
    exemplar = len_field(4, len_field(1, b"\x05\x06") + b"\x11" + bytes(8))
    metadata = len_field(5, b"\x08\x02\x18\x06\x20\x05")
    raw = syms + len_field(5, len_field(1, b"\x01\x02\x03\x04") + exemplar + metadata)
    res = splicer.splice_v2(raw)
    assert res.attributed == 1 and res.body.endswith(exemplar + metadata)


def _symbols(*syms: bytes) -> bytes:
    return b"".join(len_field(4, s) for s in syms)


def test_v2_unpacked_refs_accepted(splicer: Splicer) -> None:
    # labels_refs sent one varint at a time (legal protobuf for a packed field)
    raw = _symbols(b"", b"namespace", b"ml", b"pod", b"p") + len_field(
        5, b"\x08\x01\x08\x02\x08\x03\x08\x04")
    res = splicer.splice_v2(raw)
    assert (res.counts.series, res.counts.samples, res.attributed) == (1, 0, 1)
    # the stamp sorts first; its strings are appended; the refs re-encoded packed
    assert res.body == (_symbols(b"", b"namespace", b"ml", b"pod", b"p", b"karta_workload", b"w")
                        + len_field(5, len_field(1, b"\x05\x06\x01\x02\x03\x04")))


def test_v2_multibyte_refs_and_existing_symbols(splicer: Splicer) -> None:
    syms = [b"", *(b"s%d" % i for i in range(300)), b"namespace", b"ml", b"pod", b"p", b"w"]
    ix = {s: i for i, s in enumerate(syms)}
    refs = [ix[b"s5"], ix[b"s200"], ix[b"namespace"], ix[b"ml"], ix[b"pod"], ix[b"p"]]
    sample = len_field(2, b"\x09" + b"\x00" * 8)
    raw = _symbols(*syms) + len_field(
        5, len_field(1, b"".join(encode_uvarint(r) for r in refs)) + sample)
    res = splicer.splice_v2(raw)
    req = parse_v2(res.body)
    assert labels_v2(req, req.timeseries[0]) == [*STAMPED_POD, ("s5", "s200")]  # sorted
    # "w" was in the table already: only "karta_workload" is appended
    assert list(req.symbols[len(syms):]) == ["karta_workload"]
    assert res.body.endswith(sample)


def test_v2_symbols_go_after_the_last_symbols_field(splicer: Splicer) -> None:
    series = len_field(5, len_field(1, bytes([1, 2, 3, 4])))
    raw = _symbols(b"", b"namespace", b"ml") + series + _symbols(b"pod", b"p") + series
    res = splicer.splice_v2(raw)
    req = parse_v2(res.body)
    assert [labels_v2(req, t) for t in req.timeseries] == [STAMPED_POD, STAMPED_POD]
    assert list(req.symbols) == ["", "namespace", "ml", "pod", "p", "karta_workload", "w"]


def test_v2_untouched_is_byte_exact(splicer: Splicer) -> None:
    raw = request_v2({"namespace": "ml", "pod": "ghost"}, {"a": "b"})
    res = splicer.splice_v2(raw)
    assert res.body is raw
    assert res.unattributed == {"pod_unknown": 1, "no_pod_label": 1}


def test_v2_sent_stamped_labels_replaced(splicer: Splicer) -> None:
    raw = request_v2({**POD, "karta_workload": "forged", "karta_instance": "x"})
    req = parse_v2(splicer.splice_v2(raw).body)
    assert labels_v2(req, req.timeseries[0]) == STAMPED_POD


def test_a_stamp_of_many_labels_in_sorted_position(make_splicer: MakeSplicer) -> None:
    sp = make_splicer(KEEP_SENT)  # a sender's karta_z kept: it falls inside the block
    stamp = (("karta_workload", "w"), ("karta_component", "c"), ("karta_kind", "K"))
    sp.table.set(b"ml", b"p", stamp)
    raw = request_v1(series_v1({**POD, "__name__": "m", "karta": "a", "karta_z": "z"}))
    (got,) = parse_v1(sp.splice_v1(raw).body).timeseries
    assert [n for n, _ in labels_of(got)] == [
        "__name__", "karta", "karta_component", "karta_kind", "karta_workload", "karta_z",
        "namespace", "pod"]
    assert encode_label_v1(b"karta_kind", b"K") in sp.splice_v1(raw).body
    assert b"karta_kind" in STAMPED


@pytest.mark.parametrize("sent", [
    {"karta_a": "x"}, {"karta_zz": "x"}, {"jz": "1", "karta_zz": "x"}, {"karta_": ""},
])
@pytest.mark.parametrize("extra_stamp", [(), (("job", "j"),)])
def test_sent_karta_labels_next_to_the_block_or_not_are_dropped(
        make_splicer: MakeSplicer, sent: dict[str, str],
        extra_stamp: tuple[tuple[str, str], ...]) -> None:
    """The native splice looks for a sorted series' karta_ labels next to the stamp's
    block only when every stamp name starts with karta_; a stamp of another name (not
    the contract's, but a table may hold one) makes it scan: dropped either way."""
    sp = make_splicer()
    sp.table.set(b"ml", b"p", (("karta_workload", "w"), *extra_stamp))
    raw = request_v1(series_v1({**POD, "a": "1", **sent}))
    res = sp.splice_v1(raw)
    (got,) = parse_v1(res.body).timeseries
    assert labels_of(got) == sorted([("a", "1"), *extra_stamp, *STAMPED_POD]
                                    + [(n, v) for n, v in sent.items() if n == "jz"])
    assert res.stripped == 1
    req = parse_v2(sp.splice_v2(request_v2({**POD, "a": "1", **sent})).body)
    assert labels_v2(req, req.timeseries[0]) == labels_of(got)


def test_unsorted_labels_of_an_unstamped_series_go_out_sorted(splicer: Splicer) -> None:
    # a sender that does not sort: Prometheus sorts on ingest, so the proxy must not
    # refuse it, and what it forwards is valid RW (names sorted)
    ts = series_v1({})
    del ts.labels[:]
    for n, v in [("job", "a"), ("__name__", "up"), ("instance", "x")]:
        ts.labels.add(name=n, value=v)
    raw = request_v1(ts)
    res = splicer.splice_v1(raw)
    (got,) = parse_v1(res.body).timeseries
    assert labels_of(got) == [("__name__", "up"), ("instance", "x"), ("job", "a")]
    assert got.samples == ts.samples and res.stripped == 0


def test_unsorted_refs_of_an_unstamped_v2_series_go_out_sorted(splicer: Splicer) -> None:
    raw = request_v2({"__name__": "up", "job": "a"})
    req = parse_v2(raw)
    refs = list(req.timeseries[0].labels_refs)
    del req.timeseries[0].labels_refs[:]
    req.timeseries[0].labels_refs.extend(refs[2:] + refs[:2])  # job first
    res = splicer.splice_v2(req.SerializeToString())
    out = parse_v2(res.body)
    assert labels_v2(out, out.timeseries[0]) == [("__name__", "up"), ("job", "a")]


def test_a_v2_body_under_the_v1_content_type_is_refused(splicer: Splicer) -> None:
    raw = request_v2({"__name__": "up", "namespace": "ml", "pod": "p"})
    with pytest.raises(DecodeError) as info:
        splicer.splice_v1(raw)
    assert (info.value.kind, info.value.status) == ("protocol_mismatch", 400)


def test_a_v1_body_under_the_v2_content_type_is_refused(splicer: Splicer) -> None:
    raw = request_v1(series_v1(POD))
    with pytest.raises(DecodeError) as info:
        splicer.splice_v2(raw)
    assert (info.value.kind, info.value.status) == ("protocol_mismatch", 400)


# -- series the TSDB would refuse for having no labels --------------------------------

ONLY_KARTA = {"karta_workload": "x", "karta_zz": "y"}


def _refused(call: object) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        assert callable(call)
        call()
    return info.value


def test_a_series_of_only_karta_labels_is_refused_not_forwarded_empty(splicer: Splicer
                                                                      ) -> None:
    """sender_karta_labels: drop would leave it with no labels: Prometheus answers 500
    "empty labelset", the proxy 502, and the sender retries the batch (its innocent series
    with it) forever. 400 invalid_labels instead, in both protocols, naming the policy."""
    innocent = series_v1({"namespace": "ml", "pod": "p"})
    for err in (
        _refused(lambda: splicer.splice_v1(request_v1(innocent, series_v1(ONLY_KARTA)))),
        _refused(lambda: splicer.splice_v2(request_v2(POD, ONLY_KARTA))),
    ):
        assert (err.kind, err.status) == ("invalid_labels", 400)
        assert "sender_karta_labels: drop" in str(err)


@pytest.mark.parametrize("labels", [
    {"karta_workload": "x", "foo": ""},
    {"__name__": "", "karta_workload": "x"},
    {"__name__": "", "a": "", "karta_zz": "y", "zz": ""},
])
def test_a_series_of_karta_labels_and_empty_values_is_refused(splicer: Splicer,
                                                               labels: dict[str, str]
                                                               ) -> None:
    """A label with an empty value is no label to Prometheus: once the drop took the
    karta_* ones, ``{karta_workload="x", foo=""}`` reached Prometheus 2.42 as an empty label
    set, 500 "empty labelset", the proxy 502, the sender's batch of 999 good series retried
    forever (the audit's t10). Refused 400 as a series of only karta_* labels is."""
    innocent = series_v1(POD)
    for err in (
        _refused(lambda: splicer.splice_v1(request_v1(innocent, series_v1(labels)))),
        _refused(lambda: splicer.splice_v2(request_v2(POD, labels))),
    ):
        assert (err.kind, err.status) == ("invalid_labels", 400)
        assert "no labels with a value" in str(err)


def test_empty_values_the_drop_does_not_touch_pass_as_sent(splicer: Splicer) -> None:
    """A series of only empty values and no karta_* label is the sender's, as it would be
    sent straight to the TSDB: the proxy leaves it alone (the check runs where a label was
    dropped); one with a value next to the dropped karta_* passes without them."""
    raw1 = request_v1(series_v1({"foo": ""}))
    assert splicer.splice_v1(raw1).body is raw1
    raw2 = request_v2({"foo": ""})
    assert splicer.splice_v2(raw2).body is raw2
    kept = {"a": "", "b": "1", "karta_workload": "x"}
    (got,) = parse_v1(splicer.splice_v1(request_v1(series_v1(kept))).body).timeseries
    assert labels_of(got) == [("a", ""), ("b", "1")]
    out = parse_v2(splicer.splice_v2(request_v2(kept)).body)
    assert labels_v2(out, out.timeseries[0]) == [("a", ""), ("b", "1")]


def test_only_karta_labels_pass_where_nothing_drops_them(make_splicer: MakeSplicer) -> None:
    """``keep`` of the sender's karta_* labels, or conflict_policy keep with a
    karta_workload: the series keeps its labels, so it is valid and passes unchanged."""
    for plan in (KEEP_SENT, KEEP_POLICY):
        sp = make_splicer(plan)
        raw1 = request_v1(series_v1(ONLY_KARTA))
        assert sp.splice_v1(raw1).body is raw1
        raw2 = request_v2(ONLY_KARTA)
        assert sp.splice_v2(raw2).body is raw2
    # conflict_policy keep without a karta_workload: dropped, so refused
    sp = make_splicer(KEEP_POLICY)
    err = _refused(lambda: sp.splice_v1(request_v1(series_v1({"karta_kind": "Job"}))))
    assert err.kind == "invalid_labels"


def test_a_series_with_no_labels_is_refused(splicer: Splicer) -> None:
    """Prometheus answers 500 to a series with no labels too (sent straight or through the
    proxy): refused 400 like an empty label name."""
    ts = series_v1({})
    del ts.labels[:]
    for err in (_refused(lambda: splicer.splice_v1(request_v1(series_v1(POD), ts))),
                _refused(lambda: splicer.splice_v2(request_v2(POD, {})))):
        assert (err.kind, err.status, str(err)) == (
            "invalid_labels", 400,
            "a series with no labels (series 1 of the request, no __name__)")


def test_the_first_defect_answers_when_a_later_series_has_another(splicer: Splicer) -> None:
    """The native 1.0 splice reads series ahead of the one it stamps: a series left empty
    by the drop must still be the answer when a series right after it is invalid in
    another way, as the reference (one series at a time) answers."""
    bad_utf8 = len_field(1, encode_label_v1(b"a", b"\xff"))
    raw = request_v1(series_v1(POD), series_v1(ONLY_KARTA)) + bad_utf8
    assert _refused(lambda: splicer.splice_v1(raw)).kind == "invalid_labels"
    raw = request_v1(series_v1(POD), series_v1({"a": "1"})) + bad_utf8
    assert _refused(lambda: splicer.splice_v1(raw)).kind == "invalid_utf8"


# -- the TSDB's label limit ---------------------------------------------------------------

#: a stamp of three labels: with namespace and pod, a pod's series has 5 labels and more
STAMP3 = (("karta_kind", "Job"), ("karta_namespace", "ml"), ("karta_workload", "w"))


def _limited(make_splicer: MakeSplicer, limit: int) -> Splicer:
    sp = make_splicer(dataclasses.replace(PLAN, max_labels=limit))
    sp.table.set(b"ml", b"p", STAMP3)
    return sp


def _labels(n: int, **more: str) -> dict[str, str]:
    """A pod's series of ``n`` labels (namespace, pod and a00...) and ``more``."""
    return {**POD, **{f"a{i:02d}": "v" for i in range(n - 2)}, **more}


def _out(sp: Splicer, version: int, labels: dict[str, str]
         ) -> tuple[list[tuple[str, str]], SpliceResult]:
    """Version 1, 2, or 0: RW 1.0 through ``splice_snappy`` (the path of a snappy request
    to a snappy upstream, the common one)."""
    if version == 0:
        raw = request_v1(series_v1(labels))
        res = sp.splice_snappy(Protocol.V1, raw, snappy.compress(raw))
        # a snappy block either way (the native edit's, or compressed again)
        return labels_of(parse_v1(snappy.uncompress(res.body)).timeseries[0]), res
    if version == 1:
        res = sp.splice_v1(request_v1(series_v1(labels)))
        return labels_of(parse_v1(res.body).timeseries[0]), res
    res = sp.splice_v2(request_v2(labels))
    out = parse_v2(res.body)
    return labels_v2(out, out.timeseries[0]), res


@pytest.mark.parametrize("version", [0, 1, 2])
def test_a_series_the_stamp_brings_to_the_limit_is_stamped(make_splicer: MakeSplicer,
                                                           version: int) -> None:
    sp = _limited(make_splicer, 8)
    got, res = _out(sp, version, _labels(5))
    assert len(got) == 8 and ("karta_workload", "w") in got
    assert (res.attributed, res.unattributed, res.label_limited) == (1, {}, None)


@pytest.mark.parametrize("version", [0, 1, 2])
def test_a_series_the_stamp_would_push_past_the_limit_goes_unstamped(
        make_splicer: MakeSplicer, version: int) -> None:
    """VictoriaMetrics at -maxLabelsPerTimeseries drops the labels that sort last, so
    series that differ only in those merge (samples lost behind a 204); Mimir refuses the
    whole request. One label over with the stamp: forwarded as sent, counted label_limit,
    its __name__ and count kept for the log line."""
    sp = _limited(make_splicer, 8)
    labels = _labels(5, __name__="gpu_util")
    got, res = _out(sp, version, labels)
    assert got == sorted(labels.items())
    assert (res.attributed, res.unattributed) == (0, {"label_limit": 1})
    assert res.label_limited == LabelLimited(b"gpu_util", 9, 8)


@pytest.mark.parametrize("version", [0, 1, 2])
def test_the_labels_the_stamp_replaces_do_not_count(make_splicer: MakeSplicer,
                                                    version: int) -> None:
    """The sender's karta_* labels are dropped before the stamp goes in: a series sent at
    the limit with two of them is within it stamped (7 - 2 + 3); with an empty __name__
    and over the limit, it is forwarded without the stamp and without the sender's
    karta_* labels (no forgery gets through), and the log names no metric."""
    sp = _limited(make_splicer, 8)
    sent = _labels(5, karta_workload="forged", karta_zz="x")
    got, res = _out(sp, version, sent)
    assert len(got) == 8 and ("karta_workload", "w") in got and ("karta_zz", "x") not in got
    assert res.attributed == 1
    sent = _labels(7, karta_workload="forged")
    got, res = _out(sp, version, sent)
    assert got == sorted(_labels(7).items())
    assert (res.unattributed, res.stripped) == ({"label_limit": 1}, 1)
    assert res.label_limited == LabelLimited(b"", 10, 8)


@pytest.mark.parametrize("version", [0, 1, 2])
def test_a_series_sent_past_the_limit_goes_unstamped(make_splicer: MakeSplicer,
                                                     version: int) -> None:
    """Past the limit as sent: unstamped too, as the sender sent it (the stamp would push
    more of its own labels past what the TSDB keeps); 0 is no limit."""
    got, res = _out(_limited(make_splicer, 8), version, _labels(9))
    assert len(got) == 9 and res.attributed == 0 and res.label_limited is not None
    got, res = _out(_limited(make_splicer, 0), version, _labels(9))
    assert len(got) == 12 and res.attributed == 1 and res.label_limited is None


def test_a_request_in_parts_keeps_its_first_label_limited_series() -> None:
    first, second = (SpliceResult(b"", Counts(), label_limited=LabelLimited(m, 9, 8))
                     for m in (b"a", b"b"))
    whole = SpliceResult(b"", Counts())
    whole.add(first)
    whole.add(second)
    assert whole.label_limited == LabelLimited(b"a", 9, 8)


# -- a refusal names its series -------------------------------------------------------------

#: a request of good series, the bad one at index 2
GOOD = [{"__name__": f"good_{i}", **POD} for i in range(4)]


def _bad_v1(bad: bytes) -> bytes:
    return request_v1(*(series_v1(s) for s in GOOD[:2])) + bad + request_v1(
        *(series_v1(s) for s in GOOD[2:]))


@pytest.mark.parametrize(("bad", "message"), [
    (_label(b"__name__", b"up") + _label(b"a", b"x\xffy"),
     'label value is not valid UTF-8: "x\\xffy" (series 2 of the request, __name__ "up")'),
    (_label(b"__name__", b"up") + _label(b"a", b"1") + _label(b"a", b"2"),
     'label name "a" repeated in one series (series 2 of the request, __name__ "up")'),
    (_label(b"", b"v") + _label(b"__name__", b"up"),
     'a label with an empty name (series 2 of the request, __name__ "up")'),
    (_label(b"__name__", b"") + _label(b"karta_workload", b"x"),
     f'{NO_LABELS_LEFT} (series 2 of the request, __name__ "")'),
    (_label(b"job", b"") + _label(b"karta_zz", b"x"),
     f"{NO_LABELS_LEFT} (series 2 of the request, no __name__)"),
    # invalid UTF-8 in the name itself, and one past SHOWN bytes: escaped, cut
    (_label(b"__name__", b"\xc0\xafm\"\\") + _label(b"b", b"\xff"),
     'label value is not valid UTF-8: "\\xc0\\xafm\\x22\\x5c" (series 2 of the request, '
     '__name__ "\\xc0\\xafm\\x22\\x5c")'),
    (_label(b"__name__", "ü".encode() + b"n" * 70) + _label(b"c", b"1") + _label(b"c", b"1"),
     'label name "c" repeated in one series (series 2 of the request, '
     f'__name__ "\\xc3\\xbc{"n" * 62}...")'),
])
def test_a_refusal_names_the_series_rw1(splicer: Splicer, bad: bytes, message: str) -> None:
    """"label value is not valid UTF-8" alone left an operator to find the culprit among
    2,000 series: the refusal says its index in the request and its __name__, shown
    escaped and cut, the same text from both splices."""
    err = _refused(lambda: splicer.splice_v1(_bad_v1(len_field(1, bad))))
    assert (err.status, err.message) == (400, message)


@pytest.mark.parametrize(("bad", "message"), [
    ({"__name__": "", "karta_workload": "x", "a": ""},
     f'{NO_LABELS_LEFT} (series 2 of the request, __name__ "")'),
    ({"karta_workload": "x", "a": ""}, f"{NO_LABELS_LEFT} (series 2 of the request, no __name__)"),
    ({}, "a series with no labels (series 2 of the request, no __name__)"),
])
def test_a_refusal_names_the_series_rw2(splicer: Splicer, bad: dict[str, str],
                                        message: str) -> None:
    err = _refused(lambda: splicer.splice_v2(request_v2(*GOOD[:2], bad, *GOOD[2:])))
    assert (err.status, err.message) == (400, message)


def test_a_repeated_name_in_rw2_and_a_bad_symbol_are_named(splicer: Splicer) -> None:
    """A repeated name is the series' (named); a symbol that is not UTF-8 may be any
    series', so its refusal shows the symbol and its index in the table."""
    raw = request_v2(*GOOD[:2], {"__name__": "up", "a": "1"}, symbols=["", "a", "1"])
    req = parse_v2(raw)
    req.timeseries[2].labels_refs.extend([1, 2])  # a="1" again
    err = _refused(lambda: splicer.splice_v2(req.SerializeToString()))
    assert err.message == 'label name "a" repeated in one series (series 2 of the request, ' \
                          '__name__ "up")'
    bad = request_v2(*GOOD, symbols=["", "x\xff"]).replace("x\xff".encode(), b"x\xff\xfe")
    err = _refused(lambda: splicer.splice_v2(bad))
    assert err.message == 'symbol 1 is not valid UTF-8: "x\\xff\\xfe"'


def test_a_part_of_a_request_names_its_series_by_the_index_in_the_whole(
        implementation: str) -> None:
    """The handler splices a big RW 1.0 request in parts, each counting its series from 0:
    a refused part's series is named by its index in the request all the same."""
    sp = Splicer(PLAN, implementation)  # type: ignore[arg-type]
    good = [series_v1({"__name__": f"m{i}", "a": "x" * 50}).SerializeToString()
            for i in range(40)]
    bad = _label(b"__name__", b"bad") + _label(b"a", b"\xff")
    raw = b"".join(len_field(1, s) for s in good[:30]) + len_field(1, bad) + b"".join(
        len_field(1, s) for s in good[30:])
    cuts = split_v1(raw, 4)
    assert cuts and cuts[0] < raw.index(bad)  # the bad series is in a later part

    def part(piece: bytes | memoryview, whole: bytes, base: int) -> SpliceResult:
        return sp.splice_snappy(Protocol.V1, piece, whole, base)

    with ThreadPoolExecutor(1) as pool, pytest.raises(DecodeError) as info:
        splice_in_parts(raw, snappy.compress(raw), cuts, part, pool)
    whole = _refused(lambda: sp.splice_v1(raw))
    assert info.value.message == whole.message == (
        'label value is not valid UTF-8: "\\xff" (series 30 of the request, __name__ "bad")')


CLUSTER_PLAN = dataclasses.replace(PLAN, cluster=(b"cluster", b"c1"))


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
def test_a_series_of_another_cluster_is_not_stamped(make_splicer: MakeSplicer,
                                                    protocol: Protocol) -> None:
    """The cluster check (``enrich.cluster_label``): a series naming this cluster, or none
    (no label, an empty value), is stamped; one naming another is forwarded unstamped as
    ``other_cluster``, its sender's ``karta_*`` labels dropped all the same, and the first
    such value of the request is reported. Without the check, the same series is stamped
    (the forgery the check closes: this cluster's pod charged to c2's workload)."""
    series = [{**POD, "cluster": "c1"}, {**POD, "cluster": "c2", "karta_workload": "forged"},
              {**POD, "cluster": ""}, POD, {**POD, "cluster": "c3"}]
    raw = request_v1(*map(series_v1, series)) if protocol is Protocol.V1 \
        else request_v2(*series)
    sp = make_splicer(CLUSTER_PLAN)
    res = sp.splice_v1(raw) if protocol is Protocol.V1 else sp.splice_v2(raw)
    if protocol is Protocol.V1:
        got = [labels_of(t) for t in parse_v1(res.body).timeseries]
    else:
        req = parse_v2(res.body)
        got = [labels_v2(req, t) for t in req.timeseries]
    stamp = ("karta_workload", "w")
    assert got == [
        [("cluster", "c1"), stamp, *POD.items()],
        [("cluster", "c2"), *POD.items()],
        [("cluster", ""), stamp, *POD.items()],
        [stamp, *POD.items()],
        [("cluster", "c3"), *POD.items()],
    ]
    assert (res.attributed, res.unattributed, res.stripped, res.other_cluster) == (
        3, {"other_cluster": 2}, 1, b"c2")
    unchecked = make_splicer()
    res = unchecked.splice_v1(raw) if protocol is Protocol.V1 else unchecked.splice_v2(raw)
    assert (res.attributed, res.unattributed, res.other_cluster) == (5, {}, None)


def test_keep_trusts_a_sent_workload_before_the_cluster_check(make_splicer: MakeSplicer
                                                              ) -> None:
    """Under ``keep`` a series carrying its own ``karta_workload`` passes as it came,
    whatever its cluster (the policy trusts the sender's attribution); one without goes
    through the check."""
    sp = make_splicer(dataclasses.replace(KEEP_POLICY, cluster=(b"cluster", b"c1")))
    chained = series_v1({**POD, "cluster": "c2", "karta_workload": "from-c2"})
    other = series_v1({**POD, "cluster": "c2", "karta_kind": "K"})
    res = sp.splice_v1(request_v1(chained, other))
    first, second = parse_v1(res.body).timeseries
    assert first.SerializeToString() == chained.SerializeToString()
    assert labels_of(second) == [("cluster", "c2"), *POD.items()]
    assert (res.attributed, res.unattributed, res.other_cluster) == (
        1, {"other_cluster": 1}, b"c2")


@pytest.mark.parametrize("cluster", [(b"", b"c1"), (b"cluster", b""), (b"karta_cluster", b"c"),
                                     (b"__name__", b"c")])
def test_a_cluster_check_without_a_label_or_a_value_is_refused(cluster: tuple[bytes, bytes]
                                                               ) -> None:
    with pytest.raises(ValueError, match="cluster"):
        dataclasses.replace(PLAN, cluster=cluster)
    if not native_available():
        return
    from proxy.wire import _splice

    with pytest.raises(ValueError, match="cluster"):
        _splice.Plan([(b"namespace", b"pod", [])], [], False, [], b"karta_workload", True, 0,
                     cluster)
