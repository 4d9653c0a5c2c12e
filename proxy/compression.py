"""Request body encodings of remote write: snappy (block format) and zstd, with size limits.

Every decoded byte is bounded before it is allocated: the snappy block header declares the
decoded length, which is checked against ``max_decoded`` before decompressing; zstd frames
declare their content size in the frame header (checked the same way), and frames that do
not are decoded into a buffer that may grow only up to ``max_decoded``.

No identity encoding: remote-write 1.0 and 2.0 both require a compressed body, and a
receiver must answer 415 to an encoding it does not support, so an ``identity``
``Content-Encoding`` gets 415 like any other unknown one. A request without the header is
snappy, as Prometheus' receiver takes it: the handler's choice (``proxy.handler``), made
before it calls here.
"""

from __future__ import annotations

import mmap
import threading
import typing
from collections.abc import Sequence

import cramjam
import snappy

#: encodings ``decompress`` and ``compress`` understand (Content-Encoding values)
SUPPORTED_ENCODINGS: tuple[str, ...] = ("snappy", "zstd")

_ZSTD_MAGIC = 0xFD2FB528
# skippable frames: magic 0x184D2A50..0x184D2A5F
_ZSTD_SKIPPABLE_MASK = 0xFFFFFFF0
_ZSTD_SKIPPABLE = 0x184D2A50
#: first buffer for zstd frames that do not declare their size (grows x4 up to the limit)
_ZSTD_FIRST_GUESS = 1 << 20
#: frames and blocks the header walk reads before it gives up on a declared size: one
#: sender's zstd body is one frame of full 128 KiB blocks (512 at 64 MiB), but 15 MB of
#: empty frames were 1.75M steps of Python, 6 s that held the event loop; past the limit
#: the body counts as declaring no size (decompressed in a worker, in C, to the limit)
ZSTD_WALK_STEPS = 4096


class DecodeError(Exception):
    """A request body the proxy cannot read; ``status`` is the HTTP answer it deserves.

    ``kind`` is a short snake_case label value for the decode-error counter.
    """

    def __init__(self, kind: str, status: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"DecodeError({self.kind!r}, {self.status}, {self.message!r})"


def _too_large(declared: int, limit: int) -> DecodeError:
    return DecodeError(
        "too_large", 413, f"decoded body of {declared} bytes exceeds the limit of {limit} bytes"
    )


def normalize_encoding(encoding: str) -> str:
    return encoding.strip().lower()


class _Scratch(threading.local):
    """This thread's reusable snappy buffers.

    cramjam's allocating calls zero a fresh buffer (the decoded size, or the worst-case
    compressed size) and python-snappy copies the result once more into ``bytes``: ~0.4 ms
    of a 2,000-series request's 3 ms of snappy work, on every request (perf: memset and
    memmove, 16% of a splice worker's CPU). Decoding into and encoding from buffers a
    thread keeps skips both.
    """

    def __init__(self) -> None:
        self.decoded = _EMPTY
        self.encoded = _EMPTY


#: a scratch buffer is an anonymous mapping, not a bytearray: its pages are made resident
#: by the bytes a call writes, not by zeroing it whole when it grows (the encode buffer is
#: sized for the worst case, ~1.17x the input, and a call writes ~a third of that), and it
#: is outside malloc's heap
_EMPTY = mmap.mmap(-1, mmap.PAGESIZE)


_SCRATCH = _Scratch()
#: the largest block a thread decodes or encodes through its scratch buffers; bigger ones
#: are allocated per call, so a thread keeps at most this much per buffer
SCRATCH_BYTES = 8 << 20


def _scratch(buf: mmap.mmap, n: int) -> mmap.mmap:
    """``buf``, or a new mapping of at least ``n`` bytes (whole MiBs) where it is smaller.

    The old mapping is not closed: a view of it that is still alive keeps it until that
    view goes."""
    if len(buf) >= n and buf is not _EMPTY:  # _EMPTY is every thread's first: never
        # written, else threads encoding or decoding small bodies at once shared one page
        return buf
    return mmap.mmap(-1, max(n + (1 << 20) - 1, 1 << 20) & ~((1 << 20) - 1))


def _fresh(n: int) -> mmap.mmap:
    """An anonymous mapping of ``n`` bytes (at least one page), resident only where written
    and unmapped when its last view goes."""
    return mmap.mmap(-1, max(n, 1))


def decompress(body: bytes, encoding: str, *, max_decoded: int) -> bytes:
    """Decode a request body; raises :class:`DecodeError` (400, 413 or 415)."""
    out = _decode(body, encoding, max_decoded, scratch=False)
    assert isinstance(out, bytes)
    return out


def decompress_scratch(body: bytes, encoding: str, *, max_decoded: int) -> bytes | memoryview:
    """:func:`decompress`, but a snappy body is decoded into this thread's reusable buffer:
    the view returned is valid only until the thread's next call. For a caller done with
    it by then (the splice copies whatever it keeps, an untouched body included)."""
    return _decode(body, encoding, max_decoded, scratch=True)


def _decode(body: bytes, encoding: str, max_decoded: int, *, scratch: bool
            ) -> bytes | memoryview:
    enc = normalize_encoding(encoding)
    if enc not in SUPPORTED_ENCODINGS:
        shown = enc or "none"
        raise DecodeError(
            "unsupported_encoding",
            415,
            f"unsupported Content-Encoding {shown!r}: remote write needs snappy or zstd",
        )
    if not body:
        raise DecodeError("empty_body", 400, "empty request body")
    if enc == "snappy":
        return _snappy_decompress(body, max_decoded, scratch)
    out = _zstd_decompress(body, max_decoded)
    # the mapping decoded into, as it is: a bytes copy of it was a second decoded body
    return out if scratch else out.tobytes()


def compress(data: bytes, encoding: str) -> bytes:
    """Encode a body for the upstream (snappy block format or zstd)."""
    enc = normalize_encoding(encoding)
    if enc == "snappy":
        bound = cramjam.snappy.compress_raw_max_len(data)
        if bound > SCRATCH_BYTES:
            out: bytes = snappy.compress(data)
            return out
        buf = _SCRATCH.encoded = _scratch(_SCRATCH.encoded, bound)
        n = cramjam.snappy.compress_raw_into(data, buf)
        with memoryview(buf) as view:
            return bytes(view[:n])
    if enc == "zstd":
        return bytes(cramjam.zstd.compress(data, level=1))
    raise ValueError(f"unsupported encoding {encoding!r}")


# -- snappy --------------------------------------------------------------------------------


def block_part(block: bytes) -> SnappyPart:
    """A part already a snappy block (the splice's), to be joined by :func:`join_snappy`."""
    return SnappyPart(block, snappy_declared_length(block))


class SnappyPart(typing.NamedTuple):
    #: a whole snappy block (its length preamble, then its elements)
    block: bytes
    #: the bytes it decodes to
    decoded: int


def join_snappy(parts: Sequence[SnappyPart]) -> bytes:
    """One snappy block of the parts' bodies concatenated, without compressing again.

    A block is a varint of the decoded length, then literals and back-copies whose offsets
    reach only into the block's own output; so the parts' elements, one after the other
    behind one preamble of the total, decode to the concatenation (every copy finds the
    same bytes at the same distance). Each part's own preamble is dropped.
    """
    out: list[bytes | memoryview] = [_snappy_preamble(sum(p.decoded for p in parts))]
    for p in parts:
        view = memoryview(p.block)
        skip = 0
        while view[skip] & 0x80:
            skip += 1
        out.append(view[skip + 1:])
    return b"".join(out)


def _snappy_preamble(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)



def snappy_declared_length(body: bytes) -> int:
    """The decoded length a snappy block declares in its varint header (uint32)."""
    result = 0
    size = len(body)
    for i in range(5):
        if i >= size:
            break
        b = body[i]
        result |= (b & 0x7F) << (7 * i)
        if b < 0x80:
            if result > 0xFFFFFFFF:
                break
            return result
    raise DecodeError("snappy_corrupt", 400, "corrupt snappy block: bad length header")


#: what python-snappy raises for a bad block: its own error, or cramjam's beneath it
_SNAPPY_ERRORS = (snappy.UncompressError, cramjam.DecompressionError)


def _snappy_decompress(body: bytes, max_decoded: int, scratch: bool = False
                       ) -> bytes | memoryview:
    declared = snappy_declared_length(body)
    if declared > max_decoded:
        raise _too_large(declared, max_decoded)
    try:
        if scratch:
            # past SCRATCH_BYTES into a mapping of its own: python-snappy's bytes were a
            # second decoded body beside cramjam's buffer
            if declared <= SCRATCH_BYTES:
                buf = _SCRATCH.decoded = _scratch(_SCRATCH.decoded, declared)
            else:
                buf = _fresh(declared)
            n = cramjam.snappy.decompress_raw_into(body, buf)
            out: bytes | memoryview = memoryview(buf)[:n]
        else:
            out = snappy.uncompress(body)
    except _SNAPPY_ERRORS as exc:
        detail = str(exc) or type(exc).__name__
        raise DecodeError("snappy_corrupt", 400, f"corrupt snappy block: {detail}") from None
    if len(out) != declared:  # the decoder checks this; be explicit about the promise
        raise DecodeError("snappy_corrupt", 400, "corrupt snappy block: length mismatch")
    return out


# -- zstd ----------------------------------------------------------------------------------


def zstd_declared_length(body: bytes) -> int | None:
    """Sum of the content sizes the frames declare, or None when one does not declare it
    (or the body has more than ``ZSTD_WALK_STEPS`` frames and blocks).

    Walks frame headers only; a frame's compressed length is found by walking its block
    headers (3 bytes each), so nothing is decompressed here.
    """
    pos = 0
    n = len(body)
    total = 0
    known = True
    steps = 0
    while pos < n:
        steps += 1
        if steps > ZSTD_WALK_STEPS:
            return None
        if n - pos < 4:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated frame")
        magic = int.from_bytes(body[pos : pos + 4], "little")
        if magic & _ZSTD_SKIPPABLE_MASK == _ZSTD_SKIPPABLE:
            if n - pos < 8:
                raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated frame")
            pos += 8 + int.from_bytes(body[pos + 4 : pos + 8], "little")
            continue
        if magic != _ZSTD_MAGIC:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: bad frame magic")
        pos += 4
        if pos >= n:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated frame")
        fhd = body[pos]
        pos += 1
        fcs_flag = fhd >> 6
        single_segment = (fhd >> 5) & 1
        checksum = (fhd >> 2) & 1
        did_size = (0, 1, 2, 4)[fhd & 3]
        if not single_segment:
            pos += 1  # window descriptor
        pos += did_size
        fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
        if pos + fcs_size > n:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated frame")
        if fcs_size == 0:
            known = False
        else:
            size = int.from_bytes(body[pos : pos + fcs_size], "little")
            if fcs_size == 2:
                size += 256
            total += size
        pos += fcs_size
        # blocks
        while True:
            if pos + 3 > n:
                raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated block")
            steps += 1
            if steps > ZSTD_WALK_STEPS:
                return None
            bh = int.from_bytes(body[pos : pos + 3], "little")
            pos += 3
            last = bh & 1
            btype = (bh >> 1) & 3
            bsize = bh >> 3
            if btype == 3:
                raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: reserved block type")
            pos += 1 if btype == 1 else bsize  # RLE blocks carry one byte
            if last:
                break
        if checksum:
            pos += 4
    if pos > n:
        raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: truncated frame")
    return total if known else None


def _zstd_decompress(body: bytes, max_decoded: int) -> memoryview:
    declared = zstd_declared_length(body)
    if declared is not None:
        if declared > max_decoded:
            raise _too_large(declared, max_decoded)
        # one byte of slack: a frame decoding to more than it declared fails to fit
        return _zstd_into(body, declared + 1, exact=declared)
    size = min(max_decoded + 1, max(_ZSTD_FIRST_GUESS, len(body) * 8))
    while True:
        try:
            return _zstd_into(body, size, exact=None)
        except _BufferFull:
            if size > max_decoded:
                raise DecodeError(
                    "too_large", 413, f"decoded body exceeds the limit of {max_decoded} bytes"
                ) from None
            size = min(max_decoded + 1, size * 4)


class _BufferFull(Exception):
    pass


def _zstd_into(body: bytes, size: int, *, exact: int | None) -> memoryview:
    # a fresh mapping, not a bytearray: the pages past what the frame writes are never
    # made resident (a body that declares no size is decoded into a buffer as big as the
    # limit), and none is zeroed first
    buf = _fresh(size)
    try:
        written = cramjam.zstd.decompress_into(body, buf)
    except cramjam.DecompressionError as exc:
        # the error's traceback holds this frame for as long as the error lives: not the
        # buffer (up to max_decoded_bytes) with it
        del buf
        # cramjam has one error type for a corrupt frame and for a full buffer: only its
        # message tells them apart (a full buffer is retried bigger, up to the limit)
        if "whole buffer" in str(exc) or "too small" in str(exc):
            if exact is not None:
                raise DecodeError(
                    "zstd_corrupt", 400, "corrupt zstd body: more data than declared"
                ) from None
            raise _BufferFull from None
        raise DecodeError("zstd_corrupt", 400, f"corrupt zstd body: {exc}") from None
    if written >= size or (exact is not None and written != exact):
        del buf  # as above
        if written < size:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: less data than declared")
        if exact is not None:
            raise DecodeError("zstd_corrupt", 400, "corrupt zstd body: more data than declared")
        raise _BufferFull
    return memoryview(buf)[:written]
