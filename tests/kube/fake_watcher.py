"""A fake cluster at the source's seams: a ``WatcherFactory`` and a ``Resolver``.

``KubeSource`` reconciles watches (start, stop, switch mode, retract) against what the
engine needs; that logic does not depend on HTTP or on timing. ``FakeCluster`` holds the
objects and the served resources, builds ``FakeWatcher``s that list synchronously when
started, and pushes each change to the live watchers at once, so tests of the reconcile,
mode-switch and tombstone logic need no sleeps and no ``eventually``. The watch protocol
itself (pagination, bookmarks, 410, idle streams) stays tested against the simulator.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Unpack

from proxy.karta.model import GroupKind
from proxy.kube.client import KubeApiError
from proxy.kube.discovery import ApiResource
from proxy.kube.watcher import WatchBase, WatchEvent, WatchScope, WatchSink

Obj = dict[str, Any]

POD = ApiResource("", "v1", "Pod", "pods", True)
REPLICA_SET = ApiResource("apps", "v1", "ReplicaSet", "replicasets", True)
DEPLOYMENT = ApiResource("apps", "v1", "Deployment", "deployments", True)
KARTA = ApiResource("run.ai", "v1alpha1", "Karta", "kartas", False)
RESOURCE_INTERFACE = ApiResource("optimization.nvidia.com", "v1alpha1", "ResourceInterface",
                                 "resourceinterfaces", False)
RAY_JOB = ApiResource("ray.io", "v1", "RayJob", "rayjobs", True)
RAY_CLUSTER = ApiResource("ray.io", "v1", "RayCluster", "rayclusters", True)
JOB_SET = ApiResource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets", True)
#: what every cluster serves (the engine's builtin descriptions need them all)
BUILTIN = (
    POD, REPLICA_SET, DEPLOYMENT,
    ApiResource("apps", "v1", "StatefulSet", "statefulsets", True),
    ApiResource("apps", "v1", "DaemonSet", "daemonsets", True),
    ApiResource("batch", "v1", "Job", "jobs", True),
    ApiResource("batch", "v1", "CronJob", "cronjobs", True),
    KARTA, RESOURCE_INTERFACE,
)


class FakeWatcher(WatchBase):
    """One watch of a fake cluster: lists when started, then gets every change pushed."""

    def __init__(self, cluster: FakeCluster, resource: ApiResource, sink: WatchSink,
                 **scope: Unpack[WatchScope]) -> None:
        super().__init__(resource, sink, **scope)
        self.cluster = cluster
        #: what the source handed over at construction (a mode switch passes it on)
        self.held_at_start = dict(self.held)
        self.started = False
        self.stopped = False
        #: how many times the source told it to relist (``relist_history``)
        self.told_to_relist = 0
        #: how many times the source cut its backoff short (``retry_now``)
        self.woken = 0

    def start(self) -> None:
        """List at once, as a watcher's first list does: ADDED for every object, then
        DELETED stubs for held uids the cluster no longer has (the relist diff)."""
        assert not self.started, "started twice"
        self.started = True
        self.relist()

    def retry_now(self) -> None:
        self.woken += 1

    def relist_history(self) -> None:
        """Told to relist (another watcher saw the store go back): recorded, pending
        until the test calls ``relist`` (a real watcher's list takes its time)."""
        self.history_pending = True
        self.told_to_relist += 1

    def relist(self) -> None:
        """List now: every object the cluster has, then the diff's deletions."""
        seen: set[str] = set()
        events: list[WatchEvent] = []
        for obj in self.cluster.objects(self.resource.group_kind):
            if not self.sees(obj):
                continue
            md = obj["metadata"]
            seen.add(md["uid"])
            self.held[md["uid"]] = f"{md.get('namespace', '')}/{md['name']}"
            events.append(("ADDED", self._view(obj)))
        gone = [uid for uid in self.held if uid not in seen]
        events += [("DELETED", self.stub(uid)) for uid in gone]
        for uid in gone:
            del self.held[uid]
        if events:
            self.sink.handle(self, events)
        self.history_pending = False
        self.sink.current(self)
        self.synced.set()

    async def stop(self) -> None:
        self.stopped = True

    @property
    def live(self) -> bool:
        return self.started and not self.stopped

    async def deliver(self, events: list[WatchEvent]) -> None:
        self.sink.handle(self, events)

    def sees(self, obj: Obj) -> bool:
        md = obj["metadata"]
        if self.namespace is not None and md.get("namespace") != self.namespace:
            return False
        if self.field_selector:
            key, _, value = self.field_selector.partition("=")
            assert key == "spec.nodeName", self.field_selector
            return bool((obj.get("spec") or {}).get("nodeName") == value)
        return True

    def push(self, etype: str, obj: Obj) -> None:
        """One watch event, as a real watcher hands it on (unknown deletions dropped)."""
        md = obj["metadata"]
        if etype == "DELETED":
            if self.held.pop(md["uid"], None) is None:
                return
        else:
            self.held[md["uid"]] = f"{md.get('namespace', '')}/{md['name']}"
        self.sink.handle(self, [(etype, self._view(obj))])
        self.sink.current(self)

    def fail(self, kind: str = "unreachable", why: str = "") -> None:
        """This watch fails ``kind``'s way: the API server unreachable by default."""
        self.last_error_kind = kind
        self.last_error = why or f"{kind} (fake)"
        self.sink.health(self, False)

    def recover(self) -> None:
        self.sink.health(self, True)

    def answer(self) -> None:
        """The first page of a list came back (``WatchSink.answered``), before the list
        goes through and the watcher ``recover``s."""
        self.sink.answered(self)

    def refuse(self, status: int) -> None:
        """The server answers ``status`` (403 / 404) for this resource from now on."""
        self.sink.unserved(self, KubeApiError(status, "Forbidden", "refused by the fake"))

    def _view(self, obj: Obj) -> Obj:
        if self.metadata_only:
            return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                    "metadata": copy.deepcopy(obj["metadata"])}
        return copy.deepcopy(obj)


class FakeCluster:
    """Objects, served resources, and every watcher built: a ``WatcherFactory`` (call
    it) and a ``Resolver`` (``resolve``, ``invalidate``) for ``KubeSource``."""

    def __init__(self, *served: ApiResource) -> None:
        self.resources: dict[GroupKind, ApiResource] = {r.group_kind: r for r in served}
        self._objects: dict[GroupKind, dict[str, Obj]] = {}
        self.watchers: list[FakeWatcher] = []
        self.invalidations = 0
        #: while set, ``resolve`` raises it (discovery unreachable)
        self.discovery_error: Exception | None = None
        self._uids = itertools.count(1)

    # -- Resolver ----------------------------------------------------------------------

    async def resolve(self, gk: GroupKind) -> ApiResource | None:
        if self.discovery_error is not None:
            raise self.discovery_error
        return self.resources.get(gk)

    def invalidate(self) -> None:
        self.invalidations += 1

    def serve(self, resource: ApiResource) -> None:
        self.resources[resource.group_kind] = resource

    # -- WatcherFactory ----------------------------------------------------------------

    def __call__(self, resource: ApiResource, sink: WatchSink,
                 **scope: Unpack[WatchScope]) -> FakeWatcher:
        w = FakeWatcher(self, resource, sink, **scope)
        self.watchers.append(w)
        return w

    def live(self, kind: str) -> list[FakeWatcher]:
        """The started, not stopped watchers of ``kind``."""
        return [w for w in self.watchers if w.resource.kind == kind and w.live]

    # -- objects -----------------------------------------------------------------------

    def objects(self, gk: GroupKind) -> list[Obj]:
        return list(self._objects.get(gk, {}).values())

    def create(self, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{next(self._uids)}")
        self._store(obj)
        self._push("ADDED", obj)
        return obj

    def update(self, obj: Obj) -> None:
        obj = copy.deepcopy(obj)
        self._store(obj)
        self._push("MODIFIED", obj)

    def delete(self, obj: Obj) -> None:
        gk = _group_kind(obj)
        gone = self._objects.get(gk, {}).pop(obj["metadata"]["uid"])
        self._push("DELETED", gone)

    def delete_quietly(self, obj: Obj) -> None:
        """Delete without an event (as if the watch missed it): only a relist finds it."""
        self._objects.get(_group_kind(obj), {}).pop(obj["metadata"]["uid"])

    def _store(self, obj: Obj) -> None:
        self._objects.setdefault(_group_kind(obj), {})[obj["metadata"]["uid"]] = obj

    def _push(self, etype: str, obj: Obj) -> None:
        for w in self.watchers:
            if w.live and w.resource.group_kind == _group_kind(obj) and w.sees(obj):
                w.push(etype, obj)


def _group_kind(obj: Obj) -> GroupKind:
    group = obj["apiVersion"].rpartition("/")[0]
    return GroupKind(group, obj["kind"])
