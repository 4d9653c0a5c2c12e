"""The simulator's etcd: objects, one resourceVersion counter, a per-resource event log.

The event log is what makes watches resumable from a resourceVersion; compaction drops
it, after which older resourceVersions get 410 Gone, exactly the case a watcher must
survive by relisting.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tests.kubesim.resources import ResourceType

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)


class ApiError(Exception):
    """An API failure with the status the HTTP layer answers."""

    def __init__(self, code: int, reason: str, message: str,
                 details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> Obj:
        out: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = self.details
        return out


class NotFound(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(404, "NotFound", message)


class Conflict(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(409, "Conflict", message)


class AlreadyExists(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(409, "AlreadyExists", message)


class Gone(ApiError):
    def __init__(self, message: str, reason: str = "Expired") -> None:
        super().__init__(410, reason, message)


class TooLargeResourceVersion(ApiError):
    """What kube-apiserver answers a watch from a resourceVersion it has not reached
    (``storage.NewTooLargeResourceVersionError``): 504, reason Timeout, the cause
    ResourceVersionTooLarge. A client whose server's store went back (a restored or
    fresh etcd) meets it, and must relist."""

    def __init__(self, asked: int, current: int) -> None:
        super().__init__(
            504, "Timeout", f"Too large resource version: {asked}, current: {current}",
            {"causes": [{"reason": "ResourceVersionTooLarge",
                         "message": "Too large resource version"}],
             "retryAfterSeconds": 1})


@dataclass(slots=True)
class Event:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj
    #: the object before the change (MODIFIED), so filtered watches can turn a change
    #: that moves an object into / out of their selection into ADDED / DELETED
    old: Obj | None = None


@dataclass(eq=False)
class WatchFeed:
    """One open watch stream's inbox; the HTTP handler drains it."""

    rtype: ResourceType
    #: events to send; None: killed; bytes: ``flush`` (what was held back, then these
    #: bytes, in one write, then a clean end of the stream)
    queue: asyncio.Queue[Event | bytes | None] = field(default_factory=asyncio.Queue)
    #: set by ``disconnect`` -> the handler aborts the connection without a clean end
    killed: bool = False
    #: set by ``hang`` -> the handler writes nothing more (no event, no bookmark, no end)
    #: but keeps the connection open: a half-open connection or a stuck server
    hung: bool = False
    #: set by ``hold`` -> events (and bookmarks) are kept back until ``flush``
    holding: bool = False

    def kill(self) -> None:
        self.killed = True
        self.queue.put_nowait(None)

    def hang(self) -> None:
        self.hung = True

    def hold(self) -> None:
        self.holding = True

    def flush(self, tail: bytes) -> None:
        self.queue.put_nowait(tail)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- selectors -----------------------------------------------------------------------------

_SPLIT = re.compile(r",(?![^()]*\))")
_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_label_selector(text: str) -> Callable[[Mapping[str, str]], bool]:
    """Equality, inequality, existence and set-based requirements, ANDed."""
    reqs: list[tuple[str, str, frozenset[str]]] = []  # (op, key, values)
    for raw in _SPLIT.split(text or ""):
        part = raw.strip()
        if not part:
            continue
        m = _SET.match(part)
        if m:
            values = frozenset(v.strip() for v in m.group(3).split(","))
            reqs.append((m.group(2), m.group(1), values))
        elif "!=" in part:
            k, v = part.split("!=", 1)
            reqs.append(("notin", k.strip(), frozenset([v.strip()])))
        elif "=" in part:
            k, v = part.replace("==", "=").split("=", 1)
            reqs.append(("in", k.strip(), frozenset([v.strip()])))
        elif part.startswith("!"):
            reqs.append(("absent", part[1:].strip(), frozenset()))
        else:
            reqs.append(("present", part, frozenset()))

    def match(labels: Mapping[str, str]) -> bool:
        for op, key, values in reqs:
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and labels.get(key) in values:
                return False
            if op == "absent" and key in labels:
                return False
            if op == "present" and key not in labels:
                return False
        return True

    return match


def _field(obj: Mapping[str, Any], path: str) -> str:
    cur: Any = obj
    for step in path.split("."):
        if not isinstance(cur, Mapping):
            return ""
        cur = cur.get(step)
    return "" if cur is None else str(cur)


def parse_field_selector(text: str) -> Callable[[Mapping[str, Any]], bool]:
    """``path=value`` / ``path==value`` / ``path!=value`` on dotted paths, ANDed."""
    reqs: list[tuple[bool, str, str]] = []  # (equal?, path, value)
    for raw in (text or "").split(","):
        part = raw.strip()
        if not part:
            continue
        if "!=" in part:
            p, v = part.split("!=", 1)
            reqs.append((False, p.strip(), v.strip()))
        elif "=" in part:
            p, v = part.replace("==", "=").split("=", 1)
            reqs.append((True, p.strip(), v.strip()))
        else:
            raise ApiError(400, "BadRequest", f"invalid field selector {part!r}")
    return lambda obj: all((_field(obj, p) == v) == eq for eq, p, v in reqs)


@dataclass(slots=True)
class Filter:
    namespace: str | None = None
    labels: Callable[[Mapping[str, str]], bool] | None = None
    fields: Callable[[Mapping[str, Any]], bool] | None = None

    def __call__(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        md = obj["metadata"]
        if self.namespace is not None and md.get("namespace") != self.namespace:
            return False
        if self.labels is not None and not self.labels(md.get("labels") or {}):
            return False
        return self.fields is None or self.fields(obj)


# -- the store -----------------------------------------------------------------------------


class ResourceStore:
    """Objects of one resource plus the log of their changes."""

    def __init__(self, rtype: ResourceType) -> None:
        self.rtype = rtype
        self.objects: dict[Key, Obj] = {}
        self.log: list[Event] = []
        self.log_rvs: list[int] = []
        #: events with rv <= floor are gone from the log
        self.floor = 0
        self.feeds: set[WatchFeed] = set()
        #: the version of this resource's last change (its registration's, before any):
        #: what kube-apiserver's watch cache of the resource knows of the store's
        #: version when etcd sends it no progress notifications (``KubeSim.progress_notify``)
        self.last_rv = 0

    def append(self, ev: Event, max_log: int) -> None:
        self.last_rv = ev.rv
        self.log.append(ev)
        self.log_rvs.append(ev.rv)
        if len(self.log) > max_log:
            drop = len(self.log) // 2
            self.floor = self.log_rvs[drop - 1]
            del self.log[:drop]
            del self.log_rvs[:drop]
        for feed in self.feeds:
            feed.queue.put_nowait(ev)

    def since(self, rv: int) -> list[Event]:
        if rv < self.floor:
            raise Gone(f"too old resource version: {rv} ({self.floor})", reason="Expired")
        return self.log[bisect.bisect_right(self.log_rvs, rv):]


class Store:
    def __init__(self, max_log: int = 200_000) -> None:
        self.rv = 0
        self.max_log = max_log
        self.resources: dict[tuple[str, str], ResourceStore] = {}
        #: kind lookup: (apiVersion group, kind) -> key
        self.by_kind: dict[tuple[str, str], tuple[str, str]] = {}

    # -- types --
    def register(self, rtype: ResourceType) -> None:
        if rtype.key not in self.resources:
            self.resources[rtype.key] = ResourceStore(rtype)
            self.resources[rtype.key].last_rv = self.rv
        self.by_kind[(rtype.group, rtype.kind)] = rtype.key

    def unregister(self, rtype: ResourceType) -> None:
        rs = self.resources.pop(rtype.key, None)
        self.by_kind.pop((rtype.group, rtype.kind), None)
        if rs is not None:
            for feed in list(rs.feeds):
                feed.kill()

    def types(self) -> list[ResourceType]:
        return [rs.rtype for rs in self.resources.values()]

    def for_object(self, obj: Mapping[str, Any]) -> ResourceStore:
        api_version = obj.get("apiVersion", "")
        group = api_version.rpartition("/")[0] if "/" in api_version else ""
        key = self.by_kind.get((group, obj.get("kind", "")))
        if key is None:
            raise NotFound(f"the server could not find the requested resource ({api_version} "
                           f"{obj.get('kind')})")
        return self.resources[key]

    # -- writes --
    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def create(self, rs: ResourceStore, obj: Mapping[str, Any]) -> Obj:
        new = copy.deepcopy(dict(obj))
        rt = rs.rtype
        md = new.setdefault("metadata", {})
        if not md.get("name"):
            if md.get("generateName"):
                md["name"] = md["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise ApiError(422, "Invalid", "metadata.name: Required value")
        if rt.namespaced:
            md.setdefault("namespace", "default")
        else:
            md.pop("namespace", None)
        key = (md.get("namespace", ""), md["name"])
        if key in rs.objects:
            raise AlreadyExists(f'{rt.plural}.{rt.group} "{md["name"]}" already exists')
        new["apiVersion"] = rt.api_version
        new["kind"] = rt.kind
        md["uid"] = md.get("uid") or str(uuid.uuid4())
        md.setdefault("creationTimestamp", now_rfc3339())
        md["generation"] = 1
        rv = self._next_rv()
        md["resourceVersion"] = str(rv)
        rs.objects[key] = new
        rs.append(Event(rv, "ADDED", new), self.max_log)
        return new

    def seed(self, rs: ResourceStore, obj: Mapping[str, Any]) -> Obj:
        """Store an object that was there before the log begins (what a cluster makes at
        its creation: the ``kube-system`` Namespace): at the current resourceVersion, no
        event, so the resourceVersions tests count from stay as they were."""
        new = copy.deepcopy(dict(obj))
        rt = rs.rtype
        md = new.setdefault("metadata", {})
        new["apiVersion"], new["kind"] = rt.api_version, rt.kind
        md["uid"] = md.get("uid") or str(uuid.uuid4())
        md.setdefault("creationTimestamp", now_rfc3339())
        md["resourceVersion"] = str(self.rv)
        rs.objects[(md.get("namespace", "") if rt.namespaced else "", md["name"])] = new
        return new

    def update(self, rs: ResourceStore, obj: Mapping[str, Any]) -> Obj:
        new = copy.deepcopy(dict(obj))
        md = new.get("metadata") or {}
        key = (md.get("namespace", "") if rs.rtype.namespaced else "", md.get("name", ""))
        old = rs.objects.get(key)
        if old is None:
            raise NotFound(f'{rs.rtype.plural} "{key[1]}" not found')
        sent_rv = md.get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise Conflict(
                f'Operation cannot be fulfilled on {rs.rtype.plural} "{key[1]}": the object '
                "has been modified; please apply your changes to the latest version and try "
                "again"
            )
        new["apiVersion"] = rs.rtype.api_version
        new["kind"] = rs.rtype.kind
        omd = old["metadata"]
        md["uid"] = omd["uid"]
        md["creationTimestamp"] = omd["creationTimestamp"]
        if rs.rtype.namespaced:
            md["namespace"] = key[0]
        md["generation"] = omd.get("generation", 1) + (
            1 if new.get("spec") != old.get("spec") else 0
        )
        rv = self._next_rv()
        md["resourceVersion"] = str(rv)
        new["metadata"] = md
        rs.objects[key] = new
        rs.append(Event(rv, "MODIFIED", new, old), self.max_log)
        return new

    def delete(self, rs: ResourceStore, namespace: str, name: str) -> Obj:
        key = (namespace if rs.rtype.namespaced else "", name)
        old = rs.objects.pop(key, None)
        if old is None:
            raise NotFound(f'{rs.rtype.plural} "{name}" not found')
        gone = copy.copy(old)
        gone["metadata"] = dict(old["metadata"])
        rv = self._next_rv()
        gone["metadata"]["resourceVersion"] = str(rv)
        rs.append(Event(rv, "DELETED", gone), self.max_log)
        return gone

    def dependents(self, uid: str) -> Iterable[tuple[ResourceStore, Obj]]:
        for rs in self.resources.values():
            for obj in list(rs.objects.values()):
                for ref in obj["metadata"].get("ownerReferences") or ():
                    if ref.get("uid") == uid:
                        yield rs, obj
                        break

    def compact(self) -> None:
        for rs in self.resources.values():
            rs.floor = self.rv
            rs.log.clear()
            rs.log_rvs.clear()
