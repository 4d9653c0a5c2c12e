"""An auxiliary server binds a free port, answers there, and stops once however often told."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from proxy.aux_server import AuxServer


class Hello(AuxServer):
    async def start(self) -> str:
        async def hello(_: web.Request) -> web.Response:
            return web.Response(text="hello")

        app = web.Application()
        app.router.add_get("/", hello)
        return f"http://127.0.0.1:{await self.serve(app, '127.0.0.1', 0)}/"


async def test_serves_on_the_bound_port_until_stopped() -> None:
    server = Hello()
    url = await server.start()
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.get(url) as r:
            assert (r.status, await r.text()) == (200, "hello")
        await server.stop()
        await server.stop()  # a second stop is a no-op
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(url)


async def test_async_with_starts_and_stops() -> None:
    async with Hello() as server:
        assert server._runner is not None
    assert server._runner is None
