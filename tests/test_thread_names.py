"""The OS-level names of the proxy's threads (proxy.thread_names)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from proxy.part_threads import PartThreads
from proxy.thread_names import MAX_NAME_BYTES, name_os_thread, named_pool, os_name

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="the kernel's per-thread names are read from /proc")


def _comm() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().rstrip("\n")


def _named(name: str) -> tuple[bool, str]:
    out: list[tuple[bool, str]] = []

    def run() -> None:
        out.append((name_os_thread(), _comm()))

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    return out[0]


def test_a_thread_gets_its_python_name_from_the_kernel_too() -> None:
    assert _named("karta-splice_0") == (True, "karta-splice_0")


def test_a_long_name_is_cut_to_what_the_kernel_keeps_never_mid_character() -> None:
    assert _named("karta-something-long_12") == (True, "karta-something")
    # 14 ASCII bytes, then a 2-byte character that would end past byte 15
    cut = os_name("karta-splice_0é")
    assert cut == b"karta-splice_0" and len(cut) <= MAX_NAME_BYTES
    assert _named("karta-splice_0é") == (True, "karta-splice_0")


def test_the_other_threads_keep_their_own_names() -> None:
    before = _comm()
    _named("karta-elsewhere")
    assert _comm() == before


def test_the_worker_pools_name_their_threads() -> None:
    with named_pool("karta-splice", 2) as pool:
        assert pool.submit(_comm).result() == "karta-splice_0"
    parts = PartThreads(1)
    try:
        assert parts.submit(_comm).result() == "karta-part_0"
    finally:
        parts.shutdown(wait=True)
