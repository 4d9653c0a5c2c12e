"""The fact series as RW 1.0 wire bytes: label fields, samples, stale markers, metadata.

A few lines of protobuf wire format on purpose, over the shared primitives of
:mod:`proxy.wire.primitives`: the writer caches each pod's / workload's series as label
bytes (a :data:`Series`: header and label pieces), and a write only appends a sample to
each. Building protobuf message
objects for 100k pods every 15 s would cost far more than the facts are worth.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from proxy import contract
from proxy.facts.model import HELP, POD_FAMILIES, Fact, Labels
from proxy.wire.primitives import encode_label_v1, len_field
from proxy.wire.primitives import encode_uvarint as _varint


@functools.lru_cache(maxsize=1 << 12)
def _label_field(name: str, value: str) -> bytes:
    """TimeSeries.labels (field 1): the shared Label encoding, cached by the text pair.

    Cached: most pairs (identity labels, phases, external labels) repeat across thousands
    of series, one workload's ~20 series in a row. Small: pods' names and uids never
    repeat, and 64k entries held ~17 MB for them."""
    return encode_label_v1(name.encode(), value.encode())


def merged_pairs(name: str, labels: Labels, external: Labels) -> list[tuple[str, str]]:
    """``__name__``, the labels and the external labels a series is written with, sorted;
    the series' own label wins over an external one (Prometheus' external-label rule, so a
    misconfigured external label cannot duplicate a name), empty values are left out."""
    merged = dict(external)
    merged.update(labels)
    merged["__name__"] = name
    return [(k, merged[k]) for k in sorted(merged) if merged[k]]


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


#: label names of a workload's identity (:func:`proxy.facts.model.workload_identity`):
#: every series of a workload carries the same ones, so their fields are encoded once per
#: workload and shared by its ~20 series
IDENTITY_LABELS = frozenset(
    (contract.LABEL_GROUP, contract.LABEL_KIND, contract.LABEL_NAMESPACE, contract.LABEL_WORKLOAD)
)
#: the families whose series carry a workload's identity (every family but the pods', the
#: coverage and the process facts)
WORKLOAD_FAMILIES = frozenset(contract.FACT_SERIES) - frozenset((
    contract.FACT_POD_INFO, contract.FACT_POD_UNATTRIBUTED_INFO, contract.FACT_NAMESPACE_PODS,
    contract.FACT_SOURCE_LAST_CURRENT, contract.FACT_CONTRACT_INFO, contract.FACT_BUILD_INFO,
))

#: the labels of the families made per pod (``POD_FAMILIES``) that are the pod's own: every other
#: label of a pod's series (its family's name, the stamp, the reason, the external labels)
#: is the same for every pod of a workload component, so each run of those is one bytes
#: object for all of them (:func:`_pod_pieces`) instead of a copy in every pod's series
#: (3.4 MB less RSS at 37.5k pods, ``memory_bench.py``)
POD_OWN_LABELS = frozenset(
    (contract.FACT_LABEL_NAMESPACE, contract.FACT_LABEL_POD, contract.FACT_LABEL_UID)
)

#: A series as the writer keeps it: ``(header, *label pieces)``, whose concatenation is
#: ``0x0a <length> <label fields>``, the TimeSeries header and labels, ready to be followed
#: by one sample field. Pieces, not one bytes object, so that a workload's identity
#: labels are held once for all its series; equal tuples are equal series (the pieces of
#: a label set are a function of the set and the series' family: see :func:`encode_facts`).
Series = tuple[bytes, ...]


@functools.lru_cache(maxsize=1 << 12)
def series_header(length: int) -> bytes:
    """``0x0a <length>``: a WriteRequest.timeseries field header; one object per length."""
    return b"\x0a" + _varint(length)


def series_bytes(series: Series) -> bytes:
    """A series' header and labels as one string (the order of stale markers)."""
    return b"".join(series)


#: the values of a group of one series of value 1 (a pod's info series): one tuple for all
_ONE = (1.0,)


@functools.lru_cache(maxsize=1 << 10)
def _shape(counts: tuple[int, ...]) -> tuple[int, ...]:
    """One object per shape: the ~11k workloads of a cluster have a handful of shapes."""
    return counts


class Group(NamedTuple):
    """The fact series of one pod or workload (or the coverage, or the process facts), as
    the writer keeps them between writes: ``values[i]`` is the value of the i-th series.

    Flat, not a tuple per series: a workload's ~22 series as tuples of pieces were 18 MiB
    of the writer's cache at 37.5k pods (11.7k workloads), a 72-byte tuple each; laid end
    to end they are one tuple of pointers per workload. ``shape`` says how many pieces
    each series has (its header, then its label pieces) and is one object for every group
    of that shape. A workload's series share its identity piece (:func:`_pieces`): held
    as one bytes object per series, the prefixes were ~60 MB at 37.5k pods.

    A group is a tuple subclass, which the cyclic collector never untracks (it does so
    for exact tuples only): the writer leaves its groups out of later collections with
    ``memory.freeze_survivors`` after each write, as it does its cache.
    """

    pieces: tuple[bytes, ...]
    shape: tuple[int, ...]
    values: tuple[float, ...]

    def series(self) -> Iterator[Series]:
        """Each series' header and label pieces, in order."""
        pieces, start = self.pieces, 0
        if len(self.shape) == 1:  # a pod's: the pieces are the series
            yield pieces
            return
        for n in self.shape:
            yield pieces[start:start + n]
            start += n


@functools.lru_cache(maxsize=1 << 10)
def interleaver(shape: tuple[int, ...]) -> Callable[[tuple[bytes, ...]], tuple[bytes, ...]]:
    """For a group of ``shape``: from ``pieces + samples`` (one sample field per series),
    each series' pieces followed by its sample field, in one C call. A write makes a
    group's part of a request with it instead of a step of Python per series: that step
    was ~85% of a warm write (0.2-0.3 s at 37.5k pods, the event loop's time)."""
    take: list[int] = []
    start, samples = 0, sum(shape)
    for i, n in enumerate(shape):
        take.extend(range(start, start + n))
        take.append(samples + i)
        start += n
    return operator.itemgetter(*take)  # >= 3 indices (a header, a label piece, a
    # sample): a tuple, never a bare item


def _make(flat: list[bytes], counts: list[int], values: list[float]) -> Group:
    vals = tuple(values)
    return Group(tuple(flat), _shape(tuple(counts)), _ONE if vals == _ONE else vals)


def _group(series: Iterable[Series], values: Iterable[float]) -> Group:
    flat: list[bytes] = []
    counts: list[int] = []
    for one in series:
        flat.extend(one)
        counts.append(len(one))
    return _make(flat, counts, list(values))


def union(first: Group, then: Group) -> Group:
    """The series of ``first``, then those of ``then`` that ``first`` lacks (with their
    values): what one write made of two objects of one identity, or what is owed stale
    markers after writes that did not all land."""
    have = set(first.series())
    extra = [(s, v) for s, v in zip(then.series(), then.values, strict=True) if s not in have]
    if not extra:
        return first
    return _group([*first.series(), *(s for s, _ in extra)],
                  [*first.values, *(v for _, v in extra)])


def swapped(series: Series, old: bytes, new: bytes, sample_len: int) -> Series | None:
    """``series`` with its label field ``old`` (one piece, not in a shared run) replaced by
    ``new``, for samples of ``sample_len``; None when it has no such piece."""
    if old not in series:
        return None
    labels = tuple(new if piece == old else piece for piece in series[1:])
    return (series_header(sum(map(len, labels)) + sample_len), *labels)


def label_field(name: str, value: str) -> bytes:
    """One label field as the encoder writes it (a series' piece, unless shared)."""
    return _label_field(name, value)


def rehead(group: Group, sample_len: int) -> Group:
    """A kept group for sample fields of another length (its headers count the sample)."""
    return _group(
        ((series_header(sum(map(len, one[1:])) + sample_len), *one[1:])
         for one in group.series()),
        group.values,
    )


def _pieces(pairs: list[tuple[str, str]], shared: dict[tuple[tuple[str, str], ...], bytes],
            shared_names: frozenset[str]) -> list[bytes]:
    """Label fields of sorted ``pairs``: each run of consecutive ``shared_names`` pairs as
    one piece, the same object for every series of the call (``shared``), the others a
    field each (cached: phases, statuses and names repeat across workloads)."""
    out: list[bytes] = []
    run: list[tuple[str, str]] = []

    def flush() -> None:
        if run:
            key = tuple(run)
            piece = shared.get(key)
            if piece is None:
                piece = shared[key] = b"".join(_label_field(k, v) for k, v in key)
            out.append(piece)
            run.clear()

    for pair in pairs:
        if pair[0] in shared_names:
            run.append(pair)
        else:
            flush()
            out.append(_label_field(*pair))
    flush()
    return out


def _unshared(piece: bytes) -> bytes:
    return piece


def _pod_pieces(pairs: list[tuple[str, str]],
                runs: Callable[[bytes], bytes]) -> list[bytes]:
    """Label fields of a pod's sorted ``pairs``, each run of consecutive labels of one
    sort (the pod's own, :data:`POD_OWN_LABELS`, or not) as one piece; a run not the pod's
    own is what ``runs`` gives for it (the equal one it shares)."""
    out: list[bytes] = []
    run: list[bytes] = []
    own = False
    for k, v in pairs:
        mine = k in POD_OWN_LABELS
        if run and mine is not own:
            piece = b"".join(run)
            out.append(piece if own else runs(piece))
            run.clear()
        own = mine
        run.append(_label_field(k, v))
    if run:
        piece = b"".join(run)
        out.append(piece if own else runs(piece))
    return out


def encode_facts(facts: Iterable[Fact], external: Labels, sample_len: int,
                 runs: Callable[[bytes], bytes] | None = None) -> Group:
    """The series of ``facts`` with ``external`` labels, for samples of ``sample_len``; a
    label set that comes twice is written once, with its first value.

    A workload family's series is ``(header, pieces...)`` with the identity and external
    labels in shared runs (:func:`_pieces`); a pod's is ``(header, pieces...)`` with the
    labels that are not the pod's own in pieces shared through ``runs`` (:func:`_pod_pieces`:
    the writer's :class:`~proxy.shared_values.SharedValues`; None: not shared); every
    other series (the coverage's, the process') is ``(header, labels)``: nothing in it
    repeats. Which it is depends on the family alone, so one label set always makes the
    same tuple (the writer compares a group's series with what it wrote last time).
    """
    flat: list[bytes] = []
    counts: list[int] = []
    values: list[float] = []
    shared: dict[tuple[tuple[str, str], ...], bytes] = {}
    shared_names = IDENTITY_LABELS | {k for k, _ in external}
    for f in facts:
        pairs = merged_pairs(f.name, f.labels, external)
        if f.name in WORKLOAD_FAMILIES:
            pieces = _pieces(pairs, shared, shared_names)
        elif f.name in POD_FAMILIES:
            pieces = _pod_pieces(pairs, _unshared if runs is None else runs)
        else:
            pieces = [b"".join(_label_field(k, v) for k, v in pairs)]
        flat.append(series_header(sum(map(len, pieces)) + sample_len))
        flat.extend(pieces)
        counts.append(len(pieces) + 1)
        values.append(f.value)
    group = _make(flat, counts, values)
    if len(counts) > 1 and len(set(group.series())) < len(counts):  # e.g. an instance id
        first: dict[Series, float] = {}  # listed twice in the object
        for one, value in zip(group.series(), group.values, strict=True):
            first.setdefault(one, value)
        return _group(first, first.values())
    return group
