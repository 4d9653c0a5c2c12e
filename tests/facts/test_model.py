"""What the fact series say (proxy.facts.model): the pods' and workloads' facts, the
freshness, contract and build facts, reasons as codes, and the attribution coverage; read
off the writer's requests and the model's own facts."""

from __future__ import annotations

from proxy import contract
from proxy.facts import iter_facts, workload_facts
from proxy.index import PodIndex
from proxy.karta.model import GENERIC_PHASES
from proxy.karta.results import ChangeSet, PodAttribution
from tests.facts.helpers import (
    DEP,
    DEP_IDENT,
    RAY_IDENT,
    WRITER,
    by_name,
    coverage,
    decode,
    dep_facts,
    ray_facts,
    small_index,
    writer,
)


def test_pod_facts_join_on_the_stamped_labels() -> None:
    series = decode(writer(small_index()).build_request(1_700_000_600_000))
    info = by_name(series, contract.FACT_POD_INFO)
    assert info == {
        (
            ("karta_component", "head"),
            ("karta_group", "ray.io"),
            ("karta_kind", "RayJob"),
            ("karta_namespace", "ml"),
            ("karta_workload", "train"),
            ("namespace", "ml"),
            ("pod", "train-head"),
            ("uid", "p-head"),
        ): 1.0,
        (
            ("karta_component", "workers"),
            ("karta_group", "ray.io"),
            ("karta_instance", "group-a"),
            ("karta_kind", "RayJob"),
            ("karta_namespace", "ml"),
            ("karta_replica", "0"),
            ("karta_workload", "train"),
            ("namespace", "ml"),
            ("pod", "train-w0"),
            ("uid", "p-w0"),
        ): 1.0,
        (
            ("karta_group", "apps"),
            ("karta_kind", "Deployment"),
            ("karta_namespace", "web"),
            ("karta_workload", "api"),
            ("namespace", "web"),
            ("pod", "api-7d9-x"),
            ("uid", "p-api"),
        ): 1.0,
    }
    assert by_name(series, contract.FACT_POD_UNATTRIBUTED_INFO) == {
        (
            WRITER,
            ("namespace", "web"),
            ("pod", "loner"),
            ("reason", "no_described_owner"),
            ("uid", "p-lost"),
        ): 1.0
    }


def test_phase_is_a_state_set_and_statuses_are_all_reported() -> None:
    series = decode(writer(small_index()).build_request(1_700_000_600_000))
    ident = RAY_IDENT
    phase = {
        dict(k)["phase"]: v
        for k, v in by_name(series, contract.FACT_WORKLOAD_PHASE).items()
        if k[:4] == ident
    }
    assert set(phase) == set(GENERIC_PHASES)
    assert [p for p, v in phase.items() if v == 1.0] == ["Running"]
    assert sum(phase.values()) == 1.0
    status = {
        dict(k)["status"]: v
        for k, v in by_name(series, contract.FACT_WORKLOAD_STATUS).items()
        if k[:4] == ident
    }
    assert set(status) == set(GENERIC_PHASES)
    assert {s for s, v in status.items() if v == 1.0} == {"Running", "Degraded"}
    # the transition time says where it comes from (one series per workload)
    assert by_name(series, contract.FACT_WORKLOAD_PHASE_TRANSITION)[
        (*ident, ("source", "observed"))] == 1_700_000_000.5
    dated = {f.labels: f.value for f in workload_facts(ray_facts(phase_since_source="object"))
             if f.name == contract.FACT_WORKLOAD_PHASE_TRANSITION}
    assert dated == {(*ident, ("source", "object")): 1_700_000_000.5}
    # the Undefined workload says why; the Running one has no reason series
    assert by_name(series, contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO) == {
        (*DEP_IDENT, ("reason", "no_status_matched")): 1.0
    }
    info = by_name(series, contract.FACT_WORKLOAD_INFO)
    assert info[
        tuple(
            sorted((*ident, ("builtin", "false"), ("description", "rayjob"),
                    ("workload_uid", "w-ray")))
        )
    ] == 1.0
    assert len(info) == 2


def test_replica_facts_per_component_instance() -> None:
    series = decode(writer(small_index()).build_request(1_700_000_600_000))
    head = (("karta_component", "head"), *RAY_IDENT)
    workers = tuple(sorted((("karta_component", "workers"), ("karta_instance", "group-a"),
                            *RAY_IDENT)))
    desired = by_name(series, contract.FACT_COMPONENT_DESIRED_REPLICAS)
    assert desired[head] == 1 and desired[workers] == 4
    assert by_name(series, contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN) == {workers: 2.0}
    assert by_name(series, contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX) == {workers: 8.0}
    observed = by_name(series, contract.FACT_COMPONENT_OBSERVED_PODS)
    assert observed[head] == 1 and observed[workers] == 3
    # the Deployment's unnamed component: component and instance labels left out
    assert observed[DEP_IDENT] == 2 and desired[DEP_IDENT] == 2


def test_freshness_contract_and_build_facts() -> None:
    series = decode(writer(small_index()).build_request(1_700_000_600_000))
    assert by_name(series, contract.FACT_SOURCE_LAST_CURRENT) == {
        (WRITER, ("resource", "pods")): 1_700_000_500.0,
        (WRITER, ("resource", "rayjobs.ray.io")): 1_700_000_400.0,
    }
    assert by_name(series, contract.FACT_CONTRACT_INFO) == {
        (WRITER, ("version", contract.CONTRACT_VERSION)): 1.0
    }
    import proxy
    from proxy.wire.native import DEFAULT as SPLICE

    assert by_name(series, contract.FACT_BUILD_INFO) == {
        (WRITER, ("splice", SPLICE), ("version", proxy.__version__)): 1.0
    }


def test_reason_labels_keep_the_code_not_the_detail() -> None:
    from proxy.facts import reason_code

    assert reason_code("jq_error: .status.x: cannot iterate over null (in .status)") == "jq_error"
    assert reason_code("no_status_matched") == "no_status_matched"
    assert reason_code("Something: odd") == "other"
    index = PodIndex()
    index.apply(ChangeSet(workloads={"w-dep": dep_facts(phase_reason="jq_error: boom (in .x)")}))
    facts = [f for f in iter_facts(index) if f.name == contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO]
    assert [dict(f.labels)["reason"] for f in facts] == ["jq_error"]


# -- attribution coverage ------------------------------------------------------------------


def test_coverage_counts_pods_per_namespace_by_state_and_reason() -> None:
    """The same split as the per-pod facts: codes, not details; an empty reason is
    `unattributed`; a namespace with no attributed pod still has its 0."""
    index = small_index()
    index.apply(ChangeSet(pods={
        "q1": PodAttribution("batch", "a", "q1", None, reason="owner_missing"),
        "q2": PodAttribution("batch", "b", "q2", None, reason="owner_missing"),
        "q3": PodAttribution("batch", "c", "q3", None, reason="description_error: jq: bad"),
        "q4": PodAttribution("batch", "d", "q4", None),
        "q5": PodAttribution("web", "e", "q5", None, reason="no_described_owner"),
    }))
    series = decode(writer(index, external_labels={"cluster": "c1"}).build_request(1000))
    assert coverage(series) == {
        ("ml", "attributed", ""): 2,
        ("web", "attributed", ""): 1,
        ("web", "unattributed", "no_described_owner"): 2,
        ("batch", "attributed", ""): 0,
        ("batch", "unattributed", "owner_missing"): 2,
        ("batch", "unattributed", "description_error"): 1,
        ("batch", "unattributed", "unattributed"): 1,
    }
    labels = {k for k in series if ("__name__", contract.FACT_NAMESPACE_PODS) in k}
    assert all(dict(k)["cluster"] == "c1" for k in labels)
    # and it agrees with counting the per-pod facts, pod by pod
    per_pod: dict[tuple[str, str, str], float] = {}
    for f in iter_facts(index):
        d = dict(f.labels)
        if f.name == contract.FACT_POD_INFO:
            key = (d["namespace"], "attributed", "")
        elif f.name == contract.FACT_POD_UNATTRIBUTED_INFO:
            key = (d["namespace"], "unattributed", d["reason"])
        else:
            continue
        per_pod[key] = per_pod.get(key, 0) + 1
    assert {k: v for k, v in coverage(series).items() if v} == per_pod


def test_coverage_is_a_few_series_however_many_pods() -> None:
    """Memory and write size follow namespaces x reasons, not pods."""
    index = PodIndex()
    index.apply(ChangeSet(pods={
        f"u{i}": PodAttribution(f"ns{i % 7}", f"p{i}", f"u{i}", DEP if i % 5 else None,
                                reason="" if i % 5 else "no_described_owner")
        for i in range(5000)
    }))
    facts = [f for f in iter_facts(index, pods=False) if f.name == contract.FACT_NAMESPACE_PODS]
    assert len(facts) == 14
    assert sum(f.value for f in facts) == 5000
