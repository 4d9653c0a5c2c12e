"""One object for equal values that many records keep for their whole lives.

The engine, the index and the fact writer each keep values that repeat across pods (a
(component, instance) key, a namespace's bytes, the stamp part of a pod's fact series):
a copy per pod was ~17 MB at 37.5k pods (docs/performance.md, "Strings kept once").
``sys.intern`` does this for ``str`` only. A leaf module, so the engine can share it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class SharedValues(Generic[T]):
    """``shared(value)``: the equal value it holds, else ``value``, held from then on.

    It only saves memory, so when full it starts again rather than evicting with
    bookkeeping of its own: values that come and go (namespaces, pods) cannot grow it,
    and what it forgot is shared again from its next sight on. ``most`` may be changed
    as what is shared grows (the fact writer: the pods it writes)."""

    __slots__ = ("_held", "most")

    def __init__(self, most: int) -> None:
        self.most = most
        self._held: dict[T, T] = {}

    def __call__(self, value: T) -> T:
        held = self._held.get(value)
        if held is None:
            if len(self._held) >= self.most:
                self._held.clear()
            held = self._held[value] = value
        return held

    def __len__(self) -> int:
        return len(self._held)
