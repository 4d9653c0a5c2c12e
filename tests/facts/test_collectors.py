"""The facts on /metrics and the writer's own metrics (proxy.facts.collectors), read with
prometheus_client's own text parser: the same facts as the writer writes, each label set
once."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import contract
from proxy.config import FactSettings
from proxy.facts import FactsCollector, FactWriter, FactWriterCollector, iter_facts
from proxy.index import PodIndex
from tests.facts.helpers import by_name, decode, nosend, owner_refs, small_index, writer


def test_metrics_endpoint_serves_the_same_facts() -> None:
    index = small_index()
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    text = generate_latest(registry).decode()
    scraped = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    written = {
        (dict(labels)["__name__"], tuple(kv for kv in labels if kv[0] != "__name__"), v[0][0])
        for labels, v in decode(writer(index).build_request(1)).items()
    }
    assert scraped == written
    assert {f.name for f in iter_facts(index)} == set(contract.FACT_SERIES)
    assert "# TYPE karta_workload_phase gauge" in text


def test_no_fact_family_before_the_index_is_ready() -> None:
    """Pods are listed before their ReplicaSets: a half-listed index walks a pod up to its
    owner not listed yet as its workload, and a scrape during a start
    (``forward_before_ready``: ready for a Service) stored an audit's phantom
    ``karta_workload_info{karta_kind="ReplicaSet"}``. Nothing until ready, as the fact
    writer writes nothing."""
    index = small_index()
    index.ready = False
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    assert "karta_" not in generate_latest(registry).decode()
    index.ready = True
    assert "karta_workload_info{" in generate_latest(registry).decode()


def test_metrics_carry_the_cluster_uid_as_the_written_facts_do() -> None:
    """Every replica reads the uid (not only the leader), so the scraped copy of
    ``karta_contract_info`` carries the same ``karta_cluster_uid`` as the written one."""
    index = small_index()
    registry = CollectorRegistry()
    registry.register(FactsCollector(index, cluster_uid=lambda: "u-1"))
    text = generate_latest(registry).decode()
    infos = [s for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == contract.FACT_CONTRACT_INFO]
    assert [s.labels.get(contract.FACT_LABEL_CLUSTER_UID) for s in infos] == ["u-1"]
    written = decode(FactWriter(FactSettings(), index, nosend,
                                cluster_uid=lambda: "u-1").build_request(1))
    assert {tuple(sorted(s.labels.items())) for s in infos} == {
        tuple(kv for kv in k if kv[0] != "__name__") for k in written
        if dict(k)["__name__"] == contract.FACT_CONTRACT_INFO}


def test_writer_collector_reports_leadership_and_writes() -> None:
    w = writer(small_index())
    registry = CollectorRegistry()
    registry.register(FactWriterCollector(w))
    w.metrics.writes_ok.inc(3)
    text = generate_latest(registry).decode()
    assert f"{contract.OP_FACT_WRITER_LEADER} 1.0" in text
    assert f'{contract.OP_FACT_WRITES}{{result="success"}} 3.0' in text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert names == set(contract.FACT_WRITER_METRICS)


def test_metrics_can_leave_out_the_per_pod_facts() -> None:
    registry = CollectorRegistry()
    registry.register(FactsCollector(small_index(), pod_facts=False))
    names = {
        fam.name for fam in text_string_to_metric_families(generate_latest(registry).decode())
    }
    assert contract.FACT_WORKLOAD_PHASE in names
    assert contract.FACT_POD_INFO not in names
    assert contract.FACT_POD_UNATTRIBUTED_INFO not in names
    assert contract.FACT_NAMESPACE_PODS in names  # coverage stays: a few series


# -- each label set once, whatever the engine holds ---------------------------------------


def _scrape(index: PodIndex) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample of the facts on /metrics, as prometheus_client parses them."""
    registry = CollectorRegistry()
    registry.register(FactsCollector(index))
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples]


def test_a_workload_recreated_while_its_old_pods_remain_is_described_once() -> None:
    """The engine holds two workloads of one identity: a Deployment deleted (orphaning
    its ReplicaSet and pods, whose references still name it) and one created again under
    its name. /metrics served ~20 label sets twice, with contradicting values (phase
    Undefined 1 and Initializing 1), which Prometheus refuses as a whole scrape; the writer
    kept the first, so the orphaned remnant's Undefined hid the live object's phase."""
    from proxy.karta.engine import Engine

    def obj(kind: str, name: str, uid: str, owner: dict[str, Any] | None = None,
            **rest: Any) -> dict[str, Any]:
        md: dict[str, Any] = {"name": name, "namespace": "web", "uid": uid,
                              "labels": {"app": "api"}}
        if owner is not None:
            md["ownerReferences"] = owner_refs(owner)
        return {"apiVersion": "v1" if kind == "Pod" else "apps/v1", "kind": kind,
                "metadata": md, **rest}

    engine = Engine(clock=lambda: 1_700_000_000.0)
    index = PodIndex()
    index.ready = True
    old = obj("Deployment", "api", "d-1", spec={"replicas": 2})
    rs1 = obj("ReplicaSet", "api-1", "rs-1", old, spec={"replicas": 2})
    index.apply(engine.upsert_many([old, rs1, *(obj("Pod", f"api-1-{i}", f"p1-{i}", rs1)
                                                 for i in range(2))]))
    index.apply(engine.delete(old))  # deleted, orphaning: its ReplicaSet and pods stay
    new = obj("Deployment", "api", "d-2", spec={"replicas": 1})
    rs2 = obj("ReplicaSet", "api-2", "rs-2", new, spec={"replicas": 1})
    index.apply(engine.upsert_many([new, rs2, obj("Pod", "api-2-0", "p2-0", rs2)]))
    assert sorted(w.ref.uid for w in engine.workloads()) == ["d-1", "d-2"]  # both held

    scraped = _scrape(index)
    keys = [(name, labels) for name, labels, _ in scraped]
    assert len(keys) == len(set(keys)), "a label set served twice"
    phase = {dict(labels)["phase"]: v for name, labels, v in scraped
             if name == contract.FACT_WORKLOAD_PHASE and dict(labels)["karta_workload"] == "api"}
    live = engine.workload("d-2")
    assert live is not None and live.phase != "Undefined"
    assert phase[live.phase] == 1.0 and phase["Undefined"] == 0.0
    info = [dict(labels)["workload_uid"] for name, labels, _ in scraped
            if name == contract.FACT_WORKLOAD_INFO]
    assert info == ["d-2"]

    written = decode(writer(index).build_request(1000))
    assert all(len(samples) == 1 for samples in written.values())
    wphase = {dict(k)["phase"]: v
              for k, v in by_name(written, contract.FACT_WORKLOAD_PHASE).items()}
    assert wphase[live.phase] == 1.0 and wphase["Undefined"] == 0.0
    # the same facts both ways
    assert {(n, lb, v) for n, lb, v in scraped} == {
        (dict(lb)["__name__"], tuple(kv for kv in lb if kv[0] != "__name__"), v[0][0])
        for lb, v in written.items()}
    # the orphans go: the new one alone, as before; the new one goes: none
    index.apply(engine.delete_many([rs1, *(obj("Pod", f"api-1-{i}", f"p1-{i}", rs1)
                                           for i in range(2))]))
    assert index.shadowed == set() and list(index.fact_workloads()) == ["d-2"]
    index.apply(engine.delete_many([new, rs2, obj("Pod", "api-2-0", "p2-0", rs2)]))
    assert not [1 for name, _, _ in _scrape(index) if name == contract.FACT_WORKLOAD_INFO]


def test_an_instance_listed_twice_by_the_object_is_one_row_and_one_series_on_metrics() -> None:
    """A RayCluster naming one worker group twice: the engine made a replica row per
    listed id, and /metrics served the two rows' label sets twice (the writer kept the
    first). One row now, with the values at the id's first position."""
    from proxy.karta.description import parse_description
    from proxy.karta.engine import Engine
    from tests.karta.descriptions import raycluster_karta

    rc = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
          "metadata": {"name": "rc", "namespace": "ml", "uid": "rc-1"},
          "spec": {"workerGroupSpecs": [{"groupName": "cpu", "replicas": 2},
                                        {"groupName": "gpu", "replicas": 1},
                                        {"groupName": "cpu", "replicas": 5}]},
          "status": {"state": "ready"}}
    worker = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "rc-w", "namespace": "ml", "uid": "p-w",
                           "labels": {"ray.io/node-type": "worker", "ray.io/group": "cpu"},
                           "ownerReferences": owner_refs(rc)}}
    for objs in ([rc, worker], [worker, rc]):  # the object first, or its pods
        engine = Engine()
        engine.add_descriptions([parse_description(raycluster_karta(), "test")])
        index = PodIndex()
        for o in objs:
            index.apply(engine.upsert(o))
        wf = engine.workload("rc-1")
        assert wf is not None
        rows = [(r.component, r.instance, r.desired, r.observed) for r in wf.replicas]
        assert rows == [("head", "", 1.0, 0), ("worker", "cpu", 2.0, 1), ("worker", "gpu", 1.0, 0)]
        scraped = _scrape(index)
        keys = [(name, labels) for name, labels, _ in scraped]
        assert len(keys) == len(set(keys)), "a label set served twice"
