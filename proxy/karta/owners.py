"""The owner graph: which object controls which, kept for upward walks and downward fan-out.

Objects arrive in any order (a pod before its ReplicaSet, a ReplicaSet before its
Deployment). The graph therefore records every controller reference as an edge even while
the owner is absent: the reverse map (owner uid -> dependents) is both the owner "cache,
misses included" of upstream and the list of exactly the pods and objects to re-attribute
when that owner appears, changes owner or goes away. Nothing here knows about
descriptions; the walk asks a callback whether a kind is described.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from proxy.karta.model import GroupKind
from proxy.karta.packed import Packed
from proxy.shared_values import SharedValues

T = TypeVar("T")

#: Unattributed reasons (snake_case; they become label values of the proxy's own metrics).
REASON_NO_CONTROLLER_OWNER = "no_controller_owner"
REASON_NO_DESCRIBED_OWNER = "no_described_owner"
REASON_OWNER_MISSING = "owner_missing"
REASON_HOP_LIMIT = "hop_limit"
REASON_DESCRIPTION_ERROR = "description_error"

POD = GroupKind("", "Pod")
#: a static pod's mirror is controlled by its Node (see ``slim.pod_controller``)
NODE = GroupKind("", "Node")

_GK_CACHE: dict[tuple[str, str], GroupKind] = {}
#: an OwnerRef keeps one apiVersion string for all owners of it, not its parse's copy
#: ("apps/v1" once, not once per owner: ~1 MB at 37.5k pods)
_API_VERSIONS: SharedValues[str] = SharedValues(10_000)


def group_kind(api_version: str, kind: str) -> GroupKind:
    """Interned GroupKind: every pod of a ReplicaSet shares one object, not a copy each."""
    key = (api_version, kind)
    gk = _GK_CACHE.get(key)
    if gk is None:
        if len(_GK_CACHE) > 10_000:  # hostile input must not grow this without bound
            _GK_CACHE.clear()
        gk = _GK_CACHE[key] = GroupKind.from_api_version(api_version, kind)
    return gk


class OwnerRef:
    """A ``controller: true`` ownerReference: enough to name an owner that was never seen."""

    __slots__ = ("api_version", "gk", "name", "uid")

    def __init__(self, uid: str, gk: GroupKind, name: str, api_version: str) -> None:
        self.uid = uid
        self.gk = gk
        self.name = name
        self.api_version = api_version

    def same(self, other: OwnerRef | None) -> bool:
        return (
            other is not None
            and other.uid == self.uid
            and other.gk == self.gk
            and other.name == self.name
        )

    def __repr__(self) -> str:
        return f"OwnerRef({self.gk}/{self.name} uid={self.uid})"


def controller_ref(refs: Any) -> OwnerRef | None:
    """The controller reference of an ownerReferences list; malformed entries are skipped."""
    if not isinstance(refs, list):
        return None
    for ref in refs:
        if not isinstance(ref, Mapping) or ref.get("controller") is not True:
            continue
        uid, kind, api_version = ref.get("uid"), ref.get("kind"), ref.get("apiVersion")
        if isinstance(uid, str) and uid and isinstance(kind, str) and isinstance(api_version, str):
            name = ref.get("name")
            return OwnerRef(uid, group_kind(api_version, kind),
                            name if isinstance(name, str) else "", _API_VERSIONS(api_version))
    return None


@dataclass(slots=True, eq=False)
class ObjectRecord:
    """A non-pod object as the engine keeps it.

    ``obj`` is the (trimmed, packed) object only for described kinds, whose status, scale and
    instance ids are evaluated; owners of other kinds keep identity and owner only.
    ``cache`` holds whatever the engine derived from ``obj`` (reset on every change; typed
    ``Any`` because that type lives in the engine, above this module).
    """

    uid: str
    gk: GroupKind
    namespace: str
    name: str
    owner: OwnerRef | None
    obj: Mapping[str, Any] | Packed | None
    cache: Any = field(default=None, init=False)
    #: uid of the workload this described object belongs to ("" when none)
    member: str = field(default="", init=False)


@dataclass(slots=True)
class Ghost:
    """What an owner that was removed while something still pointed at it leaves behind
    for a while: enough to walk through it (its kind, namespace, name and its own
    controller reference), as through an absent owner whose owner is still known.

    Kubernetes' background deletion removes a Deployment, then its ReplicaSets, then their
    pods (which terminate gracefully, and are scraped meanwhile): without the ghost, the
    ReplicaSet's reference to the Deployment went with it, and its pods' walks stopped at
    the ReplicaSet, a workload of its own for the rest of their lives."""

    uid: str
    gk: GroupKind
    namespace: str
    name: str
    owner: OwnerRef | None
    #: when it is dropped (the graph's clock)
    expires: float


class _Dependents:
    __slots__ = ("ref", "uids")

    def __init__(self, ref: OwnerRef) -> None:
        self.ref = ref
        self.uids: set[str] = set()


@dataclass(slots=True, eq=False)
class WalkResult(Generic[T]):
    """The topmost described element reached, or the reason none was."""

    described: T | None
    uid: str
    obj: ObjectRecord | None
    ref: OwnerRef | None
    reason: str
    #: uid of the pod the chain ended at, when it ended at a present pod without a
    #: controller before any described kind (the engine makes that pod the workload)
    root_pod: str = ""
    #: the walk stopped at the hop limit above ``obj``, a present described object: the
    #: object's own walk (which starts higher) may reach further
    cut: bool = False


class OwnerGraph:
    """Objects by uid, controller edges both ways, and the bounded upward walk."""

    def __init__(self, max_hops: int, pods: Mapping[str, Any], *,
                 ghost_seconds: float = 0.0, max_ghosts: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        self.max_hops = max_hops
        self.objects: dict[str, ObjectRecord] = {}
        #: owners removed while something pointed at them (:class:`Ghost`), oldest first
        #: (so in expiry order): kept ``ghost_seconds``, at most ``max_ghosts`` of them
        self.ghosts: dict[str, Ghost] = {}
        self.ghost_seconds = ghost_seconds
        self.max_ghosts = max_ghosts
        self._clock = clock
        #: ghosts dropped for the count bound, for the caller to re-place what walked
        #: through them (:meth:`take_evicted`)
        self._evicted: list[str] = []
        #: pods can own objects too (a LeaderWorkerSet leader pod owns its workers'
        #: StatefulSet); records with an ``owner`` attribute, walked as kind Pod
        self._pods = pods
        self._dependents: dict[str, _Dependents] = {}
        #: kind -> number of live edges pointing at an owner of that kind
        self.owner_kinds: Counter[GroupKind] = Counter()
        #: set when a kind first appears on, or last disappears from, the edges
        self.kinds_touched = False

    # -- edges ----------------------------------------------------------------------------

    def link(self, child_uid: str, ref: OwnerRef) -> OwnerRef:
        """Record ``child -> ref``; returns the shared OwnerRef to keep (one per owner)."""
        dep = self._dependents.get(ref.uid)
        if dep is None:
            dep = self._dependents[ref.uid] = _Dependents(ref)
            self._count_kind(ref.gk, +1)
        elif not dep.ref.same(ref):
            # children disagree about the owner's kind or name: keep the newest
            self._count_kind(dep.ref.gk, -1)
            self._count_kind(ref.gk, +1)
            dep.ref = ref
        dep.uids.add(child_uid)
        return dep.ref

    def unlink(self, child_uid: str, ref: OwnerRef) -> None:
        dep = self._dependents.get(ref.uid)
        if dep is None:
            return
        dep.uids.discard(child_uid)
        if not dep.uids:
            del self._dependents[ref.uid]
            self._count_kind(dep.ref.gk, -1)

    def _count_kind(self, gk: GroupKind, delta: int) -> None:
        n = self.owner_kinds[gk] + delta
        if n <= 0:
            del self.owner_kinds[gk]
            self.kinds_touched = True
        else:
            self.owner_kinds[gk] = n
            if n == 1 and delta > 0:
                self.kinds_touched = True

    def absent_owners(self) -> list[tuple[str, GroupKind]]:
        """(uid, kind) of every owner some child points at that is not present itself
        (not watched, or not seen yet)."""
        objects = self.objects
        return [(uid, dep.ref.gk) for uid, dep in self._dependents.items()
                if uid not in objects]

    def dependents(self, uid: str) -> set[str]:
        dep = self._dependents.get(uid)
        return dep.uids if dep is not None else set()

    def topmost(self, uids: list[str]) -> list[str]:
        """``uids`` without those that lie below another of them, in their order.

        For what a description change owes, each given with what lies below it: when two
        kinds change at once (a Deployment's and a ReplicaSet's description), a ReplicaSet
        owed under its Deployment and again as itself would be re-attributed twice, with
        all its pods. One on an owner cycle back to itself is kept, so a cycle of owed
        objects is never dropped whole."""
        among = set(uids)
        out = []
        for uid in uids:
            ref = self._owner(uid)
            below = False
            for _ in range(self.max_hops):
                if ref is None:
                    break
                if ref.uid == uid:  # on a cycle back to itself
                    below = False
                    break
                below = below or ref.uid in among
                ref = self._owner(ref.uid)
            if not below:
                out.append(uid)
        return out

    def _owner(self, uid: str) -> OwnerRef | None:
        """The controller reference of the object, pod or ghost ``uid``; None for a root
        or one not held."""
        rec = self.objects.get(uid)
        if rec is not None:
            return rec.owner
        pod = self._pods.get(uid)
        if pod is not None:
            return pod.owner
        ghost = self.ghosts.get(uid)
        return ghost.owner if ghost is not None else None

    def add_descendants(self, uid: str, into: dict[str, None]) -> None:
        """Add every pod and object below ``uid`` to ``into``, nearest first (cycles
        tolerated), skipping what is there already and what lies below it.

        For a caller gathering the objects below many (a run of what a description change
        owes): when everything in ``into`` came with all its descendants, the walk stops
        at what is there, so a subtree shared by two of them is walked once. ``uid``
        itself is not added, only what lies below it."""
        dependents = self._dependents
        stack = [uid]
        while stack:
            dep = dependents.get(stack.pop())
            if dep is None:
                continue
            for child in dep.uids:
                if child not in into:
                    into[child] = None
                    stack.append(child)

    def add_within_reach(self, uid: str, into: dict[str, None]) -> None:
        """Add to ``into`` the pods and objects below ``uid`` whose attribution can
        change when ``uid`` does (appears, goes, changes owner, kind, name or namespace,
        or the instance ids its workload's pods are checked against): the objects up to
        ``max_hops`` references below it, and the pods up to twice that. ``uid`` itself
        is not added.

        An object's walk (:meth:`walk`, its membership) reads the owners up to
        ``max_hops`` references above it, and of the one past those only the uid (its
        own record's reference), for a cycle; a pod's walk reads as much and, when the
        limit stops it above a described object it passed, goes on with that object's
        own walk (``Engine._attribute_pod``): up to ``2 * max_hops`` above the pod. What
        lies deeper cannot reach ``uid``, whatever it is. Re-attributing everything
        below (:meth:`add_descendants`) made an owner added to the bottom of a chain of
        N owners re-attribute the N below it: N^2 / 2 walks for the chain, which any
        tenant can make (docs/karta-attribution.md, "Long chains")."""
        dependents = self._dependents
        pods = self._pods
        hops = self.max_hops
        seen = {uid}
        level = [uid]
        depth = 0
        while level and depth < 2 * hops:
            depth += 1
            deeper: list[str] = []
            for parent in level:
                dep = dependents.get(parent)
                if dep is None:
                    continue
                for child in dep.uids:
                    if child in seen:
                        continue
                    seen.add(child)
                    deeper.append(child)
                    if depth <= hops or child in pods:
                        into[child] = None
            level = deeper

    # -- objects --------------------------------------------------------------------------

    def put(self, rec: ObjectRecord) -> ObjectRecord | None:
        """Store ``rec``; returns the record it replaced. Keeps the edge to its owner.

        A ghost of its uid is dropped: the object is back (its edge, if the same, kept)."""
        old = self.objects.get(rec.uid)
        ghost = self.ghosts.pop(rec.uid, None) if self.ghosts else None
        old_owner = old.owner if old is not None else ghost.owner if ghost is not None else None
        if old_owner is not None and rec.owner is not None and old_owner.same(rec.owner):
            rec.owner = old_owner  # same edge: keep the shared reference
        else:
            if old_owner is not None:
                self.unlink(rec.uid, old_owner)
            if rec.owner is not None:
                rec.owner = self.link(rec.uid, rec.owner)
        self.objects[rec.uid] = rec
        return old

    def remove(self, uid: str) -> ObjectRecord | None:
        """Forget the object ``uid``; while something points at it, it stays a ghost
        (:meth:`bury`)."""
        old = self.objects.pop(uid, None)
        if old is None:
            return None
        buried = self.bury(uid, old.gk, old.namespace, old.name, old.owner)
        if old.owner is not None and not buried:
            self.unlink(uid, old.owner)
        return old

    # -- ghosts ---------------------------------------------------------------------------

    def bury(self, uid: str, gk: GroupKind, namespace: str, name: str,
             owner: OwnerRef | None) -> bool:
        """Keep a ghost of an object or pod being removed, if anything else (a pod, an
        object, a ghost) points at it; returns whether it did. The ghost keeps the edge to
        its own owner (the reverse map still finds what lies below that owner through it),
        until it is dropped. The caller forgets the object itself."""
        if self.ghost_seconds <= 0 or self.max_ghosts <= 0 or self._clock is None:
            return False
        dep = self._dependents.get(uid)
        if dep is None or not any(child != uid for child in dep.uids):
            return False
        self.ghosts.pop(uid, None)
        self.ghosts[uid] = Ghost(uid, gk, namespace, name, owner,
                                 self._clock() + self.ghost_seconds)
        while len(self.ghosts) > self.max_ghosts:
            oldest = next(iter(self.ghosts))
            self._drop_ghost(oldest)
            self._evicted.append(oldest)
        return True

    def unbury(self, uid: str) -> Ghost | None:
        """Drop the ghost of ``uid`` (a pod of that uid is back; objects: :meth:`put`)."""
        if uid not in self.ghosts:
            return None
        return self._drop_ghost(uid)

    def _drop_ghost(self, uid: str) -> Ghost:
        ghost = self.ghosts.pop(uid)
        if ghost.owner is not None:
            self.unlink(uid, ghost.owner)
        return ghost

    def expire(self) -> list[str]:
        """Drop the ghosts past their time, and those dropped for the count bound since
        the last call; returns their uids: what lies below each must be placed again."""
        gone = self.take_evicted()
        if not self.ghosts or self._clock is None:
            return gone
        now = self._clock()
        while self.ghosts:
            uid, ghost = next(iter(self.ghosts.items()))
            if ghost.expires > now:
                break
            self._drop_ghost(uid)
            gone.append(uid)
        return gone

    def take_evicted(self) -> list[str]:
        """The ghosts dropped for the count bound since the last call."""
        gone, self._evicted = self._evicted, []
        return gone

    # -- the walk -------------------------------------------------------------------------

    def foreign(self, uid: str, namespace: str) -> bool:
        """``uid`` is held, as a namespaced object or a pod in another namespace than
        ``namespace``, the dependent's (``""``: cluster-scoped): absent to that dependent.

        As for Kubernetes (its garbage collector: "cross-namespace owner references are
        disallowed by design"): a namespaced dependent may name owners in its own
        namespace or cluster-scoped ones, a cluster-scoped dependent cluster-scoped ones
        only. A reference carrying the uid of another namespace's object must not put a
        pod into that namespace's workload. (:meth:`walk` tests the same inline.)"""
        rec = self.objects.get(uid)
        if rec is not None:
            return bool(rec.namespace) and rec.namespace != namespace
        pod = self._pods.get(uid)
        if pod is not None:
            return bool(pod.namespace != namespace)
        ghost = self.ghosts.get(uid)
        return ghost is not None and bool(ghost.namespace) and ghost.namespace != namespace

    def walk(
        self,
        start: OwnerRef | None,
        namespace: str,
        described: Callable[[GroupKind], T | None],
        errored: Callable[[GroupKind], bool],
        top: WalkResult[T] | None = None,
    ) -> WalkResult[T]:
        """Follow controller references up from ``start``; the highest described one wins.

        ``namespace`` is the namespace of the dependent ``start`` is the reference of.
        ``top`` is what the caller already holds (a described object walking from itself).
        An absent owner ends the walk; if its kind is described (known from the
        reference), it is the workload, identified by the reference alone.

        A ghost (an owner removed while something pointed at it, :class:`Ghost`) is
        passed as an absent owner whose own controller reference is still known: if its
        kind is described it may be the workload, identified by the reference, and the
        walk goes on to its owner. A walk that ends at a ghost ends at an absent owner.
        The namespace rule holds for ghosts as for held objects.

        An owner held in another namespace than its dependent's (:meth:`foreign`) ends
        the walk as an absent owner does, but is never the workload: its uid is that
        other object's, and a workload identified by it would be that object's
        workload, in the other namespace.

        A reference back to an owner already passed is a cycle: it ends the walk as the
        hop limit does. A cycle through a described kind has no topmost described owner
        (which one the limit stopped at depended on the hop count's parity, and every
        described object on it became a workload of its own), so then nothing below it
        is attributed, the caller's ``top`` included: the reason is ``hop_limit``.

        A kind whose only description is invalid, passed above the last described owner,
        may be the real topmost workload: stopping below it would split one workload
        into several (each Job of a JobSet its own), and fixing the description would
        merge them again. So then nothing is attributed, the caller's ``top`` included:
        the reason is ``description_error``. One passed below a described owner is only
        a nested kind and does not matter.
        """
        ref = start
        hops = 0
        missing = limit = bad = False
        last_pod = ""
        #: the owners passed, in order (a chain is at most ``max_hops`` long), and the
        #: index in it of the last described one (-1: none yet)
        passed: list[str] = []
        last_described = -1
        #: the index in ``passed`` of the last owner whose kind's description is invalid
        last_errored = -1
        while ref is not None:
            if ref.uid in passed:  # a cycle: it runs from there to here
                limit = True
                if last_described >= passed.index(ref.uid):
                    top = None
                break
            if hops >= self.max_hops:
                limit = True
                break
            passed.append(ref.uid)
            hops += 1
            pod = None
            up: OwnerRef | None = None
            rec = self.objects.get(ref.uid)
            if rec is not None:
                if rec.namespace and rec.namespace != namespace:
                    missing = True  # another namespace's object: absent to this one
                    break
                gk = rec.gk
                up = rec.owner
                namespace = rec.namespace
            else:
                pod = self._pods.get(ref.uid)
                if pod is None:
                    gk = ref.gk
                    ghost = self.ghosts.get(ref.uid) if self.ghosts else None
                    if ghost is not None:
                        if ghost.namespace and ghost.namespace != namespace:
                            missing = True  # another namespace's: absent to this one
                            break
                        gk = ghost.gk
                        up = ghost.owner
                        namespace = ghost.namespace
                elif pod.namespace != namespace:
                    missing = True
                    break
                else:
                    gk = POD
                    up = pod.owner
            d = described(gk)
            if d is not None:
                top = WalkResult(d, ref.uid, rec, ref, "")
                last_described = hops - 1
            elif errored(gk):
                bad = True
                last_errored = hops - 1
            if rec is None and pod is None and up is None:
                missing = True  # absent, or a ghost at the top: ends as absent
                break
            last_pod = ref.uid if pod is not None and up is None else ""
            ref = up
        if top is not None and last_errored <= last_described:
            if limit and top.obj is not None and last_described >= 0:
                return WalkResult(top.described, top.uid, top.obj, top.ref, "", cut=True)
            return top
        if bad:
            reason = REASON_DESCRIPTION_ERROR
        elif limit:
            reason = REASON_HOP_LIMIT
        elif missing:
            reason = REASON_OWNER_MISSING
        else:
            reason = REASON_NO_DESCRIBED_OWNER
            return WalkResult(None, "", None, None, reason, last_pod)
        return WalkResult(None, "", None, None, reason)
