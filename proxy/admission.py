"""Request slots with a short, bounded, first-come-first-served wait for one.

Under overload a refused sender retries, and each retry costs the proxy a refusal (its
headers parsed, its body received and dropped) and the sender a round trip; a sender
whose request arrives a few milliseconds before a slot frees would rather wait those
milliseconds. So a request that finds every slot taken may wait up to ``wait_seconds``
for one, in arrival order, before it is refused as before. What waits is the connection
and its parsed headers only: the connection stops reading (``proxy.connection_guard``),
so the body stays in the kernel's buffers, holds no budget, and no deadline that could
refuse a sender runs meanwhile (the body deadline starts once a slot is held).

Waiters are bounded (``max_waiters``); past them a request is refused at once. The
place is promised on the headers (``promise``, by the connection's shed hook, before the
handler runs and queues: otherwise every request parsed in one turn of the event loop
would be told to wait, and most refused later at a higher price). A freed
slot goes to the first waiter directly (the slot count does not drop, so a request
arriving at that moment cannot take it first). A waiter whose sender closed its
connection gives its place up: a reading-paused socket never reports its peer's close to
the event loop, so the waiters' sockets are polled for it (``POLLRDHUP``, one ``poll``
for all of them every ``SWEEP_SECONDS`` while any wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import select
from collections import deque
from dataclasses import dataclass

#: how often the waiters' sockets are checked for a sender that went away
SWEEP_SECONDS = 0.1
#: the peer closed (``POLLRDHUP`` is Linux's; elsewhere only a reset is seen)
_RDHUP = getattr(select, "POLLRDHUP", 0)
_GONE = _RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class Outcome(enum.Enum):
    """How a wait for a slot ended."""

    #: the request holds a slot (``leave`` it once answered)
    ADMITTED = "admitted"
    #: no slot within the wait, or no place to wait: refuse it
    REFUSED = "refused"
    #: the sender closed its connection while waiting: nothing to answer
    GONE = "gone"


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[Outcome]
    #: the connection's socket, polled for its peer's close (-1: not pollable)
    fd: int


class Slots:
    """``max_requests`` slots; ``try_enter`` never waits, ``enter`` waits its turn."""

    def __init__(self, max_requests: int, max_waiters: int, wait_seconds: float) -> None:
        self.max_requests = max_requests
        self.max_waiters = max_waiters
        self.wait_seconds = wait_seconds
        #: slots held
        self.requests = 0
        #: places in line promised to requests whose handler has not queued yet
        self.promised = 0
        self._waiters: deque[_Waiter] = deque()
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def full(self) -> bool:
        """Every slot is held (or promised to a waiter)."""
        return self.requests >= self.max_requests

    def may_wait(self) -> bool:
        """A request refused a slot now would get a place to wait for one."""
        return self.wait_seconds > 0 and len(self._waiters) + self.promised < self.max_waiters

    def promise(self) -> None:
        """Keep a place in line for a request whose handler is yet to ``enter``."""
        self.promised += 1

    def unpromise(self) -> None:
        """A promised place that will not be taken (refused first, or gone)."""
        self.promised -= 1

    def try_enter(self) -> bool:
        if self.requests >= self.max_requests:
            return False
        self.requests += 1
        return True

    async def enter(self, fd: int = -1, *, promised: bool = False) -> Outcome:
        """A slot now, or after waiting in line for at most ``wait_seconds``; ``fd``: the
        connection's socket, so that a sender that goes away gives up its place;
        ``promised``: the place was ``promise``d."""
        if promised:
            self.unpromise()
        if self.try_enter():
            return Outcome.ADMITTED
        if not self.may_wait():
            return Outcome.REFUSED
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), fd)
        self._waiters.append(waiter)
        expiry = loop.call_later(self.wait_seconds, _settle, waiter.future, Outcome.REFUSED)
        if fd >= 0 and self._sweep is None:
            self._sweep = loop.call_later(SWEEP_SECONDS, self._check_gone)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.result() is Outcome.ADMITTED:
                self.leave()  # handed a slot as it was cancelled: the next waiter's
            raise
        finally:
            expiry.cancel()
            if not waiter.future.done():
                waiter.future.cancel()
            with contextlib.suppress(ValueError):  # leave() took it off the line
                self._waiters.remove(waiter)

    def leave(self) -> None:
        """Give a slot up: to the first waiter still waiting, else back."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(Outcome.ADMITTED)
                return
        self.requests -= 1

    def _check_gone(self) -> None:
        self._sweep = None
        polled = [w for w in self._waiters if w.fd >= 0 and not w.future.done()]
        if not polled:
            return
        poller = select.poll()
        for w in polled:
            poller.register(w.fd, _RDHUP)
        gone = {fd for fd, events in poller.poll(0) if events & _GONE}
        for w in polled:
            if w.fd in gone:
                _settle(w.future, Outcome.GONE)
        self._sweep = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._check_gone)


def _settle(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)
