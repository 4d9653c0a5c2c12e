"""What the engine answers: pod attribution, workload facts, change sets, and the names
of the counters in ``Engine.stats``.

These are the only engine types the rest of the proxy sees (the index, the fact
series, the watch source, the metrics). They are small, immutable and hashable. The
counter names live here, not in the engine, so the engine's parts that count
(``proxy.karta.replicas``) and the metrics that export them need not import the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: where ``WorkloadFacts.phase_since`` comes from: the object's own record (the
#: ``lastTransitionTime`` of the conditions the phase matched on), or this process's clock
#: when it saw the phase change (the object carries no evidence)
PHASE_SINCE_OBJECT = "object"
PHASE_SINCE_OBSERVED = "observed"

#: Phase reason of a workload known only from an ownerReference (its object not seen yet,
#: or seen before its kind was described, or deleted while pods it owned remain).
PHASE_REASON_OBJECT_MISSING = "workload_object_missing"


#: Counters in ``Engine.stats`` (what the engine noticed but could not act on).
STAT_AMBIGUOUS_COMPONENT = "ambiguous_component"
STAT_INSTANCE_NOT_LISTED = "instance_not_listed"
STAT_INVALID_OBJECT = "invalid_object"
#: pod-selector paths of the descriptions put in force that read pod fields the engine
#: does not keep (counted once per path each time its description is put in force)
STAT_SELECTOR_UNKEPT_FIELD = "selector_unkept_field"
#: re-evaluations the engine made of its own accord (``Engine.retry_due``): a workload
#: object's facts or a pod's place, after a jq failure that was not the expression's
#: (the sandbox's child held up, killed, unable to start) or a quarantine that ended
#: (exported as ``karta_proxy_jq_retries_total``)
STAT_JQ_RETRY = "jq_retry"
#: Where a jq runtime error can happen, the keys of ``Engine.jq_errors`` with the
#: description's name (each logged once per workload and expression; exported as
#: ``karta_proxy_jq_errors_total{where, description}``): a pod selector (the pod's
#: component, instance or replica not given), a workload's instance ids and scale paths,
#: its status (the phase: Undefined, jq_error).
JQ_ERROR_SELECTOR = "selector"
JQ_ERROR_WORKLOAD = "workload"
JQ_ERROR_STATUS = "status"
JQ_ERROR_WHERE = (JQ_ERROR_SELECTOR, JQ_ERROR_WORKLOAD, JQ_ERROR_STATUS)
#: Why a description is not in force, the keys of ``Engine.description_problems()``
#: (exported as ``karta_proxy_description_errors{reason}``), disjoint: ``invalid``, it does
#: not parse or validate and nothing of it is in force (a file, a snapshot's, a Karta
#: object the proxy never saw valid); ``held_last_valid``, a Karta object edited invalid
#: whose last valid version stays in force until a restart, when it describes nothing;
#: ``not_in_force``, valid, but another description of its kind wins.
DESCRIPTION_INVALID = "invalid"
DESCRIPTION_HELD_LAST_VALID = "held_last_valid"
DESCRIPTION_NOT_IN_FORCE = "not_in_force"
DESCRIPTION_ERROR_REASONS = (DESCRIPTION_INVALID, DESCRIPTION_HELD_LAST_VALID,
                             DESCRIPTION_NOT_IN_FORCE)


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    """The identity of a top-level workload. ``uid`` is the key; the rest is for labels."""

    namespace: str
    group: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class PodAttribution:
    """One pod's place: exactly one (workload, component, instance[, replica]) or a reason.

    ``workload is None`` means unattributed and ``reason`` says why. An attributed pod that
    no component selector accepted has ``component == ""`` (see docs/karta.md).
    """

    namespace: str
    pod: str
    uid: str
    workload: WorkloadRef | None = None
    component: str = ""
    instance: str = ""
    replica: str = ""
    #: name of the description that attributed the pod
    description: str = ""
    #: "" when attributed; otherwise a short snake_case reason (a label value)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaFact:
    """Desired vs observed pods of one component instance."""

    component: str
    instance: str
    desired: float | None
    min_desired: float | None
    max_desired: float | None
    observed: int


@dataclass(frozen=True, slots=True)
class WorkloadFacts:
    ref: WorkloadRef
    description: str
    builtin: bool
    #: the one current generic phase (documented rule in docs/karta.md)
    phase: str
    #: every matching generic status, upstream order; ("Undefined",) when none
    statuses: tuple[str, ...]
    #: why the phase is Undefined ("" otherwise)
    phase_reason: str
    #: unix seconds when ``phase`` began: from the object where it says (the matched
    #: conditions' ``lastTransitionTime``), else when this process saw it change
    phase_since: float
    replicas: tuple[ReplicaFact, ...] = ()
    #: ``PHASE_SINCE_OBJECT`` or ``PHASE_SINCE_OBSERVED``: which of the two ``phase_since`` is
    phase_since_source: str = PHASE_SINCE_OBSERVED


@dataclass(slots=True)
class ChangeSet:
    """What one engine call changed, so followers update without rescanning.

    ``pods`` maps pod uid -> new attribution, or None when the pod is gone.
    ``workloads`` maps workload uid -> new facts, or None when the workload is gone.
    ``kinds_changed`` is True when the set of kinds the engine needs watched changed.
    """

    pods: dict[str, PodAttribution | None] = field(default_factory=dict)
    workloads: dict[str, WorkloadFacts | None] = field(default_factory=dict)
    kinds_changed: bool = False

    def merge(self, other: ChangeSet) -> None:
        self.pods.update(other.pods)
        self.workloads.update(other.workloads)
        self.kinds_changed = self.kinds_changed or other.kinds_changed

    def __bool__(self) -> bool:
        return bool(self.pods or self.workloads or self.kinds_changed)


class PartialBatch(Exception):
    """The engine failed part-way through a batch (a bug; the cause is ``__cause__``).

    ``changes`` is what the batch changed before the failure, settled: the engine holds
    those changes already, so the caller applies them, or its followers would keep the
    old attributions of every object before the failing one (given again, those objects
    are unchanged and give nothing). None when settling failed too."""

    def __init__(self, changes: ChangeSet | None) -> None:
        super().__init__("the engine failed part-way through a batch")
        self.changes = changes


@dataclass(slots=True)
class Reattribution:
    """A change of descriptions, made (``Engine.change_descriptions``): what it changed
    itself (the kinds to watch), and the objects it owes a new attribution, each with
    what lies below it, to be given in runs (``Engine.reattribute``)."""

    changes: ChangeSet
    owed: list[str]
