"""cancel_and_wait ends a running loop, and is a no-op without one."""

from __future__ import annotations

import asyncio

from proxy.tasks import cancel_and_wait


async def test_a_running_loop_is_cancelled_and_awaited() -> None:
    ended = asyncio.Event()

    async def loop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # let it start
    await asyncio.wait_for(cancel_and_wait(task), 2.0)
    assert task.cancelled() and ended.is_set()


async def test_none_and_a_finished_task_are_fine() -> None:
    await cancel_and_wait(None)

    async def done() -> None:
        return None

    task = asyncio.create_task(done())
    await task
    await cancel_and_wait(task)
    assert task.done() and not task.cancelled()


async def test_the_callers_own_cancel_is_not_swallowed() -> None:
    """The caller cancelled while it waits for the task's end: cancelled (it returned, and
    a loop stopping while it stopped a task of its own ran on)."""
    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # a cleanup under way when the caller is cancelled

    task = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    caller = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.05)  # the caller waits for the cleanup
    caller.cancel()
    await asyncio.wait({caller}, timeout=2)
    assert caller.cancelled()
    assert task.done()
