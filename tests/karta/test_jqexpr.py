"""jq expressions with the upstream Karta wrapper semantics, on their own."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from proxy.karta.jqexpr import (
    MAX_ID_BYTES,
    JqCompileError,
    JqError,
    JqExpr,
    JqIdError,
    checked_id,
    input_fields,
    to_text,
)

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
        JqExpr(".metadata.name | tonumber").first(OBJ)
    with pytest.raises(JqError):
        JqExpr(".").all({"not json": b"bytes"})  # not JSON at all
    with pytest.raises(JqError):
        JqExpr(".").all_text("{not json")


def test_all_and_first() -> None:
    e = JqExpr(".spec.groups[].name")
    assert e.all(OBJ) == ["gpu", "cpu", None, ""]
    assert e.first(OBJ) == "gpu"
    assert JqExpr("empty").first(OBJ) is None
    assert JqExpr(".spec.groups[].name").all_text('{"spec":{"groups":[{"name":"a"}]}}') == ["a"]


def test_present_is_a_non_null_result() -> None:
    assert JqExpr(".metadata.labels.role").present(OBJ)
    assert not JqExpr(".metadata.labels.missing").present(OBJ)
    assert not JqExpr("empty").present(OBJ)
    assert JqExpr(".status.ready").present(OBJ)
    assert JqExpr("false").present(OBJ)  # false is a value, not an absence


def test_equals_is_json_equality_with_the_string() -> None:
    """Upstream's ``keyPath == "<value>"``: a number or a boolean is not its text."""
    assert JqExpr(".metadata.labels.role").equals(OBJ, "head")
    assert not JqExpr(".metadata.labels.n").equals(OBJ, "3")
    assert not JqExpr(".status.ready").equals(OBJ, "true")
    assert JqExpr(".metadata.labels.n | tostring").equals(OBJ, "3")
    assert JqExpr(".spec.groups[].name").equals(OBJ, "cpu")  # any output
    assert not JqExpr(".metadata.labels.missing").equals(OBJ, "null")  # null never matches


def test_single_id_needs_exactly_one() -> None:
    assert JqExpr(".metadata.name").single_id(OBJ) == "web"
    assert JqExpr(".status.count").single_id(OBJ) == "2"
    assert JqExpr(".spec.groups[].name").single_id(OBJ) is None  # two ids
    assert JqExpr(".spec.groups[2:][].name").single_id(OBJ) is None  # only null and ""
    assert JqExpr(".missing").single_id(OBJ) is None
    # exactly one result, counted before nulls and empties are left out
    assert JqExpr('null, "x"').single_id(OBJ) is None
    assert JqExpr('"", "x"').single_id(OBJ) is None


def test_ids_keep_the_place_of_null_and_empty() -> None:
    """The scale paths' outputs line up with the ids by position."""
    assert JqExpr(".spec.groups[].name").ids(OBJ) == ["gpu", "cpu", None, None]
    assert JqExpr(".missing").ids(OBJ) == [None]
    assert JqExpr("empty").ids(OBJ) == []


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
    for run in (JqExpr(".metadata.annotations.id").single_id,
                JqExpr(".spec.ids[]").ids):
        with pytest.raises(JqIdError, match="id refused") as err:
            run(obj)
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
        assert JqExpr(".metadata.annotations.id").single_id(obj) == value
        assert JqExpr(".metadata.annotations.id").ids(obj) == [value]


def test_tostring_first() -> None:
    assert JqExpr(".status.phase").tostring_first(OBJ) == "Running"
    assert JqExpr(".status.ready").tostring_first(OBJ) == "true"
    assert JqExpr(".missing").tostring_first(OBJ) == "null"
    assert JqExpr("empty").tostring_first(OBJ) is None


def test_number_takes_the_first_numeric_output() -> None:
    assert JqExpr(".spec.groups[0].replicas").number(OBJ) == 2.0
    assert JqExpr(".spec.groups[1].replicas").number(OBJ) == 4.0  # numeric string
    assert JqExpr(".spec.groups[3].replicas").number(OBJ) is None  # "x"
    assert JqExpr("null, true, 7").number(OBJ) == 7.0  # null and booleans skipped
    assert JqExpr("empty").number(OBJ) is None
    assert JqExpr("[1]").number(OBJ) is None


def test_numbers_one_per_output() -> None:
    got = JqExpr(".spec.groups[].replicas").numbers(OBJ)
    assert got == [2.0, 4.0, None, None]
    assert JqExpr('null, {}, "1e3"').numbers(OBJ) == [None, None, 1000.0]
    nan = JqExpr('"nan"').numbers(OBJ)[0]
    assert nan is not None and math.isnan(nan)


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
