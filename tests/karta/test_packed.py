"""Packed objects: what JSON carries unchanged is kept as text, the rest as it is."""

from __future__ import annotations

import datetime
import math
from typing import Any

import pytest

from proxy.karta.packed import Packed, pack, unpack

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
