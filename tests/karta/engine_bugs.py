"""An engine bug on one object, injected: what the writers of the engine must survive
(``proxy.karta.batches``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from proxy.karta.engine import Engine
from proxy.karta.results import ChangeSet


def fail_on_pod(monkeypatch: pytest.MonkeyPatch, name: str, message: str = "engine bug"
                ) -> None:
    """From now on, ``Engine`` raises ``RuntimeError(message)`` upserting the pod
    ``name``, after the pods before it in a batch were upserted, as a bug would."""
    real: Callable[..., None] = Engine._upsert_pod

    def upsert_pod(self: Engine, obj: Mapping[str, Any], md: Mapping[str, Any], uid: str,
                   cs: ChangeSet) -> None:
        if md.get("name") == name:
            raise RuntimeError(message)
        real(self, obj, md, uid, cs)

    monkeypatch.setattr(Engine, "_upsert_pod", upsert_pod)
