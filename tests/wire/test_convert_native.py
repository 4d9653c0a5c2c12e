"""The native RW 2.0 -> 1.0 conversion (``_convert.c``) against the reference
(``proxy/wire/convert.py``), on random requests.

The contract (``proxy/wire/conversion.py``): for a request it takes, the native count is
``convert.v1_form(raw)`` (its size, and how custom-bucket histograms and staleness
markers change the counts: ``convert_v2_form``) and its bytes are
``convert.v2_to_v1(raw)``, custom-bucket histograms made classic series and histogram
staleness markers of every kind placed natively; every request the reference refuses it
leaves to the reference (``None``), so the dispatching functions answer or raise exactly
what the reference does.

Requests come from ``fuzz_native.conversion_v2`` (driven by hypothesis' ``st.randoms()``,
as in ``test_native_differential.py``): the splice's RW 2.0 generator plus metric names of
every family suffix, metadata of every type with empty or repeated help and unit symbols,
exponential histograms of every shape, custom-bucket histograms (bounds of every shape,
spans with gaps, integer and float counts, an ``le`` label of the series' own), staleness
markers of every kind before, between and after them;
invalid ones are poisoned or byte-mutated.
"""

from __future__ import annotations

import math
import random
import struct
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.compression import DecodeError
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2
from proxy.wire import conversion, convert
from proxy.wire.native import native_available
from proxy.wire.primitives import STALE_NAN
from tests.wire.fuzz_native import (
    LABEL_POISONS,
    POISONS_V2,
    STALE_KINDS,
    conversion_v2,
    encode,
    mutate,
    poison,
)
from tests.wire.test_convert import _many_kinds, marked, nan_buckets_v2, nhcb_v2
from tests.wire.test_native_differential import EDGE_V2, SETTINGS, examples, f, randoms
from tests.wire_fixtures import amplifying_v2

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

from proxy.wire import _splice

RequestV2: Any = v2.Request


def reference(raw: bytes) -> tuple[bytes, convert.V1Form] | DecodeError:
    try:
        return convert.v2_to_v1(raw), convert.v1_form(raw)
    except DecodeError as e:
        return e


def check(raw: bytes) -> str:
    """Native and reference agree on ``raw``; what happened: "native" (converted
    natively), "fallback" (left to the reference, which converted it) or "refused"."""
    ref = reference(raw)
    size = _splice.convert_v2(raw)
    if isinstance(ref, DecodeError):
        assert size is None, f"native took what the reference refuses ({ref}): {raw.hex()}"
        with pytest.raises(DecodeError) as e:
            conversion.check_size(raw, None)
        assert (e.value.kind, e.value.status) == (ref.kind, ref.status)
        with pytest.raises(DecodeError) as e:
            conversion.v2_to_v1(raw)
        assert (e.value.kind, e.value.status) == (ref.kind, ref.status)
        return "refused"
    body, form = ref
    assert conversion.v2_to_v1(raw) == body, f"dispatch differs: {raw.hex()}"
    assert conversion.check_size(raw, None) == form
    # as the upstream converts: the size counted first, the bytes made at it
    assert conversion.v2_to_v1(raw, form.size) == body, f"dispatch at its size: {raw.hex()}"
    assert len(body) == form.size
    counted = _splice.convert_v2_form(raw)
    if size is None:
        assert counted is None
        return "fallback"
    assert size == form.size, f"size {size!r} != {form.size}: {raw.hex()}"
    assert isinstance(size, int)
    assert counted == (form.size, form.histograms, form.samples), raw.hex()
    got = _splice.convert_v2(raw, size)
    assert got == body, f"bytes differ: {raw.hex()}\nnative {got!r}\nref    {body!r}"
    assert _splice.convert_v2(memoryview(raw), size) == body
    return "native"


@SETTINGS
@given(rnd=randoms)
def test_valid_requests_convert_natively(rnd: random.Random) -> None:
    raw = encode(conversion_v2(rnd))
    assert check(raw) == "native", raw.hex()


@settings(SETTINGS, max_examples=examples(300))
@given(rnd=randoms)
def test_custom_buckets_convert_natively(rnd: random.Random) -> None:
    """A request of custom-bucket histograms (no staleness marker) is converted natively,
    its classic series, size and counts the reference's; one with a bucket past its
    bounds the native leaves to the reference, which refuses it."""
    raw = encode(conversion_v2(rnd, special=True, kinds=("custom",)))
    outcome = check(raw)
    assert outcome in ("native", "refused"), raw.hex()
    if outcome == "refused":
        with pytest.raises(DecodeError, match="past its"):
            convert.v2_to_v1(raw)


#: what the dispatch may not call for a request the native conversion takes: the
#: reference's conversion, its count, and its pieces
REFERENCE = ("_series_v1", "v1_form", "v2_to_v1", "series_form", "converted_series",
             "custom_buckets", "stale_marker", "classic_series")


def native_only(raw: bytes) -> None:
    """``raw`` converted and counted by the dispatch with the reference made to raise if
    called: the answers the reference's (made before), size, counts and bytes."""
    body, form = convert.v2_to_v1(raw), convert.v1_form(raw)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reference was called")

    with pytest.MonkeyPatch.context() as mp:
        for name in REFERENCE:
            mp.setattr(convert, name, refused)
        got = conversion.check_size(raw, None)
        assert got == form, raw.hex()
        assert conversion.v2_to_v1(raw, got.size) == body, raw.hex()
        assert conversion.v2_to_v1(raw) == body, raw.hex()
    assert len(body) == form.size


@settings(SETTINGS, max_examples=examples(400))
@given(rnd=randoms)
def test_staleness_markers_convert_natively(rnd: random.Random) -> None:
    """Requests with histogram staleness markers of every kind (``STALE_KINDS``: before,
    between and after custom-bucket and exponential data of their series, several in
    one) are converted natively, never left to the reference: bytes, size and counts the
    reference's. Refused only for a custom-bucket histogram (no marker) with a bucket past
    its bounds, as the reference refuses it."""
    raw = encode(conversion_v2(rnd, special=True))
    outcome = check(raw)
    assert outcome in ("native", "refused"), raw.hex()
    if outcome == "refused":
        with pytest.raises(DecodeError, match="past its"):
            convert.v2_to_v1(raw)
    else:
        native_only(raw)


@settings(SETTINGS, max_examples=examples(300))
@given(rnd=randoms)
def test_markers_alone_convert_natively(rnd: random.Random) -> None:
    """Markers without custom-bucket data beside them (lone, exponential, custom-bucket
    ones with and without bounds): never refused, always native."""
    raw = encode(conversion_v2(rnd, special=True, kinds=STALE_KINDS))
    assert check(raw) == "native", raw.hex()
    native_only(raw)


def test_generated_markers_hold_every_kind() -> None:
    """The generator is worth its examples: markers of every kind, lone ones (float
    markers), ones after custom-bucket data (classic series ending) and ones beside
    exponential data (histograms) all occur."""
    rnd = random.Random(11)
    seen = {"float": 0, "classic": 0, "histogram": 0, "borrowed": 0}
    for _ in range(150):
        raw = encode(conversion_v2(rnd, special=True, kinds=STALE_KINDS))
        assert check(raw) == "native"
        for ts in RequestV2.FromString(raw).timeseries:
            stale = [_is_marker(h) for h in ts.histograms]
            custom = [h.schema == -53 for h in ts.histograms]
            if not any(stale):
                continue
            exponential = any(not s and not c for s, c in zip(stale, custom, strict=True))
            seen["histogram"] += exponential
            seen["float"] += not exponential and not any(custom)
            seen["classic"] += not exponential and any(custom)
            seen["borrowed"] += any(
                c and s and not h.custom_values and any(custom[:i])
                for i, (h, s, c) in enumerate(zip(ts.histograms, stale, custom, strict=True)))
    assert all(n > 10 for n in seen.values()), seen


def _is_marker(h: Any) -> bool:
    return struct.pack("<d", h.sum) == struct.pack("<d", STALE_NAN)


@settings(SETTINGS, max_examples=examples(600))
@given(rnd=randoms, what=st.sampled_from(POISONS_V2))
def test_poisoned_requests(rnd: random.Random, what: str) -> None:
    """A defect the reference refuses: native falls back, the reference's error raised.
    (The label checks of the splice, a repeated or empty name, no label of a value left
    after the drop, are no conversion's: both convert those alike.)"""
    nodes = conversion_v2(rnd)
    poison(nodes, 2, what, rnd)
    outcome = check(encode(nodes))
    if what not in LABEL_POISONS:
        assert outcome == "refused", what


@settings(SETTINGS, max_examples=examples(1000))
@given(rnd=randoms, steps=st.integers(1, 4), special=st.booleans())
def test_mutated_requests(rnd: random.Random, steps: int, special: bool) -> None:
    raw = encode(conversion_v2(rnd, special=special))
    for _ in range(steps):
        raw = mutate(raw, rnd)
    check(raw)


def test_nan_counts_of_any_payload_convert_alike() -> None:
    """The debug build's CI run found native and reference apart on a sum of two NaNs."""
    assert check(nan_buckets_v2()) == "native"


@settings(SETTINGS, max_examples=examples(30))
@given(rnd=randoms)
def test_wide_requests(rnd: random.Random) -> None:
    """Hundreds of series: the metadata table and the scratch arrays grow."""
    assert check(encode(conversion_v2(rnd, series=(100, 400)))) == "native"


def test_generated_requests_hold_what_the_conversion_must_get_right() -> None:
    """The generator is worth its examples: metadata deduplicated and of stripped family
    names, exemplars, histograms, samples in most requests' conversions."""
    rnd = random.Random(5)
    seen = {"metadata": 0, "stripped": 0, "histograms": 0, "exemplars": 0, "empty help": 0}
    for _ in range(200):
        raw = encode(conversion_v2(rnd))
        assert check(raw) == "native"
        req = remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw))
        names = [m.metric_family_name for m in req.metadata]
        seen["metadata"] += bool(names)
        seen["stripped"] += "rpc_seconds" in names or "q" in names
        seen["empty help"] += any(not m.help for m in req.metadata)
        seen["histograms"] += any(t.histograms for t in req.timeseries)
        seen["exemplars"] += any(t.exemplars for t in req.timeseries)
    assert all(n > 20 for n in seen.values()), seen


def _meta_request(*series: tuple[list[int], list[bytes]], symbols: list[bytes]) -> bytes:
    """Series of these refs and raw Metadata payloads."""
    body = b"".join(f(4, s) for s in symbols)
    for refs, metas in series:
        body += f(5, f(1, bytes(refs)), f(2, bytes.fromhex("09000000000000f03f1000")),
                  *(f(5, m) for m in metas))
    return body


SYMS = [b"", b"__name__", b"rpc_seconds_bucket", b"rpc_seconds_sum", b"help", b"s", b"",
        b"help", b"rpc_seconds_gsum", b"x_sum"]
FIXED = {
    **{f"edge: {k}": v for k, v in EDGE_V2.items()},
    **{f"kinds #{i}": raw for i, raw in enumerate(_many_kinds())},
    "one family of three series": _meta_request(
        ([1, 2], [b"\x08\x03\x18\x04\x20\x05"]), ([1, 3], [b"\x08\x03\x18\x07\x20\x05"]),
        symbols=SYMS),
    "a family's help differs": _meta_request(
        ([1, 2], [b"\x08\x03\x18\x04"]), ([1, 3], [b"\x08\x03"]), symbols=SYMS),
    "help and unit refs to another empty symbol": _meta_request(
        ([1, 2], [b"\x18\x06\x20\x06"]), symbols=SYMS),
    "no type, a help": _meta_request(([1, 2], [b"\x18\x04"]), symbols=SYMS),
    "gauge of a suffixed name stays": _meta_request(([1, 2], [b"\x08\x02"]), symbols=SYMS),
    "_gsum stripped whole": _meta_request(([1, 8], [b"\x08\x04"]), symbols=SYMS),
    "summary x_sum": _meta_request(([1, 9], [b"\x08\x05"]), symbols=SYMS),
    "two metadata fields in a series": _meta_request(
        ([1, 2], [b"\x08\x03", b"\x08\x02\x18\x04"]), symbols=SYMS),
    "metadata, no symbols": f(5, f(5, b"\x08\x02")),
    "metadata, no name label": _meta_request(([4, 5], [b"\x08\x02"]), symbols=SYMS),
    "a type past the enum": _meta_request(([1, 2], [b"\x08\xff\xff\x03"]), symbols=SYMS),
    "histogram, schema -53 then 0": f(4) + f(5, f(3, b"\x20\x69\x20\x00")),
    "histogram, schema 0 then -53": f(4) + f(5, f(3, b"\x20\x00\x20\x69")),
    "histogram, stale sum then not": f(4) + f(5, f(3, b"\x19" + bytes.fromhex(
        "020000000000f07f") + b"\x19" + bytes(8))),
    "histogram, stale sum": f(4) + f(5, f(3, b"\x19" + bytes.fromhex("020000000000f07f"))),
    "a stale float sample": f(4) + f(5, f(2, b"\x09" + bytes.fromhex("020000000000f07f"))),
    "markers": marked("exponential", "marker"),
    "nhcb": nhcb_v2({"count_float": 6, "sum": 4.0, "positive_counts": [2.0, 3.0, 1.0],
                     "custom_values": [0.1, 1.0]}),
    "refs of 2^32": f(4) + f(5, f(1, b"\x80\x80\x80\x80\x10\x00")),
    "rw 1.0 metadata field": f(4) + f(3, b""),
    "rw 1.0 field 1 as a varint (unknown in 2.0)": f(4) + b"\x08\x01" + f(5),
}
EXPECT = {"histogram, schema -53 then 0": "native", "histogram, schema 0 then -53": "native",
          "histogram, stale sum then not": "native", "histogram, stale sum": "native",
          "a stale float sample": "native", "markers": "native", "nhcb": "native",
          **{f"kinds #{i}": "native" for i in range(8, 15)},
          "metadata, no symbols": "refused", "rw 1.0 metadata field": "refused",
          "refs of 2^32": "refused", "one family of three series": "native",
          "_gsum stripped whole": "native"}


@pytest.mark.parametrize("raw", list(FIXED.values()), ids=list(FIXED))
def test_fixed_cases(raw: bytes, request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.id
    got = check(raw)
    if name in EXPECT:
        assert got == EXPECT[name]


def test_metadata_as_the_reference_deduplicates_it() -> None:
    raw = FIXED["one family of three series"]
    req = remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw))
    assert [(m.metric_family_name, m.type, m.help, m.unit) for m in req.metadata] == [
        ("rpc_seconds", 3, "help", "s")]


def test_an_amplifying_request_is_counted_without_being_made() -> None:
    """The size of a request converting to ~260 MB, counted natively: exactly the
    reference's, in a moment and without its bytes."""
    raw = amplifying_v2(65536, 4000)
    size = _splice.convert_v2(raw)
    assert size == convert.v1_form(raw).size > 260 * 10**6


def test_a_wrong_size_is_refused() -> None:
    raw = FIXED["one family of three series"]
    size = _splice.convert_v2(raw)
    assert isinstance(size, int)
    for wrong in (0, size - 1, size + 1):
        with pytest.raises(ValueError, match="converts to"):
            _splice.convert_v2(raw, wrong)
    with pytest.raises(ValueError):
        _splice.convert_v2(raw, -2)
    assert _splice.convert_v2(b"", 0) == b"" and _splice.convert_v2(b"") == 0


def test_conversions_run_in_parallel_threads() -> None:
    """The GIL is released around the walk: many threads converting at once agree."""
    rnd = random.Random(9)
    raws = [encode(conversion_v2(rnd, series=(50, 100))) for _ in range(6)]
    raws += [_nhcb_request(200, every=k) for k in (1, 4)]  # classic series made natively
    want = [convert.v2_to_v1(r) for r in raws]
    wrong: list[Any] = []

    def run(k: int) -> None:
        for _ in range(20):
            if conversion.v2_to_v1(raws[k]) != want[k]:
                wrong.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(raws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def _request_with_a_marker(n: int) -> bytes:
    """``n`` ordinary series with metadata, a custom-bucket histogram series, a series
    ending in a histogram staleness marker and one with a float sample of the same labels
    as that marker's (its order kept), among them."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "pod", "rpc_seconds", "help", "seconds", "up"])
    for i in range(n):
        req.symbols.append(f"pod-{i}")
        ts = req.timeseries.add()
        ts.labels_refs.extend([1, 6 if i % 2 else 3, 2, 7 + i])
        ts.samples.add(value=float(i), timestamp=1000 + i)
        ts.metadata.type = 1 if i % 2 else 3
        ts.metadata.help_ref = 4
        ts.metadata.unit_ref = 5
        if i == n // 3:  # a custom-bucket histogram, with its metadata
            h = req.timeseries.add()
            h.labels_refs.extend([1, 3, 2, 7 + i])
            hist = h.histograms.add(count_float=6, sum=4.0, schema=-53, timestamp=1000)
            hist.positive_spans.add(offset=0, length=3)
            hist.positive_counts.extend([2.0, 3.0, 1.0])
            hist.custom_values.extend([0.1, 1.0])
            h.metadata.type = 2
            h.metadata.help_ref = 5
        if i == 2 * n // 3:  # the same labels' histogram ends, then a float sample
            m = req.timeseries.add()
            m.labels_refs.extend([1, 6, 2, 7 + i])
            m.histograms.add(sum=STALE_NAN, timestamp=1001 + i)
            again = req.timeseries.add()
            again.labels_refs.extend([1, 6, 2, 7 + i])
            again.samples.add(value=2.0, timestamp=1002 + i)
    return bytes(req.SerializeToString())


def test_a_request_with_a_marker_is_converted_without_the_reference() -> None:
    # one marker sent the request to proxy/wire/mixed.py (its series by the reference,
    # the rest natively: 10x the CPU of the request without it); now all of it is native
    raw = _request_with_a_marker(3000)
    form = convert.v1_form(raw)
    assert form.histograms == 2 and form.samples == 3 + 2 + 1
    assert check(raw) == "native"
    native_only(raw)


# -- custom-bucket histograms, natively -----------------------------------------------------


def _nhcb_request(n: int, every: int = 1) -> bytes:
    """``n`` series, every ``every``-th of a custom-bucket histogram (integer form, a
    gap), the others of a float sample; metadata per series."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "rpc_seconds", "pod", "help", "seconds", "up"])
    for i in range(n):
        req.symbols.append(f"pod-{i}")
        ts = req.timeseries.add()
        if i % every:
            ts.labels_refs.extend([1, 6, 3, 7 + i])
            ts.samples.add(value=float(i), timestamp=1000 + i)
            ts.metadata.type = 1
        else:
            ts.labels_refs.extend([3, 7 + i, 1, 2])
            h = ts.histograms.add(count_int=9, sum=4.5, schema=-53, timestamp=1000 + i)
            h.positive_spans.add(offset=0, length=2)
            h.positive_spans.add(offset=1, length=1)
            h.positive_deltas.extend([2, 1, -1])
            h.custom_values.extend([0.005, 0.1, 1.0, 2.5])
            ts.metadata.type = 3
        ts.metadata.help_ref = 4
        ts.metadata.unit_ref = 5
    return bytes(req.SerializeToString())


def test_custom_buckets_are_converted_without_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of custom-bucket histograms does not go to the reference: the native
    conversion makes their classic series, size, counts and bytes the reference's."""
    raw = _nhcb_request(300, every=3)
    body, form = convert.v2_to_v1(raw), convert.v1_form(raw)
    assert form.histograms == 100 and form.samples == 100 * (4 + 3)
    assert check(raw) == "native"

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reference was called")

    for name in REFERENCE:
        monkeypatch.setattr(convert, name, refused)
    got = conversion.check_size(raw, None)
    assert got == form
    assert conversion.v2_to_v1(raw, got.size) == body
    assert conversion.v2_to_v1(raw) == body


def _classic(raw: bytes) -> list[tuple[list[tuple[str, str]], float, int]]:
    out = []
    for ts in remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw)).timeseries:
        assert len(ts.samples) == 1 and not ts.histograms
        out.append(([(lb.name, lb.value) for lb in ts.labels], ts.samples[0].value,
                     ts.samples[0].timestamp))
    return out


def test_spans_with_gaps_integer_counts() -> None:
    # deltas 1, 1, 3, -2 -> counts 1, 2, 5, 3 at buckets 1, 2 (span 1: offset 1) and
    # 5, 6 (span 2: a gap of 2); cumulative over bounds 1..6 and +Inf
    raw = nhcb_v2({"count_int": 11, "sum": 7.0, "positive_deltas": [1, 1, 3, -2],
                   "spans": [(1, 2), (2, 2)], "custom_values": [1, 2, 3, 4, 5, 6],
                   "timestamp": -5})
    assert check(raw) == "native"
    got = _classic(raw)
    assert [(dict(lbs).get("le"), v) for lbs, v, _ in got] == [
        ("1", 0.0), ("2", 1.0), ("3", 3.0), ("4", 3.0), ("5", 3.0), ("6", 8.0),
        ("+Inf", 11.0), (None, 7.0), (None, 11.0)]
    assert {ts for _, _, ts in got} == {-5}


def test_float_counts_and_overlapping_spans() -> None:
    # a later span going back (a negative gap) adds to buckets already counted
    raw = nhcb_v2({"count_float": 6.5, "sum": 1.25, "positive_counts": [0.5, 1.0, 2.0, 3.0],
                   "spans": [(0, 2), (-2, 2)], "custom_values": [0.1, 0.2]})
    assert check(raw) == "native"
    assert [v for _, v, _ in _classic(raw)] == [2.5, 6.5, 6.5, 1.25, 6.5]


def test_deltas_win_over_float_counts_and_values_run_out() -> None:
    raw = nhcb_v2({"count_int": 1, "positive_deltas": [1], "positive_counts": [9.0, 9.0],
                   "spans": [(0, 5), (0, 3)], "custom_values": [1.0, 2.0, 3.0]})
    assert check(raw) == "native"
    assert [v for _, v, _ in _classic(raw)][:4] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("spans", [[(5, 1)], [(-1, 1)], [(0, 2), (2, 1)], [(1, 4)]])
def test_a_bucket_past_the_bounds_is_the_references_error(spans: list[tuple[int, int]]
                                                           ) -> None:
    raw = nhcb_v2({"count_int": 1, "positive_deltas": [1, 0, 0, 0], "spans": spans,
                   "custom_values": [1.0, 2.0]})
    assert _splice.convert_v2(raw) is None and _splice.convert_v2_form(raw) is None
    assert check(raw) == "refused"
    with pytest.raises(DecodeError, match="past its 2 bounds") as e:
        conversion.v2_to_v1(raw)
    assert e.value.kind == "protobuf_invalid"


def test_an_index_out_and_back_in_is_no_error() -> None:
    # past the bounds with no value taken there: the reference does not raise
    raw = nhcb_v2({"count_int": 1, "positive_deltas": [1], "spans": [(9, 0), (-9, 1)],
                   "custom_values": [1.0]})
    assert check(raw) == "native"


def test_a_running_sum_past_an_int64_is_left_to_the_reference() -> None:
    big = 2**62
    raw = nhcb_v2({"count_int": 1, "positive_deltas": [big, big, big],
                   "custom_values": [1.0, 2.0]})
    assert check(raw) == "fallback"


def test_an_existing_le_label_is_dropped_and_labels_sorted() -> None:
    req = RequestV2()
    req.symbols.extend(["", "zz", "1", "le", "0.5", "__name__", "m", "Zed", "a", "", "a", "b",
                        "m_x"])
    ts = req.timeseries.add()
    # unsorted, an "le" of the series' own, a repeated name (kept in order: a stable
    # sort), a name sorting before "__name__" (upper case) and one between it and "le"
    ts.labels_refs.extend([1, 2, 3, 4, 5, 6, 7, 2, 8, 11, 10, 2, 12, 2])
    h = ts.histograms.add(count_int=2, sum=1.0, schema=-53, timestamp=5)
    h.positive_spans.add(offset=0, length=2)
    h.positive_deltas.extend([1, 0])
    h.custom_values.append(0.25)
    raw = bytes(req.SerializeToString())
    assert check(raw) == "native"
    got = _classic(raw)
    assert got[0][0] == [("Zed", "1"), ("__name__", "m_bucket"), ("a", "b"), ("a", "1"),
                         ("le", "0.25"), ("m_x", "1"), ("zz", "1")]
    assert got[-1][0] == [("Zed", "1"), ("__name__", "m_count"), ("a", "b"), ("a", "1"),
                          ("m_x", "1"), ("zz", "1")]
    assert len(got) == 4  # the series itself: not sent (nothing but the histogram)


def test_a_series_of_samples_custom_buckets_and_exponential_histograms() -> None:
    req = RequestV2()
    req.symbols.extend(["", "__name__", "rpc_seconds", "pod", "p"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4])
    ts.samples.add(value=1.0, timestamp=10)
    c1 = ts.histograms.add(count_float=3, sum=2.0, schema=-53, timestamp=11)
    c1.positive_spans.add(offset=0, length=2)
    c1.positive_counts.extend([1.0, 2.0])
    c1.custom_values.extend([1e-9, 1e21])
    e = ts.histograms.add(count_int=2, sum=1.0, schema=3, timestamp=12, start_timestamp=1)
    e.positive_spans.add(offset=-2, length=1)
    e.positive_deltas.append(2)
    c2 = ts.histograms.add(count_int=1, sum=0.5, schema=-53, timestamp=13)
    c2.positive_spans.add(offset=1, length=1)
    c2.positive_deltas.append(1)
    c2.custom_values.append(123456.0)
    ts.samples.add(value=2.0, timestamp=14)
    ts.metadata.type = 3
    raw = bytes(req.SerializeToString())
    assert check(raw) == "native"
    out = remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw))
    first = out.timeseries[0]  # the series, its samples and exponential histogram kept
    assert [s.value for s in first.samples] == [1.0, 2.0]
    assert [h.schema for h in first.histograms] == [3]
    les = [dict((lb.name, lb.value) for lb in t.labels).get("le")
           for t in out.timeseries[1:]]
    assert les == ["1e-09", "1e+21", "+Inf", None, None, "123456", "+Inf", None, None]
    assert convert.v1_form(raw) == convert.V1Form(len(conversion.v2_to_v1(raw)), 2, 5 + 4)


def test_many_custom_histograms_and_a_long_series_of_bounds() -> None:
    """100k bounds in one histogram, many histograms in one series: converted natively,
    the reference's bytes."""
    bounds = [i / 7 for i in range(100_000)]
    raw = nhcb_v2({"count_int": 5, "positive_deltas": [1] * 5,
                   "spans": [(3, 1), (50_000, 2)] + [(0, 0)] * 1000 + [(40_000, 2)],
                   "custom_values": bounds},
                  *({"count_float": 1.0, "positive_counts": [1.0], "custom_values": [0.5]}
                    for _ in range(2000)))
    assert check(raw) == "native"


def test_the_cost_is_linear_in_the_request() -> None:
    """Spans of huge lengths, offsets of every size, and values: the walk stops with the
    values; a histogram of many bounds is counted without its classic series' labels
    walked per bound (work counted, not timed: the size of a 2x request is counted in
    about 2x the time)."""
    import time

    def cost(k: int) -> float:
        raw = nhcb_v2({"count_int": 1, "positive_deltas": [1] * 10,
                       "spans": [(0, 2**32 - 1)] + [(2**31 - 1, 2**32 - 1)] * (1000 * k),
                       "custom_values": [0.5] * (20_000 * k)}, extra_labels=200)
        times = []
        for _ in range(5):
            t = time.thread_time()
            assert isinstance(_splice.convert_v2(raw), int)
            times.append(time.thread_time() - t)
        return sorted(times)[2]

    small, large = cost(1), cost(4)
    assert large < 4 * 3 * max(small, 1e-4)


def _random_double(r: random.Random) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", r.getrandbits(64)))[0])


def test_format_le_is_the_references() -> None:
    """Go's shortest 'g' as convert.format_le writes it (from Python's repr), natively:
    random doubles of every exponent, subnormals, powers of two (whose shortest decimal
    may not be the nearest one of its length) and their neighbours, round decimals, huge,
    negative, zeros, infinities, NaNs."""
    r = random.Random(11)
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 5e-324, -5e-324,
              2.2250738585072014e-308, 2.225073858507201e-308, 1.7976931348623157e308,
              0.1, 0.005, 1e-4, 1e-5, 99999.9, 999999.0, 1e6, 123456.0, 1234567.0, 1e21,
              1e22, 1e23, 9007199254740993.0, 0.1 + 0.2, 1 / 3]
    for e in range(-1074, 1024):
        x = math.ldexp(1.0, e)
        values += [x, -x, math.nextafter(x, 0.0), math.nextafter(x, math.inf)]
    values += [_random_double(r) for _ in range(100_000)]
    values += [float(struct.unpack("<d", struct.pack("<Q", r.getrandbits(52)))[0])
               for _ in range(20_000)]
    values += [round(r.uniform(-1e7, 1e7), r.randint(0, 12)) for _ in range(20_000)]
    values += [float(f"{r.randint(1, 999_999)}e{r.randint(-330, 310)}") for _ in range(20_000)]
    wrong = [(x, _splice._format_le(x), convert.format_le(x)) for x in values
             if _splice._format_le(x) != convert.format_le(x)]
    assert not wrong, wrong[:10]


# -- staleness markers, natively --------------------------------------------------------

MARKER = {"sum": STALE_NAN}
NHCB = {"count_float": 6, "sum": 4.0, "schema": -53, "positive_counts": [2.0, 3.0, 1.0],
        "spans": [(0, 3)], "custom_values": [0.1, 1.0]}
EXPONENTIAL = {"count_float": 2, "sum": 1.0, "schema": 0, "positive_counts": [2.0],
               "spans": [(0, 1)]}


def _series(*fields: tuple[str, dict[str, Any]], start: int = 1000) -> bytes:
    """One series ``rpc_seconds{pod="p"}`` of these fields in order: ("sample", {}) or
    ("histogram", its fields), the n-th at timestamp ``start + n`` unless it says."""
    req = RequestV2()
    req.symbols.extend(["", "__name__", "rpc_seconds", "pod", "p"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4])
    for i, (what, spec) in enumerate(fields):
        spec = {"timestamp": start + i, **spec}
        if what == "sample":
            ts.samples.add(value=float(i), timestamp=spec["timestamp"])
            continue
        spans = spec.pop("spans", [])
        h = ts.histograms.add(**spec)
        for offset, length in spans:
            h.positive_spans.add(offset=offset, length=length)
    return bytes(req.SerializeToString())


def _out(raw: bytes) -> list[tuple[str | None, str | None, list[tuple[float, int]], int]]:
    """Each converted TimeSeries: name, le, its samples, how many histograms."""
    got = []
    for ts in remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw)).timeseries:
        lbs = {lb.name: lb.value for lb in ts.labels}
        got.append((lbs.get("__name__"), lbs.get("le"),
                    [(s.value, s.timestamp) for s in ts.samples], len(ts.histograms)))
    return got


def _stale(v: float) -> bool:
    return struct.pack("<d", v) == struct.pack("<d", STALE_NAN)


@pytest.mark.parametrize("kinds", [("nhcb", "marker"), ("marker",), ("exponential", "marker"),
                                   ("nhcb", "nhcb_marker"), ("nhcb_marker",)])
def test_each_kind_of_marker_natively(kinds: tuple[str, ...]) -> None:
    raw = marked(*kinds)
    assert check(raw) == "native"
    native_only(raw)


def test_a_marker_after_custom_bucket_data_ends_its_classic_series() -> None:
    raw = _series(("histogram", NHCB), ("histogram", MARKER))
    native_only(raw)
    got = _out(raw)
    assert [(n, le) for n, le, _, _ in got[5:]] == [
        ("rpc_seconds_bucket", "0.1"), ("rpc_seconds_bucket", "1"),
        ("rpc_seconds_bucket", "+Inf"), ("rpc_seconds_sum", None), ("rpc_seconds_count", None)]
    assert all(len(s) == 1 and _stale(s[0][0]) and s[0][1] == 1001 for _, _, s, _ in got[5:])
    assert _splice.convert_v2_form(raw)[1:] == (2, 10)  # type: ignore[index]


def test_a_marker_first_then_data_takes_the_bounds_of_the_last() -> None:
    # Prometheus' marker before the data in the same request: it still ends the classic
    # series of the series' (last) custom-bucket histogram, after them, at its timestamp
    other = {**NHCB, "custom_values": [0.5, 2.0, 8.0], "spans": [(0, 2)],
             "positive_counts": [1.0, 1.0]}
    raw = _series(("histogram", MARKER), ("histogram", NHCB), ("histogram", other))
    native_only(raw)
    got = _out(raw)
    assert len(got) == 5 + 6 + 6
    assert [le for _, le, _, _ in got[11:15]] == ["0.5", "2", "8", "+Inf"]
    assert all(_stale(s[0][0]) and s[0][1] == 1000 for _, _, s, _ in got[11:])


def test_a_custom_bucket_marker_first_has_no_bounds_to_take() -> None:
    # a custom-bucket marker with no bounds takes those of the data BEFORE it only
    raw = _series(("histogram", {**MARKER, "schema": -53}), ("histogram", NHCB))
    native_only(raw)
    got = _out(raw)
    assert [le for _, le, _, _ in got[:3]] == ["+Inf", None, None]
    assert all(_stale(s[0][0]) for _, _, s, _ in got[:3]) and len(got) == 3 + 5


def test_a_custom_bucket_marker_with_bounds_keeps_its_own() -> None:
    own = {**MARKER, "schema": -53, "custom_values": [3.0], "positive_counts": [9.0] * 5,
           "spans": [(7, 5)]}  # buckets past its bounds: a marker's say nothing
    raw = _series(("histogram", NHCB), ("histogram", own), ("histogram", {**MARKER,
                                                                         "schema": -53}))
    native_only(raw)
    assert [le for _, le, _, _ in _out(raw)[5:]] == ["3", "+Inf", None, None,
                                                      "3", "+Inf", None, None]


def test_markers_and_samples_in_one_series() -> None:
    # no custom-bucket or exponential data: every marker a float stale marker after the
    # series' samples, in order; a histogram fewer and a sample more each
    raw = _series(("histogram", MARKER), ("sample", {}), ("histogram", MARKER),
                  ("sample", {}), ("histogram", {**MARKER, "schema": 3}))
    native_only(raw)
    ((name, _, samples, hists),) = _out(raw)
    assert name == "rpc_seconds" and hists == 0
    assert [(_stale(v), t) for v, t in samples] == [
        (False, 1001), (False, 1003), (True, 1000), (True, 1002), (True, 1004)]
    assert _splice.convert_v2_form(raw)[1:] == (3, 3)  # type: ignore[index]
    # with custom-bucket data: the series is sent for its samples, the markers end the
    # classic series
    raw = _series(("sample", {}), ("histogram", NHCB), ("histogram", MARKER), ("sample", {}))
    native_only(raw)
    got = _out(raw)
    assert got[0][2] == [(0.0, 1000), (3.0, 1003)] and len(got) == 1 + 5 + 5


def test_several_markers_beside_exponential_data_stay_histograms_after_it() -> None:
    raw = _series(("histogram", MARKER), ("histogram", EXPONENTIAL), ("histogram", MARKER),
                  ("histogram", EXPONENTIAL), ("sample", {}))
    native_only(raw)
    (ts,) = remote_pb2.WriteRequest.FromString(conversion.v2_to_v1(raw)).timeseries
    assert [(h.timestamp, _stale(h.sum)) for h in ts.histograms] == [
        (1001, False), (1003, False), (1000, True), (1002, True)]
    assert _splice.convert_v2_form(raw)[1:] == (0, 0)  # type: ignore[index]


def test_custom_and_exponential_data_and_markers_in_one_series() -> None:
    # an exponential histogram beside: Prometheus' markers stay histograms; the
    # custom-bucket ones still end their classic series
    raw = _series(("histogram", NHCB), ("histogram", MARKER), ("histogram", EXPONENTIAL),
                  ("histogram", {**MARKER, "schema": -53}), ("histogram", MARKER))
    native_only(raw)
    got = _out(raw)
    assert got[0][3] == 3 and len(got) == 1 + 5 + 5


def test_many_markers_borrowing_long_bounds_are_counted_in_linear_time() -> None:
    # one histogram of 20,000 bounds and 4,000 markers that take them: 80M classic series
    # (GBs), counted (the size pass) without walking each marker's bounds
    bounds = [float(i) for i in range(20000)]
    nhcb = {"count_float": 1, "sum": 1.0, "schema": -53, "custom_values": bounds}
    few = _series(("histogram", nhcb), *[("histogram", MARKER)] * 2)
    many = _series(("histogram", nhcb), *[("histogram", MARKER)] * 4000)
    assert _splice.convert_v2(few) == convert.v1_form(few).size
    size = _splice.convert_v2(many)
    assert isinstance(size, int) and size > 4000 * 20000 * 30
    form = _splice.convert_v2_form(many)
    assert form is not None and form[1:] == (4001, 4001 * 20003)
    # as the proxy counts it: past the limit, nothing made
    with pytest.raises(convert.ConversionTooLarge):
        conversion.check_size(many, 64 << 20)
