"""The threads that splice a request's other parts, kept off the core of the worker that
hands the parts over.

A request alone in the worker pool is spliced in parts at once (``handler._prepare``):
the first part in the worker thread, the others in these threads. Linux wakes a thread on
the waker's core when it judges that core's cache warm, and on a 2-vCPU VM it did so for
35-38% of paced 2,000-series requests while the other core idled. The parts then took
turns on one core, and the worker phase's p90 went from ~2.2 to ~3.4 ms
(docs/performance.md, "Sixth pass").

So before the parts are handed over, :meth:`PartThreads.elsewhere` narrows the part
threads' CPU affinity to the cores the worker may use, minus the one it is on now: the
kernel must wake them elsewhere. A part thread widens its affinity back to those cores as
soon as it runs (a running thread is not moved by that), so the narrowing decides only
where it wakes: should another request's worker be woken onto the same core meanwhile,
the kernel may still balance them. It is not a pin either way: the set is taken afresh
each time from the worker's own affinity, so it follows a container's cpuset when the
kubelet changes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from proxy.thread_names import name_os_thread

T = TypeVar("T")


def _sched_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (the os module has no such call), or None where there is
    none (not Linux, no affinity calls)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


_getcpu = _sched_getcpu()


def current_cpu() -> int | None:
    """The core the calling thread runs on now, or None when it cannot be told."""
    if _getcpu is None:
        return None
    cpu = _getcpu()
    return cpu if cpu >= 0 else None


class PartThreads(ThreadPoolExecutor):
    """A thread pool for the parts after the first, whose threads can be moved off a core."""

    def __init__(self, count: int) -> None:
        #: the native ids of the pool's threads, as they start (the pool starts them on
        #: demand)
        self._tids: list[int] = []
        #: the cores a part thread widens to once it runs; None: not narrowed
        self._wide: set[int] | None = None
        super().__init__(count, thread_name_prefix="karta-part", initializer=self._started)

    def _started(self) -> None:
        name_os_thread()
        self._tids.append(threading.get_native_id())

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(self._widened, fn, *args, **kwargs)

    def _widened(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        wide = self._wide
        if wide is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, wide)
        return fn(*args, **kwargs)

    def elsewhere(self) -> int | None:
        """Have this pool's threads wake off the calling thread's core (each widens to the
        caller's cores again once it runs a task); the core they were moved off, or None
        when nothing was done (one allowed core, the core unknown, no thread started)."""
        cpu = current_cpu()
        if cpu is None or not self._tids:
            return None
        wide = os.sched_getaffinity(0)
        away = wide - {cpu}
        if not away:
            return None
        self._wide = wide
        for tid in list(self._tids):
            with contextlib.suppress(OSError):  # a thread gone, a cpuset changed meanwhile
                os.sched_setaffinity(tid, away)
        return cpu
