"""Talking to a running proxy over raw loopback sockets, as hostile or broken senders do
(stalled bodies, slow headers, pipelined requests, ``Expect: 100-continue``) where an HTTP
client would not let a test: a request written byte for byte, its answer read back with
whether the proxy closed the connection after it, and a proxy whose one request slot is
held. Shared by the admission and connection-guard tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import snappy

from proxy.runtime import Proxy
from tests.proxy_harness import CT_V1, metric, proxy_running, series_v1
from tests.scripted import Reply, ScriptedUpstream

HEAD = ("POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {CT_V1}\r\nContent-Encoding: snappy\r\n")
BODY = snappy.compress(series_v1({"__name__": "up", "job": "a"}))


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    #: bytes seen before the final status line (a ``100 Continue``)
    interim: bytes
    #: the proxy closed the connection after the answer
    closed: bool


async def read_answer(reader: asyncio.StreamReader, timeout: float = 5.0, *,
                      head_only: bool = False) -> Answer:
    """The answer to a request written on ``reader``'s connection; ``head_only``: the
    request was a HEAD (a ``Content-Length`` and no body)."""
    async with asyncio.timeout(timeout):
        interim = b""
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 1"):
                interim += head
                continue
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        body = b"" if head_only else await reader.readexactly(
            int(headers.get("content-length", "0")))
        closed = False
        if headers.get("connection", "").lower() == "close":
            try:
                async with asyncio.timeout(2.0):
                    closed = await reader.read(1) == b""
            except (TimeoutError, ConnectionError):
                closed = False
    return Answer(status, headers, body, interim, closed)


async def connect(p: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def post(p: Proxy, body: bytes = BODY) -> Answer:
    r, w = await connect(p)
    try:
        w.write((HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        return await read_answer(r)
    finally:
        w.close()


def request(body: bytes = BODY, extra: str = "") -> bytes:
    return (HEAD + extra + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def inflight(p: Proxy, n: int, *, timeout: float = 15.0) -> None:
    """Until ``n`` requests are in flight in the proxy (its headers read, a slot taken):
    waited for, not slept for, however loaded the machine."""
    deadline = loop_time() + timeout
    while metric(p, "karta_proxy_inflight_requests") != n:
        if loop_time() > deadline:
            raise AssertionError(
                f"{metric(p, 'karta_proxy_inflight_requests')} requests in flight, "
                f"expected {n}")
        await asyncio.sleep(0.01)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


async def holding_the_slot(p: Proxy) -> asyncio.Task[Answer]:
    """A request that holds the one slot for the upstream's first answer (give it a
    ``gate`` to hold it for as long as the test needs)."""
    holder = asyncio.create_task(post(p))
    await inflight(p, 1)
    return holder


@dataclass
class SlotTaken:
    """A proxy with one slot, held by ``holder`` until the test sets ``release``."""

    proxy: Proxy
    upstream: ScriptedUpstream
    holder: asyncio.Task[Answer]
    release: asyncio.Event

    async def freed(self) -> Answer:
        """The holder let go: its answer."""
        self.release.set()
        return await self.holder


@contextlib.asynccontextmanager
async def slot_taken(tmp_path: Path, *, wait: float, **server: Any
                     ) -> AsyncIterator[SlotTaken]:
    """The one slot held by a request the upstream answers only once ``release`` is set
    (not after a delay the test's next steps had to fit in: a loaded machine took longer,
    the slot came free too soon, and the tests flaked); every later request answered at
    once."""
    release = asyncio.Event()
    async with (
        ScriptedUpstream(Reply(204, gate=release), Reply(204)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=wait,
                      **server) as p,
    ):
        try:
            yield SlotTaken(p, up, await holding_the_slot(p), release)
        finally:
            release.set()  # a failed test's holder is not left hanging on the upstream
