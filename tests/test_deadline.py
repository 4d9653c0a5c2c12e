"""proxy.deadline: a deadline the loop reached late looks at what arrived before it ends
the call; on time, or with nothing arriving, it ends it as ``asyncio.timeout_at`` does.

The stall is a callback that blocks the loop (``time.sleep``) while a thread writes the
"answer" into a socket the call reads: the same race as a stopped process (the deadline
and the answer both due in the first turn after it), without a second process."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

from proxy import deadline as deadline_mod
from proxy.deadline import LATE_SECONDS, LOOK_SECONDS, MAX_LOOKS, Deadline, deadline_in

#: the call's deadline, from its start
DUE = 0.1
#: how long the loop is held up: well past the deadline, and past LATE_SECONDS
STALL = DUE + LATE_SECONDS + 0.2
#: when the "answer" arrives, from the start: during the stall, after the deadline
ANSWER_AT = DUE + 0.1


@asynccontextmanager
async def _pair() -> AsyncIterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _answer_later(b: socket.socket, delay: float) -> threading.Thread:
    def answer() -> None:
        time.sleep(delay)
        b.sendall(b"204")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return t


async def _stalled_call(timer: Callable[[float], AbstractAsyncContextManager[object]]
                        ) -> bytes:
    """A read of the answer under ``timer(due)`` while the loop is held up across the
    deadline and the answer arrives during the hold-up."""
    loop = asyncio.get_running_loop()
    async with _pair() as (a, b):
        thread = _answer_later(b, ANSWER_AT)
        loop.call_soon(time.sleep, STALL)  # runs once the read below waits
        try:
            async with timer(loop.time() + DUE):
                return await loop.sock_recv(a, 16)
        finally:
            thread.join(5)


async def test_an_answer_that_came_during_a_stall_is_read() -> None:
    assert await _stalled_call(Deadline) == b"204"


async def test_the_stdlib_deadline_ends_that_call() -> None:
    """Why the module exists: ``asyncio.timeout_at`` ends the same call although its
    answer sits in the socket (if it ever stops doing so, the module can go)."""
    with pytest.raises(TimeoutError):
        await _stalled_call(asyncio.timeout_at)


async def test_on_time_it_ends_the_call_as_the_stdlib_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No look for a deadline reached on time (a lateness threshold far above what a
    loaded test machine's loop shows, and a look so long that one would show)."""
    monkeypatch.setattr(deadline_mod, "LATE_SECONDS", 2.0)
    monkeypatch.setattr(deadline_mod, "LOOK_SECONDS", 30.0)
    loop = asyncio.get_running_loop()
    async with _pair() as (a, _b):
        began = loop.time()
        with pytest.raises(TimeoutError):
            async with deadline_in(DUE) as d:
                await loop.sock_recv(a, 16)
    took = loop.time() - began
    assert d.expired() and d.looks == 0
    assert DUE <= took < 2.0, took


async def test_a_late_deadline_with_nothing_arriving_still_ends_the_call() -> None:
    """A stall gives a look, not a reprieve: with no answer the call ends LOOK_SECONDS
    after the stall."""
    loop = asyncio.get_running_loop()
    async with _pair() as (a, _b):
        began = loop.time()
        loop.call_soon(time.sleep, STALL)
        with pytest.raises(TimeoutError):
            async with deadline_in(DUE) as d:
                await loop.sock_recv(a, 16)
    took = loop.time() - began
    assert d.expired() and d.looks >= 1  # another only if the look itself was held up
    assert STALL + LOOK_SECONDS <= took < STALL + (MAX_LOOKS + 1) * LOOK_SECONDS, took


async def test_stall_after_stall_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each look held up again gives another, MAX_LOOKS at most: the call still ends."""
    monkeypatch.setattr(deadline_mod, "LOOK_SECONDS", 0.05)
    loop = asyncio.get_running_loop()
    stalls = 0

    def hold_up() -> None:  # every turn's timers run late, as long as this keeps going
        nonlocal stalls
        if stalls < MAX_LOOKS + 2:
            stalls += 1
            time.sleep(LATE_SECONDS + 0.05)
            loop.call_later(0.01, hold_up)

    async with _pair() as (a, _b):
        loop.call_soon(hold_up)
        with pytest.raises(TimeoutError):
            async with deadline_in(0.01) as d:
                await loop.sock_recv(a, 16)
    assert d.expired() and d.looks == MAX_LOOKS


async def test_an_answer_in_time_cancels_the_timer() -> None:
    loop = asyncio.get_running_loop()
    async with _pair() as (a, b):
        b.sendall(b"ok")
        async with deadline_in(DUE) as d:
            assert await loop.sock_recv(a, 16) == b"ok"
        await asyncio.sleep(DUE + 0.05)  # a timer left behind would cancel this sleep
    assert not d.expired()


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    """A stop (the task cancelled) during the call is not turned into a TimeoutError."""
    loop = asyncio.get_running_loop()
    async with _pair() as (a, _b):
        async def call() -> None:
            async with deadline_in(10):
                await loop.sock_recv(a, 16)

        task = asyncio.create_task(call())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_cancel_from_elsewhere_after_it_expired_stays_a_cancel() -> None:
    """As the stdlib's: a cancel that came beside the deadline's is passed on."""
    loop = asyncio.get_running_loop()
    async with _pair() as (a, _b):
        async def call() -> None:
            async with deadline_in(0):
                try:
                    await loop.sock_recv(a, 16)
                finally:
                    asyncio.current_task().cancel()  # type: ignore[union-attr]

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(call())
