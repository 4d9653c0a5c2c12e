"""Owners the watch has not delivered yet, fetched by one GET each.

A pod placed while its owner (a ReplicaSet) had not reached the proxy walked up to that
absent owner and, its kind being described, made it the workload: the pod's series went
out as ``ReplicaSet/web-2``, then as ``Deployment/web`` once the ReplicaSet arrived: two
label sets of one series, and a made-up workload in the fact series. The watches of
different kinds are separate streams: a ReplicaSet watch behind the pods' (reconnecting
after an error, a relist, ordinary lag) is enough.

So, once the index is ready, an object (a pod, or an owner) whose controller the engine
does not hold, of a kind that is watched, is held back ("parked") while that owner is
fetched with one GET, as the watch would deliver it (whole, or metadata only); the owner
goes through the source's event path first (its own absent owner fetched the same way,
up to ``max_owner_hops``), then what waited for it. A pod parked is unknown to the index
for the GET's round trip, and ``PARK_SECONDS`` at most from the moment it was parked
(queued behind other GETs, behind a slow one, behind its owner's own owner): past that it
is placed as before (the absent owner its workload) and the GET's answer moves it.

- A fetched copy is applied only while its uid is still absent (the watch may have
  delivered it meanwhile); a later watch event of it older than the copy (a watch behind,
  replaying) is skipped, and never replaces the copy while that waits parked itself:
  ``metadata.resourceVersion`` compared when both are decimal
  integers (etcd's are); otherwise events apply as they come.
- A relist of its watcher that does not find it retracts it only if the list is not
  older than the copy (``fetched_after``, asked through the source): a paginated list is
  one snapshot at its first page's version, taking seconds, and an owner created
  meanwhile is not in it. Retracted, its pods (with no ghost of it) moved to the made-up
  workload until the watch's ADDED: what this module exists to prevent. The watch from
  the list's version delivers it or its deletion; a 410 instead, and the next list, past
  the copy, decides. After the store went back, a relist retracts what it does not find
  (the copy's version is of the old history). Past ``MAX_VERSIONS`` copies: as before.
- One GET per uid at a time, ``REFETCH_SECONDS`` apart at least (whatever sends what
  waits back to a GET: no loop of GETs), at most ``CONCURRENCY`` under way; at most
  ``MAX_OWNERS`` owners tracked and ``MAX_PARKED`` objects parked (past either, objects
  go on at once: the old behaviour). Memory grows with pods, never with series.
- A kind no longer watched (dropped at a description reload, or watched at another
  version) before the GET or while it is under way: the copy is dropped (``unwatched``),
  never fed through a stopped watcher whose retraction has already run.
- 404 / 410 or another uid under the name: the owner is gone, not retried; what waited
  goes on (an absent owner, as before). 403: that kind is not fetched again (one warning
  naming the missing ``get``). Anything else (5xx, a timeout, the server unreachable):
  what waited goes on at once (as before), and the GET is retried with a backoff, up to
  ``MAX_ATTEMPTS`` times, while the owner is still absent and something points at it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from proxy import contract
from proxy.karta.model import GroupKind
from proxy.karta.owners import OwnerRef, controller_ref
from proxy.kube.client import ACCEPT_JSON, ACCEPT_METADATA_WATCH, KubeApiError, KubeClient
from proxy.kube.discovery import ApiResource
from proxy.kube.watcher import RETRY_AFTER_MAX, Backoff, Watcher, WatchEvent
from proxy.metrics import present_at_zero
from proxy.tasks import cancel_and_wait

log = logging.getLogger(__name__)

#: ``outcome`` of ``karta_proxy_owner_fetches_total``: the object applied; the watch
#: delivered it first (the copy dropped); not found (or another uid under its name);
#: RBAC refused the GET; it failed (5xx, timeout, unreachable: retried); not made (the
#: bounds on owners tracked or objects parked were reached: once per owner); its kind no
#: longer watched (there, or at that version) before the GET or while it was under way
OUTCOMES = ("fetched", "superseded", "gone", "forbidden", "failed", "skipped", "unwatched")
CONCURRENCY = 16
#: how long an object waits parked at most, from the moment it is parked: queued behind
#: other GETs or behind a slow one, then placed as before (the GET goes on)
PARK_SECONDS = 2.0
#: the least time between two GETs of one owner
REFETCH_SECONDS = 1.0
MAX_OWNERS = 1000
MAX_PARKED = 20_000
#: fetched copies whose resourceVersion a later (older) watch event, and a relist that
#: does not find them, is checked against
MAX_VERSIONS = 10_000
FETCH_TIMEOUT = 5.0
MAX_ATTEMPTS = 5
#: how long a gone owner, or one whose GETs all failed, is not fetched again
FORGET_SECONDS = 60.0

_FETCHING, _RETRYING, _FETCHED, _DONE = "fetching", "retrying", "fetched", "done"


class _Owner:
    """One absent owner being fetched (or recently given up on)."""

    __slots__ = ("depth", "expiry", "late", "namespace", "ref", "state", "task", "until")

    def __init__(self, ref: OwnerRef, namespace: str, depth: int) -> None:
        self.ref = ref
        #: the namespace of the dependent that named it (owners share it, or are
        #: cluster-scoped)
        self.namespace = namespace
        #: how many references above the first object that waited for it it lies
        self.depth = depth
        self.state = _FETCHING
        self.task: asyncio.Task[None] | None = None
        #: for ``_DONE``: when (monotonic) it may be fetched again
        self.until = 0.0
        #: for ``_DONE``: the timer that forgets it then (cancelled by ``stop``)
        self.expiry: asyncio.TimerHandle | None = None
        #: what waited for it went on at its deadline: what comes next goes on at once
        self.late = False


class OwnerFetcher:
    """Parks what waits for an absent owner, fetches the owner, feeds both back."""

    def __init__(
        self,
        client: KubeClient,
        *,
        feed: Callable[[Watcher, list[WatchEvent]], None],
        watcher_for: Callable[[GroupKind, str], Watcher | None],
        holds: Callable[[str], bool],
        pointed_at: Callable[[str], bool],
        ready: Callable[[], bool],
        max_hops: int,
        registry: CollectorRegistry,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``feed``: the source's event path (it calls :meth:`admit` and :meth:`fed`);
        ``watcher_for(kind, namespace)``: the watcher a fetched owner is delivered as
        (None: not watched there, or not listed yet); ``holds`` / ``pointed_at``: the
        engine holds the uid (object, pod or ghost) / something points at it."""
        self._client = client
        self._feed = feed
        self._watcher_for = watcher_for
        self._holds = holds
        self._pointed_at = pointed_at
        self._ready = ready
        self._max_hops = max_hops
        self._backoff_max = backoff_max
        self._clock = clock
        self._sem = asyncio.Semaphore(CONCURRENCY)
        self._owners: dict[str, _Owner] = {}
        #: owner uid -> what waits for it: dependent uid -> (its watcher, its event)
        self._waiting: dict[str, dict[str, tuple[Watcher, WatchEvent]]] = {}
        #: dependent uid -> the owner uid it waits for
        self._parked: dict[str, str] = {}
        #: uid of a fetched copy -> its resourceVersion (oldest first)
        self._versions: dict[str, int] = {}
        #: parked uid -> when (clock) it goes on, whatever it waits for (oldest first)
        self._deadlines: dict[str, float] = {}
        self._reaper: asyncio.Task[None] | None = None
        #: what is being released at its deadline (not parked again on the way)
        self._expired: set[str] = set()
        #: owner uid -> when (clock) its last GET was sent (oldest first)
        self._last_get: dict[str, float] = {}
        #: owners a GET was not made for (over the bounds), counted once each
        self._skipped: dict[str, None] = {}
        #: kinds whose GET RBAC refused: not fetched again
        self.forbidden: set[GroupKind] = set()
        #: stopped: nothing is parked and no task started any more (an event still
        #: coming in goes on at once): a GET or a reaper started after ``stop`` had
        #: nobody to cancel it, and ran on over a client being closed
        self.stopped = False
        self.fetches = present_at_zero(Counter(
            contract.OP_OWNER_FETCHES,
            "GETs of owners the watch had not delivered when something pointing at them "
            "came, by outcome (fetched, superseded: the watch was first, gone: 404, "
            "forbidden: 403, failed: retried, skipped: over the bounds, not made, "
            "unwatched: the kind no longer watched).",
            ["outcome"],
            registry=registry,
        ), OUTCOMES)

    @property
    def parked(self) -> int:
        return len(self._parked)

    async def stop(self) -> None:
        """Cancel the reaper, every GET and every owner's expiry timer; nothing starts
        after this. What waits parked is dropped with them: the source stopping, nothing
        reads the index any more. The timers were left pending: each held the fetcher
        (and through its callbacks the source and its index) for up to
        ``FORGET_SECONDS`` after the stop."""
        self.stopped = True
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
            self._reaper = None
        for owner in list(self._owners.values()):
            if owner.task is not None:
                await cancel_and_wait(owner.task)
        for owner in self._owners.values():
            if owner.expiry is not None:
                owner.expiry.cancel()
                owner.expiry = None
        self._owners.clear()
        self._waiting.clear()
        self._parked.clear()
        self._deadlines.clear()

    # -- the event path --------------------------------------------------------------------

    def admit(self, watcher: Watcher, events: list[WatchEvent]) -> list[WatchEvent]:
        """The events to feed now: those older than a fetched copy dropped, those whose
        owner is being fetched parked."""
        if self.stopped or (not self._versions and not self._parked
                            and not self._ready()):
            return events
        out: list[WatchEvent] = []
        for ev in events:
            etype, obj = ev
            md = obj.get("metadata")
            uid = md.get("uid") if isinstance(md, Mapping) else None
            if not isinstance(uid, str) or not uid or not isinstance(md, Mapping):
                out.append(ev)
                continue
            if etype == "DELETED":
                self._unpark(uid)
                self._versions.pop(uid, None)
            elif self._versions and self._older(uid, md):
                # skipped before anything else: an event older than the copy fetched
                # never replaces it, nor the copy waiting parked (that dropped the copy
                # with the event, and what waited for it waited for good)
                log.debug("watch %s: %s at resourceVersion %s is older than the copy "
                          "fetched; skipped", watcher.name, uid, md.get("resourceVersion"))
                continue
            else:
                self._unpark(uid)  # a newer event of it replaces it
                if self._park(watcher, ev, uid, md):
                    continue
            out.append(ev)
        return out

    def fed(self, events: list[WatchEvent]) -> None:
        """``events`` went to the engine: what waited for one of them goes on."""
        if not self._waiting:
            return
        for _, obj in events:
            # a deletion too: what waited for a parked owner deleted goes on (below a
            # ghost, as before), not until its deadline
            md = obj.get("metadata")
            uid = md.get("uid") if isinstance(md, Mapping) else None
            if isinstance(uid, str) and uid in self._waiting:
                self._release(uid)

    def fetched_after(self, uid: str, version: str) -> bool:
        """A copy of ``uid`` fetched is newer than ``version`` (a list's): both decimal
        integers, and the watch has delivered neither a newer event of it nor its
        deletion (either ends the copy's record)."""
        fetched = self._versions.get(uid)
        return fetched is not None and version.isdecimal() and int(version) < fetched

    def new_history(self) -> None:
        """The store went back (a watcher saw it): forget the versions of the copies
        fetched. Kept, every event and list item of the new history below a copy's old
        version was skipped as older than it: a restored owner that differs from the
        copy (another owner above it) kept the copy's data until an event passed the old
        version. The store is one for every kind: all are forgotten."""
        self._versions.clear()

    def _older(self, uid: str, md: Mapping[str, Any]) -> bool:
        fetched = self._versions.get(uid)
        if fetched is None:
            return False
        rv = md.get("resourceVersion")
        if not isinstance(rv, str) or not rv.isdecimal():
            return False
        if int(rv) < fetched:
            return True
        if int(rv) > fetched:
            del self._versions[uid]  # the watch has caught up
        return False

    def _park(self, watcher: Watcher, ev: WatchEvent, uid: str,
              md: Mapping[str, Any]) -> bool:
        """Whether ``ev`` waits for its owner (fetched now, or on its way)."""
        ref = controller_ref(md.get("ownerReferences"))
        if (ref is None or uid in self._expired or not self._ready()
                or self._holds(ref.uid)):
            return False
        up = ref.uid
        if up in self._parked:  # the owner waits itself (for its own owner)
            if self._on_cycle(up, uid):
                return False
            return self._hold_back(up, uid, watcher, ev)
        owner = self._owners.get(up)
        if owner is not None:
            if owner.state in (_FETCHING, _FETCHED):
                # past its deadline once: the rest go on at once too, as the first did
                return not owner.late and self._hold_back(up, uid, watcher, ev)
            if owner.state == _RETRYING or self._clock() < owner.until:
                return False  # failed lately: the old behaviour until a retry gets it
            self._forget(owner)
        mine = self._owners.get(uid)
        depth = (mine.depth if mine is not None else 0) + 1
        if depth > self._max_hops or ref.gk in self.forbidden:
            return False
        ns = md.get("namespace")
        ns = ns if isinstance(ns, str) else ""
        if self._watcher_for(ref.gk, ns) is None:
            return False  # not watched (or not listed yet: its list delivers it)
        if len(self._parked) >= MAX_PARKED or len(self._owners) >= MAX_OWNERS:
            # counted once per owner (a GET not made), not per event of what names it
            if up not in self._skipped:
                self._skipped[up] = None
                if len(self._skipped) > MAX_OWNERS:
                    del self._skipped[next(iter(self._skipped))]
                self.fetches.labels("skipped").inc()
            return False
        owner = self._owners[up] = _Owner(ref, ns, depth)
        owner.task = asyncio.get_running_loop().create_task(
            self._fetch(owner), name=f"fetch owner {ref.gk}/{ref.name}")
        return self._hold_back(up, uid, watcher, ev)

    def _on_cycle(self, up: str, uid: str) -> bool:
        """``up`` waits, through the owners it waits for, for ``uid``: parking ``uid``
        behind it would park both for good."""
        seen = 0
        node: str | None = up
        while node is not None and seen <= len(self._parked):
            if node == uid:
                return True
            node = self._parked.get(node)
            seen += 1
        return False

    def _hold_back(self, up: str, uid: str, watcher: Watcher, ev: WatchEvent) -> bool:
        self._waiting.setdefault(up, {})[uid] = (watcher, ev)
        self._parked[uid] = up
        # PARK_SECONDS from now, whatever it waits behind (the semaphore's queue, a
        # slow GET, its owner's own owner); deadlines come in order (one delay for all)
        self._deadlines.pop(uid, None)
        self._deadlines[uid] = self._clock() + PARK_SECONDS
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap(), name="owner fetch deadlines")
        return True

    def _unpark(self, uid: str) -> None:
        up = self._parked.pop(uid, None)
        if up is not None:
            self._deadlines.pop(uid, None)
            deps = self._waiting.get(up)
            if deps is not None:
                deps.pop(uid, None)
                if not deps:
                    del self._waiting[up]

    def _release(self, up: str) -> None:
        """What waits for ``up`` goes on (through the event path: it may wait again,
        for another owner)."""
        deps = self._waiting.pop(up, None)
        if not deps:
            return
        for uid in deps:
            del self._parked[uid]
            self._deadlines.pop(uid, None)
        self._feed_grouped(deps.values())

    def _feed_grouped(self, evs: Iterable[tuple[Watcher, WatchEvent]]) -> None:
        by_watcher: dict[int, tuple[Watcher, list[WatchEvent]]] = {}
        for w, ev in evs:
            by_watcher.setdefault(id(w), (w, []))[1].append(ev)
        for w, batch in by_watcher.values():
            self._feed(w, batch)

    async def _reap(self) -> None:
        """Release what has waited ``PARK_SECONDS``: placed as before (its owner absent,
        or the owner's own absent owner its workload); the GET goes on, and its answer
        moves it to its true workload. Queued behind other GETs (200 owners of 0.2 s at
        4 at a time), pods stayed unknown 5.5 s on the median, 10.3 s at most."""
        while self._deadlines:
            first = next(iter(self._deadlines.values()))
            wait = first - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            now = self._clock()
            late: list[str] = []
            for u, t in self._deadlines.items():
                if t > now:
                    break
                late.append(u)
            released: list[tuple[Watcher, WatchEvent]] = []
            for uid in late:
                up = self._parked[uid]
                owner = self._owners.get(up)
                if owner is not None:
                    owner.late = True
                released.append(self._waiting[up][uid])
                self._unpark(uid)
            log.debug("%d objects waited %.1f s for their owners' GETs; placed as before",
                      len(late), PARK_SECONDS)
            self._expired = set(late)
            try:
                self._feed_grouped(released)
            finally:
                self._expired = set()

    # -- the GET ---------------------------------------------------------------------------

    async def _fetch(self, owner: _Owner) -> None:
        uid, ref = owner.ref.uid, owner.ref
        backoff = Backoff(cap=self._backoff_max)
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                asked = 0.0  # what the server asked to wait (a 429's, a 503's Retry-After)
                watcher = self._watcher_for(ref.gk, owner.namespace)
                if watcher is None:
                    self._done(owner, "unwatched", forget=True)
                    return
                await self._spaced(uid)
                try:
                    async with self._sem:
                        self._sent(uid)
                        raw = await self._client.request_bytes(
                            self._path(watcher.resource, owner.namespace, ref.name),
                            accept=ACCEPT_METADATA_WATCH if watcher.metadata_only
                            else ACCEPT_JSON, timeout=FETCH_TIMEOUT)
                    obj = json.loads(raw)
                except KubeApiError as e:
                    if e.status in (404, 410):
                        self._done(owner, "gone")
                        return
                    if e.status == 403:
                        self._forbid(watcher.resource, e)
                        self._done(owner, "forbidden")
                        return
                    why = str(e)
                    asked = min(e.retry_after or 0.0, RETRY_AFTER_MAX)
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
                    why = f"{type(e).__name__}: {e}"
                else:
                    if self._watcher_for(ref.gk, owner.namespace) is not watcher:
                        # dropped (or watched at another version) meanwhile: its copy fed
                        # through a stopped watcher, nothing would ever retract it
                        self._done(owner, "unwatched", forget=True)
                        return
                    md = obj.get("metadata") if isinstance(obj, dict) else None
                    if not isinstance(md, dict) or md.get("uid") != uid:
                        self._done(owner, "gone")  # another object under its name now
                        return
                    self._apply(owner, watcher, obj)
                    return
                self.fetches.labels("failed").inc()
                log.debug("GET of owner %s %s/%s failed (attempt %d): %s", ref.gk,
                          owner.namespace, ref.name, attempt, why)
                owner.state = _RETRYING
                self._release(uid)  # meanwhile: the old behaviour
                if attempt == MAX_ATTEMPTS:
                    break
                # a server shedding load (API Priority and Fairness' 429) says how long
                # to wait: the backoff alone came back within it, up to 5 GETs an owner
                await asyncio.sleep(max(backoff.next(), asked))
                if self._holds(uid) or not self._pointed_at(uid):
                    self._forget(owner)
                    return
            self._give_up(owner)
        except asyncio.CancelledError:
            raise
        except Exception:  # never leave what waits parked for good
            log.exception("fetching owner %s %s/%s failed", ref.gk, owner.namespace,
                          ref.name)
            self._forget(owner)
            self._release(uid)

    async def _spaced(self, uid: str) -> None:
        """Wait until ``REFETCH_SECONDS`` since this owner's last GET: whatever sends
        what waits for it back to a new GET, no tight loop of GETs of one object. One
        did: a copy taken for superseded, what waited parked again at once, 1,984 GETs
        of one ReplicaSet in 2 s."""
        last = self._last_get.get(uid)
        if last is not None:
            wait = last + REFETCH_SECONDS - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)

    def _sent(self, uid: str) -> None:
        now = self._clock()
        self._last_get.pop(uid, None)
        self._last_get[uid] = now
        while self._last_get:  # oldest first: those past the interval are no longer needed
            first = next(iter(self._last_get))
            if self._last_get[first] + REFETCH_SECONDS >= now:
                break
            del self._last_get[first]

    @staticmethod
    def _path(res: ApiResource, namespace: str, name: str) -> str:
        return f"{res.path(namespace if res.namespaced else None)}/{name}"

    def _apply(self, owner: _Owner, watcher: Watcher, obj: dict[str, Any]) -> None:
        """The fetched copy, through the event path, if the owner is still absent."""
        uid = owner.ref.uid
        md = obj["metadata"]
        if self._holds(uid) or uid in self._parked:
            # delivered by the watch meanwhile (held, or parked itself). Not "in the
            # watcher's held": a watch event skipped as older than a copy is held there
            # and not by the engine, and a copy dropped for it sent what waited back to
            # a new GET, in a loop
            self._forget(owner)
            self.fetches.labels("superseded").inc()
            if uid not in self._parked:  # else: what waits goes on once it does
                self._release(uid)
            return
        self.fetches.labels("fetched").inc()
        obj["apiVersion"] = watcher.resource.api_version
        obj["kind"] = watcher.resource.kind
        # held as the watch holds it: a relist that no longer finds it retracts it (but
        # for one older than this copy, ``fetched_after``)
        watcher.held[uid] = f"{md.get('namespace', '')}/{md.get('name', '')}"
        owner.state = _FETCHED
        try:
            self._feed(watcher, [("ADDED", obj)])
        finally:
            self._forget(owner)
        rv = md.get("resourceVersion")
        if isinstance(rv, str) and rv.isdecimal():
            self._versions.pop(uid, None)
            self._versions[uid] = int(rv)
            while len(self._versions) > MAX_VERSIONS:
                del self._versions[next(iter(self._versions))]
        if uid not in self._parked:  # fed (else: what waits goes on once it is)
            self._release(uid)

    def _done(self, owner: _Owner, outcome: str, *, forget: bool = False) -> None:
        """``forget``: may be fetched again at once (else ``FORGET_SECONDS`` later)."""
        self.fetches.labels(outcome).inc()
        if forget:
            self._forget(owner)
        else:
            self._give_up(owner)
        self._release(owner.ref.uid)

    def _give_up(self, owner: _Owner) -> None:
        """Not fetched again for ``FORGET_SECONDS``; then forgotten by its timer (or
        named again once its time is over, by ``_park``). ``_prune``, which forgot
        such owners only when the table was full (``MAX_OWNERS``), let the table grow
        with time under churn (a RayJob deleted, its RayCluster's GET a 404: 2, 4, 6 ...
        14 entries over six cycles of a soak with 5 live pods); next to the timers it
        freed nothing they had not (each fires at its owner's time) and was removed: a
        table full of owners given up on skips new ones until their timers free it, the
        bound holding either way (``test_owners_given_up_on_stay_within_the_bound...``)."""
        owner.state, owner.task = _DONE, None
        owner.until = self._clock() + FORGET_SECONDS
        owner.expiry = asyncio.get_running_loop().call_later(
            FORGET_SECONDS, self._expire, owner)

    def _expire(self, owner: _Owner) -> None:
        owner.expiry = None
        self._forget(owner)

    def _forget(self, owner: _Owner) -> None:
        if owner.expiry is not None:
            owner.expiry.cancel()
            owner.expiry = None
        if self._owners.get(owner.ref.uid) is owner:
            del self._owners[owner.ref.uid]

    def _forbid(self, res: ApiResource, error: KubeApiError) -> None:
        if res.group_kind in self.forbidden:
            return
        self.forbidden.add(res.group_kind)
        log.warning("RBAC forbids the proxy's service account to get %s (%s): owners of "
                    "that kind the watch has not delivered yet are not fetched (until a "
                    "restart); their pods are placed below them meanwhile, as the owner "
                    "itself. Grant get with list and watch on %s (config/rbac/)",
                    res.name, error, res.name)

