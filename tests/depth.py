"""How deeply nested a value Python's C code takes here: what tests of deep input measure
instead of assuming, because the limit moved with every version.

- 3.11: Python's recursion limit (1,000), Python and C calls alike;
- 3.12 and 3.13: the C recursion limit (1,500 on 3.12.1, 10,000 on 3.13.0), which only
  calls from C into Python and C code's own recursion take from;
- from 3.14: the thread's stack itself, which CPython measures, so the limit is the
  stack's size over the frame's: on an 8 MiB stack ~20,000 levels of msgspec's decoder,
  ~87,000 of its encoder, ~35,000 of ``json.dumps`` (dicts).

``python -m tests.depth`` prints how deep a list ``json.dumps`` takes in a fresh
interpreter's main thread: what the jq sandbox's child has to encode its outputs with."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def deepest(call: Callable[[int], object], high: int = 1 << 20) -> int:
    """The greatest ``n <= high`` for which ``call(n)`` raises no RecursionError (0 when
    even 1 does): a binary search, so ``call`` must fail at every depth past its limit."""
    low, best = 1, 0
    while low <= high:
        mid = (low + high) // 2
        try:
            call(mid)
        except RecursionError:
            high = mid - 1
        else:
            best, low = mid, mid + 1
    return best


def nested_list(depth: int) -> list[Any]:
    """``[[...[]...]]``, ``depth`` lists, built without recursion."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nested_object(depth: int) -> dict[str, Any]:
    """``{"a": {"a": ... 1}}``, ``depth`` objects, built without recursion."""
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def fresh_json_encoder_limit() -> int:
    """How deep a list ``json.dumps`` takes in a new interpreter's main thread (this
    module run by ``sys.executable``): the depth a fresh process, as the jq sandbox's
    child is, starts refusing from."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.depth"], cwd=root, check=True,
                          capture_output=True, text=True, timeout=120)
    return int(done.stdout)


if __name__ == "__main__":
    print(deepest(lambda n: json.dumps(nested_list(n))))
