"""Cutting a request at series boundaries (proxy.wire.halves): parts are requests of their
own, every series in exactly one, halves by bytes."""

from __future__ import annotations

import dataclasses
import random
import tracemalloc
from array import array
from collections.abc import Iterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.compression import DecodeError
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2
from proxy.wire.halves import Spans, layout
from proxy.wire.primitives import Protocol, encode_uvarint

WriteRequest: Any = cast(Any, remote_pb2).WriteRequest
RequestV2: Any = cast(Any, v2).Request


def v1(sizes: list[int]) -> bytes:
    """Series whose label values are ``sizes`` bytes long, metadata between and after."""
    req = WriteRequest()
    for i, n in enumerate(sizes):
        ts = req.timeseries.add()
        ts.labels.add(name="pod", value=str(i) * n)
        ts.samples.add(value=float(i), timestamp=i)
    req.metadata.add(type=1, metric_family_name="m", help="h")
    return req.SerializeToString()


def test_the_middle_is_by_bytes_and_leaves_a_series_on_each_side() -> None:
    lay = layout(v1([1000, 10, 10, 10]), Protocol.V1)
    assert lay.middle(0, 4) == 1  # the big one alone: the others together are smaller
    assert lay.middle(1, 4) in (2, 3)  # three of a size: either is a half
    assert lay.middle(2, 4) == 3
    lay = layout(v1([10, 10, 10, 1000]), Protocol.V1)
    assert lay.middle(0, 4) == 3
    with pytest.raises(ValueError):
        lay.middle(2, 3)


def test_v1_parts_share_the_series_and_the_first_takes_the_rest() -> None:
    raw = v1([5, 6, 7, 8, 9])
    lay = layout(raw, Protocol.V1)
    assert len(lay.series) == 5 and len(lay.other) == 1
    first, second = WriteRequest.FromString(lay.part(0, 2)), WriteRequest.FromString(lay.part(2, 5))
    whole = WriteRequest.FromString(raw)
    assert list(first.timeseries) + list(second.timeseries) == list(whole.timeseries)
    assert len(first.metadata) == 1 and len(second.metadata) == 0
    assert lay.part(0, 5) == raw  # one slice: the whole, byte for byte


def test_v1_other_fields_go_with_the_last_part_when_asked() -> None:
    """The fact writer's halves: its metadata follows its series, and goes with the half
    that ends at the last series."""
    raw = v1([5, 6, 7, 8, 9])
    lay = layout(raw, Protocol.V1)
    first = lay.part(0, 2, other_last=True)
    second = lay.part(2, 5, other_last=True)
    assert not WriteRequest.FromString(first).metadata
    assert len(WriteRequest.FromString(second).metadata) == 1
    assert first + second == raw  # series in order, the metadata after them, once
    assert lay.part(1, 2, other_last=True) == lay.part(1, 2)  # neither end: series alone
    assert lay.part(0, 5, other_last=True) == raw


def resolved(req: Any) -> list[Any]:
    """A 2.0 request's series with every ref resolved: what a receiver reads of them."""
    syms = list(req.symbols)

    def labels(refs: Any) -> list[tuple[str, str]]:
        return [(syms[refs[i]], syms[refs[i + 1]]) for i in range(0, len(refs), 2)]

    return [(labels(t.labels_refs), [s.SerializeToString() for s in t.samples],
             [h.SerializeToString() for h in t.histograms],
             [(labels(e.labels_refs), e.value, e.timestamp) for e in t.exemplars],
             (t.metadata.type, syms[t.metadata.help_ref], syms[t.metadata.unit_ref]))
            for t in req.timeseries]


def used_strings(req: Any) -> set[str]:
    syms = list(req.symbols)
    refs = [r for t in req.timeseries for r in (
        *t.labels_refs, *(r for e in t.exemplars for r in e.labels_refs),
        t.metadata.help_ref, t.metadata.unit_ref)]
    return {syms[r] for r in refs}


def test_v2_parts_each_carry_the_symbols_their_series_use() -> None:
    # the label strings are most of an RW 2.0 body: parts that each carried the whole
    # table were 91% of the whole at halves, so a request well over a limit stayed over
    req = RequestV2()
    req.symbols.extend(["", "pod", "a", "b", "c", "trace", "t1", "help me", "s"])
    for ref in (2, 3, 4):
        ts = req.timeseries.add()
        ts.labels_refs.extend([1, ref])
        ts.samples.add(value=1.0, timestamp=ref)
    req.timeseries[2].exemplars.add(labels_refs=[5, 6], value=2.0, timestamp=4)
    req.timeseries[2].metadata.type = 2
    req.timeseries[2].metadata.help_ref = 7
    req.timeseries[2].metadata.unit_ref = 8
    raw = req.SerializeToString()
    lay = layout(raw, Protocol.V2)
    parts = [RequestV2.FromString(lay.part(a, b)) for a, b in ((0, 1), (1, 3))]
    assert [list(p.symbols) for p in parts] == [
        ["", "pod", "a"], ["", "pod", "b", "c", "trace", "t1", "help me", "s"]]
    assert [r for p in parts for r in resolved(p)] == resolved(req)
    assert RequestV2.FromString(lay.part(0, 3)) == req


@settings(max_examples=150, deadline=None)
@given(rnd=st.randoms(use_true_random=False), cut=st.integers(1, 9))
def test_v2_parts_resolve_to_the_whole_with_only_their_own_strings(
        rnd: random.Random, cut: int) -> None:
    names = ["__name__", "pod", "namespace", "le", "karta_workload", "ü", ""]
    req = RequestV2()
    req.symbols.extend([""] + [rnd.choice(names) + str(rnd.randrange(5)) for _ in range(30)]
                       + ["", "dup", "dup"])
    nsym = len(req.symbols)
    for i in range(10):
        ts = req.timeseries.add()
        for _ in range(rnd.randrange(1, 4)):
            ts.labels_refs.extend([rnd.randrange(1, nsym), rnd.randrange(nsym)])
        ts.samples.add(value=float(i), timestamp=i)
        if rnd.random() < 0.4:
            ts.exemplars.add(labels_refs=[rnd.randrange(nsym), rnd.randrange(nsym)],
                             value=1.5, timestamp=i)
        if rnd.random() < 0.3:
            ts.histograms.add(count_int=3, sum=1.0, schema=1, timestamp=i)
        if rnd.random() < 0.5:
            ts.metadata.type = rnd.randrange(8)
            ts.metadata.help_ref = rnd.randrange(nsym)
            ts.metadata.unit_ref = rnd.randrange(nsym)
    raw = req.SerializeToString()
    lay = layout(raw, Protocol.V2)
    parts = [RequestV2.FromString(lay.part(a, b)) for a, b in ((0, cut), (cut, 10))]
    assert [r for p in parts for r in resolved(p)] == resolved(req)
    for p in parts:  # symbol 0 and the strings its series use, each ref'd string kept
        assert p.symbols[0] == ""
        assert set(p.symbols[1:]) <= used_strings(p) | {""}


def test_unknown_fields_of_long_tags_stay_with_the_first_part_and_bad_bodies_raise() -> None:
    raw = v1([3, 4])
    # field 16, length-delimited: a two-byte tag whose first byte is 0x82
    unknown = encode_uvarint(16 << 3 | 2) + b"\x02" + b"\x0a\x00"
    lay = layout(unknown + raw, Protocol.V1)
    assert len(lay.series) == 2 and len(lay.other) == 2
    assert lay.part(1, 2) == raw[lay.series[1].start - len(unknown):lay.series[1].end
                                 - len(unknown)]
    assert lay.part(0, 1).startswith(unknown)
    one = layout(raw[:lay.series[0].end - len(unknown)], Protocol.V1)  # one field alone
    assert len(one.series) == 1 and not one.other
    with pytest.raises(DecodeError):
        layout(raw[:-1], Protocol.V1)


def _many_series(protocol: Protocol, n: int) -> bytes:
    if protocol is Protocol.V1:
        req = WriteRequest()
        for i in range(n):
            ts = req.timeseries.add()
            ts.labels.add(name="pod", value=f"p{i}")
            ts.samples.add(value=1.0, timestamp=i)
        return cast(bytes, req.SerializeToString())
    req2 = RequestV2()
    req2.symbols.extend(["", "pod"])
    for i in range(n):
        req2.symbols.append(f"p{i}")
        ts2 = req2.timeseries.add()
        ts2.labels_refs.extend([1, 2 + i])
        ts2.samples.add(value=1.0, timestamp=i)
    return cast(bytes, req2.SerializeToString())


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
def test_cutting_holds_no_python_object_per_series(protocol: Protocol) -> None:
    # a 413 for a 620k-series RW 2.0 request held 526 MiB (a Span per series, a parsed
    # series per series of a part), none of it charged to the byte budget: the layout
    # holds offsets (a few bytes a series), a part only itself and a byte a symbol
    n = 20_000
    raw = _many_series(protocol, n)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        lay = layout(raw, protocol)
        held = tracemalloc.get_traced_memory()[0] - before
        assert held <= 24 * n + 4096, held  # offsets: 12 bytes a series, 8 a symbol
        tracemalloc.reset_peak()
        at = tracemalloc.get_traced_memory()[0]
        half = lay.part(0, lay.middle(0, n))
        peak = tracemalloc.get_traced_memory()[1] - at
    finally:
        tracemalloc.stop()
    assert peak <= 3 * len(half) + 5 * (n + 2) + 65536, (peak, len(half))
    assert len(half) < len(raw)


class _CountingSpans(Spans):
    """Spans that count the fields read through them (``pairs``, ``[i]``, the offset
    arrays' items): the work a part does over the symbols table."""

    __slots__ = ("counted", "read")

    def __init__(self, of: Spans) -> None:
        super().__init__()
        self.counted = (_CountingArray("I", of.starts), _CountingArray("I", of.ends))
        self.starts, self.ends = self.counted
        self.read = 0

    def pairs(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, int]]:
        for pair in super().pairs(lo, hi):
            self.read += 1
            yield pair


class _CountingArray(array):  # type: ignore[type-arg,unused-ignore]
    """An ``array('I')`` whose items read one by one are counted."""

    read = 0

    def __getitem__(self, i: Any) -> Any:
        self.read += 1
        return super().__getitem__(i)


def test_an_rw2_part_reads_the_symbols_it_uses_not_the_whole_table() -> None:
    # a request with a 200k-symbol table its series barely use: each part walked the whole
    # table (a byte and an accumulated ref a symbol, compress over every span), 0.9 CPU-s
    # a request at 250k symbols; now what it reads follows its own refs
    unused = 200_000
    req = RequestV2()
    req.symbols.extend(["", "__name__", "m", "pod"] + [""] * unused)
    for i in range(64):
        req.symbols.append(f"p{i}")
        ts = req.timeseries.add()
        ts.labels_refs.extend([1, 2, 3, 4 + unused + i])
        ts.samples.add(value=1.0, timestamp=i)
    lay = layout(req.SerializeToString(), Protocol.V2)
    counting = _CountingSpans(lay.symbols)
    lay = dataclasses.replace(lay, symbols=counting)
    for lo, hi in ((0, 32), (32, 64), (0, 16), (16, 32)):
        got = RequestV2.FromString(lay.part(lo, hi))
        assert list(got.symbols) == ["", "__name__", "m", "pod"] + [f"p{i}" for i in
                                                                     range(lo, hi)]
        lay.part_bytes(lo, hi)
    read = counting.read + sum(a.read for a in counting.counted)
    assert read <= 2 * 4 * (3 + 32 + 1), read  # the symbols used, start and end each
