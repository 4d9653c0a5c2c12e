"""A deadline that does not end a call whose answer came while the process was stopped.

``asyncio.timeout_at`` cancels at the first turn of the event loop that runs past its
time. When the process was stopped (SIGSTOP, a cgroup freezer, a debugger) or the loop
was blocked across that time, the first turn after it runs both the deadline and the I/O
that arrived meanwhile, and the deadline wins:

- stopped while waiting for I/O (``epoll_wait``), the wait's own timeout runs out during
  the stop, so at the resume it returns with no event, and the deadline, due by then,
  cancels the call in that turn; the answer is read only in the next one;
- blocked in a callback, the next turn reads the answer first, but the call's task
  resumes a turn later (a future's callbacks are scheduled, not run), and the deadline,
  run in between, cancels it.

Either way a sender's batch the upstream had stored was answered 504 and sent again (a
second copy on VictoriaMetrics without deduplication), and a stored fact write was
counted as failed. Audited with SIGSTOP: a 35 s stop against the upstream's 25 s
deadline, 3 of 3 (docs/operations.md, "A paused replica").

:class:`Deadline` acts at the same time as ``asyncio.timeout_at`` but, when the loop
reaches it :data:`LATE_SECONDS` or more late, first gives the call :data:`LOOK_SECONDS`
more, at most :data:`MAX_LOOKS` times: time for what already arrived to be read, not
time for the other side to answer. A late deadline is rare (nothing else makes the loop
half a second late), so the grace costs nothing otherwise, and the longest a deadline can
be extended is bounded (``MAX_LOOKS * LOOK_SECONDS``, each only after a stall).

Not for a deadline that must hold across a stop: a lease's renew deadline ends the
leadership *because* the process may have been stopped past it (``proxy.lease``).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: a deadline the loop runs this much past its time was held up (a stop, a blocked loop),
#: not merely reached: ordinary turns of a loaded loop are late by milliseconds
LATE_SECONDS = 0.25
#: what a held-up deadline gives the call before it ends it: enough turns of the loop
#: for an answer already in the socket to be read, parsed and handed to its task, with a
#: backlog after a long stop (3,000 buffered pod updates took 36 ms after a resume)
LOOK_SECONDS = 1.0
#: the most looks one deadline gives: a loop held up again during each (stop after stop)
#: still ends the call
MAX_LOOKS = 3


class Deadline:
    """``asyncio.timeout_at(when)`` that looks at what arrived before it ends a call the
    loop reached it late for (module docstring). Raises ``TimeoutError`` on the way out
    when it ended the call; a cancellation from elsewhere stays a ``CancelledError``."""

    __slots__ = ("_handle", "_looks", "_timeout", "_when")

    def __init__(self, when: float) -> None:
        #: the event loop's time the call ends at (moved by a look)
        self._when = when
        #: the stdlib's, never scheduled itself: it does the cancelling and the uncancel
        #: bookkeeping that tell this deadline's cancellation from another
        self._timeout = asyncio.timeout_at(None)
        self._handle: asyncio.TimerHandle | None = None
        #: the looks given so far
        self._looks = 0

    @property
    def looks(self) -> int:
        """How many times it found itself late and gave the call more time."""
        return self._looks

    def expired(self) -> bool:
        """It ended the call (as ``asyncio.Timeout.expired``)."""
        return self._timeout.expired()

    async def __aenter__(self) -> Deadline:
        await self._timeout.__aenter__()
        loop = asyncio.get_running_loop()
        self._handle = loop.call_at(self._when, self._due, loop)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when expired

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if now - self._when >= LATE_SECONDS and self._looks < MAX_LOOKS:
            self._looks += 1
            self._when = now + LOOK_SECONDS
            self._handle = loop.call_at(self._when, self._due, loop)
            return
        self._handle = None
        self._timeout.reschedule(now)  # cancels the task in the next turn


def deadline_in(seconds: float) -> Deadline:
    """A :class:`Deadline` ``seconds`` from now on the running loop's clock."""
    return Deadline(asyncio.get_running_loop().time() + seconds)
