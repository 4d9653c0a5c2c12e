"""A deadline on each request's line and headers, which aiohttp's server does not have.

aiohttp closes a connection only after ``keepalive_timeout`` (an hour by default) of
silence, and a connection that sends half a request line and then one byte a minute is
never silent: thousands of them hold sockets and parser buffers for as long as their
sender likes (slowloris). Here the request line and headers must be complete within
``timeout`` seconds of the connection's start, or of the first byte after the previous
request's body; otherwise the connection gets a 408 and is closed. Idle time between
keep-alive requests is not counted (that is ``keepalive_timeout``'s), nor is the body
(the handler bounds that: ``server.body_read_timeout_seconds``).

aiohttp has no hook for it, so the connection protocol is a subclass of its
``RequestHandler`` that watches ``data_received``: a new parsed message means the
headers are complete; bytes while no body is pending mean headers are under way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

#: written to a connection whose headers ran out of time (no request to answer exists)
_TEXT_408 = b"request headers not received in time\n"
RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_TEXT_408), _TEXT_408))

#: told the peer address of each connection closed for its headers
OnTimeout = Callable[[str], None]


class _DeadlineProtocol(RequestHandler):
    __slots__ = ("_body", "_header_timer")

    def __init__(self, manager: _DeadlineServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        #: the last parsed request's body: while it is incomplete, bytes are body bytes
        self._body: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._body = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # bytes after a complete body (or before any request) start the next headers
        headers_pending = self._body is None or self._body.is_eof()
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._disarm()
            if self._messages:
                self._body = self._messages[-1][1]
        elif data and headers_pending:
            self._arm()

    def _arm(self) -> None:
        server = self._manager
        if isinstance(server, _DeadlineServer) and self._header_timer is None:
            self._header_timer = self._loop.call_later(server.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        server = self._manager
        if self.transport is None or self._force_close or not isinstance(server, _DeadlineServer):
            return
        if self._request_in_progress:  # a pipelined request still being answered
            self._arm()
            return
        peer = self.transport.get_extra_info("peername")
        server.on_timeout(str(peer[0]) if isinstance(peer, tuple) and peer else "")
        self.transport.write(RESPONSE_408)
        self.force_close()  # asyncio closes after the 408 is flushed


class _DeadlineServer(web.Server):
    """aiohttp's low-level server, making ``_DeadlineProtocol`` connections."""

    def __init__(self, *args: Any, header_timeout: float, on_timeout: OnTimeout,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.on_timeout = on_timeout

    def __call__(self) -> RequestHandler:
        return _DeadlineProtocol(self, loop=self._loop, **self._kwargs)


class HeaderDeadlineRunner(web.AppRunner):
    """An ``AppRunner`` whose connections have a header deadline."""

    def __init__(self, app: web.Application, *, header_timeout: float, on_timeout: OnTimeout,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._on_timeout = on_timeout

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, freezes it
        return _DeadlineServer(
            plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
            header_timeout=self._header_timeout, on_timeout=self._on_timeout, **plain._kwargs,
        )
