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
