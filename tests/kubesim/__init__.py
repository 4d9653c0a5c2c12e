"""Kubernetes API simulator for tests: ``from tests.kubesim import KubeSim``."""

from tests.kubesim.resources import (
    CORE_TYPES,
    CRD_TYPES,
    ResourceType,
)
from tests.kubesim.server import KubeSim, free_port
from tests.kubesim.store import (
    AlreadyExists,
    ApiError,
    Conflict,
    Gone,
    NotFound,
    TooLargeResourceVersion,
)

__all__ = [
    "CORE_TYPES",
    "CRD_TYPES",
    "AlreadyExists",
    "ApiError",
    "Conflict",
    "Gone",
    "KubeSim",
    "NotFound",
    "ResourceType",
    "TooLargeResourceVersion",
    "free_port",
]
