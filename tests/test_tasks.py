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
