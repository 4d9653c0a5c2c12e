"""Generic phase of one workload object from its description's ``statusDefinition``.

Upstream reports every matching status and no single winner; a time series of "the
phase" needs exactly one, so ``PHASE_PRIORITY`` picks it (reasoning in docs/karta.md).
Evaluation never raises: a broken expression or an odd object yields ``Undefined`` with
a reason, because one bad workload must not stop the engine.

When the phase began is read from the object too (``StatusResult.since``): the
``lastTransitionTime`` of the conditions its matcher matched on. The API server keeps that
across restarts of the proxy and changes of leader; the proxy's own observation does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from proxy.karta.jqexpr import Evaluated, JqError, JqExpr, jq_text, to_text
from proxy.karta.model import UNDEFINED, UPSTREAM_STATUS_ORDER, Matcher, StatusDefinition

#: The one current phase is the first of the matching statuses in this order.
#: Terminal outcomes first (a finished job may still report a stale "running" signal),
#: then transitions over the steady states they lead to or from, then Degraded over
#: Running (a partial outage must not hide behind "running"), Initializing last (many
#: kinds keep their "created" signal true for the whole life of the workload).
PHASE_PRIORITY: tuple[str, ...] = (
    "Failed",
    "Completed",
    "Suspending",
    "Resuming",
    "Suspended",
    "Degraded",
    "Running",
    "Initializing",
)

REASON_NO_DEFINITION = "no_status_definition"
REASON_NO_MATCH = "no_status_matched"
REASON_JQ_ERROR = "jq_error"
REASON_BAD_OBJECT = "invalid_object"
_REASON_LIMIT = 160

assert set(PHASE_PRIORITY) == set(UPSTREAM_STATUS_ORDER)


@dataclass(frozen=True, slots=True)
class StatusResult:
    #: the one current generic phase (``Undefined`` when nothing matched)
    phase: str
    #: every matching generic status in upstream order; ``("Undefined",)`` when none
    statuses: tuple[str, ...]
    #: why the phase is ``Undefined``; "" otherwise
    reason: str
    #: unix seconds the phase began, from the object: the latest ``lastTransitionTime`` of
    #: the conditions of the phase's first matching matcher that has ``byConditions``
    #: (None when no such matcher matches or a time is missing or unreadable)
    since: float | None = None
    #: the failed expression's :attr:`JqError.retry_after <proxy.karta.jqexpr.JqError>`
    #: (reason ``jq_error``): when the evaluation may be worth trying again; None: not
    retry_after: float | None = None


_NO_DEFINITION = StatusResult(UNDEFINED, (UNDEFINED,), REASON_NO_DEFINITION)
_NO_MATCH = StatusResult(UNDEFINED, (UNDEFINED,), REASON_NO_MATCH)


def object_text(obj: Mapping[str, Any]) -> str:
    """A workload object as the JSON text its expressions read: keys sorted (gojq
    iterates objects in key order, :func:`jq_text`), timestamps as the API writes them
    (:func:`_json_default`); TypeError / ValueError / RecursionError when it is not JSON
    (NaN, bytes, a cycle)."""
    return jq_text(obj, allow_nan=False, default=_json_default)


def status_expressions(status: StatusDefinition | None) -> list[JqExpr]:
    """Every expression :func:`evaluate_status` may run: the phase and conditions paths
    and each matcher's ``byExpression``, for evaluating them together (``Evaluated``)."""
    if status is None:
        return []
    exprs = [e for e in (status.phase_path, status.conditions_path) if e is not None]
    exprs += [m.by_expression for _, matchers in status.mappings for m in matchers
              if m.by_expression is not None]
    return exprs


class _Input:
    """The object serialised once, so each of a description's expressions reuses it; or
    their outputs evaluated together beforehand (``evaluated``)."""

    __slots__ = ("_evaluated", "_text", "obj")

    def __init__(self, obj: Mapping[str, Any], evaluated: Evaluated | None = None) -> None:
        self.obj = obj
        self._text: str | None = None
        self._evaluated = evaluated

    def run(self, expr: JqExpr) -> list[Any]:
        try:
            if self._evaluated is not None:
                return self._evaluated.outputs(expr)
            if self._text is None:
                self._text = object_text(self.obj)
            return expr.all_text(self._text)
        except JqError as exc:
            detail = str(exc.__cause__ or exc)
            raise _Failure(f"{REASON_JQ_ERROR}: {detail} (in {_clip(expr.source, 60)})") from exc


class _Failure(Exception):
    """Aborts one evaluation; the message is the reason, already short."""


def _json_default(value: Any) -> Any:
    """Timestamps as the API server writes them: YAML files (snapshots, fixtures) read
    unquoted RFC 3339 times as datetime objects, and they must compare like the API's."""
    if isinstance(value, datetime):
        if value.tzinfo is not None and value.utcoffset() == timedelta(0):
            value = value.replace(tzinfo=None)
            text = value.isoformat(timespec="microseconds" if value.microsecond else "seconds")
            return text + "Z"
        return value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else to_text(value)


class _Evaluation:
    def __init__(self, status: StatusDefinition, obj: Mapping[str, Any],
                 evaluated: Evaluated | None) -> None:
        self.status = status
        self.input = _Input(obj, evaluated)
        self._phase: str | None = None
        self._phase_done = False
        self._conditions: dict[str, Mapping[str, Any]] | None = None

    def phase(self) -> str | None:
        if not self._phase_done:
            self._phase_done = True
            if self.status.phase_path is not None:
                out = self.input.run(self.status.phase_path)
                first = out[0] if out else None
                self._phase = first if isinstance(first, str) else None
        return self._phase

    def conditions(self) -> dict[str, Mapping[str, Any]]:
        if self._conditions is None:
            self._conditions = {}
            if self.status.conditions_path is not None:
                out = self.input.run(self.status.conditions_path)
                items: list[Any]
                if out and isinstance(out[0], list):
                    items = out[0]
                else:  # a path ending in [] yields the conditions one by one
                    items = [v for v in out if isinstance(v, Mapping)]
                type_field = self.status.type_field
                for item in items:
                    if isinstance(item, Mapping):
                        ctype = _text(item.get(type_field))
                        if ctype is not None:
                            self._conditions[ctype] = item  # a later duplicate wins
        return self._conditions

    def since(self, m: Matcher) -> float | None:
        """When ``m``'s conditions (all present: it matched) last changed, the latest of
        them: the matcher holds since the last of its conditions took its value. A
        condition matched by its ``reason`` took it at its ``lastUpdateTime`` when that is
        later (:data:`_UPDATE_FIELD`)."""
        conditions = self.conditions()
        latest: float | None = None
        for want in m.by_conditions:
            have = conditions.get(want.type)
            t = _timestamp(have.get(_TRANSITION_FIELD)) if have is not None else None
            if t is None:
                return None
            if want.reason is not None and have is not None:
                updated = _timestamp(have.get(_UPDATE_FIELD))
                if updated is not None and updated > t:
                    t = updated
            latest = t if latest is None else max(latest, t)
        return latest

    def matches(self, m: Matcher) -> bool:
        if m.by_phase is not None and self.phase() != m.by_phase:
            return False
        if m.by_conditions:
            conditions = self.conditions()
            for want in m.by_conditions:
                have = conditions.get(want.type)
                if have is None:
                    return False
                if want.status is not None and (
                    _text(have.get(self.status.status_field)) != want.status
                ):
                    return False
                if want.reason is not None and (
                    _text(have.get(self.status.reason_field)) != want.reason
                ):
                    return False
        if m.by_expression is not None:
            out = self.input.run(m.by_expression)
            got = to_text(out[0]) if out else None
            if got != m.expected_result:
                return False
        return True


def evaluate_status(status: StatusDefinition | None, obj: Mapping[str, Any],
                    evaluated: Evaluated | None = None) -> StatusResult:
    """Every matching generic status and the one current phase; never raises.
    ``evaluated``: the outputs of :func:`status_expressions` on ``obj`` (its
    :func:`object_text`), evaluated beforehand with other paths of the object."""
    if status is None:
        return _NO_DEFINITION
    try:
        ev = _Evaluation(status, obj, evaluated)
        # both paths up front, not only when a matcher reads them: a jq error in either
        # aborts the evaluation (upstream), where a lazy read let a failing path pass
        # unseen whenever no matcher reached it
        ev.phase()
        ev.conditions()
        matched = [
            name for name, matchers in status.mappings if any(ev.matches(m) for m in matchers)
        ]
    except _Failure as exc:
        cause = exc.__cause__
        return StatusResult(UNDEFINED, (UNDEFINED,), _clip(str(exc), _REASON_LIMIT),
                            retry_after=cause.retry_after
                            if isinstance(cause, JqError) else None)
    except (TypeError, ValueError, RecursionError) as exc:
        # not JSON (NaN, bytes, cycles): report the object, keep the engine going
        reason = _clip(f"{REASON_BAD_OBJECT}: {exc}", _REASON_LIMIT)
        return StatusResult(UNDEFINED, (UNDEFINED,), reason)
    if not matched:
        return _NO_MATCH
    statuses = tuple(s for s in UPSTREAM_STATUS_ORDER if s in matched)
    phase = next(s for s in PHASE_PRIORITY if s in matched)
    return StatusResult(phase, statuses, "", _phase_since(ev, status, phase))


#: the condition field that says when its status last changed (Kubernetes API convention)
_TRANSITION_FIELD = "lastTransitionTime"
#: the field some controllers keep beside it (a Deployment's, a ReplicaSet's, and the
#: operators that copied their helpers): set when the condition's status *or reason*
#: changes, not on every sync. A matcher that names a reason holds since the condition
#: took that reason, which ``lastTransitionTime`` does not say when the status stayed:
#: a Deployment's ``Progressing`` stays True through a rollout, and turns to reason
#: ``NewReplicaSetAvailable`` at its end, dated only here
_UPDATE_FIELD = "lastUpdateTime"


def _phase_since(ev: _Evaluation, status: StatusDefinition, phase: str) -> float | None:
    """The object's evidence of when ``phase`` began, or None.

    Only matchers with ``byConditions`` carry evidence; a description that wants its phase
    dated lists such a matcher first (the built-ins do: a narrower twin of a replica-count
    rule, same status). A matcher that fails here (a jq error after the one that matched)
    only means no evidence: the phase stands as evaluated."""
    for name, matchers in status.mappings:
        if name != phase:
            continue
        for m in matchers:
            if not m.by_conditions:
                continue
            try:
                if not ev.matches(m):
                    continue
                since = ev.since(m)
            except (_Failure, TypeError, ValueError, RecursionError):
                return None
            if since is not None:
                return since
    return None


def _timestamp(value: Any) -> float | None:
    """RFC 3339 text (``2024-05-01T10:00:00Z``) as unix seconds; anything else None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    if t.tzinfo is None:  # the API writes UTC; a bare time from a hand-written file too
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
