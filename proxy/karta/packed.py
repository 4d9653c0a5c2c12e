"""Kept cluster objects as JSON text, read back only when they are evaluated again.

The engine keeps whole objects only for described kinds (status, scale and instance ids
are evaluated from them), and evaluates them once per object version or description
change; in between they only take memory. Parsed JSON is ~5x its text in Python
objects, so the engine keeps the text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class Packed:
    """A kept object as its JSON text: ~5x smaller than the parsed dicts.

    Described objects are kept only to be evaluated again (a new object version, a
    description change), and every evaluation serialises them for jq anyway; 20k
    Deployments, ReplicaSets, StatefulSets and Jobs of a 37.5k-pod cluster are ~75 MB as
    dicts, ~15 MB as text.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def pack(obj: Mapping[str, Any]) -> Mapping[str, Any] | Packed:
    """``obj`` as text if the text reads back as an equal object, else ``obj`` itself.

    Equal after the round trip means every later evaluation sees the same input: what
    JSON cannot carry unchanged (YAML timestamps, NaN, tuples, non-string keys, cycles)
    keeps the object as it is.
    """
    try:
        text = json.dumps(obj, separators=(",", ":"))
        same = json.loads(text) == obj
    except (TypeError, ValueError, RecursionError):
        return obj
    return Packed(text) if same else obj


def unpack(obj: Mapping[str, Any] | Packed) -> Mapping[str, Any]:
    """The object to evaluate (a fresh copy each time for packed ones)."""
    if isinstance(obj, Packed):
        loaded: dict[str, Any] = json.loads(obj.text)
        return loaded
    return obj
