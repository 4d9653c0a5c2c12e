"""Counters and histograms updated by one thread only, the event loop's, as plain numbers,
and read by the registry at scrape time.

A ``prometheus_client`` update costs the event loop thread five or six Python calls (the
child's lookup, ``inc`` and its two observability checks, the value's ``inc`` with its
lock): about 60 of the ~850 calls that thread makes per remote-write request, where what
karta-proxy spends beyond a plain relay is that thread's interpreter work
(docs/performance.md, "Fourteenth pass"). The request path's counters are updated on the
event loop alone, so they need no lock: here a counter is a number in a dict, ``+=`` is
the whole update (no call at all), and a histogram's observation is one method call and a
``bisect``.

**One thread writes.** ``+=`` on a shared number is a read and a write; two threads doing
it may lose one's update. A family here must be updated by the event loop thread only; a
metric updated from worker threads too (``karta_proxy_splice_limits_total``, taken as a
splice grows) stays a ``prometheus_client`` one. Reading from another thread (a test's
``get_sample_value``) sees each number as it was at some point, as prometheus_client's
own reads do; each family's samples are built in one go (no await inside), so a
``/metrics`` page that pauses between families (``proxy.yielding``) never reads a dict
the loop is adding to.

**The same exposition.** Names, help, type, label names and order, and sample order are
those of the ``prometheus_client`` metric it replaces (``*_created`` are off process-wide:
``proxy.metrics``): an unlabelled family is present at 0 from the start, a labelled
family's series appear at their first update, in that order, and histogram buckets are
cumulative, ``le`` written as ``prometheus_client`` writes it, then ``_count`` and
``_sum``; every value a float.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

#: a series' label values, in the family's label order (``()``: the unlabelled series)
LabelValues = tuple[str, ...]


class _LoopFamily(Collector):
    """What both kinds of family share: the names ``describe`` gives the registry (for
    its checks of names taken twice), and the registration once the series are set up
    (a scrape may collect as soon as it is registered)."""

    #: the prometheus_client family class the exposition is made of
    kind: type[CounterMetricFamily] | type[HistogramMetricFamily]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)

    def _register(self, registry: CollectorRegistry | None) -> None:
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield self.kind(self.name, self.documentation, labels=self.labelnames)


class LoopCounter(_LoopFamily):
    """A counter family whose series are ``values[label values]``: ``+=`` them, on the
    event loop thread only. An unlabelled counter's one series is ``values[()]``."""

    kind = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        super().__init__(name, documentation, labelnames)
        #: each series' count, by its label values; a missing one is made at 0 when first
        #: added to (a ``defaultdict``: no call on the update)
        self.values: defaultdict[LabelValues, float] = defaultdict(float)
        if not self.labelnames:
            self.values[()] = 0.0  # present from the start, as prometheus_client's is
        self._register(registry)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        yield family


class Observations:
    """One histogram series: its bucket counts (not cumulative) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose bound is at least it (as
        prometheus_client does; the last bound is +Inf)."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Series(dict[LabelValues, Observations]):
    """A histogram's series by label values, each made when first looked up."""

    __slots__ = ("bounds",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__()
        self.bounds = bounds

    def __missing__(self, labels: LabelValues) -> Observations:
        series = self[labels] = Observations(self.bounds)
        return series


class LoopHistogram(_LoopFamily):
    """A histogram family whose series are ``series[label values]`` (made at the first
    look-up): ``.observe(amount)`` them, on the event loop thread only. An unlabelled
    histogram's one series is ``series[()]``."""

    kind = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry | None = None) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = tuple(float(b) for b in buckets)
        if bounds[-1] != INF:
            bounds += (INF,)
        #: the buckets' ``le`` values as written
        self._les = tuple(floatToGoString(b) for b in bounds)
        self.series = _Series(bounds)
        if not self.labelnames:
            self.series[()]  # present from the start, as prometheus_client's is
        self._register(registry)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in list(self.series.items()):
            total = 0.0
            buckets = []
            for le, n in zip(self._les, list(series.counts), strict=True):
                total += n
                buckets.append((le, total))
            family.add_metric(labels, buckets, series.sum)
        yield family
