"""What a connection gets before the handler sees a request: a deadline on the request
line and headers, which aiohttp's server does not have, and overload shedding on the
headers alone, at the cost of a canned answer.

**Header deadline.** aiohttp closes a connection only after ``keepalive_timeout`` of
silence (an hour by default; ``server.keepalive_timeout_seconds`` here), and a connection
that sends half a request line and then one byte a minute is never silent: thousands of
them hold sockets and parser buffers for as long as their sender likes (slowloris). Here
the request line and headers must be complete within ``header_timeout`` seconds of the
connection's start, or of the first byte after the previous request's body; otherwise the
connection gets a 408 and is closed. Idle time between keep-alive requests is not counted
(that is ``keepalive_timeout``'s), nor is the body (the handler bounds that:
``server.body_read_timeout_seconds``).

**Shedding.** Under overload the event loop is the bottleneck: at 2x more connections
than request slots it was ~93% busy while the worker threads idled, and every refusal
that went through aiohttp's request machinery (a ``Request``, a task, the handler, a
``Response``, its headers) was loop time taken from the admitted requests. So the parser
is wrapped: when a request's headers are parsed and the server's ``shed`` hook says it
would be refused for overload, aiohttp never sees it, and the connection writes the
canned answer the hook returns (503 + ``Retry-After``) itself.

A refused sender retries, and one that has to reconnect first costs the proxy an accept,
a new protocol with its parser and task, and a close, several times what the refusal
does. So the answer keeps the connection open whenever the rest of the request can be
skipped cheaply: an HTTP/1.1 request with a declared ``Content-Length`` of at most
``DRAIN_MAX_BYTES`` (or none), no ``Expect``, no ``Connection: close``, no upgrade. The
parser goes on framing the body (so a pipelined request after it is read as the
request it is), and what it hands over is dropped as it comes, never buffered and never
counted against the byte budget; the body must be complete within ``header_timeout``,
or the connection is closed as below (the sender already has its answer). Any other
refused request (chunked, larger, ``Expect: 100-continue``, whose sender may or may not
send the body) gets the answer with ``Connection: close``: the connection half-closes,
drops whatever else arrives without parsing it, and closes after ``LINGER_SECONDS`` (or
when the sender closes first, as it does once it has read the answer).

**Waiting.** When the hook answers ``Wait`` instead (every slot taken, a place in line
free: ``proxy.admission``), the request goes to aiohttp as usual but the connection stops
reading at once, so the body stays in the kernel while the handler waits for a slot;
the handler says when it is done waiting (``admitted``) and the connection reads on.

**Connections and header bytes.** aiohttp limits neither the number of connections nor
the bytes of one request's headers in all (128 lines of 8190 bytes each: ~1 MiB, held
until the header deadline), so 400 connections that never finished their headers held
~750 MiB. Here a connection past ``ConnectionLimit`` is closed as soon as it is made,
before a byte is read (with TLS, before the handshake: ``proxy.tls_handshake``), and a
request whose line and headers pass ``max_header_bytes`` gets a 431 and the connection
closed (counted over the reads that leave them unfinished, and measured, before the parser
takes them, in the read that ends them: 20 KiB of them in one write were taken). What a
connection may hold of unfinished headers is so bounded by ``max_header_bytes`` (and one
socket read beyond it, dropped in the same turn of the loop), and all of them by
``max_connections`` times that.

**Send deadline.** Nothing bounded the other direction: aiohttp writes an answer into
the transport, and a client that never reads it (a 4 KiB receive buffer, a 3.6 MB JSON
listing) held the answer's bytes, twice (the response and the transport's copy), and its
connection's place for as long as it stayed connected: 100 of them grew RSS from 150 to
595 MiB, 16 of them locked every sender out of a 16-connection proxy for good. Here the
transport's write buffer has no slack (``set_write_buffer_limits(high=0)``, so aiohttp's
flow control pauses the connection as soon as the kernel cannot take all of an answer,
and resumes it once the proxy holds none of it), and a connection paused for
``send_timeout`` seconds is aborted: its buffer and its handler (stopped in its write
by the reset) go at once. The deadline runs per stall, so a slow reader that empties the
buffer in time is served whatever the answer's size; it also bounds a connection that
aiohttp closes with bytes still unsent (a keep-alive timeout, ``Connection: close``),
which asyncio otherwise keeps open until they are sent. Under TLS the same holds of the
TLS layer's buffer (the TCP transport beneath it pauses it past its own 64 KiB), and
asyncio's TLS shutdown timeout (30 s) bounds a close.

**Idle connections at the limit.** A keep-alive connection waiting for its next request
costs nothing to close: its client reconnects when it has something to send. So when
``max_connections`` are open, a new connection is not refused while one of them is idle
(answered, nothing of a next request received, nothing left to send): the one idle the
longest is aborted and the new one takes its place (16 idle keep-alive clients had locked
a 16-connection proxy for aiohttp's hour). A connection that never sent a request is not
idle in this sense (its header deadline bounds it), nor is one being answered (the send
deadline does).

aiohttp has no hook for any of these, so the connection protocol is a subclass of its
``RequestHandler`` that watches ``data_received`` and wraps its parser.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import enum
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import (
    BadHttpMethod,
    HttpProcessingError,
    InvalidHeader,
    LineTooLong,
)
from aiohttp.http_parser import HttpRequestParserPy
from aiohttp.web_protocol import RequestHandler

from proxy.shown import credential_header, hidden_query, one_line, shown

#: the ``Server`` header of every answer: the product, not its runtime. aiohttp's own
#: (``Python/3.11 aiohttp/3.14.5``) told every client, and every scanner, which versions
#: to look up vulnerabilities for; the proxy's version is on its landing page and on
#: ``/metrics`` (``karta_proxy_build_info``), behind whatever guards those pages
SERVER_HEADER = "karta-proxy"

#: what this module takes from aiohttp's server beyond its public API (aiohttp 3.14): the
#: ``RequestHandler`` attributes it reads or sets, the methods it overrides or calls, and
#: the body reader's byte count. pyproject.toml pins aiohttp's minor version, and
#: ``tests/test_connection_guard.py`` checks every name here, so a new aiohttp is taken
#: once that test names nothing missing (a name gone would otherwise pass silently: an
#: attribute set on a slotted class raises, one read through ``getattr`` does not).
AIOHTTP_HANDLER_ATTRIBUTES = (
    "_buffer_paused", "_close", "_force_close", "_keepalive_handle", "_keepalive_timeout", "_loop",
    "_manager", "_messages", "_next_keepalive_close_time", "_parser", "_reading_paused",
    "_request_count", "_request_in_progress", "_task_handler", "_waiter",
)
AIOHTTP_HANDLER_METHODS = (
    "_handle_request", "_pause_transport_reading", "_process_keepalive",
    "_resume_transport_reading", "connection_lost", "connection_made", "data_received",
    "eof_received", "finish_response", "force_close", "handle_error", "pause_writing",
    "resume_writing",
)
AIOHTTP_SERVER_ATTRIBUTES = ("_connections", "_kwargs", "_loop")
AIOHTTP_PAYLOAD_ATTRIBUTES = ("_buffer", "_size")

#: after an answer that left the body unread (a refusal with ``Connection: close``): how
#: long the rest of it is read and dropped before closing, so a sender still writing sees
#: the answer rather than a reset; a stalled sender is dropped after it (aiohttp's default
#: is 10 s of a socket per refused stall)
LINGER_SECONDS = 1.0
#: a refused request's declared body up to this size is skipped to keep the connection
#: (reading it costs the proxy less than the sender's reconnect does); a larger one gets
#: ``Connection: close``
DRAIN_MAX_BYTES = 1 << 20
#: past this many bytes of answers not yet taken by a sender (one that pipelines refused
#: requests without reading), a refusal closes the connection instead
MAX_UNSENT_BYTES = 64 * 1024
#: how long a connection may hold bytes of its answers that the client does not take
#: (the default of ``server.send_timeout_seconds``): as long as a body may take to come in
#: (``body_read_timeout_seconds``). Ample for a client that reads: it bounds one stall,
#: not an answer, and a stall ends once the kernel has room for what the proxy holds (about
#: half its send buffer, at most 4 MiB, free: ~70 KB/s read over 30 s)
SEND_TIMEOUT_SECONDS = 30.0
#: at stop, after the drain: how long the requests still in flight, their handlers
#: cancelled, get to end before their connections are closed under them
CANCEL_GRACE_SECONDS = 0.5


class _Idle(enum.Enum):
    """A listed connection's state when a place is needed (``ConnectionLimit``)."""

    IDLE = enum.auto()
    #: about to be idle (aiohttp between an answer and its wait for the next request)
    SOON = enum.auto()
    BUSY = enum.auto()


@dataclass(frozen=True, slots=True)
class Canned:
    """A whole answer the connection writes itself, in the two forms it is sent in."""

    #: the connection stays open for the next request
    keep_alive: bytes
    #: with ``Connection: close``
    close: bytes


def canned(status: str, headers: Mapping[str, str], text: str) -> Canned:
    """A plain-text answer (``status``: code and reason) with ``headers`` and a
    ``Content-Length``, in both forms."""
    body = text.encode()
    head = "".join([f"HTTP/1.1 {status}\r\nServer: {SERVER_HEADER}\r\n"
                    "Content-Type: text/plain; charset=utf-8\r\n",
                    *(f"{k}: {v}\r\n" for k, v in headers.items()),
                    f"Content-Length: {len(body)}\r\n"])
    return Canned(keep_alive=f"{head}\r\n".encode() + body,
                  close=f"{head}Connection: close\r\n\r\n".encode() + body)


#: what ends a request's line and headers for aiohttp's parser, and its length
_HEADER_ENDS = ((b"\r\n\r\n", 4), (b"\n\n", 2))
#: written to a connection whose headers ran out of time (no request to answer exists)
RESPONSE_408 = canned("408 Request Timeout", {}, "request headers not received in time\n").close
#: one header line (and the request line) at most, aiohttp's own default: a bearer token
#: of a few KiB fits
MAX_FIELD_BYTES = 8190
#: headers of one request at most (aiohttp's default is 128); a remote-write sender sends
#: ~10, a browser ~20, an ingress adds a few
MAX_HEADERS = 64


def header_limits(max_header_bytes: int) -> dict[str, Any]:
    """aiohttp's own per-line and count limits for a total of ``max_header_bytes`` (its
    parser has none for the total, which ``_GuardedProtocol`` checks)."""
    field = min(MAX_FIELD_BYTES, max_header_bytes)
    return {"max_line_size": field, "max_field_size": field, "max_headers": MAX_HEADERS}


def line_too_long(max_header_bytes: int) -> str:
    """What a request with a line past aiohttp's per-line limit is told: that limit, not
    the total's (a 9 KB tenant header under a 16 KiB total was told its headers passed
    16384 bytes, and raising ``server.max_header_bytes`` changes nothing past 8190)."""
    field = header_limits(max_header_bytes)["max_field_size"]
    why = ("server.max_header_bytes" if field < MAX_FIELD_BYTES
           else "the most aiohttp reads of one line, whatever server.max_header_bytes")
    return f"the request line or a header line is longer than {field} bytes ({why})"


def response_431(max_header_bytes: int) -> bytes:
    """The answer to headers past the limit, with ``Connection: close`` (the rest of them
    is never read)."""
    return canned("431 Request Header Fields Too Large", {},
                  f"request line and headers larger than {max_header_bytes} bytes "
                  "(server.max_header_bytes)\n").close


#: told the peer address of each connection closed at once because ``max_connections``
#: were open
OnConnectionRefused = Callable[[str], None]
#: told the peer address of each idle keep-alive connection closed to make room for a new
#: one at ``max_connections``
OnIdleClosed = Callable[[str], None]
#: told the peer address and why of each request refused because its headers were too large
OnHeaderTooLarge = Callable[[str, str], None]


class ConnectionLimit:
    """The client connections open now, at most ``limit``: one object for the plain and
    the TLS listener's protocols, counted when a connection is made (asyncio pairs every
    ``connection_made`` with a ``connection_lost``, so the count cannot drift) and given
    back when it is lost. At the limit, an idle keep-alive connection is closed to make
    room for the new one, else the new one is refused."""

    __slots__ = ("idle", "limit", "on_idle_closed", "on_refused", "open")

    def __init__(self, limit: int, on_refused: OnConnectionRefused | None = None,
                 on_idle_closed: OnIdleClosed | None = None) -> None:
        self.limit = limit
        self.on_refused = on_refused
        self.on_idle_closed = on_idle_closed
        self.open = 0
        #: keep-alive connections answered and not yet sent a byte more, the longest idle
        #: first (a dict for its order); one that is no longer idle may linger here until
        #: its next answer, and is skipped (``_GuardedProtocol.idle_state``)
        self.idle: dict[_GuardedProtocol, None] = {}

    def take(self, transport: asyncio.BaseTransport) -> bool:
        """Count a new connection, or close it at once when ``limit`` are open and none of
        them is idle: the sender sees the close (or a reset) and reconnects, as after any
        dropped connection, and nothing of it is read or allocated past the protocol
        object. When one is idle, it is closed instead, and gives its place back in the
        next turn of the loop (until then one more than ``limit`` is counted)."""
        if self.open < self.limit or self._close_idle():
            self.open += 1
            return True
        cast(asyncio.Transport, transport).abort()
        if self.on_refused is not None:
            self.on_refused(_peer(transport))
        return False

    def give_back(self) -> None:
        self.open -= 1

    def _close_idle(self) -> bool:
        """Close the connection idle the longest; False when none is. Each one listed is
        looked at once, whether closed or skipped (it lists itself again after its next
        answer), so a flood of connections past the limit costs no scan of them all."""
        idle = self.idle
        soon: list[_GuardedProtocol] = []
        try:
            while idle:
                conn = next(iter(idle))
                del idle[conn]
                state = conn.idle_state()
                if state is _Idle.SOON:
                    soon.append(conn)
                elif state is _Idle.IDLE:
                    peer = conn.close_idle()
                    if self.on_idle_closed is not None:
                        self.on_idle_closed(peer)
                    return True
            return False
        finally:
            for conn in soon:  # listed again, after the others
                idle[conn] = None


@dataclass(frozen=True, slots=True)
class Wait:
    """The shed hook's answer for a request that is to wait for a slot: aiohttp handles it,
    and the connection reads nothing more until the handler says it was ``admitted`` (its
    body stays in the kernel's buffers meanwhile). ``release`` gives back the place in line
    the hook promised it, when the connection goes before its handler ever ran."""

    release: Callable[[], None]

class OnTimeout(Protocol):
    """Told the peer address of each connection closed for its headers (``unused``: it
    had not sent a byte, so it was closed without a 408: no request was refused)."""

    def __call__(self, remote: str, *, unused: bool = False) -> None: ...


#: told the peer address, and the bytes left unsent, of each connection aborted because
#: its client did not take its answer within the send deadline
OnSendTimeout = Callable[[str, int], None]
#: told how many requests still in flight the stop ended when its drain ran out
OnEnded = Callable[[int], None]
#: (method, path without the query, headers, what tells the peer address) of a parsed
#: request -> the answer to write instead of handling it, a ``Wait`` to handle it once the
#: connection has stopped reading, or None to handle it. The peer address is asked for
#: only when needed (a refusal's log line): not for every request that is handled
Shed = Callable[[str, str, Any, Callable[[], str]], Canned | Wait | None]


class OnBadHttp(Protocol):
    """Told the peer and the parser's message of a request aiohttp refused as malformed
    (``quiet``: a first request that is not HTTP at all)."""

    def __call__(self, remote: str, message: str, *, quiet: bool = False) -> None: ...


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


def skippable(version: tuple[int, int], keep_alive: bool, headers: Mapping[str, str]) -> bool:
    """Whether a refused request can be answered on a connection that stays open: its
    body is framed by a length small enough to skip, and its sender sends it (no
    ``Expect``: a sender waiting for ``100 Continue`` may never send it)."""
    if not keep_alive or version != (1, 1) or "Expect" in headers or "Upgrade" in headers \
            or "Transfer-Encoding" in headers:
        return False
    try:
        return int(headers.get("Content-Length", "0")) <= DRAIN_MAX_BYTES
    except ValueError:  # pragma: no cover - the parser already refused it
        return False


def _discard(payload: Any) -> None:
    """Drop what a skipped body's reader holds. Not ``read_nowait``: that resumes the
    transport and so re-enters ``data_received`` from inside the parser."""
    buffer = getattr(payload, "_buffer", None)
    if buffer:
        buffer.clear()
        payload._size = 0


class _SheddingParser:
    """aiohttp's request parser, with the requests the server sheds taken out of what it
    hands to ``RequestHandler`` (everything else is the parser's own)."""

    __slots__ = ("_inner", "_protocol")

    def __init__(self, inner: Any, protocol: _GuardedProtocol) -> None:
        self._inner = inner
        self._protocol = protocol

    def feed_data(self, data: bytes) -> tuple[Any, Any, Any]:
        messages, upgraded, tail = self._inner.feed_data(data)
        protocol = self._protocol
        if protocol._skipping is not None:
            protocol.skipped()
        # a refusal is written at once, so only while no earlier request awaits its answer
        while messages and not protocol._request_in_progress:
            message, payload = messages[0]
            answer = protocol.shed_answer(message)
            if answer is None:
                break
            if isinstance(answer, Wait):
                protocol.hold(answer, payload)
                break
            if not protocol.shed(message, payload, answer):
                return [], False, b""  # closing: nothing after it is handled either
            messages = messages[1:]
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SpentParser:
    """Stands in for the parser of a connection that reads no more requests (its headers
    too large): the parser's state, up to a socket read of headers, goes at once rather
    than when the connection does (after ``LINGER_SECONDS``)."""

    __slots__ = ()

    def feed_data(self, data: bytes) -> tuple[list[Any], bool, bytes]:
        return [], False, b""

    def feed_eof(self) -> None:
        return None

    def message_consumed(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def set_upgraded(self, val: bool) -> None:
        pass


class _GuardedProtocol(RequestHandler):
    __slots__ = ("_body", "_counted", "_drain_deadline", "_drain_timer", "_header_bytes",
                 "_header_tail", "_header_timer", "_heard", "_holding", "_limited", "_linger",
                 "_listed", "_max_header_bytes", "_refused", "_retiring", "_send_timer",
                 "_shed_count", "_shedding", "_skipping", "_wire")

    def __init__(self, manager: _GuardedServer, *, limited: bool = True, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        #: this protocol counts its connection against ``manager.limit`` (not so behind
        #: TLS, whose protocol counts it from before the handshake)
        self._limited = limited
        self._counted = False
        #: closed at once past the connection limit: aiohttp never saw it
        self._refused = False
        #: the manager's, at hand (read twice for every read of headers)
        self._max_header_bytes = manager.max_header_bytes
        #: bytes received of the request line and headers not yet complete
        self._header_bytes = 0
        #: a byte came on this connection (one that sent none is closed without a 408)
        self._heard = False
        #: the last bytes of them, where a blank line that ends them may begin
        self._header_tail = b""
        self._header_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        #: one timer for the skipped bodies of a connection, re-armed for the deadline of
        #: the one being skipped when it fires (not one timer per refusal)
        self._drain_timer: asyncio.TimerHandle | None = None
        self._drain_deadline = 0.0
        #: closing after a refusal: every byte from now on is dropped unparsed
        self._shedding = False
        #: the body of a refused request on a connection kept open, while it arrives
        self._skipping: Any = None
        #: requests refused on this connection (their headers end like a handled one's)
        self._shed_count = 0
        #: the last parsed request's body: while it is incomplete, bytes are body bytes
        self._body: Any = None
        #: reading paused while the request with this body waits for a slot (``hold`` /
        #: ``admitted``), and its promise
        self._holding: tuple[Wait, Any] | None = None
        #: the answer being made is the connection's last (``retire``)
        self._retiring = False
        #: the limit whose ``idle`` lists this connection now (its next byte unlists it)
        self._listed: ConnectionLimit | None = None
        #: the send deadline, while the client leaves bytes of an answer unsent
        self._send_timer: asyncio.TimerHandle | None = None
        #: the transport, until the connection is lost: aiohttp forgets it when it closes
        #: the connection, which may then still hold unsent bytes (the send deadline's)
        self._wire: asyncio.Transport | None = None
        if manager.shed is not None:
            self._parser = cast(Any, _SheddingParser(self._parser, self))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limit = cast(_GuardedServer, self._manager).limit
        if self._limited and limit is not None:
            if not limit.take(transport):
                self._refused = True
                return
            self._counted = True
        super().connection_made(transport)
        wire = self._wire = cast(asyncio.Transport, transport)
        # no slack in the write buffer: aiohttp's flow control pauses the connection (and
        # the send deadline starts) as soon as the kernel cannot take all of an answer, and
        # resumes it once all of it is sent. asyncio's TLS transport pauses at a size of
        # ``high`` and more (a plain one past it): there, any byte pending
        if transport.get_extra_info("sslcontext") is None:
            wire.set_write_buffer_limits(high=0)
        else:
            wire.set_write_buffer_limits(high=1, low=0)
        self._arm()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        """An answer made before any handler, or for one that raised, named as every
        other answer is (``SERVER_HEADER``): aiohttp's prepare hook, which names the
        others, does not run for a request no route was matched for."""
        response = self._error_response(request, status, exc, message)
        response.headers["Server"] = SERVER_HEADER
        return response

    def _error_response(self, request: web.BaseRequest, status: int,
                        exc: BaseException | None, message: str | None
                        ) -> web.StreamResponse:
        """A request the parser refused (aiohttp's 400, before any handler) is counted and
        logged in one line by the manager's ``on_bad_http``, where aiohttp logs it at
        error level with a traceback, or not at all, and counts nothing."""
        server = cast(_GuardedServer, self._manager)
        if status != 400 or not isinstance(exc, HttpProcessingError) \
                or server.on_bad_http is None:
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong) or exc.message.startswith("Too many headers"):
            # aiohttp's per-line or count limit: refused as the total is, but said as
            # itself, the line never quoted (aiohttp's message holds its first 100 bytes:
            # a bearer token's)
            said = (line_too_long(server.max_header_bytes) if isinstance(exc, LineTooLong)
                    else f"more than {MAX_HEADERS} headers (the most the proxy reads)")
            server.on_header_too_large(request.remote or _peer(self.transport), said)
            response = web.Response(status=431, headers={"Connection": "close"},
                                    text=said + "\n")
            response.force_close()
            return response
        # aiohttp's own reasoning: a first "request" that is no HTTP method at all is a
        # port scan or TLS spoken to a plain port, noise at the error level
        quiet = self._request_count == 1 and isinstance(exc, BadHttpMethod)
        said = parser_error_line(message or str(exc), exc)
        server.on_bad_http(request.remote or _peer(self.transport), said, quiet=quiet)
        response = web.Response(status=400, text=said + "\n")
        response.force_close()
        return response

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return  # never made, as far as aiohttp knows
        if self._counted:
            self._counted = False
            limit = cast(_GuardedServer, self._manager).limit
            if limit is not None:
                limit.give_back()
        self._disarm()
        self._unlist()
        for timer in (self._linger, self._drain_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._linger = self._drain_timer = self._send_timer = None
        self._wire = None
        self._body = self._skipping = None
        holding = self._holding
        if holding is not None and any(p is holding[1] for _, p in self._messages):
            # gone before aiohttp handed the request to the handler, which never will now
            self._holding = None
            holding[0].release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        if self._listed is not None:
            self._unlist()
        if self._shedding:
            return  # the rest of a shed request: dropped, never parsed
        if self._close or self._force_close:
            self._finish_body(data)
            return
        # bytes after a complete body (or before any request) start the next headers
        headers_pending = self._body is None or self._body.is_eof()
        if headers_pending and data and not self._messages:
            # headers that end in this read are measured before the parser takes them: it
            # would hand them on whole, and the count below (of reads that leave them
            # unfinished) never saw 20 KiB of them sent in one write
            room = self._max_header_bytes - self._header_bytes
            end = self._headers_end(data, room)
            if end > room or (end < 0 and len(data) > room + 4):
                self._headers_too_large()
                return
        before = self._request_count + self._shed_count
        super().data_received(data)
        if self._shedding:
            return
        if self._request_count + self._shed_count != before:
            self._disarm()
            self._header_bytes = 0
            self._header_tail = b""
            if self._messages:
                self._body = self._messages[-1][1]
        elif data and headers_pending:
            self._arm()
            if not self._messages:  # not a parser stopped behind a queue of requests
                self._header_bytes += len(data)
                self._header_tail = (self._header_tail + data[-3:])[-3:]
                if self._header_bytes > self._max_header_bytes:
                    self._headers_too_large()

    # aiohttp types it ``-> None``; asyncio's ``Protocol.eof_received`` reads a true answer
    # as "keep the transport open"
    def eof_received(self) -> bool:  # type: ignore[override]
        """The sender shut its side of the connection after its request (a half-close:
        ``shutdown(SHUT_WR)``, as HTTP/1.0 tools and scripts do): its requests are still
        answered, on the side it reads, and the connection closes after the last answer
        (``retire``). asyncio closes the transport at once unless this says True: the
        request was handled all the same (a write forwarded and stored, or not, as the
        close and the handler's start fell) and its answer went to nobody, so the sender,
        seeing a dropped connection, sent the batch again (stored twice where the TSDB
        keeps duplicates), and a request answered 4xx was sent again forever; Prometheus'
        receiver (Go's server) answers them. Closed at once as before: nothing to answer
        (aiohttp waiting for a request, or one whose line, headers or body had not all
        come and never will), a refusal being shed, TLS (asyncio's TLS transport cannot
        stay half open)."""
        transport = self.transport
        body = self._body
        if transport is None or transport.get_extra_info("sslcontext") is not None \
                or self._shedding or self._skipping is not None or self._header_bytes \
                or (body is not None and not body.is_eof()) \
                or (_waiting_for_request(self) and not self._messages):
            return False
        self.retire()
        return True

    def _finish_body(self, data: bytes) -> None:
        """Bytes for a connection aiohttp is closing, as it marks every one at a stop
        (``close`` in ``Server.pre_shutdown``, ``_force_close`` in ``shutdown``), after
        which its ``data_received`` drops them: the body of the request being handled
        still goes to the parser, or the drain's "requests in flight finish" did not hold
        for a request whose body was still arriving (answered 503 "request body too
        slow", counted as the sender's fault, with most of the drain left). Nothing else
        is read: no request after it is taken (the connection closes after its answer),
        and an idle connection closes as before."""
        body = self._body
        if body is None or body.is_eof() or not self._request_in_progress \
                or self.transport is None:
            return
        closing = self._close, self._force_close
        self._close = self._force_close = False
        try:
            super().data_received(data)
        finally:
            self._close, self._force_close = closing

    def _headers_end(self, data: bytes, room: int) -> int:
        """How many bytes of ``data`` belong to the request line and headers when their
        blank line is in it (that line's end included), else -1. aiohttp's parser ends
        them at CRLF CRLF or a bare LF LF, either maybe begun in the previous read. Looked
        for in the first ``room`` bytes (and a line end) only: the rest of a read that
        holds a request's first body bytes (up to 256 KiB of binary) is not scanned for
        every request, and headers that do not end there are too large anyway.

        Once a request (its headers in one read, no tail before them, the usual case),
        so the seam with the previous read is looked at only when there is one: an end
        within ``data``'s first bytes is found in ``data`` itself then."""
        tail = self._header_tail
        seam = tail + data[:3] if tail or room < 1 else b""
        within = room if room > 0 else 0
        end = -1
        for mark, size in _HEADER_ENDS:
            if seam:
                at = seam.find(mark)
                if at >= 0 and at + size > len(tail):
                    at += size - len(tail)
                    if end < 0 or at < end:
                        end = at
            at = data.find(mark, 0, within + size)
            if at >= 0 and (end < 0 or at + size < end):
                end = at + size
        return end

    def _headers_too_large(self) -> None:
        """Headers past ``max_header_bytes`` before their end: 431 and close, as aiohttp
        does past its own per-line limits; the parser holding them goes with the
        connection. Behind a request still being answered (a pipelining sender) there is no
        place for the answer: the connection is closed without one."""
        server = cast(_GuardedServer, self._manager)
        self._disarm()
        server.on_header_too_large(_peer(self.transport),
                                   f"request line and headers past {server.max_header_bytes} "
                                   "bytes before their end")
        transport = self.transport
        self._shedding = True
        self._parser = cast(Any, _SpentParser())
        if transport is None or self._request_in_progress or self._force_close:
            self.force_close()
            return
        transport.write(response_431(server.max_header_bytes))
        self._close_after_answer()

    def retire(self) -> None:
        """Close after the answer to the request in flight, at once when there is none.

        Not aiohttp's ``close``: that stops reading at once, so a body still arriving was
        cut off and its request answered 503 (too slow). The answer itself says
        ``Connection: close`` instead (``finish_response``), and aiohttp closes once it is
        written: a request being handled loses nothing. An idle connection is closed as
        aiohttp's keep-alive timeout closes one; a request whose headers were still
        arriving gets no answer, and its sender sends it again on a new connection.

        Idle is aiohttp waiting for a message (``_waiting_for_request``), not "no request
        in progress and none queued": aiohttp pops a request before its handler's task
        first runs (a later turn of the loop before Python 3.12), and a close in that turn
        dropped a request that was then handled and stored: the sender, with no answer,
        sent it again. Between aiohttp's steps (a request popped, an answer written, the
        connection just made) the check is made again in the next turn, when aiohttp is
        either waiting (closed then) or in a handler (closed by its answer)."""
        self._retiring = True
        if _waiting_for_request(self):
            self.force_close()
        elif not (self._request_in_progress or self._messages):
            self._loop.call_soon(self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self.transport is not None and _waiting_for_request(self):
            self.force_close()

    async def _handle_request(self, request: web.BaseRequest, start_time: float | None,
                              request_handler: Callable[[web.BaseRequest],
                                                        Awaitable[web.StreamResponse]],
                              ) -> tuple[web.StreamResponse, bool]:
        resp, reset = await super()._handle_request(request, start_time, request_handler)
        if self._retiring:
            # retired after its answer said keep-alive (while it was being written):
            # aiohttp reads ``keep_alive`` next to decide whether to wait for another
            # request, which would have kept the connection open to be served again
            resp.force_close()
        elif not reset and resp.keep_alive and not (self._close or self._force_close):
            # answered, kept open: idle from now on, until its next byte
            limit = cast(_GuardedServer, self._manager).limit
            if limit is not None and self.transport is not None:
                limit.idle[self] = None
                self._listed = limit
        return resp, reset

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        if self._retiring or self._close or self._force_close:
            # before the headers: they say it; after (a streamed page): aiohttp still
            # reads ``keep_alive`` from it to decide whether to close. ``_close`` /
            # ``_force_close``: a stop (aiohttp marks every connection so), after which
            # the connection closes once this answer is written: an answer that said
            # keep-alive had a sender reusing connections (Prometheus) write its next
            # batch on it and read EOF, a failed send, where ``Connection: close`` has it
            # open a new connection (another replica's, behind a Service)
            resp.force_close()
        return await super().finish_response(request, resp, start_time)

    # -- idle at the limit ------------------------------------------------------------------

    def _unlist(self) -> None:
        if self._listed is not None:
            self._listed.idle.pop(self, None)
            self._listed = None

    def idle_state(self) -> _Idle:
        """Whether this connection, listed as idle, is: aiohttp waiting for its next
        request, not a byte of one received, nothing of the last answer left to send, no
        refused body being skipped. ``SOON``: aiohttp is between the answer it just wrote
        and that wait (a turn of the loop; one such connection taken for busy would stay
        unlisted while idle). Unlisted unless ``SOON``."""
        transport = self.transport
        if transport is None or self._force_close or self._close or self._shedding \
                or self._messages or self._header_bytes or self._skipping is not None \
                or self._holding is not None or self._send_timer is not None \
                or transport.get_write_buffer_size():
            self._listed = None
            return _Idle.BUSY
        if not _waiting_for_request(self):
            if self._request_in_progress:
                self._listed = None
                return _Idle.BUSY
            return _Idle.SOON
        self._listed = None
        return _Idle.IDLE

    def close_idle(self) -> str:
        """Abort this idle connection (``idle_state``), and tell its peer's address.
        Aborted, not closed: there is nothing to flush, and a TLS close would wait for
        the client's close_notify (up to 30 s), holding the place the new connection
        needs."""
        transport = cast(asyncio.Transport, self.transport)
        peer = _peer(transport)
        transport.abort()
        return peer

    # -- send deadline ----------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The kernel did not take all of an answer: the client must take the rest within
        the send deadline (``resume_writing`` when it has)."""
        super().pause_writing()
        server = self._manager
        if self._send_timer is None and isinstance(server, _GuardedServer):
            self._send_timer = self._loop.call_later(server.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        """The client left bytes of an answer unsent for the whole send deadline: the
        connection is aborted, what it holds to send dropped with it, and a handler
        still writing ends with the reset (aiohttp's ``ConnectionResetError``)."""
        self._send_timer = None
        wire = self._wire
        if wire is None:
            return
        server = cast(_GuardedServer, self._manager)
        if server.on_send_timeout is not None:
            server.on_send_timeout(_peer(wire), wire.get_write_buffer_size())
        wire.abort()

    # -- shedding -------------------------------------------------------------------------

    def hold(self, wait: Wait, payload: Any) -> None:
        """Stop reading while the request just parsed (its body ``payload``) waits for a
        slot."""
        self._holding = (wait, payload)
        # the transport only, as aiohttp's flow control pauses it (the parser's own pause
        # is for a body being parsed, and there may be none); the flag keeps aiohttp from
        # resuming it when its message queue drains
        self._reading_paused = True
        self._pause_transport_reading()

    def shed_answer(self, message: Any) -> Canned | Wait | None:
        server = self._manager
        if not isinstance(server, _GuardedServer) or server.shed is None or self._messages \
                or not isinstance(getattr(message, "path", None), str):
            return None
        path = message.path.partition("?")[0]
        return server.shed(message.method, path, message.headers, self._remote)

    def _remote(self) -> str:
        """The peer's address (a shed request's log line)."""
        return _peer(self.transport)

    def shed(self, message: Any, payload: Any, answer: Canned) -> bool:
        """Answer ``message`` at once; True when the connection stays open (the rest of its
        body is skipped as it comes), False when it closes."""
        self._disarm()
        self._shed_count += 1
        transport = self.transport
        if transport is None:
            self._shedding = True
            return False
        if not skippable(message.version, not message.should_close, message.headers) \
                or transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            transport.write(answer.close)
            self._close_after_answer()
            return False
        transport.write(answer.keep_alive)
        self._body = payload
        if payload.is_eof():
            self._consumed()
        else:
            _discard(payload)
            self._skipping = payload
            server = cast(_GuardedServer, self._manager)
            self._drain_deadline = self._loop.time() + server.header_timeout
            if self._drain_timer is None:
                self._drain_timer = self._loop.call_at(self._drain_deadline, self._drain_due)
        # as after an answered request: idle from now on counts toward keepalive_timeout
        close_time = self._loop.time() + self._keepalive_timeout
        self._next_keepalive_close_time = close_time
        if self._keepalive_handle is None:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)
        return True

    def skipped(self) -> None:
        """More of a refused request's body went through the parser: dropped, and once it
        is complete the connection reads the next request."""
        payload = self._skipping
        _discard(payload)
        if payload.is_eof():
            self._skipping = None
            self._consumed()

    def _consumed(self) -> None:
        """Free the parser's queue slot of a refused request, as aiohttp does for a handled
        one (the parser stops between requests once too many are unconsumed)."""
        if self._parser is not None:
            self._parser.message_consumed()

    def _drain_due(self) -> None:
        """A refused request's body past its deadline stopped short: the sender has its
        answer, so the connection closes as after a closing refusal."""
        self._drain_timer = None
        if self._skipping is None:
            return
        if self._loop.time() < self._drain_deadline:  # a later body than the one armed for
            self._drain_timer = self._loop.call_at(self._drain_deadline, self._drain_due)
            return
        self._skipping = None
        if self.transport is not None and not self._force_close:
            self._close_after_answer()

    def _close_after_answer(self) -> None:
        """Half-close, then drop the rest unread until the sender closes or the linger time
        is up."""
        self._shedding = True
        transport = self.transport
        if transport is None:
            return
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
        if not self._heard:
            # a connection a client opened and did not use (Go's transport dials one per
            # request that finds no idle connection, and pools those another connection
            # freed first made unneeded: a Prometheus scaling its shards up leaves some).
            # A 408 there is read by the client as the answer to a request it sends on
            # that connection as the 408 arrives (Prometheus drops a batch on a 4xx): a
            # close without an answer is retried, as Go's own server closes it
            server.on_timeout(_peer(self.transport), unused=True)
            self.force_close()
            return
        server.on_timeout(_peer(self.transport))
        self.transport.write(RESPONSE_408)
        self.force_close()  # asyncio closes after the 408 is flushed


def close_when_answered(protocol: asyncio.BaseProtocol) -> None:
    """Close an aiohttp connection after the request in flight has its answer, or at once
    when it has none: the trust it was made under is gone (a client CA removed,
    ``proxy.tls``), and a keep-alive connection is otherwise served for as long as its
    sender keeps it."""
    if isinstance(protocol, _GuardedProtocol):
        protocol.retire()
    elif isinstance(protocol, RequestHandler) and _waiting_for_request(protocol):
        protocol.force_close()  # a bare aiohttp server: idle only


def _waiting_for_request(protocol: RequestHandler) -> bool:
    """aiohttp's own test of an idle connection (``_process_keepalive``, aiohttp 3.14):
    its ``start`` awaits ``_waiter`` for the next message, and nothing else is pending."""
    waiter = protocol._waiter
    return waiter is not None and not waiter.done()


def holding(request: web.BaseRequest) -> bool:
    """Whether ``request`` came with a ``Wait`` (its connection not reading) that the
    handler has not yet said it is done with."""
    protocol = request.protocol
    return isinstance(protocol, _GuardedProtocol) and protocol._holding is not None


def admitted(request: web.BaseRequest) -> bool:
    """The handler is done waiting for a slot for ``request`` (it holds one, or is refused):
    the connection reads again if a ``Wait`` stopped it (aiohttp's own flow control pauses
    it again if the body outruns the handler). True: it had (the handler still owns the
    place in line its ``Wait`` promised)."""
    protocol = request.protocol
    if not isinstance(protocol, _GuardedProtocol) or protocol._holding is None:
        return False
    protocol._holding = None
    protocol._reading_paused = False
    if not protocol._buffer_paused:
        protocol._resume_transport_reading()
    return True


def http_parser() -> str:
    """Which parser aiohttp reads requests with: ``llhttp`` (its C extension) or
    ``python`` (none: a Python it has no wheel for, a debug build,
    ``AIOHTTP_NO_EXTENSIONS``), which refuses with other words (:func:`_invalid_header`)
    and costs ~40 us more a request's head (measured on the 2-core VM, 2026-12-06):
    said in the start-up line."""
    return "python" if web_protocol.HttpRequestParser is HttpRequestParserPy else "llhttp"


#: a request line as llhttp quotes it: a method (a token: no space, no colon), a target,
#: a version; a header line's name holds no space before its colon
_REQUEST_LINE = re.compile(rb"[^ :]+ [^ ]* HTTP/[^ ]*")


def parser_error_line(message: str, exc: HttpProcessingError | None = None) -> str:
    """aiohttp's refusal of what it could not parse, on one line for the sender and the
    log. llhttp's is four lines (the reason, a blank, the line it stopped in as a bytes
    repr, a caret), and a sender logs the first line of a body alone: Prometheus logged
    ``Invalid header token:`` and nothing of which header. Said as ``reason: "line"``,
    the line quoted by the refusal rule (``proxy.shown``: 64 bytes, the rest escaped),
    and the value of a credential header left out: a malformed ``Authorization`` line
    was quoted whole into the log. An :class:`InvalidHeader` quotes one piece of a line
    alone (:func:`_invalid_header`)."""
    if isinstance(exc, InvalidHeader) and exc.args:
        return _invalid_header(exc.args[0])
    reason: list[str] = []
    data: bytes | None = None
    for line in message.split("\n"):
        text = line.strip()
        if data is None and text[:2] in ("b'", 'b"'):
            with contextlib.suppress(ValueError, SyntaxError):
                data = ast.literal_eval(text)
                continue
        if text and text.strip("^~ "):
            reason.append(text.rstrip(":"))
    # (aiohttp's Python parser quotes a request's target raw, in its message: control
    # characters escaped, a credential query parameter's value hidden)
    said = hidden_query(one_line(": ".join(reason))) or "Bad Request"
    if data is None:
        return said
    if _REQUEST_LINE.fullmatch(data):
        # ``POST /api/v1/write?api_key=<key> HTTP/1.1``: a sender's URL may carry its
        # credential in the query, as upstream.url may (shown as ``shown_url`` shows it)
        return f'{said}: "{shown(hidden_query(data.decode("latin-1")).encode("latin-1"))}"'
    name, colon, _ = data.partition(b":")
    if data[:1] in (b" ", b"\t"):
        # a folded line (obs-fold) goes on with the header above it, which may be an
        # Authorization: its text is the token's (``Authorization: Bearer\r\n <token>``)
        return f'{said}: "(a folded header line, not shown: it may go on with a credential)"'
    if not colon and b" HTTP/" not in data:
        # a line of the headers without a name (a value on a line of its own: ``Bearer
        # <token>``), or what follows an HTTP/2 preface: not a request line
        return f'{said}: "(a line with no header name, not shown: it may be a credential)"'
    if colon and credential_header(name.decode("latin-1")):
        return f'{said}: "{shown(name)}: (value not shown: a credential)"'
    return f'{said}: "{shown(data)}"'


def _invalid_header(piece: bytes | str) -> str:
    """aiohttp's :class:`InvalidHeader`: what its Python parser raises for every malformed
    header (the parser running where aiohttp's C extension is not: a Python it has no
    wheel for, a debug build, ``AIOHTTP_NO_EXTENSIONS``), and its C parser for a NUL in a
    value llhttp let through. It quotes the whole line, the name alone or the value
    alone, and nothing tells which: ``Authorization: Bearer <token>\x01`` was refused as
    ``Invalid HTTP header: b'Bearer <token>\x01'``, the token in the log and the answer.
    Bytes, the sender's, are shown by their length alone; a string is a header name of
    the parser's own (``Content-Length``, which it checks itself)."""
    if isinstance(piece, str):
        return f'Invalid HTTP header: "{shown(piece.encode("utf-8", "replace"))}"'
    return (f'Invalid HTTP header: "(a header line or its name or value, {len(piece)} '
            f'bytes, not shown: it may be a credential)"')


class _GuardedServer(web.Server):
    """aiohttp's low-level server, making ``_GuardedProtocol`` connections."""

    def __init__(self, *args: Any, header_timeout: float, on_timeout: OnTimeout,
                 shed: Shed | None, on_bad_http: OnBadHttp | None = None,
                 limit: ConnectionLimit | None = None, max_header_bytes: int = 1 << 20,
                 on_header_too_large: OnHeaderTooLarge | None = None,
                 on_ended: OnEnded | None = None,
                 send_timeout: float = SEND_TIMEOUT_SECONDS,
                 on_send_timeout: OnSendTimeout | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.on_timeout = on_timeout
        self.shed = shed
        self.on_bad_http = on_bad_http
        self.limit = limit
        self.max_header_bytes = max_header_bytes
        self.on_header_too_large: OnHeaderTooLarge = on_header_too_large or _ignore
        self.on_ended = on_ended
        self.send_timeout = send_timeout
        self.on_send_timeout = on_send_timeout

    def __call__(self) -> RequestHandler:
        return _GuardedProtocol(self, loop=self._loop, **self._kwargs)

    def uncounted(self) -> RequestHandler:
        """A connection's protocol under a TLS layer that counts the connection itself."""
        return _GuardedProtocol(self, limited=False, loop=self._loop, **self._kwargs)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Let the requests in flight finish for ``timeout`` at most, then end them: the
        stop takes ``timeout`` + ``CANCEL_GRACE_SECONDS`` at most.

        aiohttp's own (3.14) waits ``timeout`` for a handler, then "cancels" the request,
        which ends a handler reading the body but not one waiting on the upstream, and
        waits ``timeout`` again before it cancels the handler's task: a SIGTERM with
        requests on a slow upstream took 21 s where 10 were documented. Here its
        shutdown runs as it would, and once ``timeout`` has passed the connections'
        handler tasks are cancelled (their senders see the connection closed, and
        retry), which ends its second wait at once. How many requests that ended is told
        to ``on_ended``: their cancelled handlers count and log nothing, and 64 requests
        so ended left no trace.
        """
        drain = asyncio.ensure_future(super().shutdown(timeout))
        if timeout is None:
            await drain
            return
        connections = list(self._connections)
        done, _ = await asyncio.wait({drain}, timeout=timeout)
        if not done:
            ended = 0
            for conn in connections:
                task = conn._task_handler
                if task is not None and not task.done():
                    # a request being handled (not a connection reading the rest of a
                    # body after its answer)
                    ended += conn._request_in_progress
                    task.cancel()
            if ended and self.on_ended is not None:
                self.on_ended(ended)
            done, _ = await asyncio.wait({drain}, timeout=CANCEL_GRACE_SECONDS)
        if not done:  # a handler that would not end: its connection closed all the same
            for conn in connections:
                conn.force_close()
            drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drain


def _ignore(*_: str) -> None:
    pass


class GuardedRunner(web.AppRunner):
    """An ``AppRunner`` whose connections have a header deadline and, with ``shed``,
    shed overload on the headers."""

    def __init__(self, app: web.Application, *, header_timeout: float, on_timeout: OnTimeout,
                 shed: Shed | None = None, on_bad_http: OnBadHttp | None = None,
                 limit: ConnectionLimit | None = None, max_header_bytes: int = 1 << 20,
                 on_header_too_large: OnHeaderTooLarge | None = None,
                 on_ended: OnEnded | None = None,
                 send_timeout: float = SEND_TIMEOUT_SECONDS,
                 on_send_timeout: OnSendTimeout | None = None, **kwargs: Any) -> None:
        """``limit``: the connections open at once (none: no limit); ``max_header_bytes``:
        a request's line and headers in all, aiohttp's per-line limits set to fit it;
        ``on_ended``: told how many requests in flight a stop ended; ``send_timeout``:
        how long a client may leave bytes of an answer unsent, ``on_send_timeout`` told
        of each connection aborted for it. aiohttp's ``keepalive_timeout`` is among
        ``kwargs`` (its default is an hour)."""
        super().__init__(app, **header_limits(max_header_bytes), **kwargs)
        self._header_timeout = header_timeout
        self._on_timeout = on_timeout
        self._shed = shed
        self._on_bad_http = on_bad_http
        self._limit = limit
        self._max_header_bytes = max_header_bytes
        self._on_header_too_large = on_header_too_large
        self._on_ended = on_ended
        self._send_timeout = send_timeout
        self._on_send_timeout = on_send_timeout

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, freezes it
        return _GuardedServer(
            plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
            header_timeout=self._header_timeout, on_timeout=self._on_timeout,
            shed=self._shed, on_bad_http=self._on_bad_http, limit=self._limit,
            max_header_bytes=self._max_header_bytes,
            on_header_too_large=self._on_header_too_large, on_ended=self._on_ended,
            send_timeout=self._send_timeout, on_send_timeout=self._on_send_timeout,
            **plain._kwargs,
        )
