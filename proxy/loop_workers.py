"""Threads that run a request's CPU work and hand the result straight to the event loop.

``loop.run_in_executor`` costs the event loop thread ~75 Python calls per request: a
``concurrent.futures.Future`` with its condition variable, the executor's lock and
thread-count check, an asyncio future chained to the first one and the copy of its state
back (``benchmarks/loop_bench.py``). The loop thread is where karta-proxy spends beyond a
plain relay, and interpreter work there slows most when the machine does
(docs/performance.md, "Fourteenth pass"). Here a job is one tuple on a queue and the
answer one ``call_soon_threadsafe`` that sets the awaiting future: ~10 calls.

The threads (one per core the proxy may use) start with the first job and are named for
the OS (``proxy.thread_names``). A thread that cannot start (a pids limit, ``RuntimeError:
can't start new thread``) is tried again at the next job: with none running the job is
refused with :class:`ThreadStartError` (the handler answers 503), with some running it
waits for those. A job still queued when the workers are shut down is
cancelled; one running finishes, its result dropped when no one waits for it any more.

Each thread adds up the time it spends on jobs, and the queue says how many wait: read at
scrape time (``karta_proxy_worker_busy_seconds_total``, ``..._queued_requests``), they
tell a proxy at capacity (every worker busy all the time) with nothing added on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from proxy.thread_names import name_os_thread

T = TypeVar("T")

#: a job: the loop to answer on, the future to set there, the call
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _set_result(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():  # cancelled meanwhile: the request was abandoned
        fut.set_result(result)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _cancel(fut: asyncio.Future[Any]) -> None:
    fut.cancel()


#: what stops a thread from starting, as a refusal names it: a thread's stack is mapped,
#: so an address-space limit stops it as surely as a pids limit (seen under RLIMIT_AS)
THREAD_LIMITS = ("the process is at its thread or pids limit (a pod's pids limit, ulimit -u, "
                 "kernel.threads-max) or its address-space limit (ulimit -v: a thread's "
                 "stack is mapped)")


class ThreadStartError(RuntimeError):
    """No worker thread runs and none could be started for a job (the job is not queued)."""


class LoopWorkers:
    """A fixed set of named threads; :meth:`run` awaits a call made in one of them."""

    def __init__(self, prefix: str, count: int) -> None:
        if count < 1:
            raise ValueError(f"a worker pool needs at least one thread, not {count}")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._prefix = prefix
        self._threads = [self._thread(i) for i in range(count)]
        #: every thread started (until then each job tries to start the rest)
        self._started = False
        #: seconds each thread spent on jobs (each item written by its own thread only)
        self._busy = [0.0] * count

    @property
    def threads(self) -> int:
        return len(self._threads)

    def busy_seconds(self) -> float:
        """Time the threads spent on jobs since they started, summed (a job is counted
        when it ends)."""
        return sum(self._busy)

    def queued(self) -> int:
        """Jobs waiting for a free thread now."""
        return self._jobs.qsize() if not self._closed else 0

    def _thread(self, i: int) -> threading.Thread:
        return threading.Thread(target=self._work, args=(i,), name=f"{self._prefix}_{i}",
                                daemon=True)

    def running(self) -> int:
        """Threads started (and not shut down)."""
        return sum(t.ident is not None for t in self._threads)

    def _start(self) -> None:
        """Start the threads not started yet; raises :class:`ThreadStartError` when none
        runs afterwards. A thread that fails to start is made anew and tried again at the
        next job, so one failed start (a pids limit hit for a moment) wedges nothing."""
        failure: RuntimeError | None = None
        for i, t in enumerate(self._threads):
            if t.ident is not None:
                continue
            try:
                t.start()
            except RuntimeError as e:  # "can't start new thread": the pids or thread limit
                self._threads[i] = self._thread(i)
                failure = e
                break  # the next ones would fail as well
        if failure is None:
            self._started = True
        elif not self.running():
            raise ThreadStartError(
                f"cannot start a worker thread ({failure}): {THREAD_LIMITS}") from failure

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` in a worker thread: the future of its result, or of what it raised,
        set on the event loop. Awaited where it is made (``await pool.submit(...)``), not
        kept in a variable: a failure's traceback holds the awaiting frame, and the future
        holds the failure, a cycle that only the garbage collector would free, with the
        request's buffers in the frames of the traceback (tens of MB a request). No
        coroutine of its own: one frame fewer to resume on the loop per request."""
        if self._closed:
            raise RuntimeError("the worker threads are shut down")
        if not self._started:  # at the first job: a handler never used starts none; after
            # a failed start, the threads still missing
            self._start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return fut

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; its result, or what it raised."""
        return await self.submit(fn, *args)

    def shutdown(self) -> None:
        """Stop the threads once each has finished its job (queued ones are cancelled),
        and wait for them."""
        self._closed = True
        started = [t for t in self._threads if t.ident is not None]
        for _ in started:
            self._jobs.put(None)
        for t in started:  # a thread that never started cannot be joined
            if t is not threading.current_thread():
                t.join()

    def _work(self, i: int) -> None:
        name_os_thread()
        jobs, busy, clock = self._jobs, self._busy, time.perf_counter
        while (job := jobs.get()) is not None:
            started = clock()
            self._do(*job)
            busy[i] += clock() - started
            del job  # nothing of a request kept while waiting for the next

    def _do(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any],
            fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._closed:
            self._answer(loop, _cancel, fut)
            return
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting request, as an executor does
            self._answer(loop, _set_exception, fut, e)
        else:
            self._answer(loop, _set_result, fut, result)
        finally:
            # the failure's traceback holds this frame: without its references to the
            # future (which holds the failure) and the call, no cycle (see ``run``)
            del fut, fn, args

    @staticmethod
    def _answer(loop: asyncio.AbstractEventLoop, how: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: no one to answer
            loop.call_soon_threadsafe(how, *args)
