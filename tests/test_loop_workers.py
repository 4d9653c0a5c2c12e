"""The request workers: a call made in a named thread, its result or error handed to the
awaiting coroutine, a shut-down pool taking no more and cancelling what is queued."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.loop_workers import LoopWorkers, ThreadStartError


def _where(x: int) -> tuple[str, int]:
    return threading.current_thread().name, x * 2


def _holding(release: threading.Event, seconds: float = 0.0
             ) -> tuple[threading.Event, Callable[[], None]]:
    """A job that says when a worker took it, then holds the worker until ``release`` is
    set (the test's next steps need not fit in a time, however loaded the machine), and
    ``seconds`` more."""
    taken = threading.Event()

    def job() -> None:
        taken.set()
        assert release.wait(30)
        time.sleep(seconds)

    return taken, job


async def _taken(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def _comm() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


async def test_a_call_runs_in_a_named_worker_and_its_result_comes_back() -> None:
    pool = LoopWorkers("karta-test", 2)
    try:
        results = await asyncio.gather(*(pool.run(_where, i) for i in range(20)))
        assert [x for _, x in results] == [i * 2 for i in range(20)]
        assert {name for name, _ in results} <= {"karta-test_0", "karta-test_1"}
        assert threading.current_thread().name not in {name for name, _ in results}
        if Path("/proc/self/task").is_dir():
            assert (await pool.run(_comm)).startswith("karta-test_")
    finally:
        pool.shutdown()


async def test_an_error_reaches_the_caller_and_the_worker_goes_on() -> None:
    pool = LoopWorkers("karta-test", 1)
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 // 0)
        assert await pool.run(_where, 3) == ("karta-test_0", 6)
    finally:
        pool.shutdown()


async def test_the_loop_runs_while_a_worker_does() -> None:
    pool = LoopWorkers("karta-test", 1)
    turned = threading.Event()

    async def turning() -> None:
        for _ in range(5):
            await asyncio.sleep(0.005)
        turned.set()

    try:
        # the job waits for five turns of the loop: made only if the loop runs meanwhile
        # (counted, not timed: how many turns a loaded machine makes in 0.2 s is not the
        # test's to know)
        turns = asyncio.create_task(turning())
        assert await pool.run(turned.wait, 10)
        await turns
    finally:
        pool.shutdown()


async def test_an_abandoned_call_is_dropped_and_the_next_one_answered() -> None:
    pool = LoopWorkers("karta-test", 1)
    release = threading.Event()
    try:
        taken, job = _holding(release)
        slow = asyncio.create_task(pool.run(job))
        await _taken(taken)
        slow.cancel()  # while it runs, whatever the timing
        with pytest.raises(asyncio.CancelledError):
            await slow
        release.set()
        assert await pool.run(_where, 1) == ("karta-test_0", 2)
    finally:
        release.set()
        pool.shutdown()


async def test_after_shutdown_queued_calls_are_cancelled_and_new_ones_refused() -> None:
    pool = LoopWorkers("karta-test", 1)
    release = threading.Event()
    taken, job = _holding(release)
    busy = asyncio.create_task(pool.run(job))
    await _taken(taken)
    queued = asyncio.create_task(pool.run(_where, 1))
    await asyncio.sleep(0.01)
    assert pool.queued() == 1
    shutting = asyncio.create_task(asyncio.to_thread(pool.shutdown))
    while not pool._closed:  # the running job let go only once the pool is shut
        await asyncio.sleep(0.01)
    release.set()
    await shutting
    await busy  # the running one finishes
    with pytest.raises(asyncio.CancelledError):
        await queued
    with pytest.raises(RuntimeError, match="shut down"):
        await pool.run(_where, 2)
    assert not any(t.name.startswith("karta-test_") for t in threading.enumerate())


def test_a_pool_never_used_starts_no_thread_and_shuts_down_at_once() -> None:
    before = threading.active_count()
    pool = LoopWorkers("karta-test", 4)
    assert threading.active_count() == before
    pool.shutdown()


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LoopWorkers("karta-test", 0)


async def test_busy_time_and_queued_jobs_are_counted() -> None:
    pool = LoopWorkers("karta-test", 1)
    assert (pool.threads, pool.busy_seconds(), pool.queued()) == (1, 0.0, 0)
    release = threading.Event()
    try:
        started = time.perf_counter()
        taken, job = _holding(release, 0.2)
        first = asyncio.create_task(pool.run(job))
        await _taken(taken)
        second = asyncio.create_task(pool.run(time.sleep, 0.1))
        await asyncio.sleep(0.01)
        assert pool.queued() == 1  # waits for the one thread
        release.set()
        await asyncio.gather(first, second)
        assert pool.queued() == 0
        # a job is counted when it ends, just after its answer: read once the thread is
        # done (read at once, the second job was not yet counted on a loaded machine)
        await asyncio.to_thread(pool.shutdown)
        # at least the jobs' sleeps, at most the time they took (one thread)
        assert 0.29 <= pool.busy_seconds() <= time.perf_counter() - started
    finally:
        release.set()
        pool.shutdown()
    assert pool.queued() == 0


def _failing_starts(monkeypatch: pytest.MonkeyPatch, prefix: str, *fail: int) -> list[str]:
    """``threading.Thread.start`` raising as at a pids limit for the ``fail``-th starts
    (0-based) of threads named ``prefix...``; the names of every such start attempted."""
    real = threading.Thread.start
    attempts: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith(prefix):
            attempts.append(self.name)
            if len(attempts) - 1 in fail:
                raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return attempts


async def test_a_failed_thread_start_refuses_the_job_and_the_next_one_starts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the pool was marked started before its threads were: one failed start left no
    # thread running, and every later job waited on the queue for good
    attempts = _failing_starts(monkeypatch, "karta-test_", 0)
    pool = LoopWorkers("karta-test", 1)
    try:
        with pytest.raises(ThreadStartError, match="pids limit") as err:
            await pool.run(_where, 1)
        assert "can't start new thread" in str(err.value)
        assert pool.queued() == 0 and pool.running() == 0  # the job was not left queued
        async with asyncio.timeout(10):
            assert await pool.run(_where, 2) == ("karta-test_0", 4)
        assert attempts == ["karta-test_0", "karta-test_0"]
    finally:
        pool.shutdown()  # joins the thread that started, not the one that failed


def test_shutdown_after_a_failed_start_joins_only_threads_that_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # "cannot join thread before it is started" ended the stop with exit 1
    _failing_starts(monkeypatch, "karta-test_", 0)

    async def refused() -> None:
        with pytest.raises(ThreadStartError):
            await pool.run(_where, 1)

    pool = LoopWorkers("karta-test", 2)
    asyncio.run(refused())
    pool.shutdown()


async def test_a_pool_with_some_threads_started_takes_jobs_and_starts_the_rest_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = _failing_starts(monkeypatch, "karta-test_", 1)
    pool = LoopWorkers("karta-test", 2)
    try:
        async with asyncio.timeout(10):
            assert (await pool.run(_where, 1))[1] == 2  # thread 0 runs it
            assert pool.running() == 1
            await pool.run(_where, 2)  # the next job starts the missing one
        assert pool.running() == 2
        assert attempts == ["karta-test_0", "karta-test_1", "karta-test_1"]
    finally:
        pool.shutdown()
    assert not any(t.name.startswith("karta-test_") for t in threading.enumerate())
