"""GroupKind -> the resource the cluster serves it as (version, plural, scope).

Descriptions name kinds, the API wants plurals and versions: discovery is the only
honest way to get them (CRDs choose their own). Groups are fetched lazily and cached; a
miss refreshes the group list at most every ``refresh_interval`` seconds, so a CRD
installed after start is found without hammering the server for kinds it never serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.karta.model import GVK, GroupKind
from proxy.kube.client import KubeApiError, KubeClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ApiResource(GVK):
    """A kind as the cluster serves it: its group/version/kind (``api_version`` and
    ``group_kind`` come with them), plural and scope."""

    plural: str
    namespaced: bool

    @property
    def name(self) -> str:
        """``plural.group`` (``pods`` for the core group): the metric / freshness key."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else "/api/v1"
        if namespace and self.namespaced:
            return f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{self.plural}"


class Resolver(Protocol):
    """What the source needs of discovery (``Discovery``, or a static table in tests)."""

    async def resolve(self, gk: GroupKind) -> ApiResource | None: ...

    def invalidate(self) -> None: ...


class Discovery:
    def __init__(
        self,
        client: KubeClient,
        *,
        refresh_interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._refresh_interval = refresh_interval
        self._clock = clock
        #: group -> versions, preferred first (None until the group list is fetched)
        self._groups: dict[str, list[str]] | None = None
        self._groups_at = -1e18
        #: group/version -> {kind: ApiResource}
        self._resources: dict[str, dict[str, ApiResource]] = {}

    async def resolve(self, gk: GroupKind) -> ApiResource | None:
        """The served resource for ``gk``, or None when the cluster does not serve it."""
        found = await self._find(gk)
        if found is None and self._clock() - self._groups_at >= self._refresh_interval:
            self.invalidate()
            found = await self._find(gk)
        return found

    def invalidate(self) -> None:
        self._groups = None
        self._resources.clear()

    async def _find(self, gk: GroupKind) -> ApiResource | None:
        groups = await self._group_versions()
        for version in groups.get(gk.group, []):
            gv = f"{gk.group}/{version}" if gk.group else version
            resources = await self._group_version(gv)
            if gk.kind in resources:
                return resources[gk.kind]
        return None

    async def _group_versions(self) -> dict[str, list[str]]:
        if self._groups is None:
            groups: dict[str, list[str]] = {"": ["v1"]}
            doc = await self._client.request_json("/apis")
            for g in doc.get("groups") or []:
                preferred = (g.get("preferredVersion") or {}).get("version")
                versions = [v["version"] for v in g.get("versions") or []]
                if preferred in versions:
                    versions.remove(preferred)
                    versions.insert(0, preferred)
                groups[g["name"]] = versions
            self._groups = groups
            self._groups_at = self._clock()
        return self._groups

    async def _group_version(self, gv: str) -> dict[str, ApiResource]:
        cached = self._resources.get(gv)
        if cached is not None:
            return cached
        path = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        try:
            doc: dict[str, Any] = await self._client.request_json(path)
        except KubeApiError as e:
            if e.status != 404:
                raise
            doc = {}
        group, _, version = gv.rpartition("/")
        out: dict[str, ApiResource] = {}
        for r in doc.get("resources") or []:
            if "/" in r["name"]:  # subresources (pods/status, ...)
                continue
            verbs = set(r.get("verbs") or ())
            if not {"list", "watch"} <= verbs:
                continue
            out[r["kind"]] = ApiResource(group, version, r["kind"], r["name"],
                                         bool(r.get("namespaced")))
        self._resources[gv] = out
        return out
