"""Returning freed heap: big blocks freed after a load stop counting in RSS."""

from __future__ import annotations

import ctypes.util
import platform
from pathlib import Path

import pytest

from proxy import memory


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"),
                    reason="glibc's malloc_trim")
def test_freed_blocks_of_a_load_are_returned() -> None:
    if memory._libc() is None:
        pytest.skip("no malloc_trim in this C library")
    # 60k strings of ~1 KB, the shape of a snapshot's object texts, with a small survivor
    # after every one so glibc cannot give the space back by itself when they are freed
    texts = [("x" * 1000) + str(i) for i in range(60_000)]
    keep = [str(i) * 40 for i in range(60_000)]
    del texts
    before = _rss()
    assert memory.trim()
    assert _rss() < before - 20 * 1024 * 1024
    assert keep[-1]


def test_trim_is_harmless_to_call_again() -> None:
    memory.trim()
    assert memory.trim() in (True, False)


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_arenas_are_capped_unless_the_operator_chose() -> None:
    """In a fresh process (before any thread): capped; with MALLOC_ARENA_MAX set, left
    to glibc, which reads the variable itself."""
    import os
    import subprocess
    import sys

    if memory._libc() is None:
        pytest.skip("no glibc")
    code = "from proxy import memory; print(memory.limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    mine = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert mine.stdout.strip() == "True"
    theirs = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"},
                            capture_output=True, text=True, timeout=60, check=True)
    assert theirs.stdout.strip() == "False"


class _Node:
    """A container the cyclic collector tracks (and can hold in a cycle)."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_freezes_what_is_alive_and_frees_old_cycles() -> None:
    """What a load leaves alive is out of every later collection's walk; a cycle that
    was garbage before is still freed by the settle's one collection, even one that an
    earlier settle had frozen (a reload's replaced objects)."""
    import gc
    import weakref

    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: reference counting alone never frees it
    gone = weakref.ref(a)
    memory.settle()  # frozen while alive
    try:
        kept = _Node()
        memory.settle()
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "still walked by gc"
        del a, b
        memory.settle()
        assert gone() is None, "a frozen cycle that became garbage was not freed"
    finally:
        gc.unfreeze()
