"""The facts on ``/metrics``, and the fact writer's own operational metrics.

The writer's metrics are plain prometheus_client ``Counter`` / ``Gauge`` objects
(:class:`FactWriterMetrics`), which the writer counts into. The facts themselves are not:
they are the index's state at the scrape, series that come and go with pods and
workloads and whose label sets differ within a family (``reason`` only on unattributed
pods), so :class:`FactsCollector` renders them per scrape from the fact model, a family at
a time, instead of keeping a labelled child per series (290k of them at 37.5k pods)
between scrapes or building them all as samples at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import Counter, Gauge
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

import proxy
from proxy import contract
from proxy.exposition import TextFamily
from proxy.facts.model import HELP, POD_FAMILIES, family_facts
from proxy.index import PodIndex
from proxy.metrics import present_at_zero


class FactsCollector(Collector):
    """The fact series on ``/metrics`` (every replica, leader or not; no stale markers).

    No external labels here: the scraping Prometheus adds its own target labels. Scrape
    with ``honor_labels: true`` so the facts' ``namespace``/``pod`` labels are not renamed
    to ``exported_*`` by the target's.
    """

    def __init__(
        self,
        index: PodIndex,
        build_version: str = proxy.__version__,
        *,
        pod_facts: bool = True,
        cluster_uid: Callable[[], str] = str,
    ) -> None:
        self._index = index
        self._build_version = build_version
        self._pod_facts = pod_facts
        #: the cluster's uid as known now ("" unknown: proxy.kube.cluster_identity)
        self._cluster_uid = cluster_uid

    def collect(self) -> Iterator[Metric]:
        """One :class:`~proxy.exposition.TextFamily` per fact family with series, each
        rendered from the fact model as it is written (:func:`proxy.exposition.chunks`):
        a scrape holds one family's producer and a chunk of text, never all the samples
        (~290k at 37.5k pods: that took a scrape from ~235 to ~446 MiB). Every family
        reads the pods and workloads taken here, so the page describes one state.

        None before the index is ready: it holds some kinds and not yet others (pods are
        listed before their ReplicaSets), and a pod whose owner is not listed yet walks
        up to it as its workload: with ``server.forward_before_ready`` (ready for a
        Service, so scraped) an audit saw ``karta_workload_info{karta_kind="ReplicaSet"}``
        and 22 more lines of a workload that does not exist, stored by the scrape. The
        fact writer, for the same reason, writes nothing before ready."""
        index = self._index
        if not index.ready:
            return
        pods = list(index.pods.values())
        workloads = list(index.fact_workloads().values())
        cluster_uid = self._cluster_uid()
        for name in contract.FACT_SERIES:
            if name in POD_FAMILIES and not self._pod_facts:
                continue
            facts = family_facts(name, index, pods, workloads, self._build_version,
                                 cluster_uid)
            first = next(facts, None)
            if first is None:
                continue
            rows = ((f.labels, f.value) for f in itertools.chain((first,), facts))
            yield TextFamily(name, HELP[name], rows)


def _by_reason(name: str, documentation: str, reasons: Iterable[str]) -> Counter:
    """A counter by ``reason``, outside any registry, every reason present from the start."""
    return present_at_zero(Counter(name, documentation, ["reason"], registry=None), reasons)


class FactWriterMetrics:
    """The fact writer's counters and gauges, outside any registry (the writer's
    :class:`FactWriterCollector` serves them where the runtime registers it)."""

    def __init__(self) -> None:
        self.leader = Gauge(contract.OP_FACT_WRITER_LEADER, "1 when this replica writes the "
                            "fact series (lease holder, or no election configured).",
                            registry=None)
        self.writes = Counter(contract.OP_FACT_WRITES, "Fact series writes by result.",
                              ["result"], registry=None)
        self.writes_ok = self.writes.labels(result="success")
        self.writes_failed = self.writes.labels(result="failure")
        self.stale_markers = Counter(contract.OP_FACT_STALE_MARKERS, "Stale markers written "
                                     "for fact series this writer wrote that went away (not "
                                     "the markers a takeover writes for the other source's "
                                     "transition series, nor those for series the previous "
                                     "leader probably ended).", registry=None)
        self.series_refused = Counter(
            contract.OP_FACT_SERIES_REFUSED, "Fact series the upstream refused for good, "
            "left out of a write: one by one after a 400 bisected down to them, or with a "
            "request refused whole.", registry=None)
        self.series = Gauge(contract.OP_FACT_SERIES, "Fact series in the last write.",
                            registry=None)
        self.last_write = Gauge(contract.OP_FACT_LAST_WRITE, "Unix time of the last "
                                "successful fact write.", registry=None)
        self.stepdowns = _by_reason(
            contract.OP_FACT_WRITER_STEPDOWNS, "Times this replica gave the fact writer's "
            "lease up by itself, by reason (writes_failing: every fact write failed for "
            "long enough that another replica may do better; clock_offset: every write was "
            "held that long, this host's clock off the upstream's).", contract.STEPDOWN_REASONS)
        self.clock_offset = Gauge(
            contract.OP_UPSTREAM_CLOCK_OFFSET, "This host's wall clock less the upstream's, "
            "by the Date header of its answers to the proxy's own requests, in seconds "
            "(NaN before one came); fact writes are held while it is beyond "
            "facts.max_clock_offset_seconds.", registry=None)
        self.lease_failures = _by_reason(
            contract.OP_FACT_LEASE_FAILURES, "Rounds of the fact writer's lease election "
            "that failed, by reason (timeout, status: the API answered an error, "
            "connection).", contract.LEASE_FAILURE_REASONS)

    def families(self) -> Iterator[Metric]:
        """Every family, without the counters' ``_created`` samples: docs/metrics.md
        lists what the writer serves, and the creation time of a process-lifetime
        counter says nothing ``process_start_time_seconds`` does not."""
        for metric in (self.leader, self.writes, self.stale_markers, self.series_refused,
                       self.series, self.last_write, self.stepdowns, self.lease_failures,
                       self.clock_offset):
            for family in metric.collect():
                family.samples = [s for s in family.samples
                                  if not s.name.endswith("_created")]
                yield family


def sample_value(metric: Counter | Gauge) -> float:
    """The value of an unlabelled metric or one labelled child (tests, benchmarks)."""
    family = next(iter(metric.collect()))
    return next(s.value for s in family.samples if not s.name.endswith("_created"))


class MeteredWriter(Protocol):
    """What :class:`FactWriterCollector` reads of a writer (no import of the writer, which
    counts into :class:`FactWriterMetrics` defined here)."""

    @property
    def metrics(self) -> FactWriterMetrics: ...


class FactWriterCollector(Collector):
    """Operational metrics of the fact writer: is this replica the writer, how it fares."""

    def __init__(self, writer: MeteredWriter) -> None:
        self._metrics = writer.metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()
