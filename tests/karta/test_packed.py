"""Packed objects: what JSON carries unchanged is kept as text, the rest as it is."""

from __future__ import annotations

import datetime
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.karta.jqexpr import JqExpr
from proxy.karta.packed import Packed, pack, pack_decoded, pack_for_jq, unpack
from tests.depth import deepest, nested_object

DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web", "namespace": "ns", "uid": "d1", "generation": 3,
                 "labels": {"app": "web", "é": "\u00e9\ud800"}},
    "spec": {"replicas": 2, "ratio": 0.1, "big": 2**70, "flag": True, "none": None,
             "neg": -0.0, "list": [1, 1.0, "1", [], {}]},
}


def test_a_json_object_is_kept_as_text_and_reads_back_equal_with_its_types() -> None:
    packed = pack(DEPLOYMENT)
    assert isinstance(packed, Packed)
    back = unpack(packed)
    assert back == DEPLOYMENT and back is not DEPLOYMENT
    items = back["spec"]["list"]
    assert [type(v) for v in items[:3]] == [int, float, str]
    assert type(back["spec"]["flag"]) is bool
    assert math.copysign(1.0, back["spec"]["neg"]) == -1.0
    assert list(back["metadata"]) == list(DEPLOYMENT["metadata"])  # key order kept


@pytest.mark.parametrize(
    "odd",
    [
        datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),  # unquoted YAML time
        datetime.date(2024, 1, 2),
        float("nan"),
        (1, 2),  # a YAML !!omap entry
        {1: "int key"},
        {"a", "b"},
        b"bytes",
    ],
)
def test_what_json_does_not_carry_unchanged_keeps_the_object(odd: Any) -> None:
    obj = {**DEPLOYMENT, "status": {"odd": odd}}
    assert pack(obj) is obj
    assert unpack(obj) is obj


def test_a_cycle_keeps_the_object() -> None:
    obj: dict[str, Any] = {"kind": "X"}
    obj["self"] = obj
    assert pack(obj) is obj


# -- pack_decoded: the text of an object decoded from JSON, by msgspec ---------------------

_JSON_SCALARS = (st.none() | st.booleans() | st.integers() | st.text()
                 | st.floats(allow_nan=False, allow_infinity=False))
#: what a JSON decode gives: string keys, finite numbers, ints of any size
_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(), inner, max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), _JSON, max_size=6))
def test_pack_decoded_gives_jq_the_value_and_key_order_object_text_gives(
        obj: dict[str, Any]) -> None:
    """Whatever JSON can carry (lone surrogates included: those go the slow way): the
    same value, with its keys in the same order, as the text every other pack makes."""
    fast, slow = pack_decoded(obj), pack_for_jq(obj)
    assert isinstance(fast, Packed) and isinstance(slow, Packed)

    def pairs(text: str) -> Any:
        return json.loads(text, object_pairs_hook=list)

    assert pairs(fast.text) == pairs(slow.text)
    assert unpack(fast) == unpack(slow) == obj


def test_pack_decoded_reads_alike_in_jq() -> None:
    """The same outputs in libjq (key order of iteration included) for the shapes a
    description reads, whatever the spelling of the text (UTF-8, exponents)."""
    obj = {"status": {"nodes": {"b": {"phase": "Running", "n": 1e16}, "a": {"phase": "é"}}},
           "spec": {"replicas": 2**70, "ratio": 1.5e-7, "neg": -0.0}}
    fast, slow = pack_decoded(obj), pack_for_jq(obj)
    assert isinstance(fast, Packed) and isinstance(slow, Packed)
    assert fast.text != slow.text  # spelled differently ...
    for source in ('[.status.nodes[] | .phase]', ".status.nodes | keys_unsorted",
                   "[.spec[]]", '[.. | numbers]'):
        expr = JqExpr(source)
        assert expr.run_here(fast.text) == expr.run_here(slow.text), source  # ... read alike


def test_pack_decoded_leaves_what_json_cannot_give_to_pack_for_jq() -> None:
    lone = {"metadata": {"name": "\ud800"}}
    assert pack_decoded(lone).text == pack_for_jq(lone).text  # type: ignore[union-attr]
    timestamp = {"t": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)}
    assert pack_decoded(timestamp).text == pack_for_jq(timestamp).text  # type: ignore[union-attr]


def _nested_text(depth: int) -> str:
    """``{"a":{"a": ... 1}}``, ``depth`` objects: the text msgspec spells such an object."""
    return '{"a":' * depth + "1" + "}" * depth


def _deepest_decoded() -> tuple[int, Any]:
    """The deepest object msgspec's decoder gives from here, and its depth: what a watch
    decodes, as deep as the stack it decodes from leaves room for (:mod:`tests.depth`)."""
    decoded: list[Any] = [None]

    def decode(depth: int) -> None:  # the last to succeed is the deepest
        decoded[0] = msgspec.json.decode(_nested_text(depth).encode())

    return deepest(decode, high=400_000), decoded[0]


def _from_deeper(frames: int, call: Callable[[], Any]) -> Any:
    """``call()`` from ``frames`` calls deeper, each made by C (``functools.partial``):
    from Python 3.12 a Python-to-Python call leaves the C recursion limit, which msgspec's
    and ``json``'s encoders count, as it is, and only a call from C into Python takes
    from it; 3.11 counts both against the one limit."""
    return functools.partial(_from_deeper, frames - 1, call)() if frames else call()


def test_pack_decoded_of_an_object_nested_as_deep_as_a_watch_decodes_it() -> None:
    """msgspec's decoder and encoder each count the stack they are called from: on 3.11
    to 3.13 an object a watch decoded as deep as its stack allowed is too deep for the
    encoder called from a deeper one (the source's handling of the slice). Its
    RecursionError (``json``'s too, which ``pack_for_jq`` catches: the object kept as it
    is) went out of ``facts_work``, and so out of the watch source's handling of the slice
    holding a heavy object's update. The depth is the decoder's here, and the deeper
    stack one every version counts (:func:`_from_deeper`): 200 Python frames alone take
    nothing from the C recursion limit of 3.12 and 3.13. From 3.14, which measures the
    stack, the decoder's frames are the larger (:mod:`tests.depth`), so such an object
    packs: either way it is kept, as it is or as its text. The text is compared as text:
    decoding it again is at the decoder's very limit, which a few bytes more of stack
    anywhere below (3.15 measures it) pass."""
    depth, obj = _deepest_decoded()
    kept = _from_deeper(200, lambda: pack_decoded(obj))
    assert kept is obj or (isinstance(kept, Packed) and kept.text == _nested_text(depth))


def test_pack_decoded_of_an_object_deeper_than_its_encoders_take_keeps_it() -> None:
    """On every version, an object twice as deep as msgspec's encoder takes here (deeper
    than ``json``'s too) is kept as it is: no RecursionError out of ``pack_decoded``."""
    encoder = msgspec.json.Encoder(order="sorted")
    obj = nested_object(2 * deepest(lambda n: encoder.encode(nested_object(n)), high=400_000))
    assert pack_decoded(obj) is obj
