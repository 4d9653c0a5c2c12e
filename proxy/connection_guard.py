"""What a connection gets before the handler sees a request: a deadline on the request
line and headers, which aiohttp's server does not have, and overload shedding on the
headers alone, at the cost of a canned answer.

**Header deadline.** aiohttp closes a connection only after ``keepalive_timeout`` (an
hour by default) of silence, and a connection that sends half a request line and then one
byte a minute is never silent: thousands of them hold sockets and parser buffers for as
long as their sender likes (slowloris). Here the request line and headers must be complete
within ``header_timeout`` seconds of the connection's start, or of the first byte after
the previous request's body; otherwise the connection gets a 408 and is closed. Idle time
between keep-alive requests is not counted (that is ``keepalive_timeout``'s), nor is the
body (the handler bounds that: ``server.body_read_timeout_seconds``).

**Shedding.** Under overload the event loop is the bottleneck: at 2x more connections
than request slots it was ~93% busy while the worker threads idled, and every refusal
that went through aiohttp's request machinery (a ``Request``, a task, the handler, a
``Response``, its headers) was loop time taken from the admitted requests. So the parser
is wrapped: when a request's headers are parsed and the server's ``shed`` hook says it
would be refused for overload, aiohttp never sees it. The connection writes the canned
answer the hook returns (503 + ``Retry-After`` + ``Connection: close``), half-closes,
drops whatever else arrives without parsing it, and closes after ``LINGER_SECONDS`` (or
when the sender closes first, as it does once it has read the answer).

aiohttp has no hook for either, so the connection protocol is a subclass of its
``RequestHandler`` that watches ``data_received`` and wraps its parser.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

#: after an answer that left the body unread (a refusal with ``Connection: close``): how
#: long the rest of it is read and dropped before closing, so a sender still writing sees
#: the answer rather than a reset; a stalled sender is dropped after it (aiohttp's default
#: is 10 s of a socket per refused stall)
LINGER_SECONDS = 1.0

_TEXT_408 = b"request headers not received in time\n"
#: written to a connection whose headers ran out of time (no request to answer exists)
RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TEXT_408), _TEXT_408))

#: told the peer address of each connection closed for its headers
OnTimeout = Callable[[str], None]
#: (method, path without the query, headers, peer address) of a parsed request -> the
#: whole answer to write instead of handling it, or None to handle it
Shed = Callable[[str, str, Any, str], bytes | None]


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class _SheddingParser:
    """aiohttp's request parser, with the requests the server sheds taken out of what it
    hands to ``RequestHandler`` (everything else is the parser's own)."""

    __slots__ = ("_inner", "_protocol")

    def __init__(self, inner: Any, protocol: _GuardedProtocol) -> None:
        self._inner = inner
        self._protocol = protocol

    def feed_data(self, data: bytes) -> tuple[Any, Any, Any]:
        messages, upgraded, tail = self._inner.feed_data(data)
        if messages and not self._protocol._request_in_progress:
            answer = self._protocol.shed_answer(messages[0][0])
            if answer is not None:
                self._protocol.shed(answer)
                return [], False, b""  # nothing after it is handled either
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _GuardedProtocol(RequestHandler):
    __slots__ = ("_body", "_header_timer", "_linger", "_shedding")

    def __init__(self, manager: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._shedding = False
        #: the last parsed request's body: while it is incomplete, bytes are body bytes
        self._body: Any = None
        if manager.shed is not None:
            self._parser = cast(Any, _SheddingParser(self._parser, self))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self._body = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._shedding:
            return  # the rest of a shed request: dropped, never parsed
        # bytes after a complete body (or before any request) start the next headers
        headers_pending = self._body is None or self._body.is_eof()
        before = self._request_count
        super().data_received(data)
        if self._shedding:
            return
        if self._request_count != before:
            self._disarm()
            if self._messages:
                self._body = self._messages[-1][1]
        elif data and headers_pending:
            self._arm()

    # -- shedding -------------------------------------------------------------------------

    def shed_answer(self, message: Any) -> bytes | None:
        server = self._manager
        if not isinstance(server, _GuardedServer) or server.shed is None or self._messages \
                or not isinstance(getattr(message, "path", None), str):
            return None
        path = message.path.partition("?")[0]
        return server.shed(message.method, path, message.headers, _peer(self.transport))

    def shed(self, answer: bytes) -> None:
        """Answer at once, then drop the rest unread until the sender closes or the linger
        time is up."""
        self._disarm()
        self._shedding = True
        transport = self.transport
        if transport is None:
            return
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        # the parser's buffer for the dropped body may have paused reading: drain it
        with contextlib.suppress(AttributeError, RuntimeError):
            transport.resume_reading()
        self._linger = self._loop.call_later(LINGER_SECONDS, self._close_shed)

    def _close_shed(self) -> None:
        self._linger = None
        self.force_close()

    # -- header deadline ------------------------------------------------------------------

    def _arm(self) -> None:
        server = self._manager
        if isinstance(server, _GuardedServer) and self._header_timer is None:
            self._header_timer = self._loop.call_later(server.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        server = self._manager
        if self.transport is None or self._force_close or not isinstance(server, _GuardedServer):
            return
        if self._request_in_progress:  # a pipelined request still being answered
            self._arm()
            return
        server.on_timeout(_peer(self.transport))
        self.transport.write(RESPONSE_408)
        self.force_close()  # asyncio closes after the 408 is flushed


class _GuardedServer(web.Server):
    """aiohttp's low-level server, making ``_GuardedProtocol`` connections."""

    def __init__(self, *args: Any, header_timeout: float, on_timeout: OnTimeout,
                 shed: Shed | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.on_timeout = on_timeout
        self.shed = shed

    def __call__(self) -> RequestHandler:
        return _GuardedProtocol(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An ``AppRunner`` whose connections have a header deadline and, with ``shed``,
    shed overload on the headers."""

    def __init__(self, app: web.Application, *, header_timeout: float, on_timeout: OnTimeout,
                 shed: Shed | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._on_timeout = on_timeout
        self._shed = shed

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, freezes it
        return _GuardedServer(
            plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
            header_timeout=self._header_timeout, on_timeout=self._on_timeout,
            shed=self._shed, **plain._kwargs,
        )
