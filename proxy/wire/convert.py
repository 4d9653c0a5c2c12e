"""RW 2.0 -> 1.0: a 2.0 request as the equivalent 1.0 WriteRequest, for 1.0-only upstreams.

Values, timestamps and histogram buckets keep their bytes: the field numbers of Sample and
Histogram agree between the versions. Only what 1.0 has no place for is dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from proxy.wire.primitives import (
    encode_label_v1,
    encode_uvarint,
    invalid,
    len_field,
    read_field,
    read_refs,
    uvarint,
)
from proxy.wire.splice_v2 import scan_v2, split_series_v2


def _check_refs(refs: Sequence[int], nsym: int) -> None:
    if refs and max(refs) >= nsym:
        raise invalid(f"symbol reference {max(refs)} past the table of {nsym}")


def _copy_fields(raw: bytes, p: int, end: int, skip: Collection[int]) -> bytes:
    """The fields of one message minus those numbered in ``skip``, bytes as they were."""
    parts: list[bytes] = []
    start = p
    while p < end:
        number, _, _, q = read_field(raw, p, end)
        if number in skip:
            parts.append(raw[start:p])
            start = q
        p = q
    parts.append(raw[start:end])
    return b"".join(parts)


def _labels_v1(refs: Sequence[int], syms: Sequence[bytes]) -> bytes:
    return b"".join(
        encode_label_v1(syms[refs[i]], syms[refs[i + 1]]) for i in range(0, len(refs), 2)
    )


class ConversionTooLarge(Exception):
    """An RW 2.0 request whose RW 1.0 form would be larger than an RW 1.0 request may be:
    RW 2.0 interns strings, so a small request (one long symbol named by many series) can
    convert to one hundreds or thousands of times its size."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"converted to RW 1.0 it would be {size} bytes, more than the "
                         f"{limit} an RW 1.0 request may be")
        self.size = size
        self.limit = limit


def _uvarint_size(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_size(payload: int) -> int:
    """Bytes of a length-delimited field of a number below 16 (one tag byte) holding
    ``payload`` bytes."""
    return 1 + _uvarint_size(payload) + payload


def _label_size(name: int, value: int) -> int:
    """Bytes of ``encode_label_v1`` of a name and value of these lengths."""
    return _field_size(_field_size(name) + (_field_size(value) if value else 0))


def _labels_size(refs: Sequence[int], lengths: Sequence[int]) -> int:
    return sum(_label_size(lengths[refs[i]], lengths[refs[i + 1]])
               for i in range(0, len(refs), 2))


def _copied_size(raw: bytes, p: int, end: int, skip: Collection[int]) -> int:
    """``len(_copy_fields(raw, p, end, skip))`` without making it."""
    size = end - p
    while p < end:
        number, _, _, q = read_field(raw, p, end)
        if number in skip:
            size -= q - p
        p = q
    return size


def v1_size(raw_v2: bytes) -> int:
    """The size of ``v2_to_v1(raw_v2)``, in one pass that makes nothing of that size (the
    symbols' lengths times the refs to them, the framing): what a conversion would hold,
    known before a byte of it is allocated. Raises what ``v2_to_v1`` raises."""
    scan = scan_v2(raw_v2)
    syms = scan.symbols
    nsym = len(syms)
    lengths = [len(s) for s in syms]
    total = 0
    metadata: dict[tuple[bytes, int, bytes, bytes], None] = {}
    for _, p, end in scan.series:
        ser = split_series_v2(raw_v2, p, end, nsym)
        body = _labels_size(ser.refs, lengths)
        for s, q in ser.other:
            number, _, ps, fq = read_field(raw_v2, s, q)
            if number == 2:
                body += _field_size(_copied_size(raw_v2, ps, fq, (3,)))
            elif number == 3:
                body += _field_size(_copied_size(raw_v2, ps, fq, (17,)))
            elif number == 4:
                refs, rest = exemplar_v2(raw_v2, ps, fq, nsym)
                body += _field_size(_labels_size(refs, lengths) + sum(map(len, rest)))
            elif number == 5:
                mtype, help_ref, unit_ref = metadata_v2(raw_v2, ps, fq)
                _check_refs((help_ref, unit_ref), nsym)
                name = family_name(_metric_name(ser.refs, syms), mtype)
                if name and (mtype or syms[help_ref] or syms[unit_ref]):
                    metadata[(name, mtype, syms[help_ref], syms[unit_ref])] = None
        total += _field_size(body)
    for name, mtype, help_, unit in metadata:
        body = _field_size(len(name))
        if mtype:
            body += 1 + _uvarint_size(mtype)
        if help_:
            body += _field_size(len(help_))
        if unit:
            body += _field_size(len(unit))
        total += _field_size(body)
    return total


def check_size(raw_v2: bytes, limit: int | None) -> int:
    """The size ``raw_v2`` converts to (``v1_size``); ``ConversionTooLarge`` past
    ``limit`` (None: no limit)."""
    size = v1_size(raw_v2)
    if limit is not None and size > limit:
        raise ConversionTooLarge(size, limit)
    return size


def v2_to_v1(raw_v2: bytes) -> bytes:
    """A 2.0 request as the equivalent 1.0 WriteRequest, for 1.0-only upstreams.

    Labels and exemplar labels are resolved from the symbols; samples lose
    ``start_timestamp`` and histograms ``start_timestamp`` (1.0 has neither); series
    metadata becomes one 1.0 MetricMetadata per metric family (deduplicated); the rc.3
    ``created_timestamp`` is dropped. Values, timestamps and histogram buckets keep their
    bytes: the field numbers of Sample and Histogram agree between the versions.
    """
    scan = scan_v2(raw_v2)
    syms = scan.symbols
    nsym = len(syms)
    out: list[bytes] = []
    metadata: dict[tuple[bytes, int, bytes, bytes], None] = {}
    for _, p, end in scan.series:
        ser = split_series_v2(raw_v2, p, end, nsym)
        samples: list[bytes] = []
        exemplars: list[bytes] = []
        histograms: list[bytes] = []
        for s, q in ser.other:
            number, _, ps, fq = read_field(raw_v2, s, q)
            if number == 2:  # Sample: drop start_timestamp = 3
                samples.append(len_field(2, _copy_fields(raw_v2, ps, fq, (3,))))
            elif number == 3:  # Histogram (2.0: 3, 1.0: 4): drop start_timestamp = 17
                histograms.append(len_field(4, _copy_fields(raw_v2, ps, fq, (17,))))
            elif number == 4:  # Exemplar (2.0: 4, 1.0: 3)
                exemplars.append(len_field(3, _exemplar_v1(raw_v2, ps, fq, syms)))
            elif number == 5:
                mtype, help_ref, unit_ref = metadata_v2(raw_v2, ps, fq)
                _check_refs((help_ref, unit_ref), nsym)
                name = family_name(_metric_name(ser.refs, syms), mtype)
                # a ref to another "" than symbol 0 says nothing either
                if name and (mtype or syms[help_ref] or syms[unit_ref]):
                    metadata[(name, mtype, syms[help_ref], syms[unit_ref])] = None
            # created_timestamp (6) and unknown fields have no 1.0 equivalent
        # 1.0 field order: labels, samples, exemplars, histograms
        body = b"".join((_labels_v1(ser.refs, syms), *samples, *exemplars, *histograms))
        out.append(len_field(1, body))
    for name, mtype, help_, unit in metadata:
        body = b""
        if mtype:
            body += b"\x08" + encode_uvarint(mtype)
        body += len_field(2, name)
        if help_:
            body += len_field(4, help_)
        if unit:
            body += len_field(5, unit)
        out.append(len_field(3, body))
    return b"".join(out)


#: metric types (the same numbers in RW 1.0 and 2.0) whose samples' names are the family's
#: with a suffix: histogram, gaugehistogram, summary
_SUFFIXED_TYPES = frozenset({3, 4, 5})
_FAMILY_SUFFIXES = (b"_bucket", b"_count", b"_sum", b"_gcount", b"_gsum", b"_created")


def family_name(name: bytes, mtype: int) -> bytes:
    """The metric family a series' name belongs to, as RW 1.0 metadata names it: RW 2.0
    carries metadata per series (``rpc_seconds_bucket``, ``_sum``, ``_count``), RW 1.0 per
    family (``rpc_seconds``), and a store keyed by family (Mimir's) would get three wrong
    ones."""
    if mtype in _SUFFIXED_TYPES:
        for suffix in _FAMILY_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)]
    return name


def _metric_name(refs: Sequence[int], syms: Sequence[bytes]) -> bytes:
    for i in range(0, len(refs), 2):
        if syms[refs[i]] == b"__name__":
            return syms[refs[i + 1]]
    return b""


def metadata_v2(raw: bytes, p: int, end: int) -> tuple[int, int, int]:
    mtype = help_ref = unit_ref = 0
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if wt == 0:
            v = uvarint(raw, s)[0]
            if number == 1:
                mtype = v
            elif number == 3:
                help_ref = v
            elif number == 4:
                unit_ref = v
        p = q
    return mtype, help_ref, unit_ref


def exemplar_v2(raw: bytes, p: int, end: int, nsym: int) -> tuple[list[int], list[bytes]]:
    """An RW 2.0 Exemplar's label refs (checked) and its other fields, bytes as they were."""
    refs: list[int] = []
    rest: list[bytes] = []
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if number == 1:
            read_refs(raw, wt, s, q, refs, "exemplar labels_refs")
        else:
            rest.append(raw[p:q])
        p = q
    if len(refs) % 2:
        raise invalid("exemplar labels_refs has an odd number of entries")
    _check_refs(refs, nsym)
    return refs, rest


def _exemplar_v1(raw: bytes, p: int, end: int, syms: Sequence[bytes]) -> bytes:
    refs, rest = exemplar_v2(raw, p, end, len(syms))
    return _labels_v1(refs, syms) + b"".join(rest)
