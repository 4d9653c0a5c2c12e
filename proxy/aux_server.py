"""The small HTTP servers around the proxy: the demo's receiver, the demo exporter, and
the tests' scripted upstream. Not the proxy's own listener (``proxy.server``).

Each serves one aiohttp application on one port (0: a free one, as tests need) and is
started and stopped, or used with ``async with``; starting, finding the bound port through
the runner's public ``addresses`` and stopping are written here once.
"""

from __future__ import annotations

import ssl
from typing import Any, Self

from aiohttp import web


class AuxServer:
    """Serve an application with ``serve`` from ``start``; ``stop`` may be called twice."""

    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Serve, and return the URL to reach it at."""
        raise NotImplementedError

    async def serve(self, app: web.Application, host: str, port: int, *,
                    ssl_context: ssl.SSLContext | None = None, **runner_options: Any) -> int:
        """Serve ``app`` on ``host:port``; returns the bound port. ``runner_options`` go to
        ``web.AppRunner`` (access logs are off)."""
        runner = web.AppRunner(app, access_log=None, **runner_options)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        return next(a[1] for a in runner.addresses if isinstance(a, tuple))

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
