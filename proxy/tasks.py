"""Ending the proxy's background loops (file watchers, pollers) on the way out.

A cancelled loop raises ``CancelledError`` into whoever awaits it; ``stop()`` methods want
the loop gone and nothing raised, however often they are called.
"""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended, swallowing its cancellation."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
