"""An engine call over a batch that one object's failure cannot fail whole
(proxy.karta.batches)."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.karta.batches import alone_if_failing
from proxy.karta.results import ChangeSet


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
