"""Stopping a real ``karta-proxy`` process a test started, as Kubernetes does."""

from __future__ import annotations

import asyncio
import signal


async def stop(proc: asyncio.subprocess.Process, timeout: float = 20) -> str:
    """SIGTERM the process unless it already ended, wait for it, and give its log
    (stderr): called from a ``finally``, so a test that failed still stops its process,
    and the exit status is left for the caller to assert after the block."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), timeout)
    return err.decode()
