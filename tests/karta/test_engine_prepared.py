"""Facts prepared in another thread (``Engine.facts_work``, ``upsert_many(prepared=)``):
the engine ends exactly where it ends without them, and knows which objects are heavy.

The equality tests guard the refactor (they pass on any engine that ignores
``prepared``): the same change sets, attributions, facts, jq error counts, log lines and
retries owed, for every kind of description the facts read (status, instance ids, scale
paths, a jq error of the expression's own, an id refused, the sandbox failing for now).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from proxy.karta.engine import Engine, Prepared
from proxy.karta.jq_sandbox import JqSandbox
from proxy.karta.jqexpr import JqExpr, install_runner, remove_runner
from proxy.karta.results import ChangeSet
from tests.clock import ManualClock
from tests.karta.test_engine import (
    RAY_KARTA,
    RETRIED_THING,
    deployment,
    describe,
    karta,
    obj,
    pod,
    raycluster,
    replicaset,
)

Obj = dict[str, Any]

#: a kind whose instances are a map's keys, with a scale path per instance
GRAPH_KARTA = karta({"group": "example.com", "kind": "Graph"}, [{
    "name": "service", "ownerRef": "root",
    "specDefinition": {"podTemplateSpecPath": ".spec.services[]"},
    "scaleDefinition": {"replicasPath": ".spec.services[] | .replicas"},
    "instanceIdPath": ".spec.services | keys[]",
    "podSelector": {"componentInstanceSelector": {"idPath": '.metadata.annotations["svc"]'}},
}], statusDefinition={"phaseDefinition": {"path": ".status.state"},
                      "statusMappings": {"running": [{"byPhase": "ready"}]}})




def graph(name: str, services: dict[str, int], state: str = "ready") -> Obj:
    return obj("example.com/v1", "Graph", name,
               spec={"services": {s: {"replicas": n} for s, n in services.items()}},
               status={"state": state})


def thing(name: str, phase: Any) -> Obj:
    return obj("example.com/v1", "Thing", name, status={"phase": phase})


def _engine(clock: ManualClock) -> Engine:
    e = Engine(clock=clock, retry_clock=clock, heavy_seconds=0.0)
    e.add_descriptions([describe(RAY_KARTA), describe(GRAPH_KARTA), describe(RETRIED_THING)])
    return e


def _prepared_upsert(e: Engine, objs: list[Obj], *, evaluated: bool = True) -> ChangeSet:
    """``upsert_many`` with each object's facts prepared first, as the source's thread
    does (in this thread: what the thread runs reads only the kept text and the plan),
    and each object but a pod fed as its work's stub, as the source feeds it (a pod's
    update is never deferred: the whole pod goes with its prepared text). ``evaluated``
    False: the text alone, as when the thread failed."""
    fed: list[Obj] = []
    ready: dict[int, Prepared] = {}
    for o in objs:
        work = e.facts_work(o)
        if work is None:
            fed.append(o)
            continue
        assert work.stub is not None  # an update's, not a held object's
        one = o if o.get("kind") == "Pod" else work.stub
        fed.append(one)
        ready[id(one)] = work.run() if evaluated else work.unevaluated()
    return e.upsert_many(fed, prepared=ready)


def _unevaluated_upsert(e: Engine, objs: list[Obj]) -> ChangeSet:
    return _prepared_upsert(e, objs, evaluated=False)


Step = Callable[[Engine, Callable[[Engine, list[Obj]], ChangeSet]], ChangeSet]


def _history() -> list[Step]:
    """Steps of one history; each upserts through the given call (plain or prepared)."""
    rs = replicaset("web-rs", deployment("web"))
    rc = raycluster("rc", ["gpu", "cpu"])
    g = graph("g", {"a": 2, "b": 1})

    def up(*objs: Obj) -> Step:
        return lambda e, call: call(e, list(objs))

    return [
        # new objects (the record made from nothing) with what lies below them
        up(deployment("web"), rs, pod("w1", rs), rc, g, thing("t", "Running")),
        up(pod("r1", rc, **{"ray.io/node-type": "worker", "ray.io/group": "cpu"}),
           pod("bare")),
        # updates in place: status, instance ids (the pods' places follow), scale
        up(deployment("web", replicas=3, ready=1)),
        up(raycluster("rc", ["gpu"], state="failed")),
        up(graph("g", {"a": 4, "c": 1})),
        # a jq error of the expression's own, logged once, then fixed
        up(thing("t", 5)),
        up(thing("t", 7)),
        up(thing("t", "Running")),
        # an id refused (control character): a jq error of the id path
        up(graph("g", {"a": 1, "bad\nid": 2})),
        # a bare pod is its own workload: its text kept on the pod path
        up(pod("bare") | {"status": {"phase": "Succeeded"}}),
        # unchanged object: nothing
        up(graph("g", {"a": 1, "bad\nid": 2})),
    ]


def _plain(e: Engine, objs: list[Obj]) -> ChangeSet:
    return e.upsert_many(objs)


def _state(e: Engine) -> tuple[Any, ...]:
    return (sorted(e.pods(), key=lambda a: a.uid),
            sorted(e.workloads(), key=lambda f: f.ref.uid),
            dict(e.jq_errors), dict(e._retries), dict(e.stats))


def _run(steps: list[Step], call: Callable[[Engine, list[Obj]], ChangeSet],
         caplog: pytest.LogCaptureFixture) -> tuple[Engine, list[Any]]:
    clock = ManualClock(1000.0)
    e = _engine(clock)
    caplog.clear()
    seen: list[Any] = []
    for step in steps:
        seen.append((step(e, call), _state(e)))
        clock.now += 1.0
    seen.append([(r.levelname, r.getMessage()) for r in caplog.records])
    return e, seen


def test_prepared_facts_give_what_the_engine_gives_without_them(
        installed_sandbox: JqSandbox, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.karta.engine")
    plain, want = _run(_history(), _plain, caplog)
    prepared, got = _run(_history(), _prepared_upsert, caplog)
    assert got == want
    _, text_only = _run(_history(), _unevaluated_upsert, caplog)
    assert text_only == want
    assert any("jq error" in m for _, m in want[-1])  # the history met jq errors
    assert prepared.jq_errors == plain.jq_errors and plain.jq_errors
    for uid in ("deployment-web", "raycluster-rc", "graph-g", "thing-t", "pod-bare"):
        assert prepared.heavy(uid) and plain.heavy(uid), uid  # heavy_seconds 0


def test_prepared_facts_failing_for_now_owe_the_same_retries() -> None:
    """The sandbox cannot start: every evaluation fails for now (``retry_after`` 0),
    prepared or not; the retries owed, and what they give once it can, are the same."""
    results = []
    for call in (_plain, _prepared_upsert):
        clock = ManualClock(1000.0)
        e = _engine(clock)
        broken = JqSandbox(command=["/nonexistent/python"])
        install_runner(broken)
        try:
            # one object: the sandbox's message for a second one says how long until
            # its next try, which the order of the evaluations decides
            first = call(e, [thing("t", "Running")])
            owed = dict(e._retries)
        finally:
            remove_runner(broken)
        box = JqSandbox(timeout_seconds=5.0)
        install_runner(box)
        try:
            clock.now += 1.0
            retried = e.retry_due(100, 10.0)
        finally:
            remove_runner(box)
            box.close()
        results.append((first, owed, retried, _state(e)))
    assert results[0] == results[1]
    first, owed, retried, _ = results[0]
    assert owed and first.workloads["thing-t"] is not None
    assert first.workloads["thing-t"].phase == "Undefined"
    assert retried.workloads["thing-t"] is not None
    assert retried.workloads["thing-t"].phase == "Running"


def test_facts_prepared_under_a_description_no_longer_in_force_are_not_used(
        installed_sandbox: JqSandbox) -> None:
    """The work is taken, the description changes before the facts come back: the
    object's facts are those of the description in force, as without them."""
    clock = ManualClock(1000.0)
    e = _engine(clock)
    e.upsert(graph("g", {"a": 1}))
    new = graph("g", {"a": 3})
    work = e.facts_work(new)
    assert work is not None
    ready = work.run()
    # the phase now read from another field: the prepared facts say Undefined there
    changed = karta({"group": "example.com", "kind": "Graph"}, GRAPH_KARTA["spec"][
        "structureDefinition"]["childComponents"], statusDefinition={
            "phaseDefinition": {"path": ".status.state | ascii_upcase"},
            "statusMappings": {"running": [{"byPhase": "READY"}]}})
    e.add_descriptions([describe(RAY_KARTA), describe(changed), describe(RETRIED_THING)])
    assert ready.plan is not e.facts_work(new).plan  # type: ignore[union-attr]
    cs = e.upsert_many([new], prepared={id(new): ready})
    facts = cs.workloads["graph-g"]
    assert facts is not None and facts.phase == "Running"
    assert [r.desired for r in facts.replicas] == [3.0]


def test_a_waiting_update_is_replanned_under_the_description_in_force(
        installed_sandbox: JqSandbox) -> None:
    """An update's work taken before its kind's description changed: ``replanned`` gives
    the same text under the plan now in force (its facts then used as they are), the same
    work while the plan stands, None once the kind is no longer described."""
    e = _engine(ManualClock(1000.0))
    e.upsert(graph("g", {"a": 1}))
    new = graph("g", {"a": 3})
    work = e.facts_work(new)
    assert work is not None and e.replanned(work) is work
    changed = karta({"group": "example.com", "kind": "Graph"}, GRAPH_KARTA["spec"][
        "structureDefinition"]["childComponents"], statusDefinition={
            "phaseDefinition": {"path": ".status.state | ascii_upcase"},
            "statusMappings": {"running": [{"byPhase": "READY"}]}})
    e.add_descriptions([describe(RAY_KARTA), describe(changed), describe(RETRIED_THING)])
    again = e.replanned(work)
    assert again is not None and again.plan is not work.plan
    assert (again.kept, again.stub, again.pack_seconds) == (
        work.kept, work.stub, work.pack_seconds)
    ready = again.run()
    cs = e.upsert_many([new], prepared={id(new): ready})
    facts = cs.workloads["graph-g"]
    assert facts is not None and facts.phase == "Running"
    assert e._graph.objects["graph-g"].cache.facts is ready.facts  # used, not made again
    e.add_descriptions([describe(RAY_KARTA), describe(RETRIED_THING)])
    assert e.replanned(work) is None


def test_facts_prepared_under_the_description_its_workload_is_still_under_are_used(
        installed_sandbox: JqSandbox) -> None:
    """The thread evaluates an update as its kind's description changes, and the
    workload is re-attributed later (in runs, ``change_descriptions``): until then it is
    under the old description, whose facts the thread made. They are used, not made
    again on the event loop (~150-250 ms for a heavy object); the end, once
    re-attributed, is an engine's that was given none."""
    changed = karta({"group": "example.com", "kind": "Graph"}, GRAPH_KARTA["spec"][
        "structureDefinition"]["childComponents"], statusDefinition={
            "phaseDefinition": {"path": ".status.state | ascii_upcase"},
            "statusMappings": {"running": [{"byPhase": "READY"}]}})
    new = graph("g", {"a": 3})
    ends = []
    for given in (True, False):
        clock = ManualClock(1000.0)
        e = Engine(clock=clock, retry_clock=clock, heavy_seconds=0.0)
        e.add_descriptions([describe(GRAPH_KARTA)])
        e.upsert(graph("g", {"a": 1}))
        work = e.facts_work(new)
        assert work is not None
        ready = work.run()
        change = e.change_descriptions([describe(changed)])
        cs = e.upsert_many([new], prepared={id(new): ready} if given else None)
        cache = e._graph.objects["graph-g"].cache
        assert (cache.facts is ready.facts) is given  # not evaluated again
        before = cs.workloads["graph-g"]
        assert before is not None and before.phase == "Running"  # the old description's
        after = e.reattribute(change.owed).workloads.get("graph-g")
        cache = e._graph.objects["graph-g"].cache
        assert cache.plan.desc.name == describe(changed).name and cache.plan in e._plans.values()
        ends.append((before, after, dict(e.jq_errors), e.heavy("graph-g")))
    assert ends[0] == ends[1]


def test_a_heavy_object_is_forgotten_when_deleted(installed_sandbox: JqSandbox) -> None:
    """Heavy by the last evaluation's time; forgotten with the object (and light again
    when an evaluation takes less than the threshold)."""
    e = Engine(heavy_seconds=0.0)
    e.add_descriptions([describe(GRAPH_KARTA)])
    g = graph("g", {"a": 1})
    e.upsert(g)
    assert e.heavy("graph-g")
    e.delete(g)
    assert not e.heavy("graph-g") and not e._heavy
    slow = Engine(heavy_seconds=3600.0)
    slow.add_descriptions([describe(GRAPH_KARTA)])
    slow.upsert(g)
    assert not slow.heavy("graph-g")
    assert e.facts_work(pod("p", g)) is not None  # the built-in Pod description
    assert Engine(builtins=False).facts_work(g) is None  # no description of its kind


def test_prepared_facts_are_used_and_accounted_at_first_use(installed_sandbox: JqSandbox) -> None:
    """The prepared evaluation is the one kept (not made again on this thread), and its
    jq error counted once, when the engine used it; an object no workload uses keeps its
    prepared facts unaccounted (as its evaluation would not have been made)."""
    e = _engine(ManualClock(1000.0))
    t = thing("t", 5)
    work = e.facts_work(t)
    assert work is not None
    ready = work.run()
    assert ready.facts is not None and ready.facts.errors and ready.seconds > 0
    e.upsert_many([t], prepared={id(t): ready})
    cache = e._graph.objects["thing-t"].cache
    assert cache.facts is ready.facts and cache.unaccounted is None
    assert sum(e.jq_errors.values()) == 1


def test_waiting_for_the_sandbox_busy_with_another_thread_is_no_weight(
        installed_sandbox: JqSandbox) -> None:
    """The heavy objects' thread holds the sandbox for a whole evaluation (~160-250 ms
    a heavy object): a light object evaluated on the event loop meanwhile waited for it,
    and that wait counted as its own evaluation's time, so it became heavy and its next
    updates queued behind the heavy ones'; the thread's own evaluation, waiting for the
    loop's, the same. Here the other thread's evaluation is held ~0.3 s (its child
    stopped, then continued by a timer): the object waits that long, and stays light."""
    e = Engine(heavy_seconds=0.1)
    e.add_descriptions([describe(GRAPH_KARTA)])
    assert installed_sandbox.run(JqExpr("."), "1") == [1]
    pid = installed_sandbox.child_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    other = threading.Thread(target=installed_sandbox.run, args=(JqExpr("."), "2"),
                             name="karta-jq_0")
    other.start()
    resume = threading.Timer(0.3, os.kill, (pid, signal.SIGCONT))
    try:
        deadline = time.monotonic() + 5
        while not installed_sandbox._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert installed_sandbox._lock.locked(), "the other evaluation did not start"
        resume.start()
        began = time.monotonic()
        e.upsert(graph("g", {"a": 1}))
        assert time.monotonic() - began >= 0.2  # it did wait for the other one
    finally:
        resume.join(5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        other.join(10)
    assert not e.heavy("graph-g")


def test_facts_prepared_under_a_stale_plan_weigh_only_their_pack(
        installed_sandbox: JqSandbox) -> None:
    """Facts not used (their plan no longer in force) cost the event loop nothing: the
    object's weight is its pack and the evaluation made here, not the thread's unused one
    as well (it kept an object the new description made light heavy one version more,
    its next update deferred behind the heavy ones')."""
    e = Engine(heavy_seconds=0.5)
    e.add_descriptions([describe(GRAPH_KARTA)])
    e.upsert(graph("g", {"a": 1}))
    new = graph("g", {"a": 3})
    work = e.facts_work(new)
    assert work is not None
    ready = work.run()._replace(seconds=1.0)  # the thread's evaluation took a second
    changed = karta({"group": "example.com", "kind": "Graph"}, GRAPH_KARTA["spec"][
        "structureDefinition"]["childComponents"], statusDefinition={
            "phaseDefinition": {"path": ".status.state | ascii_upcase"},
            "statusMappings": {"running": [{"byPhase": "READY"}]}})
    e.add_descriptions([describe(changed)])
    e.upsert_many([new], prepared={id(new): ready})
    assert not e.heavy("graph-g")
