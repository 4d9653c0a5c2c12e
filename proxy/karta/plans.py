"""Descriptions compiled for the engine, and the pod record they are tested on.

A description is parsed once (``proxy.karta.model``) but its selectors are tested on
every pod event, so the engine works from a plan built once per description in force
(``_DescriptionPlan``): the pod-bearing components with their selectors ready
(``_PodComponentPlan``), the components that get replica facts (``_FactComp``), and the
selector paths that read what the engine does not keep of a pod (``unkept_pod_reads``).

libjq costs ~30 us a call through the PyPI binding, so the plain label / annotation /
name lookups that nearly every pod selector is are answered with a dict probe on the
pod record (``_PodRec``); anything else goes to jq with the same wrapper semantics
(``_Probe``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from proxy.karta.jqexpr import JqExpr, input_fields, outputs_equal, outputs_present
from proxy.karta.model import Component, Description, ScaleDefinition
from proxy.karta.owners import POD, OwnerRef
from proxy.karta.packed import Packed
from proxy.karta.results import PodAttribution

_MAP = r'\.metadata\.(labels|annotations)(?:\["([^"\\]*)"\]|\.([A-Za-z_][A-Za-z0-9_]*))'
_MAP_PATH = re.compile(rf"^\s*{_MAP}\s*$")
#: one label / annotation lookup, else another (the built-in Job's completion index: the
#: label since Kubernetes 1.28, the annotation before)
_ALT_MAP_PATH = re.compile(rf"^\s*{_MAP}\s*//\s*{_MAP}\s*$")
_FIELD_PATH = re.compile(r"^\s*\.metadata\.(name|namespace|uid)\s*$")
#: the kind of the pod's controller, as the built-in Pod description asks for it
_CONTROLLER_KIND_PATH = re.compile(
    r"^\s*\.metadata\.ownerReferences\[\]\?\s*\|\s*select\(\s*\.controller\s*==\s*true\s*\)"
    r"\s*\|\s*\.kind\s*$"
)


# -- pod-side selectors ------------------------------------------------------------------


#: (component, instance) of attributed pods, the key of a workload's pod counts. A plain
#: tuple, not a NamedTuple: ``_replica_facts`` looks counts up by it for every row on every
#: pod event of the workload, and a tuple literal is ~3.4x cheaper to build there than a
#: NamedTuple (median of 5: 199 ns vs 678 ns per lookup, timeit, Python 3.11, Dec 2026).
_CountKey = tuple[str, str]


class _PodRec:
    """A pod as the engine keeps it: the metadata selectors read, and where it was placed."""

    __slots__ = (
        "annotations",
        "att",
        "cache",
        "key",
        "labels",
        "name",
        "namespace",
        "obj",
        "owner",
        "uid",
        "wl",
    )

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.namespace = ""
        self.name = ""
        self.labels: Any = None
        self.annotations: Any = None
        self.owner: OwnerRef | None = None
        #: the whole (trimmed, packed) pod, only while it is bare: its own workload
        self.obj: Mapping[str, Any] | Packed | None = None
        #: what the engine derived from ``obj`` (a ``proxy.karta.replicas._FactsCache``;
        #: typed ``Any`` as ``ObjectRecord.cache`` is: that type builds on this module)
        self.cache: Any = None
        self.att: PodAttribution | None = None
        #: workload uid ("" when unattributed) and its (component, instance) count key
        self.wl = ""
        self.key: _CountKey = ("", "")

    def jq_input(self) -> dict[str, Any]:
        """The pod as selectors see it (built per evaluation, not kept): the metadata
        fields of ``POD_SELECTOR_METADATA``, nothing else."""
        md: dict[str, Any] = {"name": self.name, "namespace": self.namespace, "uid": self.uid}
        if self.labels is not None:
            md["labels"] = self.labels
        if self.annotations is not None:
            md["annotations"] = self.annotations
        o = self.owner
        if o is not None:  # the controller reference is all the engine keeps of the list
            md["ownerReferences"] = [{"apiVersion": o.api_version, "kind": o.gk.kind,
                                      "name": o.name, "uid": o.uid, "controller": True}]
        return {"metadata": md}


#: what a pod selector sees of a pod's metadata (``_PodRec.jq_input``); of
#: ``ownerReferences``, the controller reference only. Kept per pod, for every pod: the
#: rest (spec, status, other metadata) is dropped when the pod arrives
POD_SELECTOR_METADATA = frozenset(
    {"name", "namespace", "uid", "labels", "annotations", "ownerReferences"})


def unkept_pod_reads(expr: JqExpr) -> list[str]:
    """The paths ``expr`` reads of a pod that the engine does not keep (``.spec.x``,
    ``.metadata.generateName``), as far as :func:`input_fields` can tell.

    Such a selector sees null there, silently: upstream runs selectors on the whole pod,
    and a description written for that would place pods differently here. Told at load
    time (a warning), since keeping more of every pod costs memory for all of them."""
    out = []
    for names in input_fields(expr.source) or ():
        if names[0] != "metadata" or (len(names) > 1 and names[1] not in POD_SELECTOR_METADATA):
            out.append("." + ".".join(names[:2]))
    return out


class _Probe:
    """A jq path evaluated on a pod; plain metadata lookups skip libjq.

    ``.metadata.labels["k"]``, ``.metadata.labels.k`` (same for annotations) and
    ``.metadata.name|namespace|uid`` yield exactly what jq yields for them on a pod whose
    labels are a map: the value or null. Two such map lookups joined by ``//`` yield the
    first one's value unless it is null or false, else the second one's, as jq does.
    ``.metadata.ownerReferences[]? | select(.controller
    == true) | .kind`` (the built-in Pod description's test for its controlled pods)
    yields the kept controller reference's kind, or nothing. Everything else is handed to jq.
    """

    __slots__ = ("alt", "expr", "field", "key")

    def __init__(self, expr: JqExpr) -> None:
        self.expr = expr
        self.field: str | None = None
        self.key = ""
        #: for ``field == "alt"``: the (map, key) lookups, tried in order
        self.alt: tuple[tuple[str, str], ...] = ()
        m = _MAP_PATH.match(expr.source)
        a = _ALT_MAP_PATH.match(expr.source) if m is None else None
        if m is not None:
            self.field = m.group(1)
            self.key = m.group(2) if m.group(2) is not None else m.group(3)
        elif a is not None:
            self.field = "alt"
            g = a.groups()
            self.alt = ((g[0], g[1] if g[1] is not None else g[2]),
                        (g[3], g[4] if g[4] is not None else g[5]))
        else:
            m = _FIELD_PATH.match(expr.source)
            if m is not None:
                self.field = m.group(1)
            elif _CONTROLLER_KIND_PATH.match(expr.source):
                self.field = "controller_kind"

    def unkept(self) -> list[str]:
        """What the path reads of a pod the engine does not keep (the plain lookups read
        kept metadata only)."""
        return unkept_pod_reads(self.expr) if self.field is None else []

    def outputs(self, pod: _PodRec) -> list[Any]:
        f = self.field
        if f is None:
            return self.expr.all(pod.jq_input())
        if f == "labels":
            m = pod.labels
        elif f == "annotations":
            m = pod.annotations
        elif f == "controller_kind":
            return [pod.owner.gk.kind] if pod.owner is not None else []
        elif f == "alt":
            v: Any = None
            for which, key in self.alt:
                mm = pod.labels if which == "labels" else pod.annotations
                if mm is None:
                    v = None
                elif isinstance(mm, dict):
                    v = mm.get(key)
                else:
                    return self.expr.all(pod.jq_input())  # jq decides what a non-map yields
                if v is not None and v is not False:
                    return [v]
            return [v]
        else:
            return [getattr(pod, f)]
        if m is None:
            return [None]
        if not isinstance(m, dict):
            return self.expr.all(pod.jq_input())  # jq decides what a non-map yields
        return [m.get(self.key)]


class _UnkeptRead(NamedTuple):
    """A pod-selector path that reads pod fields the engine does not keep (a warning when
    its description is put in force)."""

    #: the selector, e.g. ``componentTypeSelector.keyPath``
    what: str
    #: the jq path
    source: str
    #: the unkept fields it reads (``unkept_pod_reads``)
    fields: list[str]


class _PodComponentPlan:
    """One pod-bearing component, ready to test pods."""

    __slots__ = ("check_ids", "has_type", "inst", "match_labels", "name", "replica", "type",
                 "value")

    def __init__(self, comp: Component, by_name: Mapping[str, Component]) -> None:
        self.name = comp.name
        sel = comp.pod_selector
        ts = sel.type_selector if sel is not None else None
        self.type = _Probe(ts.key_path) if ts is not None and ts.key_path is not None else None
        self.value = ts.value if ts is not None else None
        self.match_labels = ts.match_labels if ts is not None else ()
        self.has_type = self.type is not None or bool(self.match_labels)
        ip = sel.instance_id_path if sel is not None else None
        self.inst = _Probe(ip) if ip is not None else None
        self.check_ids = comp.instance_id_path is not None
        # replicaSelector: declared once, inherited along the component ownerRef chain
        self.replica: _Probe | None = None
        cur: Component | None = comp
        for _ in range(len(by_name) + 1):
            if cur is None:
                break
            rs = cur.pod_selector.replica_key_path if cur.pod_selector is not None else None
            if rs is not None:
                self.replica = _Probe(rs)
                break
            cur = by_name.get(cur.owner_ref) if cur.owner_ref else None

    def unkept(self) -> list[_UnkeptRead]:
        """The selector paths of this component that read what the engine does not keep."""
        out = []
        for what, probe in (("componentTypeSelector.keyPath", self.type),
                            ("componentInstanceSelector.idPath", self.inst),
                            ("replicaSelector.keyPath", self.replica)):
            fields = probe.unkept() if probe is not None else []
            if probe is not None and fields:
                out.append(_UnkeptRead(what, probe.expr.source, fields))
        return out

    def accepts(self, pod: _PodRec) -> bool:
        if self.match_labels:
            labels = pod.labels if isinstance(pod.labels, dict) else {}
            for k, v in self.match_labels:
                if labels.get(k) != v:
                    return False
        if self.type is not None:
            out = self.type.outputs(pod)
            if self.value is not None:
                return outputs_equal(out, self.value)
            return outputs_present(out)
        return True


class _FactComp:
    """A component that gets replica facts: it scales, or pods land in it."""

    __slots__ = ("ids_path", "name", "scale", "subtree")

    def __init__(
        self, name: str, scale: ScaleDefinition | None, ids_path: JqExpr | None,
        subtree: frozenset[str],
    ) -> None:
        self.name = name
        self.scale = scale
        self.ids_path = ids_path
        self.subtree = subtree


class _DescriptionPlan:
    """A description prepared for the engine (built once per winning description)."""

    def __init__(self, desc: Description) -> None:
        self.desc = desc
        comps = (desc.root, *desc.children)
        by_name = {c.name: c for c in comps}
        pod_comps = list(desc.pod_components) or [c for c in comps if c.pod_bearing]
        self.pod_comps = [_PodComponentPlan(c, by_name) for c in pod_comps]
        self.single = len(self.pod_comps) == 1
        #: with several components, one without a type selector takes what none accepts
        self.fallback = next((c for c in self.pod_comps if not c.has_type), None)
        self.selective = [c for c in self.pod_comps if c.has_type]
        #: the components a pod may be placed in ("": none accepted it): a place kept
        #: through a jq failure that may pass must be one of this description's
        self.pod_comp_names = frozenset({"", *(c.name for c in self.pod_comps)})
        kids: dict[str, list[str]] = {}
        for c in desc.children:
            kids.setdefault(c.owner_ref or desc.root.name, []).append(c.name)

        def subtree(name: str) -> frozenset[str]:
            out = {name}
            stack = [name]
            while stack:
                for k in kids.get(stack.pop(), ()):
                    if k not in out:
                        out.add(k)
                        stack.append(k)
            return frozenset(out)

        pod_names = {c.name for c in pod_comps}
        # A Pod workload (a bare pod and the pods it controls) has a row per component
        # only while it has pods there: nearly every bare pod controls none, and a 0 row
        # each would be noise. Its rows count their own component only: the pod's row
        # says 1 of 1 (itself), the controlled pods have theirs.
        own_only = desc.group_kind == POD
        if own_only:
            pod_names = set()
        self.fact_comps: list[_FactComp] = []
        for c in comps:
            if c.scale is None and c.name not in pod_names:
                continue
            self.fact_comps.append(
                _FactComp(c.name, c.scale, c.instance_id_path,
                          frozenset({c.name}) if own_only else subtree(c.name))
            )
        #: component -> its instanceIdPath, for the components that list instances
        self.ids_paths: dict[str, JqExpr] = {
            c.name: c.instance_id_path for c in comps if c.instance_id_path is not None
        }
        #: "component selector path: fields" for each pod-selector path that reads pod
        #: fields the engine does not keep (an inherited replicaSelector once)
        self.unkept: list[str] = []
        for cp in self.pod_comps:
            for u in cp.unkept():
                line = f"{u.what} {u.source!r} reads {', '.join(u.fields)}"
                if not any(u.endswith(line) for u in self.unkept):
                    self.unkept.append(f"component {cp.name!r}: {line}")
