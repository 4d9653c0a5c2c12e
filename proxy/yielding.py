"""Background work on the event loop gives way to the remote-write requests being relayed.

A fact write, a standby replica's walk of the fact groups and a ``/metrics`` page are
each ~0.1-2 s of Python at 37.5k pods, made on the event loop in short stretches. What
happens between two stretches decides what a relayed request meanwhile pays:

- one turn of the loop (``sleep(0)``): a relayed request needs many (its body, the
  hand-off to a worker and back, the upstream's post and answer), and its worker needs
  the GIL a few times, which a stretch of Python holds up to the interpreter's switch
  interval (5 ms). Requests relayed during a fact write took 20-40 ms instead of ~5,
  during a ``/metrics`` scrape 100-420 ms;
- 1 ms of the loop's time: 8-12 ms during a fact write, the write 0.8-0.9 s long;
- :meth:`Pacer.pause`: a few turns, so that a request whose headers arrived during the
  stretch takes its slot, and then, while any request is being relayed (``busy``), a
  wait for it: requests relayed during a fact write take ~1 ms more than outside one at
  the median (p90 7-8 ms against 6-7), the write is over in half the time, and during a
  scrape they take ~5 ms (docs/performance.md, "Eighth pass").

The wait is bounded twice: ``DEFER_MAX_SECONDS`` per pause, so a saturated proxy still
makes progress on its background work, and a budget per piece of work, after which its
pauses are ``PAUSE_SECONDS`` of real time as before, so that it ends in time (a fact
write within its interval, a page within the scraper's timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

#: a pause gives the loop this many turns before it asks ``busy``: a request whose
#: headers arrived during the stretch holds its slot after 4 (the socket's read,
#: aiohttp's protocol task, the request's task; measured in-process)
ARRIVAL_TURNS = 6
#: the longest one pause waits for requests: under saturation (always busy) background
#: work still makes one stretch per this long
DEFER_MAX_SECONDS = 0.02
#: a pause without ``busy`` to ask, or past the budget: this much of the loop's real time
PAUSE_SECONDS = 0.001

#: engine work a reload does on the event loop (a snapshot's changes, a description
#: change's re-attribution) runs in runs of about this long, each followed by a pause: in
#: one go a snapshot reload's was 15-27 ms at 37.5k pods with 1% of them changed, and a
#: configuration reload's 3.3-4.0 s, a stall for any request relayed meanwhile
LOOP_RUN_SECONDS = 0.002
#: how long a reload's pauses may wait in all for requests being relayed: a reload under
#: constant load ends at most this much later than on an idle proxy
RELOAD_DEFER_SECONDS = 10.0

#: whether a remote-write request is being handled now
Busy = Callable[[], bool]


class _Budget:
    """What one piece of background work may wait for requests being relayed: while
    ``busy()``, ``DEFER_MAX_SECONDS`` per pause, ``budget`` seconds in all (on ``clock``)."""

    def __init__(self, busy: Busy | None, budget: float, clock: Callable[[], float]) -> None:
        self._busy = busy
        self._clock = clock
        self._until = clock() + budget

    def remaining(self) -> float:
        """Seconds of the budget left: what a later part of the same work is given, so
        that its parts together keep to one budget."""
        return max(0.0, self._until - self._clock())

    def _deadline(self) -> float | None:
        """Until when this pause may wait; None: not at all (nothing to ask whether a
        request is relayed, or the budget is spent)."""
        now = self._clock()
        if self._busy is None or now >= self._until:
            return None
        return min(now + DEFER_MAX_SECONDS, self._until)

    def _waits(self, deadline: float | None) -> bool:
        """Whether to wait on: a request is being relayed and the deadline is ahead."""
        return (deadline is not None and self._busy is not None and self._busy()
                and self._clock() < deadline)


class Pacer(_Budget):
    """The pauses of one piece of background work (one fact write, one page); made on
    the event loop, ``budget`` seconds of waiting for requests from now on."""

    def __init__(self, busy: Busy | None, budget: float) -> None:
        super().__init__(busy, budget, asyncio.get_running_loop().time)

    async def pause(self) -> None:
        """Let the loop run: while the budget lasts, a few turns and then, while a request
        is being relayed, a wait for it (``DEFER_MAX_SECONDS`` at most); else
        ``PAUSE_SECONDS`` of real time."""
        if self._deadline() is None:
            await asyncio.sleep(PAUSE_SECONDS)
            return
        for _ in range(ARRIVAL_TURNS):
            await asyncio.sleep(0)
        deadline = self._deadline()
        while self._waits(deadline):
            await asyncio.sleep(PAUSE_SECONDS)


#: a worker thread's work between two pauses: the event loop waits at most this long for
#: the GIL when a request arrives (the interpreter's own switch interval is 5 ms)
THREAD_STRETCH_SECONDS = 0.0005


class Abandoned(Exception):
    """Raised by a :class:`ThreadPacer` abandoned by its owner (the source stopping): the
    thread's work ends at its next pause. A thread cannot be cancelled, and the process
    waited at its exit for the pool's threads: a stop during a snapshot reload waited
    0.06-2.3 s for its read, one during the first load at 37.5k pods ~3.6 s."""


class ThreadPacer(_Budget):
    """The pauses of background work in a worker thread (a snapshot reload's read and
    diff): call it once per unit of work (an object); every ``THREAD_STRETCH_SECONDS``
    it pauses.

    A thread needs this as much as the loop does: its Python holds the GIL, and the loop
    and the splice workers each waited up to the switch interval (5 ms) for it, several
    times per request. During a 2.5 s reload at 37.5k pods requests took 60-180 ms and
    queued (docs/performance.md, "Ninth pass"). A pause hands the GIL over (a sleep
    releases it), and while the budget lasts and a request is being relayed, waits for
    it in ``PAUSE_SECONDS`` sleeps, at most ``DEFER_MAX_SECONDS`` per pause."""

    def __init__(self, busy: Busy | None, budget: float) -> None:
        super().__init__(busy, budget, time.monotonic)
        self._next = time.perf_counter() + THREAD_STRETCH_SECONDS
        self.abandoned = False

    def abandon(self) -> None:
        """From the event loop: the work is no longer wanted; its next call raises."""
        self.abandoned = True

    def __call__(self) -> None:
        if self.abandoned:
            raise Abandoned("abandoned: its owner stopped")
        if time.perf_counter() >= self._next:
            self.pause()
            self._next = time.perf_counter() + THREAD_STRETCH_SECONDS

    def pause(self) -> None:
        time.sleep(0)
        deadline = self._deadline()
        while self._waits(deadline):
            time.sleep(PAUSE_SECONDS)


#: the least a byte of a weighed run (:meth:`Slices.run`) is taken to cost: its JSON
#: decoded, and the object through the engine. A slimmed 4 KB pod costs ~4 ns a byte, a
#: 1.7 MB Argo Workflow evaluated by its description ~100; at this floor a 4 ms run holds
#: at most 2 MB of JSON, whatever cheaper items came before it
MIN_SECONDS_PER_BYTE = 2e-9


class Slices:
    """Runs of a piece of work sized to take about ``budget`` seconds each: the next run's
    size comes from the last one's cost, shrunk at once after a costly run, grown at most
    2x after a cheap one (a cost per item that varies, a description's status expressions
    or a 4 KB pod against a 1 KB one, is followed within a run or two).

    Items that differ in size by 1,000x (a watcher's: pods of 4 KB, Argo Workflows of
    1.7 MB, bookmarks of 100 bytes) are weighed too (``run``'s ``weight``, their bytes):
    a run also ends where its bytes would cost more than the budget at the last weighed
    run's cost per byte. By count alone, a list's first run was 64 items and a watcher's
    grew on bookmarks up to ``most``: the list of 10 Workflows of 1.66 MB held the event
    loop 1.8 s in one run.

    An instance keeps its size from one piece of work to the next: a watcher's from one
    batch of events to the next; a reload makes one of its own."""

    def __init__(self, budget: float, *, first: int = 64, most: int = 4096,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = budget
        self.most = most
        self._clock = clock
        #: items in the next run
        self.size = first
        #: seconds a byte of the last weighed run took (never under the floor)
        self.per_byte = MIN_SECONDS_PER_BYTE

    def run(self, n: int, step: Callable[[int, int], object],
            weight: Callable[[int], int] | None = None) -> Iterator[None]:
        """``step(i, j)`` over ``range(n)`` a run at a time, yielding after each run:
        where the caller lets the event loop in. ``weight(k)``: item ``k``'s size (its
        bytes); a run then also ends before the item that would take its bytes past
        what the budget buys (one item at least)."""
        i = 0
        while i < n:
            j = min(n, i + self.size)
            weighed = 0
            if weight is not None:
                room = self.budget / self.per_byte
                k = i
                while k < j:
                    w = weight(k)
                    if k > i and weighed + w > room:
                        break
                    weighed += w
                    k += 1
                j = k
            t0 = self._clock()
            step(i, j)
            elapsed = self._clock() - t0
            self.adapt(j - i, elapsed)
            if weighed > 0:
                self.per_byte = max(MIN_SECONDS_PER_BYTE, elapsed / weighed)
            i = j
            yield

    def adapt(self, n: int, elapsed: float) -> None:
        """Size the next run from this one: ``n`` items in ``elapsed`` seconds."""
        fit = int(self.budget * n / elapsed) if elapsed > 0 else self.most
        self.size = max(1, min(self.most, 2 * self.size, fit))


async def in_runs(n: int, step: Callable[[int, int], object], slices: Slices,
                  pacer: Pacer) -> None:
    """``step(i, j)`` over ``range(n)`` in the runs of ``slices``, with a pause of
    ``pacer`` after each: background work on the event loop that gives way to the
    requests being relayed (a configuration reload's re-attribution)."""
    for _ in slices.run(n, step):
        await pacer.pause()
