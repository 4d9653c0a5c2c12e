"""The Karta engine: descriptions + cluster objects -> attribution and workload facts.

Pure: no network, no HTTP, no Kubernetes client. Sources (``proxy.snapshot``,
``proxy.kube``) feed it objects; ``proxy.index`` follows the change sets it returns.

Why it is shaped this way:

* Objects arrive in any order and change one at a time, so every call is incremental: it
  re-attributes exactly the pods below the object that changed (the owner graph's reverse
  edges say which), as far down as a walk can reach it from (``max_owner_hops``, twice
  that for pods: a chain below it costs nothing past that), and returns only what
  changed. Nothing rescans all pods, except a change of descriptions, which
  re-attributes the pods of the kinds it touches.
* Memory is per pod, so a pod keeps only what selectors read (its metadata: name,
  namespace, uid, labels, annotations, ownerReferences), shared with the object it came
  from, never its spec or status (``proxy.karta.slim``). Whole objects are kept only for
  described kinds (and bare pods), whose status, scale and instance ids are evaluated
  from them, and then as the JSON text their expressions read (``proxy.karta.packed``),
  handed to jq as it is.
* libjq costs ~30 us a call through the PyPI binding, so the plain label / annotation /
  name lookups that nearly every pod selector is are answered with a dict probe; anything
  else goes to jq with the same wrapper semantics (``_Probe``, with the descriptions
  compiled for the engine in ``proxy.karta.plans``).

The rules (topmost described owner, component choice, instance check, phase of a workload
whose object was not seen) are documented in docs/karta-attribution.md.
"""

from __future__ import annotations

import copy
import heapq
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.karta.jqexpr import JqError, single_output_id, waited_seconds
from proxy.karta.model import UNDEFINED, Description, GroupKind
from proxy.karta.owners import (
    POD,
    REASON_NO_CONTROLLER_OWNER,
    ObjectRecord,
    OwnerGraph,
    WalkResult,
    controller_ref,
    group_kind,
)
from proxy.karta.packed import Packed, pack_decoded, pack_for_jq
from proxy.karta.plans import _CountKey, _DescriptionPlan, _PodRec, _Probe
from proxy.karta.replicas import (
    _cached,
    _FactsCache,
    _ObjectFacts,
    _read_object_facts,
    _replica_facts,
)
from proxy.karta.results import (
    DESCRIPTION_HELD_LAST_VALID,
    DESCRIPTION_INVALID,
    DESCRIPTION_NOT_IN_FORCE,
    JQ_ERROR_SELECTOR,
    JQ_ERROR_STATUS,
    PHASE_REASON_OBJECT_MISSING,
    PHASE_SINCE_OBJECT,
    PHASE_SINCE_OBSERVED,
    STAT_AMBIGUOUS_COMPONENT,
    STAT_INSTANCE_NOT_LISTED,
    STAT_INVALID_OBJECT,
    STAT_JQ_RETRY,
    STAT_SELECTOR_UNKEPT_FIELD,
    ChangeSet,
    PartialBatch,
    PodAttribution,
    Reattribution,
    WorkloadFacts,
    WorkloadRef,
)
from proxy.karta.slim import _interned, _trim, pod_controller
from proxy.shared_values import SharedValues

if TYPE_CHECKING:
    from proxy.karta.description import DescriptionError
    from proxy.karta.explain import Explanation

log = logging.getLogger(__name__)


#: (workload, expression) pairs whose jq error was logged, at most (then forgotten, and
#: logged again): one bad description over every workload of its kind stays bounded
_JQ_LOGGED_MAX = 10_000
#: jq error lines in one window of ``_JQ_LINE_WINDOW_SECONDS`` at most, the rest counted
#: in one line after it: past ``_JQ_LOGGED_MAX`` failing pairs, the once-each set is
#: forgotten at every turn, and with the re-evaluations of a jq sandbox that cannot
#: start (every pair again each backoff) an audit saw ~313 lines a second at 6,000
#: workloads; the errors themselves are counted in ``karta_proxy_jq_errors_total``
_JQ_LINES_PER_WINDOW = 20
_JQ_LINE_WINDOW_SECONDS = 60.0
#: stale entries the retry heap may hold beyond those owed before it is made anew: a
#: pod deleted while it owes a retry (an hour away during a quarantine) leaves its
#: entry, and under pod churn they piled up (an audit: 11,289 entries for 100 owed)
_RETRY_HEAP_SLACK = 1024
#: a kind's "description in force" info lines: at most one per this many seconds (the
#: changes in between counted in the next one)
_IN_FORCE_LINE_SECONDS = 60.0
#: characters of jq's message a log line shows (``error(.metadata.annotations.x)`` quotes
#: up to 256 KiB a pod's author wrote)
_JQ_MESSAGE_SHOWN = 300

#: the backoff of the re-evaluations owed after a jq failure that may pass (``JqError.
#: retry_after``): the first this long after it, each next one twice as long after the
#: last, at most ``RETRY_MAX_SECONDS``; a success (or a failure that is the expression's
#: own) ends it
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
#: what a retry re-evaluates: a workload object's facts (status, ids, scale), a pod's place
_RETRY_FACTS = "facts"
_RETRY_POD = "pod"

_DESCRIPTION_KINDS = frozenset({"Karta", "ResourceInterface"})

#: distinct (component, instance) keys the engine shares one tuple of among its pods
#: (``Engine._count_keys``; ~2 MB at 37.5k pods: one tuple per pod otherwise)
_COUNT_KEYS_MAX = 1 << 16

#: how long an owner removed while pods or objects still pointed at it is walked through
#: (its ghost, :class:`proxy.karta.owners.Ghost`), by default: the pod tombstones' time
#: (``karta.tombstone_seconds``, which the proxy passes)
DEFAULT_GHOST_SECONDS = 600.0
#: at most this many ghosts at once (the oldest dropped first): a ghost costs a few
#: hundred bytes (~210 B more than nothing, once the record it replaces is freed,
#: measured with tracemalloc over 40k), so a mass deletion inside the window stays
#: within ~10-20 MB
MAX_GHOSTS = 50_000
#: an object whose last facts evaluation (its pack for jq and the evaluation) took at
#: least this long is heavy (:meth:`Engine.heavy`): a source may have the next versions'
#: facts prepared in another thread (:meth:`Engine.facts_work`), so that the event loop
#: does not wait for the jq sandbox (an Argo Workflow of 3,000 nodes: ~160-250 ms an
#: update, docs/performance.md)
HEAVY_SECONDS = 0.010


def _api_source(obj: Mapping[str, Any], md: Mapping[str, Any]) -> str:
    """The source of a description object: ``api:<kind>/<name>`` (the uid without a
    name). With the kind: a ``Karta`` and a ``ResourceInterface`` of one name are two
    objects (two resources), so neither may replace, or delete, the other's description."""
    return f"api:{obj.get('kind')}/{md.get('name') or md.get('uid') or ''}"


class _Placement(NamedTuple):
    """A pod's component, instance and replica in its workload ("": none)."""

    component: str
    instance: str
    replica: str


_UNPLACED = _Placement("", "", "")


class _HeldPhase(NamedTuple):
    """A workload's phase record from before a transient evaluation failure."""

    phase: str
    since: float
    prev_since: float


class _Workload:
    __slots__ = ("by_comp", "counts", "evidenced", "facts", "held", "objs", "phase", "plan",
                 "prev_since", "ref", "since", "uid")

    def __init__(self, uid: str, ref: WorkloadRef, plan: _DescriptionPlan) -> None:
        self.uid = uid
        self.ref = ref
        self.plan = plan
        #: (component, instance) -> attributed pods, and component -> attributed pods
        self.counts: dict[_CountKey, int] = {}
        self.by_comp: dict[str, int] = {}
        #: described objects (the workload itself, nested ones) that belong to it
        self.objs: set[str] = set()
        self.facts: WorkloadFacts | None = None
        self.phase: str | None = None
        self.since = 0.0
        #: when this proxy saw the phase before the current one begin, where the object
        #: itself said that phase (-inf: not seen, or said by no object)
        self.prev_since = -math.inf
        #: the last phase was read from the object (not "object missing")
        self.evidenced = False
        #: while the phase is Undefined only because an evaluation failed for a reason
        #: that may pass (the jq sandbox restarting, a time limit): the phase, since and
        #: prev_since from before that gap, put back if the same phase returns
        self.held: _HeldPhase | None = None


class Prepared(NamedTuple):
    """An object version's facts prepared in another thread (:meth:`FactsWork.run`), for
    ``Engine.upsert_many(..., prepared=)``: what the engine would make of the object on
    the event loop, made off it."""

    #: the plan in force for the object's kind when the work was taken: the facts are
    #: used only while it still is
    plan: _DescriptionPlan
    #: the object as the engine keeps it (``pack_decoded(_trim(obj))``: its jq text)
    kept: Mapping[str, Any] | Packed
    #: None: not evaluated (the thread failed): the engine evaluates the kept text itself
    facts: _ObjectFacts | None
    #: how long the pack and the evaluation took (the object's weight, :data:`HEAVY_SECONDS`)
    seconds: float
    #: how long the pack took alone: the weight's share when the facts go unused (their
    #: plan no longer in force: the engine evaluates the text itself, and times that)
    pack_seconds: float


def _timed_facts(plan: _DescriptionPlan, kept: Mapping[str, Any] | Packed
                 ) -> tuple[_ObjectFacts, float]:
    """An object version's facts and the seconds they took, less those this thread
    waited for the jq sandbox busy with the other thread's evaluation (the event loop's
    or the heavy objects' thread's): a light object evaluated while a heavy one held the
    sandbox is not heavy for it."""
    waited = waited_seconds()
    began = time.perf_counter()
    facts = _read_object_facts(plan, kept)
    return facts, time.perf_counter() - began - (waited_seconds() - waited)


class FactsWork:
    """One object version's facts to prepare in another thread, taken on the engine's
    thread (:meth:`Engine.facts_work`): the plan in force for its kind, the object as the
    engine keeps it (its jq text), and ``stub``, the object to feed the engine in its
    place with the result (its apiVersion, kind and light metadata: all an upsert reads of
    an object whose kept text it is given; None for a held object's re-evaluation after
    a description change, :meth:`Engine.held_facts_work`, which feeds no object). The
    text is made there, not in the thread:
    a JSON encoder holds the GIL in one piece wherever it runs (msgspec's ~3 ms for a
    1.5 MB object: :func:`~proxy.karta.packed.pack_decoded`), and a version waiting for
    the thread then holds its text, not its parsed dicts (~5x the text: ~7 MB of them a
    version). :meth:`run` reads only the text and the
    plan (immutable), so it is safe in any thread; the jq evaluation holds the GIL
    in-process, so this frees the event loop only with the jq sandbox as the runner (the
    thread waits on its child's pipe)."""

    __slots__ = ("kept", "pack_seconds", "plan", "stub")

    def __init__(self, stub: dict[str, Any] | None, kept: Mapping[str, Any] | Packed,
                 plan: _DescriptionPlan, pack_seconds: float) -> None:
        self.stub = stub
        self.kept = kept
        self.plan = plan
        self.pack_seconds = pack_seconds

    def run(self) -> Prepared:
        facts, seconds = _timed_facts(self.plan, self.kept)
        return Prepared(self.plan, self.kept, facts, self.pack_seconds + seconds,
                        self.pack_seconds)

    def unevaluated(self) -> Prepared:
        """The kept text without facts (the thread failed): fed with ``stub``, the
        engine evaluates the text itself, as for an object of its own."""
        return Prepared(self.plan, self.kept, None, self.pack_seconds, self.pack_seconds)


# -- the engine --------------------------------------------------------------------------


class Engine:
    """Descriptions + cluster objects in, ``ChangeSet`` out (see module docstring)."""

    def __init__(
        self,
        *,
        builtins: bool = True,
        max_owner_hops: int = 6,
        clock: Callable[[], float] = time.time,
        ghost_seconds: float = DEFAULT_GHOST_SECONDS,
        max_ghosts: int = MAX_GHOSTS,
        ghost_clock: Callable[[], float] = time.monotonic,
        retry_clock: Callable[[], float] = time.monotonic,
        heavy_seconds: float = HEAVY_SECONDS,
    ) -> None:
        """``ghost_seconds`` and ``max_ghosts`` bound the ghosts of removed owners
        (:class:`proxy.karta.owners.Ghost`; 0: none are kept), timed by ``ghost_clock``;
        :meth:`expire_ghosts` drops those past their time. ``retry_clock`` (monotonic)
        times the re-evaluations owed after jq failures that may pass (:meth:`retry_due`)
        and the minute of the description changes' log lines; ``clock`` (the wall clock)
        dates what the engine saw (a phase's ``since``). ``heavy_seconds``: what a facts
        evaluation takes at least for its object to be heavy (:meth:`heavy`)."""
        self._clock = clock
        self._pods: dict[str, _PodRec] = {}
        self._graph = OwnerGraph(max_owner_hops, self._pods, ghost_seconds=ghost_seconds,
                                 max_ghosts=max_ghosts, clock=ghost_clock)
        #: pods without a controller owner (the built-in Pod description's candidates)
        self._bare: set[str] = set()
        self._wl: dict[str, _Workload] = {}
        #: one tuple per (component, instance) for every pod placed there (``rec.key``)
        self._count_keys: SharedValues[_CountKey] = SharedValues(_COUNT_KEYS_MAX)
        self._plans: dict[GroupKind, _DescriptionPlan] = {}
        #: the plans an owner walk may stop at: all but Pod (only bare pods are Pod workloads)
        self._walk_plans: dict[GroupKind, _DescriptionPlan] = {}
        self._sources: dict[str, list[Description]] = {}
        self._api_specs: dict[str, Any] = {}
        self._api_errors: dict[str, DescriptionError] = {}
        self._source_errors: dict[str, list[DescriptionError]] = {}
        self._selection_errors: list[DescriptionError] = []
        #: kinds whose only description is invalid: the kinds of the description objects
        #: that failed to parse (``DescriptionError.kind``), from any source (files, a
        #: snapshot, API objects), that no valid description describes
        self._errored: frozenset[GroupKind] = frozenset()
        self.description_errors: list[DescriptionError] = []
        #: pod-selector paths of the descriptions in force that read pod fields the
        #: engine does not keep (``unkept_pod_reads``): in force, but they see null there
        self.description_warnings: list[str] = []
        #: what the engine noticed: ambiguous components, unlisted instances, its own
        #: re-evaluations (the jq errors are in ``jq_errors``)
        self.stats: Counter[str] = Counter()
        #: the jq runtime errors by where (``JQ_ERROR_WHERE``) and the name of the
        #: description whose expression failed: the counter alone said that one failed,
        #: not which (``karta_proxy_jq_errors_total{where, description}``)
        self.jq_errors: Counter[tuple[str, str]] = Counter()
        #: (workload uid, expression) of the jq errors logged (:meth:`_log_jq_error`)
        self._jq_logged: set[tuple[str, str]] = set()
        #: the jq error lines' window: when it began (monotonic), lines in it, and the
        #: errors not logged for its cap (:meth:`_log_jq_error`)
        self._jq_window = (-_JQ_LINE_WINDOW_SECONDS, 0, 0)
        #: per kind and description now in force: when its next "in force" line may go,
        #: and the changes held back since the last one (:meth:`_log_in_force`)
        self._in_force_lines: dict[tuple[GroupKind, str], tuple[float, int]] = {}
        self._dirty: set[str] = set()
        self._retry_clock = retry_clock
        #: (what, uid) -> (when, backoff) of the re-evaluations owed (:meth:`_owe_retry`)
        self._retries: dict[tuple[str, str], tuple[float, float]] = {}
        #: the same, by when (an entry whose time is not the dict's is stale)
        self._retry_heap: list[tuple[float, str, str]] = []
        #: the soonest ``retry_after`` of the pod selectors' errors of the pod being placed
        self._pod_retry_after: float | None = None
        #: where a description object's re-attribution goes during ``upsert_many(...,
        #: owed=)``; None: done at once
        self._owing: list[str] | None = None
        #: the facts prepared in another thread during ``upsert_many(..., prepared=)``, by
        #: ``id(obj)``
        self._prepared: Mapping[int, Prepared] | None = None
        #: the objects whose last facts evaluation took ``heavy_seconds`` or more: a set of
        #: the few heavy ones, not a field of every record
        self._heavy: set[str] = set()
        self._heavy_seconds = heavy_seconds
        #: uid -> seconds its pack for jq took, for the evaluation that follows in the same
        #: call (emptied as each call settles)
        self._packing: dict[str, float] = {}
        self._required: dict[GroupKind, str] = {POD: "full"}
        #: kinds required ``full`` that stopped being so since :meth:`take_lapsed_kinds`
        self._lapsed: set[GroupKind] = set()
        self._kinds_touched = True
        if builtins:
            from proxy.karta.builtin import builtin_descriptions

            self._sources["builtin"] = list(builtin_descriptions())
        cs = ChangeSet()
        self._reattribute_below(self._reselect(), cs)
        self._settle(cs)

    # -- public: objects ----------------------------------------------------------------

    def upsert(self, obj: Mapping[str, Any]) -> ChangeSet:
        """Add or replace one object: a Pod, any owner, a workload, or a description."""
        return self.upsert_many((obj,))

    def delete(self, obj: Mapping[str, Any]) -> ChangeSet:
        """Forget one object (``apiVersion``, ``kind``, ``metadata.uid`` are enough)."""
        return self.delete_many((obj,))

    def upsert_many(self, objs: Iterable[Mapping[str, Any]], *,
                    owed: list[str] | None = None,
                    prepared: Mapping[int, Prepared] | None = None) -> ChangeSet:
        """Many upserts, one change set; workload facts are computed once at the end.

        ``owed``: a description object among them re-attributes nothing itself; the
        objects of the kinds its change touches are added to ``owed``, for the caller to
        give, each with what lies below it, in runs (:meth:`reattribute`), as
        :meth:`change_descriptions` does for files.

        ``prepared``: by ``id(obj)``, what :meth:`FactsWork.run` made of some of them in
        another thread: their kept text taken from it, and their facts too while the plan
        it was made under is still in force (else evaluated here, as without it). The
        result is the one without it: the facts' jq errors are counted and logged, and
        their retries owed, when the engine first uses them, as for its own."""
        self._prepared = prepared
        try:
            return self._apply_each(objs, self._upsert, owed)
        finally:
            self._prepared = None

    def delete_many(self, objs: Iterable[Mapping[str, Any]], *,
                    owed: list[str] | None = None) -> ChangeSet:
        """Many deletions, one change set (``owed``: as for :meth:`upsert_many`)."""
        return self._apply_each(objs, self._delete, owed)

    def _apply_each(self, objs: Iterable[Mapping[str, Any]],
                    step: Callable[[Mapping[str, Any], ChangeSet], None],
                    owed: list[str] | None) -> ChangeSet:
        cs = ChangeSet()
        self._owing = owed
        try:
            for obj in objs:
                step(obj, cs)
        except Exception as e:
            raise self._partial(cs) from e
        finally:
            self._owing = None
        self._settle(cs)
        return cs

    def _partial(self, cs: ChangeSet) -> PartialBatch:
        """What a batch that failed part-way did before the failure, settled
        (:class:`PartialBatch`)."""
        dirty = set(self._dirty)
        try:
            self._settle(cs)
        except Exception:
            # the workloads stay to settle at the next call, as if this one had not tried
            self._dirty |= dirty
            log.exception("settling a batch the engine failed on failed too")
            return PartialBatch(None)
        return PartialBatch(cs)

    # -- public: ghosts -----------------------------------------------------------------

    def expire_ghosts(self) -> ChangeSet:
        """Drop the ghosts of removed owners past their time (and those the count bound
        dropped); the pods and objects that walked through one are placed again, as after
        any owner change. Call periodically (the index's tombstone expiry does)."""
        cs = ChangeSet()
        try:
            self._replace_below(self._graph.expire(), cs)
        except Exception as e:
            raise self._partial(cs) from e
        self._settle(cs)
        return cs

    def log_held_changes(self) -> None:
        """Tell the description changes :meth:`_log_in_force` held back, once their
        minute is over and no later change told them: the last edits of a burst were
        otherwise never logged (a controller's 5 edits in 20 s made one line, for the
        first). Call periodically (the runtime's housekeeping does, with the ghosts)."""
        now = self._retry_clock()
        for key, (next_at, held) in list(self._in_force_lines.items()):
            if not held or now < next_at:
                continue
            gk, name = key
            self._in_force_lines[key] = (next_at, 0)
            plan = self._plans.get(gk)
            if plan is not None and plan.desc.name == name:
                what = f"description {plan.desc.name} ({plan.desc.source}) of {gk} is in force"
            elif plan is not None:
                what = (f"{gk} is now described by {plan.desc.name} ({plan.desc.source}), "
                        "logged at the time")
            else:
                what = f"{gk} is not described now"
            log.info("karta engine: %d more change(s) of the description in force for %s "
                     "in the minute after the last line, not logged then; %s",
                     held, gk, what)

    def ghosts(self) -> int:
        """How many ghosts of removed owners are kept now."""
        return len(self._graph.ghosts)

    # -- public: retries ----------------------------------------------------------------

    def retry_due(self, max_objects: int, max_seconds: float) -> ChangeSet:
        """Evaluate again the workload objects and pods whose last evaluation failed for
        a reason that may have passed (:attr:`JqError.retry_after
        <proxy.karta.jqexpr.JqError>`: the jq sandbox's child held up, killed or unable
        to start, a quarantine over), those whose backoff is over, soonest first: at most
        ``max_objects``, and none more once ``max_seconds`` are spent (each may take one
        jq time limit). Without it such a failure stood until the object's next event,
        days for a quiet Deployment. Call periodically (the runtime's jq housekeeping
        does, every second)."""
        cs = ChangeSet()
        started = time.monotonic()
        now = self._retry_clock()
        heap = self._retry_heap
        done = 0
        try:
            while heap and heap[0][0] <= now and done < max_objects:
                when, what, uid = heapq.heappop(heap)
                owed = self._retries.get((what, uid))
                if owed is None or owed[0] != when:
                    continue  # settled meanwhile, or owed later
                done += 1
                self.stats[STAT_JQ_RETRY] += 1
                try:
                    self._retry(what, uid, cs)
                except Exception:
                    self._retries.pop((what, uid), None)  # not owed again for ever
                    raise
                if time.monotonic() - started >= max_seconds:
                    break
        except Exception as e:
            raise self._partial(cs) from e
        self._settle(cs)
        return cs

    def retries_due(self) -> bool:
        """Whether a re-evaluation is due now (:meth:`retry_due`)."""
        heap = self._retry_heap
        now = self._retry_clock()
        while heap:
            when, what, uid = heap[0]
            owed = self._retries.get((what, uid))
            if owed is not None and owed[0] == when:
                return when <= now
            heapq.heappop(heap)  # stale
        return False

    def retries_owed(self) -> int:
        """How many re-evaluations are owed (due or not)."""
        return len(self._retries)

    def _retry(self, what: str, uid: str, cs: ChangeSet) -> None:
        """One re-evaluation owed: it owes another (later, the backoff doubled), or ends
        the debt, as any evaluation does (:meth:`_owe_retry`)."""
        if what == _RETRY_POD:
            rec = self._pods.get(uid)
            if rec is None:
                self._retries.pop((what, uid), None)
            else:
                self._attribute_pod(rec, cs)
            return
        holder: ObjectRecord | _PodRec | None = self._graph.objects.get(uid)
        if holder is None:
            holder = self._pods.get(uid)
        wl = self._wl.get(uid)
        if holder is None or holder.obj is None or wl is None:
            self._retries.pop((what, uid), None)  # gone, or no longer a workload
            return
        before = _cached(holder.cache, wl.plan)
        holder.cache = None
        self._dirty.add(uid)
        after = self._object_facts(uid, wl.plan)
        if after is None or not after.same_ids(before):
            # the instance ids came (or changed): the pods' places depend on them
            if isinstance(holder, _PodRec):
                self._attribute_pod(holder, cs)
            self._replace_below((uid,), cs)

    def _owe_retry(self, what: str, uid: str, retry_after: float | None) -> None:
        """After an evaluation of ``uid``: a failure that may pass (``retry_after`` not
        None) owes a re-evaluation after the backoff (doubled from the last one owed),
        or after ``retry_after`` if later (a quarantine's end); anything else (success,
        the expression's own failure) ends what was owed."""
        key = (what, uid)
        if retry_after is None:
            if self._retries and self._retries.pop(key, None) is not None:
                self._trim_retry_heap()
            return
        now = self._retry_clock()
        last = self._retries.get(key)
        if last is not None and last[0] > now:
            # one is owed already (this evaluation was an event's, not the retry): it
            # stands, the backoff not doubled, unless this failure may pass sooner (a
            # quarantine's retry, then a child killed); so an object failing at every
            # event of a busy hour adds no heap entry per event
            when = now + max(last[1], retry_after)
            if when >= last[0] - RETRY_FIRST_SECONDS:
                return
            backoff = last[1]
        else:
            backoff = (RETRY_FIRST_SECONDS if last is None
                       else min(last[1] * 2, RETRY_MAX_SECONDS))
            when = now + max(backoff, retry_after)
        self._retries[key] = (when, backoff)
        heapq.heappush(self._retry_heap, (when, what, uid))
        self._trim_retry_heap()

    def _trim_retry_heap(self) -> None:
        """Make the retry heap anew from what is owed once its stale entries (settled,
        or owed at another time) pass ``_RETRY_HEAP_SLACK``: it then stays within twice
        what is owed plus the slack, and so does the popping of stale entries in
        :meth:`retries_due` / :meth:`retry_due`."""
        if len(self._retry_heap) > 2 * len(self._retries) + _RETRY_HEAP_SLACK:
            heap = [(when, what, uid) for (what, uid), (when, _) in self._retries.items()]
            heapq.heapify(heap)
            self._retry_heap = heap

    def _replace_below(self, uids: Iterable[str], cs: ChangeSet) -> None:
        """Re-attribute what lies below each of ``uids`` within its reach (not
        themselves: gone, or attributed by the caller): what a walk can reach it from,
        ``max_owner_hops`` references for an object, twice that for a pod
        (:meth:`OwnerGraph.add_within_reach`), so that one owner's change costs what it
        can change, not the length of a chain below it."""
        todo: dict[str, None] = {}
        for uid in uids:
            self._graph.add_within_reach(uid, todo)
        if todo:
            self._reattribute(todo, cs)

    # -- public: descriptions -----------------------------------------------------------

    def add_descriptions(
        self,
        descs: Iterable[Description],
        *,
        source: str = "files",
        errors: Iterable[DescriptionError] = (),
    ) -> ChangeSet:
        """Set the descriptions of one source (replacing what it gave before), and
        re-attribute what that changes at once.

        ``errors`` are that source's load errors (e.g. from ``load_description_paths``),
        kept in ``description_errors`` so they are reported with the rest.
        """
        return self._at_once(self.change_descriptions(descs, source=source, errors=errors))

    def remove_descriptions(self, source: str) -> ChangeSet:
        return self._at_once(self.change_descriptions(None, source=source))

    def change_descriptions(
        self,
        descs: Iterable[Description] | None,
        *,
        source: str = "files",
        errors: Iterable[DescriptionError] = (),
    ) -> Reattribution:
        """Set the descriptions of one source (``None``: remove them), owing the objects
        of the kinds that changes, and what lies below them, a new attribution
        (:meth:`reattribute`).

        For a caller on the event loop, which re-attributes in runs and lets the loop in
        between: in one go, three described kinds took 2.5-3.4 s at 37.5k pods, and
        every request relayed meanwhile waited. Until an object owed is re-attributed, it
        keeps the attribution it had.
        """
        if descs is None:
            self._sources.pop(source, None)
            self._source_errors.pop(source, None)
        else:
            self._sources[source] = list(descs)
            self._source_errors[source] = list(errors)
        owed = self._reselect()
        cs = ChangeSet()
        self._settle(cs)
        return Reattribution(cs, owed)

    def reattribute(self, uids: Iterable[str]) -> ChangeSet:
        """Attribute these objects (owed by :meth:`change_descriptions`), and what lies
        below each of them at this call, again under the descriptions in force; one gone
        meanwhile is skipped."""
        cs = ChangeSet()
        try:
            self._reattribute_below(uids, cs)
        except Exception as e:
            raise self._partial(cs) from e
        self._settle(cs)
        return cs

    def _at_once(self, change: Reattribution) -> ChangeSet:
        cs = change.changes
        cs.merge(self.reattribute(change.owed))
        return cs

    # -- public: answers ----------------------------------------------------------------

    def pod(self, uid: str) -> PodAttribution | None:
        rec = self._pods.get(uid)
        return rec.att if rec is not None else None

    def pods(self) -> Iterable[PodAttribution]:
        return [rec.att for rec in self._pods.values() if rec.att is not None]

    def workloads(self) -> Iterable[WorkloadFacts]:
        return [wl.facts for wl in self._wl.values() if wl.facts is not None]

    def workload(self, uid: str) -> WorkloadFacts | None:
        wl = self._wl.get(uid)
        return wl.facts if wl is not None else None

    def explain(self, namespace: str, pod: str, uid: str | None = None
                ) -> Explanation | None:
        """Why ``namespace/pod`` got its attribution, walked again on demand (the status
        page; read-only, never on the request path). None for a pod the engine does not
        hold; of two pods of one name, the newest. ``uid``, when the caller knows it (the
        index does), finds the pod at once; without it, or when it names another pod,
        the pods are scanned (3-4 ms of the loop at 45k pods)."""
        from proxy.karta.explain import explain_pod

        found = self._pods.get(uid) if uid else None
        if found is not None and (found.name != pod or found.namespace != namespace
                                  or found.att is None):
            found = None
        for rec in () if found is not None else self._pods.values():
            if rec.name == pod and rec.namespace == namespace and rec.att is not None:
                found = rec
        if found is None or found.att is None:
            return None

        def description_of(gk: GroupKind) -> str | None:
            plan = self._walk_plans.get(gk)
            return plan.desc.name if plan is not None else None

        return explain_pod(found, found.att, self._pods, self._graph, description_of,
                           self._is_errored)

    def descriptions(self) -> dict[GroupKind, Description]:
        """The description in force for each described kind."""
        return {gk: plan.desc for gk, plan in self._plans.items()}

    def selection_losers(self) -> list[DescriptionError]:
        """The valid descriptions not in force because another wins for their kind
        (``select_descriptions``; a built-in a user description replaces is none), each
        an error naming the winner. Also among ``description_errors``."""
        return list(self._selection_errors)

    def description_problems(self) -> dict[str, int]:
        """``description_errors`` counted by why (``DESCRIPTION_ERROR_REASONS``, each
        present; they add up to ``len(description_errors)``), for a metric an alert reads:
        the log lines alone left nothing to alert on before a restart changed every
        series of the kind. A Karta object edited invalid is ``held_last_valid`` while
        its last valid version is the one in force for its kind (a restart then takes
        its pods to ``description_error``), ``invalid`` otherwise, as every error of a
        file or a snapshot is (nothing of it in force)."""
        in_force = {plan.desc.source for plan in self._plans.values()}
        held = sum(1 for source in self._api_errors if source in in_force)
        return {
            DESCRIPTION_INVALID: sum(map(len, self._source_errors.values()))
            + len(self._api_errors) - held,
            DESCRIPTION_HELD_LAST_VALID: held,
            DESCRIPTION_NOT_IN_FORCE: len(self._selection_errors),
        }

    def heavy(self, uid: str) -> bool:
        """Whether the last facts evaluation of object ``uid`` (its pack for jq and the
        evaluation) took ``heavy_seconds`` or more."""
        return uid in self._heavy

    def facts_work(self, obj: Mapping[str, Any]) -> FactsWork | None:
        """The facts of this object version to prepare in another thread (for
        ``upsert_many(..., prepared=)``, with the work's ``stub`` in the object's place),
        under the plan in force for its kind now; None when its kind has none (nothing to
        evaluate). The object's kept text is made here, on the calling thread, the way
        for an object decoded from JSON (a watch event's, the source's only caller:
        :func:`~proxy.karta.packed.pack_decoded`)."""
        api, kind = obj.get("apiVersion"), obj.get("kind")
        if not isinstance(api, str) or not isinstance(kind, str) \
                or not isinstance(obj.get("metadata"), Mapping):
            return None
        plan = self._plans.get(group_kind(api, kind))
        if plan is None:
            return None
        began = time.perf_counter()
        trimmed = _trim(obj)
        kept = pack_decoded(trimmed)
        stub = {"apiVersion": api, "kind": kind, "metadata": trimmed["metadata"]}
        return FactsWork(stub, kept, plan, time.perf_counter() - began)

    def replanned(self, work: FactsWork) -> FactsWork | None:
        """An update's ``work`` (:meth:`facts_work`) under the plan in force for its kind
        now: a description changed while it waited, and facts made under the old plan
        would go unused (evaluated again on the event loop). Its kept text does not depend
        on the plan. None: its kind is no longer described (nothing to evaluate)."""
        stub = work.stub
        assert stub is not None, "an update's work (a re-evaluation's is held_facts_work's)"
        plan = self._plans.get(group_kind(stub["apiVersion"], stub["kind"]))
        if plan is None:
            return None
        return work if plan is work.plan else FactsWork(stub, work.kept, plan,
                                                         work.pack_seconds)

    def held_facts_work(self, uid: str) -> FactsWork | None:
        """The facts of workload object ``uid`` as held now (its kept text, no pack made)
        under the plan in force for its kind, to prepare in another thread after a
        description change (its kind's new plan) for :meth:`use_prepared`, then
        ``reattribute([uid])``; None when there is nothing to evaluate: not a workload,
        no text kept, its kind not described, or those facts cached already."""
        holder, gk = self._holder(uid)
        plan = self._plans.get(gk) if gk is not None else None
        if holder is None or holder.obj is None or plan is None or uid not in self._wl \
                or (holder.cache is not None and holder.cache.plan is plan):
            return None
        return FactsWork(None, holder.obj, plan, 0.0)

    def _holder(self, uid: str) -> tuple[ObjectRecord | _PodRec | None, GroupKind | None]:
        """The object or pod record of ``uid`` and its kind."""
        rec = self._graph.objects.get(uid)
        if rec is not None:
            return rec, rec.gk
        prec = self._pods.get(uid)
        return (prec, POD) if prec is not None else (None, None)

    def use_prepared(self, uid: str, ready: Prepared) -> None:
        """Facts prepared in another thread from :meth:`held_facts_work`, for the
        evaluations that follow (``reattribute([uid])``, next): put in the record's cache,
        to be accounted at first use, while the object keeps the text they were made of,
        their plan is in force, and no evaluation under it was made meanwhile (on the
        loop, for a pod's event: counted twice else). Otherwise ignored: the engine
        evaluates the object itself, as without them (a watch event or a newer
        description came since)."""
        holder, gk = self._holder(uid)
        if holder is None or gk is None or ready.facts is None or holder.obj is not ready.kept \
                or ready.plan is not self._plans.get(gk) \
                or (holder.cache is not None and holder.cache.plan is ready.plan):
            return
        holder.cache = _FactsCache(ready.plan, ready.facts, ready.seconds)

    def holds(self, uid: str) -> bool:
        """The uid is a pod, an object or a ghost the engine holds: not an owner absent."""
        return uid in self._pods or uid in self._graph.objects or uid in self._graph.ghosts

    def pointed_at(self, uid: str) -> bool:
        """Something the engine holds names ``uid`` as its controller."""
        return bool(self._graph.dependents(uid))

    @property
    def max_owner_hops(self) -> int:
        return self._graph.max_hops

    def required_kinds(self) -> dict[GroupKind, str]:
        """Kinds a source must deliver: ``full`` objects, or ``metadata`` only.

        ``full``: described kinds (status, scale and instance ids are read from them),
        kinds whose description is invalid (so fixing it needs no relist) and Pod.
        ``metadata``: kinds seen as controller owners on chains, component kinds and
        ``additionalChildKinds`` of the descriptions in force (owner walks pass them).
        """
        return dict(self._required)

    def take_lapsed_kinds(self) -> set[GroupKind]:
        """The kinds required ``full`` that stopped being so (their description gone,
        not yet back or back since) since the last call, forgotten here.

        While a kind is not described, its objects are kept without their bodies,
        whatever the watch delivers: one described again before the source's next
        round finds its watch full as it wants it, and would keep those objects
        bodiless (``workload_object_missing``) until each one's next change. The
        source lists such a kind again whole."""
        lapsed, self._lapsed = self._lapsed, set()
        return lapsed

    # -- objects ------------------------------------------------------------------------

    def _invalid(self, why: str, obj: Any) -> None:
        self.stats[STAT_INVALID_OBJECT] += 1
        ident = ""
        if isinstance(obj, Mapping):
            md = obj.get("metadata")
            ident = f"{obj.get('kind')!s} {md.get('namespace') if isinstance(md, Mapping) else ''}"
            ident += f"/{md.get('name') if isinstance(md, Mapping) else ''}"
        log.warning("karta engine: ignored object %s: %s", ident, why)

    def _upsert(self, obj: Mapping[str, Any], cs: ChangeSet) -> None:
        if not isinstance(obj, Mapping):
            self._invalid("not a mapping", obj)
            return
        kind, api, md = obj.get("kind"), obj.get("apiVersion"), obj.get("metadata")
        if not isinstance(kind, str) or not isinstance(api, str) or not isinstance(md, Mapping):
            self._invalid("apiVersion, kind and metadata are required", obj)
            return
        if kind in _DESCRIPTION_KINDS:
            from proxy.karta.description import is_description_object

            if is_description_object(obj):
                self._upsert_description(obj, md, cs)
                return
        uid = md.get("uid")
        if not isinstance(uid, str) or not uid:
            self._invalid("metadata.uid is required", obj)
            return
        if kind == "Pod" and api == "v1":
            self._upsert_pod(obj, md, uid, cs)
        else:
            self._upsert_object(obj, md, uid, group_kind(api, kind), cs)

    def _delete(self, obj: Mapping[str, Any], cs: ChangeSet) -> None:
        if not isinstance(obj, Mapping):
            self._invalid("not a mapping", obj)
            return
        kind, md = obj.get("kind"), obj.get("metadata")
        if not isinstance(md, Mapping):
            self._invalid("metadata is required", obj)
            return
        if kind in _DESCRIPTION_KINDS:
            from proxy.karta.description import is_description_object

            if is_description_object(obj):
                self._delete_description(obj, md, cs)
                return
        uid = md.get("uid")
        if not isinstance(uid, str) or not uid:
            self._invalid("metadata.uid is required", obj)
            return
        if uid in self._pods:
            self._delete_pod(uid, cs)
        elif uid in self._graph.objects:
            self._delete_object(uid, cs)

    def _upsert_pod(
        self, obj: Mapping[str, Any], md: Mapping[str, Any], uid: str, cs: ChangeSet
    ) -> None:
        ns, name = md.get("namespace") or "", md.get("name") or ""
        if type(ns) is str:  # one string per namespace, not one per pod (~0.8 MB at 37.5k)
            ns = sys.intern(ns)
        labels = _interned(md.get("labels"), values=True)
        ann = _interned(md.get("annotations"), values=False)
        owner = pod_controller(md.get("ownerReferences"))
        rec = self._pods.get(uid)
        same_owner = False
        if rec is None:
            if self._graph.ghosts:
                self._graph.unbury(uid)  # a pod of a removed one's uid is back
            rec = self._pods[uid] = _PodRec(uid)
        elif (
            (same_owner := (owner.same(rec.owner) if owner is not None else rec.owner is None))
            and rec.labels == labels
            and rec.annotations == ann
            and rec.name == name
            and rec.namespace == ns
        ):
            if rec.owner is None:  # a bare pod is its own workload: its status matters
                rec.obj, rec.cache = self._kept(obj, uid, POD)
                if rec.wl:
                    self._dirty.add(rec.wl)
            return  # nothing a selector or a walk reads has changed
        rec.namespace, rec.name = sys.intern(str(ns)), str(name)
        rec.labels, rec.annotations = labels, ann
        owner_changed = not same_owner
        if owner_changed:
            if rec.owner is not None:
                self._graph.unlink(uid, rec.owner)
                rec.owner = None
            if owner is not None:
                rec.owner = self._graph.link(uid, owner)
        if rec.owner is None:
            self._bare.add(uid)
            rec.obj, rec.cache = self._kept(obj, uid, POD)
            if uid in self._wl:  # its own workload's status was read from the object
                self._dirty.add(uid)
        else:
            self._bare.discard(uid)
            rec.obj = rec.cache = None
        self._attribute_pod(rec, cs)
        if owner_changed:  # pods can own objects (LWS leader pod -> worker StatefulSet)
            self._replace_below((uid,), cs)

    def _delete_pod(self, uid: str, cs: ChangeSet) -> None:
        rec = self._pods.pop(uid)
        self._heavy.discard(uid)
        self._owe_retry(_RETRY_POD, uid, None)
        self._owe_retry(_RETRY_FACTS, uid, None)
        # a pod that owns pods or objects stays a ghost while they point at it
        buried = self._graph.bury(uid, POD, rec.namespace, rec.name, rec.owner)
        if rec.owner is not None and not buried:
            self._graph.unlink(uid, rec.owner)
        self._bare.discard(uid)
        self._leave(rec)
        cs.pods[uid] = None
        self._replace_below((uid, *self._graph.take_evicted()), cs)

    def _upsert_object(
        self,
        obj: Mapping[str, Any],
        md: Mapping[str, Any],
        uid: str,
        gk: GroupKind,
        cs: ChangeSet,
    ) -> None:
        plan = self._plans.get(gk)
        # kinds with an invalid description too: fixing it must not wait for a relist
        kept, cache = (self._kept(obj, uid, gk) if plan is not None or gk in self._errored
                       else (None, None))
        rec = ObjectRecord(
            uid,
            gk,
            sys.intern(str(md.get("namespace") or "")),
            str(md.get("name") or ""),
            controller_ref(md.get("ownerReferences")),
            kept,
        )
        rec.cache = cache
        old = self._graph.put(rec)
        if old is not None:
            rec.member = old.member
        if (
            old is None
            or old.gk != gk
            or old.owner is not rec.owner
            or old.name != rec.name
            or old.namespace != rec.namespace
        ):
            todo = {uid: None}
            self._graph.add_within_reach(uid, todo)
            self._reattribute(todo, cs)
            return
        # same place in the graph: only what is derived from the object itself can change
        wl = self._wl.get(uid)
        if wl is None:
            return
        self._dirty.add(uid)
        before = _cached(old.cache, wl.plan)
        after = self._object_facts(uid, wl.plan)
        if (before is not None and (after is None or not after.same_ids(before))) or (
            old.obj is None and after is not None and after.ids  # ids were unknown until now
        ):
            self._replace_below((uid,), cs)

    def _delete_object(self, uid: str, cs: ChangeSet) -> None:
        old = self._graph.remove(uid)
        if old is None:
            return
        self._heavy.discard(uid)
        self._owe_retry(_RETRY_FACTS, uid, None)
        if old.member:
            wl = self._wl.get(old.member)
            if wl is not None:
                wl.objs.discard(uid)
                self._dirty.add(old.member)
        if uid in self._wl:
            self._dirty.add(uid)
        self._replace_below((uid, *self._graph.take_evicted()), cs)

    # -- attribution --------------------------------------------------------------------

    def _reattribute_below(self, roots: Iterable[str], cs: ChangeSet) -> None:
        """Re-attribute ``roots`` and what lies below each *now*, each object once.

        What lies below is found here, not when the descriptions changed: between the
        change and a caller's later run, an object that joined a root was attributed
        under the new descriptions as it joined, and one that left was re-attributed as
        it left, so each object existing at the change gets the new descriptions either
        way."""
        todo: dict[str, None] = {}
        below = self._graph.add_descendants
        for uid in roots:
            if uid not in todo:
                todo[uid] = None
                below(uid, todo)
        self._reattribute(todo, cs)

    def _reattribute(self, uids: Iterable[str], cs: ChangeSet) -> None:
        for uid in uids:
            prec = self._pods.get(uid)
            if prec is not None:
                self._attribute_pod(prec, cs)
                continue
            orec = self._graph.objects.get(uid)
            if orec is not None:
                self._attribute_object(orec)

    def _is_errored(self, gk: GroupKind) -> bool:
        return gk in self._errored

    def _workload_ref(self, top: WalkResult[_DescriptionPlan], namespace: str) -> WorkloadRef:
        """The workload's identity; shared by its pods (one object, not one per pod)."""
        if top.obj is not None:
            o = top.obj
            fields = (o.namespace, o.gk.group, o.gk.kind, o.name, o.uid)
        elif top.ref is not None:
            r = top.ref
            # known only from a reference: owners live in the namespace of their dependents
            fields = (namespace, r.gk.group, r.gk.kind, r.name, r.uid)
        else:  # a bare pod, its own workload
            p = self._pods[top.uid]
            fields = (p.namespace, "", "Pod", p.name, p.uid)
        wl = self._wl.get(top.uid)
        if wl is not None:
            w = wl.ref
            if (w.namespace, w.group, w.kind, w.name, w.uid) == fields:
                return w
        return WorkloadRef(*fields)

    def _attribute_pod(self, rec: _PodRec, cs: ChangeSet) -> None:
        if rec.owner is None:
            plan = self._plans.get(POD)
            if plan is None:
                top: WalkResult[_DescriptionPlan] = WalkResult(
                    None, "", obj=None, ref=None, reason=REASON_NO_CONTROLLER_OWNER
                )
            else:
                top = WalkResult(plan, rec.uid, obj=None, ref=None, reason="")
        else:
            top = self._graph.walk(rec.owner, rec.namespace, self._walk_plans.get,
                                   self._is_errored)
            if top.cut and top.obj is not None:
                # the hop limit stopped the pod's walk above a described object, whose
                # own walk starts higher: the pod goes where that object goes (its
                # membership, :meth:`_attribute_object`), or a nested Deployment would be
                # a workload of its own pods and a member of the workload above at once
                o = top.obj
                top = self._graph.walk(o.owner, o.namespace, self._walk_plans.get,
                                       self._is_errored,
                                       WalkResult(top.described, o.uid, o, None, ""))
            if top.described is None and top.root_pod:
                # a bare pod that controls pods (a Spark driver its executors) is their
                # workload under the Pod description, which places them in its components
                plan = self._plans.get(POD)
                if plan is not None:
                    top = WalkResult(plan, top.root_pod, obj=None, ref=None, reason="")
        plan = top.described
        if plan is None:
            att = PodAttribution(rec.namespace, rec.name, rec.uid, reason=top.reason)
            if rec.wl:
                self._leave(rec)
            self._owe_retry(_RETRY_POD, rec.uid, None)
        else:
            wref = self._workload_ref(top, rec.namespace)
            wl_uid = top.uid
            self._pod_retry_after = None
            comp, inst, replica = self._placement(plan, rec, wl_uid)
            old = rec.att
            if (self._pod_retry_after is not None and old is not None
                    and rec.wl == wl_uid and old.component in plan.pod_comp_names):
                # a selector failed for now (the sandbox down, its child killed): the
                # pod keeps the place it has in this workload until the retry owed
                # settles it. Placed by what did not fail, it moved to the default
                # component (or none) for the outage and back after: a second and a
                # third label set of every series of the pod in the TSDB
                comp, inst, replica = old.component, old.instance, old.replica
            self._owe_retry(_RETRY_POD, rec.uid, self._pod_retry_after)
            att = PodAttribution(
                rec.namespace, rec.name, rec.uid, wref, comp, inst, replica, plan.desc.name
            )
            key = (comp, inst)
            if wl_uid != rec.wl or key != rec.key:
                key = self._count_keys(key)
                self._leave(rec)
                wl = self._join(wl_uid, wref, plan)
                wl.counts[key] = wl.counts.get(key, 0) + 1
                wl.by_comp[comp] = wl.by_comp.get(comp, 0) + 1
                rec.wl, rec.key = wl_uid, key
                self._dirty.add(wl_uid)
            else:
                self._join(wl_uid, wref, plan)
        if att != rec.att:
            rec.att = att
            cs.pods[rec.uid] = att

    def _leave(self, rec: _PodRec) -> None:
        if not rec.wl:
            return
        wl = self._wl.get(rec.wl)
        if wl is not None:
            n = wl.counts.get(rec.key, 0) - 1
            if n > 0:
                wl.counts[rec.key] = n
            else:
                wl.counts.pop(rec.key, None)
            comp, _ = rec.key
            n = wl.by_comp.get(comp, 0) - 1
            if n > 0:
                wl.by_comp[comp] = n
            else:
                wl.by_comp.pop(comp, None)
            self._dirty.add(rec.wl)
        rec.wl, rec.key = "", ("", "")

    def _join(self, uid: str, ref: WorkloadRef, plan: _DescriptionPlan) -> _Workload:
        wl = self._wl.get(uid)
        if wl is None:
            wl = self._wl[uid] = _Workload(uid, ref, plan)
            self._dirty.add(uid)
        elif wl.ref is not ref or wl.plan is not plan:
            wl.ref, wl.plan = ref, plan
            self._dirty.add(uid)
        return wl

    def _attribute_object(self, rec: ObjectRecord) -> None:
        """A described object belongs to its topmost described owner (often itself)."""
        plan = self._plans.get(rec.gk)
        new = ""
        if plan is None:
            if rec.gk not in self._errored:
                rec.obj = None  # no longer described: nothing to evaluate on it
        else:
            top = self._graph.walk(
                rec.owner, rec.namespace, self._walk_plans.get, self._is_errored,
                WalkResult(plan, rec.uid, obj=rec, ref=None, reason=""),
            )
            if top.described is not None:  # None: on, or below, an owner cycle
                new = top.uid
                self._join(new, self._workload_ref(top, rec.namespace), top.described)
                self._wl[new].objs.add(rec.uid)
                self._dirty.add(new)
        if rec.member and rec.member != new:
            wl = self._wl.get(rec.member)
            if wl is not None:
                wl.objs.discard(rec.uid)
                self._dirty.add(rec.member)
        rec.member = new

    def _placement(self, plan: _DescriptionPlan, pod: _PodRec, wl_uid: str) -> _Placement:
        """Where a pod lands in a workload of ``plan``."""
        cp = None
        if plan.single:
            cp = plan.pod_comps[0]
        else:
            for c in plan.selective:
                try:
                    ok = c.accepts(pod)
                except JqError as exc:
                    self._selector_error(plan, wl_uid, c.type, exc, pod)
                    ok = False
                if ok:
                    if cp is not None:  # selectors must be exclusive: the first one wins
                        self.stats[STAT_AMBIGUOUS_COMPONENT] += 1
                        break
                    cp = c
            if cp is None:
                cp = plan.fallback
        if cp is None:
            return _UNPLACED
        inst = ""
        if cp.inst is not None:
            try:
                iid = single_output_id(cp.inst.outputs(pod))
            except JqError as exc:
                self._selector_error(plan, wl_uid, cp.inst, exc, pod)
                iid = None
            if iid is not None and cp.check_ids:
                ev = self._object_facts(wl_uid, plan)
                ids = ev.ids.get(cp.name) if ev is not None else None
                if ids is not None and iid not in ids:
                    self.stats[STAT_INSTANCE_NOT_LISTED] += 1
                    iid = None
            inst = iid or ""
        replica = ""
        if cp.replica is not None:
            try:
                replica = single_output_id(cp.replica.outputs(pod)) or ""
            except JqError as exc:
                self._selector_error(plan, wl_uid, cp.replica, exc, pod)
        return _Placement(cp.name, inst, replica)

    # -- jq errors ----------------------------------------------------------------------

    def _selector_error(self, plan: _DescriptionPlan, wl_uid: str, probe: _Probe | None,
                        exc: JqError, pod: _PodRec) -> None:
        self.jq_errors[(JQ_ERROR_SELECTOR, plan.desc.name)] += 1
        after = exc.retry_after
        if after is not None:
            soonest = self._pod_retry_after
            self._pod_retry_after = after if soonest is None else min(soonest, after)
        source = probe.expr.source if probe is not None else ""
        self._log_jq_error(plan, wl_uid, "pod selector", source, str(exc.__cause__ or exc),
                           pod=f"{pod.namespace}/{pod.name}")

    def _log_jq_error(self, plan: _DescriptionPlan, wl_uid: str, where: str, expression: str,
                      message: str, *, pod: str = "") -> None:
        """Log a jq runtime error once per workload and expression (counted by the
        caller, every time, in ``stats``). A selector's names the pod it failed on too
        (``namespace/name``): an expression failing on some pods only (a label one pod
        lacks) was told by its workload alone, the pod left to be guessed."""
        key = (wl_uid, expression)
        if key in self._jq_logged:
            return
        began, lines, held = self._jq_window
        now = time.monotonic()
        if now - began >= _JQ_LINE_WINDOW_SECONDS:
            if held:
                log.warning("karta engine: %d more jq errors were not logged in the last "
                            "%.0f s (at most %d lines a window; every one is counted in "
                            "karta_proxy_jq_errors_total)", held, now - began,
                            _JQ_LINES_PER_WINDOW)
            began, lines, held = now, 0, 0
        if lines >= _JQ_LINES_PER_WINDOW:
            self._jq_window = (began, lines, held + 1)
            return  # not remembered: logged later, in a window with room
        self._jq_window = (began, lines + 1, held)
        if len(self._jq_logged) >= _JQ_LOGGED_MAX:
            self._jq_logged.clear()
        self._jq_logged.add(key)
        wl = self._wl.get(wl_uid)
        rec = self._graph.objects.get(wl_uid)
        if wl is not None:
            ident = f"{wl.ref.kind} {wl.ref.namespace}/{wl.ref.name}"
        elif rec is not None:
            ident = f"{rec.gk.kind} {rec.namespace}/{rec.name}"
        else:
            ident = f"uid {wl_uid}"
        if pod:
            ident += f", pod {pod}"
        what = f"{where} {expression!r}" if expression else where
        if len(message) > _JQ_MESSAGE_SHOWN:  # jq's message may quote the input's values
            message = message[:_JQ_MESSAGE_SHOWN] + f"... ({len(message)} characters)"
        log.warning("karta engine: jq error in %s of description %s (%s), on workload %s: %s"
                    " (logged once per workload and expression)",
                    what, plan.desc.name, plan.desc.source, ident, message)

    # -- workload facts -----------------------------------------------------------------

    def _kept(self, obj: Mapping[str, Any], uid: str, gk: GroupKind
              ) -> tuple[Mapping[str, Any] | Packed, _FactsCache | None]:
        """What a record keeps of ``obj`` (its jq text) and its facts cache: those
        prepared in another thread when ``upsert_many`` was given them (to be accounted
        for at first use, if their plan is the one asked then: the kind's, or the old one
        its workload is under until re-attributed after a description change), else the
        text made here (timed, for the object's weight) and no facts yet."""
        ready = self._prepared.get(id(obj)) if self._prepared is not None else None
        if ready is not None:
            if ready.facts is None or ready.plan is not self._plans.get(gk):
                # the pack weighs the evaluation made here if they go unused
                self._packing[uid] = ready.pack_seconds
            if ready.facts is None:
                return ready.kept, None
            return ready.kept, _FactsCache(ready.plan, ready.facts, ready.seconds)
        began = time.perf_counter()
        kept = pack_for_jq(_trim(obj))
        self._packing[uid] = time.perf_counter() - began
        return kept, None

    def _object_facts(self, uid: str, plan: _DescriptionPlan) -> _ObjectFacts | None:
        """Derived facts of the workload object, cached per object version and plan;
        evaluated here, or taken from another thread's evaluation (``upsert_many(...,
        prepared=)``), and accounted for either way at their first use: jq errors counted
        and logged, a retry owed or settled, the object's weight (:meth:`heavy`)."""
        holder: ObjectRecord | _PodRec | None = self._graph.objects.get(uid)
        if holder is None:
            holder = self._pods.get(uid)
        if holder is None or holder.obj is None:
            return None
        cache: _FactsCache | None = holder.cache
        if cache is not None and cache.plan is plan:
            if cache.unaccounted is None:
                return cache.facts
            ev, seconds = cache.facts, cache.unaccounted
            self._packing.pop(uid, None)  # in ``unaccounted``
        else:
            ev, seconds = _timed_facts(plan, holder.obj)
            seconds += self._packing.pop(uid, 0.0)
        holder.cache = _FactsCache(plan, ev)
        if seconds >= self._heavy_seconds:
            self._heavy.add(uid)
        else:
            self._heavy.discard(uid)
        self._owe_retry(_RETRY_FACTS, uid, ev.retry_after)
        for err in ev.errors:
            self.jq_errors[(err.where, plan.desc.name)] += 1
            where = "status" if err.where == JQ_ERROR_STATUS else "workload path"
            self._log_jq_error(plan, uid, where, err.expression, err.message)
        return ev

    def _workload_facts(self, wl: _Workload) -> WorkloadFacts:
        plan = wl.plan
        ev = self._object_facts(wl.uid, plan)
        statuses: tuple[str, ...]
        if ev is None:
            phase, statuses, reason = UNDEFINED, (UNDEFINED,), PHASE_REASON_OBJECT_MISSING
        else:
            phase, statuses, reason = ev.phase, ev.statuses, ev.reason
        # an Undefined that says only "could not evaluate for now" is a gap in the
        # evidence, not a phase of the object: the same phase after it goes on from its
        # old start (one sandbox restart would otherwise reset time-in-phase of every
        # workload updated meanwhile)
        failed_for_now = phase == UNDEFINED and ev is not None and ev.retry_after is not None
        held = wl.held
        if held is not None and not failed_for_now:
            wl.held = None
            if phase == held.phase:
                wl.phase, wl.since, wl.prev_since = phase, held.since, held.prev_since
            else:  # another phase, first seen now (an Undefined too: the gap was none)
                wl.phase, wl.since, wl.prev_since = phase, self._clock(), held.since
        elif phase != wl.phase:
            if failed_for_now and wl.phase is not None and wl.evidenced:
                wl.held = _HeldPhase(wl.phase, wl.since, wl.prev_since)
            wl.prev_since = wl.since if wl.phase is not None and wl.evidenced else -math.inf
            wl.phase, wl.since = phase, self._clock()
        wl.evidenced = ev is not None
        # the object's time, unless it is older than the previous phase this proxy saw the
        # object in: then it dates an earlier stretch of this phase (a Deployment's
        # Available stays True through a rollout, Running -> Initializing -> Running, and
        # time in Running counted from weeks ago), and the proxy's own sighting is the start
        if ev is not None and ev.since is not None and ev.since >= wl.prev_since:
            since, source = ev.since, PHASE_SINCE_OBJECT
        else:
            since, source = wl.since, PHASE_SINCE_OBSERVED
        return WorkloadFacts(
            wl.ref,
            plan.desc.name,
            plan.desc.builtin,
            phase,
            statuses,
            reason,
            since,
            _replica_facts(plan, ev, wl.counts, wl.by_comp),
            source,
        )

    def _settle(self, cs: ChangeSet) -> None:
        """Settle the workloads touched by this call, and the required kinds."""
        dirty, self._dirty = self._dirty, set()
        for uid in dirty:
            wl = self._wl.get(uid)
            if wl is None:
                continue
            if not wl.counts and not wl.objs:
                del self._wl[uid]
                if wl.facts is not None:
                    cs.workloads[uid] = None
                continue
            facts = self._workload_facts(wl)
            if facts != wl.facts:
                wl.facts = facts
                cs.workloads[uid] = facts
        self._packing.clear()  # each pack's evaluation was in this call, or is none
        if self._kinds_touched or self._graph.kinds_touched:
            self._kinds_touched = self._graph.kinds_touched = False
            required = self._compute_required()
            if required != self._required:
                self._lapsed.update(gk for gk, mode in self._required.items()
                                    if mode == "full" and required.get(gk) != "full")
                self._required = required
                cs.kinds_changed = True

    def _compute_required(self) -> dict[GroupKind, str]:
        req: dict[GroupKind, str] = {gk: "metadata" for gk in self._graph.owner_kinds}
        for plan in self._plans.values():
            for c in plan.desc.children:
                if c.kind is not None:
                    req[c.kind.group_kind] = "metadata"
            for g in plan.desc.additional_child_kinds:
                req[g.group_kind] = "metadata"
        for gk in (*self._plans, *self._errored):
            req[gk] = "full"
        req[POD] = "full"
        return req

    # -- descriptions -------------------------------------------------------------------

    def _upsert_description(
        self, obj: Mapping[str, Any], md: Mapping[str, Any], cs: ChangeSet
    ) -> None:
        from proxy.karta.description import DescriptionError, parse_description

        source = _api_source(obj, md)
        spec = obj.get("spec")
        if source in self._api_specs and self._api_specs[source] == spec:
            return  # a resync of an unchanged description: nothing to redo
        self._api_specs[source] = copy.deepcopy(spec)  # the caller may reuse its dict
        try:
            desc = parse_description(obj, source)
        except DescriptionError as exc:
            # an edit that broke it: its last valid version stays in force (as a reload's
            # invalid file keeps the files in force), the error reported beside it; a
            # typo in one edit took every pod of the kind to description_error, every
            # one of its series changing label set, until the next edit
            self._api_errors[source] = exc
            if source in self._sources:
                log.warning("karta engine: description %s not taken, its last valid version "
                            "stays in force: %s", source, exc)
            else:
                log.warning("karta engine: description %s skipped: %s", source, exc)
        else:
            self._sources[source] = [desc]
            self._api_errors.pop(source, None)
        self._reselect_api(cs)

    def _delete_description(
        self, obj: Mapping[str, Any], md: Mapping[str, Any], cs: ChangeSet
    ) -> None:
        source = _api_source(obj, md)
        self._api_specs.pop(source, None)
        self._sources.pop(source, None)
        self._api_errors.pop(source, None)
        self._reselect_api(cs)

    def _reselect_api(self, cs: ChangeSet) -> None:
        """After a description object changed: re-attribute what that touches, or owe it
        to the caller's list (``upsert_many(..., owed=)``)."""
        touched = self._reselect()
        if self._owing is not None:
            self._owing.extend(touched)
        else:
            self._reattribute_below(touched, cs)

    def _log_in_force(self, gk: GroupKind, old: _DescriptionPlan | None,
                      new: _DescriptionPlan | None) -> None:
        """An info line when the description in force for ``gk`` changes: a description
        taking effect, changed, replacing a built-in or another description, or leaving.
        The built-ins taking effect at the start are not news. At most one line per kind
        and description per :data:`_IN_FORCE_LINE_SECONDS` (a controller rewriting a
        Karta in a loop makes one line a minute), the changes in between counted in the
        next; another description taking over is logged at once."""
        if old is None and new is not None and new.desc.builtin:
            return
        # the monotonic clock: on the wall clock a step back of an hour held every line of
        # the kind's description changes for that hour
        now = self._retry_clock()
        key = (gk, new.desc.name if new is not None else "")
        next_at, held = self._in_force_lines.get(key, (0.0, 0))
        if now < next_at:
            self._in_force_lines[key] = (next_at, held + 1)
            return
        if len(self._in_force_lines) >= _JQ_LOGGED_MAX:
            self._in_force_lines.clear()
        self._in_force_lines[key] = (now + _IN_FORCE_LINE_SECONDS, 0)

        def named(p: _DescriptionPlan) -> str:
            return f"{'built-in ' if p.desc.builtin else ''}description {p.desc.name} " \
                   f"({p.desc.source})"

        if new is None:
            assert old is not None
            what = f"{gk} is no longer described ({named(old)} left)"
        elif old is None:
            what = f"{named(new)} takes effect for {gk}"
        elif (old.desc.name, old.desc.source) == (new.desc.name, new.desc.source):
            what = f"{named(new)} of {gk} changed"
        elif old.desc.builtin and not new.desc.builtin:
            what = f"{named(new)} replaces the built-in description {old.desc.name} of {gk}"
        else:
            what = f"{named(new)} replaces {named(old)} for {gk}"
        more = f" ({held} earlier change(s) in the last {_IN_FORCE_LINE_SECONDS:.0f} s not " \
               "logged)" if held else ""
        log.info("karta engine: %s; its objects and pods are attributed again%s", what, more)

    def _reselect(self) -> list[str]:
        """Pick the description in force per kind; the objects whose kind's description
        changed, to re-attribute with everything below them (their pods, the objects
        whose owner chains pass through them)."""
        from proxy.karta.description import select_descriptions

        ordered = list(self._sources.get("builtin", ()))
        for src, descs in self._sources.items():
            if src != "builtin":
                ordered.extend(descs)
        winners, errors = select_descriptions(ordered)
        before = set(self._selection_errors)
        for e in errors:
            if e not in before:  # each loser once (again only if it wins and loses anew)
                log.warning("karta engine: description not in force: %s", e)
        self._selection_errors = list(errors)
        self.description_errors = [
            *(e for errs in self._source_errors.values() for e in errs),
            *self._api_errors.values(),
            *self._selection_errors,
        ]
        old = self._plans
        new: dict[GroupKind, _DescriptionPlan] = {}
        for gk, desc in winners.items():
            prev = old.get(gk)
            # by value: a description read again unchanged (every configuration reload
            # re-reads the files) keeps its plan, and its kind is not re-attributed
            if prev is not None and prev.desc == desc:
                new[gk] = prev
            else:
                new[gk] = plan = _DescriptionPlan(desc)
                for problem in plan.unkept:
                    self.stats[STAT_SELECTOR_UNKEPT_FIELD] += 1
                    log.warning("karta engine: description %s (%s): %s, which the proxy does "
                                "not keep of a pod: that selector sees null there",
                                desc.name, desc.source, problem)
        self.description_warnings = [
            f"{p.desc.source} ({p.desc.name}): {u}" for p in new.values() for u in p.unkept]
        changed = {gk for gk in old.keys() | new.keys() if old.get(gk) is not new.get(gk)}
        for gk in sorted(changed, key=str):
            self._log_in_force(gk, old.get(gk), new.get(gk))
        errored = frozenset(
            e.kind for e in (*(e for errs in self._source_errors.values() for e in errs),
                             *self._api_errors.values())
            if e.kind is not None
        ) - new.keys()
        changed |= errored ^ self._errored
        self._errored = errored
        self._plans = new
        self._walk_plans = {gk: p for gk, p in new.items() if gk != POD}
        if not changed:
            return []
        self._kinds_touched = True
        # the objects of a changed kind, the absent owners of one, and bare pods when
        # Pod's description changed: what lies below them is found as they are given
        # (:meth:`_reattribute_below`), so the loop is not held for a walk of every
        # object below (51k at 37.5k pods, 70-100 ms) when the change is made
        roots = [uid for uid, rec in self._graph.objects.items() if rec.gk in changed]
        roots += [uid for uid, gk in self._graph.absent_owners() if gk in changed]
        if POD in changed:
            roots += self._bare  # and the pods they control (Pod workloads too)
        # one below another is given with it already
        return self._graph.topmost(roots)
