"""What the HTTP layers cost the event loop thread per remote-write request: aiohttp's
server and client against the floor of a minimal keep-alive HTTP/1.1 exchange over
asyncio's transports, for a body of a 2,000-series request.

Issue #8's last two targets (2 cores >= 1.7x 1 core, CPU <= 1.3x the pass-through) are
held by karta-proxy's event loop thread: ~0.8 ms of a 2,000-series request's ~3.6 ms of
CPU, a serial share that bounds two cores at ~1.64x (docs/performance.md, "Issue #8,
where it stands"). Its splice, compression and decompression are already in worker
threads; what is left on that thread is mostly the HTTP server taking the request and
the HTTP client sending it on. This benchmark says how much of that a leaner HTTP layer
could take away, before anyone writes one:

- **client**: CPU of the calling thread (``time.thread_time``) per POST of the body to a
  raw 204 sink in another process, over one pooled keep-alive connection, for
  ``Upstream.forward`` (the product's whole send: headers, deadline, counts, and its
  client, ``proxy.upstream_http``), a bare ``aiohttp.ClientSession`` as ``Upstream``
  configured it before it had its own client, and a minimal client (one
  ``asyncio.Protocol``: the request head and body written, the answer's head read);
- **server**: CPU of a server process per request taken (its ``/proc`` CPU over the
  requests), for an ``aiohttp.web`` handler reading the body and answering 204, and a
  minimal server (one ``asyncio.Protocol``: head parsed, ``Content-Length`` bytes read,
  204 written), the requests sent by the minimal client of this process.

The minimal ones are floors, not products: no chunked bodies, no limits, no TLS, no
errors; a real replacement costs more than they do. Rounds alternate the variants;
printed are medians over the rounds and the ratios to the floors.

    python benchmarks/http_layer_bench.py [--requests 2000] [--rounds 5]
                                          [--body-bytes 300000] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.procs import cpu_seconds, free_port
from relay.workdir import results_path

from proxy.config import UpstreamSettings
from proxy.upstream import Outgoing, Upstream
from proxy.wire.primitives import Protocol

#: requests before each measured stretch (connections made, caches and code warm)
WARMUP = 200
_RW1_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}
_NO_CONTENT = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"


class _RawServer(asyncio.Protocol):
    """The floor of a server: the head's ``Content-Length``, that many bytes, a 204."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._buf[:end]).lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:head.find(b"\r\n", at) if b"\r\n" in head[at:] else None])
            if len(self._buf) < end + 4 + length:
                return
            del self._buf[:end + 4 + length]
            assert self._transport is not None
            self._transport.write(_NO_CONTENT)


async def _serve(kind: str, port: int) -> None:
    if kind == "raw":
        server = await asyncio.get_running_loop().create_server(_RawServer, "127.0.0.1", port)
        await server.serve_forever()
        return

    async def write(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=204)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/api/v1/write", write)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


class _RawClient(asyncio.Protocol):
    """The floor of a client: one request at a time on one connection, the answer's head
    read (a 204 has no body)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.answer: asyncio.Future[bytes] | None = None

    def data_received(self, data: bytes) -> None:
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end >= 0 and self.answer is not None:
            head = bytes(self._buf[:end])
            del self._buf[:end + 4]
            self.answer.set_result(head)
            self.answer = None


Send = Callable[[], Awaitable[None]]


async def _raw_sender(port: int, body: bytes) -> tuple[Send, Callable[[], None]]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(_RawClient, "127.0.0.1", port)
    fixed = "".join(f"{k}: {v}\r\n" for k, v in _RW1_HEADERS.items())

    async def send() -> None:
        proto.answer = loop.create_future()
        head = (f"POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{fixed}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        transport.writelines((head, body))
        answer = await proto.answer
        if answer[9:12] != b"204":
            raise RuntimeError(f"sink answered {answer[:40]!r}")

    return send, transport.close


async def _aiohttp_sender(port: int, body: bytes) -> tuple[Send, Callable[[], None]]:
    # the session as ``Upstream.start`` made it before the proxy's own client
    # (``proxy.upstream_http``): the reference that client is measured against
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=30.0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    url = f"http://127.0.0.1:{port}/api/v1/write"

    async def send() -> None:
        resp = await session.post(url, data=body, headers=_RW1_HEADERS, allow_redirects=False)
        async with resp:
            await resp.content.read(4096)
            if resp.status != 204:
                raise RuntimeError(f"sink answered {resp.status}")

    def close() -> None:
        asyncio.get_running_loop().create_task(session.close())

    return send, close


async def _upstream_sender(port: int, body: bytes) -> tuple[Send, Callable[[], None]]:
    upstream = Upstream(UpstreamSettings(url=f"http://127.0.0.1:{port}/api/v1/write",
                                         protocol="v1", max_connections=1))
    await upstream.start()
    out = Outgoing(Protocol.V1, "snappy", body)

    async def send() -> None:
        answer = await upstream.forward(out, _RW1_HEADERS)
        if answer.status != 204:
            raise RuntimeError(f"sink answered {answer.status}: {answer.body[:200]!r}")

    def close() -> None:
        asyncio.get_running_loop().create_task(upstream.close())

    return send, close


SENDERS: dict[str, Callable[[int, bytes], Awaitable[tuple[Send, Callable[[], None]]]]] = {
    "Upstream.forward": _upstream_sender,
    "aiohttp client": _aiohttp_sender,
    "minimal client": _raw_sender,
}


def _start_server(kind: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)],
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            asyncio.run(_probe(port))
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{kind} server did not listen on {port}")


async def _probe(port: int) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.close()
    await writer.wait_closed()


async def _client_ms(sender: str, port: int, body: bytes, requests: int) -> float:
    """Calling-thread CPU ms per request of ``sender``."""
    send, close = await SENDERS[sender](port, body)
    try:
        for _ in range(WARMUP):
            await send()
        started = time.thread_time()
        for _ in range(requests):
            await send()
        return (time.thread_time() - started) / requests * 1e3
    finally:
        close()
        await asyncio.sleep(0)


async def _server_ms(pid: int, port: int, body: bytes, requests: int) -> float:
    """Server-process CPU ms per request, sent by the minimal client. ``/proc`` counts
    CPU in clock ticks (10 ms): 2,000 requests at ~0.07 ms are ~14 of them, so a round
    of fewer requests reads coarsely (and a tiny one may read 0)."""
    send, close = await _raw_sender(port, body)
    try:
        for _ in range(WARMUP):
            await send()
        started = cpu_seconds(pid)
        for _ in range(requests):
            await send()
        return (cpu_seconds(pid) - started) / requests * 1e3
    finally:
        close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests a round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--body-bytes", type=int, default=300_000,
                   help="the body's size (a 2,000-series high-cardinality request, snappy, "
                        "is ~250-350 kB)")
    p.add_argument("--json", type=results_path, help="write the figures here")
    p.add_argument("--serve", choices=("raw", "aiohttp"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.port))
        return 0
    body = os.urandom(args.body_bytes)  # the layers never read it: compressibility is moot
    client: dict[str, list[float]] = {name: [] for name in SENDERS}
    server: dict[str, list[float]] = {"aiohttp server": [], "minimal server": []}
    sink, sink_port = _start_server("raw")
    servers = {"aiohttp server": _start_server("aiohttp"), "minimal server": (sink, sink_port)}
    try:
        for r in range(args.rounds):
            for name in SENDERS:
                client[name].append(
                    asyncio.run(_client_ms(name, sink_port, body, args.requests)))
            for name, (proc, port) in servers.items():
                server[name].append(
                    asyncio.run(_server_ms(proc.pid, port, body, args.requests)))
            print(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1]:.3f}" for k, v in {**client, **server}.items()),
                  flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    med = {k: statistics.median(v) for k, v in {**client, **server}.items()}
    print(f"\nCPU ms per request of {args.body_bytes:,} bytes, median of {args.rounds} rounds "
          f"of {args.requests:,} requests (keep-alive, one connection):")
    for name, floor in (("Upstream.forward", "minimal client"),
                        ("aiohttp client", "minimal client"),
                        ("aiohttp server", "minimal server")):
        ratio = f"{med[name] / med[floor]:.1f}x" if med[floor] > 0 else "n/a"
        print(f"  {name:18} {med[name]:6.3f}  ({ratio} the {floor}'s "
              f"{med[floor]:.3f}; {med[name] - med[floor]:+.3f} ms)")
    saved = (med["Upstream.forward"] - med["minimal client"]
             + med["aiohttp server"] - med["minimal server"])
    print(f"  at most {saved:.3f} ms a request a leaner HTTP layer could take off the "
          "event loop thread (both floors reached)")
    if args.json:
        args.json.write_text(json.dumps({"body_bytes": args.body_bytes,
                                         "requests": args.requests, "median_ms": med,
                                         "rounds_ms": {**client, **server}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
