"""The part threads are moved off the handing worker's core, and only that core."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from proxy.part_threads import PartThreads, current_cpu

CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
needs_two = pytest.mark.skipif(
    len(CPUS) < 2 or current_cpu() is None,
    reason="needs two usable CPUs and sched_getcpu (Linux)")


@pytest.fixture
def pool() -> Iterator[PartThreads]:
    threads = PartThreads(1)
    yield threads
    threads.shutdown(wait=True)


def started(pool: PartThreads) -> int:
    """The native id of the pool's thread, started by a first task."""
    return pool.submit(threading.get_native_id).result(timeout=10)


def test_current_cpu_is_one_this_thread_may_use() -> None:
    cpu = current_cpu()
    assert cpu is None or cpu in CPUS


@needs_two
def test_the_part_threads_leave_the_callers_core_and_only_it(pool: PartThreads) -> None:
    tid = started(pool)
    avoided = pool.elsewhere()
    assert avoided is not None and avoided in CPUS
    assert os.sched_getaffinity(tid) == CPUS - {avoided}


@needs_two
def test_a_part_wakes_elsewhere_then_widens_again(pool: PartThreads) -> None:
    """The narrowing decides where the part thread wakes; running, it may use every core
    the caller may (so the kernel can still balance it against other work)."""
    tid = started(pool)
    for _ in range(20):
        avoided = pool.elsewhere()
        assert pool.submit(current_cpu).result(timeout=10) != avoided
        assert os.sched_getaffinity(tid) == CPUS


@needs_two
def test_each_call_takes_the_callers_core_and_cpus_afresh(pool: PartThreads) -> None:
    tid = started(pool)
    first, second = sorted(CPUS)[:2]
    result: list[int | None] = []

    def from_core(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})  # the kernel moves this thread there at once
        os.sched_setaffinity(0, {first, second})
        result.append(pool.elsewhere())

    # each caller is a thread of its own: this one's affinity is left as it was
    for cpu in (first, second):
        t = threading.Thread(target=from_core, args=(cpu,))
        t.start()
        t.join(10)
    # each time, the set is the caller's own (here two cores) minus the core it was on
    # (a thread may be moved between reading its core and the call: then the other one)
    assert len(result) == 2 and all(r in (first, second) for r in result)
    assert os.sched_getaffinity(tid) == {first, second} - {result[-1]}


@needs_two
def test_nothing_is_moved_with_one_core_allowed(pool: PartThreads) -> None:
    tid = started(pool)
    before = os.sched_getaffinity(tid)
    out: list[int | None] = []

    def pinned() -> None:
        cpu = min(CPUS)
        os.sched_setaffinity(0, {cpu})
        out.append(pool.elsewhere())

    t = threading.Thread(target=pinned)
    t.start()
    t.join(10)
    assert out == [None]
    assert os.sched_getaffinity(tid) == before


def test_no_thread_started_yet_is_nothing_to_move(pool: PartThreads) -> None:
    assert pool.elsewhere() is None
    assert pool.submit(int, "7").result(timeout=10) == 7
