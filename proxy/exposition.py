"""The ``/metrics`` body as a stream of chunks, a family at a time.

``prometheus_client.generate_latest`` holds the whole page three times over (a string
per sample line, their join, its UTF-8 encoding) and every sample as a ``Sample`` with a
label dict. For the proxy's own metrics that is nothing; for the fact families (~290k
series at 37.5k pods, ~41 MB of text) it took a scrape from ~235 to ~446 MiB of RSS. A
collector that can render its families itself yields :class:`TextFamily` objects: their
lines are made from the collector's own records as they are written out, a chunk at a
time, so a scrape holds one chunk of text, not the page. Every other family goes
through ``generate_latest`` one family at a time, so the page is byte for byte what
``generate_latest`` would make of the whole registry.

A :class:`TextFamily` is a ``Metric`` too: a consumer that reads ``samples`` (
``generate_latest`` itself, a test, another registry) gets them, made on first access.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

#: bytes of text per chunk written to the response: large enough that the per-write
#: cost of the transport stays small, small enough to be nothing next to the process
CHUNK_BYTES = 1 << 16

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    """A label value as the text format writes it (prometheus_client's escaping)."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def sample_line(name: str, labels: Iterable[tuple[str, str]], value: float, *,
                timestamp: int | None = None, number: Callable[[float], str] = floatToGoString,
                extra: str = "") -> str:
    """One sample line, as ``generate_latest`` renders it (labels sorted by name, no
    timestamp). Names are the contract's, valid legacy names: nothing to escape there.

    For text that imitates another exporter's (the demo exporter's kubelet and DCGM
    pages): ``timestamp``, milliseconds written after the value; ``number``, the value's
    format (``floatToGoString`` writes ``1.0`` where the kubelet writes ``1``);
    ``extra``, label text already rendered, written after the sorted labels (a scrape
    target's, as Prometheus appends them)."""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels))
    if extra:
        inner = f"{inner},{extra}" if inner else extra
    head = f"{name}{{{inner}}}" if inner else name
    if timestamp is None:
        return f"{head} {number(value)}\n"
    return f"{head} {number(value)} {timestamp}\n"


def family_header(name: str, documentation: str, kind: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family, as ``generate_latest`` writes them."""
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class TextFamily(Metric):
    """A gauge family whose samples are rendered straight from ``rows`` (labels, value)
    when the page is written: :meth:`chunks` for :func:`chunks`, ``samples`` for any
    other reader. ``rows`` is read once (one scrape)."""

    def __init__(self, name: str, documentation: str,
                 rows: Iterable[tuple[Labels, float]]) -> None:
        self._rows: Iterable[tuple[Labels, float]] | None = rows
        self._samples: list[Sample] | None = None
        super().__init__(name, documentation, "gauge")

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            rows, self._rows = self._rows or (), None
            self._samples = [Sample(self.name, dict(labels), value) for labels, value in rows]
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        """``Metric.__init__`` sets an empty list; samples come from the rows instead."""
        if value:
            self._samples = list(value)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The family's text, ``chunk_bytes`` at a time (roughly: whole lines)."""
        if self._samples is not None:  # already read as samples: render those
            yield generate_latest(_One(self))
            return
        rows, self._rows = self._rows or (), None
        name = self.name
        part = [family_header(name, self.documentation, self.type)]
        size = 0
        for labels, value in rows:
            line = sample_line(name, labels, value)
            part.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield "".join(part).encode()
                part, size = [], 0
        if part:
            yield "".join(part).encode()


class _One(Collector):
    """One family as a registry, for ``generate_latest``."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self._metric


class AllBut:
    """Every sample name but ``left_out``: a ``names`` for :func:`chunks` that leaves
    families out (``/metrics?facts=false``) rather than listing the ones kept, so a family
    a later version adds is still served."""

    __slots__ = ("left_out", "within")

    def __init__(self, left_out: Container[str], within: Container[str] | None = None) -> None:
        self.left_out = left_out
        #: the names asked for beside (``name[]``), or None: every other
        self.within = within

    def __contains__(self, name: object) -> bool:
        return name not in self.left_out and (self.within is None or name in self.within)


def restricted(metric: Metric, names: Container[str]) -> Metric | None:
    """``metric`` with only its samples named in ``names`` (``requests_total``, not
    ``requests``; ``duration_seconds_bucket``), or None when it has none: what
    prometheus_client's own ``name[]`` filter keeps. A :class:`TextFamily` (a gauge: its
    samples carry its name) is kept or left out whole, its rows never read when left out."""
    if isinstance(metric, TextFamily):
        return metric if metric.name in names else None
    samples = [s for s in metric.samples if s.name in names]
    if not samples:
        return None
    out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    out.samples = samples
    return out


def chunks(registry: Any, names: Container[str] | None = None) -> Iterator[bytes]:
    """The text exposition of ``registry`` (anything with ``collect()``), a family or a
    chunk at a time: the same bytes as ``generate_latest(registry)``; with ``names``, only
    the samples so named (:func:`restricted`), in the registry's order. An empty chunk
    comes after each family, kept or not: a point to pause at with nothing to write,
    since a collector may do a family's work (finding it has no series) before yielding
    it."""
    for metric in registry.collect():
        kept = metric if names is None else restricted(metric, names)
        if isinstance(kept, TextFamily):
            yield from kept.chunks()
        elif kept is not None:
            yield generate_latest(_One(kept))
        yield b""
