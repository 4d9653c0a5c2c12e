"""Parsed Karta descriptions: the immutable, validated form the engine runs on.

Both input forms (``run.ai/v1alpha1 Karta`` and the older
``optimization.nvidia.com/v1alpha1 ResourceInterface``) parse into these classes;
``proxy.karta.description`` does the parsing and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.karta.jqexpr import JqExpr

#: Generic statuses, in upstream's evaluation order (``Undefined`` when none matches).
UPSTREAM_STATUS_ORDER: tuple[str, ...] = (
    "Resuming",
    "Suspending",
    "Suspended",
    "Running",
    "Failed",
    "Completed",
    "Initializing",
    "Degraded",
)
UNDEFINED = "Undefined"
#: Every generic phase the proxy can report (the state-set of the phase fact series).
GENERIC_PHASES: tuple[str, ...] = (*UPSTREAM_STATUS_ORDER, UNDEFINED)


@dataclass(frozen=True, slots=True)
class GroupKind:
    """Descriptions and owners are matched by group + kind, whatever the version."""

    group: str
    kind: str

    @classmethod
    def from_api_version(cls, api_version: str, kind: str) -> GroupKind:
        group = api_version.rpartition("/")[0] if "/" in api_version else ""
        return cls(group, kind)

    def __str__(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


@dataclass(frozen=True, slots=True)
class GVK:
    group: str
    version: str
    kind: str

    @property
    def group_kind(self) -> GroupKind:
        return GroupKind(self.group, self.kind)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


@dataclass(frozen=True, slots=True)
class TypeSelector:
    """``componentTypeSelector``: ``key_path`` (+ optional ``value``) and/or ``match_labels``."""

    key_path: JqExpr | None = None
    value: str | None = None
    match_labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PodSelector:
    type_selector: TypeSelector | None = None
    #: ``componentInstanceSelector.idPath`` (runs on the pod).
    instance_id_path: JqExpr | None = None
    #: ``replicaSelector.keyPath`` (runs on the pod); inherited by descendant components.
    replica_key_path: JqExpr | None = None


@dataclass(frozen=True, slots=True)
class ScaleDefinition:
    """jq on the workload object; list outputs line up with ``instanceIdPath`` ids."""

    replicas: JqExpr | None = None
    min_replicas: JqExpr | None = None
    max_replicas: JqExpr | None = None


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    kind: GVK | None = None
    #: Name of the parent component in the same description (not a k8s ownerReference).
    owner_ref: str | None = None
    pod_bearing: bool = False
    scale: ScaleDefinition | None = None
    #: ``instanceIdPath`` (runs on the workload object).
    instance_id_path: JqExpr | None = None
    pod_selector: PodSelector | None = None


@dataclass(frozen=True, slots=True)
class ConditionMatch:
    type: str
    status: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Matcher:
    """ANDed criteria; an empty matcher matches."""

    by_phase: str | None = None
    by_conditions: tuple[ConditionMatch, ...] = ()
    by_expression: JqExpr | None = None
    expected_result: str | None = None


@dataclass(frozen=True, slots=True)
class StatusDefinition:
    phase_path: JqExpr | None = None
    conditions_path: JqExpr | None = None
    type_field: str = "type"
    status_field: str = "status"
    reason_field: str = "reason"
    #: generic status name (e.g. ``Running``) -> ORed matchers
    mappings: tuple[tuple[str, tuple[Matcher, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Description:
    name: str
    #: where it came from: a file path, ``builtin:<name>`` or ``api:<kind>/<name>``
    source: str
    #: ``Karta`` or ``ResourceInterface``
    form: str
    root: Component
    children: tuple[Component, ...] = ()
    additional_child_kinds: tuple[GVK, ...] = ()
    status: StatusDefinition | None = None
    builtin: bool = False
    pod_components: tuple[Component, ...] = field(default=())

    @property
    def group_kind(self) -> GroupKind:
        assert self.root.kind is not None
        return self.root.kind.group_kind
