"""Handing freed heap back to the operating system after a big load.

CPython allocates objects over 512 bytes (a snapshot object's JSON text, a long label
value) from glibc's malloc, which keeps freed memory for reuse instead of returning it.
After a load that freed many such blocks (a snapshot read, then applied), the process
would carry them as RSS for its whole life: ~20-30 MB at 37.5k pods, and the peak of the
fact write that follows is that much higher. ``malloc_trim(0)`` returns them, and
:func:`limit_arenas` keeps threads from each keeping an arena of their own.

The same load leaves the cyclic garbage collector a large long-lived heap (the engine's
records and the index: ~500k tracked objects at 37.5k pods), which every full collection
walks again: 150-370 ms with the GIL held, the event loop and the splice workers stopped,
whenever enough young objects survive (a fact write makes them). The sources move what a
load builds out of the collector's view as they build it (:func:`collect_and_freeze`,
every few thousand objects), not in one pass over the whole heap at the end: that held
the event loop 0.22-0.57 s at 37.5k pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import threading
import types
from asyncio import selector_events
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - musl and others have no malloc_trim
    except (OSError, AttributeError):
        return None
    return libc


#: glibc malloc arenas for the process: the main one and one shared by every worker
#: thread. glibc's default is 8 per core, one per thread that ever allocates: the
#: snapshot read (a thread), the splice workers and the default executor each left an
#: arena of freed blocks that the others could not reuse (a /metrics scrape after the
#: first fact write: +16 MiB with the default, +0 with 1 or 2 at 37.5k pods).
ARENA_MAX = 2
_M_ARENA_MAX = -8  # malloc.h


def limit_arenas(n: int = ARENA_MAX) -> bool:
    """Cap glibc's malloc arenas at ``n`` (call before threads start; True if set).

    ``MALLOC_ARENA_MAX`` in the environment wins: an operator who set it meant it."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.mallopt(_M_ARENA_MAX, n))
    except (OSError, AttributeError):  # pragma: no cover - a libc without mallopt
        log.debug("mallopt failed", exc_info=True)
        return False


#: glibc's thresholds for the request path: a request's buffers (its body, the decoded
#: bytes, the spliced bytes, the compressed output: 0.3-2 MB each at 2,000 series) come
#: from the heap and stay there once freed. glibc's defaults map each such block afresh
#: (its mmap threshold starts at 128 KiB) or trim the heap's top as soon as twice the
#: largest block seen is free, so every request faulted its pages in again: ~5% of a
#: worker's CPU in the kernel zeroing pages (perf, 37.5k pods, 2,000-series requests).
#: Freed request memory is reused by the next request, so this moves RSS only by what
#: was live at once anyway; ``trim`` (after a load) still hands everything back.
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_request_buffers() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to 64 MiB free at its top (call
    at start; True if set). ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in
    the environment wins."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # pragma: no cover - a libc without mallopt
        log.debug("mallopt failed", exc_info=True)
        return False


def trim() -> bool:
    """Return free heap to the OS where the C library can (glibc); True if it did."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except OSError:  # pragma: no cover - a libc that cannot be called
        log.debug("malloc_trim failed", exc_info=True)
        return False


async def trim_off_loop() -> bool:
    """:func:`trim` in a worker thread, for the event loop's callers: ``malloc_trim`` walks
    the whole heap, 4-9 ms at 37.5k pods, and on the loop every request relayed meanwhile
    waited that long (ctypes releases the GIL for the call, and the loop's own small
    allocations are Python's, not malloc's)."""
    return await asyncio.to_thread(trim)


class _Pauses:
    """Who is in :func:`collections_paused` now, and the collector's state before the
    first of them came in: the last to leave puts it back, so pauses that overlap in
    two threads do not end each other's early."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.was_enabled = False


_pauses = _Pauses()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic collection while the block runs (the collector's state as it was after).

    For reading a big file into objects that hold no cycles, as a YAML snapshot is read:
    the read's allocations would start full collections that walk the whole process
    heap with the GIL held, the event loop waiting (one of 39-45 ms in a bare process
    reading 37.5k pods; when the document was built whole before its items were read,
    each walked all of it again, ~1.2 s of them per read, up to 0.38 s at once). The
    pause is process-wide: cyclic garbage that other threads make meanwhile waits for
    the next collection (it is not lost, as a frozen cycle would be). Reference counting
    frees everything else as ever.
    """
    with _pauses.lock:
        if not _pauses.inside:
            _pauses.was_enabled = gc.isenabled()
            gc.disable()
        _pauses.inside += 1
    try:
        yield
    finally:
        with _pauses.lock:
            _pauses.inside -= 1
            if not _pauses.inside and _pauses.was_enabled:
                gc.enable()


@functools.cache
def release_closed_transports() -> None:
    """Make a closed asyncio socket transport free without the cyclic collector (once per
    process; the freezes below call it).

    Python 3.11's selector transport keeps a bound method of itself (``_read_ready_cb``;
    3.12 also ``_write_ready``, dropped only by ``close()``): a cycle, so a closed
    transport, its socket object and their dicts wait for a collection. A connection open
    at a freeze (a watch's, the upstream's, a sender's) is in the permanent generation,
    and once closed that cycle was never collected: five objects, ~0.8 KiB, per
    connection that outlived a fact write, for the process's life. The churn soak
    (``benchmarks/churn_soak.py``) kept one per watch restart, 214 after 25 cycles; at
    the watches' 4-8 minutes, ~100 an hour in every replica besides senders' and the
    upstream's connections. Once the transport has told its protocol the connection is
    lost it calls nothing of itself again (the reader and writer were removed when it
    closed): dropping those methods there breaks the cycle, as CPython 3.12's ``close()``
    does, on every way a transport ends (TLS too: its layers hold no cycle once closed).
    """
    cls = getattr(selector_events, "_SelectorSocketTransport", None)
    lost = getattr(cls, "_call_connection_lost", None)
    if cls is None or lost is None:  # pragma: no cover - another asyncio
        return

    def call_connection_lost(self: Any, exc: BaseException | None) -> None:
        try:
            lost(self, exc)
        finally:
            own = vars(self)
            for name in [k for k, v in own.items()
                         if isinstance(v, types.MethodType) and v.__self__ is self]:
                del own[name]

    cls._call_connection_lost = call_connection_lost


def freeze_survivors() -> None:
    """Leave what is alive now out of later collections, without collecting first.

    For what a periodic job built and keeps until its next run (the fact writer's cache:
    ~290k series tuples at 37.5k pods). Left tracked, every full collection walked them
    again: 77-210 ms with the GIL held, every ~10 s while relaying with facts every 5 s,
    and the p99 latency a request saw went from 10 to 190 ms (``relay_bench.py
    --fact-interval 5``). ``gc.freeze()`` only moves the tracked objects to the permanent
    generation: O(1), and reference counting still frees them when they go. Only for
    objects that hold no cycles once garbage (tuples of bytes; a snapshot reload's
    stubs and engine records): a frozen cycle is never collected. What is garbage among
    the rest is collected first by the caller, before it builds (:func:`collect_unfrozen`).
    A connection's transport is such a cycle: :func:`release_closed_transports`.
    """
    release_closed_transports()
    gc.freeze()


def collect_unfrozen() -> None:
    """A full collection of what is not frozen: what came since the last
    :func:`freeze_survivors` (0.55 ms with 5,000 survivors and 300 tracebacks beside a
    frozen 37.5k-pod index and fact cache).

    For a periodic job to call before it builds what it will freeze: the freeze is
    process-wide, so a reference cycle that was already garbage but not yet collected
    (a broken watch stream's exception, its traceback, frames, the aiohttp response and
    transport they hold) went into the permanent generation with the job's survivors,
    never to be collected. A 90-minute soak under pod churn measured that as ~14,000
    Python blocks an hour in every replica; collecting after the build instead would walk
    the new cache too (5-15 ms)."""
    gc.collect()


def collect_and_freeze() -> None:
    """:func:`collect_unfrozen`, then :func:`freeze_survivors`: for a load that builds a
    large long-lived heap, every few thousand objects and at its end. Each step's
    collection walks only what came since the last freeze (a few ms at 37.5k pods),
    where one pass over the whole heap at the end (unfreeze, collect, freeze) held the
    event loop 0.22-0.57 s, and no cycle already garbage is frozen for good. A reload
    freezes what it leaves (:func:`freeze_survivors`) without collecting: what it
    replaces forms no cycles (``test_a_reload_leaves_no_cyclic_garbage``)."""
    collect_unfrozen()
    freeze_survivors()
