"""Protobuf wire primitives shared by every encoder and decoder of the project: varints,
field framing, the RW 1.0 Label encoding, and the remote-write message kinds.

One place for these (as VictoriaMetrics keeps them in ``lib/prompb``) so the splices, the
2.0 -> 1.0 conversion and the fact encoder cannot drift apart on the framing.

Wire facts used throughout (see ``proto/``): a 1.0 WriteRequest is ``timeseries = 1`` and
``metadata = 3``; a TimeSeries is ``labels = 1``, ``samples = 2``, ``exemplars = 3``,
``histograms = 4``; a Label is ``name = 1``, ``value = 2``. A 2.0 Request is
``symbols = 4`` and ``timeseries = 5``; its TimeSeries has ``labels_refs = 1`` (packed
uint32), ``samples = 2``, ``histograms = 3``, ``exemplars = 4``, ``metadata = 5``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from proxy.compression import DecodeError
from proxy.shown import SHOWN, shown

#: Prometheus' staleness marker: a NaN with this exact bit pattern ends a series (a float
#: sample of it, or a histogram whose ``sum`` is it).
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]


class Protocol(enum.Enum):
    """The two remote-write messages; the value is the protobuf message name."""

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
    """RW 1.0 or 2.0 from a Content-Type; :class:`DecodeError` 415 for anything else.

    No Content-Type at all is RW 1.0, as Prometheus' own receiver takes it: early 1.0
    senders set none, and refusing them would drop data a direct write keeps.
    """
    if not ct.strip():
        return Protocol.V1
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


def invalid(what: str) -> DecodeError:
    """The error of every malformed protobuf: 400 ``protobuf_invalid``."""
    return DecodeError("protobuf_invalid", 400, f"invalid protobuf: {what}")


def check_utf8(b: bytes, what: str) -> None:
    """400 ``invalid_utf8`` unless ``b`` is valid UTF-8 (Prometheus refuses such labels),
    the string shown escaped (:func:`proxy.shown.shown`)."""
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("invalid_utf8", 400,
                          f'{what} is not valid UTF-8: "{shown(b)}"') from None


# -- varints and fields -------------------------------------------------------------------

_BYTE = [bytes((i,)) for i in range(128)]


def uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, position after it).

    At most 10 bytes, and the 10th may only carry the top bit of a 64-bit value: protobuf
    readers refuse anything longer or larger, so the proxy does too.
    """
    result = 0
    shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise invalid("truncated varint")
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            raise invalid("varint overflows 64 bits")
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


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


#: largest field number protobuf allows (2^29 - 1)
MAX_FIELD_NUMBER = (1 << 29) - 1


def read_field(buf: bytes, pos: int, end: int) -> tuple[int, int, int, int]:
    """Read the field at ``pos``: (field number, wire type, payload start, field end).

    For length-delimited fields the payload start is after the length; for the others it
    is after the tag. Groups (wire types 3, 4) are refused: no remote-write message has
    any. A field that runs past ``end`` is refused.
    """
    key, p = uvarint(buf, pos)
    number = key >> 3
    wt = key & 7
    if number == 0:
        raise invalid("field number 0")
    if number > MAX_FIELD_NUMBER:
        raise invalid(f"field number {number} is past 2^29 - 1")
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
        raise invalid(f"unsupported wire type {wt}")
    if q > end:
        raise invalid("field runs past the end of its message")
    return number, wt, p, q


def decode_packed(buf: bytes, p: int, end: int, out: list[int]) -> None:
    """Append the packed varints of ``buf[p:end]`` to ``out``."""
    while p < end:
        b = buf[p]
        if b < 0x80:
            out.append(b)
            p += 1
        else:
            v, p = uvarint(buf, p)
            out.append(v)
    if p != end:
        raise invalid("packed varints run past their field")


def read_refs(raw: bytes, wt: int, s: int, q: int, refs: list[int], what: str) -> None:
    """A ``labels_refs`` field, packed (the norm) or one unpacked element (also legal)."""
    if wt == 2:
        decode_packed(raw, s, q, refs)
    elif wt == 0:
        refs.append(uvarint(raw, s)[0])
    else:
        raise invalid(f"{what} with a wrong wire type")


def encode_refs(refs: list[int]) -> bytes:
    """Packed varints (the payload of a ``labels_refs`` field)."""
    if not refs or max(refs) < 0x80:
        return bytes(refs)
    return b"".join(encode_uvarint(r) for r in refs)


# -- labels -------------------------------------------------------------------------------


def encode_label_v1(name: bytes, value: bytes) -> bytes:
    """One RW 1.0 Label field, as Prometheus writes it (empty value left out)."""
    inner = len_field(1, name) + (len_field(2, value) if value else b"")
    return len_field(1, inner)


def parse_label(buf: bytes, p: int, end: int) -> tuple[bytes, bytes]:
    """Name and value of one Label message (unknown fields inside are skipped; the last of
    a repeated name or value wins, as in every protobuf reader)."""
    name = b""
    value = b""
    while p < end:
        number, wt, s, q = read_field(buf, p, end)
        if number == 1 and wt == 2:
            name = buf[s:q]
        elif number == 2 and wt == 2:
            value = buf[s:q]
        elif number in (1, 2):
            raise invalid("label name/value with a wrong wire type")
        p = q
    return name, value


def labels_of(field: bytes) -> bytes:
    """The label fields of a whole RW 1.0 TimeSeries field (its tag and length first):
    what names the series, whatever its sample. The fact writer remembers a series the
    upstream refused by them (``b"".join(series[1:])`` of its own encoded series)."""
    _, _, p, end = read_field(field, 0, len(field))
    start = pos = p
    while pos < end:
        number, _, _, q = read_field(field, pos, end)
        if number != 1:
            break
        pos = q
    return field[start:pos]


def series_text(labels: bytes) -> str:
    """``name{label="value", ...}`` of a series' RW 1.0 label fields, for a log line that
    names a series (bytes that are not UTF-8 shown replaced, not refused). A name or value
    longer than :data:`SHOWN` bytes is cut there, its length said (``"xxx..." (5000
    bytes)``): a series refused for a long value would otherwise log it whole."""
    pairs: list[tuple[str, str]] = []
    pos, end = 0, len(labels)
    while pos < end:
        _, _, p, q = read_field(labels, pos, end)
        k, v = parse_label(labels, p, q)
        pairs.append((_cut_text(k), _cut_text(v)))
        pos = q
    metric = next((v for k, v in pairs if k == "__name__"), "")
    rest = ", ".join(f'{k}="{v}"' for k, v in pairs if k != "__name__")
    return f"{metric}{{{rest}}}"


def _cut_text(b: bytes) -> str:
    if len(b) <= SHOWN:
        return b.decode("utf-8", "replace")
    return b[:SHOWN].decode("utf-8", "replace") + f"...({len(b)} bytes)"


# -- the payloads a splice copies (samples, exemplars, histograms, metadata) -------------

#: wire type of each known field (numbers 1, 2, ...; -1: any): a sample, RW 1.0 and 2.0
SAMPLE_WIRE_TYPES = (1, 0, 0)
#: an exemplar's value and timestamp (field 1, its labels, is read on its own)
EXEMPLAR_WIRE_TYPES = (-1, 1, 0)
#: an RW 2.0 Metadata: type, (reserved), help_ref, unit_ref
METADATA_V2_WIRE_TYPES = (0, -1, 0, 0)
#: a Histogram's fields 1-17 (RW 1.0 has 1-16): a wire type, or "s" BucketSpans (a
#: message of two varints), "v" sint64s and "d" doubles (one per field, or packed)
HISTOGRAM_FIELDS: tuple[int | str, ...] = (
    0, 1, 1, 0, 1, 0, 1, "s", "v", "d", "s", "v", "d", 0, 0, "d", 0)


def check_fields(buf: bytes, p: int, end: int, wire_types: tuple[int, ...], what: str
                 ) -> None:
    """Walk a payload the splice copies unparsed: every field's framing (read_field's
    rules) and the wire type of its known fields, as a protobuf reader would refuse them.

    Mirrors ``check_fields`` of ``_splice.c``."""
    k = len(wire_types)
    while p < end:
        number, wt, _, q = read_field(buf, p, end)
        if number <= k and wire_types[number - 1] >= 0 and wt != wire_types[number - 1]:
            raise invalid(f"{what} field {number} with a wrong wire type")
        p = q


def check_histogram(buf: bytes, p: int, end: int, known: int) -> None:
    """A Histogram (``known``: 16 fields in RW 1.0, 17 in 2.0): its framing, the wire types
    of its fields, its spans' framing, packed varints that parse, packed doubles of
    whole 8-byte values."""
    while p < end:
        number, wt, s, q = read_field(buf, p, end)
        kind = HISTOGRAM_FIELDS[number - 1] if number <= known else -1
        if kind == "s":
            if wt != 2:
                raise invalid(f"histogram field {number} with a wrong wire type")
            check_fields(buf, s, q, (0, 0), "bucket span")
        elif kind in ("v", "d"):
            if wt == 2:
                if kind == "v":
                    decode_packed(buf, s, q, [])
                elif (q - s) % 8:
                    raise invalid(f"histogram field {number}: packed doubles of {q - s} bytes")
            elif wt != (0 if kind == "v" else 1):
                raise invalid(f"histogram field {number} with a wrong wire type")
        elif kind != -1 and wt != kind:
            raise invalid(f"histogram field {number} with a wrong wire type")
        p = q


def check_exemplar_v1(buf: bytes, p: int, end: int) -> None:
    """An RW 1.0 Exemplar: its framing, and each label's framing and UTF-8."""
    while p < end:
        number, wt, s, q = read_field(buf, p, end)
        if number == 1:
            if wt != 2:
                raise invalid("exemplar label with a wrong wire type")
            name, value = parse_label(buf, s, q)
            check_utf8(name, "exemplar label name")
            check_utf8(value, "exemplar label value")
        elif number <= 3 and wt != EXEMPLAR_WIRE_TYPES[number - 1]:
            raise invalid(f"exemplar field {number} with a wrong wire type")
        p = q


def check_exemplar_v2(buf: bytes, p: int, end: int, nsym: int) -> None:
    """An RW 2.0 Exemplar: its framing; its label refs an even number, inside the table."""
    refs: list[int] = []
    while p < end:
        number, wt, s, q = read_field(buf, p, end)
        if number == 1:
            read_refs(buf, wt, s, q, refs, "exemplar labels_refs")
        elif number <= 3 and wt != EXEMPLAR_WIRE_TYPES[number - 1]:
            raise invalid(f"exemplar field {number} with a wrong wire type")
        p = q
    if len(refs) % 2:
        raise invalid("exemplar labels_refs has an odd number of entries")
    if refs and max(refs) >= nsym:
        raise invalid(f"exemplar symbol reference {max(refs)} past the table of {nsym}")


def check_metadata_v2(buf: bytes, p: int, end: int, nsym: int) -> None:
    """An RW 2.0 Metadata: its framing; help_ref and unit_ref inside the table."""
    while p < end:
        number, wt, s, q = read_field(buf, p, end)
        if number <= 4 and METADATA_V2_WIRE_TYPES[number - 1] >= 0 and (
                wt != METADATA_V2_WIRE_TYPES[number - 1]):
            raise invalid(f"metadata field {number} with a wrong wire type")
        if number in (3, 4):
            ref = uvarint(buf, s)[0]
            if ref >= nsym:
                raise invalid(f"metadata symbol reference {ref} past the table of {nsym}")
        p = q
