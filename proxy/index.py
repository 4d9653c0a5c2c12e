"""The pod index: the one piece of shared state between the cluster side and the data path.

Sources (snapshot, watches) feed the Karta engine; the engine's change sets are applied
here. The request path never reads it directly: the splice reads its own per-pod table,
which the index's pod listeners (:meth:`PodIndex.subscribe_pods`) keep equal to
:meth:`PodIndex.answer`, hearing of every key whose answer may have changed. Deleted pods
stay as tombstones for ``tombstone_seconds`` so late samples and stale markers still get
their labels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from cachetools import TTLCache

from proxy import contract
from proxy.karta.results import (
    PHASE_REASON_OBJECT_MISSING,
    ChangeSet,
    PodAttribution,
    WorkloadFacts,
    WorkloadRef,
)
from proxy.shared_values import SharedValues

#: Sorted (name, value) pairs, empty values left out. Interned: every pod of one
#: (workload, component, instance, replica) shares the same tuple object.
LabelPairs = tuple[tuple[str, str], ...]

#: (namespace, pod) as a series names them
PodKey = tuple[bytes, bytes]

#: What the fact series name a workload by: (group, kind, namespace, name), no uid
Identity = tuple[str, str, str, str]


def identity(ref: WorkloadRef) -> Identity:
    return (ref.group, ref.kind, ref.namespace, ref.name)


def _preference(wf: WorkloadFacts) -> tuple[bool, str]:
    """Which of two workloads of one identity the fact series describe: the one whose
    object is present (a workload deleted and made again under its name, while pods of
    the old one remain, is two workloads: the old one known from those pods' references
    alone), then the greater uid (any rule every replica applies alike)."""
    return wf.phase_reason != PHASE_REASON_OBJECT_MISSING, wf.ref.uid

DEFAULT_TOMBSTONE_SECONDS = 600.0
#: namespaces whose encoded name the index shares among their pods' keys
#: (``PodIndex._ns_bytes``; ~1.5 MB at 37.5k pods, one bytes per pod otherwise)
_NS_BYTES_MAX = 4096


def stamped_pairs(att: PodAttribution) -> LabelPairs:
    """The labels the contract stamps for an attributed pod, in sorted order."""
    w = att.workload
    if w is None:
        return ()
    values = (
        (contract.LABEL_COMPONENT, att.component),
        (contract.LABEL_GROUP, w.group),
        (contract.LABEL_INSTANCE, att.instance),
        (contract.LABEL_KIND, w.kind),
        (contract.LABEL_NAMESPACE, w.namespace),
        (contract.LABEL_REPLICA, att.replica),
        (contract.LABEL_WORKLOAD, w.name),
    )
    return tuple((k, v) for k, v in values if v)


class _Tombstones(TTLCache[PodKey, str]):
    """Deleted pods (key -> uid) until ``tombstone_seconds`` after their deletion.

    A TTL cache keeps them in expiry order, so an expiry pass costs what expired, not a
    scan of every pod. TTLCache also expires on its own inside an insert or a read; every
    expiry goes through :meth:`expire`, so :attr:`gone` collects them all for the index
    to drop and announce.
    """

    def __init__(self, ttl: float, timer: Callable[[], float]) -> None:
        super().__init__(maxsize=math.inf, ttl=ttl, timer=timer)
        self.gone: list[tuple[PodKey, str]] = []

    def expire(self, time: float | None = None) -> list[tuple[PodKey, str]]:
        items: list[tuple[PodKey, str]] = super().expire(time)
        self.gone.extend(items)
        return items


@dataclass(slots=True)
class _Entry:
    uid: str
    pairs: LabelPairs
    #: None while the pod lives; expiry time (monotonic) once it is a tombstone
    expires: float | None = None


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A deleted pod's name, still answering with its last stamp for ``seconds_left``."""

    uid: str
    pairs: LabelPairs
    seconds_left: float


class PodIndex:
    """(namespace, pod) -> stamped label pairs, plus the facts the fact series publish."""

    def __init__(
        self,
        *,
        tombstone_seconds: float = DEFAULT_TOMBSTONE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tombstone_seconds = tombstone_seconds
        self._clock = clock
        self._by_name: dict[tuple[bytes, bytes], _Entry] = {}
        self._tombstones = _Tombstones(tombstone_seconds, clock)
        self._key_by_uid: dict[str, tuple[bytes, bytes]] = {}
        self._interned: dict[LabelPairs, LabelPairs] = {}
        #: known pods that the engine could not attribute -> (its uid, its reason). The
        #: uid says whose reason it is: a pod re-created under its name can arrive before
        #: its predecessor's deletion (a relist gives the new uid, then retracts the old
        #: one), and that deletion must not take the newcomer's reason with it
        self._unattributed: dict[tuple[bytes, bytes], tuple[str, str]] = {}
        self.pods: dict[str, PodAttribution] = {}
        #: how many of ``pods`` have no workload (kept as they change: the pages show it)
        self.unattributed_pods = 0
        #: counts the change sets applied: a view computed from ``pods`` at one value
        #: holds until it moves (proxy/attribution_page.py caches its listings by it)
        self.generation = 0
        #: every workload the engine reports, by uid (see :meth:`fact_workloads`)
        self.workloads: dict[str, WorkloadFacts] = {}
        #: workload identity -> uid, and for an identity several workloads share (a
        #: workload re-created under its name while pods of the old one remain), all their
        #: uids: the fact series name a workload without its uid, so only one of them is
        #: described (:func:`_preference`); the others are ``shadowed``
        self._identities: dict[Identity, str] = {}
        self._namesakes: dict[Identity, set[str]] = {}
        #: uids of the workloads a namesake is preferred to: left out of the fact series
        self.shadowed: set[str] = set()
        #: True once every required source has delivered its initial state
        self.ready = False
        #: resource name -> unix time it was last known current (list, event, bookmark)
        self.freshness: dict[str, float] = {}
        #: True while a source knows it is cut off (the index is served as last known)
        self.stale = False
        self._listeners: list[Callable[[ChangeSet], None]] = []
        self._pod_listeners: list[Callable[[Collection[PodKey]], None]] = []
        #: each namespace's bytes, shared by the keys of its pods (``_put_pod``)
        self._ns_bytes: SharedValues[bytes] = SharedValues(_NS_BYTES_MAX)

    # -- request path -------------------------------------------------------------------

    def lookup(self, namespace: bytes, pod: bytes) -> LabelPairs | None:
        """Stamped labels for a pod named in a series, or None. O(1), no allocation."""
        entry = self._by_name.get((namespace, pod))
        return entry.pairs if entry is not None else None

    def reason(self, namespace: bytes, pod: bytes) -> str:
        """Why a pod has no labels: the engine's reason, or ``pod_unknown``."""
        hit = self._unattributed.get((namespace, pod))
        return hit[1] if hit is not None else "pod_unknown"

    def answer(self, namespace: bytes, pod: bytes) -> LabelPairs | str | None:
        """What the splice's pod table holds for a pod: its stamped pairs, the reason it
        has none, or None for a pod the index does not know."""
        entry = self._by_name.get((namespace, pod))
        if entry is not None:
            return entry.pairs
        hit = self._unattributed.get((namespace, pod))
        return hit[1] if hit is not None else None

    def uid_of(self, namespace: str, pod: str) -> str | None:
        """The uid of the pod of that name the index holds (the newest: a put of either
        kind takes the name from the other), or None. O(1): the attribution page's."""
        key = (namespace.encode(), pod.encode())
        entry = self._by_name.get(key)
        if entry is not None:
            return entry.uid
        hit = self._unattributed.get(key)
        return hit[0] if hit is not None else None

    def answers(self) -> Iterator[tuple[bytes, bytes, LabelPairs | str]]:
        """Every pod the index knows, with its :meth:`answer` (to fill a pod table)."""
        for (ns, pod), e in self._by_name.items():
            yield ns, pod, e.pairs
        for (ns, pod), (_, reason) in self._unattributed.items():
            if (ns, pod) not in self._by_name:
                yield ns, pod, reason

    # -- cluster side -------------------------------------------------------------------

    def subscribe(self, listener: Callable[[ChangeSet], None]) -> None:
        """Call ``listener`` with every applied change set. No part of the proxy listens
        (the fact series read the index at each write, the pod table follows
        :meth:`subscribe_pods`): it is how a test or a benchmark sees every change."""
        self._listeners.append(listener)

    def subscribe_pods(self, listener: Callable[[Collection[PodKey]], None]) -> None:
        """Call ``listener`` with the (namespace, pod) keys whose :meth:`answer` may have
        changed, after every change set and every tombstone expiry (the splice's pod
        table follows this way)."""
        self._pod_listeners.append(listener)

    def _notify_pods(self, keys: set[PodKey]) -> None:
        if keys:
            for listener in self._pod_listeners:
                listener(keys)

    def apply(self, changes: ChangeSet) -> None:
        if not changes:
            return
        self.generation += 1
        now = self._clock()
        keys: set[PodKey] = set()
        for uid, att in changes.pods.items():
            old = self._key_by_uid.get(uid)
            if old is not None:
                keys.add(old)
            if att is None:
                self._remove_pod(uid, now)
            else:
                self._put_pod(uid, att)
                keys.add(self._key_by_uid[uid])
        for wuid, facts in changes.workloads.items():
            was = self.workloads.get(wuid)
            if facts is None:
                if was is not None:
                    del self.workloads[wuid]
                    self._leave_identity(wuid, identity(was.ref))
                continue
            self.workloads[wuid] = facts
            if was is None:
                self._join_identity(wuid, identity(facts.ref))
            elif was.ref is not facts.ref and identity(was.ref) != identity(facts.ref):
                self._leave_identity(wuid, identity(was.ref))
                self._join_identity(wuid, identity(facts.ref))
            elif self._namesakes:  # (nearly always empty) its facts changed: so may the choice
                ident = identity(facts.ref)
                if ident in self._namesakes:
                    self._choose(ident)
        self._notify_pods(keys)
        for listener in self._listeners:
            listener(changes)

    def _join_identity(self, uid: str, ident: Identity) -> None:
        first = self._identities.setdefault(ident, uid)
        if first == uid and ident not in self._namesakes:
            return  # alone, as nearly every workload is
        self._namesakes.setdefault(ident, {first}).add(uid)
        self._choose(ident)

    def _leave_identity(self, uid: str, ident: Identity) -> None:
        self.shadowed.discard(uid)
        namesakes = self._namesakes.get(ident)
        if namesakes is None:
            if self._identities.get(ident) == uid:
                del self._identities[ident]
            return
        namesakes.discard(uid)
        if self._identities.get(ident) == uid:
            self._identities[ident] = next(iter(namesakes))
        if len(namesakes) > 1:
            self._choose(ident)
        else:
            del self._namesakes[ident]
            self.shadowed -= namesakes

    def _choose(self, ident: Identity) -> None:
        namesakes = self._namesakes[ident]
        preferred = max(namesakes, key=lambda u: _preference(self.workloads[u]))
        self.shadowed |= namesakes
        self.shadowed.discard(preferred)

    def fact_workloads(self) -> dict[str, WorkloadFacts]:
        """The workloads the fact series describe, by uid: one per identity (a copy).

        A label set must never come twice (Prometheus refuses a scrape with a duplicate
        series, and two values of one series in a write contradict each other), and the
        fact series name a workload by its identity, not its uid."""
        out = dict(self.workloads)
        for uid in self.shadowed:
            del out[uid]
        return out

    def _put_pod(self, uid: str, att: PodAttribution) -> None:
        was = self.pods.get(uid)
        self.unattributed_pods += ((att.workload is None)
                                   - (was is not None and was.workload is None))
        self.pods[uid] = att
        key = (self._ns_bytes(att.namespace.encode()), att.pod.encode())
        old_key = self._key_by_uid.get(uid)
        if old_key is not None and old_key != key:  # pods do not rename; be safe anyway
            self._by_name.pop(old_key, None)
        self._key_by_uid[uid] = key
        holder = self._live_holder(key)
        if was is not None and holder is not None and holder != uid:
            # A namesake came after this pod and holds the name: a relist gives the new
            # uid at once but retracts the old one only after its last page, and a change
            # to the old one meanwhile (its owner deleted) took the name from the live
            # newcomer, then tombstoned it with the old labels and let it expire. The
            # name is the newest pod's; this one's attribution stays in ``pods`` only.
            return
        pairs = stamped_pairs(att)
        if not pairs:
            self._unattributed[key] = (uid, att.reason or "unattributed")
            # the newest pod of a name wins, even over a (tombstoned) attributed namesake
            self._by_name.pop(key, None)
            self._tombstones.pop(key, None)
            return
        self._unattributed.pop(key, None)
        pairs = self._interned.setdefault(pairs, pairs)
        self._by_name[key] = _Entry(uid, pairs)
        self._tombstones.pop(key, None)

    def _live_holder(self, key: PodKey) -> str | None:
        """The uid of the live pod that answers for a name (attributed, or not), or None
        (no pod of that name, or only a tombstone)."""
        entry = self._by_name.get(key)
        if entry is not None and entry.expires is None:
            return entry.uid
        hit = self._unattributed.get(key)
        return hit[0] if hit is not None else None

    def _remove_pod(self, uid: str, now: float) -> None:
        was = self.pods.pop(uid, None)
        if was is not None and was.workload is None:
            self.unattributed_pods -= 1
        key = self._key_by_uid.pop(uid, None)
        if key is None:
            return
        hit = self._unattributed.get(key)
        if hit is not None and hit[0] == uid:  # not a namesake's that came after it
            del self._unattributed[key]
        entry = self._by_name.get(key)
        if entry is not None and entry.uid == uid:
            entry.expires = now + self._tombstone_seconds
            self._tombstones[key] = uid

    def expire(self) -> int:
        """Drop tombstones past their time; returns how many. Call periodically."""
        self._tombstones.expire()
        gone, self._tombstones.gone = self._tombstones.gone, []
        dead = []
        for key, uid in gone:
            entry = self._by_name.get(key)
            if entry is not None and entry.uid == uid and entry.expires is not None:
                del self._by_name[key]
                dead.append(key)
        self._notify_pods(set(dead))
        if dead:
            live = {e.pairs for e in self._by_name.values()}
            self._interned = {p: p for p in live}
        return len(dead)

    def mark_fresh(self, resource: str, when: float | None = None) -> None:
        self.freshness[resource] = time.time() if when is None else when

    # -- introspection ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_name)

    def tombstones(self) -> int:
        return len(self._tombstones) + len(self._tombstones.gone)

    def tombstone(self, namespace: bytes, pod: bytes) -> Tombstone | None:
        """A deleted pod whose name still stamps series (its late samples, its stale
        markers), or None: what the attribution pages say of a pod no longer in ``pods``."""
        entry = self._by_name.get((namespace, pod))
        if entry is None or entry.expires is None:
            return None
        return Tombstone(entry.uid, entry.pairs, max(0.0, entry.expires - self._clock()))

