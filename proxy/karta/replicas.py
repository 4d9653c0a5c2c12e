"""Replica-row facts: what a workload object says of its components (status, instance
ids, desired / min / max replicas), evaluated once per object version and description,
and the rows of desired vs observed pods built from it on each pod event.

The evaluation (jq on the object) is cached with the object (``_FactsCache``); the
rows' fixed part is a template built from it once (``_RowTemplate``), so a pod event
only looks its counts up (``_replica_facts``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from proxy.karta.jqexpr import Evaluated, JqError, JqExpr, output_ids, output_numbers
from proxy.karta.model import UNDEFINED
from proxy.karta.packed import Packed, unpack
from proxy.karta.plans import _CountKey, _DescriptionPlan
from proxy.karta.results import JQ_ERROR_STATUS, JQ_ERROR_WORKLOAD, ReplicaFact


class _TemplateRow(NamedTuple):
    """One replica fact row's fixed part; only the observed count is looked up per event.

    ``_replica_facts`` unpacks these on every pod event of the workload. A NamedTuple takes
    the memory of a plain tuple but unpacks slower (no fast path for tuple subclasses):
    140 vs 51 ns a row (timeit, median of 5, Python 3.11, Dec 2026), under 1 us an event
    for the few rows a workload has, against the 15-60 us a pod event costs in
    ``benchmarks/engine_bench.py``; so the rows stay named."""

    component: str
    #: the instance id, or None for the component as a whole (no instances)
    instance: str | None
    desired: float | None
    min_replicas: float | None
    max_replicas: float | None
    #: the component first, then the components below it whose pods it counts
    counted: tuple[str, ...]


class _RowTemplate:
    """The replica rows an object version fixes, and the (component, instance) keys they
    cover (pods counted under any other key get a row of their own)."""

    __slots__ = ("covered", "rows")

    def __init__(self) -> None:
        self.rows: list[_TemplateRow] = []
        self.covered: set[_CountKey] = set()

    @classmethod
    def build(
        cls, plan: _DescriptionPlan, ev: _ObjectFacts | None,
        named: Collection[_CountKey] | None = None,
    ) -> _RowTemplate | None:
        """The rows of an object version (``ev`` None: the object not seen). A component
        whose instance ids the object does not give (not seen, or the path failed) has
        no fixed rows: None, unless ``named`` gives the (component, instance) keys the
        pods name, whose instances then make its rows, without desired counts."""
        out = cls()
        for fc in plan.fact_comps:
            want, lo, hi = ev.scale.get(fc.name, _NO_SCALE) if ev is not None else _NO_SCALE
            comps = (fc.name, *sorted(fc.subtree - {fc.name}))
            if fc.ids_path is None:
                out.rows.append(
                    _TemplateRow(fc.name, None, _summed(want), _summed(lo), _summed(hi), comps)
                )
                out.covered.add((fc.name, ""))
                continue
            ids = ev.ids.get(fc.name) if ev is not None else None
            if ids is None:
                if named is None:
                    return None  # the instances are whatever the pods say: no fixed rows
                ids = tuple(sorted({i for (c, i) in named if c in fc.subtree}))
                want = lo = hi = ()
            for i, iid in enumerate(ids):
                if iid is None or (fc.name, iid) in out.covered:
                    # a null or empty id: no row, but its place (the scale outputs line
                    # up by position); an id listed twice: one row, the first's
                    continue
                out.rows.append(
                    _TemplateRow(fc.name, iid, _nth(want, i), _nth(lo, i), _nth(hi, i), comps)
                )
                out.covered.add((fc.name, iid))
        return out


class _ScaleOutputs(NamedTuple):
    """A component's scale paths evaluated on the object: each a list of numbers, one per
    instance (or summed when the component has no instances); empty when unset or failed."""

    replicas: Sequence[float | None]
    min_replicas: Sequence[float | None]
    max_replicas: Sequence[float | None]


_NO_SCALE = _ScaleOutputs((), (), ())


class _FactsJqError(NamedTuple):
    """A jq error met evaluating an object version (counted and logged by the engine,
    which knows the description and the workload)."""

    #: ``JQ_ERROR_STATUS`` or ``JQ_ERROR_WORKLOAD``
    where: str
    #: the expression ("" for the status: the message names it)
    expression: str
    message: str


class _ObjectFacts:
    """What the engine derives from one version of a workload object."""

    __slots__ = ("errors", "ids", "phase", "reason", "retry_after", "rows", "rows_built",
                 "scale", "since", "statuses")

    def __init__(self) -> None:
        self.phase = UNDEFINED
        #: when the phase began according to the object (None: the object does not say)
        self.since: float | None = None
        self.statuses: tuple[str, ...] = (UNDEFINED,)
        self.reason = ""
        #: component -> instance ids in order, None in the place of a null or empty one
        #: (None for the whole: the path failed)
        self.ids: dict[str, tuple[str | None, ...] | None] = {}
        self.scale: dict[str, _ScaleOutputs] = {}
        #: the replica rows' fixed part, built on first use (None: ids unknown, no template)
        self.rows: _RowTemplate | None = None
        self.rows_built = False
        #: the jq errors met, to log once the facts are cached
        self.errors: list[_FactsJqError] = []
        #: the soonest :attr:`JqError.retry_after <proxy.karta.jqexpr.JqError>` of those
        #: errors: None when none was transient (the facts stand until the object changes)
        self.retry_after: float | None = None

    def failed_for_now(self, retry_after: float | None) -> None:
        """One of the evaluations failed for a reason that may pass (``retry_after``)."""
        if retry_after is not None:
            self.retry_after = (retry_after if self.retry_after is None
                                else min(self.retry_after, retry_after))

    def template(self, plan: _DescriptionPlan) -> _RowTemplate | None:
        """Rows and desired values of this object version; only ``observed`` varies."""
        if not self.rows_built:
            self.rows, self.rows_built = _RowTemplate.build(plan, self), True
        return self.rows

    def same_ids(self, other: _ObjectFacts | None) -> bool:
        return other is not None and other.ids == self.ids


class _FactsCache(NamedTuple):
    """What an object record's ``cache`` holds: the evaluation of its current version under
    the plan it was made with (a new description makes it stale)."""

    plan: _DescriptionPlan
    facts: _ObjectFacts
    #: the seconds an evaluation made in another thread took (``Engine.facts_work``), not
    #: yet accounted for (its jq errors counted and logged, its retry owed): the engine
    #: does that at its first use, as it does for one it makes itself; None: accounted
    unaccounted: float | None = None


def _cached(cache: _FactsCache | None, plan: _DescriptionPlan) -> _ObjectFacts | None:
    """The facts the engine has used of this object version under ``plan`` (one made in
    another thread and not yet used counts as none, as if it had not been made)."""
    return (cache.facts if cache is not None and cache.plan is plan
            and cache.unaccounted is None else None)


def _read_object_facts(plan: _DescriptionPlan, kept: Mapping[str, Any] | Packed
                       ) -> _ObjectFacts:
    """An object version's facts under ``plan``; each jq error kept for the caller to
    count and log. ``kept``: the object as the engine keeps it, its jq text
    (:func:`~proxy.karta.packed.pack_for_jq`) evaluated as it is."""
    from proxy.karta.status import (
        REASON_JQ_ERROR,
        evaluate_status,
        object_text,
        status_expressions,
    )

    ev = _ObjectFacts()
    scales = [sp for fc in plan.fact_comps if fc.scale is not None
              for sp in (fc.scale.replicas, fc.scale.min_replicas, fc.scale.max_replicas)
              if sp is not None]
    exprs = [*status_expressions(plan.desc.status), *plan.ids_paths.values(), *scales]
    # every path of the object in one evaluation (one round trip to the jq sandbox);
    # an object that is not JSON goes path by path, each telling it as it does alone
    evaluated: Evaluated | None = None
    if exprs:
        with contextlib.suppress(TypeError, ValueError, RecursionError):
            text = kept.text if isinstance(kept, Packed) else object_text(kept)
            evaluated = Evaluated(exprs, text)
    # read only without ``evaluated``: every expression (none here, for a packed object)
    # otherwise has its outputs there
    obj = unpack(kept) if evaluated is None else kept if isinstance(kept, Mapping) else {}

    def outputs(path: JqExpr) -> list[Any]:
        return evaluated.outputs(path) if evaluated is not None else path.all(obj)

    res = evaluate_status(plan.desc.status, obj, evaluated)
    ev.phase, ev.statuses, ev.reason = res.phase, tuple(res.statuses), res.reason
    ev.since = res.since
    if res.reason.startswith(REASON_JQ_ERROR):
        # the reason names the expression (clipped); one status is one evaluation
        ev.errors.append(_FactsJqError(JQ_ERROR_STATUS, "", res.reason))
        ev.failed_for_now(res.retry_after)
    for name, path in plan.ids_paths.items():
        try:
            ev.ids[name] = tuple(output_ids(outputs(path)))
        except JqError as exc:
            ev.errors.append(
                _FactsJqError(JQ_ERROR_WORKLOAD, path.source, str(exc.__cause__ or exc)))
            ev.failed_for_now(exc.retry_after)
            ev.ids[name] = None
    for fc in plan.fact_comps:
        if fc.scale is None:
            continue
        outs: list[list[float | None]] = []
        for sp in (fc.scale.replicas, fc.scale.min_replicas, fc.scale.max_replicas):
            try:
                outs.append(output_numbers(outputs(sp)) if sp is not None else [])
            except JqError as exc:
                if sp is not None:
                    ev.errors.append(_FactsJqError(
                        JQ_ERROR_WORKLOAD, sp.source, str(exc.__cause__ or exc)))
                ev.failed_for_now(exc.retry_after)
                outs.append([])
        ev.scale[fc.name] = _ScaleOutputs(*outs)
    return ev


def _summed(values: Sequence[float | None]) -> float | None:
    """A component without instances: one number, or the sum of a list path's outputs."""
    nums = [v for v in values if v is not None]
    return sum(nums) if nums else None


def _nth(values: Sequence[float | None], i: int) -> float | None:
    """Instance ``i``'s number: a scale path yields one per listed instance, or too few."""
    return values[i] if i < len(values) else None


def _replica_facts(
    plan: _DescriptionPlan, ev: _ObjectFacts | None, counts: Mapping[_CountKey, int],
    by_comp: Mapping[str, int],
) -> tuple[ReplicaFact, ...]:
    """Desired vs observed rows of a workload whose pods are counted by (component,
    instance) in ``counts`` and by component in ``by_comp``; runs on every pod event of
    the workload, so the fixed part comes from the object version's template and only
    counts are looked up."""
    tpl = ev.template(plan) if ev is not None else None
    if tpl is None:  # the object not seen, or instance ids unknown: the pods name them
        tpl = _RowTemplate.build(plan, ev, named=counts)
        assert tpl is not None
    rows: list[ReplicaFact] = []
    for name, iid, want, lo, hi, comps in tpl.rows:
        if iid is None:
            seen = by_comp.get(name, 0)
            for c in comps[1:]:
                seen += by_comp.get(c, 0)
            rows.append(ReplicaFact(name, "", want, lo, hi, seen))
        else:
            seen = counts.get((name, iid), 0)
            for c in comps[1:]:
                seen += counts.get((c, iid), 0)
            rows.append(ReplicaFact(name, iid, want, lo, hi, seen))
    extra = [k for k in counts if k not in tpl.covered]
    for key in sorted(extra):
        comp, inst = key
        rows.append(ReplicaFact(comp, inst, None, None, None, counts[key]))
    return tuple(rows)

