"""A remote-write request cut at series boundaries into parts that are requests of their own.

Used when the upstream refuses a request as too large (413, its size limit): the proxy's
stamp makes a body bigger than what the sender sized under that limit, so the proxy sends
it in parts instead of letting the sender drop the batch. Every part is a valid request
of the same protocol, and the parts together carry every series exactly once:

- RW 1.0: the series (field 1) are shared out; every other top-level field (metadata,
  unknown fields) goes with the first part only, once (or with the last, ``other_last``:
  the fact writer's halves, whose metadata has always followed its series).
- RW 2.0: the series (field 5) are shared out, each part with a symbols table of its
  own: the strings its series refer to (labels, exemplar labels, metadata help and unit),
  in their order in the whole table, its series' refs renumbered. The label strings are
  most of an RW 2.0 body (74% of a 2,000-series cAdvisor request), so parts that each
  carried the whole table were 91% of the whole at halves and 83% at sixteenths: a
  request over the upstream's limit by more than that could never be cut under it. The
  renumbering is made from the refs the part's series use (its cost follows the part, not
  the table: a part of a request with 2M symbols, most of them unused, walked all 2M).
  Every other top-level field goes with the first part only, once, as in RW 1.0: RW 2.0
  defines no top-level field but ``symbols`` and ``timeseries`` (1-3 reserved), so any
  other is unknown to every receiver, which skips it (protobuf's rule for unknown fields);
  copied into every part, one bigger than the upstream's limit made every part refused,
  31 posts for one request.

RW 1.0 fields keep their relative order, and a run of adjacent series is one slice of the
input: a part is a join of a few spans, never a re-encoding. An RW 2.0 part is re-encoded
only where refs are (``labels_refs``, an exemplar's ``labels_refs``, a metadata's
``help_ref`` / ``unit_ref``); every other field keeps its bytes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
import threading
import typing
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.wire.convert import exemplar_v2, metadata_v2
from proxy.wire.native import field_count, field_ends
from proxy.wire.primitives import (
    Counts,
    Protocol,
    encode_refs,
    encode_uvarint,
    invalid,
    len_field,
    read_field,
    read_refs,
)

#: the field number of a series in each protocol's request message
SERIES_FIELD = {Protocol.V1: 1, Protocol.V2: 5}
#: a series' sample, histogram and exemplar field numbers in each protocol
_DATA_FIELDS = {Protocol.V1: (2, 4, 3), Protocol.V2: (2, 3, 4)}
#: what a layout holds per top-level field at most, while it is made (:func:`layout_bytes`):
#: the field's end (4 bytes, dropped once read), its start and end (8), its share of the
#: prefix sums (4), and the arrays' room to grow (1/8)
_BYTES_PER_FIELD = 20


class Span(NamedTuple):
    """One top-level field of the request: ``raw[start:end]``."""

    start: int
    end: int


class Spans:
    """Fields of a request as two arrays of offsets, 8 bytes a field: a list of
    :class:`Span` was ~150 bytes a field, one field a series, and a request the upstream
    refuses for its size has hundreds of thousands (its memory was never charged)."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts = array("I")
        self.ends = array("I")

    def append(self, start: int, end: int) -> None:
        self.starts.append(start)
        self.ends.append(end)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Span:
        return Span(self.starts[i], self.ends[i])

    def pairs(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of fields ``lo:hi``, made one at a time."""
        hi = len(self) if hi is None else hi
        return zip(itertools.islice(self.starts, lo, hi),
                   itertools.islice(self.ends, lo, hi), strict=True)

    @property
    def nbytes(self) -> int:
        return (self.starts.itemsize * self.starts.buffer_info()[1]
                + self.ends.itemsize * self.ends.buffer_info()[1])


class _Renumber(typing.Protocol):
    """A symbol's new ref plus one, by its old ref (an ``array`` over the whole table, or
    a ``dict`` of the refs a part uses)."""

    def __getitem__(self, ref: int, /) -> int: ...


#: a part that uses fewer than one symbol in this many is renumbered sparsely (a dict of
#: its refs, sorted: ~140 bytes and a log factor a ref), else over the table (an array of
#: 4 bytes a symbol, made at C speed): either way under ~5 bytes a symbol of the table, and
#: time that follows the part's refs, not the table
_SPARSE = 32


@dataclass(slots=True)
class _Marks:
    """A byte a symbol of the whole table, zero but while a part is made (the symbols its
    series use marked), made once per layout: a table of 2M mostly unused symbols cost
    every part a 2M-entry walk when each part made its own. The lock keeps two parts of one
    layout from sharing it at once (the upstream makes them one at a time)."""

    used: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True, frozen=True)
class Layout:
    """A request's top-level fields: its series, and the rest."""

    raw: bytes
    protocol: Protocol
    series: Spans
    #: every other top-level field but the RW 2.0 symbols (RW 1.0 metadata, unknown fields)
    other: Spans
    #: ``prefix[i]``: the bytes of ``series[:i]``, to cut a range at its middle byte
    prefix: array[int]
    #: RW 2.0: the request's ``symbols`` fields, the table in order (empty for 1.0)
    symbols: Spans
    #: the bytes of ``other`` and of ``symbols``, summed once: a part's bound is asked for
    #: every part, and the sum over a table of 2M symbols was a walk of 2M each time
    other_bytes: int = 0
    symbol_bytes: int = 0
    _marks: _Marks = field(default_factory=_Marks)

    @property
    def nbytes(self) -> int:
        """What the layout holds beside ``raw``."""
        return (self.series.nbytes + self.other.nbytes + self.symbols.nbytes
                + self.prefix.itemsize * self.prefix.buffer_info()[1]
                + len(self._marks.used))

    def middle(self, lo: int, hi: int) -> int:
        """Where ``series[lo:hi]`` (two series at least) is cut into two halves of about
        equal bytes, each with one series at least: halves by bytes, not by count, since
        one series may be far bigger than the others (a histogram, many samples)."""
        if hi - lo < 2:
            raise ValueError("a range of one series has no middle")
        target = (self.prefix[lo] + self.prefix[hi]) / 2
        return min(max(bisect.bisect_left(self.prefix, target, lo + 1, hi), lo + 1), hi - 1)

    def floor(self, lo: int, hi: int, *, other_last: bool = False) -> int:
        """The bytes the part of ``series[lo:hi]`` carries whatever series it holds: the
        other top-level fields, when it is the part that takes them (the first; the last
        under ``other_last``). No part cut from it is smaller, so a part
        whose floor is at least a body the upstream refused as too large is refused too
        (``proxy.upstream``)."""
        with_other = hi == len(self.series) if other_last else lo == 0
        return self.other_bytes if with_other else 0

    def part_bytes(self, lo: int, hi: int) -> int:
        """The most the request of ``series[lo:hi]`` can be (an RW 2.0 part may carry
        every symbol), and what making it holds beside, to charge it before it is made.
        Known in constant time."""
        series = self.prefix[hi] - self.prefix[lo]
        other = self.floor(lo, hi)
        if self.protocol is Protocol.V1:
            return series + other
        # the refs renumbered may each take a byte more; its work: a ref is a byte at
        # least, so it uses at most ``series`` symbols, renumbered under ~5 bytes a symbol
        work = 5 * min(len(self.symbols), series)
        return series * 2 + other + self.symbol_bytes + work

    def part(self, lo: int, hi: int, *, other_last: bool = False) -> bytes:
        """The request of ``series[lo:hi]`` (see the module's rules for the other fields).

        ``other_last``: an RW 1.0 request's other fields go with the part that ends at the
        last series rather than the one that starts at the first: the fact writer cut its
        refused requests so before it cut them here, and its bodies stay as they were."""
        if self.protocol is Protocol.V2:
            return self._part_v2(lo, hi)
        with_other = hi == len(self.series) if other_last else lo == 0
        shared = self.other.pairs() if with_other else iter(())
        spans = heapq.merge(shared, self.series.pairs(lo, hi))
        out: list[bytes] = []
        start = end = -1
        for s, e in spans:
            if s != end:
                if end >= 0:
                    out.append(self.raw[start:end])
                start = s
            end = e
        if end >= 0:
            out.append(self.raw[start:end])
        return b"".join(out)

    def counts(self, lo: int, hi: int) -> Counts:
        """What ``series[lo:hi]`` carries: a part the upstream stored has no Written
        headers of its own when it went out as RW 1.0, or when the proxy knows it stored
        only from a later refusal (``proxy.upstream``); read series by series, on the rare
        paths that need it."""
        samples, histograms, exemplars = _DATA_FIELDS[self.protocol]
        out = Counts()
        raw = self.raw
        for s, e in self.series.pairs(lo, hi):
            _, _, p, q = read_field(raw, s, e)
            out.series += 1
            while p < q:
                number, _, _, p = read_field(raw, p, q)
                if number == samples:
                    out.samples += 1
                elif number == histograms:
                    out.histograms += 1
                elif number == exemplars:
                    out.exemplars += 1
        return out

    def _part_v2(self, lo: int, hi: int) -> bytes:
        """An RW 2.0 part with the symbols its series use, and nothing else of the table;
        the other top-level fields with the first part only.

        Its series are read twice (the symbols they use, then each written out renumbered)
        rather than held read: a series taken apart is ~1 KiB of Python objects, and a half
        of a big request has hundreds of thousands. The symbols used are marked in the
        layout's one byte a symbol and listed as found; the renumbering is made from that
        list (sorted), or, when the part uses one symbol in ``_SPARSE`` or more, over the
        table (its cost then follows the part's refs as well)."""
        raw, symbols = self.raw, self.symbols
        nsym = len(symbols)
        marks = self._marks
        with marks.lock:
            if len(marks.used) != nsym:
                marks.used = bytearray(nsym)
            used = marks.used
            listed: array[int] | None = array("I")
            sparse = nsym // _SPARSE
            try:
                for s, e in self.series.pairs(lo, hi):
                    for r in _SeriesRefs.of(raw, s, e, nsym).all():
                        if not used[r]:
                            used[r] = 1
                            if listed is not None:
                                listed.append(r)
                                if len(listed) > sparse:
                                    listed = None  # dense: over the table
                if nsym and not used[0]:
                    used[0] = 1
                    if listed is not None:
                        listed.append(0)
                return self._write_v2(lo, hi, listed)
            finally:
                if listed is None:
                    used[:] = bytes(nsym)
                else:
                    for r in listed:
                        used[r] = 0

    def _write_v2(self, lo: int, hi: int, listed: array[int] | None) -> bytes:
        """The part of ``series[lo:hi]``, the symbols it uses marked (``listed``: them, or
        None when they are many)."""
        raw, symbols = self.raw, self.symbols
        nsym = len(symbols)
        view = memoryview(raw)
        out = bytearray()
        renumber: _Renumber
        if listed is None:
            renumber = array("I", itertools.accumulate(self._marks.used))
            for s, e in itertools.compress(symbols.pairs(), self._marks.used):
                out += view[s:e]
        else:
            order = sorted(listed)
            renumber = {r: i for i, r in enumerate(order, 1)}
            starts, ends = symbols.starts, symbols.ends
            for r in order:
                out += view[starts[r]:ends[r]]
            del order
        if lo == 0:
            for s, e in self.other.pairs():
                out += view[s:e]
        for s, e in self.series.pairs(lo, hi):
            out += len_field(5, _SeriesRefs.of(raw, s, e, nsym).encode(raw, renumber))
        return bytes(out)


#: the one-byte tag of an RW 2.0 ``symbols`` field (4, length-delimited)
_SYMBOLS_TAG = 4 << 3 | 2


@dataclass(slots=True)
class _SeriesRefs:
    """One RW 2.0 series' fields, with every symbol ref it holds read out."""

    #: (field number, field start, field end, payload start) in request order
    fields: list[tuple[int, int, int, int]]
    labels: list[int]
    #: per exemplar field (in order): its label refs and its other fields
    exemplars: list[tuple[list[int], list[bytes]]]
    #: per metadata field (in order): (help_ref, unit_ref)
    metadata: list[tuple[int, int]]

    @classmethod
    def of(cls, raw: bytes, start: int, end: int, nsym: int) -> _SeriesRefs:
        """The series at ``raw[start:end]`` (its TimeSeries field), read once and not
        checked again: the splice checked every field of this body, and a part reads each
        series twice (samples were 40% of the time cutting a 620k-series request)."""
        _, _, p, q = read_field(raw, start, end)  # the TimeSeries field itself
        fields: list[tuple[int, int, int, int]] = []
        labels: list[int] = []
        exemplars: list[tuple[list[int], list[bytes]]] = []
        metadata: list[tuple[int, int]] = []
        while p < q:
            number, wt, ps, fq = read_field(raw, p, q)
            if number == 1:
                read_refs(raw, wt, ps, fq, labels, "labels_refs")
            else:
                fields.append((number, p, fq, ps))
                if number == 4:
                    exemplars.append(exemplar_v2(raw, ps, fq, nsym))
                elif number == 5:
                    _, help_ref, unit_ref = metadata_v2(raw, ps, fq)
                    if max(help_ref, unit_ref) >= nsym:
                        raise invalid(f"metadata symbol reference past the table of {nsym}")
                    metadata.append((help_ref, unit_ref))
            p = fq
        return cls(fields, labels, exemplars, metadata)

    def all(self) -> list[int]:
        return [*self.labels, *(r for x, _ in self.exemplars for r in x),
                *(r for m in self.metadata for r in m)]

    def encode(self, raw: bytes, renumber: _Renumber) -> bytes:
        """The series with its refs renumbered (``renumber[old] - 1``), its other fields
        as they were."""
        out = [len_field(1, encode_refs([renumber[r] - 1 for r in self.labels]))]
        exemplars, metadata = iter(self.exemplars), iter(self.metadata)
        for number, s, e, ps in self.fields:
            if number == 4:
                refs, rest = next(exemplars)
                labels = (len_field(1, encode_refs([renumber[r] - 1 for r in refs])) if refs
                          else b"")
                out.append(len_field(4, labels + b"".join(rest)))
            elif number == 5:
                help_ref, unit_ref = next(metadata)
                out.append(len_field(5, _metadata_with(raw, ps, e, renumber[help_ref] - 1,
                                                       renumber[unit_ref] - 1)))
            else:
                out.append(raw[s:e])
        return b"".join(out)


def _metadata_with(raw: bytes, p: int, end: int, help_ref: int, unit_ref: int) -> bytes:
    """A Metadata message with ``help_ref`` (3) and ``unit_ref`` (4) set anew."""
    out: list[bytes] = []
    while p < end:
        number, _, _, q = read_field(raw, p, end)
        if number not in (3, 4):
            out.append(raw[p:q])
        p = q
    if help_ref:
        out.append(b"\x18" + encode_uvarint(help_ref))
    if unit_ref:
        out.append(b"\x20" + encode_uvarint(unit_ref))
    return b"".join(out)


def layout_bytes(raw: bytes) -> int:
    """The most :func:`layout` of ``raw`` holds beside ``raw`` while it is made, known
    before: a request cut in parts charges it to its byte budget first. ``DecodeError``
    for a body that cannot be read."""
    return _BYTES_PER_FIELD * field_count(raw)


def layout(raw: bytes, protocol: Protocol) -> Layout:
    """The top-level fields of a request; ``DecodeError`` for one that cannot be read (a
    body the splice accepted always can).

    The field ends come from the native ``field_ends`` (4 bytes a field, and 10x faster
    than reading them here), and a series is told by its first byte, the one-byte tag of
    a length-delimited field 1 (RW 1.0) or 5 (RW 2.0): the first byte of a longer tag has
    its high bit set; so is an RW 2.0 ``symbols`` field (4). Offsets are 4 bytes: the
    bodies cut so are the proxy's own, far under 4 GiB."""
    tag = SERIES_FIELD[protocol] << 3 | 2
    symbols_tag = _SYMBOLS_TAG if protocol is Protocol.V2 else -1
    series, other, symbols = Spans(), Spans(), Spans()
    start = 0
    for end in field_ends(raw):
        first = raw[start]
        if first == tag:
            series.append(start, end)
        elif first == symbols_tag:
            symbols.append(start, end)
        else:
            other.append(start, end)
        start = end
    prefix = array("I", itertools.accumulate(
        map(operator.sub, series.ends, series.starts), initial=0))
    return Layout(raw, protocol, series, other, prefix, symbols,
                  sum(map(operator.sub, other.ends, other.starts)),
                  sum(map(operator.sub, symbols.ends, symbols.starts)))
