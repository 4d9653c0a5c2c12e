"""Every sample description and every built-in kind against a synthetic cluster fixture.

Fixtures (``tests/karta/fixtures/``, format in ``tests/karta/clusters.py``) hold the
workload object, its intermediate owners and pods labelled as the real operators label
them, plus the expected attribution table, phase and replica facts. Each cluster is fed in
several orders (owners before pods, pods before owners, shuffled, one batch) and the
answer must not depend on the order.
"""

from __future__ import annotations

import functools
import random
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.karta.builtin import builtin_descriptions
from proxy.karta.description import load_description_paths
from proxy.karta.engine import Engine
from proxy.karta.model import Description, GroupKind
from tests.karta.clusters import SAMPLES, Cluster, all_clusters, load_cluster, uid_of

ORDERS = ("as_written", "reversed", "pods_first", "shuffled", "batch", "api_descriptions")


def _cases() -> list[Any]:
    out = []
    for path in all_clusters():
        cluster = load_cluster(path)
        for i, names in enumerate(cluster.description_sets):
            label = "+".join(n.removesuffix(".yaml") for n in names) or "builtin"
            for order in ORDERS:
                out.append(pytest.param(path, i, order, id=f"{path.stem}[{label}]-{order}"))
    return out


def _need_samples(names: list[str]) -> None:
    if names and not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")


@functools.cache
def _descriptions(names: tuple[str, ...]) -> tuple[Description, ...]:
    """Parsed once per set: descriptions are immutable, and jq compiles take ~4 ms each."""
    descs, errors = load_description_paths([SAMPLES / n for n in names])
    assert errors == []
    return tuple(descs)


def _engine(cluster: Cluster, names: list[str], *, via_api: bool = False) -> Engine:
    _need_samples(names)
    engine = Engine(builtins=cluster.builtins, clock=lambda: 1000.0)
    if via_api:
        for n in names:
            obj = yaml.safe_load((SAMPLES / n).read_text(encoding="utf-8"))
            obj.setdefault("metadata", {}).setdefault("name", Path(n).stem)
            engine.upsert(obj)
    else:
        engine.add_descriptions(_descriptions(tuple(names)))
    assert engine.description_errors == []
    # the samples' and built-ins' pod selectors read only what the engine keeps of a pod
    assert engine.description_warnings == []
    return engine


def _feed(engine: Engine, cluster: Cluster, order: str) -> None:
    objs = cluster.everything
    if order == "batch":
        engine.upsert_many(objs)
        return
    if order == "reversed":
        objs = objs[::-1]
    elif order == "pods_first":
        objs = [*cluster.pods, *cluster.objects[::-1]]
    elif order == "shuffled":
        objs = list(objs)
        random.Random(cluster.name).shuffle(objs)
    for o in objs:
        engine.upsert(o)


def check_cluster(engine: Engine, cluster: Cluster) -> None:
    table: dict[str, Any] = {}
    for uid in cluster.expect_pods:
        att = engine.pod(uid)
        assert att is not None, uid
        if att.workload is None:
            table[att.pod] = {"reason": att.reason}
        else:
            w = att.workload
            table[att.pod] = [f"{w.kind}/{w.name}", att.component, att.instance, att.replica]
            assert w.uid == uid_of(w.kind, w.name)
            assert w.namespace == att.namespace
            assert att.description
    want = {
        p["metadata"]["name"]: cluster.expect_pods[p["metadata"]["uid"]] for p in cluster.pods
    }
    assert table == want

    facts = {f"{f.ref.kind}/{f.ref.name}": f for f in engine.workloads()}
    assert sorted(facts) == sorted(cluster.expect_workloads)
    for key, exp in cluster.expect_workloads.items():
        f = facts[key]
        assert (key, f.phase) == (key, exp["phase"])
        assert f.phase in f.statuses
        assert f.phase_reason == exp.get("reason", f.phase_reason)
        if "since" in exp:
            when = datetime.fromisoformat(exp["since"]).timestamp()
            assert (key, f.phase_since, f.phase_since_source) == (key, when, "object")
        else:
            assert (key, f.phase_since, f.phase_since_source) == (key, 1000.0, "observed")
        rows = [
            [r.component, r.instance, r.desired, r.min_desired, r.max_desired, r.observed]
            for r in f.replicas
        ]
        assert rows == exp["replicas"], key


@pytest.mark.parametrize(("path", "index", "order"), _cases())
def test_cluster_fixture(path: Path, index: int, order: str) -> None:
    cluster = load_cluster(path)
    names = cluster.description_sets[index]
    engine = _engine(cluster, names, via_api=order == "api_descriptions")
    _feed(engine, cluster, order)
    check_cluster(engine, cluster)


@pytest.mark.parametrize("path", all_clusters(), ids=lambda p: p.stem)
def test_cluster_fixture_in_the_jq_sandbox(path: Path) -> None:
    """Every fixture's expected facts with the expressions evaluated as the proxy runs
    them: in the sandbox child, a workload's paths in one round trip (``Evaluated``)."""
    from proxy.karta.jq_sandbox import JqSandbox
    from proxy.karta.jqexpr import install_runner, remove_runner

    cluster = load_cluster(path)
    box = JqSandbox(timeout_seconds=10.0)
    install_runner(box)
    try:
        for names in cluster.description_sets:
            engine = _engine(cluster, list(names))
            _feed(engine, cluster, "as_written")
            check_cluster(engine, cluster)
        assert box.restarts == {"timeout": 0, "died": 0, "start_failed": 0}
    finally:
        remove_runner(box)
        box.close()


def test_every_sample_has_a_fixture() -> None:
    if not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")
    used = {n for p in all_clusters() for s in load_cluster(p).description_sets for n in s}
    samples = {p.name for p in SAMPLES.glob("*.yaml")} - {"ri-mpijob.yaml"}
    assert samples - used == set()


def test_every_builtin_kind_has_a_fixture() -> None:
    covered: set[GroupKind] = set()
    for p in all_clusters():
        cluster = load_cluster(p)
        if [] not in cluster.description_sets:
            continue
        for key in cluster.expect_workloads:
            kind = key.split("/")[0]
            for o in [*cluster.objects, *cluster.pods]:
                if o["kind"] == kind:
                    covered.add(GroupKind.from_api_version(o["apiVersion"], kind))
    assert {d.group_kind for d in builtin_descriptions()} - covered == set()


def test_invalid_sample_is_reported_and_the_rest_keep_working() -> None:
    if not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")
    paths = [SAMPLES / "ri-mpijob.yaml", SAMPLES / "ri-pytorch.yaml"]
    descs, errors = load_description_paths(paths)
    assert len(errors) == 1 and "ri-mpijob" in errors[0].source
    engine = Engine(clock=lambda: 1000.0)
    engine.add_descriptions(descs, errors=errors)
    assert engine.description_errors == errors
    cluster = load_cluster(Path(__file__).parent / "fixtures" / "pytorchjob.yaml")
    engine.upsert_many(cluster.everything)
    check_cluster(engine, cluster)


def test_invalid_api_description_marks_its_kind() -> None:
    """An invalid description object is skipped and named; its pods say description_error."""
    if not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")
    raw = yaml.safe_load((SAMPLES / "wm-raycluster.yaml").read_text(encoding="utf-8"))
    raw["spec"]["structureDefinition"]["childComponents"][1]["ownerRef"] = "nope"
    engine = Engine(clock=lambda: 1000.0)
    engine.upsert(raw)
    assert len(engine.description_errors) == 1
    err = engine.description_errors[0]
    assert err.source == "api:Karta/ray-io-raycluster-v1" and "ownerRef" in err.path
    cluster = load_cluster(Path(__file__).parent / "fixtures" / "raycluster.yaml")
    engine.upsert_many(cluster.everything)
    reasons = {a.reason for a in engine.pods()}
    assert reasons == {"description_error"}
    # fixing the object re-attributes exactly those pods
    raw["spec"]["structureDefinition"]["childComponents"][1]["ownerRef"] = "raycluster"
    cs = engine.upsert(raw)
    assert engine.description_errors == []
    assert not cs.kinds_changed  # RayCluster was already wanted in full
    assert set(cs.pods) == {p["metadata"]["uid"] for p in cluster.pods}
    check_cluster(engine, cluster)
