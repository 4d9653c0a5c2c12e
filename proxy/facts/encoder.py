"""The fact series as RW 1.0 wire bytes: label fields, samples, stale markers, metadata.

A few lines of protobuf wire format on purpose, over the shared primitives of
:mod:`proxy.wire.primitives`: the writer caches each pod's / workload's series as label
bytes (a *prefix*), and a write only appends a sample to each. Building protobuf message
objects for 100k pods every 15 s would cost far more than the facts are worth.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from typing import NamedTuple

from proxy import contract
from proxy.facts.model import HELP, Fact, Labels
from proxy.wire.primitives import encode_label_v1, len_field
from proxy.wire.primitives import encode_uvarint as _varint

#: Prometheus' stale marker: a NaN with this exact bit pattern ends a series.
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]


@functools.lru_cache(maxsize=1 << 12)
def _label_field(name: str, value: str) -> bytes:
    """TimeSeries.labels (field 1): the shared Label encoding, cached by the text pair.

    Cached: most pairs (identity labels, phases, external labels) repeat across thousands
    of series, one workload's ~20 series in a row. Small: pods' names and uids never
    repeat, and 64k entries held ~17 MB for them."""
    return encode_label_v1(name.encode(), value.encode())


def encode_labels(name: str, labels: Labels, external: Labels = ()) -> bytes:
    """TimeSeries.labels fields: ``__name__`` + labels + external labels, sorted by name.

    A series' own label wins over an external label of the same name (Prometheus'
    external-label rule), so a misconfigured external label cannot duplicate a name.
    """
    merged = dict(external)
    merged.update(labels)
    merged["__name__"] = name
    return b"".join(_label_field(k, merged[k]) for k in sorted(merged) if merged[k])


def timestamp_field(now_ms: int) -> bytes:
    """Sample.timestamp (field 2): the same bytes for every sample of one write."""
    return b"\x10" + _varint(now_ms)


def sample_field(value: float, ts_bytes: bytes) -> bytes:
    """TimeSeries.samples (field 2) holding one Sample{value=1 double, timestamp=2}."""
    sample = b"\x09" + struct.pack("<d", value) + ts_bytes
    return b"\x12" + _varint(len(sample)) + sample


def _metadata(name: str) -> bytes:
    """WriteRequest.metadata (field 3): MetricMetadata{type=GAUGE, family, help}."""
    body = (
        b"\x08\x02"  # type = GAUGE
        + len_field(2, name.encode())
        + len_field(4, HELP.get(name, "").encode())
    )
    return len_field(3, body)


#: the metadata of every fact family, appended to the last request of a write
METADATA = b"".join(_metadata(n) for n in contract.FACT_SERIES)


def series_prefix(label_bytes: bytes, sample_len: int) -> bytes:
    """``0x0a <length> <labels>``: a WriteRequest.timeseries header and its labels, ready
    to be followed by one sample field of ``sample_len`` bytes."""
    return b"\x0a" + _varint(len(label_bytes) + sample_len) + label_bytes


def split_header(prefix: bytes) -> bytes:
    """The label bytes of a cached series prefix (``0x0a <varint length> <labels>``)."""
    i = 1
    while prefix[i] & 0x80:
        i += 1
    return prefix[i + 1 :]


def rehead(prefix: bytes, sample_len: int) -> bytes:
    """A cached prefix for a sample field of another length."""
    return series_prefix(split_header(prefix), sample_len)


class Encoded(NamedTuple):
    """The fact series of one pod or workload, as the writer caches them between writes.

    A prefix is ``0x0a <length> <label fields>``, the TimeSeries header and labels, ready
    to be followed by the sample of a write; ``values[i]`` is the value of ``prefixes[i]``.
    Two tuples, not a (prefix, value) pair per series: 290k series at 37.5k pods, the
    pairs and lists were ~13 MB of the cache.
    """

    prefixes: tuple[bytes, ...]
    values: tuple[float, ...]


def encode_facts(facts: Iterable[Fact], external: Labels, sample_len: int) -> Encoded:
    """The series of ``facts`` with ``external`` labels, for samples of ``sample_len``."""
    prefixes: list[bytes] = []
    values: list[float] = []
    for f in facts:
        prefixes.append(series_prefix(encode_labels(f.name, f.labels, external), sample_len))
        values.append(f.value)
    return Encoded(tuple(prefixes), tuple(values))
