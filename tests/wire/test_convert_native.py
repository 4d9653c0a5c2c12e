"""The native RW 2.0 -> 1.0 conversion (``_convert.c``) against the reference
(``proxy/wire/convert.py``), on random requests.

The contract (``proxy/wire/conversion.py``): for a request it takes, the native size is
``convert.v1_form(raw).size`` (and the counts do not change) and its bytes are
``convert.v2_to_v1(raw)``; a request holding a custom-bucket histogram or a histogram
staleness marker, and every request the reference refuses, it leaves to the reference
(``None``), so the dispatching functions answer or raise exactly what the reference does.

Requests come from ``fuzz_native.conversion_v2`` (driven by hypothesis' ``st.randoms()``,
as in ``test_native_differential.py``): the splice's RW 2.0 generator plus metric names of
every family suffix, metadata of every type with empty or repeated help and unit symbols,
exponential histograms of every shape; invalid ones are poisoned or byte-mutated.
"""

from __future__ import annotations

import random
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
    conversion_v2,
    encode,
    mutate,
    poison,
)
from tests.wire.test_convert import _many_kinds, marked, nhcb_v2
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
    if size is None:
        return "fallback"
    assert size == form.size, f"size {size!r} != {form.size}: {raw.hex()}"
    assert isinstance(size, int)
    assert form.histograms == form.samples == 0
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
def test_custom_buckets_and_staleness_markers_fall_back(rnd: random.Random) -> None:
    """Every request with a custom-bucket histogram or a histogram staleness marker goes
    to the reference (the classic series, the marker rules: convert.py's own)."""
    raw = encode(conversion_v2(rnd, special=True))
    assert check(raw) in ("fallback", "refused"), raw.hex()
    assert _splice.convert_v2(raw) is None


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
EXPECT = {"histogram, schema -53 then 0": "native", "histogram, schema 0 then -53": "fallback",
          "histogram, stale sum then not": "native", "histogram, stale sum": "fallback",
          "a stale float sample": "native", "markers": "fallback", "nhcb": "fallback",
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
    raws = [encode(conversion_v2(rnd, series=(50, 100))) for _ in range(8)]
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


def _mixed_request(n: int) -> bytes:
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


def test_only_the_series_the_native_leaves_are_converted_by_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # one custom-bucket histogram sent the whole request to the reference: 32k series
    # took 1.58 CPU-s against 0.06 natively. Now the reference walks those series alone
    # (and the native conversion the rest), and the bytes, size and counts are its own
    raw = _mixed_request(3000)
    body, form = convert.v2_to_v1(raw), convert.v1_form(raw)
    walked: list[int] = []
    real = convert._series_v1

    def spy(raw_v2: bytes, syms: Any, series: Any, metadata: Any) -> Any:
        count = 0
        for ser in real(raw_v2, syms, series, metadata):
            count += 1
            yield ser
        walked.append(count)
        assert len(syms) <= 8  # the symbols of one series, not the table of 3,000

    monkeypatch.setattr(convert, "_series_v1", spy)
    got = conversion.check_size(raw, None)
    assert got == form and form.histograms == 2 and form.samples == 3 + 2 + 1
    assert conversion.v2_to_v1(raw, got.size) == body
    assert conversion.v2_to_v1(raw) == body
    assert len(body) == form.size
    # each pass: the two series alone, once each (size, then bytes; the size pass also
    # reads their labels alone); never the 3,000 others
    assert walked and max(walked) == 1 and sum(walked) == 2 * 3, walked
