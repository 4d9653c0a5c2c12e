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


@contextlib.contextmanager
def whole_heap_collections() -> Iterator[list[int]]:
    """The generations of the collections made while nothing was frozen, in a process
    whose heap is frozen first: a collection that walks the whole heap (the event loop
    held for it: ~0.2-0.6 s at 37.5k pods), as ``gc.unfreeze()`` then ``gc.collect()``
    makes. Everything frozen meanwhile back in reach afterwards."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and gc.get_freeze_count() == 0:
            seen.append(info["generation"])

    gc.collect()
    gc.freeze()
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.unfreeze()
