"""Compiled jq expressions with the upstream Karta wrapper semantics.

Upstream evaluates descriptions with gojq; we use libjq through the PyPI ``jq`` package.
Every expression is compiled once, when its description is loaded, and evaluated per
object event (never per sample). Evaluation raises nothing but ``JqError``: a jq runtime
error becomes one, and callers turn it into a reason (``Undefined`` phase, unattributed
pod).
"""

from __future__ import annotations

import json
from typing import Any

import jq


class JqCompileError(ValueError):
    """The expression is not valid jq; raised at description load time."""


class JqError(RuntimeError):
    """The expression failed at run time on one object."""


def to_text(value: Any) -> str:
    """The string form upstream compares against (jq ``tostring``).

    Compact, keys sorted (gojq iterates a map in key order) and non-ASCII as is: jq and
    gojq write "é", where JSON's default ASCII escape ("\\u00e9") never equalled an
    ``expectedResult`` written as the text reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


# Upstream's wrapper semantics, over the outputs of a path: ``JqExpr`` runs the program
# and applies them; the engine applies them as well to outputs it reads without libjq
# (plain metadata lookups), so both answer alike.


def outputs_present(out: list[Any]) -> bool:
    """Upstream's key-only type selector: the path yields a non-null result."""
    return any(v is not None for v in out)


def outputs_equal(out: list[Any], value: str) -> bool:
    """Upstream's ``keyPath`` + ``value``: some output equals the string value.

    JSON equality, as upstream's ``keyPath == "<value>"``: a number 0 or a boolean true
    is not the string "0" or "true" (its ``tostring`` would be, and matched pods that
    upstream leaves out)."""
    return any(type(v) is str and v == value for v in out)


def output_ids(out: list[Any]) -> list[str | None]:
    """The id list of an ``instanceIdPath``, by position: each output as text, None for
    a null or empty one.

    The scale paths' outputs line up with the ids by position, so an id no pod can
    name (null, "") keeps its place: dropped, the ids after it took the desired counts
    of the places before them (ids ["", "b"], replicas [5, 1] gave "b" 5)."""
    return [None if v is None or v == "" else to_text(v) for v in out]


def single_output_id(out: list[Any]) -> str | None:
    """Instance / replica ids: exactly one result, non-null and non-empty, else None.

    The count is of all outputs, nulls and empties included: [null, "x"] is two results,
    so no id (upstream), not "x"."""
    if len(out) != 1:
        return None
    v = out[0]
    return None if v is None or v == "" else to_text(v)


class JqExpr:
    """One compiled jq program."""

    __slots__ = ("_program", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._program = jq.compile(source)
        except ValueError as exc:
            raise JqCompileError(f"jq does not compile: {source!r}: {exc}") from exc

    def __repr__(self) -> str:
        return f"JqExpr({self.source!r})"

    def __eq__(self, other: object) -> bool:
        """By the program's text: two compilations of one text are the same program, so
        a description read again compares equal to the one in force (an unchanged
        description file, re-read at every configuration reload, re-attributes nothing)."""
        if not isinstance(other, JqExpr):
            return NotImplemented
        return self.source == other.source

    def __hash__(self) -> int:
        return hash(self.source)

    def all(self, obj: Any) -> list[Any]:
        """Every output, in order."""
        try:
            return list(self._program.input_value(obj).all())
        except (ValueError, TypeError, RecursionError) as exc:
            # TypeError / RecursionError: the input is not JSON (bytes, a cycle)
            raise JqError(f"{self.source!r}: {exc}") from exc

    def all_text(self, text: str) -> list[Any]:
        """Every output for an input already serialised as JSON.

        Lets a caller running several expressions on one object serialise it once.
        """
        try:
            return list(self._program.input_text(text).all())
        except ValueError as exc:
            raise JqError(f"{self.source!r}: {exc}") from exc

    def first(self, obj: Any) -> Any:
        """The first output, or None when there is none."""
        out = self.all(obj)
        return out[0] if out else None

    def present(self, obj: Any) -> bool:
        return outputs_present(self.all(obj))

    def equals(self, obj: Any, value: str) -> bool:
        return outputs_equal(self.all(obj), value)

    def single_id(self, obj: Any) -> str | None:
        return single_output_id(self.all(obj))

    def ids(self, obj: Any) -> list[str | None]:
        return output_ids(self.all(obj))

    def tostring_first(self, obj: Any) -> str | None:
        """``byExpression``: first output of ``(<expr>) | tostring``."""
        out = self.all(obj)
        return to_text(out[0]) if out else None

    def number(self, obj: Any) -> float | None:
        """Scale paths: the first output as a number; numeric strings are accepted."""
        for v in self.all(obj):
            if isinstance(v, bool) or v is None:
                continue
            if isinstance(v, int | float):
                return float(v)
            if isinstance(v, str):
                try:
                    return float(v)
                except ValueError:
                    return None
        return None

    def numbers(self, obj: Any) -> list[float | None]:
        """Every output as a number (one per component instance for list paths)."""
        out: list[float | None] = []
        for v in self.all(obj):
            if isinstance(v, bool):
                out.append(None)
            elif isinstance(v, int | float):
                out.append(float(v))
            elif isinstance(v, str):
                try:
                    out.append(float(v))
                except ValueError:
                    out.append(None)
            else:
                out.append(None)
        return out
