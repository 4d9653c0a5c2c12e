"""Remote-write bodies at the wire level: scan, splice label bytes, convert 2.0 to 1.0.

Nothing here builds protobuf objects on the request path. A 1.0 body is walked field by
field; each TimeSeries' label fields are handed to the caller's cache as one ``bytes`` key
and, when the series gets new labels, only its label fields and its length prefix are
rewritten. Every other byte of the request is copied through as a span of the input.
``docs/wire.md`` explains the splice and why it is sound.

Wire facts used throughout (see ``proto/``): a 1.0 WriteRequest is ``timeseries = 1`` and
``metadata = 3``; a TimeSeries is ``labels = 1``, ``samples = 2``, ``exemplars = 3``,
``histograms = 4``; a Label is ``name = 1``, ``value = 2``. A 2.0 Request is
``symbols = 4`` and ``timeseries = 5``; its TimeSeries has ``labels_refs = 1`` (packed
uint32), ``samples = 2``, ``histograms = 3``, ``exemplars = 4``, ``metadata = 5``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.compression import DecodeError

# -- protocols ----------------------------------------------------------------------------


class Protocol(enum.Enum):
    V1 = "prometheus.WriteRequest"
    V2 = "io.prometheus.write.v2.Request"

    @property
    def content_type(self) -> str:
        if self is Protocol.V1:
            return "application/x-protobuf"
        return "application/x-protobuf;proto=io.prometheus.write.v2.Request"

    @property
    def version_header(self) -> str:
        """Value of ``X-Prometheus-Remote-Write-Version`` for this protocol."""
        return "0.1.0" if self is Protocol.V1 else "2.0.0"


def protocol_from_content_type(ct: str) -> Protocol:
    """RW 1.0 or 2.0 from a Content-Type; :class:`DecodeError` 415 for anything else."""
    parts = [p.strip() for p in ct.split(";")]
    media = parts[0].lower()
    if media != "application/x-protobuf":
        raise DecodeError(
            "unsupported_content_type",
            415,
            f"unsupported Content-Type {ct!r}: remote write needs application/x-protobuf",
        )
    proto = ""
    for param in parts[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "proto":
            proto = value.strip().strip('"')
    if proto in ("", Protocol.V1.value):
        return Protocol.V1
    if proto == Protocol.V2.value:
        return Protocol.V2
    raise DecodeError(
        "unsupported_content_type",
        415,
        f"unsupported remote-write message {proto!r}: expected {Protocol.V1.value} "
        f"or {Protocol.V2.value}",
    )


@dataclass(slots=True)
class Counts:
    """What a request carries, for the ``X-Prometheus-Remote-Write-*-Written`` headers."""

    series: int = 0
    samples: int = 0
    histograms: int = 0
    exemplars: int = 0

    def add(self, other: Counts) -> None:
        self.series += other.series
        self.samples += other.samples
        self.histograms += other.histograms
        self.exemplars += other.exemplars


# -- varints and fields -------------------------------------------------------------------

_BYTE = [bytes((i,)) for i in range(128)]


def _invalid(what: str) -> DecodeError:
    return DecodeError("protobuf_invalid", 400, f"invalid protobuf: {what}")


def uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, position after it)."""
    result = 0
    shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise _invalid("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise _invalid("varint longer than 10 bytes")


def encode_uvarint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return encode_uvarint(number << 3 | 2) + encode_uvarint(len(payload)) + payload


def skip_field(buf: bytes, pos: int, end: int) -> tuple[int, int, int, int]:
    """Read the field at ``pos``: (field number, wire type, payload start, field end).

    For length-delimited fields the payload start is after the length; for the others it
    is after the tag. Groups (wire types 3, 4) are refused: no remote-write message has any.
    """
    key, p = uvarint(buf, pos)
    number = key >> 3
    wt = key & 7
    if number == 0:
        raise _invalid("field number 0")
    if wt == 2:
        ln, p = uvarint(buf, p)
        q = p + ln
    elif wt == 0:
        _, q = uvarint(buf, p)
    elif wt == 1:
        q = p + 8
    elif wt == 5:
        q = p + 4
    else:
        raise _invalid(f"unsupported wire type {wt}")
    if q > end:
        raise _invalid("field runs past the end of its message")
    return number, wt, p, q


#: b"\x0a" + varint(n): the head of a TimeSeries (1.0) for small lengths, prebuilt
_TS_HEAD_V1: list[bytes] = [b"\x0a" + encode_uvarint(n) for n in range(4096)]


def _ts_head_v1(n: int) -> bytes:
    return _TS_HEAD_V1[n] if n < 4096 else b"\x0a" + encode_uvarint(n)


_HEADS = {tag: [bytes((tag,)) + encode_uvarint(n) for n in range(4096)] for tag in (0x0A, 0x2A)}


def _head(tag: int, n: int) -> bytes:
    """Tag + length of a length-delimited field (prebuilt for the usual tags and sizes)."""
    return _HEADS[tag][n] if n < 4096 else bytes((tag,)) + encode_uvarint(n)


def _utf8(b: bytes, what: str) -> None:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("invalid_utf8", 400, f"{what} is not valid UTF-8: {b[:64]!r}") from None


# -- RW 1.0 labels ------------------------------------------------------------------------

#: (name, value, the whole encoded Label field)
LabelField = tuple[bytes, bytes, bytes]


def parse_label_payload(buf: bytes, p: int, end: int) -> tuple[bytes, bytes]:
    """Name and value of one Label message (unknown fields inside are skipped)."""
    name = b""
    value = b""
    while p < end:
        number, wt, s, q = skip_field(buf, p, end)
        if number == 1 and wt == 2:
            name = buf[s:q]
        elif number == 2 and wt == 2:
            value = buf[s:q]
        elif number in (1, 2):
            raise _invalid("label name/value with a wrong wire type")
        p = q
    return name, value


def parse_labels_v1(fields: bytes, *, check_utf8: bool = True) -> list[LabelField]:
    """Split a run of 1.0 Label fields (a cache key) into (name, value, field bytes).

    The common shape (``0a L 0a N name 12 V value`` with one-byte lengths) is read inline;
    anything else (long labels, unknown fields inside a Label, other field order) goes
    through the generic field reader.
    """
    out: list[LabelField] = []
    p = 0
    n = len(fields)
    plain = True  # every label in the inline shape: the framing is what _utf8_ok assumes
    while p < n:
        if fields[p] != 0x0A:
            raise _invalid("expected a label field")
        c = fields[p + 1] if p + 1 < n else 0x80
        if c < 0x80:
            s = p + 2
            q = s + c
        elif p + 2 < n and fields[p + 2] < 0x80:
            s = p + 3
            q = s + ((c & 0x7F) | (fields[p + 2] << 7))
        else:
            _, _, s, q = skip_field(fields, p, n)
        if q > n:
            raise _invalid("label runs past the end of its series")
        # name: 0a N name; value: 12 V value (absent when empty); V may take two bytes
        name: bytes | None = None
        value = b""
        if q - s >= 2 and fields[s] == 0x0A and fields[s + 1] < 0x80:
            ne = s + 2 + fields[s + 1]
            if ne == q:
                name, value = fields[s + 2 : ne], b""
            elif ne + 2 <= q and fields[ne] == 0x12:
                v = fields[ne + 1]
                if v < 0x80 and ne + 2 + v == q:
                    name, value = fields[s + 2 : ne], fields[ne + 2 : q]
                elif v >= 0x80 and ne + 3 <= q and fields[ne + 2] < 0x80 and (
                    ne + 3 + ((v & 0x7F) | (fields[ne + 2] << 7)) == q
                ):
                    name, value = fields[s + 2 : ne], fields[ne + 3 : q]
        if name is None:
            plain = False
            name, value = parse_label_payload(fields, s, q)
        out.append((name, value, fields[p:q]))
        p = q
    if check_utf8 and not (plain and _utf8_ok(fields)):
        # the framing has non-ASCII bytes (a length >= 128) or a string is bad: check
        # each string; NUL is ASCII, so joining with it hides no fault
        try:
            b"\x00".join([x for lf in out for x in lf[:2]]).decode("utf-8")
        except UnicodeDecodeError:
            for name, value, _ in out:
                _utf8(name, "label name")
                _utf8(value, "label value")
    return out


_KARTA = b"karta_"


def scan_labels_v1(key: bytes, wanted: Collection[bytes]) -> tuple[dict[bytes, bytes], int] | None:
    """The cheap read of a label run on a cache miss: the values of the ``wanted`` names
    and the offset of the first label sorting after every ``karta_`` name (where the
    stamped block goes; ``len(key)`` when none does).

    Only for the usual shape: labels sorted by name and unique, no ``karta_`` name, each
    Label exactly ``0a N name [12 V value]`` with one-byte name length and one- or two-byte
    lengths otherwise, every string valid UTF-8. Anything else answers None and takes
    :func:`parse_labels_v1`, which reads every layout and says what is wrong.

    UTF-8 of every string in one C-level decode: in this shape the only non-ASCII framing
    bytes are the first bytes of two-byte lengths, each between two ASCII bytes (a tag
    before, the length's second byte after), so each decodes to exactly one U+FFFD with
    ``errors="replace"`` and cannot join a string's bytes; the strings are all valid when
    the count of U+FFFD is exactly the count of such lengths (a string that really holds
    U+FFFD only sends the key to the general path).
    """
    got: dict[bytes, bytes] = {}
    n = len(key)
    p = 0
    at = -1
    wide = 0  # two-byte lengths
    prev = b""
    try:
        while p < n:
            if key[p] != 0x0A:
                return None
            c = key[p + 1]
            if c < 0x80:
                s = p + 2
                q = s + c
            else:
                c2 = key[p + 2]
                if c2 >= 0x80:
                    return None
                s = p + 3
                q = s + ((c & 0x7F) | (c2 << 7))
                wide += 1
            ln = key[s + 1]
            if key[s] != 0x0A or ln >= 0x80:
                return None
            ne = s + 2 + ln
            name = key[s + 2 : ne]
            if name <= prev:
                return None  # unsorted or duplicate: the general path sorts like the reference
            prev = name
            if ne == q:
                vs = q
            else:
                v = key[ne + 1]
                if key[ne] != 0x12:
                    return None
                if v < 0x80:
                    vs = ne + 2
                else:
                    vs = ne + 3
                    v = (v & 0x7F) | (key[ne + 2] << 7)
                    if key[ne + 2] >= 0x80:
                        return None
                    wide += 1
                if vs + v != q:
                    return None
            if name in wanted:
                got[name] = key[vs:q]
            if at < 0 and name > _KARTA:
                if name.startswith(_KARTA):
                    return None  # a karta_ label to replace or merge around: general path
                at = p
            p = q
    except IndexError:
        return None
    if p != n:
        return None
    if wide:
        if key.decode("utf-8", "replace").count("\ufffd") != wide:
            return None
    elif not _utf8_ok(key):
        return None
    return got, (n if at < 0 else at)


def _utf8_ok(b: bytes) -> bool:
    """True when ``b`` decodes as UTF-8 as a whole.

    For a run of Label fields in the plain shape (tags 0a/12, no other fields) this proves
    every name and value valid: a multi-byte sequence cannot span an ASCII byte, each
    string is bounded by ASCII tags and length bytes, and a two-byte length puts a lone
    non-ASCII byte between two ASCII ones, which fails the decode. A False is
    inconclusive.
    """
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def encode_label_v1(name: bytes, value: bytes) -> bytes:
    return len_field(1, len_field(1, name) + len_field(2, value))


def merge_labels(
    labels: Sequence[tuple[bytes, bytes, bytes]],
    stamp: Sequence[tuple[bytes, bytes, bytes]],
    drop: Collection[bytes],
) -> list[tuple[bytes, bytes, bytes]]:
    """The series' labels minus those named in ``drop``, plus ``stamp``, sorted by name.

    Items are (name, value, encoding); byte order of UTF-8 names is code point order, which
    is the order Prometheus sorts by. The sort is stable, so a sender's (invalid) duplicate
    names keep their relative order rather than being guessed away.
    """
    kept = [lf for lf in labels if lf[0] not in drop]
    if not stamp:
        return kept
    if _is_sorted(kept):
        # the usual case: one contiguous block goes in at a single position
        first = stamp[0][0]
        last = stamp[-1][0]
        i = 0
        while i < len(kept) and kept[i][0] < first:
            i += 1
        if i == len(kept) or kept[i][0] > last:
            return [*kept[:i], *stamp, *kept[i:]]
    merged = [*kept, *stamp]
    merged.sort(key=lambda lf: lf[0])
    return merged


def _is_sorted(labels: Sequence[tuple[bytes, bytes, bytes]]) -> bool:
    return all(labels[i][0] < labels[i + 1][0] for i in range(len(labels) - 1))


# -- RW 1.0 splice ------------------------------------------------------------------------

#: What the caller's cache holds per label set; the first six items are read here:
#: ``(cell, new, head18, head9, delta, reason, token, ...)``:
#:
#: - cell / token: the entry is valid while ``cell[0] is token``. The cache's owner keeps
#:   one cell per pod holding the index's current answer for it and replaces ``cell[0]``
#:   when the pod changes, so every entry of that pod (and only those) goes stale at once.
#:   Entries of series that name no pod use :data:`ALWAYS`;
#: - new: the new run of label fields, or None for "unchanged";
#: - head18 / head9: the series head (``0a`` + length) for the two fast tails, objects of a
#:   shared table (an entry holds one copy of its labels, not one per head);
#: - delta: len(new) - len(key);
#: - reason: "" when attributed, else the reason label value (only unchanged entries have
#:   one, so a stamped hit never reads it).
#:
#: The caller may keep more items after those (e.g. what it needs to revalidate).
Entry = tuple[Any, ...]
CacheGet = Callable[[bytes], "Entry | None"]
#: computes (and stores) an entry; must raise :class:`DecodeError` when the key is not a
#: run of complete Label fields (the fast path offers keys it has not walked)
CacheMiss = Callable[[bytes], "Entry"]

#: the cell of entries that never go stale (series that name no pod); their token is None
ALWAYS: list[Any] = [None]


def make_entry(
    cell: list[Any], token: Any, reason: str, key_len: int, new: bytes | None, *extra: Any
) -> Entry:
    """An :data:`Entry` (``new`` None: unchanged), valid while ``cell[0] is token``."""
    if new is None:
        return (cell, None, None, None, 0, reason, token, *extra)
    if reason:
        raise ValueError("a stamped entry is attributed: it has no reason")
    n = len(new)
    return (cell, new, _ts_head_v1(n + 18), _ts_head_v1(n + 9), n - key_len, "", token, *extra)


def _split_series_v1(
    raw: bytes, p: int, end: int
) -> tuple[bytes, int, list[tuple[int, int]], int, int, int]:
    """Walk one TimeSeries: (label fields, end of the leading label run or -1 if labels are
    not all in front, spans of the other fields, samples, exemplars, histograms)."""
    label_spans: list[tuple[int, int]] = []
    other: list[tuple[int, int]] = []
    samples = exemplars = histograms = 0
    lead_end = p  # end of the labels while they are all in front
    pos = p
    while pos < end:
        b = raw[pos]
        if b == 0x0A:  # a label field; one- and two-byte lengths read inline
            c = raw[pos + 1] if pos + 1 < end else 0x80
            if c < 0x80:
                q = pos + 2 + c
            elif pos + 2 < end and raw[pos + 2] < 0x80:
                q = pos + 3 + ((c & 0x7F) | (raw[pos + 2] << 7))
            else:
                _, _, _, q = skip_field(raw, pos, end)
            if q > end:
                raise _invalid("label runs past the end of its series")
            label_spans.append((pos, q))
            if other:
                lead_end = -1
            elif lead_end >= 0:
                lead_end = q
        else:
            number, wt, _, q = skip_field(raw, pos, end)
            if number == 1:
                raise _invalid("label field with a wrong wire type")
            if wt == 2:
                if number == 2:
                    samples += 1
                elif number == 3:
                    exemplars += 1
                elif number == 4:
                    histograms += 1
            elif number in (2, 3, 4):
                raise _invalid("series data field with a wrong wire type")
            other.append((pos, q))
        pos = q
    if lead_end >= 0:
        return raw[p:lead_end], lead_end, other, samples, exemplars, histograms
    key = b"".join(raw[s:q] for s, q in label_spans)
    return key, -1, other, samples, exemplars, histograms


def splice_v1(
    raw: bytes, get: CacheGet, miss: CacheMiss
) -> tuple[bytes, Counts, list[str]]:
    """Rewrite the labels of every 1.0 series the cache says to; copy everything else.

    ``get(label_bytes)`` is a cache probe (a dict's ``get``); ``miss(label_bytes)``
    computes (and stores) the entry when the probe finds nothing valid for
    ``generation``. Returns the new body (``raw`` itself when nothing changed), the counts,
    and the reasons of the series passed through unattributed, one item per series (the
    attributed ones are ``counts.series - len(reasons)``), for the caller to tally.

    Fast path: Prometheus writes a series as its labels followed by one sample of 18 bytes
    (a value and a 6-byte timestamp) or 9 bytes (value 0 left out). When the tail looks
    like such a sample, the bytes before it are the key. A hit is proof: only complete
    runs of Label fields are ever stored, so the prefix is exactly the label fields and the
    tail exactly one sample field. On a miss the key is offered to ``miss``, which parses
    it as Label fields; when it is not (the tail only looked like a sample), the series
    takes the full walk, which handles every valid layout.
    This loop is the proxy's hottest code: it is written for few bytecodes per series.
    """
    n = len(raw)
    out: list[bytes] = []
    append = out.append
    reasons: list[str] = []
    add_reason = reasons.append
    copy_from = 0
    pos = 0
    series = slow = samples = exemplars = histograms = 0
    try:
        while pos < n:
            if raw[pos] != 0x0A:
                number, _, _, q = skip_field(raw, pos, n)
                if number == 1:
                    raise _invalid("timeseries field with a wrong wire type")
                pos = q
                continue
            series += 1
            b = raw[pos + 1]
            if b < 0x80:
                p = pos + 2
                end = p + b
            else:
                b2 = raw[pos + 2]
                if b2 < 0x80:
                    p = pos + 3
                    end = p + ((b & 0x7F) | (b2 << 7))
                else:
                    ln, p = uvarint(raw, pos + 1)
                    end = p + ln
            if end > n:
                raise _invalid("series runs past the end of the request")
            q = end - 18
            if q > p and raw[q] == 0x12 and raw[q + 1] == 16:
                tail = 2
            else:
                q = end - 9
                tail = 3 if q > p and raw[q] == 0x12 and raw[q + 1] == 7 else 0
            if tail:
                key = raw[p:q]
                ent = get(key)
                if ent is None or ent[0][0] is not ent[6]:
                    try:
                        ent = miss(key)
                    except DecodeError as exc:
                        if exc.kind != "protobuf_invalid":
                            raise
                        ent = None  # not a label run after all: walk the series
                if ent is not None:
                    new = ent[1]
                    if new is not None:
                        append(raw[copy_from:pos])
                        append(ent[tail])
                        append(new)
                        copy_from = q
                    elif ent[5]:
                        add_reason(ent[5])
                    pos = end
                    continue
            # full walk
            slow += 1
            key, lead_end, other, s_, e_, h_ = _split_series_v1(raw, p, end)
            samples += s_
            exemplars += e_
            histograms += h_
            ent = get(key)
            if ent is None or ent[0][0] is not ent[6]:
                ent = miss(key)
            new = ent[1]
            if new is not None:
                append(raw[copy_from:pos])
                if lead_end >= 0:
                    append(_ts_head_v1(end - p + ent[4]))
                    append(new)
                    copy_from = lead_end
                else:
                    rest = b"".join(raw[s:e] for s, e in other)
                    append(_ts_head_v1(len(new) + len(rest)))
                    append(new)
                    append(rest)
                    copy_from = end
            elif ent[5]:
                add_reason(ent[5])
            pos = end
    except IndexError:
        raise _invalid("truncated message") from None
    counts = Counts(series, samples + series - slow, histograms, exemplars)
    if not out:
        return raw, counts, reasons
    append(raw[copy_from:])
    return b"".join(out), counts, reasons


def count_v1(raw: bytes) -> Counts:
    """Counts of a 1.0 body without changing it (pass-through paths)."""
    counts = Counts()
    pos = 0
    n = len(raw)
    while pos < n:
        number, wt, s, q = skip_field(raw, pos, n)
        if number == 1:
            if wt != 2:
                raise _invalid("timeseries field with a wrong wire type")
            _, _, _, s_, e_, h_ = _split_series_v1(raw, s, q)
            counts.series += 1
            counts.samples += s_
            counts.exemplars += e_
            counts.histograms += h_
        pos = q
    return counts


# -- RW 2.0 -------------------------------------------------------------------------------


@dataclass(slots=True)
class ScanV2:
    """Where things are in a 2.0 request."""

    symbols: list[bytes]
    #: end offset of the last symbols field (-1 when there is none)
    symbols_end: int
    #: (field start, payload start, field end) of every TimeSeries
    series: list[tuple[int, int, int]]


def scan_v2(raw: bytes) -> ScanV2:
    symbols: list[bytes] = []
    add_symbol = symbols.append
    series: list[tuple[int, int, int]] = []
    add_series = series.append
    symbols_end = -1
    pos = 0
    n = len(raw)
    try:
        while pos < n:
            tag = raw[pos]
            if tag == 0x22 or tag == 0x2A:  # symbols = 4, timeseries = 5; short lengths inline
                c = raw[pos + 1]
                if c < 0x80:
                    s = pos + 2
                    q = s + c
                elif raw[pos + 2] < 0x80:
                    s = pos + 3
                    q = s + ((c & 0x7F) | (raw[pos + 2] << 7))
                else:
                    _, _, s, q = skip_field(raw, pos, n)
                if q > n:
                    raise _invalid("field runs past the end of its message")
                if tag == 0x22:
                    add_symbol(raw[s:q])
                    symbols_end = q
                else:
                    add_series((pos, s, q))
                pos = q
                continue
            number, wt, s, q = skip_field(raw, pos, n)
            if number == 4:
                if wt != 2:
                    raise _invalid("symbols field with a wrong wire type")
                add_symbol(raw[s:q])
                symbols_end = q
            elif number == 5:
                if wt != 2:
                    raise _invalid("timeseries field with a wrong wire type")
                add_series((pos, s, q))
            pos = q
    except IndexError:
        raise _invalid("truncated message") from None
    if symbols:
        # one C-level check for all: NUL is ASCII, so joining keeps every fault visible
        try:
            b"\x00".join(symbols).decode("utf-8")
        except UnicodeDecodeError:
            bad = next(s for s in symbols if not _valid_utf8(s))
            raise DecodeError(
                "invalid_utf8", 400, f"symbol is not valid UTF-8: {bad[:64]!r}"
            ) from None
        if symbols[0] != b"":
            raise _invalid("symbols table must start with the empty string")
    return ScanV2(symbols, symbols_end, series)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def decode_packed(buf: bytes, p: int, end: int, out: list[int]) -> None:
    while p < end:
        b = buf[p]
        if b < 0x80:
            out.append(b)
            p += 1
        else:
            v, p = uvarint(buf, p)
            out.append(v)
    if p != end:
        raise _invalid("packed varints run past their field")


def read_refs(raw: bytes, wt: int, s: int, q: int, refs: list[int], what: str) -> None:
    """A ``labels_refs`` field, packed (the norm) or one unpacked element (also legal)."""
    if wt == 2:
        decode_packed(raw, s, q, refs)
    elif wt == 0:
        refs.append(uvarint(raw, s)[0])
    else:
        raise _invalid(f"{what} with a wrong wire type")


@dataclass(slots=True)
class SeriesV2:
    """One 2.0 TimeSeries taken apart: label refs and the spans of everything else."""

    refs: list[int]
    other: list[tuple[int, int]]
    samples: int
    histograms: int
    exemplars: int


def split_series_v2(raw: bytes, p: int, end: int) -> SeriesV2:
    refs: list[int] = []
    other: list[tuple[int, int]] = []
    samples = histograms = exemplars = 0
    while p < end:
        number, wt, s, q = skip_field(raw, p, end)
        if number == 1:
            read_refs(raw, wt, s, q, refs, "labels_refs")
        else:
            if wt == 2:
                if number == 2:
                    samples += 1
                elif number == 3:
                    histograms += 1
                elif number == 4:
                    exemplars += 1
            elif number in (2, 3, 4, 5):
                raise _invalid("series data field with a wrong wire type")
            other.append((p, q))
        p = q
    if len(refs) % 2:
        raise _invalid("labels_refs has an odd number of entries")
    return SeriesV2(refs, other, samples, histograms, exemplars)


def _check_refs(refs: Sequence[int], nsym: int) -> None:
    if refs and max(refs) >= nsym:
        raise _invalid(f"symbol reference {max(refs)} past the table of {nsym}")


#: What the caller's cache holds per resolved label set (the tuple of a series' label
#: strings, name, value, name, value, ...), first four items read here:
#: ``(cell, reason, at, data, token, ...)``: cell, token and reason as in :data:`Entry`;
#: ``at`` -1 unchanged, >= 0 the pair index where the stamped ``data`` (name, value,
#: name, value, ... sorted by name) goes in, -2 ``data`` is every (name, value) pair of the
#: new label set.
EntryV2 = tuple[Any, ...]
UNCHANGED = -1
WHOLE = -2
LabelKey = tuple[bytes, ...]
CacheGetV2 = Callable[[LabelKey], "EntryV2 | None"]
CacheMissV2 = Callable[[LabelKey], "EntryV2"]

_NVARINTS: dict[int, re.Pattern[bytes]] = {}


def _varints_end(raw: bytes, s: int, q: int, k: int) -> int:
    """Offset after the first ``k`` varints packed in ``raw[s:q]`` (one C-level match)."""
    if k == 0:
        return s
    rx = _NVARINTS.get(k)
    if rx is None:
        rx = _NVARINTS[k] = re.compile(rb"(?:[\x80-\xff]*[\x00-\x7f]){%d}" % k)
    m = rx.match(raw, s, q)
    if m is None:  # pragma: no cover - the refs were decoded from these bytes
        raise _invalid("packed varints")
    return m.end()


def _decode_refs(raw: bytes, s: int, q: int) -> list[int]:
    out: list[int] = []
    decode_packed(raw, s, q, out)
    return out


def _encode_refs(refs: Sequence[int]) -> bytes:
    if not refs or max(refs) < 0x80:
        return bytes(refs)
    return b"".join(encode_uvarint(r) for r in refs)


def splice_v2(
    raw: bytes,
    get: CacheGetV2,
    miss: CacheMissV2,
    intern: dict[bytes, bytes] | None = None,
) -> tuple[bytes, Counts, list[str]]:
    """Rewrite ``labels_refs`` of every 2.0 series the cache stamps; copy the rest.

    The cache is keyed by the resolved label strings, so it carries across requests
    (refs are per request, strings are not). New strings go to the end of the symbols
    table (right after the last existing symbol field), existing ones are reused, so every
    ref already in the request stays valid. Returns the body (``raw`` itself when nothing
    changed), the counts, and the reasons of the unattributed series (as ``splice_v1``).

    Fast layout (what Prometheus writes): one packed ``labels_refs`` field first, then
    exactly one sample field. Its refs are decoded in place, and a stamped series' new
    refs are the old packed bytes cut at the block position with the stamp's refs in
    between. Any other layout is taken apart field by field.

    ``intern`` (the caller's, kept across requests): the key's strings are looked up there
    first, so keys of later requests hold the very objects the cache's keys hold and a
    probe compares identities instead of bytes.
    """
    scan = scan_v2(raw)
    syms = scan.symbols
    nsym = len(syms)
    key_syms = syms if intern is None else list(map(intern.setdefault, syms, syms))
    sym_index: dict[bytes, int] | None = None
    new_syms: list[bytes] = []
    #: id(stamp) -> (stamp, its refs packed): the stamp kept so its id stays its own
    stamp_refs: dict[int, tuple[Any, bytes]] = {}
    #: string -> its ref in this request, encoded
    enc_ref: dict[bytes, bytes] = {}
    out: list[bytes] = []
    append = out.append
    copy_from = 0
    # new symbols go right after the last symbols field: a slot in ``out``, filled at the end
    sym_at = scan.symbols_end if scan.symbols_end >= 0 else 0
    sym_slot = -1
    reasons: list[str] = []
    add_reason = reasons.append
    series = samples = histograms = exemplars = 0
    try:
        for start, p, end in scan.series:
            series += 1
            labels: list[bytes] | None = None  # name, value, name, value, ...
            s = q = -1
            if p < end and raw[p] == 0x0A:
                c = raw[p + 1]
                if c < 0x80:
                    s = p + 2
                    q = s + c
                elif raw[p + 2] < 0x80:
                    s = p + 3
                    q = s + ((c & 0x7F) | (raw[p + 2] << 7))
                if 0 <= q < end - 1 and raw[q] == 0x12 and raw[q + 1] < 0x80 and (
                    q + 2 + raw[q + 1] == end
                ):
                    # refs resolved as they are read (q < end: raw[i + 1] exists)
                    labels = []
                    add = labels.append
                    i = s
                    try:
                        while i < q:
                            b = raw[i]
                            if b < 0x80:
                                add(key_syms[b])
                                i += 1
                            else:
                                b2 = raw[i + 1]
                                if b2 < 0x80:
                                    add(key_syms[(b & 0x7F) | (b2 << 7)])
                                    i += 2
                                else:
                                    v, i = uvarint(raw, i)
                                    add(key_syms[v])
                    except IndexError:
                        raise _invalid(f"a symbol reference is past the table of {nsym}") from None
                    if i != q:
                        raise _invalid("packed varints run past their field")
                    samples += 1
            ser = None
            if labels is None:
                ser = split_series_v2(raw, p, end)
                refs = ser.refs
                if refs and max(refs) >= nsym:
                    raise _invalid(f"symbol reference {max(refs)} past the table of {nsym}")
                labels = [key_syms[r] for r in refs]
                samples += ser.samples
                histograms += ser.histograms
                exemplars += ser.exemplars
            if len(labels) & 1:
                raise _invalid("labels_refs has an odd number of entries")
            key = tuple(labels)
            ent = get(key)
            if ent is None or ent[0][0] is not ent[4]:
                ent = miss(key)
            if ent[1]:
                add_reason(ent[1])
            at = ent[2]
            if at == UNCHANGED:
                continue
            if sym_index is None:
                # the first occurrence of a string wins, as a reader would look it up
                sym_index = dict(zip(reversed(syms), range(nsym - 1, -1, -1), strict=True))
                if not syms:
                    new_syms.append(b"")
                    sym_index[b""] = 0
            data = ent[3]
            if at >= 0:
                memo = stamp_refs.get(id(data))
                if memo is None:
                    for x in data:
                        if x not in enc_ref:
                            enc_ref[x] = encode_uvarint(_sym_ref(x, sym_index, new_syms, nsym))
                    sp = b"".join(map(enc_ref.__getitem__, data))
                    stamp_refs[id(data)] = (data, sp)
                else:
                    sp = memo[1]
            if sym_slot < 0 and sym_at <= start:
                append(raw[copy_from:sym_at])
                sym_slot = len(out)
                append(b"")
                copy_from = sym_at
            append(raw[copy_from:start])
            copy_from = end
            if at >= 0 and ser is None:
                # the packed refs cut at the block; the sample after them copied as it was
                cut = _varints_end(raw, s, q, 2 * at)
                n_refs = q - s + len(sp)
                lab_head = _head(0x0A, n_refs)
                append(_head(0x2A, len(lab_head) + n_refs + end - q) + lab_head)
                append(raw[s:cut])
                append(sp)
                append(raw[cut:end])
                continue
            refs = ser.refs if ser is not None else _decode_refs(raw, s, q)
            if at >= 0:
                packed = _encode_refs(refs[: 2 * at]) + sp + _encode_refs(refs[2 * at :])
            else:
                packed = b"".join(
                    _refs_bytes(
                        _sym_ref(n, sym_index, new_syms, nsym),
                        _sym_ref(v, sym_index, new_syms, nsym),
                    )
                    for n, v in data
                )
            rest = raw[q:end] if ser is None else b"".join(raw[a:b] for a, b in ser.other)
            append(len_field(5, len_field(1, packed) + rest))
    except IndexError:
        raise _invalid("truncated message") from None
    counts = Counts(series, samples, histograms, exemplars)
    if not out:
        return raw, counts, reasons
    if sym_slot < 0:  # the symbols come after every changed series
        append(raw[copy_from:sym_at])
        sym_slot = len(out)
        append(b"")
        copy_from = sym_at
    out[sym_slot] = b"".join(len_field(4, x) for x in new_syms)
    append(raw[copy_from:])
    return b"".join(out), counts, reasons


def _refs_bytes(a: int, b: int) -> bytes:
    if a < 0x80 and b < 0x80:
        return bytes((a, b))
    return encode_uvarint(a) + encode_uvarint(b)


def _sym_ref(s: bytes, index: dict[bytes, int], new_syms: list[bytes], base: int) -> int:
    """The ref of string ``s``: an existing symbol, or a new one appended to the table."""
    ref = index.get(s)
    if ref is None:
        ref = base + len(new_syms)
        new_syms.append(s)
        index[s] = ref
    return ref


def count_v2(raw: bytes) -> Counts:
    scan = scan_v2(raw)
    counts = Counts()
    for _, p, end in scan.series:
        ser = split_series_v2(raw, p, end)
        _check_refs(ser.refs, len(scan.symbols))
        counts.series += 1
        counts.samples += ser.samples
        counts.histograms += ser.histograms
        counts.exemplars += ser.exemplars
    return counts


# -- RW 2.0 -> 1.0 ------------------------------------------------------------------------


def _copy_fields(raw: bytes, p: int, end: int, skip: Collection[int]) -> bytes:
    """The fields of one message minus those numbered in ``skip``, bytes as they were."""
    parts: list[bytes] = []
    start = p
    while p < end:
        number, _, _, q = skip_field(raw, p, end)
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
        ser = split_series_v2(raw_v2, p, end)
        _check_refs(ser.refs, nsym)
        samples: list[bytes] = []
        exemplars: list[bytes] = []
        histograms: list[bytes] = []
        for s, q in ser.other:
            number, _, ps, fq = skip_field(raw_v2, s, q)
            if number == 2:  # Sample: drop start_timestamp = 3
                samples.append(len_field(2, _copy_fields(raw_v2, ps, fq, (3,))))
            elif number == 3:  # Histogram (2.0: 3, 1.0: 4): drop start_timestamp = 17
                histograms.append(len_field(4, _copy_fields(raw_v2, ps, fq, (17,))))
            elif number == 4:  # Exemplar (2.0: 4, 1.0: 3)
                exemplars.append(len_field(3, _exemplar_v1(raw_v2, ps, fq, syms)))
            elif number == 5:
                name = _metric_name(ser.refs, syms)
                mtype, help_ref, unit_ref = _metadata_v2(raw_v2, ps, fq)
                _check_refs((help_ref, unit_ref), nsym)
                if name and (mtype or help_ref or unit_ref):
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


def _metric_name(refs: Sequence[int], syms: Sequence[bytes]) -> bytes:
    for i in range(0, len(refs), 2):
        if syms[refs[i]] == b"__name__":
            return syms[refs[i + 1]]
    return b""


def _metadata_v2(raw: bytes, p: int, end: int) -> tuple[int, int, int]:
    mtype = help_ref = unit_ref = 0
    while p < end:
        number, wt, s, q = skip_field(raw, p, end)
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


def _exemplar_v1(raw: bytes, p: int, end: int, syms: Sequence[bytes]) -> bytes:
    refs: list[int] = []
    rest: list[bytes] = []
    while p < end:
        number, wt, s, q = skip_field(raw, p, end)
        if number == 1:
            read_refs(raw, wt, s, q, refs, "exemplar labels_refs")
        else:
            rest.append(raw[p:q])
        p = q
    if len(refs) % 2:
        raise _invalid("exemplar labels_refs has an odd number of entries")
    _check_refs(refs, len(syms))
    return _labels_v1(refs, syms) + b"".join(rest)
