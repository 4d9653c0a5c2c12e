"""An HTTP Kubernetes API simulator (aiohttp) for tests and benchmarks.

It serves what a watching client meets on a real API server: discovery, paginated
lists at a resourceVersion, chunked watch streams (ADDED / MODIFIED / DELETED /
BOOKMARK / ERROR 410 after compaction, any ERROR on demand), server-side watch
timeouts, abrupt disconnects, metadata-only (PartialObjectMetadata) responses,
namespace / label / field selectors, CRDs registered at runtime, create / update /
patch / delete with optimistic concurrency (Lease election builds on that), and, on
demand, RBAC enforced as kube-apiserver's authorizer does (``enforce_rbac``). Tests
drive it from Python (``create``, ``update``, ``delete``, ``compact``,
``disconnect_watches``, ``drain_watches``, ``hang_watches``, ``hold_watches`` / ``flush_watches``,
``cut_lists``, ``list_token_ttl``, ``progress_notify``, ``stop`` / ``start``) and point
kubernetes-asyncio at it through the kubeconfig it writes.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import dataclasses
import json
import re
import socket
import ssl
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.kubesim.rbac import (
    SERVICE_ACCOUNT_NAME,
    SERVICE_ACCOUNT_NAMESPACE,
    Attributes,
    Authorizer,
    forbidden,
    request_attributes,
    service_account_user,
)
from tests.kubesim.resources import CORE_TYPES, NAMESPACE, ResourceType
from tests.kubesim.store import (
    ApiError,
    Event,
    Filter,
    NotFound,
    Obj,
    ResourceStore,
    Store,
    TooLargeResourceVersion,
    WatchFeed,
    parse_field_selector,
    parse_label_selector,
)

META_GROUP_VERSION = "meta.k8s.io/v1"


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes' order of API versions (``CompareKubeAwareVersionStrings``): GA before
    beta before alpha, a higher major then minor first, other names last by name."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if m is None:
        return (3, 0, 0, version)
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (stage, -int(m.group(1)), -int(m.group(3) or 0), "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def partial_metadata(obj: Mapping[str, Any]) -> Obj:
    return {
        "apiVersion": META_GROUP_VERSION,
        "kind": "PartialObjectMetadata",
        "metadata": obj["metadata"],
    }


def _metadata_mode(accept: str) -> str:
    """'' (full objects), 'object' (as=PartialObjectMetadata) or 'list' (...List)."""
    for media in accept.split(","):
        params = dict(
            p.strip().split("=", 1) for p in media.split(";")[1:] if "=" in p
        )
        as_ = params.get("as", "")
        if as_ and params.get("g") == "meta.k8s.io":
            return "list" if as_ == "PartialObjectMetadataList" else "object"
    return ""


class KubeSim:
    """One simulated API server on 127.0.0.1.

    ``bookmark_interval`` and ``max_watch_seconds`` are short by default so tests see
    bookmarks and server-side watch ends within seconds (a real server: ~1 min and
    5-10 min).
    """

    def __init__(
        self,
        resources: Iterable[ResourceType] = CORE_TYPES,
        *,
        port: int | None = None,
        token: str = "kubesim-token",
        bookmark_interval: float = 1.0,
        max_watch_seconds: float = 300.0,
        max_log: int = 200_000,
        ssl_context: ssl.SSLContext | None = None,
        kube_system_uid: str = "",
    ) -> None:
        #: the uid of the ``kube-system`` Namespace every cluster has (a fresh one unless
        #: given): the cluster's identity, which the proxy's fact writer reads
        #: (proxy/kube/cluster_identity.py). Served as a real server does, a Namespace
        #: (``NAMESPACE``, registered if ``resources`` leave it out); ``delete`` it or
        #: ``fail_resource(NAMESPACE, 403)`` for a cluster that does not answer it
        self.kube_system_uid = kube_system_uid or str(uuid.uuid4())
        self.store = Store(max_log=max_log)
        for rt in (*resources, NAMESPACE):
            self.store.register(rt)
        self._seed_kube_system()
        self.port = port or free_port()
        self.token = token
        #: serve HTTPS with this context (one that requires client certificates tests a
        #: kubeconfig authenticating with one); read at each ``start``
        self.ssl_context = ssl_context
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        #: answer every API request with this status while set (e.g. 503: an outage
        #: where the server is up but failing)
        self.fail_status: int | None = None
        #: (group, plural) -> the versions it is served at besides its own (see
        #: ``serve_versions``)
        self.also_served: dict[tuple[str, str], tuple[str, ...]] = {}
        #: (group, plural, namespace or "") -> (status, Accept substring or ""): requests
        #: for that resource (list, watch, get; with that substring in their Accept header,
        #: if given; within that namespace, if given) are answered with the status, while
        #: discovery still lists it (see ``fail_resource``)
        self.failing_resources: dict[tuple[str, str, str], tuple[int, str, bool, int]] = {}
        #: the keys of ``failing_resources`` answered with a text/plain body (see
        #: ``fail_resource``)
        self.plain_failures: set[tuple[str, str, str]] = set()
        #: the keys of ``failing_resources`` that fail lists and watches only: a GET of
        #: one object is served (see ``fail_resource``)
        self.collections_failing: set[tuple[str, str, str]] = set()
        #: (group, plural) -> (seconds, methods, continued): requests for that resource
        #: (of those methods, all when empty; only the pages of a list after its first
        #: with ``continued``) wait that long before they are handled (see
        #: ``delay_resource``)
        self.delayed_resources: dict[tuple[str, str],
                                     tuple[float, frozenset[str], bool]] = {}
        #: (group, plural) -> how the pages of its lists after the first are cut (see
        #: ``cut_lists``)
        self.cut_resources: dict[tuple[str, str], int | str] = {}
        #: group/version -> status: its discovery document is answered with the status
        #: (see ``fail_discovery``)
        self.failing_discovery: dict[str, int] = {}
        #: answer every new watch with a stream that ends at once, cleanly, with no
        #: event (a proxy in between cutting streams, a server shutting down)
        self.empty_watches = False
        #: answer every new watch with what it replays, one BOOKMARK and a clean end at
        #: once (an intermediary cutting streams after their first bytes)
        self.short_watches = False
        #: answer every new watch with ERROR 410 at once, whatever its resourceVersion (a
        #: watch cache behind the list that a load balancer sent to another API server)
        self.gone_watches = False
        #: whether a watch's bookmarks follow the whole store's version (True: etcd
        #: sends kube-apiserver's watch cache progress notifications often, 5 s as
        #: kubeadm, GKE and OpenShift set ``--experimental-watch-progress-notify-interval``)
        #: or only its own resource's changes (False: etcd's default, 10 min, as good as
        #: none). The watch cache sends a watch bookmarks only once its version passed the
        #: one the watch started from (``cacheWatcher.process``), so with False a watch of
        #: a kind that does not change gets no bookmark at all until one of its objects
        #: does: the list it started from is at the store's version, above the kind's own
        #: last change (see ``_watch``)
        self.progress_notify = True
        #: bodies to answer the next list requests with (200, JSON content type), one
        #: each: a server or a proxy in between that sends what is not a valid list
        self.garbled_lists: list[bytes] = []
        #: the RBAC every request is authorized against (``enforce_rbac``); None: all
        #: allowed
        self.authorizer: Authorizer | None = None
        #: the requests the authorizer refused (403 Forbidden), in order
        self.refused: list[Attributes] = []
        #: (method, path, query, accept) of recent requests, for assertions
        self.requests: collections.deque[tuple[str, str, dict[str, str], str]] = (
            collections.deque(maxlen=2000)
        )
        #: seconds a paged list's continue token lives (None: until ``compact`` or 32
        #: newer lists): kube-apiserver's tokens die with their resourceVersion, which
        #: etcd compacts every 5 minutes, so a list paged through for longer than that
        #: gets 410 Expired part-way (see ``_list``)
        self.list_token_ttl: float | None = None
        #: the continue tokens offered in 410 answers to expired ones (``_expired``):
        #: inconsistent lists, never to be asked by a client that needs a consistent one
        self.inconsistent_tokens: list[str] = []
        self._runner: web.AppRunner | None = None
        #: token id -> (resourceVersion, items, the loop time the list began)
        self._snapshots: collections.OrderedDict[str, tuple[int, list[Obj], float]] = (
            collections.OrderedDict()
        )
        self._snap_seq = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="kubesim-")

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port, reuse_address=True,
                           ssl_context=self.ssl_context)
        await site.start()
        self._runner = runner

    async def stop(self) -> None:
        """Go away (connection refused from now on); open watches break abruptly."""
        self.disconnect_watches()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def close(self) -> None:
        await self.stop()
        self._tmp.cleanup()

    async def __aenter__(self) -> KubeSim:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def write_kubeconfig(self, path: str | Path | None = None) -> Path:
        """A kubeconfig that points kubernetes-asyncio at this simulator."""
        target = Path(path) if path else Path(self._tmp.name) / "kubeconfig"
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kubesim", "cluster": {"server": self.url}}],
            "users": [{"name": "kubesim", "user": {"token": self.token}}],
            "contexts": [
                {"name": "kubesim", "context": {"cluster": "kubesim", "user": "kubesim"}}
            ],
            "current-context": "kubesim",
        }
        target.write_text(json.dumps(cfg))
        return target

    def _seed_kube_system(self) -> None:
        rs = self.store.resources[NAMESPACE.key]
        if ("", "kube-system") not in rs.objects:
            self.store.seed(rs, {"metadata": {"name": "kube-system",
                                              "uid": self.kube_system_uid},
                                 "spec": {"finalizers": ["kubernetes"]},
                                 "status": {"phase": "Active"}})

    # -- test control API ------------------------------------------------------------------

    def register(self, *rtypes: ResourceType) -> None:
        """Install CRDs at runtime: discovery lists them from now on."""
        for rt in rtypes:
            self.store.register(rt)

    def unregister(self, *rtypes: ResourceType, cascade: bool = False) -> None:
        """A CRD deleted: as kube-apiserver's CRD finalizer (``customresourcecleanup``)
        does, its objects are deleted first (a DELETED event each on the open watches;
        ``cascade``: their dependents too, the garbage collector's part, which a real
        cluster does a little later), then its open watches end cleanly and discovery no
        longer lists it (its paths answer 404)."""
        for rt in rtypes:
            rs = self.store.resources.get(rt.key)
            if rs is not None:
                for obj in list(rs.objects.values()):
                    md = obj["metadata"]
                    if (md.get("namespace", "") if rt.namespaced else "",
                            md["name"]) in rs.objects:
                        self.delete(obj, cascade=cascade)
                for feed in list(rs.feeds):
                    feed.flush(b"")  # after the DELETED events queued: a clean end
                rs.feeds.clear()  # ended so, not killed (aborted) below
            self.store.unregister(rt)
            self.also_served.pop(rt.key, None)

    def serve_version(self, rtype: ResourceType, version: str) -> None:
        """A CRD upgrade: ``rtype`` served at ``version`` only from now on (discovery says
        so, the old version's paths answer 404), its objects kept; its open watches end,
        as when the CRD's storage is rebuilt."""
        self.serve_versions(rtype, version)

    def serve_versions(self, rtype: ResourceType, *versions: str) -> None:
        """A CRD's served versions changed (``spec.versions[].served``): ``rtype`` served
        at each of ``versions`` from now on, one store whatever the version (discovery
        lists every one, the group's preferred version first by Kubernetes' version
        priority; a version no longer served answers 404), its objects kept. Its open
        watches end (of every version), as kube-apiserver rebuilds a CRD's storage when
        its spec changes. Objects are sent as stored: no conversion of ``apiVersion``."""
        rs = self.store.resources[rtype.key]
        rs.rtype = dataclasses.replace(rs.rtype, version=versions[0])
        self.also_served[rtype.key] = tuple(v for v in versions[1:] if v != versions[0])
        self.store.by_kind[(rtype.group, rtype.kind)] = rtype.key
        for feed in list(rs.feeds):
            feed.kill()

    def create(self, obj: Mapping[str, Any]) -> Obj:
        return copy.deepcopy(self.store.create(self.store.for_object(obj), obj))

    def update(self, obj: Mapping[str, Any]) -> Obj:
        """Replace; a stale ``metadata.resourceVersion`` raises ``Conflict`` (409)."""
        return copy.deepcopy(self.store.update(self.store.for_object(obj), obj))

    def get(self, api_version: str, kind: str, name: str, namespace: str = "") -> Obj:
        rs = self.store.for_object({"apiVersion": api_version, "kind": kind})
        key = (namespace if rs.rtype.namespaced else "", name)
        obj = rs.objects.get(key)
        if obj is None:
            raise NotFound(f'{rs.rtype.plural} "{name}" not found')
        return copy.deepcopy(obj)

    def delete(self, obj: Mapping[str, Any], *, cascade: bool = True) -> Obj:
        """Delete by apiVersion/kind/metadata.name(/namespace); ``cascade`` deletes the
        objects it owns too (the garbage collector's background propagation)."""
        rs = self.store.for_object(obj)
        md = obj["metadata"]
        gone = self.store.delete(rs, md.get("namespace", "default"), md["name"])
        if cascade:
            for dep_rs, dep in list(self.store.dependents(gone["metadata"]["uid"])):
                dmd = dep["metadata"]
                if (dmd.get("namespace", ""), dmd["name"]) in dep_rs.objects:
                    self.delete(dep, cascade=True)
        return gone

    def objects(self, rtype: ResourceType) -> list[Obj]:
        return list(self.store.resources[rtype.key].objects.values())

    def compact(self) -> None:
        """Drop the event log: watches from any older resourceVersion get 410 Gone."""
        self.store.compact()
        self._snapshots.clear()

    def reset_store(self, resource_version: int = 0, *, keep_watches: bool = False) -> None:
        """Replace the store by an empty one at ``resource_version`` (older than the
        current one, as a rule), the same kinds registered: an API server back on an
        etcd restored from a backup, or on a fresh one. A watch from one of the old
        store's newer resourceVersions is accepted and sent nothing (no event, no
        bookmark) until the new store passes that version, as kube-apiserver's watch
        cache does; a list from one is answered 504 "Too large resource version". Open
        watches are broken (the API server restarted), or with ``keep_watches`` moved
        to the new store (it was replaced under them): silent the same way."""
        old, self.store = self.store, Store(max_log=self.store.max_log)
        self.store.rv = resource_version
        for rt in old.types():
            self.store.register(rt)
        if NAMESPACE.key in self.store.resources:  # a restored etcd: the cluster's own
            self._seed_kube_system()
        self._snapshots.clear()
        for key, rs in old.resources.items():
            for feed in list(rs.feeds):
                if keep_watches:
                    rs.feeds.discard(feed)
                    self.store.resources[key].feeds.add(feed)
                else:
                    feed.kill()

    def disconnect_watches(self) -> int:
        """Break every open watch stream abruptly (no clean end of the chunked body)."""
        n = 0
        for rs in self.store.resources.values():
            for feed in list(rs.feeds):
                feed.kill()
                n += 1
        return n

    def drain_watches(self) -> int:
        """End every open watch stream cleanly now, with what it was sent, as at its
        timeout but early: an API server shutting down with
        ``--shutdown-watch-termination-grace-period`` (OpenShift sets 25 s, k0s its stop
        timeout) drains its watches so, the handler returning with the chunked
        terminator, in a rollout as in any restart (without, they are cut when it
        exits: ``disconnect_watches``). New watches are served (the next API server)."""
        n = 0
        for rs in self.store.resources.values():
            for feed in list(rs.feeds):
                if not feed.hung:
                    feed.flush(b"")
                    n += 1
        return n

    def hang_watches(self) -> int:
        """Make every open watch stream go silent without closing: no more events,
        bookmarks or end of stream, whatever timeoutSeconds said. The connection stays
        open until the client gives up (or ``disconnect_watches`` / ``stop``). New
        watches are served normally."""
        n = 0
        for rs in self.store.resources.values():
            for feed in list(rs.feeds):
                if not feed.hung:
                    feed.hang()
                    n += 1
        return n

    def enforce_rbac(self, objects: Iterable[Mapping[str, Any]] | None, *,
                     user: str = service_account_user(SERVICE_ACCOUNT_NAMESPACE,
                                                      SERVICE_ACCOUNT_NAME)) -> None:
        """Authorize every request from now on as kube-apiserver's RBAC authorizer does,
        for ``user`` (the token's identity), over the Role, ClusterRole, RoleBinding and
        ClusterRoleBinding objects among ``objects`` (a manifest's documents; other kinds
        are skipped) and the grants every cluster gives every authenticated user
        (discovery, ``/version``): a request they do not allow is answered 403 with the
        real Forbidden Status and kept in ``refused`` (tests/kubesim/rbac.py). None: allow
        everything again."""
        self.authorizer = None if objects is None else Authorizer(objects, user=user)

    def fail_resource(self, rtype: ResourceType, status: int | None, *,
                      accept: str = "", namespace: str | None = None,
                      watch_only: bool = False, retry_after: int = 0,
                      collections_only: bool = False, plain: bool = False) -> None:
        """Answer requests for one resource with ``status`` from now on (None: serve it
        again), only those whose Accept header contains ``accept`` if given, and only
        those within ``namespace`` if given (a namespace whose RoleBinding is missing),
        only its watches with ``watch_only`` (a Role granting get and list, not watch),
        with ``retry_after`` seconds asked for (the ``Retry-After`` header and the Status'
        ``details.retryAfterSeconds``, as kube-apiserver's 429 of API priority and
        fairness sends them), only its lists and watches with ``collections_only`` (a GET
        of one object served: a watch cut off while the store answers), with a text/plain
        body and no Status with ``plain`` (what kube-apiserver's API priority and fairness
        and max-in-flight filters answer a request they reject: ``http.Error`` with "Too
        many requests, please try again later.", the ``Retry-After`` header the only word
        of how long; a JSON Status 429 is a watch cache not ready yet);
        discovery still lists it, as on a real cluster: 403 is RBAC refusing the proxy's
        service account, 500 a failing conversion webhook or aggregated API."""
        key = (*rtype.key, namespace or "")
        self.collections_failing.discard(key)
        self.plain_failures.discard(key)
        if status is None:
            self.failing_resources.pop(key, None)
        else:
            self.failing_resources[key] = (status, accept, watch_only, retry_after)
            if collections_only:
                self.collections_failing.add(key)
            if plain:
                self.plain_failures.add(key)

    def delay_resource(self, rtype: ResourceType, seconds: float | None, *,
                       methods: Iterable[str] = (), continued: bool = False) -> None:
        """Make requests for one resource (only those of ``methods``, e.g. ``("PUT",)``, if
        given; only the pages of its lists after the first, asked with a ``continue``
        token, with ``continued``) wait ``seconds`` before they are handled from now on
        (None or 0: at once again): a slow API server or etcd, or a list of many objects
        that takes seconds page by page while the cluster changes (its pages stay those
        of its first page's resourceVersion, as kube-apiserver's). The wait comes before
        the request is applied, and a client that gives up meanwhile does not stop it: a
        write that timed out client-side is applied all the same, as on a real server."""
        if not seconds:
            self.delayed_resources.pop(rtype.key, None)
        else:
            self.delayed_resources[rtype.key] = (
                float(seconds), frozenset(m.upper() for m in methods), continued)

    def cut_lists(self, rtype: ResourceType, cut: int | str | None) -> None:
        """Cut ``rtype``'s lists part-way from now on (None: serve them whole again): the
        pages asked with a ``continue`` token (every page after the first) are answered
        with ``cut``: an HTTP status (a 5xx: etcd timing out under a page), ``"reset"``
        (the connection closed with no answer: an API server restarting between two
        pages), or ``"expire"`` (the list's snapshot dropped, so the page gets 410
        Expired, kube-apiserver's answer to a token whose resourceVersion was compacted:
        what ``compact`` does to a list under way, here to every one)."""
        if cut is None:
            self.cut_resources.pop(rtype.key, None)
        else:
            self.cut_resources[rtype.key] = cut

    def fail_discovery(self, group_version: str, status: int | None) -> None:
        """Answer the discovery document of one group/version (``ray.io/v1``) with
        ``status`` from now on (None: serve it again), the group list still naming it:
        an aggregated API or a CRD group whose discovery is unavailable (503)."""
        if status is None:
            self.failing_discovery.pop(group_version, None)
        else:
            self.failing_discovery[group_version] = status

    def hold_watches(self, rtype: ResourceType | None = None) -> int:
        """Make every open watch stream (of ``rtype`` only, if given) hold back what it
        would send (events and bookmarks) until ``flush_watches``: what happens meanwhile
        then reaches the client in one chunk. The changes are in the log as usual (a
        resumed watch replays them)."""
        n = 0
        stores = ([self.store.resources[rtype.key]] if rtype is not None
                  else self.store.resources.values())
        for rs in stores:
            for feed in list(rs.feeds):
                if not feed.holding and not feed.hung:
                    feed.hold()
                    n += 1
        return n

    def flush_watches(self, *, error: ApiError | None = None, raw: bytes = b"") -> int:
        """Every holding watch stream writes, in one write, the events it held back, then
        an ``ERROR`` event with ``error``'s Status (if given), then ``raw`` (e.g. a
        malformed line), and ends the stream cleanly: how a real API server ends a watch
        on an internal error (an etcd watch channel failing), events and all."""
        tail = (_line({"type": "ERROR", "object": error.status()}) if error else b"") + raw
        n = 0
        for rs in self.store.resources.values():
            for feed in list(rs.feeds):
                if feed.holding:
                    feed.flush(tail)
                    n += 1
        return n

    def watch_count(self, rtype: ResourceType | None = None) -> int:
        stores = (
            [self.store.resources[rtype.key]] if rtype else list(self.store.resources.values())
        )
        return sum(len(rs.feeds) for rs in stores if rs is not None)

    @property
    def resource_version(self) -> int:
        return self.store.rv

    # -- HTTP ------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/")
        query = dict(request.query)
        accept = request.headers.get("Accept", "")
        self.requests.append((request.method, path, query, accept))
        try:
            if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            if self.authorizer is not None:
                attrs = request_attributes(request.method, request.path, query)
                if not self.authorizer.allows(attrs):
                    self.refused.append(attrs)
                    raise self.authorizer.forbidden(attrs)
            if self.fail_status is not None:
                raise ApiError(self.fail_status, "ServiceUnavailable", "simulated failure")
            if path == "/version":
                return web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
            if path in ("/api", "/apis") or path.startswith(("/api/", "/apis/")):
                return await self._api(request, path, query, accept)
            raise NotFound(f"no route {path}")
        except ApiError as e:
            after = (e.details or {}).get("retryAfterSeconds")
            headers = {"Retry-After": str(after)} if after else None
            if isinstance(e, PlainError):
                return web.Response(text=e.message + "\n", status=e.code, headers=headers)
            return web.json_response(e.status(), status=e.code, headers=headers)

    def _group_versions(self) -> dict[str, list[ResourceType]]:
        out: dict[str, list[ResourceType]] = collections.defaultdict(list)
        for rt in self.store.types():
            out[rt.api_version].append(rt)
            for version in self.also_served.get(rt.key, ()):
                also = dataclasses.replace(rt, version=version)
                out[also.api_version].append(also)
        return out

    async def _api(
        self, request: web.Request, path: str, query: dict[str, str], accept: str
    ) -> web.StreamResponse:
        parts = path.split("/")[1:]
        gvs = self._group_versions()
        if parts == ["api"]:
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if parts == ["apis"]:
            # one entry per group, its versions by priority (the preferred one first), as
            # kube-apiserver lists them: one entry per group/version was two groups of
            # one name, and a client kept only the last
            by_group: dict[str, list[str]] = collections.defaultdict(list)
            for gv in gvs:
                if "/" in gv:
                    group, version = gv.split("/")
                    by_group[group].append(version)
            groups = []
            for group in sorted(by_group):
                entries = [{"groupVersion": f"{group}/{v}", "version": v}
                           for v in sorted(by_group[group], key=version_priority)]
                groups.append({"name": group, "versions": entries,
                               "preferredVersion": entries[0]})
            return web.json_response({"kind": "APIGroupList", "apiVersion": "v1",
                                      "groups": groups})
        if parts[0] == "api":
            gv, rest = (parts[1] if len(parts) > 1 else ""), parts[2:]
        else:
            if len(parts) == 2:
                group = parts[1]
                versions = sorted((gv.split("/")[1] for gv in gvs
                                   if gv.startswith(group + "/")), key=version_priority)
                if not versions:
                    raise NotFound(f"group {group} not served")
                entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
                return web.json_response({"kind": "APIGroup", "apiVersion": "v1",
                                          "name": group, "versions": entries,
                                          "preferredVersion": entries[0]})
            gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        if gv not in gvs:
            raise NotFound(f"the server could not find the requested resource ({gv})")
        if not rest and gv in self.failing_discovery:
            raise ApiError(self.failing_discovery[gv], "ServiceUnavailable",
                           "the server is currently unable to handle the request")
        if not rest:
            return web.json_response({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                "resources": [rt.discovery_entry() for rt in gvs[gv]],
            })
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        plural, name = rest[0], (rest[1] if len(rest) > 1 else "")
        rtype = next((rt for rt in gvs[gv] if rt.plural == plural), None)
        if rtype is None:
            raise NotFound(f"the server could not find the requested resource ({plural})")
        fkey = (*rtype.key, namespace or "")
        failing = (self.failing_resources.get(fkey)
                   if namespace is not None else None)
        if failing is None:
            fkey = (*rtype.key, "")
            failing = self.failing_resources.get(fkey)
        one = len(rest) > 1  # a request for one object, not a list or watch
        if failing is not None and failing[1] in accept and (
                not failing[2] or request.query.get("watch") in ("1", "true")) and not (
                one and fkey in self.collections_failing):
            raise _failure(failing[0], request_attributes(request.method, path, query),
                           failing[3], plain=fkey in self.plain_failures)
        cut = self.cut_resources.get(rtype.key)
        if cut is not None and "continue" in query and not one:
            if cut == "reset":
                if request.transport is not None:
                    request.transport.abort()
                return web.Response()  # never sent: the connection is gone
            if cut == "expire":
                self._snapshots.clear()
            elif isinstance(cut, int):
                raise _failure(cut, request_attributes(request.method, path, query))
        delayed = self.delayed_resources.get(rtype.key)
        if delayed is not None and (not delayed[1] or request.method in delayed[1]) and (
                not delayed[2] or "continue" in query):
            await request.read()  # the body is in (kept for .json()) before the client leaves
            await asyncio.sleep(delayed[0])
        rs = self.store.resources[rtype.key]
        if namespace is not None and not rtype.namespaced:
            raise NotFound(f"{plural} is not namespaced")
        method = request.method
        if not name:
            if method == "GET":
                flt = Filter(
                    namespace=namespace,
                    labels=parse_label_selector(query["labelSelector"])
                    if query.get("labelSelector") else None,
                    fields=parse_field_selector(query["fieldSelector"])
                    if query.get("fieldSelector") else None,
                )
                mode = _metadata_mode(accept)
                if _parse_bool(query.get("watch", "")):
                    return await self._watch(request, rs, flt, mode, query)
                return self._list(rs, flt, mode, query)
            if method == "POST":
                body = await request.json()
                if rtype.namespaced:
                    body.setdefault("metadata", {})["namespace"] = namespace or "default"
                body["apiVersion"], body["kind"] = rtype.api_version, rtype.kind
                return web.json_response(self.store.create(rs, body), status=201)
            raise ApiError(405, "MethodNotAllowed", f"{method} not allowed on a collection")
        key = ((namespace or "") if rtype.namespaced else "", name)
        if method == "GET":
            obj = rs.objects.get(key)
            if obj is None:
                raise NotFound(f'{plural}.{rtype.group} "{name}" not found')
            if _metadata_mode(accept):
                return web.json_response(partial_metadata(obj))
            return web.json_response(obj)
        if method == "PUT":
            body = await request.json()
            md = body.setdefault("metadata", {})
            md["name"] = name
            if rtype.namespaced:
                md["namespace"] = namespace or "default"
            return web.json_response(self.store.update(rs, body))
        if method == "PATCH":
            patch = await request.json()
            current = rs.objects.get(key)
            if current is None:
                raise NotFound(f'{plural}.{rtype.group} "{name}" not found')
            merged = _merge_patch(copy.deepcopy(current), patch)
            return web.json_response(self.store.update(rs, merged))
        if method == "DELETE":
            obj = rs.objects.get(key)
            if obj is None:
                raise NotFound(f'{plural}.{rtype.group} "{name}" not found')
            return web.json_response(self.delete(obj))
        raise ApiError(405, "MethodNotAllowed", f"{method} not allowed")

    # -- list ------------------------------------------------------------------------------

    def _list(
        self, rs: ResourceStore, flt: Filter, mode: str, query: dict[str, str]
    ) -> web.Response:
        if self.garbled_lists:
            return web.Response(body=self.garbled_lists.pop(0), content_type="application/json")
        rt = rs.rtype
        limit = int(query.get("limit") or 0)
        token = query.get("continue", "")
        state: Obj = {}
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                snap_id, offset = state["id"], int(state["offset"])
            except (ValueError, KeyError) as e:
                raise ApiError(400, "BadRequest", f"invalid continue token: {e}") from e
        if state.get("after"):  # an inconsistent token: the rest at the store's version
            rv, items = self.store.rv, [o for o in _current(rs, flt)
                                        if _key(o) > list(state["after"])]
            offset, snap_id, began = 0, "", asyncio.get_running_loop().time()
        elif token:
            snap = self._snapshots.get(snap_id)
            now = asyncio.get_running_loop().time()
            if snap is not None and self.list_token_ttl is not None and (
                    now - snap[2] > self.list_token_ttl):
                del self._snapshots[snap_id]  # its version compacted away
                snap = None
            if snap is None:
                raise self._expired(state.get("key"))
            rv, items, began = snap
        else:
            rv = self.store.rv
            asked = query.get("resourceVersion", "")
            if asked.isascii() and asked.isdigit() and int(asked) > rv:
                # kube-apiserver waits up to 3 s for its cache to reach the version,
                # then answers this (a watch from such a version is accepted instead)
                raise TooLargeResourceVersion(int(asked), rv)
            items = _current(rs, flt)
            offset = 0
            snap_id = ""
            began = asyncio.get_running_loop().time()
        page = items[offset: offset + limit] if limit else items[offset:]
        next_token = ""
        remaining = len(items) - offset - len(page)
        if remaining > 0:
            if not snap_id:
                self._snap_seq += 1
                snap_id = str(self._snap_seq)
                self._snapshots[snap_id] = (rv, items, began)
                while len(self._snapshots) > 32:
                    self._snapshots.popitem(last=False)
            next_token = _token({"id": snap_id, "offset": offset + len(page),
                                 "key": _key(page[-1])})
        if mode:
            out_items = [partial_metadata(o) for o in page]
            body: Obj = {"kind": "PartialObjectMetadataList", "apiVersion": META_GROUP_VERSION}
        else:
            if rt.builtin:  # typed lists: items carry no apiVersion/kind
                out_items = [
                    {k: v for k, v in o.items() if k not in ("apiVersion", "kind")}
                    for o in page
                ]
            else:
                out_items = page
            body = {"kind": rt.list_kind, "apiVersion": rt.api_version}
        body["metadata"] = {"resourceVersion": str(rv)}
        if next_token:
            body["metadata"]["continue"] = next_token
            body["metadata"]["remainingItemCount"] = remaining
        body["items"] = out_items
        return web.Response(body=json.dumps(body, separators=(",", ":")).encode(),
                            content_type="application/json")

    def _expired(self, key: list[str] | None) -> ApiError:
        """kube-apiserver's answer to a continue token whose resourceVersion etcd
        compacted (``handleCompactedErrorForPaging``): 410 Expired, with a continue token
        in the Status' list metadata that lists the rest from the key the dead token was
        at, at the store's version now: an inconsistent list, which a client needing a
        consistent one must not use. The tokens offered so are kept in
        ``inconsistent_tokens``."""
        if not key:
            return ApiError(410, "Expired", "The provided continue parameter is too old "
                            "to display a consistent list result. You can start a new "
                            "list without the continue parameter.")
        fresh = _token({"id": "", "offset": 0, "after": key})
        self.inconsistent_tokens.append(fresh)
        return ExpiredContinue(fresh)

    # -- watch -----------------------------------------------------------------------------

    async def _watch(
        self,
        request: web.Request,
        rs: ResourceStore,
        flt: Filter,
        mode: str,
        query: dict[str, str],
    ) -> web.StreamResponse:
        rt = rs.rtype
        timeout = self.max_watch_seconds
        if query.get("timeoutSeconds"):
            timeout = min(timeout, float(query["timeoutSeconds"]))
        bookmarks = _parse_bool(query.get("allowWatchBookmarks", ""))
        rv_param = query.get("resourceVersion", "")
        # as kube-apiserver's watch cache (cacheWatcher.process): a watch from a
        # resourceVersion is sent only what is newer, whatever the store's own version.
        # One from a version the store has not reached (an etcd restored from a backup
        # under it) is accepted, not answered 504, and stays silent, bookmarks included,
        # until the store passes that version
        start = int(rv_param) if rv_param.isascii() and rv_param.isdigit() else 0
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        feed = WatchFeed(rt)
        # register and snapshot in one tick: nothing is missed, nothing duplicated
        rs.feeds.add(feed)
        initial: list[tuple[str, Obj]] = []
        gone: ApiError | None = None
        if rv_param in ("", "0"):
            initial = [("ADDED", o) for o in rs.objects.values() if flt(o)]
        else:
            try:
                initial = [x for ev in rs.since(int(rv_param)) if (x := _translate(ev, flt))]
            except ApiError as e:
                gone = e
        try:
            await resp.prepare(request)
            if mode == "list" or self.empty_watches:
                # a real server ends such a stream with no events
                await resp.write_eof()
                return resp
            if gone is None and self.gone_watches:
                gone = ApiError(410, "Expired", "too old resource version (gone_watches)")
            if gone is not None:
                await resp.write(_line({"type": "ERROR", "object": gone.status()}))
                await resp.write_eof()
                return resp
            for etype, obj in initial:
                await resp.write(_line({"type": etype,
                                        "object": partial_metadata(obj) if mode else obj}))
            if self.short_watches:
                await resp.write(_bookmark(rt, mode, self.store.rv))
                await resp.write_eof()
                return resp
            held: list[bytes] = []  # lines kept back while the feed is holding
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            # only a line this watch is sent puts the next bookmark off: an event its
            # filter drops did, and a watch of a quiet namespace got no bookmark while
            # the others churned
            next_bookmark = loop.time() + self.bookmark_interval
            while True:
                if feed.hung:
                    # silent from now on, whatever the deadline: swallow events until
                    # killed (the client may have gone; nobody reads this connection)
                    while not feed.killed and await feed.queue.get() is not None:
                        pass
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                now = loop.time()
                remaining = deadline - now
                if remaining <= 0:
                    break
                wait = (min(remaining, max(0.0, next_bookmark - now)) if bookmarks
                        else remaining)
                try:
                    if feed.queue.empty():
                        ev = await asyncio.wait_for(feed.queue.get(), wait)
                    else:
                        ev = feed.queue.get_nowait()
                except TimeoutError:
                    if feed.hung or feed.holding:
                        next_bookmark = loop.time() + self.bookmark_interval
                        continue
                    # the watch cache's version: the store's with progress
                    # notifications (etcd's revision moves on with leases and events
                    # however quiet the watched kind; this store's does not, hence a
                    # bookmark at the watch's own start version too: a quiet watch gets
                    # its bookmarks, a restored store's watch none); without, its own
                    # kind's last change, and a bookmark only once that is newer than
                    # the watch's start, as kube-apiserver sends them
                    cache = self.store.resources.get(rt.key, rs)  # reset_store's too
                    known = self.store.rv if self.progress_notify else cache.last_rv
                    if bookmarks and feed.queue.empty() and loop.time() >= next_bookmark:
                        if known > start or (self.progress_notify and known == start):
                            await resp.write(_bookmark(rt, mode, known))
                        next_bookmark = loop.time() + self.bookmark_interval
                    continue
                if ev is None or feed.killed:
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if feed.hung:
                    continue
                if isinstance(ev, bytes):  # flush: what was held back, the tail, the end
                    await resp.write(b"".join(held) + ev)
                    break
                out = _translate(ev, flt) if ev.rv > start else None
                if out is not None:
                    line = _line({"type": out[0],
                                  "object": partial_metadata(out[1]) if mode else out[1]})
                    if feed.holding:
                        held.append(line)
                    else:
                        await resp.write(line)
                        next_bookmark = loop.time() + self.bookmark_interval
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            # the client went away (a watch it gave up as idle) and the stream's end
            # found the connection closing: nothing to answer, and nothing to log (aiohttp
            # logged each as "Error handling request")
            return resp
        finally:
            rs.feeds.discard(feed)


class ExpiredContinue(ApiError):
    """410 Expired for a compacted continue token, with an inconsistent one to go on."""

    def __init__(self, token: str) -> None:
        super().__init__(
            410, "Expired", "The provided continue parameter is too old to display a "
            "consistent list result. You can start a new list without the continue "
            "parameter, or use the continue token in this response to retrieve the "
            "remainder of the results. Continuing with the provided token results in an "
            "inconsistent list - objects that were created, modified, or deleted between "
            "the time the first chunk was returned and now may show up in the list.")
        self.token = token

    def status(self) -> Obj:
        out = super().status()
        out["metadata"] = {"continue": self.token}
        return out


def _current(rs: ResourceStore, flt: Filter) -> list[Obj]:
    """The objects a list selects now, in key order (namespace, name), as etcd's."""
    return sorted((o for o in rs.objects.values() if flt(o)), key=_key)


def _key(obj: Mapping[str, Any]) -> list[str]:
    md = obj["metadata"]
    return [md.get("namespace", ""), md["name"]]


def _token(state: Obj) -> str:
    return base64.urlsafe_b64encode(json.dumps(state).encode()).decode()


class PlainError(ApiError):
    """An error answered with a text/plain body, no Status (``details`` only for the
    ``Retry-After`` header)."""


def _failure(status: int, attrs: Attributes, retry_after: int = 0, *,
             plain: bool = False) -> ApiError:
    """What a real API server answers for a resource it refuses or fails on (a 403 as
    its RBAC authorizer refuses the shipped service account)."""
    if plain:
        return PlainError(status, "", "Too many requests, please try again later."
                          if status == 429 else "simulated failure",
                          {"retryAfterSeconds": retry_after} if retry_after else None)
    if retry_after:
        return ApiError(status, "TooManyRequests" if status == 429 else "ServiceUnavailable",
                        "the server has received too many requests and has asked us to "
                        "try again later", details={"retryAfterSeconds": retry_after})
    resource = f"{attrs.resource}.{attrs.api_group}" if attrs.api_group else attrs.resource
    if status == 403:
        return forbidden(attrs, service_account_user(SERVICE_ACCOUNT_NAMESPACE,
                                                     SERVICE_ACCOUNT_NAME))
    if status == 404:
        return NotFound("the server could not find the requested resource")
    return ApiError(status, "InternalError", f"simulated failure of {resource}")


def _parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool, as the API server reads query flags."""
    return text in ("1", "t", "T", "TRUE", "true", "True")


def _line(obj: Obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _bookmark(rt: ResourceType, mode: str, rv: int) -> bytes:
    """A BOOKMARK line as kube-apiserver writes it: an empty object of the watched kind
    at ``rv``. A typed one (a built-in kind, PartialObjectMetadata) is its Go zero value
    encoded, ``creationTimestamp: null`` in its metadata (a Pod's adds an empty spec and
    status, left out here); a CRD's unstructured one has the version alone."""
    md: Obj = {"resourceVersion": str(rv)}
    if mode or rt.builtin:
        md["creationTimestamp"] = None
    kind, api_version = (("PartialObjectMetadata", META_GROUP_VERSION) if mode
                         else (rt.kind, rt.api_version))
    return _line({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                                                  "metadata": md}})


def _translate(ev: Event, flt: Filter) -> tuple[str, Obj] | None:
    """The event a filtered watch sees: an object moving into the selection is ADDED,
    one moving out is DELETED, with its content before the change (the last the watch
    was allowed to see) at the change's resourceVersion, as kube-apiserver's watch cache
    sends it (``cacheWatcher.convertToWatchEvent``)."""
    new_in = flt(ev.obj)
    if ev.type == "MODIFIED":
        old_in = flt(ev.old)
        if new_in:
            return ("MODIFIED" if old_in else "ADDED", ev.obj)
        if not old_in or ev.old is None:
            return None
        last = dict(ev.old, metadata={**ev.old["metadata"], "resourceVersion": str(ev.rv)})
        return ("DELETED", last)
    return (ev.type, ev.obj) if new_in else None


def _merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge_patch(target.get(k), v)
    return target

