"""RW 2.0 -> 1.0 conversion for 1.0-only upstreams."""

from __future__ import annotations

import math
import random
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from proxy.compression import DecodeError
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2, types_pb2
from proxy.sender import Series, build_v1, build_v2
from proxy.wire import conversion
from proxy.wire.convert import (
    QUIET_NAN_BITS,
    ConversionTooLarge,
    WithoutHistograms,
    check_size,
    format_le,
    v1_form,
    v2_to_v1,
    without_histograms,
)
from proxy.wire.primitives import encode_uvarint, len_field
from tests.upstream_proto import upstream_v1
from tests.wire_fixtures import (
    STALE_NAN,
    TS,
    amplifying_v2,
    is_stale,
    labels_of,
    parse_v1,
    request_v2,
)

RequestV2: Any = cast(Any, v2).Request
WriteRequest: Any = cast(Any, remote_pb2).WriteRequest


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
    # start_timestamp left out: test_v2_to_v1_leaves_out_start_and_created_timestamps_...


def test_v2_to_v1_parses_with_upstream_protos(tmp_path: Path) -> None:
    up = upstream_v1(tmp_path)
    raw = request_v2({"__name__": "g", "pod": "p"}, histograms=2, exemplars=1, metadata=True)
    req = up["prometheus.WriteRequest"]()
    req.ParseFromString(v2_to_v1(raw))
    assert len(req.timeseries) == 1
    assert len(req.timeseries[0].histograms) == 2
    # nothing unknown to upstream left over
    assert req.SerializeToString() == v2_to_v1(raw)


@pytest.mark.parametrize("convert", [v2_to_v1, conversion.v2_to_v1], ids=["reference", "run"])
def test_v2_to_v1_leaves_out_start_and_created_timestamps_and_nothing_else(
        convert: Callable[[bytes], bytes]) -> None:
    """RW 1.0 has no field for a sample's or a histogram's ``start_timestamp`` (3, 17) nor
    for rc.3's ``created_timestamp`` (6 on the series): the 1.0 request is the one a 1.0
    sender writes with the same data, byte for byte. A 1.0 receiver's classes keep unknown
    fields, so parsing the output with them (``test_v2_to_v1_parses_with_upstream_protos``)
    does not tell; nor does a search of its bytes for the field's name."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "g"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2])
    ts.samples.add(value=2.5, timestamp=TS, start_timestamp=TS - 1000)
    h = ts.histograms.add(count_float=2.0, sum=1.0, schema=0, timestamp=TS,
                          start_timestamp=TS - 5)
    h.positive_spans.add(offset=0, length=1)
    h.positive_counts.append(2.0)
    series = ts.SerializeToString() + b"\x30" + encode_uvarint(TS - 7)  # created_timestamp
    raw = len_field(4, b"") + len_field(4, b"__name__") + len_field(4, b"g") + len_field(
        5, series)
    expected = WriteRequest()
    one = expected.timeseries.add()
    one.labels.add(name="__name__", value="g")
    one.samples.add(value=2.5, timestamp=TS)
    hv1 = one.histograms.add(count_float=2.0, sum=1.0, schema=0, timestamp=TS)
    hv1.positive_spans.add(offset=0, length=1)
    hv1.positive_counts.append(2.0)
    assert convert(raw) == expected.SerializeToString()


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


def _many_kinds() -> list[bytes]:
    meta = [Series({"__name__": f"rpc_seconds{s}", "pod": "p", "e": ""}, [(TS, 1.0)],
                   metric_type="histogram", help="latency" * 40, unit="seconds")
            for s in ("_bucket", "_sum", "_count")]
    tall = RequestV2()
    tall.symbols.extend(["", "__name__", "m", "v" * 300, "w" * 20000])
    ts = tall.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4, 4, 3, 3, 0])
    ex = ts.exemplars.add(value=1.0, timestamp=TS)
    ex.labels_refs.extend([3, 4, 4, 0])
    ts.samples.add(value=1.0, timestamp=TS, start_timestamp=TS - 1)
    return [request_v2(), request_v2({"__name__": "g"}),
            request_v2({"__name__": "g", "pod": "p"}, {"__name__": "h", "x": "y" * 200},
                       histograms=3, exemplars=2, metadata=True),
            build_v2(meta), cast(bytes, tall.SerializeToString()),
            amplifying_v2(1000, 50), amplifying_v2(127, 3), amplifying_v2(16384, 2),
            nhcb_v2({"count_float": 6, "sum": 4.0, "positive_counts": [2.0, 3.0, 1.0],
                     "custom_values": [0.1, 1.0]}, samples=1, extra_labels=3),
            nhcb_v2({"count_int": 3, "sum": 4.0, "positive_deltas": [1, 1],
                     "spans": [(0, 1), (2, 1)], "custom_values": [0.1, 1.0, 1e-9],
                     "timestamp": -5}),
            *(marked(*kinds) for kinds in (("nhcb", "marker"), ("marker",),
                                           ("exponential", "marker"), ("nhcb", "nhcb_marker"),
                                           ("nhcb_marker",)))]


def marked(*kinds: str) -> bytes:
    """One series of histograms ending in staleness markers, of these kinds: custom-bucket
    data (``nhcb``), exponential data, Prometheus' marker (``marker``: schema 0, no buckets)
    and a custom-bucket marker with no bounds (``nhcb_marker``)."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "rpc_seconds", "pod", "p"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4])
    for i, kind in enumerate(kinds):
        at = TS + 1000 * i
        if kind == "nhcb":
            h = ts.histograms.add(count_float=6, sum=4.0, schema=-53, timestamp=at)
            h.positive_spans.add(offset=0, length=3)
            h.positive_counts.extend([2.0, 3.0, 1.0])
            h.custom_values.extend([0.1, 1.0])
        elif kind == "exponential":
            h = ts.histograms.add(count_float=2, sum=1.0, schema=0, timestamp=at)
            h.positive_spans.add(offset=0, length=1)
            h.positive_counts.append(2.0)
        else:
            ts.histograms.add(sum=STALE_NAN, timestamp=at,
                              **({"schema": -53} if kind == "nhcb_marker" else {}))
    return cast(bytes, req.SerializeToString())


def nhcb_v2(*histograms: dict[str, Any], samples: int = 0, extra_labels: int = 0) -> bytes:
    """One series of custom-bucket histograms (``histograms``: fields of each)."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "rpc_seconds", "pod", "p", "le", "junk", "a", "b"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4, *([7, 8] * extra_labels)])
    for i in range(samples):
        ts.samples.add(value=1.0, timestamp=TS + i)
    for fields in histograms:
        fields = dict(fields)
        spans = fields.pop("spans", [(0, len(fields.get("positive_counts", [])) or
                                      len(fields.get("positive_deltas", [])))])
        h = ts.histograms.add(**{"schema": -53, "timestamp": TS, **fields})
        for offset, length in spans:
            h.positive_spans.add(offset=offset, length=length)
    return cast(bytes, req.SerializeToString())


def _classic(raw: bytes) -> list[tuple[dict[str, str], float, int, int]]:
    """Each converted series: labels, its one sample, and its histograms."""
    out = []
    for ts in parse_v1(v2_to_v1(raw)).timeseries:
        sample = ts.samples[0] if ts.samples else None
        out.append((dict(labels_of(ts)), sample.value if sample else math.nan,
                    sample.timestamp if sample else 0, len(ts.histograms)))
    return out


def test_a_custom_bucket_histogram_becomes_classic_series() -> None:
    raw = nhcb_v2({"count_float": 6, "sum": 4.0, "positive_counts": [2.0, 3.0, 1.0],
                   "custom_values": [0.1, 1.0]})
    got = _classic(raw)
    assert [(lb["__name__"], lb.get("le"), v, t, n) for lb, v, t, n in got] == [
        ("rpc_seconds_bucket", "0.1", 2.0, TS, 0), ("rpc_seconds_bucket", "1", 5.0, TS, 0),
        ("rpc_seconds_bucket", "+Inf", 6.0, TS, 0), ("rpc_seconds_sum", None, 4.0, TS, 0),
        ("rpc_seconds_count", None, 6.0, TS, 0)]
    # the histogram's labels, sorted with le in place; the series itself is not sent
    for ts in parse_v1(v2_to_v1(raw)).timeseries:
        names = [n for n, _ in labels_of(ts)]
        assert names == sorted(names) and ("pod", "p") in labels_of(ts)
    form = v1_form(raw)
    assert (form.histograms, form.samples, form.size) == (1, 5, len(v2_to_v1(raw)))


def test_custom_buckets_integer_form_spans_with_gaps_and_zero_counts() -> None:
    # bounds 0.1, 0.5, 1, 5: buckets 1 and 3 (a gap before each), then +Inf; deltas
    raw = nhcb_v2({"count_int": 12, "sum": 30.0, "positive_deltas": [4, -4, 8],
                   "spans": [(1, 1), (1, 1), (0, 1)], "custom_values": [0.1, 0.5, 1, 5]})
    got = [(lb.get("le"), v) for lb, v, _, _ in _classic(raw)]
    assert got == [("0.1", 0.0), ("0.5", 4.0), ("1", 4.0), ("5", 4.0), ("+Inf", 12.0),
                   (None, 30.0), (None, 12.0)]
    # zero counts everywhere, float form; a histogram with no buckets at all
    raw = nhcb_v2({"count_float": 0, "sum": 0.0, "positive_counts": [0.0, 0.0],
                   "custom_values": [2.5]},
                  {"count_float": 0, "sum": 0.0, "custom_values": [1e6]})
    got = [(lb.get("le"), v) for lb, v, _, _ in _classic(raw)]
    assert got == [("2.5", 0.0), ("+Inf", 0.0), (None, 0.0), (None, 0.0),
                   ("1e+06", 0.0), ("+Inf", 0.0), (None, 0.0), (None, 0.0)]


def test_a_series_with_samples_too_keeps_them_and_exponential_histograms_pass() -> None:
    raw = nhcb_v2({"count_float": 1, "sum": 1.0, "positive_counts": [1.0],
                   "custom_values": [1.0]}, samples=2)
    got = _classic(raw)
    assert got[0][0] == {"__name__": "rpc_seconds", "pod": "p"} and len(got) == 1 + 4
    plain = request_v2({"__name__": "g", "pod": "p"}, histograms=2)
    assert v1_form(plain).histograms == 0
    assert len(parse_v1(v2_to_v1(plain)).timeseries[0].histograms) == 2


def test_a_staleness_marker_ends_the_classic_series_its_custom_bucket_data_became() -> None:
    # Prometheus' marker (schema 0) after custom-bucket data: every classic series, bounds
    # and all, ends at its timestamp; nothing goes out as a 1.0 histogram
    for last in ("marker", "nhcb_marker"):
        got = _classic(marked("nhcb", last))
        assert [(lb["__name__"], lb.get("le"), t, n) for lb, _, t, n in got[5:]] == [
            ("rpc_seconds_bucket", "0.1", TS + 1000, 0),
            ("rpc_seconds_bucket", "1", TS + 1000, 0),
            ("rpc_seconds_bucket", "+Inf", TS + 1000, 0),
            ("rpc_seconds_sum", None, TS + 1000, 0), ("rpc_seconds_count", None, TS + 1000, 0)]
        assert all(is_stale(v) for _, v, _, _ in got[5:]) and len(got) == 10
        form = v1_form(marked("nhcb", last))
        assert (form.histograms, form.samples) == (2, 10)


def test_a_lone_staleness_marker_goes_out_as_a_float_one() -> None:
    # a 1.0 receiver without native histograms refuses a request holding any histogram
    # (Prometheus 2.42: 500, which senders retry forever); a float marker every one takes
    (ts,) = parse_v1(v2_to_v1(marked("marker"))).timeseries
    assert dict(labels_of(ts)) == {"__name__": "rpc_seconds", "pod": "p"}
    assert len(ts.histograms) == 0 and [s.timestamp for s in ts.samples] == [TS]
    assert is_stale(ts.samples[0].value)
    form = v1_form(marked("marker"))
    assert (form.histograms, form.samples) == (1, 1)
    # a custom-bucket marker alone: its +Inf bucket, _sum and _count end; no value made up
    got = _classic(marked("nhcb_marker"))
    assert [(lb["__name__"], lb.get("le")) for lb, _, _, _ in got] == [
        ("rpc_seconds_bucket", "+Inf"), ("rpc_seconds_sum", None), ("rpc_seconds_count", None)]
    assert all(is_stale(v) for _, v, _, _ in got)


def test_a_staleness_marker_of_exponential_histograms_stays_a_histogram() -> None:
    (ts,) = parse_v1(v2_to_v1(marked("exponential", "marker"))).timeseries
    assert [h.timestamp for h in ts.histograms] == [TS, TS + 1000] and not ts.samples
    assert is_stale(ts.histograms[1].sum)
    assert v1_form(marked("exponential", "marker")).histograms == 0


def test_without_histograms_leaves_out_native_histograms_and_nothing_else() -> None:
    # for a receiver without native histograms (Prometheus 2.42 on its defaults), which
    # refuses the whole request for one: floats, exemplars, metadata and the classic
    # series of custom buckets stay, byte for byte; a series left with labels only goes
    mixed = RequestV2.FromString(request_v2({"__name__": "g", "pod": "p"}, histograms=2,
                                            exemplars=1, metadata=True))
    only = mixed.timeseries.add()  # a series of one exponential histogram and nothing else
    only.CopyFrom(mixed.timeseries[0])
    del only.samples[:], only.exemplars[:], only.histograms[1:]
    plain = mixed.timeseries.add()  # no histogram: its bytes go as they are
    plain.CopyFrom(mixed.timeseries[0])
    del plain.histograms[:]
    nhcb = RequestV2.FromString(nhcb_v2({"count_float": 6, "sum": 4.0,
                                         "positive_counts": [2.0, 3.0, 1.0],
                                         "custom_values": [0.1, 1.0]}))
    converted = v2_to_v1(mixed.SerializeToString()) + v2_to_v1(nhcb.SerializeToString())
    left = without_histograms(converted)
    assert left.histograms == 3
    before, after = parse_v1(converted), parse_v1(left.body)
    assert len(after.timeseries) == len(before.timeseries) - 1
    kept = [ts for ts in before.timeseries if ts.samples or ts.exemplars]
    for old, new in zip(kept, after.timeseries, strict=True):
        assert not new.histograms
        # as bytes: protobuf 5.26 (the bound) compares field by field, and a NaN sample
        # is not equal to itself there
        assert labels_of(new) == labels_of(old)
        for field in ("samples", "exemplars"):
            assert [m.SerializeToString() for m in getattr(new, field)] == [
                m.SerializeToString() for m in getattr(old, field)], field
    assert list(after.metadata) == list(before.metadata)
    assert [n for ts in after.timeseries for n, _ in labels_of(ts)].count("le") == 3
    assert before.timeseries[2].SerializeToString() in left.body  # as it was
    # nothing to leave out: the same bytes; histograms only: nothing left but metadata
    assert without_histograms(v2_to_v1(nhcb.SerializeToString())).body == v2_to_v1(
        nhcb.SerializeToString())
    lone = RequestV2()
    lone.symbols.extend(mixed.symbols)
    lone.timeseries.add().CopyFrom(only)
    left = without_histograms(v2_to_v1(lone.SerializeToString()))
    assert left.histograms == 1 and not parse_v1(left.body).timeseries
    assert len(parse_v1(left.body).metadata) == 1
    assert without_histograms(b"") == WithoutHistograms(b"", 0)


@pytest.mark.parametrize("seed", range(40))
def test_without_histograms_is_the_request_without_them_for_any_shape(seed: int) -> None:
    # long labels and values (lengths of two bytes and more), fields past 15 (tags of two
    # bytes), histograms before other fields of a series, series of labels only: the
    # protobuf reading of the result is the request's with its histograms cleared
    rng = random.Random(seed)
    req = WriteRequest()
    for i in range(rng.randrange(1, 30)):
        ts = req.timeseries.add()
        ts.labels.add(name="__name__", value="m" * rng.choice((1, 130, 20000)))
        ts.labels.add(name="i", value=str(i))
        for _ in range(rng.randrange(3)):
            ts.samples.add(value=1.0, timestamp=i)
        for _ in range(rng.randrange(2)):
            ts.exemplars.add(value=1.0, timestamp=i).labels.add(name="t", value="x" * 200)
        for _ in range(rng.randrange(3)):
            h = ts.histograms.add(count_int=1, sum=1.0, schema=0, zero_count_int=1, timestamp=i)
            h.positive_spans.add(offset=0, length=rng.randrange(300))
            h.positive_deltas.extend([1] * rng.randrange(300))
    raw = bytearray(req.SerializeToString())
    if rng.random() < 0.5:  # an unknown field (number 20) in the last series
        raw += len_field(1, b"\xa2\x01\x02ab" + len_field(1, b"\x0a\x01x\x12\x01y"))
    if rng.random() < 0.5:  # a histogram before a sample and an exemplar
        label = len_field(1, len_field(1, b"__name__") + len_field(2, b"late"))
        histogram = len_field(4, req.timeseries[0].histograms.add().SerializeToString())
        raw += len_field(1, label + histogram + len_field(2, b"\x09" + bytes(8))
                         + histogram + len_field(3, b"\x11" + bytes(8)))
    raw += len_field(3, b"\x08\x01\x12\x01m")  # metadata after the series
    left = without_histograms(bytes(raw))
    expected = WriteRequest.FromString(bytes(raw))
    assert left.histograms == sum(len(ts.histograms) for ts in expected.timeseries)
    kept = [ts for ts in expected.timeseries if not ts.histograms or ts.samples or ts.exemplars]
    for ts in kept:
        del ts.histograms[:]
    got = WriteRequest.FromString(left.body)
    assert [t.SerializeToString() for t in got.timeseries] == [
        t.SerializeToString() for t in kept]
    assert list(got.metadata) == list(expected.metadata)
    if not left.histograms:
        assert left.body == raw


def nan(payload: int) -> float:
    """A quiet NaN carrying ``payload`` in its low mantissa bits."""
    return cast(float, struct.unpack("<d", struct.pack("<Q", QUIET_NAN_BITS | payload))[0])


def bits(value: float) -> int:
    return cast(int, struct.unpack("<Q", struct.pack("<d", value))[0])


def nan_buckets_v2() -> bytes:
    """Buckets whose counts are NaNs of two payloads: their sum's payload is the
    compiler's choice (CPython's debug build kept the second, its release build the first)."""
    return nhcb_v2({"count_float": 3, "sum": 1.0, "positive_counts": [nan(0x1), nan(0x2), 1.0],
                    "custom_values": [0.5, 1.0]},
                   {"count_float": 1, "sum": 1.0, "positive_counts": [nan(0x10_0000_0000), 0.0],
                    "custom_values": [0.5]})


def test_a_bucket_whose_counts_add_up_to_nan_is_the_one_quiet_nan() -> None:
    raw = nan_buckets_v2()
    assert bits(nan(0x1)) != QUIET_NAN_BITS  # the payload survives the request
    buckets = [v for lb, v, _, _ in _classic(raw) if "le" in lb]
    assert len(buckets) == 5
    assert [hex(bits(v)) for v in buckets] == [hex(QUIET_NAN_BITS)] * 5
    # the histogram's own sum and count pass as they were sent
    assert [v for lb, v, _, _ in _classic(raw) if "le" not in lb] == [1.0, 3.0, 1.0, 1.0]


def test_a_custom_bucket_past_its_bounds_is_400() -> None:
    raw = nhcb_v2({"count_float": 1, "sum": 1.0, "positive_counts": [1.0],
                   "spans": [(2, 1)], "custom_values": [1.0]})
    with pytest.raises(DecodeError) as e:
        v2_to_v1(raw)
    assert e.value.status == 400


@pytest.mark.parametrize(("bound", "text"), [
    (0.1, b"0.1"), (1.0, b"1"), (2.5, b"2.5"), (100000.0, b"100000"), (1e6, b"1e+06"),
    (1234567.0, b"1.234567e+06"), (0.0001, b"0.0001"), (1e-05, b"1e-05"),
    (1.5e-07, b"1.5e-07"), (-0.5, b"-0.5"), (0.0, b"0"), (1e21, b"1e+21"),
    (math.inf, b"+Inf")])
def test_le_is_formatted_as_prometheus_formats_it(bound: float, text: bytes) -> None:
    assert format_le(bound) == text  # Go's strconv.FormatFloat(b, 'g', -1, 64)


@pytest.mark.parametrize("raw", _many_kinds())
def test_v1_form_size_is_the_converted_size(raw: bytes) -> None:
    assert v1_form(raw).size == len(v2_to_v1(raw))


def test_v1_form_of_an_amplifying_request_allocates_nothing_of_it() -> None:
    raw = amplifying_v2(65536, 4000)
    assert len(raw) < 200_000
    tracemalloc.start()
    try:
        size = v1_form(raw).size
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 4000 * 65536  # 263 MB, were it made
    assert peak < 4 * 2**20, peak
    with pytest.raises(ConversionTooLarge) as e:
        check_size(raw, 64 * 2**20)
    assert (e.value.size, e.value.limit) == (size, 64 * 2**20)
    assert check_size(raw, size).size == size
