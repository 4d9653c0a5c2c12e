"""Refused TLS handshakes on the listening side: counted by reason and logged, rate-limited.

asyncio drops a failed server-side handshake silently: ``SSLProtocol._fatal_error`` logs an
``OSError`` (``ssl.SSLError`` is one) only in loop debug mode, and the accept task that
awaits the handshake reports its exception only in debug mode too; a loop exception
handler is never called. So an agent refused for a missing or untrusted client
certificate, or one sending plain HTTP to the TLS port, left nothing on the proxy.

The one place that sees both the outcome and the peer is the TLS protocol of a connection,
so ``TLSSite`` makes it here: it listens without ``ssl=`` and its protocol factory returns
asyncio's own ``SSLProtocol`` (a subclass that remembers the peer address) around aiohttp's
connection protocol, with a handshake waiter whose done callback classifies a failure. That
is what ``loop.create_server(ssl=...)`` builds (``_make_ssl_transport``), so a valid
handshake runs the same code with the same timeouts; the cost is one callback per
connection. ``asyncio.sslproto`` is CPython's module, not a documented API:
tests/test_tls_handshake.py pins what is used of it (the constructor, the waiter, the
``SSLObject`` on ``_sslobj``).

The connection limit (``proxy.connection_guard.ConnectionLimit``) is taken here, by the
TLS protocol, when the TCP connection is made: a connection past it is closed before its
handshake (which costs more than its headers), and one whose handshake fails gives its
place back too (aiohttp's protocol never hears of it).

A client that connects and closes before its ClientHello (a ``tcpSocket`` probe, a port
check) is no handshake failure and is not counted.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import ssl
import time
from asyncio import sslproto
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from proxy.config import join_host_port
from proxy.connection_guard import ConnectionLimit, close_when_answered
from proxy.log import THROTTLE_SECONDS, Throttled

log = logging.getLogger("karta.tls")


class Reason(enum.StrEnum):
    """The ``reason`` label values, a closed set (docs/operations.md, TLS)."""

    NO_CLIENT_CERTIFICATE = enum.auto()
    UNTRUSTED_CERTIFICATE = enum.auto()
    SERVER_CERTIFICATE_REJECTED = enum.auto()
    CLIENT_CLOSED = enum.auto()
    NOT_TLS = enum.auto()
    PROTOCOL = enum.auto()
    TIMEOUT = enum.auto()
    OTHER = enum.auto()


REASONS: tuple[Reason, ...] = tuple(Reason)

#: OpenSSL's reason codes (``ssl.SSLError.reason``) -> the label; the rest is ``other``
_BY_SSL_REASON: dict[str, Reason] = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": Reason.NO_CLIENT_CERTIFICATE,
    "CERTIFICATE_VERIFY_FAILED": Reason.UNTRUSTED_CERTIFICATE,
    # the client's alert: it did not accept the proxy's certificate
    "TLSV1_ALERT_UNKNOWN_CA": Reason.SERVER_CERTIFICATE_REJECTED,
    "SSLV3_ALERT_BAD_CERTIFICATE": Reason.SERVER_CERTIFICATE_REJECTED,
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": Reason.SERVER_CERTIFICATE_REJECTED,
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": Reason.SERVER_CERTIFICATE_REJECTED,
    "SSLV3_ALERT_CERTIFICATE_REVOKED": Reason.SERVER_CERTIFICATE_REJECTED,
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": Reason.SERVER_CERTIFICATE_REJECTED,
    "TLSV1_ALERT_ACCESS_DENIED": Reason.SERVER_CERTIFICATE_REJECTED,
    # the first bytes are no TLS record: plain HTTP, a proxy CONNECT, anything else
    "HTTP_REQUEST": Reason.NOT_TLS,
    "HTTPS_PROXY_REQUEST": Reason.NOT_TLS,
    "WRONG_VERSION_NUMBER": Reason.NOT_TLS,
    "PACKET_LENGTH_TOO_LONG": Reason.NOT_TLS,
    "RECORD_LAYER_FAILURE": Reason.NOT_TLS,
    # TLS, but nothing both sides speak: version, cipher, group, signature algorithm
    "UNSUPPORTED_PROTOCOL": Reason.PROTOCOL,
    "NO_PROTOCOLS_AVAILABLE": Reason.PROTOCOL,
    "VERSION_TOO_LOW": Reason.PROTOCOL,
    "WRONG_SSL_VERSION": Reason.PROTOCOL,
    "NO_SHARED_CIPHER": Reason.PROTOCOL,
    "NO_SHARED_GROUPS": Reason.PROTOCOL,
    "NO_SUITABLE_SIGNATURE_ALGORITHM": Reason.PROTOCOL,
    "INAPPROPRIATE_FALLBACK": Reason.PROTOCOL,
    "TLSV1_ALERT_PROTOCOL_VERSION": Reason.PROTOCOL,
    "TLSV1_ALERT_INAPPROPRIATE_FALLBACK": Reason.PROTOCOL,
    "SSLV3_ALERT_HANDSHAKE_FAILURE": Reason.PROTOCOL,
    "TLSV1_ALERT_INSUFFICIENT_SECURITY": Reason.PROTOCOL,
}

#: at most one log line per reason in this many seconds
LOG_INTERVAL_SECONDS = THROTTLE_SECONDS


@dataclass(frozen=True, slots=True)
class Refusal:
    """One failed handshake, as counted and logged."""

    reason: Reason
    #: OpenSSL's reason code (``PEER_DID_NOT_RETURN_A_CERTIFICATE``, ...), "" without one
    ssl_reason: str
    #: the error as ssl words it (with the verification message for a certificate)
    error: str
    #: "host:port" of the client
    peer: str


def classify(exc: BaseException, *, hello_seen: bool) -> tuple[Reason, str] | None:
    """(reason, OpenSSL's code) of a handshake that ended with ``exc``; None when it is no
    refusal: the client left before saying anything (``hello_seen`` False)."""
    if isinstance(exc, ssl.SSLError):
        code = getattr(exc, "reason", None) or ""  # set by OpenSSL, absent when made by hand
        return _BY_SSL_REASON.get(code, Reason.OTHER), code
    if isinstance(exc, ConnectionAbortedError):  # SSLProtocol's handshake timeout
        return Reason.TIMEOUT, ""
    if isinstance(exc, ConnectionError) and hello_seen:
        # gone after its ClientHello without an alert: most often a client that did not
        # accept the proxy's certificate (Python's ssl sends no alert), or a scanner
        return Reason.CLIENT_CLOSED, ""
    return None


#: what ssl wraps OpenSSL's words in: "[SSL: CODE] words (_ssl.c:1006)"
_SSL_WRAPPING = re.compile(r"^\[SSL: \w+\] |\s*\(_ssl\.c:\d+\)$")


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return _SSL_WRAPPING.sub("", exc.strerror or str(exc))
    if isinstance(exc, ConnectionResetError) and not str(exc):  # SSLProtocol's EOF
        return "connection closed by the client"
    return str(exc) or type(exc).__name__


def _peer_text(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return join_host_port(str(peer[0]), peer[1])
    return str(peer or "")


class Refusals:
    """Counts refused handshakes and logs them: the first of a reason at once, the rest of
    its ``interval`` in one summary line at the end of it (``proxy.log.Throttled``), so a
    fleet of misconfigured agents retrying every second makes one line per reason per
    interval, not thousands."""

    def __init__(self, count: Callable[[str], None] | None = None, *,
                 interval: float = LOG_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``count`` is told each failure's reason (the label value) before it is logged."""
        self._count = count
        self._lines = Throttled(log, "TLS handshake failed", "TLS handshakes failed",
                                interval=interval, clock=clock)

    @property
    def interval(self) -> float:
        return self._lines.interval

    @interval.setter
    def interval(self, seconds: float) -> None:
        self._lines.interval = seconds

    def refused(self, r: Refusal) -> None:
        if self._count is not None:
            self._count(r.reason.value)
        self._lines.event(r.reason.value, {
            "peer": r.peer, "reason": r.reason.value, "ssl_reason": r.ssl_reason,
            "error": r.error})

    def close(self) -> None:
        """Write what waits for a summary now (the proxy is stopping) and cancel the timers."""
        self._lines.close()


#: the TLS protocol's own read buffer (``SSLProtocol.max_size``, asyncio's 256 KiB): made
#: and zero-filled in the constructor, before a byte arrives, so every connection held it
#: from its accept. 1,000 silent connections cost 304 KiB each with asyncio's size, 80 KiB
#: with this one (docs/operations.md). A TLS record holds 16 KiB of data at most, so a
#: read still takes two of them; a multi-MB body streams as before, in more reads.
READ_BUFFER_BYTES = 32 * 1024


class TLSConnections:
    """The listener's TLS connections open now, each with the context it was made with.

    A context checks a client certificate in the handshake only, and a keep-alive
    connection lives for as long as its sender keeps it (hours): a client whose CA was
    removed from the bundle went on writing on the connection it had. ``retire`` is how
    a change of trust reaches the connections already open (``proxy.tls``)."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: set[_WatchedTLS] = set()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, proto: _WatchedTLS) -> None:
        self._open.add(proto)

    def discard(self, proto: _WatchedTLS) -> None:
        self._open.discard(proto)

    def retire(self, current: ssl.SSLContext) -> int:
        """Close every connection made with another context than ``current``: after the
        answer to its request in flight, at once when idle, and one still in its handshake
        at once (it would finish under the old trust). Returns how many."""
        retired = 0
        for proto in list(self._open):
            if proto.context is current or proto.retired:
                continue
            proto.retire()
            retired += 1
        return retired


class _WatchedTLS(sslproto.SSLProtocol):
    """asyncio's TLS protocol, remembering the peer for the refusal's log line, and
    counting its connection against ``limit``."""

    max_size = READ_BUFFER_BYTES
    peer: str = ""
    limit: ConnectionLimit | None = None
    #: the connection holds a place in ``limit``
    counted: bool = False
    #: closed at once past ``limit``: no handshake was started
    refused: bool = False
    #: where the connection is listed while open, so that a change of trust reaches it
    connections: TLSConnections | None = None
    #: the context it was made with, and the connection protocol above it
    context: ssl.SSLContext | None = None
    app: asyncio.BaseProtocol | None = None
    #: its handshake succeeded (the connection protocol has the connection)
    handshaken: bool = False
    #: closed, or closing, because the trust it was made under is gone
    retired: bool = False
    _tcp: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.limit is not None:
            if not self.limit.take(transport):
                self.refused = True
                return
            self.counted = True
        self._tcp = transport
        if self.connections is not None:
            self.connections.add(self)
        self.peer = _peer_text(transport.get_extra_info("peername"))
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        if self.connections is not None:
            self.connections.discard(self)
        if self.counted and self.limit is not None:
            self.counted = False
            self.limit.give_back()
        super().connection_lost(exc)

    def retire(self) -> None:
        self.retired = True
        if self.app is not None and (self.handshaken or _has_connection(self.app)):
            close_when_answered(self.app)
        elif self._tcp is not None:
            cast(asyncio.Transport, self._tcp).abort()


def _has_connection(app: asyncio.BaseProtocol) -> bool:
    """The connection protocol was given its connection: the handshake is over, though
    ``handshaken`` is set a turn of the loop later (the waiter's done callback). A retire
    in that turn aborted TCP (a reset, and a request the client may have sent already
    lost) where the connection protocol can close it after its answer."""
    return getattr(app, "transport", None) is not None


def _hello_seen(proto: _WatchedTLS) -> bool:
    # a server-side SSLObject knows the shared ciphers once the ClientHello is read
    sslobj = getattr(proto, "_sslobj", None)
    try:
        return sslobj is not None and sslobj.shared_ciphers() is not None
    except (ssl.SSLError, ValueError):
        return False


#: the listener's context: one, or where to ask for the current one per connection
ContextSource = ssl.SSLContext | Callable[[], ssl.SSLContext]


def tls_protocol_factory(
    loop: asyncio.AbstractEventLoop, app_factory: Callable[[], asyncio.BaseProtocol],
    context: ContextSource, refusals: Refusals, *, handshake_timeout: float | None = None,
    limit: ConnectionLimit | None = None, connections: TLSConnections | None = None,
) -> Callable[[], asyncio.BaseProtocol]:
    """A protocol factory for a plain listener that serves TLS as ``create_server(ssl=)``
    would, and reports each failed handshake to ``refusals``; with ``limit``, counts its
    connections against it (``app_factory``'s protocols must not count them again); with
    ``connections``, lists each open connection there.

    ``context`` may be a callable, asked for the context of each new connection: a
    rotated certificate or client CA is a new context (proxy/tls.py), never a change to
    the one connections already open were made with."""
    current: Callable[[], ssl.SSLContext] = (
        (lambda: context) if isinstance(context, ssl.SSLContext) else context)

    def make() -> asyncio.BaseProtocol:
        waiter = loop.create_future()
        app, ctx = app_factory(), current()
        # typeshed says int for SSLProtocol's timeout; asyncio takes any number of seconds
        # (create_server's own parameter is a float), and it is a float setting here
        proto = _WatchedTLS(loop, app, ctx, waiter, server_side=True,
                            ssl_handshake_timeout=handshake_timeout)  # type: ignore[arg-type]
        proto.limit, proto.connections, proto.context, proto.app = limit, connections, ctx, app

        def done(f: asyncio.Future[None]) -> None:
            exc = None if f.cancelled() else f.exception()  # also marks it retrieved
            if exc is None:
                proto.handshaken = True
                return
            if proto.retired:  # ended by ``retire``, not refused
                return
            try:
                found = classify(exc, hello_seen=_hello_seen(proto))
                if found is not None:
                    refusals.refused(Refusal(found[0], found[1], _error_text(exc), proto.peer))
            except Exception:  # never let accounting break the loop's callback
                log.exception("TLS handshake failure not recorded")

        waiter.add_done_callback(done)
        return proto

    return make


class TLSSite(web.BaseSite):
    """aiohttp's ``TCPSite`` for HTTPS, with the TLS layer made by ``tls_protocol_factory``."""

    __slots__ = ("_connections", "_context", "_handshake_timeout", "_host", "_port",
                 "_refusals", "_reuse_address")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 ssl_context: ContextSource, refusals: Refusals,
                 reuse_address: bool | None = None,
                 handshake_timeout: float | None = None,
                 connections: TLSConnections | None = None) -> None:
        """``ssl_context``: the context, or a callable giving the current one (asked per
        connection, ``tls_protocol_factory``); ``connections``: where the open ones are
        listed, for ``TLSConnections.retire``."""
        self._context = ssl_context
        self._connections = connections
        first = ssl_context if isinstance(ssl_context, ssl.SSLContext) else ssl_context()
        super().__init__(runner, ssl_context=first)
        self._host, self._port, self._reuse_address = host, port, reuse_address
        self._refusals = refusals
        self._handshake_timeout = handshake_timeout

    @property
    def name(self) -> str:
        return f"https://{join_host_port(self._host or '0.0.0.0', self._port)}"

    async def start(self) -> None:
        await super().start()
        server, context = self._runner.server, self._context
        assert server is not None
        loop = asyncio.get_running_loop()
        # a guarded server's limit is taken by the TLS layer, its own protocols do not count
        limit: ConnectionLimit | None = getattr(server, "limit", None)
        app_factory = getattr(server, "uncounted", server) if limit is not None else server
        self._server = await loop.create_server(
            tls_protocol_factory(loop, app_factory, context, self._refusals,
                                 handshake_timeout=self._handshake_timeout, limit=limit,
                                 connections=self._connections),
            self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address)
