"""jq expressions with the upstream Karta wrapper semantics, on their own."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import resource
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy.karta.jqexpr as jqexpr_module
from proxy.karta.jqexpr import (
    MAX_ID_BYTES,
    InProcessRunner,
    JqCompileError,
    JqError,
    JqExpr,
    JqIdError,
    JqTypeError,
    checked_id,
    input_fields,
    jq_text,
    output_ids,
    output_numbers,
    outputs_equal,
    outputs_present,
    single_output_id,
    to_text,
)
from tests.karta import test_jq_child

OBJ: dict[str, Any] = {
    "metadata": {"name": "web", "labels": {"role": "head", "n": 3}},
    "spec": {"groups": [{"name": "gpu", "replicas": 2}, {"name": "cpu", "replicas": "4"},
                        {"name": None, "replicas": True}, {"name": "", "replicas": "x"}]},
    "status": {"phase": "Running", "ready": True, "count": 2.0},
}


@pytest.mark.parametrize(("value", "text"), [
    ("s", "s"), (True, "true"), (False, "false"), (None, "null"), (2.0, "2"), (3, "3"),
    (2.5, "2.5"), (2.0**60, "1.152921504606847e+18"), ({"b": 1, "a": [1, 2]}, '{"a":[1,2],"b":1}'),
    # non-ASCII as jq and gojq write it, not escaped
    ({"a": "é"}, '{"a":"é"}'), (["日本"], '["日本"]'),
])
def test_to_text_is_jq_tostring(value: Any, text: str) -> None:
    assert to_text(value) == text


def test_compile_error_names_the_expression() -> None:
    with pytest.raises(JqCompileError, match=r"\.spec\[") as info:
        JqExpr(".spec[")
    assert isinstance(info.value, ValueError)


def test_runtime_error_is_a_jq_error() -> None:
    with pytest.raises(JqError, match="error"):
        JqExpr('error("boom")').all(OBJ)
    with pytest.raises(JqError):
        JqExpr(".metadata.name | tonumber").all(OBJ)
    with pytest.raises(JqError):
        JqExpr(".").all({"not json": b"bytes"})  # not JSON at all
    with pytest.raises(JqError):
        JqExpr(".").all_text("{not json")


def test_all_outputs_in_order() -> None:
    assert JqExpr(".spec.groups[].name").all(OBJ) == ["gpu", "cpu", None, ""]
    assert JqExpr("empty").all(OBJ) == []
    assert JqExpr(".spec.groups[].name").all_text('{"spec":{"groups":[{"name":"a"}]}}') == ["a"]


def test_present_is_a_non_null_result() -> None:
    assert outputs_present(JqExpr(".metadata.labels.role").all(OBJ))
    assert not outputs_present(JqExpr(".metadata.labels.missing").all(OBJ))
    assert not outputs_present(JqExpr("empty").all(OBJ))
    assert outputs_present(JqExpr(".status.ready").all(OBJ))
    assert outputs_present(JqExpr("false").all(OBJ))  # false is a value, not an absence


def test_equals_is_json_equality_with_the_string() -> None:
    """Upstream's ``keyPath == "<value>"``: a number or a boolean is not its text."""
    assert outputs_equal(JqExpr(".metadata.labels.role").all(OBJ), "head")
    assert not outputs_equal(JqExpr(".metadata.labels.n").all(OBJ), "3")
    assert not outputs_equal(JqExpr(".status.ready").all(OBJ), "true")
    assert outputs_equal(JqExpr(".metadata.labels.n | tostring").all(OBJ), "3")
    assert outputs_equal(JqExpr(".spec.groups[].name").all(OBJ), "cpu")  # any output
    # null never matches
    assert not outputs_equal(JqExpr(".metadata.labels.missing").all(OBJ), "null")


def test_single_id_needs_exactly_one() -> None:
    assert single_output_id(JqExpr(".metadata.name").all(OBJ)) == "web"
    assert single_output_id(JqExpr(".status.count").all(OBJ)) == "2"
    assert single_output_id(JqExpr(".spec.groups[].name").all(OBJ)) is None  # two ids
    # only null and ""
    assert single_output_id(JqExpr(".spec.groups[2:][].name").all(OBJ)) is None
    assert single_output_id(JqExpr(".missing").all(OBJ)) is None
    # exactly one result, counted before nulls and empties are left out
    assert single_output_id(JqExpr('null, "x"').all(OBJ)) is None
    assert single_output_id(JqExpr('"", "x"').all(OBJ)) is None


def test_ids_keep_the_place_of_null_and_empty() -> None:
    """The scale paths' outputs line up with the ids by position."""
    assert output_ids(JqExpr(".spec.groups[].name").all(OBJ)) == ["gpu", "cpu", None, None]
    assert output_ids(JqExpr(".missing").all(OBJ)) == [None]
    assert output_ids(JqExpr("empty").all(OBJ)) == []


@pytest.mark.parametrize(("value", "why"), [
    ("x" * (MAX_ID_BYTES + 1), "1025 bytes, over the 1024"),
    ("x" * 100_000, "100000 bytes"),  # an annotation's content (up to 256 KiB)
    ("é" * (MAX_ID_BYTES // 2 + 1), "1026 bytes"),  # bytes of UTF-8, not characters
    ("a\nb", "control character: a\\x0ab"),
    ("a\tb", "control character"),
    ("a\u0000b", "control character"),
    ("a\u007fb", "control character"),
])
def test_an_id_that_cannot_be_a_label_value_is_refused(value: str, why: str) -> None:
    """Instance and replica ids become label values: one over the bound, or holding a
    control character, is refused (a jq error of the path), never cut, and the message
    shows at most 64 bytes of it."""
    obj = {"metadata": {"annotations": {"id": value}}, "spec": {"ids": ["a", value]}}
    for read, path in ((single_output_id, ".metadata.annotations.id"),
                       (output_ids, ".spec.ids[]")):
        with pytest.raises(JqIdError, match="id refused") as err:
            read(JqExpr(path).all(obj))
        assert why in str(err.value)
        assert isinstance(err.value, JqError)  # handled as every run-time error
        assert len(str(err.value)) < 400
    # the engine's plain label lookups skip libjq (which refuses such input itself)
    with pytest.raises(JqIdError, match=re.escape(why)):
        checked_id(value)


def test_an_id_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(JqIdError, match="not valid UTF-8"):
        checked_id("\ud800")  # a lone surrogate, as JSON may spell it


def test_an_id_up_to_the_bound_is_kept() -> None:
    for value in ("x" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2), "日本 ~ ok", "a b"):
        obj = {"metadata": {"annotations": {"id": value}}}
        assert single_output_id(JqExpr(".metadata.annotations.id").all(obj)) == value
        assert output_ids(JqExpr(".metadata.annotations.id").all(obj)) == [value]




def test_numbers_one_per_output() -> None:
    got = output_numbers(JqExpr(".spec.groups[:2][].replicas").all(OBJ))
    assert got == [2.0, 4.0]
    assert output_numbers(JqExpr('null, 3, "1e3"').all(OBJ)) == [None, 3.0, 1000.0]
    nan = output_numbers(JqExpr('"nan"').all(OBJ))[0]
    assert nan is not None and math.isnan(nan)


@pytest.mark.parametrize(("program", "said"), [
    ('"two"', "yielded text, not a number (a count, a numeric string or null): two"),
    ("true", "yielded a boolean"),
    ("{}", "yielded an object"),
    ('.spec.groups', "yielded a list"),
    ('1, "x"', "yielded text"),
    (".spec.groups[].replicas", "yielded a boolean, not a number"),
])
def test_a_scale_output_of_the_wrong_type_is_a_jq_error(program: str, said: str) -> None:
    """``replicasPath: .spec.workers`` (the object, not its ``.replicas``) or a name where
    a count was meant: the desired count was dropped as unknown without a word; now the
    path failed, counted and logged as any jq error."""
    with pytest.raises(JqTypeError, match=re.escape(said)):
        output_numbers(JqExpr(program).all(OBJ))


def test_repr_names_the_source() -> None:
    assert repr(JqExpr(".a")) == "JqExpr('.a')"


def test_two_compilations_of_one_text_are_equal() -> None:
    """So a description read again compares equal to the one in force."""
    a, b = JqExpr(".a | length"), JqExpr(".a | length")
    assert a == b and hash(a) == hash(b) and a != JqExpr(".b") and a != ".a | length"


@pytest.mark.parametrize(("source", "fields"), [
    ('.metadata.labels["a.b/c"]', [("metadata", "labels", "a.b/c")]),
    (".metadata.labels.role", [("metadata", "labels", "role")]),
    ('.["spec"].x', [("spec", "x")]),
    ('."spec".x', [("spec", "x")]),
    (".spec.containers[0].name", [("spec", "containers")]),
    (".status.conditions[]?.type", [("status", "conditions")]),
    (".metadata.labels.idx | tonumber > 0", [("metadata", "labels", "idx")]),
    ('.metadata.labels["g"], .metadata.labels["h"]', [("metadata", "labels", "g"),
                                                      ("metadata", "labels", "h")]),
    ("if .spec.x then 1 else .metadata.name end", [("spec", "x"), ("metadata", "name")]),
    ('.status.phase // "x"', [("status", "phase")]),
    ("select(.spec.a == 1)", [("spec", "a")]),
    (".metadata.labels[.spec.k]", [("metadata", "labels"), ("spec", "k")]),
    # what follows a pipe, an "as" or a mapping call reads another value: left out
    (".metadata.ownerReferences[]? | select(.controller == true) | .kind",
     [("metadata", "ownerReferences")]),
    (".metadata | .generateName", [("metadata",)]),
    ("map(.x)", []),
    (". as $p | $p.spec", []),
    ('"\\(.spec.x)"', []),
    ("1.5", []),
    ("..", []),
    ("def f: .spec; f", None),
])
def test_input_fields_are_the_paths_read_from_the_input(
        source: str, fields: list[tuple[str, ...]] | None) -> None:
    JqExpr(source)  # valid jq
    assert input_fields(source) == fields


def test_objects_are_iterated_in_key_order_as_gojq_does() -> None:
    """gojq iterates a map in key order; libjq in the order of its input text, so the
    input is written with sorted keys: ids from ``keys[]`` and values from ``.[]`` line
    up by position."""
    services = {"worker": {"replicas": 4}, "frontend": {"replicas": 1}}
    assert JqExpr(".[] | .replicas").all(services) == [1, 4]
    assert JqExpr("keys[]").all(services) == ["frontend", "worker"]
    assert JqExpr("to_entries[] | .key").all(services) == ["frontend", "worker"]
    assert JqExpr("keys_unsorted[]").all({"b": {"y": 1, "x": 2}, "a": 0}) == ["a", "b"]
    assert JqExpr(".b | .[]").all({"b": {"y": 1, "x": 2}}) == [2, 1]  # nested too
    # keys that do not sort (YAML's 1 and "a"): as they come, not an error
    assert JqExpr(".[]").all({1: "one", "a": "A"}) == ["one", "A"]


def test_every_public_method_of_jqexpr_is_called_by_the_product() -> None:
    """The product reads outputs one way (``all`` / ``all_text``, then the wrapper
    functions): a convenience method only tests called was a second path, tested in
    place of the real one."""
    import inspect
    from pathlib import Path

    import proxy

    root = Path(proxy.__file__).parent
    code = "\n".join(line for f in root.rglob("*.py")
                     for line in f.read_text(encoding="utf-8").splitlines()
                     if not line.lstrip().startswith("def "))
    methods = [name for name, _ in inspect.getmembers(JqExpr, inspect.isfunction)
               if not name.startswith("_")]
    assert methods
    unused = [name for name in methods if f".{name}(" not in code]
    assert not unused, unused


def test_one_rule_shows_refused_bytes() -> None:
    """An id refused by the engine and a label refused by the relay are shown by one
    function (``proxy.shown``), not two copies of it."""
    import proxy.karta.jqexpr
    import proxy.wire.plan
    import proxy.wire.primitives
    from proxy.shown import shown

    for mod in (proxy.karta.jqexpr, proxy.wire.plan, proxy.wire.primitives):
        assert vars(mod).get("shown") is shown, mod.__name__
        assert "_shown" not in vars(mod), mod.__name__
    with pytest.raises(JqIdError) as err:
        checked_id("\x01" + "é" * 40)
    assert str(err.value).endswith(shown(("\x01" + "é" * 40).encode()))


# -- the in-process runner: several expressions on one parse -------------------------------


def _the_same(a: Any, b: Any) -> bool:
    """Python values alike as the caller sees them: types (1 is not 1.0, True not 1),
    floats by their repr (nan, -0.0), dicts' keys in order; iterative (outputs nest up
    to Python's recursion limit)."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if repr(x) != repr(y):
                return False
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pending += zip(x, y, strict=True)
        elif isinstance(x, dict):
            if list(x) != list(y):
                return False
            pending += ((x[k], y[k]) for k in x)
        elif x != y:
            return False
    return True


def _results_alike(got: list[list[Any] | JqError], alone: list[list[Any] | JqError]) -> bool:
    """Outputs alike (:func:`_the_same`), errors by their type, message, retry and cause
    (a reason is worded from ``str(exc.__cause__ or exc)``)."""
    return len(got) == len(alone) and all(
        (type(g) is type(a) and str(g) == str(a) and g.retry_after == a.retry_after
         and type(g.__cause__) is type(a.__cause__) and str(g.__cause__) == str(a.__cause__))
        if isinstance(a, JqError) else _the_same(g, a) for g, a in zip(got, alone, strict=True))


@functools.cache
def _expressions() -> tuple[JqExpr, ...]:
    """The child's corpus (descriptions, sandbox tests, tricky programs), those that
    compile (a JqExpr is compiled: the others never reach a runner)."""
    out = []
    for source in test_jq_child._corpus():
        with contextlib.suppress(JqCompileError, UnicodeError):
            out.append(JqExpr(source))
    return tuple(out)


@pytest.fixture
def no_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIMIT_CPU in this process would bound the proxy's (here the test run's) CPU: the
    in-process runner must not set it."""
    def refused(*args: Any) -> None:
        raise AssertionError(f"setrlimit{args} in the proxy's process")
    monkeypatch.setattr(resource, "setrlimit", refused)


_RUNNER = InProcessRunner()  # its combined programs kept across the examples, as in use


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 10**6), min_size=2, max_size=8),
       text=test_jq_child.texts)
def test_in_process_run_many_is_each_expression_run_alone(
        picks: list[int], text: str, no_cpu_limit: None) -> None:
    """The same outputs (types, key order, nan) and the same JqError messages as each
    expression run alone (``run_here``, today's ``run_many``), whatever runs combined,
    alone or falls back part way; no CPU limit set."""
    exprs = [_expressions()[i % len(_expressions())] for i in picks]
    alone: list[list[Any] | JqError] = []
    for expr in exprs:
        try:
            alone.append(expr.run_here(text))
        except JqError as e:
            alone.append(e)
    assert _results_alike(_RUNNER.run_many(exprs, text), alone)


def test_in_process_run_many_parses_its_input_once(monkeypatch: pytest.MonkeyPatch,
                                                   no_cpu_limit: None) -> None:
    """N expressions on one object: one parse of its text (there were N: ~40 ms each for
    a 1.5 MB object, on the event loop with the sandbox off), the outputs each one's, an
    error that is not a string worded as alone without running it again; one expression,
    one parse as ever; one that must run alone (``input``) runs alone."""
    calls = test_jq_child._Calls()
    monkeypatch.setattr(jqexpr_module, "jq", SimpleNamespace(compile=calls.compile))
    runner = InProcessRunner()
    text = jq_text({"status": {"phase": "Running", "nodes": {"n1": {"type": "Pod"}}},
                    "metadata": {"name": "wf"}})
    exprs = [JqExpr(s) for s in (".status.phase", ".metadata.name",
                                 "[.status.nodes[] | .type]", ".spec.x", 'error("not here")',
                                 "error({})")]
    compiled = calls.compiles
    for _ in range(2):
        calls.parses = 0
        got = runner.run_many(exprs, text)
        assert got[:4] == [["Running"], ["wf"], [["Pod"]], [None]]
        assert [str(e) for e in got[4:]] == ["'error(\"not here\")': not here",
                                             "'error({})': {}"]
        assert calls.parses == 1
        assert calls.compiles == compiled + 1  # the combined program, once
    calls.parses = 0
    assert runner.run_many(exprs[:1], text) == [["Running"]]
    assert calls.parses == 1
    calls.parses = 0
    alone = runner.run_many([exprs[0], JqExpr("[inputs]")], text)
    assert alone == [["Running"], [[]]] and calls.parses == 2
