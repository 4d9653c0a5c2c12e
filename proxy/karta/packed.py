"""Kept cluster objects as JSON text.

The engine keeps whole objects only for described kinds (status, scale and instance ids
are evaluated from them), and evaluates them once per object version or description
change; in between they only take memory. Parsed JSON is ~5x its text in Python
objects, so the engine keeps the text, and keeps it as jq reads it (:func:`pack_for_jq`):
an evaluation hands that text to jq as it is, never parsed back nor written again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from proxy.karta.status import object_text


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


def pack_for_jq(obj: Mapping[str, Any]) -> Mapping[str, Any] | Packed:
    """``obj`` as the text its expressions read (:func:`~proxy.karta.status.object_text`:
    keys sorted, timestamps as the API writes them), or ``obj`` itself when it is not
    JSON (NaN, bytes, a cycle): the engine's way of keeping an object.

    Every evaluation serialises the object that way, so the text is the same input the
    object gave: an update of a 1.7 MB Argo Workflow serialised it three times and
    parsed it twice in Python (``pack``'s check, then an unpack and ``object_text`` per
    evaluation, ~50 ms of the event loop), now once (~17 ms)."""
    try:
        return Packed(object_text(obj))
    except (TypeError, ValueError, RecursionError):
        return obj


def unpack(obj: Mapping[str, Any] | Packed) -> Mapping[str, Any]:
    """The object to evaluate (a fresh copy each time for packed ones)."""
    if isinstance(obj, Packed):
        loaded: dict[str, Any] = json.loads(obj.text)
        return loaded
    return obj
