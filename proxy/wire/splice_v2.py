"""The RW 2.0 splice in pure Python: the reference the native splice is held equal to.

A 2.0 series names its labels by reference into the request's symbols table. A stamped
series gets a new ``labels_refs`` field: its kept labels keep their refs, the stamp's
strings take the ref of their first occurrence in the table or are appended to it (right
after the last symbols field, in the order first needed), so every ref already in the
request stays valid. The new refs field goes first in the series, followed by every other
field of it as it was. Nothing else of the request changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.compression import DecodeError
from proxy.wire.plan import (
    SplicePlan,
    SpliceResult,
    check_kept,
    check_names,
    decide,
    names_sorted,
    naming_series,
)
from proxy.wire.podtable import PodTable
from proxy.wire.primitives import (
    SAMPLE_WIRE_TYPES,
    Counts,
    check_exemplar_v2,
    check_fields,
    check_histogram,
    check_metadata_v2,
    check_utf8,
    encode_refs,
    encode_uvarint,
    invalid,
    len_field,
    read_field,
    read_refs,
)


@dataclass(slots=True)
class ScanV2:
    """Where things are in a 2.0 request."""

    symbols: list[bytes]
    #: end offset of the last symbols field (-1 when there is none)
    symbols_end: int
    #: (field start, payload start, field end) of every TimeSeries
    series: list[tuple[int, int, int]]


def scan_v2(raw: bytes) -> ScanV2:
    """The symbols (UTF-8 checked, the first one empty) and where each series is."""
    symbols: list[bytes] = []
    series: list[tuple[int, int, int]] = []
    symbols_end = -1
    pos = 0
    n = len(raw)
    while pos < n:
        number, wt, s, q = read_field(raw, pos, n)
        if number in (1, 3) and wt == 2:
            # reserved in 2.0: an RW 1.0 body would read as an empty 2.0 request, 2xx'd
            raise DecodeError(
                "protocol_mismatch", 400,
                "the body is an RW 1.0 request (timeseries / metadata fields 1, 3) but the "
                "Content-Type says RW 2.0: send it as application/x-protobuf")
        if number == 4:
            if wt != 2:
                raise invalid("symbols field with a wrong wire type")
            symbols.append(raw[s:q])
            symbols_end = q
        elif number == 5:
            if wt != 2:
                raise invalid("timeseries field with a wrong wire type")
            series.append((pos, s, q))
        pos = q
    for i, sym in enumerate(symbols):
        check_utf8(sym, f"symbol {i}")
    if symbols and symbols[0] != b"":
        raise invalid("symbols table must start with the empty string")
    return ScanV2(symbols, symbols_end, series)


@dataclass(slots=True)
class SeriesV2:
    """One 2.0 TimeSeries taken apart: label refs and the spans of everything else."""

    refs: list[int]
    other: list[tuple[int, int]]
    samples: int
    histograms: int
    exemplars: int


def split_series_v2(raw: bytes, p: int, end: int, nsym: int) -> SeriesV2:
    """The series' refs (an even number, each inside the table) and its other fields."""
    refs: list[int] = []
    other: list[tuple[int, int]] = []
    samples = histograms = exemplars = 0
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if number == 1:
            read_refs(raw, wt, s, q, refs, "labels_refs")
        else:
            if number in (2, 3, 4, 5):
                if wt != 2:
                    raise invalid("series data field with a wrong wire type")
                if number == 2:
                    samples += 1
                    check_fields(raw, s, q, SAMPLE_WIRE_TYPES, "sample")
                elif number == 3:
                    histograms += 1
                    check_histogram(raw, s, q, 17)
                elif number == 4:
                    exemplars += 1
                    check_exemplar_v2(raw, s, q, nsym)
                else:
                    check_metadata_v2(raw, s, q, nsym)
            other.append((p, q))
        p = q
    if len(refs) % 2:
        raise invalid("labels_refs has an odd number of entries")
    if refs and max(refs) >= nsym:
        raise invalid(f"symbol reference {max(refs)} past the table of {nsym}")
    return SeriesV2(refs, other, samples, histograms, exemplars)


class _Symbols:
    """The request's symbols as a stamp needs them: the first ref of each string, and
    the strings it had to add."""

    def __init__(self, symbols: list[bytes]) -> None:
        self.base = len(symbols)
        self.first = {s: i for i, s in reversed(list(enumerate(symbols)))}
        self.added: list[bytes] = []
        if not symbols:  # a table that is to hold anything starts with ""
            self.ref(b"")

    def ref(self, s: bytes) -> int:
        r = self.first.get(s)
        if r is None:
            r = self.first[s] = self.base + len(self.added)
            self.added.append(s)
        return r


def splice_v2(raw: bytes, plan: SplicePlan, table: PodTable) -> SpliceResult:
    """Stamp every series of a 2.0 request whose pod the table knows."""
    scan = scan_v2(raw)
    syms = scan.symbols
    result = SpliceResult(raw, Counts())
    counts = result.counts
    table_refs: _Symbols | None = None
    #: (start, end, replacement) of every changed series, in order
    edits: list[tuple[int, int, bytes]] = []
    for start, p, end in scan.series:
        ser = split_series_v2(raw, p, end, len(syms))
        counts.series += 1
        counts.samples += ser.samples
        counts.histograms += ser.histograms
        counts.exemplars += ser.exemplars
        refs = ser.refs
        labels = [(syms[refs[i]], syms[refs[i + 1]]) for i in range(0, len(refs), 2)]
        index = counts.series - 1
        with naming_series(index, labels):
            check_names([n for n, _ in labels])
            decision = decide(plan, labels, table.get)
        result.decided(decision)
        reason, stamp = decision.reason, decision.stamp
        #: (name, value, refs as sent; None: a stamp label's, found or added)
        kept: list[tuple[bytes, bytes, tuple[int, int] | None]] = [
            (n, v, (refs[2 * i], refs[2 * i + 1]))
            for i, (n, v) in enumerate(labels) if not plan.dropped(n)]
        if stamp is None or not stamp.labels:
            if not plan.drop_sent or (stamp is None and not reason):
                # nothing to drop, or ``keep``: the sender's attribution passes
                kept = [(n, v, (refs[2 * i], refs[2 * i + 1]))
                        for i, (n, v) in enumerate(labels)]
            elif len(kept) != len(labels):
                with naming_series(index, labels):
                    check_kept(v for _, v, _ in kept)
                result.stripped += 1
            if len(kept) == len(labels) and names_sorted([n for n, _ in labels]):
                continue
            merged = sorted(kept, key=lambda x: x[0])  # no string to add
        else:
            merged = sorted(kept + [(n, v, None) for n, v in stamp.labels],
                            key=lambda x: x[0])
            if [(n, v) for n, v, _ in merged] == labels:
                continue  # already exactly so
            result.stripped += any(plan.dropped(n) and (n, v) not in stamp.labels
                                   for n, v in labels)
            if table_refs is None:
                table_refs = _Symbols(syms)
        new_refs: list[int] = []
        for n, v, pair in merged:
            if pair is None:
                assert table_refs is not None
                pair = (table_refs.ref(n), table_refs.ref(v))
            new_refs.extend(pair)
        body = len_field(1, encode_refs(new_refs)) + b"".join(raw[a:b] for a, b in ser.other)
        edits.append((start, end, b"\x2a" + encode_uvarint(len(body)) + body))
    if not edits:
        return result
    at = scan.symbols_end if scan.symbols_end >= 0 else 0
    added = b"".join(len_field(4, s) for s in table_refs.added) if table_refs else b""
    out: list[bytes] = []
    copy_from = 0
    inserted = False
    for start, end, new in edits:
        if not inserted and at <= start:
            out.append(raw[copy_from:at])
            out.append(added)
            copy_from = at
            inserted = True
        out.append(raw[copy_from:start])
        out.append(new)
        copy_from = end
    if not inserted:
        out.append(raw[copy_from:at])
        out.append(added)
        copy_from = at
    out.append(raw[copy_from:])
    result.body = b"".join(out)
    return result
