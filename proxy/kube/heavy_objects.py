"""Heavy described objects' updates, their facts evaluated off the event loop.

An object whose facts take long to evaluate (an Argo Workflow of 3,000 nodes: a 1.7 MB
text, ~160-250 ms of its pack and the jq sandbox's round trip) held the event loop that
long at every update, in one piece: relayed requests waited for it (p99 ~5-9 ms ->
~375 ms), and ten such objects updated every second needed more loop than there is
(docs/performance.md, "Heavy objects updated often"). The jq work happens in the
sandbox's child, so a thread that waits for it frees the loop; with the in-process runner
nothing would be gained (libjq's binding holds the GIL), so the source defers only when
the jq sandbox is the runner.

The watch source hands here the updates (``MODIFIED``, a relist's ``ADDED``) of the
objects the engine found heavy (:meth:`proxy.karta.engine.Engine.heavy`), keyed by uid:
a newer version replaces the one waiting (latest version wins, so a stream of updates
never queues more than one version per object). One task takes them one at a time, has
the engine's :class:`~proxy.karta.engine.FactsWork` run in one thread of its own
(``karta-jq_0``), and feeds the object with what it prepared, as the source feeds any
(``feed``). An event the source feeds at once for a uid waiting here, or being evaluated
(a deletion, a version of an object no longer heavy), supersedes that version: it is
dropped, or its result discarded when it comes back.

A description's change (a Karta object's, a reload's files) owes the objects of its
kinds a new attribution, each with what lies below it, given in runs on the loop: each
heavy workload object among them had its facts evaluated under the new plan in its run,
on the loop (~150-250 ms each). Those are handed here instead (:meth:`HeavyObjects.owe`):
their held text evaluated in the thread under the plan now in force
(:meth:`~proxy.karta.engine.Engine.held_facts_work`), then the object re-attributed with
them (``reattribute``), ahead of the updates waiting. The engine uses the facts only
while the object keeps that text and the plan is in force (a watch event or a newer
description since: it evaluates them itself, the same result); a newer change owing the
object again supersedes the re-evaluation waiting or under way. An update still waiting
is evaluated under the description in force when its turn comes
(:meth:`~proxy.karta.engine.Engine.replanned`): taken before a change, its facts under the
old one would go unused, made again on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter

from proxy import contract
from proxy.karta.engine import FactsWork, Prepared
from proxy.metrics import present_at_zero
from proxy.tasks import cancel_and_wait
from proxy.thread_names import named_pool

log = logging.getLogger(__name__)

#: ``outcome`` of ``karta_proxy_deferred_object_updates_total``: evaluated off the loop
#: and applied; dropped for a newer version, a deletion or a newer description change
#: that came first
OUTCOMES: Final = ("applied", "superseded")
#: the evaluating thread's name prefix (``karta-jq_0`` for the OS too)
THREAD_PREFIX: Final = "karta-jq"


class HeavyEngine(Protocol):
    """What :class:`HeavyObjects` needs of the engine."""

    def heavy(self, uid: str) -> bool: ...

    def facts_work(self, obj: Mapping[str, Any]) -> FactsWork | None: ...

    def held_facts_work(self, uid: str) -> FactsWork | None: ...

    def replanned(self, work: FactsWork) -> FactsWork | None: ...


#: how an object goes to the engine and its change set to the index: the source's
#: (``KubeSource._feed_one``), given what was prepared for it; False: the engine failed
#: on it (counted and logged there)
Feed = Callable[[dict[str, Any], Prepared], bool]
#: how an object owed a new attribution is given it, with its facts prepared: the
#: source's (``KubeSource._reattribute_one``); False as for :data:`Feed`
Reattribute = Callable[[str, Prepared], bool]


def _uid(obj: Mapping[str, Any]) -> str | None:
    md = obj.get("metadata")
    uid = md.get("uid") if isinstance(md, Mapping) else None
    return uid if isinstance(uid, str) and uid else None


@dataclass(slots=True)
class _Flight:
    """The version or re-evaluation being evaluated in the thread, and what the events fed
    at once for its object since made of it."""

    uid: str
    #: a re-evaluation after a description change (no stub), not an update
    owed: bool
    #: its result useless, dropped: an update's object changed or gone, or a newer change
    #: owing a re-evaluation again
    superseded: bool = False
    #: a re-evaluation's object changed or gone: its facts unused, its re-attribution
    #: still given, counted superseded
    stale: bool = False


class HeavyObjects:
    """The heavy objects' versions waiting for their facts, the task that has them
    evaluated in a thread and fed, and the counter of what became of them."""

    def __init__(self, engine: HeavyEngine, feed: Feed, reattribute: Reattribute, *,
                 registry: CollectorRegistry) -> None:
        self._engine = engine
        self._feed = feed
        self._reattribute = reattribute
        #: uid -> the latest version's work waiting, in the order the uids began to wait
        #: (a newer version keeps its uid's place):
        #: its kept text and stub, not its parsed dicts (~5x the text)
        self._pending: dict[str, FactsWork] = {}
        #: uid -> its re-evaluation owed after a description change (a work without a
        #: stub), in the order owed: taken before the updates
        self._owed: dict[str, FactsWork] = {}
        #: the version (or re-evaluation) being evaluated in the thread
        self._flight: _Flight | None = None
        self._wake = asyncio.Event()
        #: set while nothing waits and nothing is being evaluated (:meth:`settled`)
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._pool = named_pool(THREAD_PREFIX, 1)
        self.updates = present_at_zero(Counter(
            contract.OP_DEFERRED_OBJECT_UPDATES,
            "Updates of heavy described objects, and their re-evaluations after a "
            "description change, whose facts were evaluated off the event loop, by "
            "outcome (applied; superseded: a newer version, a deletion or a newer "
            "description change came first).",
            ["outcome"],
            registry=registry,
        ), OUTCOMES)

    def start(self) -> None:
        """The task that drains what waits (on the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._drain(), name="kube heavy objects")

    async def stop(self) -> None:
        """Cancel the task and end the thread: an evaluation under way ends within the jq
        time limit, its result unused; what waits is dropped (the source is stopping)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
        self._owed.clear()
        self._idle.set()

    def take(self, events: list[tuple[str, dict[str, Any]]]
             ) -> list[tuple[str, dict[str, Any]]]:
        """The events to feed now; the updates of heavy objects are kept here instead (a
        version already waiting replaced). An event fed now for a uid that has a version
        waiting or being evaluated supersedes it."""
        out: list[tuple[str, dict[str, Any]]] = []
        for ev in events:
            etype, obj = ev
            uid = _uid(obj)
            if uid is None:
                out.append(ev)
                continue
            work = (self._engine.facts_work(obj)
                    if etype != "DELETED" and self._engine.heavy(uid) else None)
            if work is not None:
                # a newer version takes the waiting one's place in line, not the back: an
                # object updated more often than the line moves would never reach its
                # front, its facts never refreshed while it keeps changing
                if uid in self._pending:
                    self.updates.labels("superseded").inc()
                self._pending[uid] = work
                self._idle.clear()
                self._wake.set()
                continue
            if self._pending.pop(uid, None) is not None:
                self.updates.labels("superseded").inc()
            flight = self._flight
            if flight is not None and flight.uid == uid:
                # a re-evaluation's object changed or gone: its facts will go unused, its
                # re-attribution is still owed; an update's result is useless
                if flight.owed:
                    flight.stale = True
                else:
                    flight.superseded = True
            out.append(ev)
        return out

    def owe(self, uids: list[str]) -> list[str]:
        """The objects a description change owes a new attribution to give now; the heavy
        workload objects among them are re-evaluated here first (one waiting or under way
        superseded: its plan is no longer the newest)."""
        out: list[str] = []
        for uid in uids:
            work = self._engine.held_facts_work(uid) if self._engine.heavy(uid) else None
            if self._owed.pop(uid, None) is not None:
                self.updates.labels("superseded").inc()
            flight = self._flight
            if flight is not None and flight.uid == uid and flight.owed:
                flight.superseded = True
            if work is None:
                out.append(uid)
                continue
            self._owed[uid] = work
            self._idle.clear()
            self._wake.set()
        return out

    @property
    def pending(self) -> int:
        """Versions and re-evaluations waiting (not counting the one being evaluated)."""
        return len(self._pending) + len(self._owed)

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing is being evaluated."""
        return self._idle.is_set()

    async def settled(self) -> None:
        """Until nothing waits and nothing is being evaluated (tests)."""
        await self._idle.wait()

    async def _drain(self) -> None:
        while True:
            # the re-evaluations first: an update of the same object waiting was taken
            # under the old plan, or under the new one, which its workload is under only
            # once re-attributed (their facts used then, not evaluated again on the loop)
            line = self._owed or self._pending
            if not line:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            uid = next(iter(line))
            # no local of this loop holds the work: the last version's text (and its
            # result) would outlive its use while the loop waits, for hours maybe
            await self._evaluate(uid, line.pop(uid))

    async def _evaluate(self, uid: str, work: FactsWork) -> None:
        """One version's facts evaluated in the thread, then fed (a re-evaluation's: the
        object re-attributed), unless superseded."""
        loop = asyncio.get_running_loop()
        stub = work.stub
        # under the description in force now: one changed while it waited; a
        # re-evaluation's object as held now: deleted, changed or evaluated on the loop
        # while it waited (a pod's event), nothing is left to evaluate of its text
        current = (self._engine.replanned(work) if stub is not None
                   else self._engine.held_facts_work(uid))
        stale = False
        if current is None:  # nothing to evaluate (its kind no longer described, ...)
            if stub is None:
                self.updates.labels("superseded").inc()
            prepared = work.unevaluated()
        else:
            flight = self._flight = _Flight(uid, owed=stub is None)
            try:
                prepared = await loop.run_in_executor(self._pool, current.run)
            except Exception:
                log.warning("evaluating the facts of a heavy object off the event loop "
                            "failed; evaluating them on it", exc_info=True,
                            extra={"uid": uid})
                prepared = current.unevaluated()
            finally:
                self._flight = None
            if flight.superseded:
                self.updates.labels("superseded").inc()
                return
            stale = flight.stale
        # fed as the source feeds any event, the stub in the object's place with its
        # kept text (without facts when the thread failed: evaluated here as before)
        try:
            applied = (self._reattribute(uid, prepared) if stub is None
                       else self._feed(stub, prepared))
        except Exception:  # the source's own failure: this task must go on
            log.exception("feeding a heavy object's update failed", extra={"uid": uid})
            return
        if stale:
            self.updates.labels("superseded").inc()
        elif applied and prepared.facts is not None:
            self.updates.labels("applied").inc()
