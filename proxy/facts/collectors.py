"""The facts on ``/metrics``, and the fact writer's own operational metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

import proxy
from proxy import contract
from proxy.facts.model import HELP, iter_facts
from proxy.facts.writer import FactWriter
from proxy.index import PodIndex


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
    ) -> None:
        self._index = index
        self._build_version = build_version
        self._pod_facts = pod_facts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {
            name: Metric(name, HELP[name], "gauge") for name in contract.FACT_SERIES
        }
        for f in iter_facts(self._index, self._build_version, pods=self._pod_facts):
            families[f.name].add_sample(f.name, dict(f.labels), f.value)
        for m in families.values():
            if m.samples:
                yield m


def _family(counter_name: str) -> str:
    return counter_name.removesuffix("_total")


class FactWriterCollector(Collector):
    """Operational metrics of the fact writer: is this replica the writer, how it fares."""

    def __init__(self, writer: FactWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self._writer
        leader = Metric(contract.OP_FACT_WRITER_LEADER, "1 when this replica writes the "
                        "fact series (lease holder, or no election configured).", "gauge")
        leader.add_sample(contract.OP_FACT_WRITER_LEADER, {}, 1.0 if w.is_writer else 0.0)
        yield leader
        writes = Metric(_family(contract.OP_FACT_WRITES), "Fact series writes by result.",
                        "counter")
        writes.add_sample(contract.OP_FACT_WRITES, {"result": "success"}, float(w.writes_ok))
        writes.add_sample(contract.OP_FACT_WRITES, {"result": "failure"}, float(w.writes_failed))
        yield writes
        stale = Metric(_family(contract.OP_FACT_STALE_MARKERS), "Stale markers written for "
                       "fact series that went away.", "counter")
        stale.add_sample(contract.OP_FACT_STALE_MARKERS, {}, float(w.stale_markers_total))
        yield stale
        series = Metric(contract.OP_FACT_SERIES, "Fact series in the last write.", "gauge")
        series.add_sample(contract.OP_FACT_SERIES, {}, float(w.last_series))
        yield series
        last = Metric(contract.OP_FACT_LAST_WRITE, "Unix time of the last successful "
                      "fact write.", "gauge")
        last.add_sample(contract.OP_FACT_LAST_WRITE, {}, w.last_write_timestamp)
        yield last
