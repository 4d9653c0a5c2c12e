"""Compiled jq expressions with the upstream Karta wrapper semantics.

Upstream evaluates descriptions with gojq; we use libjq through the PyPI ``jq`` package.
Every expression is compiled once, when its description is loaded, and evaluated per
object event (never per sample), by the runner in force: libjq in this process (the
default), or the proxy's sandbox child (``proxy.karta.jq_sandbox``, bounded in time and
memory). Evaluation raises nothing but ``JqError``: a jq runtime error becomes one, and
so does an evaluation the sandbox stopped; callers turn it into a reason (``Undefined``
phase, unattributed pod).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn, Protocol

import jq

from proxy.karta.jq_child import combined, outcomes
from proxy.shown import shown


class JqCompileError(ValueError):
    """The expression is not valid jq; raised at description load time."""


class JqError(RuntimeError):
    """The expression failed at run time on one object.

    ``retry_after``: None when the failure is the expression's own (a jq error, a
    strike): the same object gives the same failure, evaluated again only when it
    changes. A number when it is not (the sandbox's child held up, killed from outside,
    unable to start, the object's time limit spent by another expression: as soon as
    the backoff allows, 0) or not for long (a quarantine: the seconds left of it): the
    engine evaluates the object again then, without waiting for its next event."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JqIdError(JqError):
    """The expression yielded an id the engine cannot stamp as a label value (too long,
    control characters, not UTF-8): handled as a run-time error of the expression, so
    the id is not used (the pod placed without it, the workload's ids unknown)."""


#: the longest id, in UTF-8 bytes, the engine stamps as a label value (``karta_instance``,
#: ``karta_replica``). Under every common upstream's limit on a label value: Mimir and
#: Cortex (``max_label_value_length``, 2048 by default) refuse the whole write request
#: holding a longer one; VictoriaMetrics' ``-maxLabelValueLen`` (1024 in old releases,
#: 4096 or 16 KiB in later ones) truncates or drops the series; Grafana Cloud cuts at
#: 2048 and appends a hash. An id is a name (a service, a group, an index): one over a
#: KiB is a description reading something that is no id (an annotation's content).
MAX_ID_BYTES = 1024


def checked_id(text: str) -> str:
    """``text`` when it can be stamped as an id, else :class:`JqIdError` (its value shown
    cut, as a refusal of the wire shows a label: :func:`proxy.shown.shown`).

    Refused, never truncated: two long ids sharing their first KiB would become one, and
    a control character (C0, DEL) is no name and breaks log lines and exposition."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\\ud800")
        raise JqIdError(
            f"id refused: not valid UTF-8: "
            f"{shown(text.encode('utf-8', 'surrogatepass'))}") from None
    if len(raw) > MAX_ID_BYTES:
        raise JqIdError(f"id refused: {len(raw)} bytes, over the {MAX_ID_BYTES} bytes an id "
                        f"may have: {shown(raw)}")
    if _CONTROL.search(text) is not None:
        raise JqIdError(f"id refused: holds a control character: {shown(raw)}")
    return text


#: C0 controls and DEL
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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


def jq_text(obj: Any, *, default: Any = None, allow_nan: bool = True) -> str:
    """``obj`` as the JSON text jq reads: compact, object keys sorted.

    Upstream runs gojq, which iterates an object in key order (``.[]``, ``to_entries``,
    ``keys_unsorted``); libjq keeps the order of the text. With the keys sorted in the
    text, libjq iterates as gojq does: ``.spec.services[] | .replicas`` lines up with
    ``.spec.services | keys[]`` (sorted by both), where insertion order gave one
    instance's desired count to another. Keys of mixed types (YAML's ``1`` and ``"a"``)
    do not sort: those go as they come."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=default,
                          allow_nan=allow_nan)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), default=default, allow_nan=allow_nan)


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
    of the places before them (ids ["", "b"], replicas [5, 1] gave "b" 5). An id that
    cannot be stamped (:func:`checked_id`) raises :class:`JqIdError`: the path failed."""
    return [None if v is None or v == "" else checked_id(to_text(v)) for v in out]


def single_output_id(out: list[Any]) -> str | None:
    """Instance / replica ids: exactly one result, non-null and non-empty, else None.

    The count is of all outputs, nulls and empties included: [null, "x"] is two results,
    so no id (upstream), not "x". An id that cannot be stamped (:func:`checked_id`)
    raises :class:`JqIdError`."""
    if len(out) != 1:
        return None
    v = out[0]
    return None if v is None or v == "" else checked_id(to_text(v))


class JqTypeError(JqError):
    """The expression yielded a value its field cannot use (a scale path's text that is no
    number, an object): handled as a run-time error of the expression, counted and
    logged with it, where the value was dropped without a word."""


def output_numbers(out: list[Any]) -> list[float | None]:
    """Scale paths' outputs as numbers, by position (one per component instance for list
    paths): numeric strings accepted, null None (the field not set). Anything else
    (a boolean, other text, a list, an object: ``replicasPath: .spec.workers`` where
    ``.spec.workers.replicas`` was meant) raises :class:`JqTypeError`: it said
    "desired unknown" silently, the description's mistake in no log line or counter."""
    nums: list[float | None] = []
    for v in out:
        if v is None:
            nums.append(None)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            nums.append(float(v))
        else:
            try:
                nums.append(float(v) if isinstance(v, str) else _no_number(v))
            except ValueError:
                _no_number(v)
    return nums


def _no_number(value: Any) -> NoReturn:
    kind = ("a boolean" if isinstance(value, bool) else "text" if isinstance(value, str)
            else "a list" if isinstance(value, list) else "an object")
    raise JqTypeError(f"yielded {kind}, not a number (a count, a numeric string or null): "
                      f"{shown(to_text(value).encode('utf-8', 'surrogatepass'))}")


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
        """Every output, in order; objects iterated in key order, as gojq does
        (:func:`jq_text`). Evaluated by the runner in force (:func:`install_runner`)."""
        try:
            text = jq_text(obj)
        except (ValueError, TypeError, RecursionError) as exc:
            # the input is not JSON (bytes, a cycle, absurd nesting): told here, in the
            # proxy's process, whatever the runner
            raise JqError(f"{self.source!r}: {exc}") from exc
        return _current.run(self, text)

    def all_text(self, text: str) -> list[Any]:
        """Every output for an input already serialised as JSON (by :func:`jq_text`,
        for gojq's key order).

        Lets a caller running several expressions on one object serialise it once.
        """
        return _current.run(self, text)

    def run_here(self, text: str) -> list[Any]:
        """Every output for ``text``, evaluated by libjq in this process and thread:
        neither interruptible nor bounded in memory (the in-process runner's way)."""
        try:
            return list(self._program.input_text(text).all())
        except (ValueError, TypeError, RecursionError) as exc:
            raise JqError(f"{self.source!r}: {exc}") from exc



# -- where expressions run ---------------------------------------------------------------


def jq_runtime_error(source: str, message: str) -> JqError:
    """jq's run-time error ``message`` of the expression ``source``, as :meth:`JqExpr.run_here`
    raises it when libjq's binding raises it (a ValueError of the message, its cause:
    callers word a reason from ``str(exc.__cause__ or exc)``), for an evaluation that
    returned the message instead (the combined form, the sandbox's child)."""
    err = JqError(f"{source!r}: {message}")
    err.__cause__ = ValueError(message)
    return err


class JqRunner(Protocol):
    """Evaluates a compiled expression on one input's JSON text: every output, in order,
    or :class:`JqError`."""

    def run(self, expr: JqExpr, text: str) -> list[Any]: ...

    def run_many(self, exprs: Sequence[JqExpr], text: str) -> list[list[Any] | JqError]:
        """Each expression on one input: its outputs, or its error (returned, not
        raised); one round trip where the runner is another process."""


class InProcessRunner:
    """libjq in the calling thread: the default (tests, tools, benchmarks, ``explain``),
    and the proxy's with ``karta.jq_sandbox: false``."""

    def __init__(self) -> None:
        #: combined programs by tuple of sources, bounded as the sandbox child's
        self._together: dict[tuple[bytes, ...], Any] = {}
        self._lock = threading.Lock()  # the cache, not the evaluation: threads share it

    def run(self, expr: JqExpr, text: str) -> list[Any]:
        return expr.run_here(text)

    def run_many(self, exprs: Sequence[JqExpr], text: str) -> list[list[Any] | JqError]:
        """Each expression's outputs or error on ``text``, as :meth:`JqExpr.run_here`
        gives them, on one parse of the text: libjq parses it at each run, ~40 ms for a
        1.5 MB object, on the event loop where the sandbox is off (nothing deferred
        then). The expressions run as one program, as the sandbox's child runs a
        request's (its :func:`~proxy.karta.jq_child.combined`, kept per tuple of sources,
        and :func:`~proxy.karta.jq_child.outcomes`, no CPU backstop armed: this is the
        proxy's process); one that form could answer otherwise runs alone, as before."""
        program = None
        if len(exprs) > 1:
            sources = [e.source.encode("utf-8", "surrogatepass") for e in exprs]
            # each compiled already (JqExpr): none compiled again to be checked alone
            programs = {s: e._program for s, e in zip(sources, exprs, strict=True)}
            with self._lock:
                program = combined(jq.compile, programs, self._together, sources)
        out: list[list[Any] | JqError] = []
        for expr, outcome in zip(exprs, outcomes(program, len(exprs), text), strict=True):
            if outcome is None:
                try:
                    out.append(expr.run_here(text))
                except JqError as e:
                    out.append(e)
            else:
                out.append(outcome[1] if outcome[0]
                           else jq_runtime_error(expr.source, outcome[1]))
        return out


IN_PROCESS = InProcessRunner()

# The runner is process-wide, not an engine's: libjq can be neither interrupted nor
# bounded in memory in-process (and aborts the process when an allocation fails), so the
# proxy evaluates in one sandbox child per process (proxy.karta.jq_sandbox), installed by
# proxy.runtime at start, and every JqExpr of every description goes through it without
# each holder of an expression (plans, status, replicas) being handed one. Installs
# stack: the last installed is in force, and removing one (in any order: proxies tests
# run side by side in one process) leaves the one installed before it.
_installed: list[JqRunner] = []
_current: JqRunner = IN_PROCESS


def install_runner(runner: JqRunner) -> None:
    """Evaluate every expression through ``runner`` from now on (until it is removed)."""
    global _current
    _installed.append(runner)
    _current = runner


def remove_runner(runner: JqRunner) -> None:
    """Take ``runner`` out (if installed); the one installed before it, else the
    in-process runner, is in force again."""
    global _current
    for i in range(len(_installed) - 1, -1, -1):
        if _installed[i] is runner:
            del _installed[i]
            break
    _current = _installed[-1] if _installed else IN_PROCESS


def current_runner() -> JqRunner:
    return _current


#: per thread, the seconds it waited for a runner busy with another thread's evaluation
#: (the jq sandbox's one child: the event loop and the heavy objects' thread share it)
_waits = threading.local()


def waited_seconds() -> float:
    """Seconds this thread has waited so far for a runner busy with another thread's
    evaluation: what an object's weight (``Engine.heavy``) leaves out of its evaluation's
    time, as no cost of its own."""
    seconds: float = getattr(_waits, "seconds", 0.0)
    return seconds


def note_wait(seconds: float) -> None:
    """A runner made this thread wait ``seconds`` for another thread's evaluation."""
    _waits.seconds = waited_seconds() + seconds


class Evaluated:
    """Several expressions' outputs on one object, evaluated together: one round trip to
    the sandbox for what a workload event reads (its status, id and scale paths), where
    one per expression cost ~2.5x the in-process time, within one time limit for the
    object (an expression not reached in it is an error). An expression's error is raised
    when its outputs are asked for, as its own evaluation would have raised it, so a
    path the caller never reads fails nothing."""

    __slots__ = ("_results",)

    def __init__(self, exprs: Iterable[JqExpr], text: str) -> None:
        unique = list(dict.fromkeys(exprs))  # by source (JqExpr's equality)
        self._results = dict(zip(unique, _current.run_many(unique, text), strict=True))

    def outputs(self, expr: JqExpr) -> list[Any]:
        """``expr``'s outputs (it must be one of the batch), or its :class:`JqError`."""
        out = self._results[expr]
        if isinstance(out, JqError):
            raise out
        return out


# -- which input fields a program reads ----------------------------------------------------

#: jq words that are not function calls (a word before "(" that is none of these is one)
_KEYWORDS = frozenset({
    "if", "then", "elif", "else", "end", "as", "def", "reduce", "foreach", "try", "catch",
    "label", "import", "include", "and", "or", "__loc__",
})
#: calls whose argument runs on the call's own input (most map or filter something else)
_SAME_INPUT_CALLS = frozenset({"select", "has", "test", "tostring", "tonumber"})
_WORD_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_$@")
_WORD_CHARS = _WORD_START | frozenset("0123456789:")
#: a "." right after one of these continues a chain (``$x.a``, ``.a[0].b``, ``f(.).c``)
_CHAINED_AFTER = _WORD_CHARS | frozenset('])?"')
#: a subscript that names a field (``["a"]``, no interpolation), and one that iterates
_BRACKET_NAME = re.compile(r'\[\s*"((?:[^"\\]|\\[^(])*)"\s*\]')
_BRACKET_ALL = re.compile(r"\[\s*\]")


def input_fields(source: str) -> list[tuple[str, ...]] | None:
    """The field paths a jq program reads from its own input, as far as a scan can tell:
    for each path that starts at the input (``.metadata.labels["k"]`` gives
    ``("metadata", "labels", "k")``), its leading field names. None when the scan cannot
    tell (a ``def``).

    For a warning, not a decision (``Engine`` tells a pod selector that reads what the
    engine does not keep of a pod): a path after a pipe, an ``as`` binding or inside a
    call that maps something else (``map(.x)``) reads another value than the input, and
    is left out, so the scan misses reads (``getpath``, ``..``) rather than invents them.
    """
    out: list[tuple[str, ...]] = []
    #: per open bracket: does a path in it still start at the program's input
    frames: list[bool] = [True]
    call = ""  # the word just read, when "(" may follow it
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c == '"':
            i = _skip_string(source, i)
            call = ""
            continue
        if c == "#":
            while i < n and source[i] != "\n":
                i += 1
            continue
        if c in _WORD_START:
            j = i + 1
            while j < n and source[j] in _WORD_CHARS:
                j += 1
            word = source[i:j]
            if word == "def":
                return None
            if word == "as":
                frames[-1] = False
            call = word if word not in _KEYWORDS and c not in "$@" else ""
            i = j
            continue
        if c.isdigit():
            j = i + 1
            while j < n and (source[j].isalnum() or source[j] in ".+-"):
                j += 1
            i, call = j, ""
            continue
        if c == ".":
            if i + 1 < n and source[i + 1] == ".":  # recursive descent: not followed
                i, call = i + 2, ""
                continue
            prev = source[i - 1] if i else ""
            names, i = _chain(source, i)
            if names and frames[-1] and prev not in _CHAINED_AFTER:
                out.append(tuple(names))
            call = ""
            continue
        if c in "([{":
            inherit = frames[-1]
            if c == "(" and call:
                inherit = inherit and call in _SAME_INPUT_CALLS
            frames.append(inherit)
        elif c in ")]}":
            if len(frames) > 1:
                frames.pop()
        elif c == "|":  # "|=" too: its right side runs on what the left side selects
            frames[-1] = False
        call = "" if not c.isspace() else call
        i += 1
    return out


def _skip_string(source: str, i: int) -> int:
    """The index after the string literal opening at ``i`` (interpolations skipped whole)."""
    n = len(source)
    i += 1
    depth = 0
    while i < n:
        c = source[i]
        if depth:
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
        elif c == "\\":
            if source[i + 1 : i + 2] == "(":
                depth = 1
            i += 2
            continue
        elif c == '"':
            return i + 1
        i += 1
    return n


def _chain(source: str, i: int) -> tuple[list[str], int]:
    """The field names of the path starting with the "." at ``i``, and where it ends.

    Names run while the steps are fields (``.a``, ``."a"``, ``["a"]``, ``.["a"]``, ``?``
    between); ``[]`` or an index ends the names, and a subscript that is an expression
    is left to the caller (it reads the program's input again)."""
    names: list[str] = []
    n = len(source)
    naming = True
    while i < n:
        c = source[i]
        if c == "?":
            i += 1
            continue
        if c == ".":
            j = i + 1
            if j < n and source[j] in _WORD_START and source[j] not in "$@":
                k = j + 1
                while k < n and (source[k].isalnum() or source[k] == "_"):
                    k += 1
                if naming:
                    names.append(source[j:k])
                i = k
                continue
            if j < n and source[j] == '"':
                end = _skip_string(source, j)
                if naming:
                    names.append(source[j + 1 : end - 1])
                i = end
                continue
            if j < n and source[j] == "[":
                i = j
                continue
            return names, i + 1  # "." alone: the input itself
        if c == "[":
            m = _BRACKET_NAME.match(source, i)
            if m is not None:
                if naming:
                    names.append(m.group(1))
                i = m.end()
                continue
            m = _BRACKET_ALL.match(source, i)
            if m is not None:
                naming = False
                i = m.end()
                continue
        return names, i
    return names, i
