"""Fact series: what the index knows, published as series into the remote-write stream
and on ``/metrics``.

One concept per module: :mod:`~proxy.facts.model` (which series exist for the index's
state), :mod:`~proxy.facts.encoder` (their RW 1.0 bytes), :mod:`~proxy.facts.writer`
(the leader/standby writer into the stream) and :mod:`~proxy.facts.collectors` (the
facts and the writer's metrics on ``/metrics``). This package re-exports what the
runtime, the benchmarks and the tests use.
"""

from proxy.facts.collectors import FactsCollector, FactWriterCollector
from proxy.facts.model import iter_facts, reason_code, workload_facts
from proxy.facts.writer import STANDBY_MEMORY, FactWriter, WriterState

__all__ = [
    "STANDBY_MEMORY",
    "FactWriter",
    "FactWriterCollector",
    "FactsCollector",
    "WriterState",
    "iter_facts",
    "reason_code",
    "workload_facts",
]
