"""One list+watch loop for one resource (optionally one namespace, one field selector).

The loop: list (paginated) -> watch from the list's resourceVersion with bookmarks ->
on a clean end (server timeout) watch again from the last resourceVersion seen; on 410
Gone, and when the server's store went back, relist and find deletions by diffing
against what this watcher holds; on a broken stream resume quietly; on refused
connections, connections closed before any answer and 5xx back off (exponential, full
jitter), unhealthy, and resume; a stream that stays silent (no event, no
bookmark) for ``idle_timeout`` is taken for dead and resumed, unless a one-item list
shows the store's resourceVersion below the held one: kube-apiserver keeps a watch from
a version its store has not reached open and silent, so that is how a store gone back
(an etcd restored without ``--bump-revision``) shows; so does the first watch resumed
after a failure, and a list answered below the held version. A 504 "Too large resource
version" or an event or bookmark older than the last seen (what other servers may send)
is relisted too. A watcher that sees the store go back has the sink tell every other
watcher of the API server to relist (``relist_history``): one whose version the restored
store had passed never sees it on its own. Events are handed to a
sink in slices sized to a time budget, with a yield to the event loop after each slice,
so a burst never stalls request handling however costly each event is.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol, TypedDict, Unpack

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, Counter

from proxy.kube.client import (
    ACCEPT_JSON,
    ACCEPT_METADATA_LIST,
    ACCEPT_METADATA_WATCH,
    KubeApiError,
    KubeClient,
)
from proxy.kube.discovery import ApiResource
from proxy.tasks import cancel_and_wait
from proxy.yielding import Slices

log = logging.getLogger(__name__)

Obj = dict[str, Any]
#: (type, object) with type ADDED / MODIFIED / DELETED; objects carry apiVersion and kind
WatchEvent = tuple[str, Obj]


class Watcher(Protocol):
    """What the source needs of one list+watch loop: ``ResourceWatcher``, or a fake at
    this seam, so the source's reconcile logic is testable without a server or timing."""

    resource: ApiResource
    metadata_only: bool
    #: the one namespace watched, or None: cluster-wide (or a cluster-scoped kind)
    namespace: str | None
    #: ``namespace/plural.group``: the freshness and health key
    name: str
    #: uid -> "namespace/name" of every object delivered and not yet retracted
    held: dict[str, str]
    #: set once the first list was delivered (or the kind turned out unserved)
    synced: asyncio.Event
    #: the last failure to list or watch ("" for none yet): what the source names when
    #: a kind that keeps failing stops holding readiness back
    last_error: str
    #: how the last failure failed, as a key ("unreachable", "API error 503", "" for
    #: none yet): the source logs one outage per way of failing, so that one kind
    #: failing for good does not hide the API server going away later
    last_error_kind: str
    #: the API server's store went back (this watcher saw it, or another watcher of the
    #: same server did) and this watcher's list of the new store has not gone through
    #: yet: a finding of it meanwhile is of the same restore, not a new one
    history_pending: bool

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def retry_now(self) -> None:
        """Cut a backoff wait after failures short: the API server answers again."""

    def relist_history(self) -> None:
        """Another watcher of the same API server saw its store go back (an etcd
        restored from a backup): relist now, as after seeing it oneself, whatever this
        watcher was doing (a watch, a list, a backoff). A watcher whose resourceVersion
        the restored store had already passed never sees it on its own."""

    def stub(self, uid: str) -> Obj: ...

    async def deliver(self, events: list[WatchEvent]) -> None: ...


class WatchScope(TypedDict, total=False):
    """What a watcher is told of its watch besides its resource and sink (``WatchBase``
    says what a key left out means)."""

    #: metadata-only objects (owners on pod chains) or whole ones (described kinds)
    metadata_only: bool
    #: one namespace, or None: cluster-wide (always None for a cluster-scoped kind)
    namespace: str | None
    #: e.g. ``spec.nodeName=n1`` in node mode; "" for none
    field_selector: str
    #: uid -> "namespace/name" the watch starts out holding (a mode switch hands it on)
    held: dict[str, str]
    #: a retry of a kind the server refused: see a watch open (after a one-item list)
    #: before the full list, so that RBAC granting list and not watch costs no full
    #: relist, no objects put back and retracted again, no "served now" (``_probe``)
    probe: bool


class WatcherFactory(Protocol):
    """Builds the watchers of a ``KubeSource`` (in the spirit of the OpenTelemetry
    k8sattributes processor's ``InformerProvider``): the seam where tests put a fake."""

    def __call__(self, resource: ApiResource, sink: WatchSink,
                 **scope: Unpack[WatchScope]) -> Watcher: ...


def deletion_stub(resource: ApiResource, uid: str, key: str) -> Obj:
    """A deletion object (apiVersion, kind, metadata) for a held uid whose held key is
    ``namespace/name``: all the engine needs to retract it."""
    ns, _, name = key.rpartition("/")
    md: Obj = {"name": name, "uid": uid}
    if ns:
        md["namespace"] = ns
    return {"apiVersion": resource.api_version, "kind": resource.kind, "metadata": md}


class WatchBase:
    """What every watcher holds, whatever feeds it (the API server, or a fake cluster):
    the data of the ``Watcher`` Protocol, and deletion stubs of what it holds. Left out
    of the scope: whole objects, cluster-wide, no field selector, nothing held yet."""

    def __init__(self, resource: ApiResource, sink: WatchSink,
                 **scope: Unpack[WatchScope]) -> None:
        self.resource = resource
        self.sink = sink
        self.metadata_only = scope.get("metadata_only", False)
        self.namespace = scope.get("namespace") if resource.namespaced else None
        self.field_selector = scope.get("field_selector", "")
        #: ``namespace/plural.group`` (``plural.group`` cluster-wide): the freshness,
        #: health and metric key
        self.name = f"{self.namespace}/{resource.name}" if self.namespace else resource.name
        #: uid -> "namespace/name" of every object this watcher delivered: the relist
        #: diff finds deletions here, and stopping the watcher can retract them. Plain
        #: strings, not tuples: a dict of atomic values stays untracked by the cyclic GC;
        #: with tuples the GC untracks it in a full collection and the next insertion
        #: puts all 100k entries back into the young generation (a 10 ms collection).
        held = scope.get("held")
        self.held: dict[str, str] = held if held is not None else {}
        #: set once the first list was delivered (or the kind turned out unserved)
        self.synced = asyncio.Event()
        #: the last failure to list or watch, for the source's warning ("" for none)
        self.last_error = ""
        #: its kind ("unreachable", "API error <status>"): the source's outage key
        self.last_error_kind = ""
        #: see a watch open before the next full list (``ResourceWatcher._probe``): a
        #: retry of a kind refused, or of this watcher refused (``Refusal.OUTAGE``)
        self.probe = scope.get("probe", False)
        #: the store went back since this watcher's last list (``Watcher``)
        self.history_pending = False

    def stub(self, uid: str) -> Obj:
        """A deletion object for a held uid (apiVersion, kind, metadata)."""
        return deletion_stub(self.resource, uid, self.held.get(uid, ""))

    def retry_now(self) -> None:
        """Nothing to cut short here (a watcher that never waits out a backoff)."""


class Refusal(enum.Enum):
    """What a watcher does once the server refused its list or watch (403 / 404), as
    the sink's ``unserved`` answers."""

    #: the kind is unserved: the source drops the watcher (retracting what it held);
    #: until then it retries after its backoff cap
    DROP = "drop"
    #: it stays and retries on its own after its backoff cap, what it held retracted
    #: (one namespace refused while the kind's others are watched)
    RETRACT = "retract"
    #: an outage (pods, which cannot be done without): it stays, keeps what it held and
    #: fails as if unreachable (unhealthy: the index stale) until a watch opens again
    #: (its retries probe, ``ResourceWatcher._probe``, before they list); retried after
    #: its backoff cap
    OUTAGE = "outage"


#: the way of failing (``last_error_kind``) of a refusal taken for an outage, by status
REFUSED = {403: "forbidden (RBAC)", 404: "not found (404)"}


class WatchSink(Protocol):
    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None: ...

    def current(self, watcher: Watcher) -> None:
        """The watcher is known current now (list done, event or bookmark seen)."""

    def relisted(self, watcher: Watcher) -> None:
        """A list after the watcher's first went through (a 410, a restore, an outage's
        end): what its pages and their decoding freed is the heap's to hand back."""

    def health(self, watcher: Watcher, healthy: bool) -> None:
        """Reaching the API server failed (False) or works again (True)."""

    def answered(self, watcher: Watcher) -> None:
        """The first page of a list came back while the watcher was unhealthy: the API
        server answers again, so the others failing may retry now. Health itself waits
        for the list to go through whole, which at 37.5k pods is seconds later."""

    def unserved(self, watcher: Watcher, error: KubeApiError) -> Refusal:
        """The server answers 404 / 403 for this resource: report, do not retry hard.
        Returns what the watcher does (``Refusal``): dropped with its kind, staying with
        what it held retracted (one namespace refused while the kind's others are
        watched), or staying with what it held kept, failing (pods refused)."""

    def fetched_after(self, watcher: Watcher, uid: str, version: str) -> bool:
        """A copy of ``uid`` was fetched by one GET (``proxy.kube.owner_fetch``) at a
        resourceVersion newer than ``version``: a list at ``version`` that does not
        find it is older than the copy, not proof that it is gone."""

    def new_history(self, watcher: Watcher) -> bool:
        """``watcher`` saw the API server's store go back (an etcd restored from a
        backup): the versions of copies fetched before say nothing of the objects of the
        new one, and every other watcher of the server relists (``relist_history``).
        Returns whether the watcher warns of it: False when ``watcher`` was already told
        to relist for one (``history_pending``), or the sink logs a line of its own;
        the watcher's finding is then logged at debug level: one warning per restore,
        not one per watcher."""


class WatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "karta_proxy_watch_events_total",
            "Watch events received, by resource and type (ADDED, MODIFIED, DELETED, "
            "BOOKMARK, ERROR, and RELIST_DELETED for deletions found by a relist diff).",
            ["resource", "type"],
            registry=registry,
        )
        self.restarts = Counter(
            "karta_proxy_watch_restarts_total",
            "Watch restarts by resource and reason (timeout: the server ended the "
            "stream; empty: it ended early with no event; short: it ended early after "
            "some; gone: 410 or the server's store gone back, relisted; restored: "
            "relisted because another watch of the API server saw its store go back; "
            "idle; disconnect: an answered stream broke; unreachable: no answer, the "
            "connection refused or closed first; error; unserved).",
            ["resource", "reason"],
            registry=registry,
        )

    def forget(self, resource: str) -> None:
        """Remove ``resource``'s children, when its kind is no longer watched: each one
        stayed for the life of the process, so every CRD kind ever described and
        dropped kept one child per event type and restart reason (20 kinds dropped:
        +41 series). A kind watched again starts from 0, a counter reset to a query."""
        for counter, label in ((self.events, "type"), (self.restarts, "reason")):
            made = {s.labels[label] for family in counter.collect() for s in family.samples
                    if s.labels.get("resource") == resource}
            for value in made:
                with contextlib.suppress(KeyError):  # removed by another namespace's drop
                    counter.remove(resource, value)


#: work (JSON decoding + engine + index) between two yields to the event loop. Also
#: during the initial sync: larger slices there starve the reads of the next list page
#: (aiohttp reads it between slices) and made the sync slower, not faster.
SLICE_BUDGET = 0.004
MAX_SLICE = 4096
#: a list page's bytes, about: the API server pages by count, and a page is read and
#: decoded on the event loop in one piece. 500 pods of ~4 KB are 2 MB; 500 Argo
#: Workflows of 1.7 MB were one answer of 331 MB for 200 of them (0.75-0.9 s of the
#: loop, and its bytes in memory at once). The next page's ``limit`` comes from the
#: last page's bytes per item
PAGE_BYTES = 8 << 20
#: the first page's ``limit`` while a watcher has not seen a page of its kind: small
#: enough for the heaviest objects (50 of 1.5 MB), one round trip more for the others
FIRST_PAGE = 50
#: no byte (event or bookmark) for this long on an open watch -> taken for dead. A real
#: API server sends a bookmark about every minute to watches that ask for them, and
#: ends every watch after ``timeoutSeconds``; a half-open TCP connection sends nothing.
IDLE_TIMEOUT = 150.0
#: the longest one page of a list may take (asked, answered and read): a page that
#: never comes is the API server unreachable, and the list starts again after a backoff
PAGE_TIMEOUT = 60.0
#: the longest a server's Retry-After (429 / 503 to a list or watch) is waited out
RETRY_AFTER_MAX = 60.0


class _ListMeta(msgspec.Struct, gc=False):
    resourceVersion: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class _ListPage(msgspec.Struct):
    """A list answer with its items left as raw JSON: an item is decoded only when its
    resourceVersion says it is not what this watcher already delivered."""

    metadata: _ListMeta | None = None
    items: list[msgspec.Raw] | None = None


class _ItemMeta(msgspec.Struct, gc=False):
    uid: str = ""
    resourceVersion: str = ""


class _ItemHead(msgspec.Struct, gc=False):
    """What a relist needs of an item to skip it: the rest (managedFields and all) is
    scanned over, not built into objects. Not tracked by the cyclic collector (strings
    only): one per item would only bring the next young collection nearer."""

    metadata: _ItemMeta | None = None


#: the way of failing (``last_error_kind``) of a list or watch answered with what is not
#: a list or watch event: an API server's bug, or a proxy in front of it answering a
#: login page or cutting a body
MALFORMED = "a malformed answer"
#: msgspec, not ``json``: a ~4 KB pod decodes in 11 us instead of 24, and a page's items
#: can be left raw (``msgspec.Raw``) until the relist knows it needs them
_PAGE = msgspec.json.Decoder(_ListPage)
_HEAD = msgspec.json.Decoder(_ItemHead)
_JSON = msgspec.json.Decoder()


def _decoded(decoder: msgspec.json.Decoder[Any], raw: bytes, what: str) -> Any:
    """``raw`` decoded; ValueError naming what came when it is not (msgspec's own says
    only where it broke: "invalid character (byte 0)" told nothing of a login page)."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{what} is not what was asked ({e}): {raw[:100]!r}") from None


def _event(line: bytes) -> tuple[str, Obj]:
    """A watch line's type and object; ValueError (the malformed line that makes the
    watcher relist) for valid JSON of another shape (``null``, ``[1]``, an object that
    is not one): it used to raise AttributeError / KeyError, which ended the task."""
    ev = _decoded(_JSON, line, "watch line")
    if not isinstance(ev, dict):
        raise ValueError(f"watch line is not an event: {line[:100]!r}")
    etype = ev.get("type", "")
    obj = ev.get("object") or {}
    if not isinstance(etype, str) or not isinstance(obj, dict):
        raise ValueError(f"watch event of an unexpected shape: {line[:100]!r}")
    return etype, obj


def _metadata(obj: Obj, line: bytes, *, named: bool) -> Obj:
    """An event object's metadata, checked where the watcher reads it: a dict, a string
    ``resourceVersion`` (the next watch's query), and for an object event a string
    ``name`` and ``uid`` (its key in ``held``); ValueError otherwise."""
    md = obj.get("metadata") if named else (obj.get("metadata") or {})
    if not isinstance(md, dict) or not isinstance(md.get("resourceVersion", ""), str):
        raise ValueError(f"watch event without usable metadata: {line[:100]!r}")
    if named and not (isinstance(md.get("name"), str) and isinstance(md.get("uid"), str)
                      and isinstance(md.get("namespace", ""), str)):
        raise ValueError(f"watch event without a name and uid: {line[:100]!r}")
    return md


class _Gone(Exception):
    """410: the resourceVersion is compacted away; only a relist helps."""


class _WentBack(_Gone):
    """An event or bookmark older than what this watch had seen: the API server's store
    went back (an etcd restored from a backup, a fresh one) under an open stream. What
    the watcher holds is of another history; only a relist helps."""


def _revision(rv: str) -> int | None:
    """A resourceVersion as a number, when it is one. Opaque to clients until
    Kubernetes 1.35 (equality only), but kube-apiserver's are etcd revisions, which only
    grow, and KEP-5504 (stable in 1.35) made that a promise: versions of one resource
    type compare as integers. Only versions of one watcher's resource are compared
    here, so a smaller one means the store went back. Anything else (an aggregated API
    server's own versions, which need not be numbers) is not compared."""
    return int(rv) if rv.isascii() and rv.isdigit() else None


def _check_order(held: str, new: str) -> None:
    """Raise ``_WentBack`` when ``new`` is numerically older than ``held``."""
    if _older(new, held):
        raise _WentBack(f"resourceVersion went back from {held} to {new}")


def _older(new: str, held: str) -> bool:
    """``new`` is numerically older than ``held`` (both the API server's integers)."""
    new_rev, old_rev = _revision(new), _revision(held)
    return new_rev is not None and old_rev is not None and new_rev < old_rev


class _ListExpired(Exception):
    """A paged list's continue token answered 410 Expired: its resourceVersion was
    compacted while the list was paged through (etcd compacts every 5 minutes). Only a
    list from the first page helps; what this one delivered is skipped by version then,
    so each try goes further than the one before."""

    def __init__(self, pages: int, seconds: float, delivered: int) -> None:
        super().__init__(f"continue token expired after {pages} pages in {seconds:.1f} s")
        self.pages = pages
        self.seconds = seconds
        #: objects this try delivered that the watcher did not hold at their version
        self.delivered = delivered


class _Broken(Exception):
    """A watch stream the server had answered (its headers came) broke: resumed quietly.
    The same aiohttp errors before an answer are the API server unreachable."""


class _Idle(Exception):
    """An open watch sent nothing for ``idle_timeout``: a dead peer or a hung stream."""


class Backoff:
    """Exponential with full jitter: ``uniform(0, min(cap, base * 2**n))``."""

    def __init__(self, base: float = 0.2, cap: float = 30.0) -> None:
        self.base = base
        self.cap = cap
        self.attempt = 0

    def next(self) -> float:
        delay = random.uniform(self.base / 2, min(self.cap, self.base * 2**self.attempt))
        self.attempt = min(self.attempt + 1, 30)
        return delay

    def reset(self) -> None:
        self.attempt = 0


def random_watch_timeout() -> int:
    """A watch's ``timeoutSeconds``: 4 to 8 minutes, spread so that the watches of one
    process (and of its replicas) do not all end and reconnect at once."""
    return random.randint(240, 480)


@dataclass
class ClientWatchers:
    """The production ``WatcherFactory``: ``ResourceWatcher``s over one client, sharing
    the metrics and the timing settings."""

    client: KubeClient
    metrics: WatchMetrics
    _: KW_ONLY
    backoff_max: float = 30.0
    idle_timeout: float = IDLE_TIMEOUT
    #: a fixed ``timeoutSeconds`` for every watch (None: the watcher's random 4-8 minutes)
    watch_timeout: int | None = None

    def __call__(self, resource: ApiResource, sink: WatchSink,
                 **scope: Unpack[WatchScope]) -> ResourceWatcher:
        wt = self.watch_timeout
        return ResourceWatcher(
            self.client, resource, sink, self.metrics, backoff_max=self.backoff_max,
            idle_timeout=self.idle_timeout,
            watch_timeout=random_watch_timeout if wt is None else lambda: wt, **scope,
        )


class ResourceWatcher(WatchBase):
    def __init__(
        self,
        client: KubeClient,
        resource: ApiResource,
        sink: WatchSink,
        metrics: WatchMetrics,
        *,
        page_size: int = 500,
        page_timeout: float = PAGE_TIMEOUT,
        slice_budget: float = SLICE_BUDGET,
        watch_timeout: Callable[[], int] = random_watch_timeout,
        idle_timeout: float = IDLE_TIMEOUT,
        backoff_max: float = 30.0,
        **scope: Unpack[WatchScope],
    ) -> None:
        super().__init__(resource, sink, **scope)
        self.client = client
        self.metrics = metrics
        self.page_size = page_size
        #: bytes per item of the last list page (None: no page yet), for the next limit
        self._item_bytes: float | None = None
        self.page_timeout = page_timeout
        #: events per slice, adapted so that a slice takes about ``slice_budget``
        self.slices = Slices(slice_budget, most=MAX_SLICE)
        self.watch_timeout = watch_timeout
        self.idle_timeout = idle_timeout
        self.backoff = Backoff(cap=backoff_max)
        #: uid -> resourceVersion of what this watcher delivered (not what a mode switch
        #: handed on in ``held``: the new mode's objects were never delivered). A relist
        #: skips items still at that version: after a 410 that is nearly all of them, and
        #: each would cost a full decode and an engine pass (2.5 s and 80 ms stalls of
        #: the event loop at 37.5k pods, docs/performance.md).
        self.versions: dict[str, str] = {}
        #: ``relist_history`` cut the loop's task (a cancel ``run`` takes back)
        self._interrupted = False
        #: a list or watch failed since the store's version was last had: the next watch
        #: resumed asks it first (``_store_checked``)
        self._check_store = False
        self.resource_version = ""
        self.healthy = True
        #: set by ``retry_now``: ends the backoff wait after a failure at once
        self._wake = asyncio.Event()
        #: 410s since a watch last made progress (an event or bookmark) or lived long
        #: enough, and their own backoff (a list resets ``backoff``, and a 410 loop goes
        #: through a list every time)
        self._gone_in_a_row = 0
        self._gone_backoff = Backoff(cap=backoff_max)
        #: lists since the last whole one whose continue token expired part-way
        self._lists_expired = 0
        #: an idle stream was warned of (later ones are logged at debug)
        self._idle_warned = False
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"watch {self.name}")

    def retry_now(self) -> None:
        """End the current (or the next) backoff wait after a failure at once: another
        watcher has just reached the API server again. After an outage each watcher
        came back on its own backoff, up to ``backoff_max`` (30 s) apart, and a pod
        created meanwhile arrived long before its ReplicaSet, stamped with the
        ReplicaSet as its workload until then."""
        self._wake.set()

    async def _pause(self, delay: float, *, floor: float = 0.0) -> None:
        """``delay`` seconds, or until ``retry_now``; at least ``floor`` whatever
        ``retry_now`` says (the server's Retry-After)."""
        if floor > 0:
            await asyncio.sleep(floor)
        if delay > floor:
            # not wait_for: it swallows a cancel that comes with the wake-up (3.11)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay - floor):
                    await self._wake.wait()
        self._wake.clear()

    async def stop(self) -> None:
        """Cancel the loop and wait for it. A loop that had already ended with an
        exception (a bug: ``run`` catches everything else) is logged, not raised: the
        caller is stopping every watcher, and one dead task must not keep the others
        (and the client) running."""
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        except Exception:
            log.exception("watch %s: its task had ended with an error", self.name)

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        rv = ""
        while True:
            try:
                rv = await self._round(rv)
            except asyncio.CancelledError:
                if not self._interrupted_here():
                    raise
                rv = ""

    def _interrupted_here(self) -> bool:
        """Whether the cancel being handled is ``relist_history``'s alone (asyncio's own
        ``timeout`` does the same): a ``stop`` meanwhile (or instead: the interrupt
        swallowed by what it cut) is a cancel to end on."""
        if not self._interrupted:
            return False
        self._interrupted = False
        task = asyncio.current_task()
        return task is not None and task.uncancel() == 0

    async def _round(self, rv: str) -> str:
        """One turn of the loop: a list if ``rv`` is "" (or the store went back), a watch
        from there, and what its end calls for; returns the version to go on from ("":
        list again). ``relist_history`` may cut it short anywhere (a cancel, taken back
        in ``run``): what it had recorded as delivered was (``_hold`` / ``_forget`` and
        the sink's hand-over go together in one synchronous step)."""
        if self.history_pending:
            rv = ""
        #: what the server asked to wait (429 / 503 Retry-After), capped
        asked = 0.0
        try:
            if rv and self._check_store:
                rv = await self._store_checked(rv)
            if not rv:
                if self.probe:
                    await self._probe()
                    self.probe = False
                rv = await self._list()
            rv, early = await self._watch(rv)
            if early is not None:
                # ended cleanly well before its timeoutSeconds, with nothing or after
                # a bookmark or a few events (a proxy in between cutting streams, a
                # server shutting down): again at once would be a tight loop
                self.metrics.restarts.labels(self.name, early).inc()
                # one is an API server shutting down: with
                # --shutdown-watch-termination-grace-period it ends its watches so, and
                # a rollout ended every watch once, each warned of. Told at info; a
                # second in a row (the backoff not reset since: something cutting
                # streams) is warned of, once a run
                if self.backoff.attempt <= 1:
                    log.log(logging.INFO if self.backoff.attempt == 0 else logging.WARNING,
                            "watch %s: the server ended the watch early (%s)%s; watching "
                            "again after a backoff", self.name,
                            "no event" if early == "empty" else "after some events",
                            "" if self.backoff.attempt == 0 else ", twice in a row")
                await asyncio.sleep(self.backoff.next())
                return rv
            self.metrics.restarts.labels(self.name, "timeout").inc()
            return rv
        except _WentBack as e:
            rv = ""
            self._another_history(str(e))
            await self._after_gone()
            return rv
        except _Gone:
            log.info("watch %s: resourceVersion %s gone (410), relisting", self.name, rv)
            rv = ""
            await self._after_gone()
            return rv
        except _ListExpired as e:
            self._lists_expired += 1
            # said as what it is, once an episode loudly: it was "resourceVersion or
            # continue token gone", then "410 again right after a relist", for a list
            # that simply takes longer than the server keeps its version
            log.log(logging.WARNING if self._lists_expired == 1 else logging.INFO,
                    "watch %s: the list's continue token expired (410) after %d pages in "
                    "%.1f s: the API server compacted its resourceVersion meanwhile (every "
                    "5 min by default), so the list is slower than that; listing again "
                    "from the first page (the %d objects this try delivered are skipped "
                    "by version: the next try goes further)",
                    self.name, e.pages, e.seconds, e.delivered)
            if e.delivered:
                # progress: the next try goes further, no backoff. One that delivered
                # nothing new (every token dying at once) backs off as any 410 loop
                self._gone_in_a_row = 0
                self._gone_backoff.reset()
            rv = ""
            await self._after_gone()
            return rv
        except KubeApiError as e:
            if e.status == 410 or e.resource_version_too_large:
                if e.status != 410:
                    # retrying the watch would be answered the same until the new
                    # store's revision passes ours, and then replay a history that
                    # is not the one this watcher holds
                    self._another_history(f"the API server has not reached "
                                          f"resourceVersion {rv} ({e.message})")
                else:  # a watch's version compacted away (a list's continue token
                    # is _ListExpired): said as the _Gone path says it (an audit saw a
                    # 150k-pod start take 57 s instead of 30 with no line saying why)
                    log.info("watch %s: resourceVersion %s gone (410), relisting",
                             self.name, rv)
                rv = ""
                await self._after_gone()
                return rv
            if e.status in (403, 404):
                self.metrics.restarts.labels(self.name, "unserved").inc()
                refusal = self.sink.unserved(self, e)
                if refusal is Refusal.OUTAGE:
                    # what it held stays, as in any outage: the relist that ends it
                    # diffs it
                    self.probe = True
                    self._failed(f"{REFUSED[e.status]}: {e}", REFUSED[e.status])
                    await self._pause(self.backoff.cap)
                    rv = ""
                    return rv
                if refusal is Refusal.RETRACT and self.held:
                    # refused after it was served: what it held is no longer known
                    await self.deliver([("DELETED", self.stub(u)) for u in self.held])
                    self.held.clear()
                    self.versions.clear()
                await asyncio.sleep(self.backoff.cap)
                rv = ""
                return rv
            reason = "error"
            if e.retry_after:
                asked = min(e.retry_after, RETRY_AFTER_MAX)
            self._failed(f"API error {e}", f"API error {e.status}")
        except _Idle:
            reason = "idle"
            # kube-apiserver accepts a watch from a version its store has not reached
            # and sends it nothing, bookmarks included: a store that went back (an etcd
            # restored from a backup) shows only as this
            if self._went_back(await self._store_version(), rv,
                               f"no data for {self.idle_timeout:.0f} s, and"):
                self.metrics.restarts.labels(self.name, reason).inc()
                await self._after_gone()
                return ""
            # the server never closed the stream; it may be fine for new requests:
            # resume (jittered), the next request tells whether it is reachable. Warned
            # of once per watcher: kube-apiserver bookmarks a watch only once its watch
            # cache's version passed the watch's, and that moves with the kind's own
            # changes and etcd's progress notifications alone (every 10 min at etcd's
            # default), so a quiet kind's watch goes idle at every idle timeout on a
            # healthy server: a warning each time, for as long as the process ran
            log.log(logging.DEBUG if self._idle_warned else logging.WARNING,
                    "watch %s: no data for %g s on an open stream (a stalled connection, "
                    "or a quiet kind the API server sends no bookmarks: its etcd's "
                    "progress notifications rare), reconnecting; said once, "
                    "karta_proxy_watch_restarts_total{reason=\"idle\"} counts each",
                    self.name, self.idle_timeout)
            self._idle_warned = True
        except _Broken as e:
            # a watch the server answered broke: resume at once (jittered), not
            # stale yet
            reason = "disconnect"
            log.info("watch %s: stream broke (%s), resuming", self.name, e)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # a connection closed with no answer (a list, a watch before its
            # headers: ServerDisconnectedError) is as unreachable as one refused: an
            # L4 load balancer with no backend accepts and closes, a TLS 1.3 server
            # refusing the client certificate too. Taken for a broken stream, it
            # never made the index stale, nor warned, nor woke the others on recovery
            reason = "unreachable"
            self._failed(f"API server unreachable: {e or type(e).__name__}",
                         "unreachable")
        except ValueError as e:  # malformed JSON from the server: relist
            # a way of failing of its own (one warning for every watcher answered so,
            # as for an outage): something in front of the API server answering a
            # login page or a cut body did so on every retry of every watcher
            reason = "error"
            self._failed(f"malformed answer: {e}", MALFORMED)
            rv = ""
        except Exception:
            # anything else is a bug here or an answer no check foresaw: the task
            # must not end with it (the index would freeze for this resource, with
            # nothing but a dead task to show for it), so log it and relist
            reason = "error"
            log.exception("watch %s: unexpected failure, relisting after a backoff",
                          self.name)
            rv = ""
        if rv:
            # resume from the newest resourceVersion seen, not the one this watch
            # started from: no replay, and a compaction since then costs no relist
            rv = self.resource_version or rv
        self.metrics.restarts.labels(self.name, reason).inc()
        # the server's Retry-After is waited out whole (not cut short by retry_now:
        # another watcher's answer says nothing of when this one may ask), then the
        # rest of the backoff if longer. It was ignored: 53 of 71 requests of the
        # audit's repro (429, Retry-After 10) came within the 10 s asked for
        await self._pause(self.backoff.next(), floor=asked)
        return rv

    async def _after_gone(self) -> None:
        """A 410 (or a store gone back): relist at once the first time (the log
        compacted past this watch's resourceVersion, the usual case), but after a
        growing backoff when the watch that got it had started from a list made since
        the last watch that made progress (an event or bookmark) or lived long enough: a
        server that answers 410 to every watch (a watch cache behind the list that a
        load balancer sent elsewhere) made a list of every object, then a watch, in a
        loop with no pause."""
        self.metrics.restarts.labels(self.name, "gone").inc()
        self._gone_in_a_row += 1
        if self._gone_in_a_row > 1:
            if self._gone_in_a_row == 2:
                log.warning("watch %s: 410 again right after a relist; relisting after a "
                            "backoff", self.name)
            await self._pause(self._gone_backoff.next())

    async def _probe(self) -> None:
        """After a refusal (403 / 404): a one-item list, then a watch from its version
        opened and closed at once; raises as the list or the watch would. RBAC granting
        list and not watch was found only by the watch after a full list: every retry
        (30 s) delivered every object again and retracted it at the watch's 403, and the
        kind was "served now" for a moment (the gauges 0, a warning again)."""
        path = self.resource.path(self.namespace)
        q = self._query()
        q["limit"] = "1"
        raw = await self.client.request_bytes(
            path, query=q, timeout=30.0,
            accept=ACCEPT_METADATA_LIST if self.metadata_only else ACCEPT_JSON)
        md = _decoded(_PAGE, raw, "list answer").metadata
        q = self._query()
        q.update(watch="1", resourceVersion=md.resourceVersion if md else "",
                 allowWatchBookmarks="true", timeoutSeconds="1")
        resp = await self.client.open(
            path, query=q, timeout=aiohttp.ClientTimeout(total=30, sock_connect=10),
            accept=ACCEPT_METADATA_WATCH if self.metadata_only else ACCEPT_JSON)
        resp.close()

    async def _store_checked(self, rv: str) -> str:
        """Back after a failure (unreachable, 5xx: an API server down or restarting, as
        when its etcd is restored): the store's version before the watch resumes from
        ``rv``; "" (a relist) if it went back. Resumed unchecked, the watch from a
        version the restored store had not reached was silent until the idle timeout
        (150 s), and meanwhile a store written on could pass every watcher's version, and
        the restore would go unseen. One small request per failure; failing, it fails
        the round as the watch would (one request per retry while the server is down)."""
        now = await self._read_store_version()
        self._set_health(True)  # it answered: the others failing retry now, as on a list
        self._check_store = False
        if not self._went_back(now, rv, f"back after {self.last_error_kind or 'a failure'},"):
            return rv
        await self._after_gone()
        return ""

    def _went_back(self, now: str, rv: str, why: str) -> bool:
        """Whether the store's version ``now`` is below the one this watch holds (its
        last event's, else ``rv``): then the store went back, and the next list is of the
        new history (``_another_history``; ``why`` begins the line that says so)."""
        held = self.resource_version or rv
        if not _older(now, held):
            return False
        self._another_history(f"{why} the API server's store is at resourceVersion {now}, "
                              f"below the {held} this watch holds")
        return True

    async def _store_version(self) -> str:
        """The store's resourceVersion now, from a list of one item with no
        resourceVersion (a consistent read, from etcd); "" when it cannot be had.
        Asked only when a watch went idle: one small request then, none otherwise. A
        failure is left to the resumed watch to find and report."""
        try:
            return await self._read_store_version()
        except (aiohttp.ClientError, TimeoutError, OSError, KubeApiError, ValueError) as e:
            log.debug("watch %s: the store's resourceVersion not had (%s); resuming",
                      self.name, e or type(e).__name__)
            return ""

    async def _read_store_version(self) -> str:
        """``_store_version``, raising what the request raises."""
        q = self._query()
        q["limit"] = "1"
        raw = await self.client.request_bytes(
            self.resource.path(self.namespace), query=q, timeout=30.0,
            accept=ACCEPT_METADATA_LIST if self.metadata_only else ACCEPT_JSON)
        md = _decoded(_PAGE, raw, "list answer").metadata
        return md.resourceVersion if md is not None else ""

    def _another_history(self, why: str) -> None:
        """This watcher saw the store go back (``why``): what it delivered is of another
        history, and a resourceVersion of it says nothing of an object in the new one (a
        restored object modified since the backup can reach the same version with other
        data). The relist delivers every object again: skipping those still "at their
        version" could keep the old data for good; and it retracts what it does not
        find, however new a copy fetched of it (``_list``). The sink has every other
        watcher of the server relist too; a finding of a restore it already has them
        relisting for (this watcher was told, and found it before its relist went
        through) is logged at debug: one warning per restore, not one per watcher."""
        if self.sink.new_history(self):
            log.warning("watch %s: %s: the API server's store was restored or replaced; "
                        "relisting, and every other watch of it relists", self.name, why)
        else:
            log.debug("watch %s: %s; relisting (a restore told already, or the sink's own "
                      "line says why not)", self.name, why)
        self._forget_history()

    def _forget_history(self) -> None:
        """The next list is of the new history: every item delivered, and what it does
        not find retracted, however new a copy fetched of it."""
        self.versions.clear()
        self.history_pending = True

    def relist_history(self) -> None:
        """Relist at once with the versions forgotten (``_another_history``'s relist),
        cutting short whatever the loop awaits: a watch of the new store can stream for
        minutes before it ends, and a relist under way may hold pages of the old store.
        The cut is a cancel of the loop's task that ``run`` takes back
        (``_interrupted_here``); one at a time."""
        self.metrics.restarts.labels(self.name, "restored").inc()
        self._forget_history()
        task = self._task
        if (task is None or task.done() or self._interrupted
                or task is asyncio.current_task()):
            return  # not running, or cut already: the next round relists
        self._interrupted = True
        task.cancel()

    def _failed(self, why: str, kind: str) -> None:
        """A list or watch that did not go through: logged at debug only, each retry.
        The sink hears of this watcher's turn to unhealthy (``WatchSink.health``) and
        warns once for all watchers failing the same way, with ``last_error``: a warning
        per retry of every watcher was 92 lines in a 46 s outage. It hears again when
        the way changes while unhealthy (unreachable, then a 500 once the server is
        back): that is a new failure to warn of, not a retry of the old one."""
        log.debug("watch %s: %s; retrying after a backoff", self.name, why)
        self._check_store = True
        changed = kind != self.last_error_kind
        self.last_error = why
        self.last_error_kind = kind
        if self.healthy or changed:
            self.healthy = False
            self.sink.health(self, False)

    def _set_health(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.sink.health(self, healthy)

    def _query(self) -> dict[str, str]:
        q: dict[str, str] = {}
        if self.field_selector:
            q["fieldSelector"] = self.field_selector
        return q

    async def _list(self) -> str:
        """List everything (paginated), deliver what changed, retract what vanished;
        returns the list's resourceVersion."""
        path = self.resource.path(self.namespace)
        accept = ACCEPT_METADATA_LIST if self.metadata_only else ACCEPT_JSON
        seen: set[str] = set()
        rv = ""
        pages = delivered = 0
        began = asyncio.get_running_loop().time()

        async def page(token: str) -> bytes:
            q = self._query()
            q["limit"] = str(self._page_limit())
            if token:
                q["continue"] = token
            return await self.client.request_bytes(path, query=q, accept=accept,
                                                   timeout=self.page_timeout)

        # the next page is fetched while this one goes through the engine: the server's
        # (and the network's) time overlaps ours
        fetch: asyncio.Future[bytes] = asyncio.ensure_future(page(""))
        try:
            while True:
                try:
                    raw = await fetch
                except KubeApiError as e:
                    if e.status == 410 and pages:  # a continue token's page
                        took = asyncio.get_running_loop().time() - began
                        raise _ListExpired(pages, took, delivered) from e
                    raise
                pages += 1
                doc = _decoded(_PAGE, raw, "list answer")
                if doc.items:
                    self._item_bytes = len(raw) / len(doc.items)
                del raw
                if pages == 1 and not self.healthy:
                    self.sink.answered(self)
                md = doc.metadata or _ListMeta()
                first = not rv
                rv, token = md.resourceVersion, md.continue_
                if first and not self.history_pending and _older(rv, self.resource_version):
                    # a list is a consistent read: the store's version now. Below what
                    # this watcher held, the store went back, whatever made it relist (a
                    # 410: a restarted API server's watch cache starts at its store's
                    # version); its items are of the new history, every one delivered
                    self._another_history(f"a list answered at resourceVersion {rv}, "
                                          f"below the {self.resource_version} this watch "
                                          f"held")
                if token:
                    fetch = asyncio.ensure_future(page(token))
                delivered += await self._deliver_items(doc.items or [], seen)
                del doc
                if not token:
                    break
        finally:
            if not fetch.done():
                # not ``await fetch`` under suppress(BaseException): that swallowed a
                # ``stop`` landing here while a failure went up (the loop ran on after
                # it, and ``stop`` waited for good); ``wait`` raises our own cancel
                fetch.cancel()
                await asyncio.wait({fetch})
                if not fetch.cancelled():
                    fetch.exception()  # retrieved: the list's own failure is what counts
        # healthy only now, not at each page: a list cut part-way (a page answered 5xx,
        # a connection reset, a timeout) cleared the stale flag at its first page and set
        # it again at the cut, every retry, with a warning each time
        self._set_health(True)
        if self._lists_expired:
            log.info("watch %s: the list went through whole after %d tries cut by an "
                     "expired continue token", self.name, self._lists_expired)
            self._lists_expired = 0
        gone = [uid for uid in self.held if uid not in seen]
        if gone and not self.history_pending:
            # a copy of an owner fetched after the list's snapshot (its first page's
            # version: a paginated list of many objects takes seconds) is not gone.
            # Retracted, a deletion was counted that never was, and the pods below it
            # (with no ghost of it to walk through) moved to a made-up workload until
            # the watch's ADDED. The watch from ``rv`` delivers it, or its deletion; a
            # 410 instead, and the next list, past it, decides
            gone = [uid for uid in gone if not self.sink.fetched_after(self, uid, rv)]
        if gone:
            await self._retract(gone)
        self.history_pending = False
        self._check_store = False  # the list's version was just compared
        self.resource_version = rv
        self.backoff.reset()
        if self.synced.is_set():
            self.sink.relisted(self)
        self.sink.current(self)
        self.synced.set()
        return rv

    def _page_limit(self) -> int:
        """The next list page's ``limit``: ``page_size``, fewer where the last page's
        items were so large that a page would pass ``PAGE_BYTES`` (``FIRST_PAGE`` before
        any page)."""
        if self._item_bytes is None:
            return min(self.page_size, FIRST_PAGE)
        return max(1, min(self.page_size, int(PAGE_BYTES / self._item_bytes)))

    async def _retract(self, gone: list[str]) -> None:
        """Hand the sink deletions of held uids a list did not find. Each slice forgets
        what it hands over, in one step: forgotten all first, a cut between two slices
        (``relist_history``) left the rest neither held nor retracted, for good."""

        def step(i: int, j: int) -> None:
            deletions: list[WatchEvent] = [("DELETED", self.stub(uid)) for uid in gone[i:j]]
            for uid in gone[i:j]:
                self._forget(uid)
            self.metrics.events.labels(self.name, "RELIST_DELETED").inc(j - i)
            self.sink.handle(self, deletions)

        await self._in_slices(len(gone), step)

    async def _deliver_items(self, items: list[msgspec.Raw], seen: set[str]) -> int:
        """Decode a page's items and hand the changed ones to the sink, in slices of
        about the time budget each (decoding included); returns how many were."""
        delivered = 0

        def step(i: int, j: int) -> None:
            nonlocal delivered
            events: list[WatchEvent] = []
            for raw in items[i:j]:
                head = (_HEAD.decode(raw).metadata or _ItemMeta())
                uid, version = head.uid, head.resourceVersion
                seen.add(uid)
                if version and self.versions.get(uid) == version:
                    continue
                obj = _JSON.decode(raw)
                self._fill(obj)
                md = obj["metadata"]
                if md.get("uid") == uid:  # the engine keeps the uid ``held`` keys by,
                    md["uid"] = uid  # not a second copy (~4.7 MB at 37.5k pods)
                self._hold(uid, md, version)
                events.append(("ADDED", obj))
            if events:
                delivered += len(events)
                self.sink.handle(self, events)

        await self._in_slices(len(items), step, lambda k: len(items[k]))
        return delivered

    async def deliver(self, events: list[WatchEvent]) -> None:
        """Hand events to the sink in slices of about the time budget each."""
        await self._in_slices(len(events), lambda i, j: self.sink.handle(self, events[i:j]))

    async def _in_slices(self, n: int, step: Callable[[int, int], None],
                         weight: Callable[[int], int] | None = None) -> None:
        """``step(i, j)`` over ``range(n)`` a slice at a time, each sized to take about
        the time budget, with a turn of the event loop after each. ``weight``: an item's
        bytes, for list items and watch lines (a 1.7 MB object costs what 400 pods do)."""
        for _ in self.slices.run(n, step, weight):
            await asyncio.sleep(0)

    def _hold(self, uid: str, md: Obj, version: str) -> None:
        """Remember a delivered object: its key for deletion stubs, its version for the
        next relist."""
        self.held[uid] = f"{md.get('namespace', '')}/{md.get('name', '')}"
        self.versions[uid] = version

    def _forget(self, uid: str) -> bool:
        """Forget a retracted object; whether it was delivered."""
        self.versions.pop(uid, None)
        return self.held.pop(uid, None) is not None

    def _fill(self, obj: Obj) -> None:
        # typed lists and metadata-only answers leave out (or replace) apiVersion/kind
        obj["apiVersion"] = self.resource.api_version
        obj["kind"] = self.resource.kind

    async def _watch(self, rv: str) -> tuple[str, str | None]:
        """Watch from ``rv`` until the server ends the stream; returns the last rv and,
        for a stream that ended within half its ``timeoutSeconds`` (no server timeout),
        how: ``empty`` (no byte) or ``short`` (after a bookmark or events); None for a
        stream that lived long enough.

        Only a stream that lived long enough resets the backoff (however it ended): one
        cut after its first bytes (a bookmark, then the end) is as much a failure as an
        empty one. Resetting it on every event or bookmark made such streams a hot loop
        (2,855 watch requests in 3 s over 9 watchers)."""
        server_timeout = self.watch_timeout()
        loop = asyncio.get_running_loop()
        opened = loop.time()
        q = self._query()
        q.update(watch="1", resourceVersion=rv, allowWatchBookmarks="true",
                 timeoutSeconds=str(server_timeout))
        # sock_read: no byte for idle_timeout (between reads, or before the headers) ends
        # the wait; total: a backstop should the server ignore timeoutSeconds
        timeout = aiohttp.ClientTimeout(total=server_timeout + 30, sock_connect=10,
                                        sock_read=self.idle_timeout)
        resp = await self.client.open(
            self.resource.path(self.namespace), query=q, timeout=timeout,
            accept=ACCEPT_METADATA_WATCH if self.metadata_only else ACCEPT_JSON,
        )
        self._set_health(True)
        # a watch from "" or "0" replays the objects in no order; from a revision, every
        # event and bookmark is newer than it
        ordered = _revision(rv) not in (None, 0)
        buf = b""
        received = False
        try:
            while True:
                try:
                    chunk = await resp.content.readany()
                except aiohttp.ServerTimeoutError as e:
                    raise _Idle() from e
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
                    raise _Broken(type(e).__name__) from e
                if not chunk:
                    if buf.strip():
                        rv = await self._process([buf], rv, ordered=ordered)
                    if loop.time() - opened >= server_timeout / 2:
                        return rv, None
                    return rv, ("short" if received else "empty")
                received = True
                buf += chunk
                if b"\n" not in chunk:
                    continue
                lines = buf.split(b"\n")
                buf = lines.pop()
                rv = await self._process(lines, rv, ordered=ordered)
        finally:
            resp.release()
            if loop.time() - opened >= server_timeout / 2:
                self.backoff.reset()  # however it ended: it lived long enough
                self._gone_in_a_row = 0
                self._gone_backoff.reset()

    async def _process(self, lines: list[bytes], rv: str, *, ordered: bool = True) -> str:
        """Decode and deliver watch lines, a time-budgeted slice at a time.

        An ``ERROR`` event or a malformed line ends the stream (raises), but the events
        before it in the slice go to the sink first: ``_hold`` / ``_forget`` have
        recorded them as delivered, and neither a resumed watch nor a relist would
        deliver them again. ``resource_version`` is then the last one delivered.

        ``ordered``: the watch started from a revision, so an event or bookmark older
        than the newest seen means the store went back (``_WentBack``, a relist); a
        server whose store was replaced under an open stream otherwise went on with
        versions this watcher would resume from, never to converge.

        The first event or bookmark ends a run of 410s (``_gone_in_a_row``): the watch
        after the relist made progress, so a later 410 is the usual compaction, relisted
        at once. Only a stream that lived half its timeoutSeconds ended the run, and a 410
        minutes later still waited out the backoff (relists 3-26 s late)."""

        def step(i: int, j: int) -> None:
            nonlocal rv
            events: list[WatchEvent] = []
            got_any = False
            try:
                for line in lines[i:j]:
                    if not line.strip():
                        continue
                    etype, obj = _event(line)
                    self.metrics.events.labels(self.name, etype).inc()
                    if etype == "BOOKMARK":
                        new = _metadata(obj, line, named=False).get("resourceVersion", rv)
                        if ordered:
                            _check_order(rv, new)
                        got_any = True
                        rv = new
                        continue
                    if etype == "ERROR":
                        code = obj.get("code", 0)
                        if code == 410:
                            raise _Gone()
                        status = code if isinstance(code, int) and code > 0 else 500
                        raise KubeApiError.from_status(status, obj)
                    if etype not in ("ADDED", "MODIFIED", "DELETED"):
                        got_any = True
                        continue
                    md = _metadata(obj, line, named=True)
                    new = md.get("resourceVersion", rv)
                    if ordered:
                        _check_order(rv, new)
                    got_any = True
                    self._fill(obj)
                    rv = new
                    uid = md.get("uid", "")
                    if etype == "DELETED":
                        if not self._forget(uid):
                            continue  # never delivered (e.g. deleted before our list)
                    else:
                        self._hold(uid, md, md.get("resourceVersion", ""))
                    events.append((etype, obj))
            finally:
                # also when the slice ends in an error: what was recorded as delivered
                # must be delivered
                if events:
                    self.sink.handle(self, events)
                if got_any:
                    self.resource_version = rv
                    self._gone_in_a_row = 0
                    self._gone_backoff.reset()
            if got_any:
                self.sink.current(self)

        await self._in_slices(len(lines), step, lambda k: len(lines[k]))
        return rv
