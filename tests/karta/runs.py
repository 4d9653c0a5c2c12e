"""Watching how a description change's re-attribution is given: in runs, or at once."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.karta.engine import Engine
from proxy.karta.results import ChangeSet


def record_runs(engine: Engine) -> list[int]:
    """From now on, how many objects each call of ``engine.reattribute`` is given."""
    runs: list[int] = []
    real = engine.reattribute

    def counting(uids: Iterable[str]) -> ChangeSet:
        uids = list(uids)
        runs.append(len(uids))
        return real(uids)

    engine.reattribute = counting  # type: ignore[method-assign]
    return runs
