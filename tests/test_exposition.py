"""The /metrics page as chunks: the bytes of ``generate_latest``, a chunk of text held at
a time, valid for Prometheus' own linter."""

from __future__ import annotations

import re
import shutil
import subprocess
import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from proxy import exposition
from proxy.exposition import CHUNK_BYTES, TextFamily
from proxy.facts import FactsCollector
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, ReplicaFact, WorkloadFacts, WorkloadRef
from proxy.metrics import ProxyMetrics


def big_index(workloads: int = 400, per: int = 10) -> PodIndex:
    """``workloads`` RayJobs of ``per`` pods: ~21 series per workload, one per pod."""
    cs = ChangeSet()
    for w in range(workloads):
        ref = WorkloadRef(f"ns-{w % 7}", "ray.io", "RayJob", f"job-{w}", f"w{w}")
        cs.workloads[ref.uid] = WorkloadFacts(
            ref, "rayjob", False, "Running", ("Running",), "", 1.7e9 + w,
            (ReplicaFact("workers", "g0", per, 1, 2 * per, per),))
        for p in range(per):
            cs.pods[f"p{w}-{p}"] = PodAttribution(ref.namespace, f"job-{w}-{p}", f"p{w}-{p}",
                                                  ref, "workers", "g0", str(p))
    cs.pods["lost"] = PodAttribution("ns-0", "loner", "lost", None, reason="no_owner: x")
    index = PodIndex()
    index.ready = True
    index.apply(cs)
    index.mark_fresh("pods", 1_700_000_000.25)
    return index


def proxy_registry(index: PodIndex) -> CollectorRegistry:
    """The proxy's registry as the runtime fills it: its own metrics, then the facts."""
    registry = ProxyMetrics().registry
    registry.register(FactsCollector(index, "1.2.3"))
    return registry


def steady(page: bytes) -> list[bytes]:
    """The page without the samples of the process collectors (memory, CPU, GC counts
    move between two renderings); their HELP and TYPE lines stay."""
    return [line for line in page.splitlines(keepends=True)
            if not line.startswith((b"process_", b"python_gc_"))]


def test_the_page_is_generate_latest_byte_for_byte() -> None:
    registry = proxy_registry(big_index())
    page = b"".join(exposition.chunks(registry))
    assert steady(page) == steady(generate_latest(registry))
    names = {f.name for f in text_string_to_metric_families(page.decode())}
    assert {"karta_pod_info", "karta_workload_phase", "karta_proxy_requests"} <= names


def test_label_values_and_help_are_escaped_as_prometheus_client_does() -> None:
    rows = [((("a", 'say "hi"'), ("b", "back\\slash"), ("c", "two\nlines")), 1.5),
            ((("z", "é ü 日本"),), float("nan")), ((), float("inf")), ((("k", "v"),), 1e21)]
    plain = Metric("odd_family", 'help with \\ and\nnewline', "gauge")
    for labels, value in rows:
        plain.add_sample("odd_family", dict(labels), value)
    ours = CollectorRegistry()
    theirs = CollectorRegistry()

    class One:
        def __init__(self, m: Metric) -> None:
            self.m = m

        def collect(self) -> list[Metric]:
            return [self.m]

    ours.register(One(TextFamily("odd_family", 'help with \\ and\nnewline', rows)))
    theirs.register(One(plain))
    assert b"".join(exposition.chunks(ours)) == generate_latest(theirs)


def test_a_text_family_read_as_samples_is_the_same_family() -> None:
    """Any other reader of the registry (generate_latest, a parser in a test) gets the
    samples, made on first access, once."""
    index = big_index(20, 2)
    fams = list(FactsCollector(index).collect())
    assert all(isinstance(f, TextFamily) for f in fams)
    phase = next(f for f in fams if f.name == "karta_workload_phase")
    assert len(phase.samples) == 20 * 9 and phase.samples is phase.samples
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    assert b"".join(exposition.chunks(registry)) == generate_latest(registry)


def test_chunks_are_bounded_and_the_page_is_never_held_whole() -> None:
    registry = proxy_registry(big_index(600, 10))
    tracemalloc.start()
    try:
        sizes = [len(c) for c in exposition.chunks(registry)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    page = sum(sizes)
    assert page > 3_000_000
    assert max(sizes) < CHUNK_BYTES + 1024  # a chunk is whole lines, a line is short
    assert peak < page / 5, f"{peak} bytes traced for a {page}-byte page"


def test_empty_fact_families_are_left_out() -> None:
    index = PodIndex()
    index.ready = True
    index.apply(ChangeSet(pods={"p": PodAttribution("ns", "p", "p", None, reason="x")}))
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    page = b"".join(exposition.chunks(registry)).decode()
    assert page == generate_latest(registry).decode()
    assert "karta_workload_phase" not in page and "karta_pod_unattributed_info{" in page


def test_counters_and_gauges_pass_through_unchanged() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things done.", ["kind"], registry=registry).labels("a").inc(2)
    Gauge("level", "A level.", registry=registry).set(0.5)
    assert b"".join(exposition.chunks(registry)) == generate_latest(registry)


def _sample_names(page: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in page.splitlines()
            if line and not line.startswith("#")}


def test_a_name_filter_keeps_the_series_named() -> None:
    # every kind of family on the proxy's page, named by its samples (a counter's _total,
    # a histogram's _bucket and _count), one family left out whole, one name unknown
    registry = proxy_registry(big_index(30, 2))
    Counter("things", "Things done.", ["kind"], registry=registry).labels("a").inc(2)
    Histogram("waits_seconds", "Waits.", registry=registry).observe(0.2)
    names = {"things_total", "waits_seconds_bucket", "waits_seconds_count",
             "karta_workload_phase", "karta_build_info", "process_open_fds", "no_such_series"}
    page = b"".join(exposition.chunks(registry, names)).decode()
    assert _sample_names(page) == names - {"no_such_series"}
    assert page.count("karta_workload_phase{") == 30 * 9


def test_a_name_filter_keeps_what_prometheus_clients_own_keeps() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things done.", ["kind"], registry=registry).labels("a").inc(2)
    Histogram("waits_seconds", "Waits.", registry=registry).observe(0.2)
    Gauge("level", "A level.", registry=registry).set(0.5)
    for names in ({"things_total"}, {"waits_seconds_bucket", "level", "things"},
                  {"waits_seconds_sum", "waits_seconds_count", "things_total"}):
        ours = b"".join(exposition.chunks(registry, names))
        # prometheus_client's filter walks its collectors as a set: another order
        theirs = generate_latest(registry.restricted_registry(names))
        assert sorted(ours.splitlines()) == sorted(theirs.splitlines()), names


def test_a_fact_family_left_out_is_never_rendered() -> None:
    """A scrape of the operational series alone costs nothing of the fact families'
    rendering: a family left out by the filter never has its rows read."""
    read: list[str] = []

    def rows(name: str) -> Iterator[tuple[exposition.Labels, float]]:
        read.append(name)
        yield (("a", "b"),), 1.0

    class Facts:
        def collect(self) -> Iterator[Metric]:
            yield TextFamily("big_fact", "Many series.", rows("big_fact"))
            yield TextFamily("small_fact", "One series.", rows("small_fact"))

    registry = CollectorRegistry()
    registry.register(Facts())
    page = b"".join(exposition.chunks(registry, {"small_fact"})).decode()
    assert read == ["small_fact"]
    assert page == '# HELP small_fact One series.\n# TYPE small_fact gauge\nsmall_fact{a="b"} 1.0\n'
    assert b"".join(exposition.chunks(registry, set())) == b""


def test_promtool_accepts_the_page() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    page = b"".join(exposition.chunks(proxy_registry(big_index(50, 3))))
    done = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                          timeout=60, check=False)
    assert b"error" not in done.stderr.lower(), done.stderr.decode()
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
