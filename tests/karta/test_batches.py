"""An engine call over a batch that one object's failure cannot fail whole
(proxy.karta.batches)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from proxy.karta.batches import alone_if_failing, object_name
from proxy.karta.engine import Engine
from proxy.karta.results import ChangeSet, PartialBatch
from tests.karta.engine_bugs import fail_on_pod


def _changes(items: Sequence[str]) -> ChangeSet:
    cs = ChangeSet()
    for item in items:
        cs.pods[item] = None  # gone: enough to tell which items gave their changes
    return cs


def test_a_batch_the_engine_takes_is_given_once() -> None:
    calls: list[list[str]] = []

    def call(items: Sequence[str]) -> ChangeSet:
        calls.append(list(items))
        return _changes(items)

    failed: list[str] = []
    cs = alone_if_failing(["a", "b", "c"], call, lambda item, e: failed.append(item))
    assert calls == [["a", "b", "c"]] and not failed
    assert sorted(cs.pods) == ["a", "b", "c"]


def test_an_object_the_engine_fails_on_costs_that_object_only() -> None:
    calls: list[list[str]] = []

    def call(items: Sequence[str]) -> ChangeSet:
        calls.append(list(items))
        if "bad" in items:
            raise RuntimeError("engine bug")
        return _changes(items)

    failed: list[tuple[str, str]] = []
    cs = alone_if_failing(["a", "bad", "c"], call,
                          lambda item, e: failed.append((item, str(e))))
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    assert failed == [("bad", "engine bug")]
    assert sorted(cs.pods) == ["a", "c"]


def test_what_a_failing_batch_did_comes_first_and_the_failure_says_its_cause() -> None:
    def call(items: Sequence[str]) -> ChangeSet:
        if len(items) > 1:  # "a" done before "bad" failed: the engine holds it already
            raise PartialBatch(_changes(["a"])) from RuntimeError("engine bug")
        if items[0] == "bad":
            raise PartialBatch(None) from RuntimeError("engine bug")
        return ChangeSet()  # given again, "a" is unchanged and gives nothing

    failed: list[tuple[str, str]] = []
    cs = alone_if_failing(["a", "bad", "c"], call,
                          lambda item, e: failed.append((item, repr(e))))
    assert sorted(cs.pods) == ["a"]
    assert failed == [("bad", "RuntimeError('engine bug')")]


def _pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "status": {"phase": "Running"},
            "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}}


def test_pods_upserted_before_the_engine_failed_reach_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of pod events failing on its second pod: the first one's attribution is
    in the answer (before, the engine held it and no follower ever got it)."""
    engine = Engine()
    fail_on_pod(monkeypatch, "bad")
    failed: list[str] = []
    cs = alone_if_failing([_pod("a"), _pod("bad"), _pod("c")], engine.upsert_many,
                          lambda obj, e: failed.append(f"{object_name(obj)}: {e}"))
    assert failed == ["Pod ns/bad: engine bug"]
    assert set(cs.pods) == {"u-a", "u-c"}
    assert all(att is not None and att.workload == engine.pod(uid).workload  # type: ignore[union-attr]
               for uid, att in cs.pods.items())
    assert cs.workloads  # the bare pods' own workloads, settled


def test_a_reattribution_that_fails_part_way_gives_what_it_did() -> None:
    engine = Engine()
    engine.upsert_many([_pod("a"), _pod("b")])
    done: list[str] = []
    real = engine._attribute_pod

    def attribute(rec: Any, cs: ChangeSet) -> None:
        if rec.name == "b":
            raise RuntimeError("engine bug")
        done.append(rec.name)
        real(rec, cs)
        cs.pods[rec.uid] = engine.pod(rec.uid)  # as if its attribution had changed

    engine._attribute_pod = attribute  # type: ignore[method-assign]
    with pytest.raises(PartialBatch) as raised:
        engine.reattribute(["u-a", "u-b"])
    assert done == ["a"] and isinstance(raised.value.__cause__, RuntimeError)
    assert raised.value.changes is not None and set(raised.value.changes.pods) == {"u-a"}


def test_a_batch_whose_settling_fails_too_leaves_its_workloads_to_settle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine()
    fail_on_pod(monkeypatch, "bad")
    real_settle = Engine._settle
    settles = 0

    def settle(self: Engine, cs: ChangeSet) -> None:
        nonlocal settles
        settles += 1
        if settles == 1:
            raise RuntimeError("another engine bug")
        real_settle(self, cs)

    monkeypatch.setattr(Engine, "_settle", settle)
    with pytest.raises(PartialBatch) as raised:
        engine.upsert_many([_pod("a"), _pod("bad")])
    assert raised.value.changes is None
    later = engine.upsert_many([_pod("c")])
    workloads = set()
    for uid in ("u-a", "u-c"):
        att = engine.pod(uid)
        assert att is not None and att.workload is not None
        workloads.add(att.workload.uid)
    assert workloads <= set(later.workloads)
