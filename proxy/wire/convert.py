"""RW 2.0 -> 1.0: a 2.0 request as the equivalent 1.0 WriteRequest, for 1.0-only upstreams.

Values, timestamps and histogram buckets keep their bytes: the field numbers of Sample and
Histogram agree between the versions. Only what 1.0 has no place for is dropped, and a
native histogram with custom buckets (schema -53), which a 1.0 receiver would store as
exponential buckets, becomes the classic ``_bucket`` / ``_sum`` / ``_count`` series. A
converted request can go without its native histograms (``without_histograms``) to a
receiver that has them off and would refuse the whole request for one.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from proxy.wire.primitives import (
    STALE_NAN,
    STALE_NAN_BITS,
    decode_packed,
    encode_label_v1,
    encode_uvarint,
    invalid,
    len_field,
    read_field,
    read_refs,
    uvarint,
)
from proxy.wire.splice_v2 import scan_v2, split_series_v2

#: the schema of a native histogram with custom bucket bounds (``custom_values``)
CUSTOM_BUCKETS_SCHEMA = -53
_DOUBLE = struct.Struct("<d")
_BITS = struct.Struct("<Q")
_U64 = (1 << 64) - 1
#: the one NaN a bucket whose counts add up to NaN carries (Python's ``math.nan``): which
#: operand's payload an addition of two NaNs keeps is the compiler's choice (CPython's
#: debug build and its release build differ), so no payload is passed on
QUIET_NAN_BITS = 0x7FF8000000000000
_QUIET_NAN: float = _DOUBLE.unpack(QUIET_NAN_BITS.to_bytes(8, "little"))[0]


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _int64(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _doubles(raw: bytes, wt: int, s: int, q: int, out: list[float]) -> None:
    if wt == 2:
        out.extend(v for (v,) in _DOUBLE.iter_unpack(raw[s:q]))
    else:
        out.append(_DOUBLE.unpack_from(raw, s)[0])


def _varints(raw: bytes, wt: int, s: int, q: int, out: list[int]) -> None:
    if wt == 2:
        decode_packed(raw, s, q, out)
    else:
        out.append(uvarint(raw, s)[0])


@dataclass(slots=True)
class CustomBuckets:
    """A native histogram with custom buckets (schema -53), read: its buckets' counts by
    index (index i's upper bound ``bounds[i]``, the last one's +Inf). ``stale``: it is a
    staleness marker (its ``sum`` is Prometheus' stale NaN), which ends every classic
    series it becomes."""

    count: float
    sum: float
    timestamp: int
    bounds: list[float]
    counts: list[float]
    stale: bool = False


def custom_buckets(raw: bytes, p: int, end: int) -> CustomBuckets | None:
    """An RW 2.0 Histogram (its payload ``raw[p:end]``, framing checked by the splice) with
    custom buckets, read; None for any other schema. Integer (``positive_deltas``) and float
    (``positive_counts``) forms; positive spans place the buckets (a span's offset is the
    gap after the previous one). ``protobuf_invalid`` for a bucket past the bounds."""
    schema = 0
    count = total = 0.0
    timestamp = 0
    stale = False
    spans: list[tuple[int, int]] = []
    deltas: list[int] = []
    floats: list[float] = []
    bounds: list[float] = []
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if number == 4 and wt == 0:
            schema = _zigzag(uvarint(raw, s)[0])
        elif number == 1 and wt == 0:
            count = float(uvarint(raw, s)[0])
        elif number == 2 and wt == 1:
            count = _DOUBLE.unpack_from(raw, s)[0]
        elif number == 3 and wt == 1:
            total = _DOUBLE.unpack_from(raw, s)[0]
            stale = _BITS.unpack_from(raw, s)[0] == STALE_NAN_BITS
        elif number == 15 and wt == 0:
            timestamp = _int64(uvarint(raw, s)[0])
        elif number == 11 and wt == 2:
            offset = length = 0
            a = s
            while a < q:
                n, w, vs, b = read_field(raw, a, q)
                if w == 0 and n in (1, 2):
                    v = uvarint(raw, vs)[0]
                    if n == 1:
                        offset = _zigzag(v)
                    else:
                        length = v
                a = b
            spans.append((offset, length))
        elif number == 12:
            _varints(raw, wt, s, q, deltas)
        elif number == 13:
            _doubles(raw, wt, s, q, floats)
        elif number == 16:
            _doubles(raw, wt, s, q, bounds)
        p = q
    if schema != CUSTOM_BUCKETS_SCHEMA:
        return None
    if stale:  # a marker's buckets, if any, say nothing
        return CustomBuckets(count, total, timestamp, bounds, [0.0] * (len(bounds) + 1), True)
    if deltas:
        values: list[float] = []
        running = 0
        for d in deltas:
            running += _zigzag(d)
            values.append(float(running))
    else:
        values = floats
    counts = [0.0] * (len(bounds) + 1)
    idx = 0
    taken = 0
    for i, (offset, length) in enumerate(spans):
        idx = offset if i == 0 else idx + offset
        for _ in range(length):
            if taken >= len(values):
                break
            if not 0 <= idx < len(counts):
                raise invalid(f"custom-bucket histogram: bucket {idx} past its "
                              f"{len(bounds)} bounds")
            counts[idx] += values[taken]
            taken += 1
            idx += 1
    return CustomBuckets(count, total, timestamp, bounds, counts)


def stale_marker(raw: bytes, p: int, end: int) -> int | None:
    """The timestamp of an RW 2.0 Histogram (its payload ``raw[p:end]``) that is a staleness
    marker, None for any other: Prometheus marks a histogram series stale with a histogram
    whose ``sum`` is the stale NaN (``Histogram{Sum: StaleNaN}``, schema 0 and no buckets
    whatever the series' schema)."""
    stale = False
    timestamp = 0
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if number == 3 and wt == 1:
            stale = _BITS.unpack_from(raw, s)[0] == STALE_NAN_BITS
        elif number == 15 and wt == 0:
            timestamp = _int64(uvarint(raw, s)[0])
        p = q
    return timestamp if stale else None


def format_le(bound: float) -> bytes:
    """A bucket bound as Prometheus (Go's ``strconv.FormatFloat(b, 'g', -1, 64)``, as
    client_golang writes ``le``) formats it: ``0.1``, ``1``, ``1e+06``, ``+Inf``."""
    if math.isinf(bound):
        return b"+Inf" if bound > 0 else b"-Inf"
    if math.isnan(bound):
        return b"NaN"
    if bound == 0:
        return b"-0" if math.copysign(1.0, bound) < 0 else b"0"
    text = repr(bound)
    sign = ""
    if text[0] == "-":
        sign, text = "-", text[1:]
    mantissa, _, exp_text = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    # the decimal point's place relative to the first significant digit
    point = len(whole) + (int(exp_text) if exp_text else 0)
    lead = len(whole + frac) - len((whole + frac).lstrip("0"))
    point -= lead
    digits = digits.rstrip("0") or "0"
    exp = point - 1
    if exp < -4 or exp >= 6:  # Go's shortest 'g' switches to an exponent so
        out = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        out += "e" + ("-" if exp < 0 else "+") + f"{abs(exp):02d}"
    elif point <= 0:
        out = "0." + "0" * -point + digits
    elif point >= len(digits):
        out = digits + "0" * (point - len(digits))
    else:
        out = digits[:point] + "." + digits[point:]
    return (sign + out).encode()


def _sample_v1(value: float, timestamp: int) -> bytes:
    return b"\x09" + _DOUBLE.pack(value) + b"\x10" + encode_uvarint(timestamp & _U64)


def classic_series(labels: Sequence[tuple[bytes, bytes]], h: CustomBuckets
                   ) -> Iterator[tuple[list[tuple[bytes, bytes]], float, int]]:
    """The classic series a custom-bucket histogram is, as (labels, value, timestamp):
    ``<name>_bucket{le=...}`` per bound and ``+Inf`` (cumulative counts), ``<name>_sum``,
    ``<name>_count``, each with the histogram's other labels, sorted by name."""
    name = b""
    rest: list[tuple[bytes, bytes]] = []
    for n, v in labels:
        if n == b"__name__":
            name = v
        elif n != b"le":
            rest.append((n, v))

    def named(suffix: bytes, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        return sorted([(b"__name__", name + suffix), *rest, *extra], key=lambda x: x[0])

    cumulative = 0.0
    for i, c in enumerate(h.counts):
        cumulative += c
        le = format_le(h.bounds[i]) if i < len(h.bounds) else b"+Inf"
        value = _QUIET_NAN if math.isnan(cumulative) else cumulative
        yield named(b"_bucket", (b"le", le)), STALE_NAN if h.stale else value, h.timestamp
    yield named(b"_sum"), STALE_NAN if h.stale else h.sum, h.timestamp
    yield named(b"_count"), STALE_NAN if h.stale else h.count, h.timestamp


def _classic_v1(labels: Sequence[tuple[bytes, bytes]], h: CustomBuckets) -> list[bytes]:
    return [len_field(1, b"".join(encode_label_v1(n, v) for n, v in lbs)
                      + len_field(2, _sample_v1(value, ts)))
            for lbs, value, ts in classic_series(labels, h)]


def _classic_size(labels: Sequence[tuple[bytes, bytes]], h: CustomBuckets) -> int:
    total = 0
    for lbs, _, ts in classic_series(labels, h):
        sample = 10 + _uvarint_size(ts & _U64)
        total += _field_size(sum(_label_size(len(n), len(v)) for n, v in lbs)
                             + _field_size(sample))
    return total


@dataclass(slots=True)
class V1Form:
    """What an RW 2.0 request converts to: its size, and how its counts change (custom-bucket
    histograms become classic series: ``histograms`` fewer histograms, ``samples`` more
    samples)."""

    size: int = 0
    histograms: int = 0
    samples: int = 0


def _check_refs(refs: Sequence[int], nsym: int) -> None:
    if refs and max(refs) >= nsym:
        raise invalid(f"symbol reference {max(refs)} past the table of {nsym}")


def _copy_fields(raw: bytes, p: int, end: int, skip: Collection[int]) -> tuple[bytes, int]:
    """The fields of one message minus those numbered in ``skip``, bytes as they were, and
    how many it left out: the conversion drops what RW 1.0 has no place for, and
    ``without_histograms`` the native histograms, whose count the sender is told."""
    parts: list[bytes] = []
    start = p
    left = 0
    while p < end:
        number, _, _, q = read_field(raw, p, end)
        if number in skip:
            parts.append(raw[start:p])
            start = q
            left += 1
        p = q
    parts.append(raw[start:end])
    return b"".join(parts), left


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


#: a series' RW 2.0 fields that go out as RW 1.0 fields, by number: (the field's 1.0
#: number, the fields of its message dropped as 1.0 has no place for them): Sample's
#: start_timestamp, Histogram's start_timestamp
_CARRIED = {2: (2, (3,)), 3: (4, (17,))}


@dataclass(slots=True)
class _SeriesV1:
    """One RW 2.0 series as RW 1.0 will carry it, read once for both the size of the
    conversion and the conversion: its label refs, the fields that go out as they are (1.0
    number, payload span, the message's fields dropped), its exemplars (label refs, other
    fields' bytes), its custom-bucket histograms (they become classic series) and the
    timestamps of the histogram staleness markers that go out as float ones (``stale``)."""

    refs: list[int]
    carried: list[tuple[int, int, int, tuple[int, ...]]]
    exemplars: list[tuple[list[int], list[bytes]]]
    classic: list[CustomBuckets]
    stale: list[int]

    @property
    def sent(self) -> bool:
        """A series left with nothing but custom-bucket histograms is not sent itself."""
        return bool(self.carried or self.exemplars or self.stale or not self.classic)


_Metadata = dict[tuple[bytes, int, bytes, bytes], None]


def _series_v1(raw_v2: bytes, syms: Sequence[bytes], series: Iterable[tuple[int, int, int]],
               metadata: _Metadata) -> Iterator[_SeriesV1]:
    """Each series of an RW 2.0 request (``scan_v2``) as RW 1.0 carries it; its metadata
    gathered in ``metadata``, one per metric family. Samples keep their fields but
    ``start_timestamp`` and histograms theirs; ``created_timestamp`` (6) and unknown fields
    have no 1.0 equivalent.

    A histogram staleness marker (``stale_marker``) of a series whose other histograms in
    the request are exponential stays a histogram, as they go. Else it ends what the series
    became: the classic series of its custom-bucket histograms (their bounds; a 1.0
    receiver stores no histogram of a series that had none), or, with neither in the
    request, the series itself as a float stale marker, which every receiver takes (a
    receiver without native histograms refuses a request holding a histogram with a 5xx,
    which a sender retries forever)."""
    nsym = len(syms)
    for _, p, end in series:
        ser = split_series_v2(raw_v2, p, end, nsym)
        out = _SeriesV1(ser.refs, [], [], [], [])
        markers: list[tuple[int, int, int]] = []
        for s, q in ser.other:
            number, _, ps, fq = read_field(raw_v2, s, q)
            if number == 3 and (h := custom_buckets(raw_v2, ps, fq)) is not None:
                if h.stale and not h.bounds and out.classic:  # the bounds it ends
                    h = replace(out.classic[-1], timestamp=h.timestamp, stale=True)
                out.classic.append(h)
            elif number == 3 and (ts := stale_marker(raw_v2, ps, fq)) is not None:
                markers.append((ps, fq, ts))
            elif number in _CARRIED:
                v1_number, dropped = _CARRIED[number]
                out.carried.append((v1_number, ps, fq, dropped))
            elif number == 4:
                out.exemplars.append(exemplar_v2(raw_v2, ps, fq, nsym))
            elif number == 5:
                mtype, help_ref, unit_ref = metadata_v2(raw_v2, ps, fq)
                _check_refs((help_ref, unit_ref), nsym)
                name = family_name(_metric_name(ser.refs, syms), mtype)
                # a ref to another "" than symbol 0 says nothing either
                if name and (mtype or syms[help_ref] or syms[unit_ref]):
                    metadata[(name, mtype, syms[help_ref], syms[unit_ref])] = None
        exponential = any(n == 4 for n, _, _, _ in out.carried)
        for ps, fq, ts in markers:
            if exponential:
                out.carried.append((4, ps, fq, (17,)))
            elif out.classic:
                out.classic.append(replace(out.classic[-1], timestamp=ts, stale=True))
            else:
                out.stale.append(ts)
        yield out


def _metadata_v1(name: bytes, mtype: int, help_: bytes, unit: bytes) -> bytes:
    """An RW 1.0 MetricMetadata's payload."""
    body = b""
    if mtype:
        body += b"\x08" + encode_uvarint(mtype)
    body += len_field(2, name)
    if help_:
        body += len_field(4, help_)
    if unit:
        body += len_field(5, unit)
    return body


def v1_form(raw_v2: bytes) -> V1Form:
    """The size of ``v2_to_v1(raw_v2)``, in one pass that makes nothing of that size (the
    symbols' lengths times the refs to them, the framing): what a conversion would hold,
    known before a byte of it is allocated; and how the request's counts change converted
    (``V1Form``). Raises what ``v2_to_v1`` raises."""
    form, metadata = series_form(raw_v2)
    # the metadata's payload is small beside the series': made, not computed
    form.size += sum(_field_size(len(_metadata_v1(*m))) for m in metadata)
    return form


def series_form(raw_v2: bytes) -> tuple[V1Form, _Metadata]:
    """``v1_form`` of the request's series alone (``size`` without the metadata), and its
    metadata."""
    scan = scan_v2(raw_v2)
    syms = scan.symbols
    lengths = [len(s) for s in syms]
    form = V1Form()
    total = 0
    metadata: _Metadata = {}
    for ser in _series_v1(raw_v2, syms, scan.series, metadata):
        for h in ser.classic:
            total += _classic_size(_labels(ser.refs, syms), h)
            form.histograms += 1
            form.samples += len(h.counts) + 2
        form.histograms += len(ser.stale)
        form.samples += len(ser.stale)
        if ser.sent:
            body = _labels_size(ser.refs, lengths)
            body += sum(_field_size(_copied_size(raw_v2, ps, fq, dropped))
                        for _, ps, fq, dropped in ser.carried)
            body += sum(_field_size(len(_sample_v1(STALE_NAN, ts))) for ts in ser.stale)
            body += sum(_field_size(_labels_size(refs, lengths) + sum(map(len, rest)))
                        for refs, rest in ser.exemplars)
            total += _field_size(body)
    form.size = total
    return form, metadata


def check_size(raw_v2: bytes, limit: int | None,
               form_of: Callable[[bytes], V1Form] | None = None) -> V1Form:
    """What ``raw_v2`` converts to (``form_of``, the reference ``v1_form`` by default);
    ``ConversionTooLarge`` when its size is past ``limit`` (None: no limit)."""
    form = (form_of or v1_form)(raw_v2)
    if limit is not None and form.size > limit:
        raise ConversionTooLarge(form.size, limit)
    return form


def v2_to_v1(raw_v2: bytes) -> bytes:
    """A 2.0 request as the equivalent 1.0 WriteRequest, for 1.0-only upstreams.

    Labels and exemplar labels are resolved from the symbols; samples lose
    ``start_timestamp`` and histograms ``start_timestamp`` (1.0 has neither); series
    metadata becomes one 1.0 MetricMetadata per metric family (deduplicated); the rc.3
    ``created_timestamp`` is dropped. Values, timestamps and histogram buckets keep their
    bytes: the field numbers of Sample and Histogram agree between the versions.

    A native histogram with custom buckets (schema -53: 1.0 has no ``custom_values``, and a
    1.0 receiver would read its buckets as exponential ones) becomes the classic series a
    1.0 receiver stores exactly (``classic_series``): ``<name>_bucket{le="..."}`` per bound
    and ``+Inf`` (cumulative), ``<name>_sum``, ``<name>_count``, the histogram's labels
    sorted with ``le`` in place, its timestamp; one TimeSeries per sample, after the
    series. A series left with nothing else (no samples, exemplars or other histograms)
    is not sent itself. ``v1_form`` says how the counts change (samples, not histograms).
    """
    out, metadata = converted_series(raw_v2)
    out.extend(len_field(3, _metadata_v1(*m)) for m in metadata)
    return b"".join(out)


def converted_series(raw_v2: bytes) -> tuple[list[bytes], _Metadata]:
    """``v2_to_v1`` of the request's series alone (its TimeSeries fields, in order), and
    its metadata (``series_form``)."""
    scan = scan_v2(raw_v2)
    syms = scan.symbols
    out: list[bytes] = []
    metadata: _Metadata = {}
    for ser in _series_v1(raw_v2, syms, scan.series, metadata):
        if ser.sent:
            carried = {n: [len_field(n, _copy_fields(raw_v2, ps, fq, dropped)[0])
                           for m, ps, fq, dropped in ser.carried if m == n] for n in (2, 4)}
            carried[2] += [len_field(2, _sample_v1(STALE_NAN, ts)) for ts in ser.stale]
            exemplars = [len_field(3, _labels_v1(refs, syms) + b"".join(rest))
                         for refs, rest in ser.exemplars]
            # 1.0 field order: labels, samples, exemplars, histograms
            out.append(len_field(1, b"".join((_labels_v1(ser.refs, syms), *carried[2],
                                              *exemplars, *carried[4]))))
        for h in ser.classic:
            out.extend(_classic_v1(_labels(ser.refs, syms), h))
    return out, metadata


@dataclass(slots=True)
class WithoutHistograms:
    """An RW 1.0 request with its native histograms left out (``without_histograms``): the
    body, and how many histograms it lost."""

    body: bytes
    histograms: int


def without_histograms(raw_v1: bytes) -> WithoutHistograms:
    """``raw_v1`` (an RW 1.0 request, a conversion's: well-formed) without the Histogram
    fields of its series, every other byte as it was; a series left with nothing but its
    labels is left out. For a receiver without native histograms (Prometheus 2.x on its
    defaults), which refuses a whole request holding one with a 500 and so stores none
    of its float samples either, and a sender retries that forever. The metadata and
    unknown top-level fields stay.

    Runs of series without a histogram are copied as one slice, and a series is walked by
    its one-byte tags and lengths (``_histograms_at``) up to its first histogram, the rest
    by ``_copy_fields`` (the conversion's copy of a message without some fields): 5.8 ms
    for 2,000 series of a histogram each (230 KB), 3.9 ms with none; a walk by
    ``read_field`` took 36 ms (20x their native conversion), paid by every converted
    request with a histogram while the upstream refuses them."""
    out: list[bytes] = []
    dropped = 0
    run = p = 0  # raw_v1[run:p]: copied as it is
    end = len(raw_v1)
    while p < end:
        if raw_v1[p] == 0x0A:  # a series
            size, s = uvarint(raw_v1, p + 1)
            q = s + size
            first, samples = _histograms_at(raw_v1, s, q)
        else:
            first = s = q = read_field(raw_v1, p, end)[3]
        if first == q:
            p = q
            continue
        out.append(raw_v1[run:p])
        rest, left = _copy_fields(raw_v1, first, q, (4,))
        dropped += left
        if samples or rest:  # a sample, an exemplar or an unknown field before or after
            out.append(len_field(1, raw_v1[s:first] + rest))
        run = p = q
    out.append(raw_v1[run:end])
    return WithoutHistograms(b"".join(out), dropped)


def _histograms_at(raw: bytes, p: int, end: int) -> tuple[int, bool]:
    """Where the first Histogram field (4) of an RW 1.0 TimeSeries payload ``raw[p:end]``
    is (``end``: none), and whether a field other than a label comes before it."""
    data = False
    while p < end:
        tag = raw[p]
        if tag == 0x22:  # field 4, length-delimited
            return p, data
        data = data or tag != 0x0A
        size = raw[p + 1] if tag < 0x80 and tag & 7 == 2 and p + 1 < end else 0x80
        p = p + 2 + size if size < 0x80 else read_field(raw, p, end)[3]
    return end, data


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


def _labels(refs: Sequence[int], syms: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    return [(syms[refs[i]], syms[refs[i + 1]]) for i in range(0, len(refs), 2)]


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
