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

import msgspec

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


#: keys sorted as :func:`~proxy.karta.jqexpr.jq_text` sorts them (by code point)
_SORTED = msgspec.json.Encoder(order="sorted")


def pack_decoded(obj: Mapping[str, Any]) -> Mapping[str, Any] | Packed:
    """:func:`pack_for_jq` for an object decoded from JSON (a watch event's): the same
    JSON value for jq, keys in the same order, made 5-8x faster (msgspec: a 1.5 MB Argo
    Workflow in ~3 ms against ~16, the event loop held all of it either way: both
    encoders hold the GIL in one piece). The text may differ in spelling only (UTF-8
    where ``json`` escapes, ``1e16`` for ``1e+16``). What ``object_text`` handles and
    this does not cannot come from JSON: NaN and infinities (msgspec would write
    ``null``), timestamps, keys that are not strings; what msgspec refuses (a lone
    surrogate; an object nested deeper than the caller's stack leaves room for: the
    decoder and the encoder each take their depth from what is left where they are
    called, of the recursion limit on 3.11, of the C recursion limit on 3.12 and 3.13,
    of the thread's stack itself from 3.14 (``tests/depth.py``), and a watch may decode
    from a shallower stack than the source hands an update here from) goes through
    :func:`pack_for_jq`. The sandbox's input limit counts a text's UTF-8 bytes, so a
    text spelled here is shorter where the object holds non-ASCII (2-4 bytes a
    character against ``json``'s 6-12): closer to what the child parses it into, and
    far from the limit for any Kubernetes object (etcd stores 1.5 MB at most)."""
    try:
        return Packed(_SORTED.encode(obj).decode())
    # UnicodeEncodeError is a ValueError
    except (TypeError, ValueError, OverflowError, RecursionError):
        return pack_for_jq(obj)


def unpack(obj: Mapping[str, Any] | Packed) -> Mapping[str, Any]:
    """The object to evaluate (a fresh copy each time for packed ones)."""
    if isinstance(obj, Packed):
        loaded: dict[str, Any] = json.loads(obj.text)
        return loaded
    return obj
