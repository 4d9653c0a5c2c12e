"""Cyclic garbage made on purpose, for tests that a freeze (``proxy.memory``) does not keep
what was already garbage."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator


class _Node:
    other: _Node | None = None


def cycle() -> weakref.ref[_Node]:
    """Two objects that refer to each other and nothing else: garbage that only the cyclic
    collector frees. The reference is dead once it has."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@contextlib.contextmanager
def collections_off() -> Iterator[None]:
    """Only the collections the code under test makes; everything frozen meanwhile back in
    reach afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()
