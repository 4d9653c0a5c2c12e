"""Heavy objects' updates evaluated off the event loop (``proxy.kube.heavy_objects``),
through the real source, the simulator's watches and the real jq sandbox.

Every described object is heavy here (``heavy_seconds`` 0). The evaluating thread is
held by hand (a ``threading.Event`` in the engine's evaluation), never by a sleep: what
is asserted is the order of things, not how long they took.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy import contract
from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta import engine as engine_module
from proxy.karta.description import parse_description
from proxy.karta.engine import Engine, FactsWork, Prepared
from proxy.karta.jq_sandbox import JqSandbox
from proxy.karta.results import WorkloadFacts
from proxy.kube.heavy_objects import HeavyObjects
from proxy.kube.source import KubeSource
from tests.karta.descriptions import RAYCLUSTER_KARTA, raycluster_karta
from tests.kube.conftest import eventually, metric
from tests.kubesim import KubeSim

Obj = dict[str, Any]

#: how long the held thread waits at most for what a test does meanwhile (a bound on a
#: failing test, never reached by a passing one)
HOLD_SECONDS = 10.0




@contextlib.asynccontextmanager
async def _deferring(sim: KubeSim, engine: Engine) -> AsyncIterator[KubeSource]:
    """A source over ``engine`` with the deferral on, stopped at the end."""
    kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()), resync_backoff_max_seconds=0.5)
    src = KubeSource(kube, engine, PodIndex(), metrics_registry=CollectorRegistry(),
                     watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5,
                     defer_heavy=True)
    try:
        yield src
    finally:
        await src.stop()


@pytest.fixture
async def source(sim: KubeSim, installed_sandbox: JqSandbox) -> AsyncIterator[KubeSource]:
    """A ready source whose engine finds every described object heavy, deferral on."""
    engine = Engine(heavy_seconds=0.0)
    engine.add_descriptions([parse_description(RAYCLUSTER_KARTA, "test")])
    async with _deferring(sim, engine) as src:
        yield src


@pytest.fixture
async def described(sim: KubeSim, installed_sandbox: JqSandbox) -> AsyncIterator[KubeSource]:
    """As ``source``, the RayCluster description a Karta object of the cluster's: its
    edits owe the described objects a new attribution (``reattribute_owed``)."""
    async with _deferring(sim, Engine(heavy_seconds=0.0)) as src:
        yield src


def raycluster(replicas: int, resource_version: str | None = None, name: str = "rc") -> Obj:
    md: Obj = {"name": name, "namespace": "default"}
    if resource_version is not None:
        md["resourceVersion"] = resource_version
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": md,
            "spec": {"workerGroupSpecs": [{"groupName": "gpu", "replicas": replicas}]},
            "status": {"state": "ready"}}


def outcome(src: KubeSource, what: str) -> float:
    return metric(src, contract.OP_DEFERRED_OBJECT_UPDATES, {"outcome": what})


def desired(src: KubeSource, uid: str) -> list[float | None]:
    facts = src.index.workloads.get(uid)
    assert facts is not None
    return [r.desired for r in facts.replicas if r.component == "worker"]


class Held:
    """The engine's evaluation (``_read_object_facts``, as the thread's work runs it)
    counted and, once armed, held until ``release`` is set (at most ``HOLD_SECONDS``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[str] = []  # the thread each evaluation ran in
        self.names: list[str] = []  # the object each evaluated
        real = engine_module._read_object_facts

        def read(*args: Any) -> Any:
            if self.armed:
                self.calls.append(threading.current_thread().name)
                self.names.append(json.loads(args[1].text)["metadata"]["name"])
                self.entered.set()
                if not self.release.wait(HOLD_SECONDS):
                    raise AssertionError("not released")
            return real(*args)

        monkeypatch.setattr(engine_module, "_read_object_facts", read)


def _heavy(src: KubeSource) -> HeavyObjects:
    assert src.heavy_objects is not None
    return src.heavy_objects


async def test_a_stream_of_updates_ends_with_the_last_version_in_fewer_evaluations(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five versions while the thread is held on the first: the versions between are
    superseded (latest wins), the index ends with the last one's facts, after fewer
    evaluations than events; none of them on the event loop's thread."""
    held = Held(monkeypatch)
    rc = sim.create(raycluster(1))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(source.start(), 10)
    assert source.engine.heavy(uid)
    heavy = _heavy(source)
    held.armed = True
    version = rc["metadata"]["resourceVersion"]
    for n in range(2, 7):
        version = sim.update(raycluster(n, version))["metadata"]["resourceVersion"]
    # every version is waiting, being evaluated or superseded
    await eventually(lambda: outcome(source, "superseded") + heavy.pending
                     + len(held.calls) == 5)
    assert desired(source, uid) == [1.0]  # nothing applied while the thread is held
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    assert desired(source, uid) == [6.0]
    assert len(held.calls) < 5
    assert all(name.startswith("karta-jq") for name in held.calls)
    assert outcome(source, "applied") == len(held.calls)
    assert outcome(source, "applied") + outcome(source, "superseded") == 5


async def test_an_object_updated_again_keeps_its_place_in_line(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer version takes the place of the one waiting, not the back of the line: an
    object updated more often than the line moves would otherwise never reach its front,
    its facts never refreshed while it keeps changing. Here ``b`` waits before ``a``'s
    next version and is updated again: it is still evaluated first."""
    held = Held(monkeypatch)
    a, b = sim.create(raycluster(1, name="a")), sim.create(raycluster(1, name="b"))
    await asyncio.wait_for(source.start(), 10)
    heavy = _heavy(source)
    held.armed = True
    a2 = sim.update(raycluster(2, a["metadata"]["resourceVersion"], name="a"))
    await eventually(held.entered.is_set)  # a's version 2 in the thread
    b2 = sim.update(raycluster(2, b["metadata"]["resourceVersion"], name="b"))
    await eventually(lambda: heavy.pending == 1)
    sim.update(raycluster(3, a2["metadata"]["resourceVersion"], name="a"))
    await eventually(lambda: heavy.pending == 2)
    sim.update(raycluster(3, b2["metadata"]["resourceVersion"], name="b"))
    await eventually(lambda: outcome(source, "superseded") == 1)
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    assert held.names == ["a", "b", "a"]
    assert desired(source, a["metadata"]["uid"]) == [3.0]
    assert desired(source, b["metadata"]["uid"]) == [3.0]


async def test_a_deletion_while_a_version_is_evaluated_leaves_the_object_deleted(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version in the thread, another waiting, then the deletion: the one waiting is
    dropped, the thread's result discarded (both superseded), the object stays deleted."""
    held = Held(monkeypatch)
    rc = sim.create(raycluster(1))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(source.start(), 10)
    heavy = _heavy(source)
    held.armed = True
    v2 = sim.update(raycluster(2, rc["metadata"]["resourceVersion"]))
    await eventually(held.entered.is_set)  # version 2 in the thread
    sim.update(raycluster(3, v2["metadata"]["resourceVersion"]))
    await eventually(lambda: heavy.pending == 1)  # version 3 waiting behind it
    sim.delete(rc)
    await eventually(lambda: uid not in source.index.workloads)
    assert heavy.pending == 0
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    assert uid not in source.index.workloads
    assert not source.engine.holds(uid)
    assert outcome(source, "superseded") == 2 and outcome(source, "applied") == 0
    assert len(held.calls) == 1


async def test_the_event_loop_runs_while_a_heavy_object_is_evaluated(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluation waits for a callback of the event loop: it can only come while
    the loop is free (an evaluation on the loop's own thread would wait for it in vain,
    and fail)."""
    loop = asyncio.get_running_loop()
    order: list[str] = []
    ran = threading.Event()
    real = engine_module._read_object_facts
    armed = False

    def on_loop() -> None:
        order.append("loop callback")
        ran.set()

    def read(*args: Any) -> Any:
        if armed:
            loop.call_soon_threadsafe(on_loop)
            if not ran.wait(HOLD_SECONDS if threading.current_thread() is not main else 0.5):
                raise AssertionError("the event loop did not run during the evaluation")
            order.append("evaluated")
        return real(*args)

    main = threading.current_thread()
    monkeypatch.setattr(engine_module, "_read_object_facts", read)
    rc = sim.create(raycluster(1))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(source.start(), 10)
    armed = True
    sim.update(raycluster(3, rc["metadata"]["resourceVersion"]))
    await eventually(lambda: outcome(source, "applied") == 1)
    assert order == ["loop callback", "evaluated"]
    assert desired(source, uid) == [3.0]


async def test_a_failing_thread_leaves_the_update_to_the_event_loop(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The evaluation fails in the thread: the update is not lost, its text is fed and
    evaluated on the loop as before (the waiting version holds only its text and
    metadata, so that text is what the engine keeps), logged, counted under neither
    outcome."""
    real = engine_module._read_object_facts
    main = threading.current_thread()

    def read(*args: Any) -> Any:
        if threading.current_thread() is not main:
            raise RuntimeError("the thread's evaluation broke")
        return real(*args)

    rc = sim.create(raycluster(1))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(source.start(), 10)
    monkeypatch.setattr(engine_module, "_read_object_facts", read)
    sim.update(raycluster(4, rc["metadata"]["resourceVersion"]))
    await eventually(lambda: desired(source, uid) == [4.0])
    await _heavy(source).settled()
    assert outcome(source, "applied") == 0 and outcome(source, "superseded") == 0
    assert any("failed; evaluating them on it" in r.getMessage() for r in caplog.records)


def test_the_counter_has_both_outcomes_from_the_start() -> None:
    class NoEngine:
        def heavy(self, uid: str) -> bool:
            return False

        def facts_work(self, obj: Any) -> None:
            return None

        def held_facts_work(self, uid: str) -> None:
            return None

        def replanned(self, work: FactsWork) -> None:
            return None

    registry = CollectorRegistry()
    feed: Callable[..., bool] = lambda what, prepared: True  # noqa: E731
    HeavyObjects(NoEngine(), feed, feed, registry=registry)
    for what in ("applied", "superseded"):
        assert registry.get_sample_value(contract.OP_DEFERRED_OBJECT_UPDATES,
                                         {"outcome": what}) == 0.0


async def test_nothing_of_a_version_is_held_once_it_is_done_with(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version superseded while the thread evaluated it (the object deleted): once
    settled, nothing holds its work (its text: ~1.7 MB for the heaviest objects) while
    the task waits for the next heavy update, which may be hours away. The task's
    locals held the last version's work and result until then."""
    held = Held(monkeypatch)
    rc = sim.create(raycluster(1))
    await asyncio.wait_for(source.start(), 10)
    heavy = _heavy(source)
    held.armed = True
    sim.update(raycluster(2, rc["metadata"]["resourceVersion"]))
    await eventually(held.entered.is_set)
    sim.delete(rc)
    await eventually(lambda: rc["metadata"]["uid"] not in source.index.workloads)
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    assert outcome(source, "superseded") == 1

    def none_held() -> bool:
        gc.collect()
        return not [o for o in gc.get_objects() if isinstance(o, (FactsWork, Prepared))]
    # the pool's worker drops its work item just after it set the result the loop woke
    # for (``del work_item``): a moment later, which the loop may not have given it yet
    await eventually(none_held, timeout=2.0)


Rows = tuple[str, list[tuple[str, str, float | None]]]


def _rows(facts: WorkloadFacts | None) -> Rows:
    assert facts is not None
    return facts.phase, sorted((r.component, r.instance, r.desired) for r in facts.replicas)


def rows(src: KubeSource, uid: str) -> Rows:
    """The workload's phase and desired replica rows in the index."""
    return _rows(src.index.workloads.get(uid))


def oracle_rows(karta: Obj, obj: Obj) -> Rows:
    """What an engine that defers nothing gives ``obj`` under the description ``karta``
    (the result once settled must be the same)."""
    engine = Engine()
    engine.upsert(karta)
    engine.upsert(obj)
    return _rows(engine.workload(obj["metadata"]["uid"]))


def edit(karta: Obj, head_replicas: bool) -> Obj:
    """The cluster's RayCluster description edited: the head's replicas counted or not."""
    edited = raycluster_karta(head_replicas=head_replicas)
    edited["metadata"]["resourceVersion"] = karta["metadata"]["resourceVersion"]
    return edited


async def test_a_description_edit_reevaluates_a_heavy_object_off_the_loop(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """The edit owes the RayCluster a new attribution: its facts under the new plan are
    evaluated in the thread (on the loop before: ~150-250 ms per heavy object), with the
    same result as on the loop, applied and counted once."""
    held = Held(monkeypatch)
    held.release.set()  # counted, not held
    karta = sim.create(RAYCLUSTER_KARTA)
    rc = sim.create(raycluster(2))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(described.start(), 10)
    assert described.engine.heavy(uid)
    assert rows(described, uid) == ("Running", [("head", "", 1.0), ("worker", "gpu", 2.0)])
    want = oracle_rows(edit(karta, head_replicas=False), rc)
    assert want == ("Running", [("head", "", None), ("worker", "gpu", 2.0)])
    held.armed = True
    sim.update(edit(karta, head_replicas=False))
    await eventually(lambda: rows(described, uid) == want)
    await asyncio.wait_for(_heavy(described).settled(), 10)
    assert held.calls == ["karta-jq_0"]
    assert outcome(described, "applied") == 1 and outcome(described, "superseded") == 0
    assert rows(described, uid) == want


async def test_a_newer_description_supersedes_a_reevaluation_under_way(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second edit while the first one's re-evaluation is in the thread: that result is
    discarded (superseded), the second one's applied; the object keeps its attribution
    until then."""
    held = Held(monkeypatch)
    karta = sim.create(RAYCLUSTER_KARTA)
    rc = sim.create(raycluster(2))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(described.start(), 10)
    before = rows(described, uid)
    held.armed = True
    first = sim.update(edit(karta, head_replicas=False))
    await eventually(held.entered.is_set)
    assert rows(described, uid) == before  # kept until its re-evaluation is applied
    second = raycluster_karta("test-raycluster", head_replicas=True)
    second["spec"]["structureDefinition"]["rootComponent"]["statusDefinition"][
        "statusMappings"]["running"] = [{"byPhase": "up"}]
    second["metadata"]["resourceVersion"] = first["metadata"]["resourceVersion"]
    second = sim.update(second)
    await eventually(lambda: outcome(described, "superseded") == 1
                     or _heavy(described).pending == 1)
    held.release.set()
    await eventually(lambda: outcome(described, "applied") == 1)
    await asyncio.wait_for(_heavy(described).settled(), 10)
    assert outcome(described, "superseded") == 1
    assert held.calls == ["karta-jq_0", "karta-jq_0"]
    held.armed = False
    want = oracle_rows(second, rc)
    assert want[1] == before[1] and want[0] != before[0]  # "ready" no longer Running
    assert rows(described, uid) == want


async def test_an_update_during_a_reevaluation_is_applied_after_it(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch update of the object while its re-evaluation is in the thread: neither is
    lost, the update comes last (its facts, made under the new plan, used as they are),
    both off the loop."""
    held = Held(monkeypatch)
    karta = sim.create(RAYCLUSTER_KARTA)
    rc = sim.create(raycluster(2))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(described.start(), 10)
    held.armed = True
    edited = sim.update(edit(karta, head_replicas=False))
    await eventually(held.entered.is_set)
    rc5 = sim.update(raycluster(5, rc["metadata"]["resourceVersion"]))
    await eventually(lambda: _heavy(described).pending == 1)
    held.release.set()
    await eventually(lambda: outcome(described, "applied") == 2)
    await asyncio.wait_for(_heavy(described).settled(), 10)
    assert held.calls == ["karta-jq_0", "karta-jq_0"]
    held.armed = False
    assert rows(described, uid) == oracle_rows(edited, rc5) == (
        "Running", [("head", "", None), ("worker", "gpu", 5.0)])
    assert outcome(described, "superseded") == 0


@dataclass
class Busy:
    """Two described objects, the thread held on an update of ``other``."""

    held: Held
    karta: Obj
    rc: Obj
    other: Obj  # its update being evaluated


async def busy_with_other(sim: KubeSim, src: KubeSource,
                          monkeypatch: pytest.MonkeyPatch) -> Busy:
    """The RayCluster description, ``rc`` and ``other`` created, ``src`` started, then the
    thread held on an update of ``other`` (the evaluations counted from there)."""
    held = Held(monkeypatch)
    karta = sim.create(RAYCLUSTER_KARTA)
    rc = sim.create(raycluster(2))
    other = sim.create(raycluster(1, name="other"))
    await asyncio.wait_for(src.start(), 10)
    held.armed = True
    other = sim.update(raycluster(3, other["metadata"]["resourceVersion"], name="other"))
    await eventually(held.entered.is_set)
    return Busy(held, karta, rc, other)


async def test_an_update_waiting_through_a_description_edit_is_evaluated_under_it_off_the_loop(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """An update taken (packed, under the description then in force) while the thread
    was busy, and still waiting when the description is edited: evaluated in the thread
    under the new description, not under the old one and then again on the loop (its
    facts under the old one unused)."""
    busy = await busy_with_other(sim, described, monkeypatch)
    held, karta, rc = busy.held, busy.karta, busy.rc
    uid = rc["metadata"]["uid"]
    heavy = _heavy(described)
    rc5 = sim.update(raycluster(5, rc["metadata"]["resourceVersion"]))
    await eventually(lambda: heavy.pending == 1)
    edited = sim.update(edit(karta, head_replicas=False))
    await eventually(lambda: heavy.pending == 3)  # both objects' re-evaluations owed
    held.release.set()
    await eventually(lambda: heavy.pending == 0)
    await asyncio.wait_for(heavy.settled(), 10)
    held.armed = False
    assert [t for t, name in zip(held.calls, held.names, strict=True) if name == "rc"] == [
        "karta-jq_0", "karta-jq_0"]  # its re-evaluation, then its update
    assert rows(described, uid) == oracle_rows(edited, rc5) == (
        "Running", [("head", "", None), ("worker", "gpu", 5.0)])


async def test_an_update_the_engine_fails_on_is_not_counted_applied(
        sim: KubeSim, source: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails on a deferred update (a bug: counted in the source's object
    errors and logged): it is not counted ``applied``."""
    rc = sim.create(raycluster(1))
    await asyncio.wait_for(source.start(), 10)
    real = source.engine.upsert_many

    def failing(objs: Any, **kw: Any) -> Any:
        if kw.get("prepared"):
            raise RuntimeError("an engine bug")
        return real(objs, **kw)

    monkeypatch.setattr(source.engine, "upsert_many", failing)
    sim.update(raycluster(3, rc["metadata"]["resourceVersion"]))
    await eventually(lambda: source.object_errors == 1)
    await asyncio.wait_for(_heavy(source).settled(), 10)
    assert outcome(source, "applied") == 0 and outcome(source, "superseded") == 0


async def test_a_reevaluation_waiting_when_its_object_is_deleted_is_not_made(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A description edit owes two objects a re-evaluation while the thread is busy; one
    of them is deleted before its turn: its held text is not evaluated in the thread
    (~150-250 ms of a heavy object's, for nothing), it is counted superseded, not
    applied; it stays deleted, and the other ends as an engine that defers nothing."""
    busy = await busy_with_other(sim, described, monkeypatch)
    held, karta, rc, other3 = busy.held, busy.karta, busy.rc, busy.other
    uid = rc["metadata"]["uid"]
    heavy = _heavy(described)
    edited = sim.update(edit(karta, head_replicas=False))
    await eventually(lambda: heavy.pending == 2)  # both objects' re-evaluations owed
    sim.delete(rc)
    await eventually(lambda: uid not in described.index.workloads)
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    held.armed = False
    assert "rc" not in held.names
    assert outcome(described, "superseded") == 1 and outcome(described, "applied") == 2
    assert uid not in described.index.workloads and not described.engine.holds(uid)
    assert rows(described, other3["metadata"]["uid"]) == oracle_rows(edited, other3)


async def test_a_reevaluation_under_way_when_its_object_is_deleted_counts_superseded(
        sim: KubeSim, described: KubeSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object of a re-evaluation in the thread is deleted meanwhile: the facts come
    back unused (the engine no longer holds that text), so it is counted superseded,
    not applied, and the object stays deleted."""
    held = Held(monkeypatch)
    karta = sim.create(RAYCLUSTER_KARTA)
    rc = sim.create(raycluster(2))
    uid = rc["metadata"]["uid"]
    await asyncio.wait_for(described.start(), 10)
    heavy = _heavy(described)
    held.armed = True
    sim.update(edit(karta, head_replicas=False))
    await eventually(held.entered.is_set)  # its re-evaluation in the thread
    sim.delete(rc)
    await eventually(lambda: uid not in described.index.workloads)
    held.release.set()
    await asyncio.wait_for(heavy.settled(), 10)
    held.armed = False
    assert held.names == ["rc"]
    assert outcome(described, "superseded") == 1 and outcome(described, "applied") == 0
    assert uid not in described.index.workloads and not described.engine.holds(uid)
