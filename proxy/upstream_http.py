"""The HTTP/1.1 client of the upstream: a pool of keep-alive connections and one POST and
its answer over an ``asyncio.Protocol``.

Purpose-built for one request shape (a POST of a body the proxy holds whole, its answer's
status, headers and first bytes) rather than aiohttp's general client, whose layers
(``ClientRequest``, ``StreamReader``, the payload writer, traces, the connector's
bookkeeping) cost the event loop thread ~0.16 ms a request against ~0.04 for the exchange
itself (``benchmarks/http_layer_bench.py``). The loop thread is what bounds the proxy's
2-core scaling (docs/performance.md). Every behaviour of aiohttp's client that the proxy
relied on is kept here, and what aiohttp did that the proxy had to turn off (cookies,
redirects, decompression, automatic headers) is simply not done:

- the request as aiohttp wrote it: ``Host`` first (the port unless the scheme's default,
  an IPv6 address in brackets; a ``Host`` among the headers replaces it there), the
  headers in their order, ``Accept: */*`` unless given, ``Content-Length``; the head and
  the body written as two writes, never joined into a copy;
- the answer: HTTP/1.0 and 1.1 status lines, interim 1xx answers skipped (not 101), heads
  bounded as aiohttp's were (8,190 bytes a line, 128 header lines), bodies by
  ``Content-Length``, chunked (trailers read and dropped) or the connection's close, none
  for 101, 204 and 304; only the first ``max_body`` bytes kept;
- a connection goes back to the pool only when its answer was read to its end, said
  nothing of closing (HTTP/1.1, or 1.0 with ``keep-alive``) and the request was all
  written; any other, and one whose exchange was cancelled, is closed;
- the pool: at most ``limit`` connections in use (the rest wait, in order: a freed
  slot is handed to the first waiter), idle ones reused oldest-released first and
  closed after ``idle_seconds`` idle, or once
  ``MAX_CONNECTION_SECONDS`` old (then the name is looked up again); names looked up with
  ``loop.getaddrinfo`` and kept ``DNS_TTL_SECONDS`` (``clear_dns_cache`` after a failed
  connect), the addresses of a name taken in turn by the connections made, and tried one
  after the other, interleaved by family, a next one started every
  ``HAPPY_EYEBALLS_DELAY`` seconds while the earlier ones have not connected (RFC 8305);
- TLS: the context given with each request (so a reloaded one makes the new connections:
  the pool keeps connections apart by context), ``server_hostname`` as given or the
  URL's host; closed with ``close_notify``.

What fails says what in one line, never the request's headers: ``ConnectFailed``
(including ``ConnectTimeout``), ``ConnectionEnded`` (closed or reset before the answer's
end: an idle close that crossed the request, or a lost answer, which cannot be told
apart, so nothing is ever sent again here), ``MalformedAnswer``; an answer whose body
broke off after its head is returned with ``broken`` set, its status the caller's to
weigh. A request that cannot be written (a line break in a header) raises
``ValueError`` before anything is sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import ipaddress
import re
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy import socks5
from proxy.egress_proxy import Egress
from proxy.tls_files import HEADER_VALUE_FORBIDDEN, go_client_context

#: how long a pooled connection is used at most: then the upstream's name is looked up
#: again, so a DNS change is followed within this much, a busy pool too
MAX_CONNECTION_SECONDS = 300.0
#: how long a name's addresses are kept (aiohttp's ``ttl_dns_cache``)
DNS_TTL_SECONDS = 10.0
#: the most names whose addresses are kept: ``{tenant}`` in the URL's host makes a name
#: per tenant, and senders choose tenants (under a wildcard DNS name each one resolves)
MAX_NAMES = 1024
#: the "Connection Attempt Delay" of RFC 8305 (aiohttp's ``happy_eyeballs_delay``)
HAPPY_EYEBALLS_DELAY = 0.25
#: the longest line of an answer's head (status line, header, chunk size), aiohttp's
MAX_LINE = 8190
#: the most header (or trailer) lines of an answer, aiohttp's
MAX_HEADERS = 128
#: the most bytes of one head: its lines at their longest
MAX_HEAD = (MAX_HEADERS + 1) * (MAX_LINE + 2) + 2
#: how long the pool's close waits for its connections to end (TLS's close_notify
#: answered) before it aborts the rest
CLOSE_WAIT_SECONDS = 1.0

#: the clock of a connection's age and idle time and of the names' cache (tests move it)
_connection_clock: Callable[[], float] = time.monotonic


class ClientError(Exception):
    """An exchange that gave no whole answer. Its text never holds the request's
    headers (they may carry credentials)."""


class ConnectFailed(ClientError):
    """No connection: the name not found, every address refused or unreachable, the TLS
    handshake failed."""


class ConnectTimeout(ConnectFailed):
    """No connection (TCP and TLS) within the connect timeout."""


class ConnectionEnded(ClientError):
    """The connection closed or was reset before the answer's end."""


class MalformedAnswer(ClientError):
    """An answer that is not HTTP/1.x as it must be (a bad status line, a header line
    too long or not a header, a bad chunk)."""


@dataclass(slots=True)
class Response:
    """One answer: its status and headers, the first ``max_body`` bytes of its body."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    #: the body broke off after the head (the connection closed or reset before its end):
    #: ``body`` is what came before
    broken: ConnectionEnded | None = None


#: a header block's lines as HTTP has them: a token, a colon, a value of visible
#: characters, spaces and tabs (obs-text too); no NUL, no lone CR or LF
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?:[ \t][\t\x20-\x7e\x80-\xff]*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")

# the parser's states
_HEAD, _LENGTH, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE, _DONE = (
    range(8))


def _tokens(headers: CIMultiDict[str], name: str) -> set[str]:
    return {t.strip().lower() for v in headers.getall(name, ()) for t in v.split(",")}


class _Connection(asyncio.Protocol):
    """One connection to the upstream and the exchange on it, one at a time: the answer
    parsed as its bytes arrive, its end a future's result."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: _Key) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        #: when it was made and when it was last put back idle (``_connection_clock``)
        self.born = _connection_clock()
        self.idle_since = self.born
        #: the transport ended, or the upstream said it ends (no more exchanges)
        self.ended = False
        #: resolved when the connection is lost
        self.lost: asyncio.Future[None] = loop.create_future()
        self._answer: asyncio.Future[Response] | None = None
        self._buf = bytearray()
        self._state = _DONE
        self._max_body = 0
        self._status = 0
        self._headers: CIMultiDict[str] | None = None
        self._body = bytearray()
        self._left = 0  # bytes of the body (or chunk) still to come
        self._trailer_lines = 0
        self._got_any = False
        #: the answer lets the connection be used again once read to its end
        self._keep = False

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            # bytes nobody asked for (on an idle connection, or after an answer): what
            # follows cannot be trusted to start an answer
            self.ended = True
            if self.transport is not None:
                self.transport.abort()
            return
        self._got_any = True
        try:
            self._feed(data)
        except MalformedAnswer as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self.ended = True
        self._at_end(None)
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._at_end(exc)
        if not self.lost.done():
            self.lost.set_result(None)

    # -- the exchange ---------------------------------------------------------------------

    def start(self, head: bytes, body: bytes, max_body: int) -> asyncio.Future[Response]:
        """Write a request; its answer is the future's result."""
        assert self.transport is not None
        self._answer = self.loop.create_future()
        self._state = _HEAD
        self._max_body = max_body
        self._got_any = False
        self._buf.clear()
        self._body.clear()
        self.transport.write(head)
        if body:
            self.transport.write(body)
        return self._answer

    def reusable(self) -> bool:
        """The exchange ended cleanly and nothing of it is left on the connection."""
        t = self.transport
        return (self._state == _DONE and self._keep and not self.ended and t is not None
                and not t.is_closing() and not self._buf and t.get_write_buffer_size() == 0)

    def close(self) -> None:
        """Close it: TLS with its close_notify; aborted when bytes of the request are
        still unwritten (a stalled upstream would hold them, and it, for ever)."""
        self.ended = True
        t = self.transport
        if t is None:
            return
        if t.get_write_buffer_size():
            t.abort()
        else:
            t.close()

    def _fail(self, exc: ClientError) -> None:
        self._state = _DONE
        self._keep = False
        self._buf.clear()
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        self.close()

    def _finish(self, broken: ConnectionEnded | None = None) -> None:
        self._state = _DONE
        assert self._headers is not None and self._answer is not None
        if not self._answer.done():
            self._answer.set_result(Response(self._status, CIMultiDictProxy(self._headers),
                                              bytes(self._body), broken))

    def _at_end(self, exc: Exception | None) -> None:
        """The connection ended (``exc``: how, None for a clean close)."""
        state = self._state
        if state == _DONE or self._answer is None or self._answer.done():
            return
        how = ("the upstream closed the connection" if exc is None
               else f"the connection ended ({exc or type(exc).__name__})")
        if state == _UNTIL_CLOSE and exc is None:
            self._finish()
        elif state == _HEAD:
            where = "the end of an answer's head" if self._got_any else "any byte of an answer"
            self._fail(ConnectionEnded(f"{how} before {where}"))
        else:
            self._keep = False
            self._finish(ConnectionEnded(f"{how} after {len(self._body)} bytes of the "
                                         "answer's body"))

    def _feed(self, data: bytes) -> None:
        while self._state == _HEAD:
            if not self._buf:  # the usual case: a whole head in one read, no copy
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    self._buf += data
                    self._bounded(MAX_HEAD, "head")
                    return
                head, data = data[:end + 2], data[end + 4:]
            else:
                start = max(0, len(self._buf) - 3)
                self._buf += data
                end = self._buf.find(b"\r\n\r\n", start)
                if end < 0:
                    self._bounded(MAX_HEAD, "head")
                    return
                head, data = bytes(self._buf[:end + 2]), bytes(self._buf[end + 4:])
                self._buf.clear()
            self._head(head)  # an interim answer's: the next head follows
            if not data:
                return
        if self._state != _DONE:
            self._body_bytes(data)
        elif data:  # bytes past the answer's end: not an answer to trust
            self._keep = False

    def _bounded(self, most: int, what: str) -> None:
        """The unfinished head, or chunked framing line, in the buffer: a line or the
        whole past its bound is refused (a hostile upstream grows no memory)."""
        last = self._buf.rfind(b"\n") + 1
        if len(self._buf) - last > MAX_LINE:
            raise MalformedAnswer(f"a line of the answer's {what} is longer than "
                                  f"{MAX_LINE} bytes")
        if len(self._buf) > most:
            raise MalformedAnswer(f"the answer's {what} is longer than {most} bytes")

    def _head(self, head: bytes) -> None:
        """A head, its last line's CRLF included."""
        line_end = head.find(b"\r\n")
        status_line = head[:line_end]
        m = _STATUS_LINE.fullmatch(status_line)
        if m is None or len(status_line) > MAX_LINE:
            raise MalformedAnswer(f"Invalid status code or version in the status line "
                                  f"{status_line[:100]!r}")
        lines = head[line_end + 2:]
        if _HEADER_LINES.fullmatch(lines) is None:
            raise MalformedAnswer("a header line of the answer is not a header "
                                  "(a control character, no colon, a folded line)")
        headers: CIMultiDict[str] = CIMultiDict()
        count = 0
        for line in lines.split(b"\r\n"):
            if not line:
                continue
            count += 1
            if count > MAX_HEADERS or len(line) > MAX_LINE:
                raise MalformedAnswer(f"the answer has more than {MAX_HEADERS} header lines "
                                      f"or one longer than {MAX_LINE} bytes")
            name, _, value = line.partition(b":")
            headers.add(name.decode("ascii"),
                        value.strip(b" \t").decode("utf-8", "surrogateescape"))
        status = int(m[2])
        if status < 100:
            raise MalformedAnswer(f"Invalid status code in the status line "
                                  f"{status_line[:100]!r}")
        if 100 <= status < 200 and status != 101:
            return  # interim (100 Continue, 103 Early Hints): the answer follows
        self._status, self._headers = status, headers
        connection = _tokens(headers, "Connection")
        keep = ("close" not in connection if m[1] == b"1" else "keep-alive" in connection)
        if status in (101, 204, 304):
            self._keep = keep and status != 101
            self._finish()
            return
        coding = headers.getall("Transfer-Encoding", ())
        lengths = headers.getall("Content-Length", ())
        if coding:
            chunked = [t.strip().lower() for v in coding for t in v.split(",")][-1] == "chunked"
            self._keep = keep and chunked and not lengths
            self._state = _CHUNK_SIZE_LINE if chunked else _UNTIL_CLOSE
        elif lengths:
            values = {v.strip() for v in lengths}
            length = values.pop()
            if values or not length.isascii() or not length.isdigit() or len(length) > 18:
                raise MalformedAnswer(f"Content-Length {', '.join(lengths)[:100]!r} is not "
                                      "one length")
            self._keep = keep
            self._left = int(length)
            self._state = _LENGTH
            if not self._left:
                self._finish()
        else:
            self._keep = False
            self._state = _UNTIL_CLOSE

    def _body_bytes(self, data: bytes) -> None:
        """Bytes after the head: the body, as its framing says, in one pass (a body of
        many chunks in one read recurses nowhere)."""
        if self._buf:  # a framing line began in the last read
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        view = memoryview(data)
        pos, size = 0, len(data)
        while pos < size and self._state != _DONE:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA):
                n = min(self._left, size - pos)
                self._left -= n
                if not self._collect(view[pos:pos + n]):
                    return
                pos += n
                if not self._left:
                    if state == _LENGTH:
                        self._finish()
                    else:
                        self._state = _CHUNK_END
            elif state == _UNTIL_CLOSE:
                if not self._collect(view[pos:]):
                    return
                pos = size
            else:  # a line of the chunked framing
                end = data.find(b"\r\n", pos)
                if end < 0:
                    self._buf += view[pos:]
                    self._bounded(MAX_LINE, "chunked framing")
                    return
                self._line(data[pos:end])
                pos = end + 2
        if self._state == _DONE and pos < size:
            self._keep = False  # bytes past the answer's end: not an answer to trust

    def _collect(self, data: memoryview) -> bool:
        """Body bytes: kept up to ``max_body``; past it the answer ends there (False), its
        connection not used again."""
        room = self._max_body - len(self._body)
        if len(data) > room:
            self._body += data[:room]
            self._keep = False
            self._finish()
            return False
        self._body += data
        return True

    def _line(self, line: bytes) -> None:
        """A line of the chunked framing: a chunk's size, the end of its data, a
        trailer (read and dropped) or the end of the trailers."""
        state = self._state
        if state == _CHUNK_END:
            if line:
                raise MalformedAnswer("a chunk of the answer's body is longer than its "
                                      "size said")
            self._state = _CHUNK_SIZE_LINE
        elif state == _CHUNK_SIZE_LINE:
            m = _CHUNK_SIZE.fullmatch(line)
            if m is None:
                raise MalformedAnswer(f"a bad chunk size line {line[:40]!r} in the "
                                      "answer's body")
            self._left = int(m[1], 16)
            if self._left:
                self._state = _CHUNK_DATA
            else:
                self._state, self._trailer_lines = _TRAILERS, 0
        elif not line:
            self._finish()
        else:
            self._trailer_lines += 1
            if self._trailer_lines > MAX_HEADERS or len(line) > MAX_LINE:
                raise MalformedAnswer("the answer's trailers are past their bounds")


#: a pool's connections are apart by (host, port, TLS context, server name, the HTTP
#: proxy they go through)
#: (host, port, TLS context, server name, proxy, the HTTPS proxy's TLS context)
_Key = tuple[str, int, "ssl.SSLContext | None", "str | None", "Egress | None",
             "ssl.SSLContext | None"]


@dataclass(slots=True, frozen=True)
class _Target:
    """What one URL means to the client, worked out once."""

    host: str  # as looked up (IDNA, no brackets)
    port: int
    tls: bool
    #: the host is an IP address: not looked up
    literal: bool
    #: ``POST <path?query> HTTP/1.1\r\n`` and ``Host: ...\r\n``
    request_line: bytes
    host_line: str
    #: the request line in absolute form (``POST http://host:port/path``), for an http://
    #: upstream reached through an HTTP proxy
    proxied_line: bytes
    #: ``host:port`` (the port always, an IPv6 address in brackets): what a ``CONNECT``
    #: asks the proxy for
    authority: str


@functools.lru_cache(maxsize=256)
def _target(url: URL) -> _Target:
    host = url.raw_host
    if not host or url.scheme not in ("http", "https") or url.port is None:
        raise ValueError("the upstream URL must be http:// or https:// with a host")
    if host.endswith(".."):
        host = host.rstrip(".") + "."
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    path = url.raw_path_qs or "/"
    return _Target(host, url.port, url.scheme == "https", literal,
                   f"POST {path} HTTP/1.1\r\n".encode("ascii"),
                   f"Host: {url.host_port_subcomponent}\r\n",
                   f"POST http://{url.host_port_subcomponent}{path} HTTP/1.1\r\n".encode(
                       "ascii"),
                   f"[{host}]:{url.port}" if ":" in host else f"{host}:{url.port}")


def request_head(target: _Target, headers: Mapping[str, str], length: int,
                 egress: Egress | None = None) -> bytes:
    """The request's head, as aiohttp wrote it (module docstring); through the HTTP proxy
    ``egress`` (an http:// upstream), in absolute form with its ``Proxy-Authorization``, as
    Go writes it (through a tunnel, a ``CONNECT``'s or a SOCKS5 proxy's, as directly).
    ``ValueError`` for a header that cannot be sent: a control character but HTAB in it
    (a line break would start a header of its own; aiohttp refused the same), or text
    that is not UTF-8 (a surrogate: aiohttp left it out, and
    ``X-Scope-OrgID: caf\\xe9`` went as ``caf``)."""
    items = list(headers.items())
    bad = HEADER_VALUE_FORBIDDEN.search("".join([k + v for k, v in items]))
    if bad:
        raise ValueError(f"a header name or value holds a control character "
                         f"({bad.group()!r}); a header is one line")
    lower = {k.lower() for k, _ in items}
    host = target.host_line
    if "host" in lower:  # the given Host where aiohttp put it, first
        host = [f"{k}: {v}\r\n" for k, v in items if k.lower() == "host"][-1]
        items = [(k, v) for k, v in items if k.lower() != "host"]
    text = "".join([f"{k}: {v}\r\n" for k, v in items])
    accept = "" if "accept" in lower else "Accept: */*\r\n"
    size = "" if "content-length" in lower else f"Content-Length: {length}\r\n"
    if egress is None or target.tls or egress.socks:
        return target.request_line + f"{host}{text}{accept}{size}\r\n".encode()
    auth = f"Proxy-Authorization: {egress.authorization}\r\n" if egress.authorization else ""
    return target.proxied_line + f"{host}{text}{accept}{size}{auth}\r\n".encode()


def _interleaved(infos: list[_AddrInfo]) -> list[_AddrInfo]:
    """Addresses by family in turn, the first family first (RFC 8305's interleave of 1,
    aiohappyeyeballs' order)."""
    families: dict[int, deque[_AddrInfo]] = {}
    for info in infos:
        families.setdefault(info[0], deque()).append(info)
    out: list[_AddrInfo] = []
    queues = list(families.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.popleft())
    return out


_AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]


async def _connect_one(loop: asyncio.AbstractEventLoop, info: _AddrInfo) -> socket.socket:
    family, kind, proto, _, address = info
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


async def _first_socket(loop: asyncio.AbstractEventLoop, infos: list[_AddrInfo]
                        ) -> socket.socket:
    """A connected socket to the first of ``infos`` that connects: each tried in turn, a
    next started ``HAPPY_EYEBALLS_DELAY`` after the last or at once when every one so far
    failed. Raises the failure (all of them, when several differ)."""
    if len(infos) == 1:
        return await _connect_one(loop, infos[0])
    pending: set[asyncio.Task[socket.socket]] = set()
    errors: list[BaseException] = []
    try:
        for i, info in enumerate(infos):
            pending.add(loop.create_task(_connect_one(loop, info)))
            last = i == len(infos) - 1
            until = loop.time() + HAPPY_EYEBALLS_DELAY
            while pending:
                wait = None if last else max(0.0, until - loop.time())
                done, pending = await asyncio.wait(pending, timeout=wait,
                                                   return_when=asyncio.FIRST_COMPLETED)
                won = [t for t in done if t.exception() is None]
                for task in won[1:]:
                    task.result().close()  # connected in the same turn: not used
                if won:
                    return won[0].result()
                errors.extend(e for t in done if (e := t.exception()) is not None)
                if not done or (not last and not pending):
                    break  # the delay passed, or all failed: the next address
    finally:
        for task in pending:
            task.cancel()
        for late in await asyncio.gather(*pending, return_exceptions=True):
            if isinstance(late, socket.socket):
                late.close()  # connected as it was cancelled
    texts = list(dict.fromkeys(str(e) for e in errors))
    if len(texts) == 1:
        raise errors[0]
    raise OSError(f"every address failed: {'; '.join(texts)}")


class _Names:
    """The upstream names' addresses, kept ``DNS_TTL_SECONDS``; concurrent look-ups of one
    name share one. Each connection made takes the next address first (aiohttp's round
    robin), so a name of several addresses spreads the pool over them."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], tuple[float, list[_AddrInfo], int]] = {}
        self._asking: dict[tuple[str, int], asyncio.Future[list[_AddrInfo]]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def _keep(self, key: tuple[str, int], entry: tuple[float, list[_AddrInfo], int]) -> None:
        """Keep ``entry``, the cache within ``MAX_NAMES``: past it the entries aged out
        go, then the oldest kept (a name asked again is looked up again)."""
        cache = self._cache
        cache[key] = entry
        if len(cache) > MAX_NAMES:
            now = _connection_clock()
            for old in [k for k, (at, _, _) in cache.items() if now - at > DNS_TTL_SECONDS]:
                del cache[old]
            while len(cache) > MAX_NAMES:
                del cache[next(iter(cache))]

    def _asked(self, key: tuple[str, int], asking: asyncio.Future[list[_AddrInfo]]) -> None:
        """A look-up ended: no longer shared, and its failure taken here too (its askers
        all gone, their deadlines passed, asyncio logged it as never retrieved)."""
        self._asking.pop(key, None)
        if not asking.cancelled():
            asking.exception()

    async def addresses(self, host: str, port: int, literal: bool) -> list[_AddrInfo]:
        if literal:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            address: tuple[Any, ...] = ((host, port, 0, 0) if family == socket.AF_INET6
                                        else (host, port))
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)]
        key = (host, port)
        entry = self._cache.get(key)
        if entry is None or _connection_clock() - entry[0] > DNS_TTL_SECONDS:
            asking = self._asking.get(key)
            if asking is None:
                asking = asyncio.ensure_future(self._look_up(host, port))
                self._asking[key] = asking
                asking.add_done_callback(functools.partial(self._asked, key))
            # shielded: one caller's deadline does not end the others' look-up
            infos = await asyncio.shield(asking)
            entry = self._cache.get(key) or (_connection_clock(), infos, 0)
        at, infos, turn = entry
        self._keep(key, (at, infos, turn + 1))
        turn %= len(infos)
        return infos[turn:] + infos[:turn]

    async def _look_up(self, host: str, port: int) -> list[_AddrInfo]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_ADDRCONFIG)
        found: list[_AddrInfo] = [i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)]
        if not found:
            raise OSError(f"no address for {host}")
        self._keep((host, port), (_connection_clock(), found, 0))
        return found


async def _tunnel(loop: asyncio.AbstractEventLoop, sock: socket.socket, egress: Egress,
                  host_port: str) -> None:
    """Open a ``CONNECT`` tunnel to ``host_port`` through the proxy ``sock`` is connected
    to; ``ConnectFailed`` with the proxy's status when it refuses (407: its credentials,
    ``proxy_url``'s user:password, missing or refused)."""
    await loop.sock_sendall(sock, egress.connect_request(host_port))
    head = b""
    while b"\r\n\r\n" not in head and len(head) <= MAX_HEAD:
        data = await loop.sock_recv(sock, 65536)
        if not data:
            break
        head += data
    _tunnel_answer(head, egress, host_port)


def _tunnel_answer(head: bytes, egress: Egress, host_port: str) -> None:
    """The proxy's answer to ``CONNECT host_port``, as much of it as came before its
    blank line, its bound, or the connection's end: ``ConnectFailed`` unless a 2xx head
    with nothing after it."""
    if b"\r\n\r\n" not in head:
        raise ConnectFailed(f"the {egress.kind} {egress.shown} answered CONNECT with a head "
                            "past its bounds" if len(head) > MAX_HEAD else
                            f"the {egress.kind} {egress.shown} closed the connection before "
                            f"answering CONNECT {host_port}")
    end = head.index(b"\r\n\r\n") + 4
    status = _STATUS_LINE.match(head)
    if status is None:
        raise ConnectFailed(f"the {egress.kind} {egress.shown} answered CONNECT with something "
                            f"not HTTP: {head[:40]!r}")
    code = int(status[2])
    if not 200 <= code < 300:
        why = (f": its credentials (the user:password of {egress.source}"
               f"{', or upstream.proxy_connect_header' if egress.connect_lines else ''}) "
               "missing or refused" if code == 407 else "")
        raise ConnectFailed(f"the {egress.kind} {egress.shown} answered {code} to CONNECT "
                            f"{host_port}{why}")
    if len(head) > end:  # the upstream's bytes before the TLS handshake: not a tunnel
        raise ConnectFailed(f"the {egress.kind} {egress.shown} sent bytes after its answer to "
                            f"CONNECT {host_port}")


class _TunnelHead(asyncio.Protocol):
    """An HTTPS proxy's answer to a ``CONNECT`` sent over TLS to it: ``done`` once its
    head is whole, past its bound, or the connection ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.head = b""
        self.done: asyncio.Future[None] = loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\r\n\r\n" in self.head or len(self.head) > MAX_HEAD:
            self._end()

    def eof_received(self) -> bool:
        self._end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _tls_tunnel(loop: asyncio.AbstractEventLoop, sock: socket.socket, egress: Egress,
                      proxy_tls: ssl.SSLContext, key: _Key, target: _Target
                      ) -> _Connection:
    """The connection to the upstream through an HTTPS proxy ``sock`` is connected to:
    TLS to the proxy (verified against its own name), then for an http:// upstream the
    requests in absolute form over it, for an https:// one a ``CONNECT`` and the
    upstream's TLS inside the proxy's, as Go's transport does."""
    tls, server_hostname = key[2], key[3]
    try:
        if tls is None:
            _, conn = await loop.create_connection(
                lambda: _Connection(loop, key), sock=sock, ssl=proxy_tls,
                server_hostname=egress.host)
            return conn
        transport, answer = await loop.create_connection(
            lambda: _TunnelHead(loop), sock=sock, ssl=proxy_tls, server_hostname=egress.host)
    except ssl.SSLError as e:  # told from the upstream's TLS, which comes after
        raise ConnectFailed(f"cannot speak TLS to the {egress.kind} {egress.shown}: {e}"
                            ) from e
    try:
        transport.write(egress.connect_request(target.authority))
        await answer.done
        _tunnel_answer(answer.head, egress, target.authority)
        conn = _Connection(loop, key)
        inner = await loop.start_tls(transport, conn, tls, server_hostname=server_hostname)
    except BaseException:
        transport.abort()
        raise
    if inner is None:  # the loop closed under it
        raise ConnectionEnded("the connection closed during the TLS handshake")
    conn.connection_made(inner)
    return conn


def basic_authorization(user: str, password: str) -> str:
    """A Basic Authorization value, UTF-8 as Go's clients send one."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """The context of an https upstream without TLS settings: the system's CAs, verified,
    ALPN ``http/1.1`` (aiohttp's default), verified as Go's clients verify
    (``go_client_context``). Made once: it reads the CA files."""
    ctx = go_client_context()
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Pool:
    """Keep-alive connections to the upstream, at most ``limit`` in use at once."""

    def __init__(self, *, limit: int, idle_seconds: float, connect_timeout: float) -> None:
        self.limit = limit
        self.idle_seconds = idle_seconds
        self.connect_timeout = connect_timeout
        self._idle: dict[_Key, deque[_Connection]] = {}
        self._in_use: set[_Connection] = set()
        #: slots taken by connections being made
        self._connecting = 0
        #: slots handed to woken waiters whose task has not taken them yet
        self._handed = 0
        #: each waiter's future: True, handed a slot; False, the pool closed
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._names = _Names()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def clear_dns_cache(self) -> None:
        """The next connection looks the name up again (a failed connect: the name may
        have moved)."""
        self._names.clear()

    async def post(self, url: URL, headers: Mapping[str, str], body: bytes, *,
                   tls: ssl.SSLContext | None, server_hostname: str | None,
                   max_body: int, egress: Egress | None = None,
                   proxy_tls: ssl.SSLContext | None = None) -> Response:
        """POST ``body`` to ``url`` with ``headers`` (``tls``: the context of an https
        URL), through the proxy ``egress`` if given (``proxy_tls``: the context an HTTPS
        one is verified with); the answer, its body's first ``max_body`` bytes."""
        target = _target(url)
        head = request_head(target, headers, len(body), egress)
        if not target.tls:
            tls = server_hostname = None
        elif tls is None:
            raise ValueError("an https upstream needs a TLS context")
        else:
            server_hostname = (server_hostname or target.host).rstrip(".")
        if egress is None or not egress.tls:
            proxy_tls = None
        elif proxy_tls is None:
            raise ValueError("an HTTPS proxy needs a TLS context")
        key: _Key = (target.host, target.port, tls, server_hostname, egress, proxy_tls)
        conn = await self._acquire(key, target)
        try:
            answer = await conn.start(head, body, max_body)
        except BaseException:
            conn.close()
            self._release(conn)
            raise
        self._release(conn)
        return answer

    # -- the pool -------------------------------------------------------------------------

    async def _acquire(self, key: _Key, target: _Target) -> _Connection:
        if self._closed:
            raise ConnectionEnded("the client is closed")
        if not self._room() and not await self._turn():
            raise ConnectionEnded("the client is closed")
        # an idle connection only with room in the pool: the idle ones of another key
        # (another host, TLS context) do not count, and would take it past its limit
        conn = self._reuse(key)
        if conn is not None:
            return conn
        self._connecting += 1
        try:
            conn = await self._connect(key, target)
        except BaseException:
            self._connecting -= 1
            self._wake()  # the slot is free again
            raise
        # the slot is the connection's now: no waiter woken (it would find the pool full
        # and queue again behind the later ones)
        self._connecting -= 1
        if self._closed:
            conn.close()
            raise ConnectionEnded("the client is closed")
        self._in_use.add(conn)
        return conn

    async def _turn(self) -> bool:
        """Wait in line for a slot: True once one is handed over (it is this caller's:
        take it before the next await), False if the pool closed meanwhile. A freed slot
        goes to the first waiter directly, counted in ``_handed`` until taken, so that a
        request arriving before the woken task runs finds no room and queues behind it
        (it took the slot, and the waiter queued again at the back)."""
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            handed = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._handed -= 1  # handed a slot and cancelled at once: the next one's
                self._wake()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        if handed:
            self._handed -= 1
        # handed a slot as the pool closed (close() ran before this task): no connection
        # made after it
        return handed and not self._closed

    def _room(self) -> bool:
        return len(self._in_use) + self._connecting + self._handed < self.limit

    def _reuse(self, key: _Key) -> _Connection | None:
        """An idle connection of ``key`` that may be used (oldest put back first), the
        ones that may not closed on the way."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = _connection_clock()
        while idle:
            conn = idle.popleft()
            if self._usable(conn, now):
                self._in_use.add(conn)
                return conn
            conn.close()
        del self._idle[key]
        return None

    def _usable(self, conn: _Connection, now: float) -> bool:
        """An idle connection may be used again: not ended, idle no longer than
        ``idle_seconds``, younger than ``MAX_CONNECTION_SECONDS``."""
        return (not conn.ended and now - conn.idle_since <= self.idle_seconds
                and now - conn.born < MAX_CONNECTION_SECONDS)

    def _release(self, conn: _Connection) -> None:
        """``conn``'s exchange ended: back to the pool if it may be used again, else
        closed; a waiter woken either way."""
        self._in_use.discard(conn)
        if conn.reusable() and not self._closed:
            conn.idle_since = _connection_clock()
            self._idle.setdefault(conn.key, deque()).append(conn)
            if self._sweep is None:
                self._sweep = asyncio.get_running_loop().call_later(
                    self.idle_seconds, self._swept)
        else:
            conn.close()
        self._wake()

    def _wake(self) -> None:
        """Hand the room there is to the first waiters."""
        while self._waiters and self._room():
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                self._handed += 1

    def _swept(self) -> None:
        """Close the connections idle past ``idle_seconds`` (or aged out), as aiohttp's
        cleanup did, so that an idle pool holds no connection the upstream will close."""
        self._sweep = None
        now = _connection_clock()
        for key in list(self._idle):
            kept: deque[_Connection] = deque()
            for conn in self._idle[key]:
                if self._usable(conn, now):
                    kept.append(conn)
                else:
                    conn.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if self._idle and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.idle_seconds,
                                                                self._swept)

    async def _connect(self, key: _Key, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, tls, server_hostname, egress, proxy_tls = key
        where = f"{target.host_line[6:-2]}"
        if egress is not None:
            host, port = egress.host, egress.port
            where += f" through the {egress.kind} {egress.shown}"
        try:
            infos = await self._names.addresses(host, port, target.literal if egress is None
                                                else egress.literal)
        except OSError as e:
            raise ConnectFailed(f"cannot look up {host}: {e}"
                                + (f" (the {egress.kind})" if egress is not None else "")
                                ) from e
        try:
            async with asyncio.timeout(self.connect_timeout):
                sock = await _first_socket(loop, _interleaved(infos))
                try:
                    if proxy_tls is not None and egress is not None:
                        return await _tls_tunnel(loop, sock, egress, proxy_tls, key,
                                                 target)
                    if egress is not None and egress.socks:
                        try:
                            await socks5.open_tunnel(loop, sock, egress, target.host,
                                                     target.port)
                        except socks5.SocksRefused as e:
                            raise ConnectFailed(str(e)) from e
                    elif egress is not None and tls is not None:
                        await _tunnel(loop, sock, egress, target.authority)
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop, key), sock=sock, ssl=tls,
                        server_hostname=server_hostname)
                except BaseException:
                    sock.close()
                    raise
        except TimeoutError as e:
            raise ConnectTimeout(f"no connection to {where} within "
                                 f"{self.connect_timeout:g} s") from e
        except ssl.SSLError as e:  # a certificate not trusted, a handshake refused
            raise ConnectFailed(f"cannot connect to {where} (TLS): {e}") from e
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {where}: {e}") from e
        return conn

    async def close(self) -> None:
        """Close every connection (TLS's with close_notify, waited for a bounded while);
        the requests waiting for one end with ``ConnectionEnded``."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        conns = [c for idle in self._idle.values() for c in idle] + list(self._in_use)
        self._idle.clear()
        self._in_use.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([c.lost for c in conns], timeout=CLOSE_WAIT_SECONDS)
            for conn in conns:
                if not conn.lost.done() and conn.transport is not None:
                    conn.transport.abort()
