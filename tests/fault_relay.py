"""A fault-injecting TCP relay on 127.0.0.1 between the proxy's client and a real
receiver, for the ways an exchange can end with the two sides disagreeing: the answer
lost after the receiver took the request, the connection reset inside the body, an answer
held back, an idle keep-alive connection closed by the upstream (a load balancer, Go's
``http.Server`` ``IdleTimeout``, VictoriaMetrics' ``-http.idleConnTimeout``).

It reads HTTP/1.1 requests and answers off the wire by their lengths (``Content-Length``,
chunked answers, bodiless statuses), so each request is known by its place and body, and
the fault for it is chosen by ``plan``; what it did is kept in ``events``. A reset is a
real one (``SO_LINGER`` 0: an RST, not a FIN), as a crashed peer or a middlebox sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

#: what may happen to one request
PASS = "pass"
#: the whole request reaches the receiver and its whole answer the relay; then the client's
#: connection is reset: the receiver has it, the client never hears
LOSE_ANSWER = "lose_answer"
#: the request head and half the body reach the receiver, then both connections are
#: reset: the receiver never has a whole request
RESET_IN_BODY = "reset_in_body"
#: the request head reaches the relay and the connection is closed (a FIN) without a byte
#: passed on: an idle close that crossed the request on the wire
CLOSE_AT_REQUEST = "close_at_request"
#: the answer's head reaches the client, then its connection is reset before the body
CUT_ANSWER = "cut_answer"


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str = PASS
    #: seconds the receiver's answer is held before it goes on (any kind that answers)
    delay: float = 0.0


@dataclass(slots=True)
class Event:
    """One request through the relay: its place, size, fault, and the receiver's status
    (0: the receiver gave none, or was never asked)."""

    index: int
    body_bytes: int
    fault: str
    status: int = 0


#: the plan: (index of the request through the relay, its body) -> what happens to it
Plan = Callable[[int, bytes], Fault]

#: bodies up to this size carry no series (the proxy's empty check write: 1 byte)
EMPTY_BODY = 16


def on_writes(faults: dict[int, Fault], every: dict[int, Fault] | None = None) -> Plan:
    """A plan by the writes that carry data (0-based; empty writes pass): ``faults`` for
    the write of that number, ``every`` for each n-th (``{3: f}``: writes 2, 5, 8, ...)."""
    count = [0]

    def plan(index: int, body: bytes) -> Fault:
        if len(body) <= EMPTY_BODY:
            return Fault()
        n, count[0] = count[0], count[0] + 1
        if n in faults:
            return faults[n]
        return next((f for k, f in (every or {}).items() if (n + 1) % k == 0), Fault())

    return plan


_BODILESS = (204, 304)


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def _read_body(reader: asyncio.StreamReader, head: bytes, status: int = 0) -> bytes:
    """The body after ``head``, as it was on the wire (chunks and all)."""
    if status in _BODILESS or 100 <= status < 200:
        return b""
    length = _header(head, b"content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    if (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        out = b""
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            out += line + await reader.readexactly(size + 2)
            if size == 0:
                return out
    return b"" if not status else await reader.read()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``'s connection with an RST."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultRelay:
    """Relay connections on a free port to ``target`` (host, port), with the faults
    ``plan`` chooses. ``idle_close``: a client connection with no request for this many
    seconds since its last answer (or its start) is closed, as an upstream closes idle
    keep-alive connections (a FIN, not an RST)."""

    def __init__(self, target: tuple[str, int], plan: Plan | None = None, *,
                 idle_close: float | None = None) -> None:
        self.target = target
        self.plan: Plan = plan or (lambda index, body: Fault())
        self.idle_close = idle_close
        self.events: list[Event] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, path: str = "/api/v1/write") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """A task of the relay's own per connection (not asyncio's, whose callback on
        Python 3.11 raises when the task it made was cancelled): cancelled at exit."""
        task = asyncio.create_task(self._serve(client_r, client_w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
            while True:
                try:
                    async with asyncio.timeout(self.idle_close):
                        head = await _read_head(client_r)
                except TimeoutError:
                    return
                body = await _read_body(client_r, head)
                event = Event(len(self.events), len(body), PASS)
                fault = self.plan(event.index, body)
                event.fault = fault.kind
                self.events.append(event)
                if fault.kind == CLOSE_AT_REQUEST:
                    return
                if fault.kind == RESET_IN_BODY:
                    up_w.write(head + body[:len(body) // 2])
                    await up_w.drain()
                    await asyncio.sleep(0.05)  # the half is read before the reset
                    reset(up_w)
                    reset(client_w)
                    return
                up_w.write(head + body)
                await up_w.drain()
                answer = await _read_head(up_r)
                event.status = int(answer.split(b" ", 2)[1])
                answer += await _read_body(up_r, answer, event.status)
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                if fault.kind == LOSE_ANSWER:
                    reset(client_w)
                    return
                if fault.kind == CUT_ANSWER:
                    client_w.write(answer[:answer.index(b"\r\n\r\n") + 4])
                    await client_w.drain()
                    await asyncio.sleep(0.05)
                    reset(client_w)
                    return
                client_w.write(answer)
                await client_w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            for w in (client_w, up_w):
                if w is not None and not w.transport.is_closing():
                    w.close()
