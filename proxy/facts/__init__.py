"""Fact series: what the index knows, published as series into the remote-write stream
and on ``/metrics``.

One concept per module: :mod:`~proxy.facts.model` (which series exist for the index's
state), :mod:`~proxy.facts.encoder` (their RW 1.0 bytes), :mod:`~proxy.facts.writer`
(the leader/standby writer into the stream) and :mod:`~proxy.facts.collectors` (the
facts and the writer's metrics on ``/metrics``). This package re-exports what the
runtime, the benchmarks and the tests use.
"""

from proxy.facts.collectors import FactsCollector, FactWriterCollector
from proxy.facts.encoder import encode_labels
from proxy.facts.model import (
    HELP,
    Fact,
    Labels,
    coverage_facts,
    iter_facts,
    pod_facts,
    process_facts,
    reason_code,
    workload_facts,
    workload_identity,
)
from proxy.facts.writer import MAX_SERIES_PER_REQUEST, STANDBY_MEMORY, FactWriter, WriterState

__all__ = [
    "HELP",
    "MAX_SERIES_PER_REQUEST",
    "STANDBY_MEMORY",
    "Fact",
    "FactWriter",
    "FactWriterCollector",
    "FactsCollector",
    "Labels",
    "WriterState",
    "coverage_facts",
    "encode_labels",
    "iter_facts",
    "pod_facts",
    "process_facts",
    "reason_code",
    "workload_facts",
    "workload_identity",
]
