"""The fact model: which fact series exist for the index's state, with their names,
labels and values.

Facts only (attribution, identity, phase, desired and observed pods, freshness, versions):
never a measurement, an aggregate or a threshold; the aggregates ship as recording rules
(``config/rules/``). Every name comes from :mod:`proxy.contract` and is documented in
``docs/metrics.md``.

Two outlets share this one producer (:func:`iter_facts` and the per-object functions),
so the stream and ``/metrics`` cannot disagree on what a fact is:
:class:`proxy.facts.writer.FactWriter` writes them into the remote-write stream and
:class:`proxy.facts.collectors.FactsCollector` serves them on ``/metrics``. Nothing here
knows the wire format or who writes.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import proxy
from proxy import contract
from proxy.index import PodIndex, stamped_pairs
from proxy.karta.model import GENERIC_PHASES, UNDEFINED
from proxy.karta.results import PodAttribution, ReplicaFact, WorkloadFacts
from proxy.wire.native import DEFAULT as SPLICE

Labels = tuple[tuple[str, str], ...]


class Fact(NamedTuple):
    """One fact series: name, its labels (sorted, no ``__name__``, no empty values), value."""

    name: str
    labels: Labels
    value: float


#: help text per fact series (also the remote-write metadata and the /metrics HELP)
HELP: dict[str, str] = {
    contract.FACT_POD_INFO: "Attribution of a pod to its Karta workload, component, "
    "instance and replica (1 while the pod is known).",
    contract.FACT_POD_UNATTRIBUTED_INFO: "A known pod that no Karta description "
    "attributes, with the reason (1 while the pod is known).",
    contract.FACT_WORKLOAD_INFO: "A workload: its identity, the Karta description that "
    "describes it and whether that description is built in.",
    contract.FACT_WORKLOAD_PHASE: "Generic phase of a workload as a state set: 1 for the "
    "current phase, 0 for every other generic phase.",
    contract.FACT_WORKLOAD_PHASE_TRANSITION: "Unix time the workload's current phase "
    "began: from the object's conditions (source=object) or as this proxy saw it change "
    "(source=observed); time() minus this is the time in the current phase.",
    contract.FACT_WORKLOAD_STATUS: "Every generic status of a workload: 1 when its "
    "status mappings match, 0 otherwise.",
    contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO: "Why a workload's phase is Undefined "
    "(present only while it is).",
    contract.FACT_COMPONENT_DESIRED_REPLICAS: "Desired replicas of a component instance, "
    "from the description's scaleDefinition.replicasPath.",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN: "Lower bound of a component instance's "
    "desired replicas (scaleDefinition.minReplicasPath).",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX: "Upper bound of a component instance's "
    "desired replicas (scaleDefinition.maxReplicasPath).",
    contract.FACT_COMPONENT_OBSERVED_PODS: "Pods the index knows in a component instance.",
    contract.FACT_NAMESPACE_PODS: "Pods the index knows in a namespace, attributed or "
    "not; unattributed ones by reason.",
    contract.FACT_SOURCE_LAST_CURRENT: "Unix time a watched resource was last known "
    "current (list, event or bookmark).",
    contract.FACT_CONTRACT_INFO: "Version of the metric and label contract (docs/metrics.md).",
    contract.FACT_BUILD_INFO: "Version of karta-proxy.",
}


# -- the producer ----------------------------------------------------------------------------


def label_set(pairs: Iterable[tuple[str, str]]) -> Labels:
    """Labels as a fact carries them: sorted by name, empty values left out (an empty
    label is no label in Prometheus, so keeping it would make two keys of one series)."""
    return tuple(sorted((k, v) for k, v in pairs if v))


#: the label of the facts that name no workload (contract.FACT_LABEL_WRITER says why)
WRITER = (contract.FACT_LABEL_WRITER, contract.WRITTEN_BY)

_REASON_CODE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def reason_code(text: str) -> str:
    """The snake_case code of a reason (``"jq_error: <detail>"`` -> ``jq_error``).

    Details (jq messages, object values) would make a label value that changes with the
    object: one new series per message. The detail belongs in logs; the label keeps the
    bounded code.
    """
    code = text.split(":", 1)[0].strip()
    return code if _REASON_CODE.match(code) else "other"


def pod_facts(att: PodAttribution) -> list[Fact]:
    """The facts of one pod: its attribution, or why it has none."""
    base = (
        (contract.FACT_LABEL_NAMESPACE, att.namespace),
        (contract.FACT_LABEL_POD, att.pod),
        (contract.FACT_LABEL_UID, att.uid),
    )
    stamped = stamped_pairs(att)
    if stamped:
        return [Fact(contract.FACT_POD_INFO, label_set((*base, *stamped)), 1.0)]
    reason = reason_code(att.reason) if att.reason else "unattributed"
    return [
        Fact(
            contract.FACT_POD_UNATTRIBUTED_INFO,
            label_set((*base, (contract.FACT_LABEL_REASON, reason), WRITER)),
            1.0,
        )
    ]


def coverage_facts(pods: Iterable[PodAttribution]) -> list[Fact]:
    """Attribution coverage: pods per namespace, attributed or unattributed by reason.

    So a dashboard or an alert reads coverage from a few series per namespace instead of
    counting the per-pod facts (one series per pod, and left out of /metrics by default).
    The same split as :func:`pod_facts`, counted in one pass: raw reasons first (a small
    set), then their codes. A namespace with pods always has its ``attributed`` series,
    0 when none is, so a share that falls to nothing is a 0, not a gap; a reason is
    present only while some pod has it (its series ends with a stale marker).
    """
    return coverage_of(Counter(map(coverage_key, pods)))


def coverage_key(att: PodAttribution) -> tuple[str, str | None]:
    """What :func:`coverage_facts` counts a pod under: its namespace, and None when it is
    attributed, else its raw reason."""
    return att.namespace, None if att.workload is not None else att.reason


def coverage_of(raw: Counter[tuple[str, str | None]]) -> list[Fact]:
    """:func:`coverage_facts` of pods already counted by :func:`coverage_key` (the fact
    writer counts them as it walks the pods, a stretch at a time)."""
    attributed: Counter[str] = Counter()
    unattributed: Counter[tuple[str, str]] = Counter()
    for (namespace, reason), n in raw.items():
        if reason is None:
            attributed[namespace] += n
        else:
            attributed[namespace] += 0
            unattributed[namespace, reason_code(reason) if reason else "unattributed"] += n
    ns_label, state = contract.LABEL_NAMESPACE, contract.FACT_LABEL_STATE
    out = [
        Fact(
            contract.FACT_NAMESPACE_PODS,
            label_set(((ns_label, namespace), (state, contract.STATE_ATTRIBUTED))),
            float(n),
        )
        for namespace, n in sorted(attributed.items())
    ]
    out.extend(
        Fact(
            contract.FACT_NAMESPACE_PODS,
            label_set(
                (
                    (ns_label, namespace),
                    (state, contract.STATE_UNATTRIBUTED),
                    (contract.FACT_LABEL_REASON, code),
                )
            ),
            float(n),
        )
        for (namespace, code), n in sorted(unattributed.items())
    )
    return out


#: each replica family's value in a workload's component instance, in the order a
#: workload's facts list them (None or NaN: no series)
_REPLICA_VALUE: dict[str, Callable[[ReplicaFact], float | None]] = {
    contract.FACT_COMPONENT_DESIRED_REPLICAS: lambda rf: rf.desired,
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN: lambda rf: rf.min_desired,
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX: lambda rf: rf.max_desired,
    contract.FACT_COMPONENT_OBSERVED_PODS: lambda rf: float(rf.observed),
}
#: the families of a workload's component instances (one series each per instance)
REPLICA_FAMILIES = frozenset((
    contract.FACT_COMPONENT_DESIRED_REPLICAS,
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN,
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX,
    contract.FACT_COMPONENT_OBSERVED_PODS,
))
#: the families made per pod (:func:`pod_facts`) and about the process (:func:`process_facts`)
POD_FAMILIES = frozenset((contract.FACT_POD_INFO, contract.FACT_POD_UNATTRIBUTED_INFO))
PROCESS_FAMILIES = frozenset((
    contract.FACT_SOURCE_LAST_CURRENT, contract.FACT_CONTRACT_INFO, contract.FACT_BUILD_INFO,
))


def workload_identity(wf: WorkloadFacts) -> Labels:
    """The stamped labels that name a workload, as every enriched series carries them."""
    r = wf.ref
    return label_set(
        (
            (contract.LABEL_GROUP, r.group),
            (contract.LABEL_KIND, r.kind),
            (contract.LABEL_NAMESPACE, r.namespace),
            (contract.LABEL_WORKLOAD, r.name),
        )
    )


def workload_facts(wf: WorkloadFacts, family: str | None = None) -> list[Fact]:
    """Info, phase state set, transition time, statuses and replica facts of a workload
    (``family``: only that family's, in the same order; /metrics renders a family at a
    time without building the others)."""
    ident = workload_identity(wf)
    out: list[Fact] = []
    if family in (None, contract.FACT_WORKLOAD_INFO):
        out.append(Fact(
            contract.FACT_WORKLOAD_INFO,
            label_set(
                (
                    *ident,
                    (contract.FACT_LABEL_WORKLOAD_UID, wf.ref.uid),
                    (contract.FACT_LABEL_DESCRIPTION, wf.description),
                    (contract.FACT_LABEL_BUILTIN, "true" if wf.builtin else "false"),
                )
            ),
            1.0,
        ))
    if family in (None, contract.FACT_WORKLOAD_PHASE):
        for phase in GENERIC_PHASES:
            out.append(
                Fact(
                    contract.FACT_WORKLOAD_PHASE,
                    label_set((*ident, (contract.FACT_LABEL_PHASE, phase))),
                    1.0 if phase == wf.phase else 0.0,
                )
            )
    if family in (None, contract.FACT_WORKLOAD_STATUS):
        statuses = set(wf.statuses)
        for status in GENERIC_PHASES:
            out.append(
                Fact(
                    contract.FACT_WORKLOAD_STATUS,
                    label_set((*ident, (contract.FACT_LABEL_STATUS, status))),
                    1.0 if status in statuses else 0.0,
                )
            )
    if family in (None, contract.FACT_WORKLOAD_PHASE_TRANSITION):
        out.append(Fact(
            contract.FACT_WORKLOAD_PHASE_TRANSITION,
            label_set((*ident, (contract.FACT_LABEL_SOURCE, wf.phase_since_source))),
            float(wf.phase_since),
        ))
    if (family in (None, contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO)
            and wf.phase == UNDEFINED and wf.phase_reason):
        out.append(
            Fact(
                contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO,
                label_set((*ident, (contract.FACT_LABEL_REASON, reason_code(wf.phase_reason)))),
                1.0,
            )
        )
    if family is not None and family not in REPLICA_FAMILIES:
        return out
    for rf in wf.replicas:
        labels = label_set(
            (
                *ident,
                (contract.LABEL_COMPONENT, rf.component),
                (contract.LABEL_INSTANCE, rf.instance),
            )
        )
        for name, value_of in _REPLICA_VALUE.items():
            if family not in (None, name):
                continue
            value = value_of(rf)
            if value is not None and not math.isnan(value):
                out.append(Fact(name, labels, float(value)))
    return out


def process_facts(index: PodIndex, build_version: str = proxy.__version__,
                  cluster_uid: str = "") -> list[Fact]:
    """Facts about the proxy itself: freshness per watched resource, contract and build.

    ``karta_build_info`` is the process's one build-info series (on /metrics as well):
    the contract names it, so the operational twin it once had was dropped instead.
    ``cluster_uid`` (:mod:`proxy.kube.cluster_identity`; "" while unknown, and in
    snapshot mode: left out) goes on ``karta_contract_info``, the one series per
    writer, so a ``cluster`` name shared by two clusters shows as two uids under it."""
    out = [
        Fact(
            contract.FACT_SOURCE_LAST_CURRENT,
            label_set(((contract.FACT_LABEL_RESOURCE, resource), WRITER)),
            float(when),
        )
        for resource, when in sorted(index.freshness.items())
        if resource
    ]
    out.append(
        Fact(
            contract.FACT_CONTRACT_INFO,
            label_set(((contract.FACT_LABEL_VERSION, contract.CONTRACT_VERSION), WRITER,
                       (contract.FACT_LABEL_CLUSTER_UID, cluster_uid))),
            1.0,
        )
    )
    out.append(Fact(contract.FACT_BUILD_INFO,
                    label_set(((contract.FACT_LABEL_SPLICE, SPLICE),
                               (contract.FACT_LABEL_VERSION, build_version), WRITER)),
                    1.0))
    return out


def iter_facts(
    index: PodIndex, build_version: str = proxy.__version__, *, pods: bool = True,
    cluster_uid: str = "",
) -> Iterator[Fact]:
    """Every fact series of the index, in no particular order (``pods=False``: without the
    per-pod ones; the per-namespace coverage, a few series, is always there)."""
    pod_list = list(index.pods.values())
    yield from coverage_facts(pod_list)
    if pods:
        for att in pod_list:
            yield from pod_facts(att)
    del pod_list
    for wf in list(index.fact_workloads().values()):
        yield from workload_facts(wf)
    yield from process_facts(index, build_version, cluster_uid)


def family_facts(
    name: str,
    index: PodIndex,
    pods: Sequence[PodAttribution],
    workloads: Sequence[WorkloadFacts],
    build_version: str = proxy.__version__,
    cluster_uid: str = "",
) -> Iterator[Fact]:
    """The series of one fact family, in :func:`iter_facts`' order, from ``pods`` and
    ``workloads`` (the index's, taken once, so every family of one page describes the
    same state); process facts from ``index`` as it is now."""
    if name == contract.FACT_NAMESPACE_PODS:
        yield from coverage_facts(pods)
    elif name in POD_FAMILIES:
        # an attributed pod (a workload: its kind and name are never empty, so its stamp
        # is not) has no unattributed fact: that family, a few pods of 37.5k, was found by
        # making every pod's facts, 104 ms in one stretch of the event loop
        unattributed = name == contract.FACT_POD_UNATTRIBUTED_INFO
        for att in pods:
            if not (unattributed and att.workload is not None):
                yield from (f for f in pod_facts(att) if f.name == name)
    elif name in PROCESS_FAMILIES:
        yield from (f for f in process_facts(index, build_version, cluster_uid)
                    if f.name == name)
    else:
        for wf in workloads:
            if _may_have(wf, name):
                yield from workload_facts(wf, name)


def _may_have(wf: WorkloadFacts, family: str) -> bool:
    """Whether ``workload_facts(wf, family)`` can have a series, told without making its
    labels: a family that few workloads have (replica bounds, an undefined phase's
    reason) was a scan of every workload's labels per page, 17-34 ms at 11.7k workloads,
    in one stretch of the event loop."""
    if family == contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO:
        return wf.phase == UNDEFINED and bool(wf.phase_reason)
    value_of = _REPLICA_VALUE.get(family)
    if value_of is None:
        return True
    return any(v is not None and not math.isnan(v) for v in map(value_of, wf.replicas))
