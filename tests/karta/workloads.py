"""Workload objects as their controllers report them, for the phase tests of the built-in
descriptions and of the samples (the same object, evaluated by either)."""

from __future__ import annotations

from typing import Any


def statefulset(
    replicas: int, *, ready: int, updated: int | None = None, revision: str = "r1"
) -> dict[str, Any]:
    """A StatefulSet the controller has observed; ``revision`` other than ``r1`` is a
    rollout in progress (updateRevision ahead of currentRevision)."""
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": "r1",
            "updateRevision": revision,
        },
    }
