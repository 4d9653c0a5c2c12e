"""The baseline relay: decompress, recompress, forward, nothing else.

Same HTTP stack as karta-proxy (aiohttp server without access log or automatic
decompression, one pooled aiohttp client session to the upstream), the same codec
library (python-snappy) and the same allocator thresholds (``proxy.memory``: freed
request buffers stay in the heap), so that the ratio karta-proxy / pass-through isolates
what enrichment costs on top of merely being a Python remote-write relay. Without the
thresholds, its CPU per paced request tripled in some runs with the relays paced
together (3.7 -> 10.3-11.3 ms), and in none with them (docs/performance.md, "Thirteenth
pass").

    python passthrough.py --listen 127.0.0.1:PORT --upstream-url http://127.0.0.1:P/api/v1/write
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import aiohttp
import snappy
from aiohttp import web

_FORWARDED = ("Content-Type", "Content-Encoding", "X-Prometheus-Remote-Write-Version", "User-Agent")


class PassThrough:
    def __init__(self, upstream_url: str) -> None:
        self._url = upstream_url
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64),
            timeout=aiohttp.ClientTimeout(total=30),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def write(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            raw = snappy.uncompress(body)
        except Exception as exc:
            return web.Response(status=400, text=f"bad snappy body: {exc}")
        out = snappy.compress(raw)
        headers = {h: request.headers[h] for h in _FORWARDED if h in request.headers}
        assert self._session is not None
        try:
            async with self._session.post(self._url, data=out, headers=headers) as resp:
                text = await resp.read()
                return web.Response(status=resp.status, body=text or None)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return web.Response(status=503, text=f"upstream: {exc}")


async def serve(host: str, port: int, upstream_url: str) -> None:
    relay = PassThrough(upstream_url)
    await relay.start()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/api/v1/write", "/api/v1/push", "/api/v1/receive"):
        app.router.add_post(path, relay.write)
    app.router.add_get("/-/ready", lambda _: _ok())
    runner = web.AppRunner(app, access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=256)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await relay.close()


async def _ok() -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    from proxy.memory import keep_request_buffers

    keep_request_buffers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--upstream-url", required=True)
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port), args.upstream_url))


if __name__ == "__main__":
    main()
