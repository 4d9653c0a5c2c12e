"""docs/metrics.md and what the proxy emits must agree: names, labels, types, version.

The emitted side is real output: the fact series produced from a small index that uses
every optional label, the labels ``stamped_pairs`` produces for a pod, and what the
``/metrics`` collectors render. The documented side is parsed from the tables.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import contract
from proxy.config import FactSettings
from proxy.facts import FactsCollector, FactWriter, FactWriterCollector, iter_facts
from proxy.index import PodIndex, stamped_pairs
from proxy.karta.results import (
    ChangeSet,
    PodAttribution,
    ReplicaFact,
    WorkloadFacts,
    WorkloadRef,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/metrics.md has no '## {heading}' section"
    return m.group(1)


def table(text: str) -> dict[str, list[str]]:
    """First-column name -> the other cells, for rows whose first cell is `code`."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} documented twice"
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def labels_cell(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def rich_index() -> PodIndex:
    """Every optional label and every conditional series appears at least once."""
    ray = WorkloadRef("ml", "ray.io", "RayJob", "train", "w1")
    dep = WorkloadRef("ml", "apps", "Deployment", "api", "w2")
    index = PodIndex()
    index.ready = True
    index.apply(
        ChangeSet(
            pods={
                "p1": PodAttribution("ml", "train-w-0", "p1", ray, "workers", "g1", "0"),
                "p2": PodAttribution("ml", "api-5f-x", "p2", dep),
                "p3": PodAttribution("ml", "stray", "p3", None, reason="no_described_owner"),
            },
            workloads={
                "w1": WorkloadFacts(
                    ray, "rayjob", False, "Running", ("Running", "Degraded"), "", 1.0,
                    (ReplicaFact("workers", "g1", 2, 1, 4, 1),),
                ),
                "w2": WorkloadFacts(
                    dep, "deployment", True, "Undefined", ("Undefined",), "no_status_matched", 2.0,
                ),
            },
        )
    )
    index.mark_fresh("pods", 3.0)
    return index


def emitted_facts() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    # with the cluster's uid known, as in Kubernetes mode once read (cluster_identity.py)
    for f in iter_facts(rich_index(), cluster_uid="0b8d6a2e-kube-system"):
        out.setdefault(f.name, set()).update(k for k, _ in f.labels)
    return out


def test_contract_version_matches_the_document_and_the_series(doc: str) -> None:
    m = re.search(r"^Contract version: `([^`]+)`", doc, re.M)
    assert m and m.group(1) == contract.CONTRACT_VERSION
    assert re.fullmatch(r"\d+\.\d+\.\d+", contract.CONTRACT_VERSION)
    versions = [
        dict(f.labels)["version"]
        for f in iter_facts(rich_index())
        if f.name == contract.FACT_CONTRACT_INFO
    ]
    assert versions == [contract.CONTRACT_VERSION]


def test_stamped_labels_are_documented(doc: str) -> None:
    documented = set(table(section(doc, "Stamped labels")))
    assert documented == set(contract.STAMPED_LABELS)
    # and what the index actually stamps stays within them
    ray = WorkloadRef("ml", "ray.io", "RayJob", "train", "w1")
    stamped = {k for k, _ in stamped_pairs(PodAttribution("ml", "p", "u", ray, "c", "i", "r"))}
    assert stamped == documented
    assert all(name.startswith(contract.STAMPED_PREFIX) for name in documented)
    assert list(contract.STAMPED_LABELS) == sorted(contract.STAMPED_LABELS)


def test_fact_series_names_and_labels_match_the_document(doc: str) -> None:
    rows = table(section(doc, "Fact series"))
    emitted = emitted_facts()
    assert set(rows) == set(emitted), (
        f"undocumented: {sorted(set(emitted) - set(rows))}; "
        f"documented, not emitted: {sorted(set(rows) - set(emitted))}"
    )
    assert set(rows) == set(contract.FACT_SERIES)
    for name, cells in rows.items():
        assert labels_cell(cells[1]) == emitted[name], name
        assert name.startswith(contract.METRIC_PREFIX)


def test_fact_series_types_match_what_metrics_serves(doc: str) -> None:
    rows = table(section(doc, "Fact series"))
    registry = CollectorRegistry()
    registry.register(FactsCollector(rich_index()))
    served = {
        fam.name: fam.type
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
    }
    for name, cells in rows.items():
        assert cells[0].split()[0] == served[name], name


def test_fact_writer_metrics_match_the_document(doc: str) -> None:
    rows = table(section(doc, "Fact writer metrics"))
    assert set(rows) == set(contract.FACT_WRITER_METRICS)
    registry = CollectorRegistry()
    registry.register(FactWriterCollector(FactWriter(FactSettings(), rich_index(), _send)))
    assert_served_as_documented(registry, rows)


def assert_served_as_documented(registry: CollectorRegistry, rows: dict[str, list[str]],
                                *, among_others: bool = False) -> None:
    """The series of ``rows`` are what ``registry`` serves (``among_others``: served
    among other families), each with the type and the labels its row names."""
    served: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if among_others and s.name not in rows:
                continue
            served[s.name] = (fam.type, set(s.labels) | served.get(s.name, ("", set()))[1])
    assert set(served) == set(rows)
    for name, cells in rows.items():
        typ, labels = served[name]
        assert cells[0].split()[0] == typ, name
        assert labels_cell(cells[1]) == labels, name


def test_every_name_in_contract_py_is_documented(doc: str) -> None:
    """A constant added to contract.py without a row in the document fails here."""
    names = {
        v
        for k, v in vars(contract).items()
        if isinstance(v, str) and (k.startswith(("FACT_", "OP_", "LABEL_")))
        and not k.startswith("FACT_LABEL_")
    }
    for n in names:
        assert f"`{n}`" in doc, n
    fact_labels = {v for k, v in vars(contract).items() if k.startswith("FACT_LABEL_")}
    assert set(contract.ALL_FACT_LABELS) == fact_labels  # what external_labels may not use
    documented_labels = set().union(
        *(labels_cell(c[1]) for c in table(section(doc, "Fact series")).values())
    )
    assert fact_labels <= documented_labels


#: the names contract 1.0.0 published, which its Changes row covers as "first published":
#: every name added since must be named in the row of the version that added it
FIRST_PUBLISHED = frozenset({
    "karta_component", "karta_group", "karta_instance", "karta_kind", "karta_namespace",
    "karta_replica", "karta_workload",
    "karta_pod_info", "karta_pod_unattributed_info", "karta_workload_info",
    "karta_workload_phase", "karta_workload_phase_transition_timestamp_seconds",
    "karta_workload_status", "karta_workload_phase_undefined_reason_info",
    "karta_component_desired_replicas", "karta_component_desired_replicas_min",
    "karta_component_desired_replicas_max", "karta_component_observed_pods",
    "karta_source_last_current_timestamp_seconds", "karta_contract_info", "karta_build_info",
    "namespace", "pod", "uid", "workload_uid", "description", "builtin", "reason", "phase",
    "status", "resource", "version",
    "karta_proxy_fact_writer_leader", "karta_proxy_fact_writes_total",
    "karta_proxy_fact_stale_markers_total", "karta_proxy_fact_series",
    "karta_proxy_fact_last_write_timestamp_seconds",
})


def test_every_name_added_since_1_0_0_is_in_the_changes(doc: str) -> None:
    """A user upgrading reads the Changes table for what is new: a metric or label added
    to contract.py must be named there (in code spans), not only in its section (1.10.0's
    row named the operational alert metrics by their section's title alone)."""
    changes = doc[doc.index("### Changes"):doc.index("## Stamped labels")]
    named = {word for span in re.findall(r"`([^`]+)`", changes)
             for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}
    added = {v for k, v in vars(contract).items()
             if isinstance(v, str) and k.startswith(("FACT_", "OP_", "LABEL_"))} - FIRST_PUBLISHED
    missing = sorted(added - named)
    assert not missing, f"contract names missing from the Changes table: {missing}"
    # and the label values the contract names (the reasons the alerts and docs select)
    values = {*contract.STEPDOWN_REASONS, *contract.LEASE_FAILURE_REASONS,
              *contract.UPSTREAM_CHECKS_MISCONFIGURED, contract.STATE_ATTRIBUTED,
              contract.STATE_UNATTRIBUTED}
    missing = sorted(values - named)
    assert not missing, f"contract values missing from the Changes table: {missing}"


async def _send(body: bytes) -> None:
    return None


def test_index_metrics_match_the_document(doc: str) -> None:
    """The index gauges an alert reads (KartaIndexNotReady) are contract names: documented
    with the types ``/metrics`` serves them with."""
    from proxy.metrics import ProxyMetrics

    rows = table(section(doc, "Index metrics"))
    assert set(rows) == set(contract.INDEX_METRICS) | set(contract.WATCH_METRICS)
    # the watch source's (tests/kube/test_source.py reads them by these names)
    for name in contract.WATCH_METRICS:
        want = ("counter" if name in (contract.OP_OWNER_FETCHES,
                                      contract.OP_DEFERRED_OBJECT_UPDATES) else "gauge")
        assert rows.pop(name)[0] == want, name
    metrics = ProxyMetrics()
    metrics.watch_index(rich_index())
    served = {fam.name: fam.type for fam in
              text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    for name, cells in rows.items():
        assert served.get(name) == cells[0].split()[0], name


def test_jq_sandbox_metrics_match_the_document(doc: str) -> None:
    """The jq sandbox's restarts and quarantine (since 1.10.0): documented with the types
    and labels ``/metrics`` serves them with, every reason present without a sandbox."""
    from proxy.metrics import ProxyMetrics

    rows = table(section(doc, "jq sandbox metrics"))
    assert set(rows) == set(contract.JQ_SANDBOX_METRICS)
    assert_served_as_documented(ProxyMetrics().registry, rows, among_others=True)


def test_operational_alert_metrics_match_the_document(doc: str) -> None:
    """The relay's, the configuration's and the certificates' metrics the shipped
    operational alerts read (since 1.10.0): documented with the types and labels
    ``/metrics`` serves them with, the upstream check's values among the documented."""
    from proxy.metrics import ProxyMetrics

    rows = table(section(doc, "Metrics the operational alerts read"))
    assert set(rows) == set(contract.OPERATIONAL_ALERT_METRICS)
    metrics = ProxyMetrics()
    # the labelled families have no child until something is counted: one each, as a
    # running proxy has (the TLS ones registered by the runtime / the upstream with TLS)
    metrics.requests.values[("/api/v1/write", "v1", "200")] += 1
    metrics.rejected.labels("overload").inc()
    metrics.unattributed.values[("other_cluster",)] += 1
    metrics.upstream_responses.values[("200",)] += 1
    metrics.upstream_misconfigured.labels("http://tsdb/api/v1/push", "not_write_endpoint",
                                          "404").inc()
    metrics.upstream_info.labels("http://tsdb/api/v1/write", "rw1", "rw1").set(1)
    for family in (metrics.tls_certificate_expiry, metrics.upstream_tls_certificate_expiry):
        family.set(1.8e9)
        metrics.registry.register(family)
    metrics.tls_reloads.labels("failure")
    metrics.upstream_tls_reloads.labels("failure")
    metrics.registry.register(metrics.upstream_tls_reloads)
    from proxy.karta.engine import Engine

    metrics.watch_engine(Engine())  # the built-in descriptions: every jq error child at 0
    assert_served_as_documented(metrics.registry, rows, among_others=True)
    checks = set(re.findall(r"`([a-z_0-9]+)`", rows[contract.OP_UPSTREAM_INFO][2]))
    assert set(contract.UPSTREAM_CHECKS_MISCONFIGURED) <= checks
