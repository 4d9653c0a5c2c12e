"""How often the event loop turned while something ran: work said to leave the loop free
(a worker thread, a paced or sliced run) must let it turn."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class LoopTurns:
    """``async with LoopTurns() as t: ...``; ``t.turns`` counts the loop's turns so far
    (a task sleeping ``interval`` each time), readable from another thread meanwhile."""

    def __init__(self, interval: float = 0.0) -> None:
        self.turns = 0
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _tick(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(self._interval)
