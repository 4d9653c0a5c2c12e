"""The live cluster as a source of the pod index: watchers -> Karta engine -> PodIndex.

Which kinds are watched follows the engine: pods always, the Karta description kinds
when ``watch_descriptions`` is on, and whatever ``engine.required_kinds()`` asks for
(owners on pod chains as metadata-only, described workload kinds as full objects).
When a change set says the kinds changed (a description came or went), watches start,
stop or switch mode. Everything the engine answers is applied to the index in one
change set per slice of events, so the data path sees few generation bumps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from proxy import contract, memory
from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta.batches import alone_if_failing, object_name
from proxy.karta.engine import FactsWork, Prepared
from proxy.karta.model import GroupKind
from proxy.karta.results import ChangeSet
from proxy.karta.slim import slim_pod
from proxy.kube.client import KubeApiError, KubeClient
from proxy.kube.discovery import ApiResource, Discovery, Resolver
from proxy.kube.heavy_objects import HeavyObjects
from proxy.kube.owner_fetch import OwnerFetcher
from proxy.kube.watcher import (
    IDLE_TIMEOUT,
    MAX_SLICE,
    REFUSED,
    SLICE_BUDGET,
    Backoff,
    ClientWatchers,
    Refusal,
    Watcher,
    WatcherFactory,
    WatchEvent,
    WatchMetrics,
)
from proxy.tasks import cancel_and_wait
from proxy.yielding import Slices

log = logging.getLogger(__name__)

T = TypeVar("T")

POD = GroupKind("", "Pod")
#: why a kind is unserved when RBAC refused its watch (the forbidden gauge reads it)
FORBIDDEN = REFUSED[403]
#: why a kind is unserved when discovery does not list it: at start or later, and after
#: its watch got 404 (a CRD deleted). One episode whichever comes first
NOT_SERVED = "not served by the cluster"
NO_LONGER_SERVED = "no longer served"
#: the least time (s) between two follower rounds an object naming an owner of a kind
#: not served asks for (``KubeSource._hint_served``): a pod left behind by a deleted
#: CRD's objects names it for as long as it runs
SERVED_HINT_INTERVAL = 5.0
KARTA = GroupKind("run.ai", "Karta")
RESOURCE_INTERFACE = GroupKind("optimization.nvidia.com", "ResourceInterface")
DESCRIPTION_KINDS = (KARTA, RESOURCE_INTERFACE)

#: during the initial sync, what is not frozen is collected and frozen after every this
#: many objects (see _apply)
SYNC_FREEZE_EVERY = 2000
#: the least time the initial sync waits for a kind other than Pod whose list or
#: discovery keeps failing before it stops holding readiness back (``sync_deadline``:
#: this, or two of the watchers' backoff caps if longer, so that a kind gets several
#: attempts with the backoff at its cap before it is given up on for readiness)
MIN_SYNC_DEADLINE = 10.0
#: the least time (s) between two restores that have every watcher relist
#: (``KubeSource.new_history``): a server whose versions of one kind go back again and
#: again (an aggregated API's own store, a bug, not an etcd restored) has that kind's
#: watcher relist alone after the first, not every watcher of the cluster each time
RESTORE_INTERVAL = 60.0
#: seconds after the last relist of a burst went through that the heap's free pages are
#: handed back (``KubeSource._trim_soon``)
RELIST_TRIM_DELAY = 1.0


class EngineLike(Protocol):
    """What the source needs of ``proxy.karta.engine.Engine``."""

    def upsert_many(self, objs: Iterable[Mapping[str, Any]], *,
                    owed: list[str] | None = None,
                    prepared: Mapping[int, Prepared] | None = None) -> ChangeSet: ...

    def delete_many(self, objs: Iterable[Mapping[str, Any]], *,
                    owed: list[str] | None = None) -> ChangeSet: ...

    def reattribute(self, uids: Iterable[str]) -> ChangeSet: ...

    def required_kinds(self) -> Mapping[GroupKind, str]: ...

    def take_lapsed_kinds(self) -> set[GroupKind]: ...

    def holds(self, uid: str) -> bool: ...

    def pointed_at(self, uid: str) -> bool: ...

    def heavy(self, uid: str) -> bool: ...

    def facts_work(self, obj: Mapping[str, Any]) -> FactsWork | None: ...

    def held_facts_work(self, uid: str) -> FactsWork | None: ...

    def replanned(self, work: FactsWork) -> FactsWork | None: ...

    def use_prepared(self, uid: str, ready: Prepared) -> None: ...

    @property
    def max_owner_hops(self) -> int: ...


class KubeSource:
    def __init__(
        self,
        settings: KubeSettings,
        engine: EngineLike,
        index: PodIndex,
        *,
        metrics_registry: CollectorRegistry | None = None,
        client: KubeClient | None = None,
        watch_timeout: int | None = None,
        watch_idle_timeout: float = IDLE_TIMEOUT,
        recheck_interval: float = 30.0,
        sync_deadline: float | None = None,
        watchers: WatcherFactory | None = None,
        discovery: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
        defer_heavy: bool = False,
    ) -> None:
        """``watchers`` and ``discovery`` replace the ones built over the client (tests
        put fakes there); with both given, no client is needed. ``clock`` times the
        retries of kinds the server refused (tests move it by hand). ``sync_deadline``:
        how long the initial sync waits for a kind other than Pod that keeps failing
        (None: ``MIN_SYNC_DEADLINE`` or two backoff caps, whichever is longer).
        ``defer_heavy``: once ready, the updates of objects the engine found heavy have
        their facts evaluated in a thread (``proxy.kube.heavy_objects``); only worth it
        with the jq sandbox as the runner (the runtime sets it so)."""
        self.settings = settings
        self.engine = engine
        self.index = index
        self.registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
        self._client = client
        self._own_client = client is None
        self._watch_timeout = watch_timeout
        self._idle_timeout = watch_idle_timeout
        self._recheck_interval = recheck_interval
        self._sync_deadline = (
            sync_deadline if sync_deadline is not None
            else max(MIN_SYNC_DEADLINE, 2 * settings.resync_backoff_max_seconds)
        )
        self._clock = clock
        #: watchers of pods whose empty first list under a filter was warned of
        self._empty_warned: set[str] = set()
        self.metrics = WatchMetrics(self.registry)
        self._last_current = Gauge(
            "karta_proxy_watch_last_current_timestamp_seconds",
            "Unix time each watched resource was last known current (list, event, bookmark).",
            ["resource"],
            registry=self.registry,
        )
        self._unserved_gauge = Gauge(
            "karta_proxy_watch_unserved",
            "1 for a kind the engine needs that the cluster does not serve (or forbids, "
            "in namespaced mode in any of its namespaces).",
            ["resource"],
            registry=self.registry,
        )
        self._forbidden_gauge = Gauge(
            contract.OP_WATCH_FORBIDDEN,
            "1 for a kind the engine needs that RBAC forbids the proxy to list or watch (in "
            "namespaced mode: in any of its namespaces): the pods it owns are attributed "
            "without it, to the owner below it. For Pod (cluster-wide): the last known pods "
            "are served, the index stale (not ready at start).",
            ["resource"],
            registry=self.registry,
        )
        self._failing_gauge = Gauge(
            "karta_proxy_watch_failing",
            "1 for a kind whose list (or discovery) kept failing past the initial sync's "
            "deadline: readiness no longer waits for it; retried in the background.",
            ["resource"],
            registry=self.registry,
        )
        self._given_discovery = discovery
        self._given_watchers = watchers
        self.discovery: Resolver | None = None
        self._make_watcher: WatcherFactory | None = None
        #: GroupKind -> (mode, watchers: one per namespace, or one cluster-wide)
        self.watchers: dict[GroupKind, tuple[str, list[Watcher]]] = {}
        #: kinds wanted but not served -> why
        self.unserved_kinds: dict[GroupKind, str] = {}
        #: kinds whose watch the server refused (403 / 404) -> when (``clock``) to try a
        #: watch again: until then discovery alone, which still lists a kind RBAC
        #: forbids, does not serve it again; after it, it counts as served once a new
        #: watcher's list went through
        self._refused: dict[GroupKind, float] = {}
        #: namespaced mode: kind -> the namespaces whose watch RBAC refused (403: the
        #: proxy's RoleBinding missing there). Those watchers stay and retry on their
        #: own; the kind's other namespaces stay watched (dropping the whole kind
        #: retracted every namespace's objects, and each retry put them back for a moment)
        self._refused_namespaces: dict[GroupKind, set[str]] = {}
        #: watchers refused as an outage (``unserved``: pods refused cluster-wide or
        #: 404, any kind refused cluster-wide after it held objects) -> (their kind, how:
        #: ``REFUSED``): not a kind unserved: the watcher stays, keeps the last known
        #: objects and is unhealthy (the index stale; for pods at start, readiness waited
        #: for) until it lists and watches again; the kind's unserved / forbidden gauges
        #: read it
        self._refused_held: dict[str, tuple[GroupKind, str]] = {}
        #: kinds whose watch the server answered 404 -> the resource it was watched as:
        #: the next reconcile round asks discovery again at once (a CRD whose served
        #: version changed is watched at the new one, handed what the old watch held)
        self._moved: dict[GroupKind, ApiResource] = {}
        #: kinds not served -> when (``clock``) an object naming an owner of the kind
        #: last had discovery asked again (``_hint_served``)
        self._hinted: dict[GroupKind, float] = {}
        #: kinds whose discovery failed in the last round that tried them -> the error
        self._discovery_failed: dict[GroupKind, str] = {}
        #: those kinds -> since when (``clock``) their discovery fails: the line at its end
        self._discovery_since: dict[GroupKind, float] = {}
        #: kinds other than Pod that still failed (list or discovery) when the initial
        #: sync's deadline passed -> why: readiness does not wait for them (a broken
        #: conversion webhook must not keep every remote write refused while the pods
        #: are indexed); they count as stale until their watchers' lists go through
        self.failing_kinds: dict[GroupKind, str] = {}
        #: watcher name -> how it fails (its ``last_error_kind``): the watchers that
        #: cannot list or watch, which make the index stale
        self._unhealthy: dict[str, str] = {}
        #: the unhealthy watchers that woke the others at a list's first page since they
        #: failed (``answered``): once each, so that a list cut at every retry's second
        #: page does not cut everyone's backoff at every retry
        self._woke: set[str] = set()
        #: way of failing -> the outage of the watchers failing so. One outage for all
        #: watchers was keyed on "none failing -> some": a kind failing for good hid
        #: the API server going away later, and a new error during an outage
        self._outages: dict[str, _Outage] = {}
        self._kinds_changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        #: counts object errors (engine refused an object); never fatal
        self.object_errors = 0
        self._since_freeze = 0
        #: objects a description object's change owes a new attribution, each with what
        #: lies below it, given in runs by the follower (:meth:`reattribute_owed`); the
        #: first run is small, as each owed object may bring several (a Deployment: its
        #: ReplicaSets and their pods)
        self._owed: list[str] = []
        self._owed_slices = Slices(SLICE_BUDGET, first=16, most=MAX_SLICE)
        #: kinds the engine stopped requiring ``full`` since their watchers were started
        #: (``Engine.take_lapsed_kinds``): one wanted full again is listed again whole
        self._lapsed: set[GroupKind] = set()
        #: fetches owners the watches have not delivered yet (None: no client, the
        #: watchers and discovery given)
        self.owner_fetcher: OwnerFetcher | None = None
        #: when (``clock``) a watcher last saw the store go back and every other one was
        #: told to relist
        self._last_restore: float | None = None
        #: the trim owed after relists (``_trim_soon``), and the one under way
        self._trim_at: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Task[bool] | None = None
        #: the heavy objects' updates evaluated off the loop (None: ``defer_heavy`` off)
        self.heavy_objects: HeavyObjects | None = (
            HeavyObjects(engine, self._feed_one, self._reattribute_one,
                         registry=self.registry) if defer_heavy else None)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, list everything required, set ``index.ready``; watches continue in
        background tasks. Failures to reach the server are retried (with backoff)
        inside, so this waits until the cluster answered."""
        await self.sync()
        self._tasks.append(asyncio.create_task(self._follow_kinds(), name="kube kinds"))

    async def sync(self) -> None:
        """The first half of ``start``: watches started and listed, ``index.ready`` set,
        but nothing follows description changes yet (``refresh_kinds`` does one round of
        that): tests drive the reconcile logic step by step from here."""
        if self._client is None and (self._given_discovery is None
                                     or self._given_watchers is None):
            self._client = await KubeClient.connect(self.settings)
        if self._given_discovery is not None:
            self.discovery = self._given_discovery
        else:
            assert self._client is not None
            self.discovery = Discovery(self._client, refresh_interval=self._recheck_interval)
        if self._given_watchers is not None:
            self._make_watcher = self._given_watchers
        else:
            assert self._client is not None
            self._make_watcher = ClientWatchers(
                self._client, self.metrics,
                backoff_max=self.settings.resync_backoff_max_seconds,
                idle_timeout=self._idle_timeout, watch_timeout=self._watch_timeout,
            )
        if self.heavy_objects is not None:
            self.heavy_objects.start()
        if self._client is not None and self.owner_fetcher is None:
            self.owner_fetcher = OwnerFetcher(
                self._client, feed=self._apply, watcher_for=self._watcher_for,
                holds=self.engine.holds, pointed_at=self.engine.pointed_at,
                ready=lambda: self.index.ready, max_hops=self.engine.max_owner_hops,
                registry=self.registry,
                backoff_max=self.settings.resync_backoff_max_seconds)
        # what the process holds before the sync, frozen as the sync's objects are (see
        # _apply): the full collections its first 2,000 objects set off walked it all,
        # up to 115 ms with the listener open
        memory.collect_and_freeze()
        deadline = asyncio.get_running_loop().time() + self._sync_deadline
        # descriptions first: they decide which kinds the engine needs
        if self.settings.watch_descriptions:
            await self._reconcile(self._desired(descriptions_only=True))
            await self._wait_synced(deadline)
        backoff = Backoff(cap=self.settings.resync_backoff_max_seconds)
        while True:
            self._kinds_changed.clear()
            failed = await self._reconcile(self._desired())
            await self._wait_synced(deadline)
            if failed and not self._excuse_discovery(deadline):
                # discovery unreachable: retry, but never in a tight loop (and not past
                # the deadline, where the kinds still failing are done without)
                left = deadline - asyncio.get_running_loop().time()
                await asyncio.sleep(min(backoff.next(), max(left, 0.01)))
                continue
            if not self._kinds_changed.is_set():
                break
        # The index and engine are now a large, long-lived heap, collected and frozen
        # piecewise during the sync (see _apply): what came since the last freeze is
        # collected and frozen the same way, and the freed list pages handed back off
        # the loop. Not one collection of the whole heap (unfrozen first): that held
        # the event loop 0.27-0.57 s at 37.5k pods (~620 ms at 150k), with the listener
        # open: probes, /metrics and the first requests waited for it
        memory.collect_and_freeze()
        await memory.trim_off_loop()
        self.index.ready = True
        log.info("cluster index ready: %d pods, %d watches", len(self.index.pods),
                 sum(len(ws) for _, ws in self.watchers.values()))

    async def stop(self) -> None:
        """Stop the follower, every watcher, the owner fetches and the client, whatever
        one of them raises: a watcher whose task had died raised here and left the rest
        running. Producers before consumers: the watchers deliver events, and an event
        parked for its owner starts a GET; the fetcher stopped first, a watcher still
        running started GETs nobody cancelled, over the client closed under them."""
        for t in self._tasks:
            await self._stopping(f"task {t.get_name()}", cancel_and_wait(t))
        self._tasks.clear()
        if self.heavy_objects is not None:
            await self._stopping("heavy objects", self.heavy_objects.stop())
        if self._trim_at is not None:
            self._trim_at.cancel()
            self._trim_at = None
        for _, ws in list(self.watchers.values()):
            for w in ws:
                await self._stopping(f"watch {w.name}", w.stop())
        self.watchers.clear()
        if self.owner_fetcher is not None:
            await self._stopping("owner fetches", self.owner_fetcher.stop())
        if self._trimming is not None:
            await self._stopping("the heap's trim", cancel_and_wait(self._trimming))
            self._trimming = None
        if self._client is not None and self._own_client:
            await self._client.close()
            self._client = None

    @staticmethod
    async def _stopping(what: str, stopped: Awaitable[None]) -> None:
        try:
            await stopped
        except Exception:
            log.exception("stopping %s failed; stopping the rest", what)

    # -- which kinds -----------------------------------------------------------------------

    def _desired(self, descriptions_only: bool = False) -> dict[GroupKind, str]:
        # the lapses up to now, with the modes they are weighed against: one after this
        # stays with the engine, for the round its change wakes
        self._lapsed |= self.engine.take_lapsed_kinds()
        want: dict[GroupKind, str] = {}
        if self.settings.watch_descriptions:
            for gk in DESCRIPTION_KINDS:
                want[gk] = "full"
        if descriptions_only:
            return want
        for gk, mode in self.engine.required_kinds().items():
            if gk in DESCRIPTION_KINDS and not self.settings.watch_descriptions:
                continue
            want[gk] = "full" if mode == "full" or want.get(gk) == "full" else "metadata"
        want[POD] = "full"
        return want

    async def _reconcile(self, want: Mapping[GroupKind, str]) -> int:
        """Start, switch and drop watchers to match ``want``; returns how many kinds could
        not be resolved (the caller retries those after a backoff)."""
        assert self.discovery is not None
        failed: list[GroupKind] = []
        #: the kinds of ``failed`` that did not fail in the round before: warned of
        newly: list[GroupKind] = []
        error: Exception | None = None
        for gk in list(self.watchers):
            if gk not in want:
                await self._drop(gk)
        for gk in ({*self.unserved_kinds, *self._refused, *self._discovery_failed,
                    *self._refused_namespaces} - want.keys()):
            self._forget(gk)
        if self._moved:
            await self._follow_moved(want)
        for gk, mode in want.items():
            current = self.watchers.get(gk)
            # a kind undescribed since its full watch started (and described again): what
            # that watch delivered meanwhile was kept without its body, so it lists again
            relist = mode == "full" and gk in self._lapsed
            if current is not None and current[0] == mode and not relist:
                continue
            retry_at = self._refused.get(gk)
            if retry_at is not None and self._clock() < retry_at:
                continue  # refused: not again before its retry time
            try:
                res = await self.discovery.resolve(gk)
            except Exception as e:  # KubeApiError, OSError, aiohttp client errors...
                failed.append(gk)
                error = e
                if gk not in self._discovery_failed:
                    newly.append(gk)
                    self._discovery_since[gk] = self._clock()
                self._discovery_failed[gk] = f"discovery failed: {e}"
                continue
            if self._discovery_failed.pop(gk, None) is not None:
                took = self._clock() - self._discovery_since.pop(gk, self._clock())
                log.info("discovery of kind %s works again after %.1f s", gk, took)
            if res is None:
                self._refused.pop(gk, None)
                self._clear_failing(gk)  # not failing: not served (reported as such)
                self._mark_unserved(gk, NOT_SERVED)
                continue
            if retry_at is None:
                self._mark_served(gk)
            # else: still unserved until the new watcher's list goes through (current())
            held: dict[str, str] = {}
            if current is not None:  # mode switch: the new watcher's relist diffs
                if current[0] == mode:
                    log.info("kind %s was not described for a while since its watch "
                             "started: listing it again whole", gk)
                for w in current[1]:
                    await w.stop()
                    held.update(w.held)
                    # the new watcher starts healthy and only reports a change: an old
                    # one's failure would otherwise keep the index stale for good
                    self._settle(w.name, "was replaced (mode switch)" if current[0] != mode
                                 else "was replaced (listed again whole)")
                self._update_stale()
            # a retry after a refusal probes a watch before it lists
            self.watchers[gk] = (mode, self._start_watchers(res, mode, held,
                                                            probe=retry_at is not None))
            self._lapsed.discard(gk)
        if newly:  # one line per round, not one per kind: an outage must not flood logs
            # and one per episode of a kind: later rounds at debug, its end at info (a
            # group failing for good warned every round, every ~10 s, forever)
            log.warning("discovery of %d kind(s) failed (%s: %s); will retry (logged at "
                        "debug level until it works)", len(newly),
                        ", ".join(map(str, newly)), error)
        elif failed:
            log.debug("discovery of %d kind(s) failed (%s: %s); will retry",
                      len(failed), ", ".join(map(str, failed)), error)
        return len(failed)

    async def _follow_moved(self, want: Mapping[GroupKind, str]) -> None:
        """The kinds whose watch got 404: discovery asked again at once. Served as
        another resource now (a CRD's version v1alpha1 -> v1): the new watchers start
        straight away with what the old ones held (their relist diffs it; nothing
        retracted meanwhile). Still resolved as before, or not at all, or discovery
        failing: no longer served, as before (unserved, retried after the recheck
        interval, the watcher dropped). A 404 made the kind unserved for the recheck
        interval (30 s) without asking discovery: its workload facts read
        ``workload_object_missing`` meanwhile, and a warning said "no longer served"."""
        assert self.discovery is not None
        self.discovery.invalidate()
        moved, self._moved = self._moved, {}
        for gk, old in moved.items():
            current = self.watchers.get(gk)
            if gk not in want or current is None or current[1][0].resource != old:
                continue  # dropped or replaced meanwhile
            try:
                res = await self.discovery.resolve(gk)
            except Exception as e:  # KubeApiError, OSError, aiohttp client errors...
                log.debug("discovery of %s after its 404 failed: %s", gk, e)
                res = None
            if res is None or res == old:
                self._mark_unserved(gk, NO_LONGER_SERVED)
                if res is not None:
                    # still listed, yet refused: discovery alone must not serve it again
                    # before the recheck interval (a watch 404'd at once in a loop). Not
                    # listed (a CRD deleted), discovery is the word: a CRD installed again
                    # is watched once a round finds it, not 30 s after the 404
                    self._refused[gk] = self._clock() + self._recheck_interval
                await self._drop(gk)
                continue
            log.info("kind %s is served as %s/%s now (its watch of %s/%s got 404); "
                     "watching that, with what was held", gk, res.api_version, res.plural,
                     old.api_version, old.plural)
            mode, ws = current
            held: dict[str, str] = {}
            for w in ws:
                await w.stop()
                held.update(w.held)
                self._settle(w.name, "was replaced (served as another version)")
            self.watchers[gk] = (mode, self._start_watchers(res, mode, held))
            names = {w.name for w in self.watchers[gk][1]}
            for w in ws:
                if w.name not in names:  # another plural: the old key is no longer watched
                    self._no_freshness(w.name)
                    self.metrics.forget(w.name)
        self._update_stale()

    def _start_watchers(
        self, res: ApiResource, mode: str, held: dict[str, str], *, probe: bool = False
    ) -> list[Watcher]:
        assert self._make_watcher is not None
        # each namespace once, in order: --namespace web --namespace web started two
        # identical watchers per kind (every object delivered twice)
        namespaces: list[str | None] = (
            list(dict.fromkeys(self.settings.namespaces))
            if res.namespaced and self.settings.namespaces else [None]
        )
        field_selector = ""
        if res.group_kind == POD and self.settings.node_name:
            field_selector = f"spec.nodeName={self.settings.node_name}"
        out = []
        for ns in namespaces:
            mine = {u: k for u, k in held.items() if ns is None or k.startswith(f"{ns}/")}
            w = self._make_watcher(res, self, metadata_only=(mode == "metadata"),
                                   namespace=ns, field_selector=field_selector, held=mine,
                                   probe=probe)
            w.start()
            out.append(w)
        return out

    async def _drop(self, gk: GroupKind) -> None:
        """Stop watching a kind no longer needed and retract its objects."""
        _, ws = self.watchers.pop(gk)
        self._lapsed.discard(gk)
        self._clear_failing(gk, quiet=True)
        if self._refused_namespaces.pop(gk, None):
            self._show_unserved(gk)
        for w in ws:
            await w.stop()
            stubs: list[WatchEvent] = [("DELETED", w.stub(uid)) for uid in w.held]
            w.held.clear()
            await w.deliver(stubs)
            self._settle(w.name, "is no longer watched")
            # no longer watched: no freshness either (a frozen one reads as a resource
            # ever staler; the fact writer ends its series with a stale marker)
            self._no_freshness(w.name)
            self.metrics.forget(w.name)
        self._update_stale()

    def _no_freshness(self, name: str) -> None:
        """A watcher's resource key is no longer watched (or not in this namespace): its
        freshness entry and its ``last_current`` child go."""
        self.index.freshness.pop(name, None)
        with contextlib.suppress(KeyError):  # never current, no child: older clients raise
            self._last_current.remove(name)

    def _forget(self, gk: GroupKind) -> None:
        """A kind no longer needed, never watched (unserved, refused, not resolved): its
        state and its ``karta_proxy_watch_unserved`` child go, as a dropped watcher's do.
        It stayed at 1 for good, one child per kind ever described, and an unserved kind
        kept every follower round invalidating discovery."""
        self.unserved_kinds.pop(gk, None)
        self._hinted.pop(gk, None)
        self._refused.pop(gk, None)
        self._discovery_failed.pop(gk, None)
        self._discovery_since.pop(gk, None)
        self._refused_namespaces.pop(gk, None)
        self._moved.pop(gk, None)
        for gauge in (self._unserved_gauge, self._forbidden_gauge):
            with contextlib.suppress(KeyError):  # never shown: no child
                gauge.remove(str(gk))

    def _mark_unserved(self, gk: GroupKind, why: str) -> None:
        was = self.unserved_kinds.get(gk)
        if was != why and not {was, why} <= {NOT_SERVED, NO_LONGER_SERVED}:
            if gk in DESCRIPTION_KINDS and why in (NOT_SERVED, NO_LONGER_SERVED):
                # no attribution goes through a description kind: its CRD absent (most
                # clusters lack the older ResourceInterface for good) is no warning
                log.info("kind %s is %s: no descriptions are read from its objects",
                         gk, why)
            else:
                log.warning("kind %s is needed but %s; attribution through it is "
                            "unavailable", gk, why)
        self.unserved_kinds[gk] = why
        self._show_unserved(gk)

    def _mark_served(self, gk: GroupKind) -> None:
        self._hinted.pop(gk, None)
        if self.unserved_kinds.pop(gk, None) is not None:
            log.info("kind %s is served now", gk)
            self._show_unserved(gk)

    def _show_unserved(self, gk: GroupKind) -> None:
        """The gauges: unserved, 1 while the kind is unserved or refused in any namespace;
        forbidden, 1 while that is RBAC's doing. Not served is what a described kind whose
        CRD is not installed is, with no object to miss; forbidden, the cluster has the
        kind and the proxy may not read it: its pods are attributed to the owner below it
        (a RayJob's to its RayCluster), with nothing else to show it."""
        refused = bool(self._refused_namespaces.get(gk))
        held = [why for kind, why in self._refused_held.values() if kind == gk]
        self._unserved_gauge.labels(str(gk)).set(
            1 if gk in self.unserved_kinds or refused or held else 0)
        self._forbidden_gauge.labels(str(gk)).set(
            1 if self.unserved_kinds.get(gk) == FORBIDDEN or refused or FORBIDDEN in held
            else 0)

    def _refuse_namespace(self, watcher: Watcher) -> None:
        """RBAC refused one namespace's watch of a kind: that watcher retracts what it
        held and retries on its own (every ``kube.resync_backoff_max_seconds``); no
        readiness wait, no freshness for it. One warning per episode."""
        gk, ns = watcher.resource.group_kind, watcher.namespace
        assert ns is not None
        refused = self._refused_namespaces.setdefault(gk, set())
        if ns not in refused:
            log.warning("kind %s is forbidden (RBAC) in namespace %s: its objects there "
                        "are not attributed, the other namespaces stay watched; retrying",
                        gk, ns)
            refused.add(ns)
        self._show_unserved(gk)
        self._no_freshness(watcher.name)
        watcher.synced.set()  # do not hold readiness hostage

    async def _wait_synced(self, deadline: float = float("inf")) -> None:
        """Wait until every served kind's watchers have listed, but past ``deadline``
        (loop time) not for a kind other than Pod whose watcher is failing: that one is
        reported (``_mark_failing``) and no longer waited for. A kind whose list is
        slow but going through is still waited for; pods always are."""
        loop = asyncio.get_running_loop()
        # one waiter per watcher for the whole wait, cancelled at its end: a new one per
        # watcher and round, never cancelled, piled up while a list kept failing (one
        # task a second per failing watcher)
        waiters: dict[int, asyncio.Task[bool]] = {}
        try:
            while True:
                pending = [
                    w
                    for gk, (_, ws) in self.watchers.items()
                    if gk not in self.unserved_kinds and gk not in self.failing_kinds
                    for w in ws
                    if not w.synced.is_set()
                ]
                now = loop.time()
                if now >= deadline:
                    for w in pending:
                        gk = w.resource.group_kind
                        if gk != POD and w.name in self._unhealthy:
                            self._mark_failing(gk, w.last_error or "its list keeps failing")
                    pending = [w for w in pending
                               if w.resource.group_kind not in self.failing_kinds]
                if not pending:
                    return
                for w in pending:
                    if id(w.synced) not in waiters:
                        waiters[id(w.synced)] = asyncio.ensure_future(w.synced.wait())
                await asyncio.wait(
                    [waiters[id(w.synced)] for w in pending],
                    # past the deadline, once a second: a failing watcher must be
                    # marked unhealthy first (and a slow list is not failing)
                    timeout=1.0 if now >= deadline else min(1.0, deadline - now),
                    return_when=asyncio.ALL_COMPLETED,
                )
        finally:
            for t in waiters.values():
                t.cancel()

    def _excuse_discovery(self, deadline: float) -> bool:
        """Past ``deadline``, the kinds other than Pod whose discovery failed are reported
        as failing and the sync goes on without them (the follower retries them);
        returns whether it may. Pods are never done without."""
        if asyncio.get_running_loop().time() < deadline or POD in self._discovery_failed:
            return False
        for gk, why in self._discovery_failed.items():
            self._mark_failing(gk, why)
        return True

    def _mark_failing(self, gk: GroupKind, why: str) -> None:
        if gk not in self.failing_kinds:
            log.warning(
                "kind %s still failing %g s into the sync (%s): ready without it, "
                "retrying in the background; pods owned through it are attributed as if "
                "it were not served until it lists", gk, self._sync_deadline, why)
        self.failing_kinds[gk] = why
        self._failing_gauge.labels(str(gk)).set(1)
        self._update_stale()

    def _clear_failing(self, gk: GroupKind, *, quiet: bool = False) -> None:
        if self.failing_kinds.pop(gk, None) is None:
            return
        if not quiet:
            log.info("kind %s is listed now", gk)
        self._failing_gauge.labels(str(gk)).set(0)
        self._update_stale()

    async def _follow_kinds(self) -> None:
        """Start / stop watches when descriptions change; retry unserved kinds."""
        assert self.discovery is not None
        backoff = Backoff(cap=self.settings.resync_backoff_max_seconds)
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the event's
            # result when a cancel comes in the same turn as the event, swallowing the
            # cancel; stop() then waited for this loop for good (a CI run hung 20 min in
            # a teardown, the watches still open)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._recheck_interval):
                    await self._kinds_changed.wait()
            try:
                failed = await self.refresh_kinds()
            except Exception:  # never let the follower die
                log.exception("reconciling watched kinds failed; retrying")
                failed = 1
            if failed:
                await asyncio.sleep(backoff.next())
                self._kinds_changed.set()
            else:
                backoff.reset()

    def wake(self) -> None:
        """Have the follower run its round now: the engine's descriptions changed outside
        the watches (a reload's description files), so the kinds it needs may have. A
        reload set nothing here, and a kind it described waited for the recheck (30 s)
        to be watched whole: its workloads read ``workload_object_missing`` meanwhile,
        where a Karta object's description was followed in 0.1 s."""
        self._kinds_changed.set()

    @property
    def kinds_pending(self) -> bool:
        """A change set, a refused watch or a description change's re-attribution owed
        asked for the follower's round, and no ``refresh_kinds`` round has run since."""
        return self._kinds_changed.is_set()

    async def refresh_kinds(self) -> int:
        """One round of following the kinds: rediscover unserved kinds, then start, stop
        or switch watches to what the engine needs now; returns how many kinds could not
        be resolved."""
        self._kinds_changed.clear()
        await self.reattribute_owed()
        assert self.discovery is not None
        want = self._desired()
        if self.unserved_kinds:
            self.discovery.invalidate()
            now = self._clock()
            for gk, retry_at in list(self._refused.items()):
                # refused since its last retry: drop the refused watcher (not one that
                # retries it now, after its retry time)
                if gk in self.watchers and now < retry_at:
                    await self._drop(gk)
        return await self._reconcile(want)

    async def reattribute_owed(self) -> None:
        """Re-attribute what description objects' changes owe, in slices with a turn of
        the event loop between, each applied to the index at once.

        In the watch event's own slice, a description of a kind with many pods held the
        loop for all of them (three described kinds: 2.5-3.4 s at 37.5k pods), with
        every request relayed meanwhile waiting. Until its slice, an object keeps the
        attribution it had. Runs in the follower's round, which the change wakes."""
        while self._owed:
            owed, self._owed = self.owe_heavy(list(dict.fromkeys(self._owed))), []
            for _ in self._owed_slices.run(len(owed), functools.partial(self._give, owed)):
                await asyncio.sleep(0)

    def owe_heavy(self, owed: list[str]) -> list[str]:
        """Of the objects a description change owes a new attribution, those to give on
        the event loop now: once ready, the heavy ones are re-evaluated in the heavy
        objects' thread first, and given from there (``proxy.kube.heavy_objects``). The
        runtime's reload hands its own here too."""
        if self.heavy_objects is None or not self.index.ready:
            return owed
        return self.heavy_objects.owe(owed)

    def _give(self, owed: list[str], i: int, j: int) -> None:
        cs = self._alone_if_failing(owed[i:j], self.engine.reattribute, str)
        self.index.apply(cs)
        if cs.kinds_changed:
            self._kinds_changed.set()

    def _reattribute_one(self, uid: str, prepared: Prepared) -> bool:
        """A heavy object's re-attribution owed (``HeavyObjects.owe``), with the facts
        prepared for it, given as a run's; False: the engine failed on it (counted and
        logged)."""
        errors = self.object_errors
        self.engine.use_prepared(uid, prepared)
        self._give([uid], 0, 1)
        return self.object_errors == errors

    def _alone_if_failing(self, items: Sequence[T], call: Callable[[Sequence[T]], ChangeSet],
                          name: Callable[[T], str]) -> ChangeSet:
        """``call(items)``, an object the engine fails on (a bug) costing that object only:
        counted (``object_errors``) and logged by ``name``, one line each (the batch's
        traceback is logged once where it failed, not once per object: an engine bug that
        hits every pod would log tens of thousands)."""
        def failed(item: T, error: Exception) -> None:
            self.object_errors += 1
            log.error("engine failed on %s: %s: %s", name(item), type(error).__name__, error)

        return alone_if_failing(items, call, failed)

    # -- WatchSink -------------------------------------------------------------------------

    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        self._apply(watcher, events)

    def _apply(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        """Feed a slice of events to the engine; apply the merged change set once.

        Once ready, an object whose owner is absent waits for that owner's GET
        (``proxy.kube.owner_fetch``), and comes back here with it."""
        fetcher = self.owner_fetcher
        if fetcher is not None:
            events = fetcher.admit(watcher, events)
        changes = ChangeSet()
        is_pod = watcher.resource.group_kind == POD and not watcher.metadata_only
        now = events
        if self.heavy_objects is not None and self.index.ready and not is_pod:
            now = self.heavy_objects.take(events)
        run: list[dict[str, Any]] = []
        run_deletes = False
        for etype, obj in now:
            deleting = etype == "DELETED"
            if run and deleting != run_deletes:
                self._feed(run, run_deletes, changes)
                run = []
            run_deletes = deleting
            run.append(slim_pod(obj) if is_pod and not deleting else obj)
        if run:
            self._feed(run, run_deletes, changes)
        self._applied(changes)
        if self.unserved_kinds:
            self._hint_served(events)
        if fetcher is not None:
            fetcher.fed(events)
        if not self.index.ready:
            # The sync builds millions of long-lived objects; each full collection on
            # the way walked all of them again (4.8 of 7.9 CPU-s for 100k pods). Freezing
            # what exists so far keeps the collector on the young objects; what is
            # garbage among them is collected first (only what is not frozen: a few ms),
            # so no cycle already garbage is frozen for good, and start() ends the same
            # way instead of collecting the whole heap once.
            self._since_freeze += len(events)
            if self._since_freeze >= SYNC_FREEZE_EVERY:
                memory.collect_and_freeze()
                self._since_freeze = 0

    def _hint_served(self, events: list[WatchEvent]) -> None:
        """An object naming an owner of a kind discovery did not list (a RayCluster's
        pod, a JobSet's Job) says the kind is served now: its CRD was installed (again)
        since. The follower's round, which asks discovery again, is woken at once, at
        most once every ``SERVED_HINT_INTERVAL`` per kind. The recheck (30 s) was the only
        way back: a RayJob created with its CRD had its pods unknown to the index (their
        owner kind unwatched) and no facts for up to 30 s, and for up to 60 s after a CRD
        deleted and installed again."""
        now = self._clock()
        # the description kinds own nothing (a cluster without the older
        # ResourceInterface CRD has it unserved for good: no event is looked at then)
        waiting = {gk for gk, why in self.unserved_kinds.items()
                   if why in (NOT_SERVED, NO_LONGER_SERVED) and gk not in DESCRIPTION_KINDS
                   and now >= self._hinted.get(gk, -1e18) + SERVED_HINT_INTERVAL}
        kinds = {gk.kind for gk in waiting}
        for _, obj in events:
            if not kinds:
                return
            md = obj.get("metadata") if isinstance(obj, dict) else None
            refs = md.get("ownerReferences") if isinstance(md, dict) else None
            for ref in refs if isinstance(refs, list) else ():
                if not isinstance(ref, dict) or ref.get("kind") not in kinds:
                    continue  # the engine reports what is malformed
                gk = GroupKind.from_api_version(str(ref.get("apiVersion", "")), ref["kind"])
                if gk in waiting:
                    self._hinted[gk] = now
                    log.debug("an object of %s names an owner of kind %s, not served at the "
                              "last look: asking discovery again", object_name(obj), gk)
                    self._kinds_changed.set()
                    waiting.discard(gk)
                    kinds = {w.kind for w in waiting}

    def _applied(self, changes: ChangeSet) -> None:
        """What the engine answered to the index, and the follower woken for what it
        owes (a slice of events, or a heavy object's update fed off its slice)."""
        if changes:
            self.index.apply(changes)
            if changes.kinds_changed:
                self._kinds_changed.set()
        if self._owed:
            self._kinds_changed.set()  # the follower's round gives what is owed

    def _feed(self, objs: list[dict[str, Any]], deletes: bool, changes: ChangeSet,
              prepared: Mapping[int, Prepared] | None = None) -> None:
        # once synced, a description object's re-attribution is owed to the follower
        # (reattribute_owed); during the sync it is done at once, before index.ready
        owed = self._owed if self.index.ready else None

        def many(batch: Sequence[dict[str, Any]]) -> ChangeSet:
            if deletes:
                return self.engine.delete_many(batch, owed=owed)
            return self.engine.upsert_many(batch, owed=owed, prepared=prepared)

        changes.merge(self._alone_if_failing(objs, many, object_name))

    def _feed_one(self, stub: dict[str, Any], prepared: Prepared) -> bool:
        """A heavy object's update (``proxy.kube.heavy_objects``): its stub, with the
        text and facts prepared for it, fed and applied as a slice's events are; False:
        the engine failed on it (counted and logged)."""
        errors = self.object_errors
        changes = ChangeSet()
        self._feed([stub], False, changes, {id(stub): prepared})
        self._applied(changes)
        return self.object_errors == errors

    def fetched_after(self, watcher: Watcher, uid: str, version: str) -> bool:
        fetcher = self.owner_fetcher
        return fetcher is not None and fetcher.fetched_after(uid, version)

    def new_history(self, watcher: Watcher) -> bool:
        """One watcher saw the store go back; every watcher of this source watches the
        same API server, whose store is one for every kind: each relists. A watcher
        whose resourceVersion the restored store had passed (a quiet kind, not
        bookmarked since the backup; a store written on after the restore) never sees it
        on its own, and resumed in the new history with the old one's objects: a pod
        the restore removed kept its stamp, a ReplicaSet whose owner it changed the old
        one, until an event of each. A finding by a watcher told already (still to list
        the new store) is of the same restore: nobody is told twice, the log says it
        once. At most one every ``RESTORE_INTERVAL``: within it, the watcher that saw it
        relists alone, and this line is the one logged."""
        if watcher.history_pending:
            return False
        if self.owner_fetcher is not None:
            self.owner_fetcher.new_history()
        now = self._clock()
        if self._last_restore is not None and now - self._last_restore < RESTORE_INTERVAL:
            log.warning("watch %s saw the API server's store go back again %.0f s after "
                        "the last restore: it relists alone (every watch relists for at "
                        "most one restore every %.0f s)", watcher.name,
                        now - self._last_restore, RESTORE_INTERVAL)
            return False
        self._last_restore = now
        told = 0
        for _, ws in self.watchers.values():
            for w in ws:
                if w is not watcher and not w.history_pending:
                    w.relist_history()
                    told += 1
        log.debug("watch %s saw the store go back: %d other watches relist", watcher.name,
                  told)
        return True

    def _watcher_for(self, gk: GroupKind, namespace: str) -> Watcher | None:
        """The watcher an owner of kind ``gk`` named by a dependent in ``namespace`` is
        fetched as (its resource and mode), if the kind is watched there and has listed
        (or is failing since the sync: its list does not come); None otherwise: a kind
        not watched is not read, one whose first list is under way delivers it soon."""
        current = self.watchers.get(gk)
        if current is None or gk in self.unserved_kinds:
            return None
        for w in current[1]:
            if w.namespace is None or w.namespace == namespace:
                if namespace in self._refused_namespaces.get(gk, ()):
                    return None
                if w.synced.is_set() or gk in self.failing_kinds:
                    return w
                return None
        return None

    def current(self, watcher: Watcher) -> None:
        if not watcher.synced.is_set():
            self._warn_if_filtered_to_nothing(watcher)
        now = time.time()
        self.index.mark_fresh(watcher.name, now)
        self._last_current.labels(watcher.name).set(now)
        if self.failing_kinds:  # a kind given up on for readiness lists again
            gk = watcher.resource.group_kind
            _, ws = self.watchers.get(gk, ("", []))
            if gk in self.failing_kinds and all(w is watcher or w.synced.is_set()
                                                for w in ws):
                self._clear_failing(gk)
        refused_ns = self._refused_namespaces.get(watcher.resource.group_kind)
        if refused_ns and watcher.namespace in refused_ns:  # RBAC fixed there
            refused_ns.discard(watcher.namespace)
            log.info("kind %s is served in namespace %s now", watcher.resource.group_kind,
                     watcher.namespace)
            self._show_unserved(watcher.resource.group_kind)
        if self._refused:  # a refused kind's retry went through: served again
            gk = watcher.resource.group_kind
            retry_at = self._refused.get(gk)
            if retry_at is not None and self._clock() >= retry_at:
                del self._refused[gk]
                self._mark_served(gk)

    def relisted(self, watcher: Watcher) -> None:
        """A relist leaves the heap holding the pages its lists and their decoding
        freed: 8 MiB at 37.5k pods after a 410 had every watcher relist (254 -> 262
        MiB), kept for the process's life. Handed back once the relists of a burst are
        through: one trim, off the loop, ``RELIST_TRIM_DELAY`` after the last (254 ->
        256 MiB; ``benchmarks/kube_scale_bench.py``). The initial sync trims at its end
        on its own."""
        if self.index.ready:
            self._trim_soon()

    def _trim_soon(self) -> None:
        if self._trim_at is not None:
            self._trim_at.cancel()
        self._trim_at = asyncio.get_running_loop().call_later(RELIST_TRIM_DELAY,
                                                              self._trim)

    def _trim(self) -> None:
        self._trim_at = None
        if self._trimming is None or self._trimming.done():
            self._trimming = asyncio.create_task(memory.trim_off_loop(), name="kube trim")

    def _warn_if_filtered_to_nothing(self, watcher: Watcher) -> None:
        """One warning when a watcher's first list of pods under a node or namespace
        filter comes back empty: a node or namespace that does not exist (a typo, a
        NODE_NAME of another cluster) lists nothing, without an error, and the proxy
        reported ready with nothing attributed and nothing said."""
        if watcher.resource.group_kind != POD or watcher.held:
            return
        node, ns = self.settings.node_name, watcher.namespace
        if not node and ns is None:
            return
        if watcher.name in self._empty_warned:
            return
        self._empty_warned.add(watcher.name)
        where = " and ".join(f for f in (f"node {node!r}" if node else "",
                                          f"namespace {ns!r}" if ns is not None else "") if f)
        log.warning("the first list of pods on %s is empty: nothing there is attributed "
                    "(is the %s right?)", where,
                    " / ".join(k for k, v in (("kube.node_name", node),
                                              ("kube.namespaces", ns)) if v),
                    extra={"node_name": node, "namespace": ns})

    def answered(self, watcher: Watcher) -> None:
        if watcher.name in self._unhealthy and watcher.name not in self._woke:
            self._woke.add(watcher.name)
            self._wake_others(watcher)

    def _wake_others(self, watcher: Watcher) -> None:
        """The API server answers ``watcher`` again: the others failing retry now, not
        at the end of their own backoffs (up to 30 s apart), so that the kinds come back
        together (a pod created meanwhile otherwise came back long before its
        ReplicaSet, with the ReplicaSet as its workload until then). Told at the first
        page of its list (``answered``): told at its end only, the others waited out a
        37.5k-pod list's seconds first."""
        for _, ws in self.watchers.values():
            for w in ws:
                if w is not watcher and w.name in self._unhealthy:
                    w.retry_now()

    def health(self, watcher: Watcher, healthy: bool) -> None:
        """One warning per way of failing (unreachable, API error 500, ...) when the
        first watcher fails so, and one info line when the last watcher failing so is
        back (or no longer watched), with how long it lasted; the watchers log their
        retries at debug. Every watcher warned on every retry (92 lines in a 46 s
        outage); and one outage for every way of failing hid the ways that came later:
        a CRD failing for good left the API server going away unlogged."""
        if healthy:
            if watcher.name not in self._unhealthy:
                return
            self._settle(watcher.name, "is back", answered=True)
            self._wake_others(watcher)
        else:
            how = watcher.last_error_kind or "failed"
            if self._unhealthy.get(watcher.name) != how:
                # any other way than unreachable is an answer of the server's
                self._settle(watcher.name, f"fails otherwise now: {how}",
                             answered=how != "unreachable")
                outage = self._outages.get(how)
                if outage is None:
                    self._outages[how] = _Outage(self._clock(), {watcher.name})
                    if watcher.name in self._refused_held:
                        self._warn_refused_held(watcher)
                    else:
                        log.warning("watch %s: %s; every watch failing so retries with "
                                    "its backoff (the others failing so are logged at "
                                    "debug level)", watcher.name,
                                    watcher.last_error or "failed")
                else:
                    outage.names.add(watcher.name)
                    log.debug("watch %s: %s", watcher.name, watcher.last_error)
                self._unhealthy[watcher.name] = how
        self._update_stale()

    def _settle(self, name: str, how: str, *, answered: bool = False) -> None:
        """The one way out of ``_unhealthy`` (back, failing otherwise, replaced, dropped):
        the last watcher to leave an outage logs its end. A watcher dropped or replaced
        while failing was discarded alone, and its outage's end never logged.
        ``answered``: the watcher heard from the API server (back, or an API error now),
        so an outage of it unreachable ends with "API server answers again"."""
        why = self._unhealthy.pop(name, None)
        self._woke.discard(name)
        if why is None:
            return
        refused = self._refused_held.get(name)
        if refused is not None and refused[1] == why:  # refused no longer (or not so)
            del self._refused_held[name]
            self._show_unserved(refused[0])
        outage = self._outages[why]
        outage.names.discard(name)
        if outage.names:
            return
        del self._outages[why]
        took = self._clock() - outage.since
        if why == "unreachable" and answered:
            if how == "is back":
                log.info("API server answers again: every watch is back after %.1f s", took)
            else:  # its new failure is an outage of its own, warned of
                log.info("API server answers again after %.1f s (the last watch cut off, "
                         "%s, %s)", took, name, how)
        else:
            log.info("watches failing with %s: none left after %.1f s (the last, %s, %s)",
                     _describe(why), took, name, how)

    def _update_stale(self) -> None:
        """``index.stale`` while any watcher cannot reach the API server, or a kind the
        sync stopped waiting for (``failing_kinds``) has not listed yet: either way the
        index lacks what the cluster holds."""
        stale = bool(self._unhealthy) or bool(self.failing_kinds)
        if stale != self.index.stale:
            if stale:
                log.warning("cluster index STALE: API server unreachable, pods refused or "
                            "a kind failing, serving the last known index")
            else:
                log.info("cluster index current again")
        self.index.stale = stale

    def unserved(self, watcher: Watcher, error: KubeApiError) -> Refusal:
        """The server refused a watch (403 / 404): the kind is unserved until its retry
        time (the recheck interval) has passed; the follower drops its watcher. The
        warning is logged once per episode, not once per refused request. In namespaced
        mode a 403 refuses only its namespace (``_refuse_namespace``): the watcher stays.

        Pods refused cluster-wide (403), or at all (404: the core resource cannot be
        unserved), are an outage instead (``Refusal.OUTAGE``): there is no owner below a
        pod to attribute it to, and dropping the watcher retracted every pod (nothing
        stamped once their tombstones expired) while the proxy stayed ready and not
        stale. The watcher keeps the last known pods and fails (``health``): the index
        stale, readiness waited for at start, the freshness entry left to age.

        So is any kind refused cluster-wide (403) once its watcher held objects: the
        proxy's ClusterRoleBinding removed while it runs. Dropped, the kind's objects were
        retracted, and every pod below them moved to the owner below (a Deployment's pods
        to their ReplicaSets, with new series for each) while the pods themselves were
        kept: attribution changed by a permission, not by the cluster. A kind refused
        before it held anything (at start, a described kind the RBAC never granted) is
        dropped as before: its pods are attributed without it, the forbidden gauge says
        so. A namespace refused in namespaced mode still retracts (``_refuse_namespace``):
        a namespace being deleted loses its RoleBinding before its last objects."""
        gk = watcher.resource.group_kind
        outage = (gk == POD and (error.status == 404 or watcher.namespace is None)) or (
            error.status == 403 and watcher.namespace is None and bool(watcher.held))
        if outage:
            self._refused_held[watcher.name] = (gk, REFUSED.get(error.status, FORBIDDEN))
            self._show_unserved(gk)
            return Refusal.OUTAGE
        if error.status == 403 and watcher.namespace is not None:
            self._refuse_namespace(watcher)
            return Refusal.RETRACT
        if error.status == 404:
            # maybe served as another version now: the reconcile asks discovery at once
            # (``_follow_moved``), and marks it unserved only if not
            self._moved[gk] = watcher.resource
            watcher.synced.set()  # do not hold readiness hostage
            self._kinds_changed.set()
            return Refusal.DROP
        self._mark_unserved(gk, FORBIDDEN)
        self._refused[gk] = self._clock() + self._recheck_interval
        watcher.synced.set()  # do not hold readiness hostage
        self._kinds_changed.set()
        return Refusal.DROP

    def _warn_refused_held(self, watcher: Watcher) -> None:
        """The one warning of an episode of a refusal taken for an outage, saying what
        RBAC is missing."""
        res = watcher.resource.name
        where = (f"in namespace {watcher.namespace}" if watcher.namespace is not None
                 else "cluster-wide")
        if self._refused_held[watcher.name][1] == FORBIDDEN:
            what = (f"RBAC forbids the proxy's service account to list or watch {res} "
                    f"{where}: it needs get, list and watch on {res} (config/rbac/)")
        else:
            what = f"the API server answers 404 to the list or watch of {res}"
        then = (f"serving the last known {len(watcher.held)} {res}, the index stale"
                if self.index.ready or watcher.resource.group_kind != POD
                else "not ready until it may (readiness waits for pods)")
        log.warning("watch %s: %s (%s); %s, retrying every %g s", watcher.name, what,
                    watcher.last_error, then, self.settings.resync_backoff_max_seconds)


class _Outage:
    """The watchers failing one way, and since when (the source's clock): what the line
    at its end says it lasted."""

    __slots__ = ("names", "since")

    def __init__(self, since: float, names: set[str]) -> None:
        self.since = since
        self.names = names


def _describe(how: str) -> str:
    """A way of failing (a watcher's ``last_error_kind``) as the log names it."""
    return "the API server unreachable" if how == "unreachable" else how
