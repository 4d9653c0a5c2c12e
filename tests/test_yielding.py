"""proxy.yielding: how background work on the event loop pauses for relayed requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

from proxy import yielding
from proxy.yielding import Pacer


async def _turns_during(coro: Awaitable[None]) -> int:
    """How many turns the event loop made while ``coro`` (awaited) ran."""
    turns = 0
    done = False

    async def ticker() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        await coro
    finally:
        done = True
        await task
    return turns


async def test_with_nothing_relayed_a_pause_is_turns_not_time() -> None:
    pacer = Pacer(lambda: False, budget=10.0)
    started = time.monotonic()
    turns = await _turns_during(pacer.pause())
    assert time.monotonic() - started < yielding.PAUSE_SECONDS
    assert turns >= yielding.ARRIVAL_TURNS - 1


async def test_while_a_request_is_relayed_a_pause_waits_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    relaying = True
    pacer = Pacer(lambda: relaying, budget=10.0)
    task = asyncio.create_task(pacer.pause())
    await asyncio.sleep(0.05)
    assert not task.done()
    relaying = False
    await asyncio.wait_for(task, 1.0)


async def test_a_pause_waits_at_most_so_long_and_the_work_at_most_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 0.02)
    pacer = Pacer(lambda: True, budget=0.1)
    started = time.monotonic()
    await asyncio.wait_for(pacer.pause(), 1.0)  # always busy: one pause, <= 20 ms
    assert 0.015 <= time.monotonic() - started < 0.5
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    started = time.monotonic()
    await asyncio.wait_for(pacer.pause(), 1.0)  # the rest of the budget, not 30 s
    await asyncio.wait_for(pacer.pause(), 1.0)  # past it: PAUSE_SECONDS
    assert time.monotonic() - started < 0.5


async def test_without_busy_a_pause_is_real_time() -> None:
    pacer = Pacer(None, budget=10.0)
    started = time.monotonic()
    await pacer.pause()
    assert time.monotonic() - started >= yielding.PAUSE_SECONDS * 0.9
