"""The RW 1.0 splice in pure Python: the reference the native splice is held equal to.

Every series of a WriteRequest is walked field by field; the pod its labels name is
looked up in the pod table; a stamped series gets its labels rewritten (the sender's
labels of stamped names dropped, the stamp merged in, sorted by name), and every other
byte of the request (samples, exemplars, histograms, metadata, unknown fields, series
that keep their labels) is copied as a span of the input. ``docs/wire.md`` explains why
that is sound.
"""

from __future__ import annotations

from proxy.compression import DecodeError
from proxy.wire.plan import (
    PodStamp,
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
    check_exemplar_v1,
    check_fields,
    check_histogram,
    check_utf8,
    encode_uvarint,
    invalid,
    parse_label,
    read_field,
)

#: (name, value, the Label field's bytes as they were sent or as the stamp encodes them)
LabelField = tuple[bytes, bytes, bytes]


def merge(labels: list[LabelField], stamp: PodStamp, plan: SplicePlan) -> list[LabelField]:
    """The series' labels minus those the plan drops, plus the stamp, sorted by name.

    Byte order of UTF-8 names is code-point order, Prometheus' order.
    """
    kept = [lf for lf in labels if not plan.dropped(lf[0])]
    add = [(n, v, f) for (n, v), f in zip(stamp.labels, stamp.fields, strict=True)]
    return sorted(kept + add, key=lambda lf: lf[0])


def splice_v1(raw: bytes, plan: SplicePlan, table: PodTable) -> SpliceResult:
    """Stamp every series of a 1.0 request whose pod the table knows."""
    n = len(raw)
    result = SpliceResult(raw, Counts())
    out: list[bytes] = []
    copy_from = 0
    pos = 0
    while pos < n:
        number, wt, s, q = read_field(raw, pos, n)
        if number in (4, 5) and wt == 2:
            # RW 2.0's symbols / timeseries: read as 1.0 it would be an empty request, 2xx'd
            raise DecodeError(
                "protocol_mismatch", 400,
                "the body is an RW 2.0 request (symbols / timeseries fields 4, 5) but the "
                "Content-Type says RW 1.0: send it as "
                "application/x-protobuf;proto=io.prometheus.write.v2.Request")
        if number == 1:
            if wt != 2:
                raise invalid("timeseries field with a wrong wire type")
            new = _series(raw, s, q, plan, table, result)
            if new is not None:
                out.append(raw[copy_from:pos])
                out.append(new)
                copy_from = q
        pos = q
    if out:
        out.append(raw[copy_from:])
        result.body = b"".join(out)
    return result


def series_before(raw: bytes | memoryview, end: int) -> int:
    """How many series fields the request has before offset ``end`` (a cut of
    :func:`split_points`): what a part's refusal adds to the index of the series it names
    (:func:`proxy.wire.plan.renumbered`). Read only for a part that was refused."""
    head = bytes(raw[:end])
    count = pos = 0
    while pos < end:
        number, wt, _, pos = read_field(head, pos, end)
        count += number == 1 and wt == 2
    return count


def split_points(raw: bytes, pieces: int) -> list[int]:
    """Where a 1.0 request can be cut into ``pieces`` parts spliced apart: after the first
    top-level field that ends at or past each ``k / pieces`` of the body, never at its end.

    Sound because the 1.0 splice keeps no state across top-level fields: the spliced parts,
    concatenated, are the spliced whole, and its first error is the first part's that has
    one. A field that cannot be read means no cut (the whole request gets the error).
    """
    if pieces < 1:
        raise ValueError("pieces must be at least 1")
    n = len(raw)
    cuts: list[int] = []
    pos = 0
    k = 1
    while pos < n and k < pieces:
        try:
            pos = read_field(raw, pos, n)[3]
        except DecodeError:
            return []
        if pos < n and pos >= n * k // pieces:
            cuts.append(pos)
            k += 1
    return cuts


def _series(raw: bytes, s: int, q: int, plan: SplicePlan, table: PodTable,
            result: SpliceResult) -> bytes | None:
    """The new TimeSeries field, or None when the series keeps its bytes."""
    counts = result.counts
    counts.series += 1
    labels: list[LabelField] = []
    other: list[tuple[int, int]] = []
    lead_end = s  # end of the labels while they are all in front; -1 once they are not
    p = s
    while p < q:
        number, wt, ps, pq = read_field(raw, p, q)
        if number == 1:
            if wt != 2:
                raise invalid("label field with a wrong wire type")
            name, value = parse_label(raw, ps, pq)
            labels.append((name, value, raw[p:pq]))
            if other:
                lead_end = -1
            elif lead_end >= 0:
                lead_end = pq
        else:
            if number in (2, 3, 4):
                if wt != 2:
                    raise invalid("series data field with a wrong wire type")
                if number == 2:
                    counts.samples += 1
                    check_fields(raw, ps, pq, SAMPLE_WIRE_TYPES[:2], "sample")
                elif number == 3:
                    counts.exemplars += 1
                    check_exemplar_v1(raw, ps, pq)
                else:
                    counts.histograms += 1
                    check_histogram(raw, ps, pq, 16)
            other.append((p, pq))
        p = pq
    pairs = [lf[:2] for lf in labels]
    with naming_series(counts.series - 1, pairs):
        for name, value, _ in labels:
            check_utf8(name, "label name")
            check_utf8(value, "label value")
        check_names([lf[0] for lf in labels])
        decision = decide(plan, pairs, table.get)
        result.decided(decision)
        reason, stamp = decision.reason, decision.stamp
        if stamp is None or not stamp.labels:
            kept = labels  # nothing to drop, or ``keep``: the sender's attribution passes
            if plan.drop_sent and not (stamp is None and not reason):
                kept = [lf for lf in labels if not plan.dropped(lf[0])]
                if len(kept) != len(labels):
                    check_kept(v for _, v, _ in kept)
                    result.stripped += 1
            if len(kept) == len(labels) and names_sorted([lf[0] for lf in labels]):
                return None
            # a sender that does not sort would reach the TSDB so: the labels go out sorted
            new = b"".join(lf[2] for lf in sorted(kept, key=lambda lf: lf[0]))
        else:
            new = b"".join(lf[2] for lf in merge(labels, stamp, plan))
            if new == b"".join(lf[2] for lf in labels):
                return None  # already exactly so: the bytes pass through untouched
            result.stripped += any(plan.dropped(n) and (n, v) not in stamp.labels
                                   for n, v, _ in labels)
    rest = raw[lead_end:q] if lead_end >= 0 else b"".join(raw[a:b] for a, b in other)
    return b"\x0a" + encode_uvarint(len(new) + len(rest)) + new + rest

