"""Ending the proxy's background tasks (file watchers, pollers, watches) on the way out.

A cancelled loop raises ``CancelledError`` into whoever awaits it; ``stop()`` methods want
the loop gone and nothing raised, however often they are called.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended, swallowing its cancellation,
    not the caller's: cancelled itself while it waits, the caller is cancelled. Both were
    swallowed: a KubeSource's follower stopped while it dropped a watcher (waiting here
    for the watcher's task) went on to wait for the next change, and ``stop`` waited for
    it for good (2 stops in 80 with descriptions churning)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise
