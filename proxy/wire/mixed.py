"""RW 2.0 -> 1.0 of a request the native conversion leaves to the reference: its series
with a histogram the native one does not convert (a staleness marker, its sum the stale
NaN, whatever its schema: :func:`needs_reference`) converted by the reference, the rest
natively, in one output equal to the reference's byte for byte. (Custom-bucket
histograms, schema -53, that are no markers are the native conversion's own: their
classic series are made natively, and a series of them goes in the native part.)

Before, one such series sent the WHOLE request to the pure-Python reference: 30-75x the
CPU per byte of the native conversion, holding the GIL (32k series and one histogram
left to the reference: 1.58 CPU-s against 0.06). Now:

- **the native part** is the request with each such series stripped to its labels and
  metadata fields (their bytes as they were, every other top-level field and the whole
  symbols table kept): the native conversion checks everything the reference would of
  the table, the request and every other series, gathers the metadata of **every** series
  in request order (so its metadata fields are the reference's: one per family, first
  seen first), and makes one RW 1.0 TimeSeries of labels only per stripped series;
- **each such series** is converted by the reference on its own, as an RW 2.0 request of
  that series and the symbols it uses (``halves.Layout.part``: the reference reads its
  table per request, so a request of a 256k-symbol table cost it that much each time);
  its TimeSeries fields (the series itself when it is sent, the classic ``_bucket`` /
  ``_sum`` / ``_count`` series of its custom-bucket histograms and markers) replace the
  stripped series' TimeSeries in the native output, at its place. The reference converts
  series by series (a marker's bounds come from its own series, only metadata is
  shared), so the series keep their order and their bytes, and the same series' samples
  their order.

The size (``V1Form``) is computed without making either output: the native size of the
stripped request, less the labels-only TimeSeries, plus the reference's size of each
such series without metadata; its counts are the native ones of the stripped request
(its other series' custom-bucket histograms) plus the reference's of those series.
Anything that fails (the native conversion of the rest declines, the reference raises
for a series, a count does not add up) answers None, and the caller runs the reference
on the whole request, which answers or raises as it always did.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from proxy.wire.convert import (
    V1Form,
    converted_series,
    labels_only_size,
    series_form,
)
from proxy.wire.halves import layout
from proxy.wire.primitives import STALE_NAN_BITS, Protocol, len_field, read_field

#: the native conversion: the size of a request's conversion (``size`` None) or its bytes
#: at that size (with ``starts``: and where each series' output starts); None when it
#: leaves the request to the reference
NativeConvert = Callable[..., "int | bytes | None"]
#: the native conversion's count of a request: (size, histograms, samples), its
#: ``V1Form``; None when it leaves the request to the reference
NativeForm = Callable[[bytes], "tuple[int, int, int] | None"]

_BITS = struct.Struct("<Q")
#: an RW 2.0 series' ``labels_refs`` and ``metadata`` fields; the one-byte tag of a
#: histogram (its field 3, length-delimited)
_KEPT_FIELDS = (1, 5)
#: the request's ``symbols`` and ``timeseries`` fields
_TABLE_AND_SERIES = (4, 5)
_HISTOGRAM_TAG = b"\x1a"
#: the tags of an RW 1.0 TimeSeries and MetricMetadata field of a request
_V1_SERIES, _V1_METADATA = 0x0A, 0x1A


def needs_reference(raw: bytes, start: int, end: int) -> bool:
    """The RW 2.0 series at ``raw[start:end]`` (its TimeSeries field) holds a histogram the
    native conversion leaves to the reference: a staleness marker (its last sum the stale
    NaN, any schema; the marker rules, a custom-bucket one's bounds from the series'
    previous histogram among them, are the reference's)."""
    if raw.find(_HISTOGRAM_TAG, start, end) < 0:  # no histogram tag byte at all
        return False
    _, _, p, q = read_field(raw, start, end)
    while p < q:
        number, wt, s, f = read_field(raw, p, q)
        if number == 3 and wt == 2 and _special_histogram(raw, s, f):
            return True
        p = f
    return False


def _special_histogram(raw: bytes, p: int, end: int) -> bool:
    """The histogram at ``raw[p:end]`` is a staleness marker: its last sum the stale NaN
    (``convert.stale_marker`` and ``custom_buckets`` read the last)."""
    stale = False
    while p < end:
        number, wt, s, q = read_field(raw, p, end)
        if number == 3 and wt == 1:
            stale = _BITS.unpack_from(raw, s)[0] == STALE_NAN_BITS
        p = q
    return stale


@dataclass(slots=True)
class _Split:
    """A request cut for the two conversions."""

    #: the request with each series that needs the reference stripped to its labels and
    #: metadata
    rest: bytes
    #: those series' places among the request's series, in order
    special: list[int]
    #: each of them as a request of its own (its symbols renumbered)
    alone: list[bytes]
    nseries: int


def _split(raw: bytes) -> _Split | None:
    """``raw`` cut so, or None when no series needs the reference (the native conversion
    declined for another reason: the reference's own answer is wanted)."""
    lay = layout(raw, Protocol.V2)
    if any(read_field(raw, s, e)[0] in _TABLE_AND_SERIES for s, e in lay.other.pairs()):
        return None  # a symbol or series under a tag of more bytes: not laid out as one
    special = [i for i, (s, e) in enumerate(lay.series.pairs()) if needs_reference(raw, s, e)]
    if not special:
        return None
    pieces: list[bytes] = []
    at = 0
    for i in special:
        s, e = lay.series[i]
        pieces.append(raw[at:s])
        pieces.append(len_field(5, _labels_and_metadata(raw, s, e)))
        at = e
    pieces.append(raw[at:])
    # series 0's request carries the other top-level fields too (the first part's): the
    # reference reads them as the native part does, and converts none
    return _Split(b"".join(pieces), special, [lay.part(i, i + 1) for i in special],
                  len(lay.series))


def _labels_and_metadata(raw: bytes, start: int, end: int) -> bytes:
    """The payload of the series at ``raw[start:end]`` with only its ``labels_refs`` and
    ``metadata`` fields, their bytes and order as they were."""
    _, _, p, q = read_field(raw, start, end)
    kept: list[bytes] = []
    while p < q:
        number, _, _, f = read_field(raw, p, q)
        if number in _KEPT_FIELDS:
            kept.append(raw[p:f])
        p = f
    return b"".join(kept)


def form(raw: bytes, native: NativeForm) -> V1Form | None:
    """What ``raw`` converts to, counted so (module docstring); None: leave it to the
    reference."""
    try:
        split = _split(raw)
        if split is None:
            return None
        counted = native(split.rest)
        if counted is None:
            return None
        out = V1Form(*counted)
        for alone in split.alone:
            own, _ = series_form(alone)
            out.size += own.size - labels_only_size(alone)
            out.histograms += own.histograms
            out.samples += own.samples
        return out
    except Exception:  # the reference on the whole says what is wrong
        return None


def converted(raw: bytes, native: NativeConvert) -> bytes | None:
    """``raw`` converted so (module docstring), equal to the reference's bytes; None: leave
    it to the reference."""
    try:
        split = _split(raw)
        if split is None:
            return None
        size = native(split.rest)
        made = native(split.rest, size, True) if isinstance(size, int) else None
        if not isinstance(made, tuple):
            return None
        body, starts = made
        return _joined(body, memoryview(starts).cast("Q"), split)
    except Exception:  # the reference on the whole says what is wrong
        return None


def _joined(made: bytes, starts: memoryview, split: _Split) -> bytes | None:
    """The native output ``made`` with the stripped series' TimeSeries replaced by the
    reference's conversion of each. ``starts``: where each series' TimeSeries fields start
    in ``made`` (a series of custom-bucket histograms is any number of them: its classic
    series), and their end; None when they do not say one TimeSeries of a stripped
    series, a series' fields, then the metadata."""
    n = split.nseries  # one at least: a series needs the reference
    end = len(made)
    if len(starts) != n + 1 or (starts[n] < end and made[starts[n]] != _V1_METADATA):
        return None
    pieces: list[bytes] = []
    at = 0
    for i, alone in zip(split.special, split.alone, strict=True):
        start, stop = starts[i], starts[i + 1]
        # the stripped series: labels alone, one TimeSeries field, sent
        if not start < stop <= end or made[start] != _V1_SERIES:
            return None
        pieces.append(made[at:start])
        pieces.extend(converted_series(alone)[0])
        at = stop
    pieces.append(made[at:])
    return b"".join(pieces)
