"""The upstream's HTTP/1.1 client (``proxy.upstream_http``) against raw loopback servers
that answer byte for byte as told: framing, interim answers, bounds, broken and early
answers, connection reuse, the pool's limit, idle and age bounds, cancellation, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from proxy import upstream_http
from proxy.egress_proxy import Egress, parse_egress
from proxy.upstream_http import (
    MAX_LINE,
    ConnectFailed,
    ConnectionEnded,
    ConnectTimeout,
    MalformedAnswer,
    Pool,
    Response,
)
from tests.ipv6 import needs_ipv6
from tests.tls_certs import Authority

OK = b"HTTP/1.1 204 No Content\r\n\r\n"
CLOSE = b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Raw:
    """A loopback server whose connections run ``handler``; what it saw kept."""

    port: int
    #: the peer of each connection, in the order they came
    peers: list[tuple[str, int]] = field(default_factory=list)
    #: each request's head, as it arrived
    heads: list[bytes] = field(default_factory=list)
    #: connections open now, and the most at once
    open: int = 0
    most: int = 0
    #: how each connection ended as the server saw it: "eof" (the client closed)
    ends: list[str] = field(default_factory=list)
    #: the peer of each request ``answering`` answered
    served: list[tuple[str, int]] = field(default_factory=list)

    def url(self, host: str = "127.0.0.1") -> URL:
        return URL(f"http://{host}:{self.port}/api/v1/write")


async def read_request(reader: asyncio.StreamReader, raw: Raw) -> bytes:
    """One request: its head (kept) and ``Content-Length`` bytes of body."""
    head = await reader.readuntil(b"\r\n\r\n")
    raw.heads.append(head)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)


def answering(*answers: bytes, then_close: bool = False,
              release: asyncio.Event | None = None) -> Callable[[Raw], Handler]:
    """A server that reads each request whole and writes the next of ``answers`` (a 204
    once they are all written; ``release``: once it is set), as long as the connection
    lasts (``then_close``: closes it after each), and notes how the client ended it."""
    queue = list(answers)

    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await read_request(reader, raw)
                except asyncio.IncompleteReadError:
                    raw.ends.append("eof")
                    return
                except ConnectionError:
                    raw.ends.append("reset")
                    return
                raw.served.append(writer.get_extra_info("peername")[:2])
                if release is not None:
                    await release.wait()
                writer.write(queue.pop(0) if queue else OK)
                await writer.drain()
                if then_close:
                    return
        return handle
    return make


@contextlib.asynccontextmanager
async def serving(make: Callable[[Raw], Handler], host: str = "127.0.0.1",
                  ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Raw]:
    raw = Raw(0)
    handler = make(raw)
    handlers: set[asyncio.Task[None]] = set()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        raw.peers.append(writer.get_extra_info("peername")[:2])
        raw.open += 1
        raw.most = max(raw.most, raw.open)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # cancelled: the test is over
        finally:
            raw.open -= 1
            writer.close()
            handlers.discard(task)

    server = await asyncio.start_server(run, host, 0, ssl=ssl_context)
    raw.port = server.sockets[0].getsockname()[1]
    try:
        yield raw
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def pool(limit: int = 4, idle: float = 30.0, connect: float = 2.0
               ) -> AsyncIterator[Pool]:
    p = Pool(limit=limit, idle_seconds=idle, connect_timeout=connect)
    try:
        yield p
    finally:
        await p.close()


async def post(p: Pool, url: URL, body: bytes = b"body", *, max_body: int = 4096,
               headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None,
               server_hostname: str | None = None, egress: Egress | None = None,
               proxy_tls: ssl.SSLContext | None = None) -> Response:
    async with asyncio.timeout(10):
        return await p.post(url, headers or {"Content-Type": "application/x-protobuf"}, body,
                            tls=tls, server_hostname=server_hostname, max_body=max_body,
                            egress=egress, proxy_tls=proxy_tls)


async def test_the_request_is_written_as_aiohttp_wrote_it() -> None:
    async with serving(answering(OK, OK)) as raw, pool() as p:
        await post(p, raw.url(), b"xyz", headers={"X-Scope-OrgID": "t", "User-Agent": "u"})
        await post(p, raw.url(), b"", headers={"host": "virtual.test", "Accept": "a/b"})
    assert raw.heads == [
        (f"POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1:{raw.port}\r\nX-Scope-OrgID: t\r\n"
         "User-Agent: u\r\nAccept: */*\r\nContent-Length: 3\r\n\r\n").encode(),
        # a Host given is sent in the place of the URL's, an Accept given instead of */*
        b"POST /api/v1/write HTTP/1.1\r\nhost: virtual.test\r\nAccept: a/b\r\n"
        b"Content-Length: 0\r\n\r\n",
    ]


def test_the_host_line_of_a_url() -> None:
    for url, host in [("http://[::1]:9090/w", "[::1]:9090"), ("https://tsdb:443/w?a=1", "tsdb"),
                      ("http://caf\u00e9.test/w", "xn--caf-dma.test")]:
        head = upstream_http.request_head(upstream_http._target(URL(url)), {}, 0)
        assert head.split(b"\r\n")[1] == f"Host: {host}".encode(), head


@pytest.mark.parametrize("header", [{"X-A": "a\r\nX-Injected: 1"}, {"X-A": "a\0"},
                                    {"X-A\n": "a"}, {"X-A": "caf\udce9"}])
async def test_a_header_that_cannot_be_sent_is_refused_before_anything_is(
        header: dict[str, str]) -> None:
    async with serving(answering(OK)) as raw, pool() as p:
        with pytest.raises(ValueError):
            await post(p, raw.url(), headers=header)
        assert (await post(p, raw.url(), headers={"X-A": "tab\tok"})).status == 204
    assert len(raw.heads) == 1 and b"X-A: tab\tok\r\n" in raw.heads[0]


@pytest.mark.parametrize(("answer", "body", "reused"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", True),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n", b"hello world", True),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", b"", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive\r\n\r\nok", b"ok", True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
     b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
    (b"HTTP/1.1 304 Not Modified\r\n\r\n", b"", True),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", b"", False),
])
async def test_answers_by_their_framing(answer: bytes, body: bytes, reused: bool) -> None:
    """Each framing read to its end: the connection used again only when the answer
    allows it (HTTP/1.1 without close, 1.0 with keep-alive; never after a 101)."""
    async with serving(answering(answer, OK)) as raw, pool() as p:
        first = await post(p, raw.url())
        second = await post(p, raw.url())
    status = int(answer.rsplit(b"HTTP/1.", 1)[1][2:5])
    assert (first.status, first.body, first.broken) == (status, body, None)
    assert second.status == 204
    assert (len(set(raw.peers)) == 1) is reused, raw.peers


async def test_an_answer_split_across_reads_is_put_together() -> None:
    answer = (b"HTTP/1.1 400 Bad\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")

    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader, raw)
            for i in range(len(answer)):  # a byte a write
                writer.write(answer[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0)
        return handle

    async with serving(make) as raw, pool() as p:
        got = await post(p, raw.url())
    assert (got.status, got.headers["X-A"], got.body) == (400, "1", b"abcde")


async def test_a_close_delimited_body_ends_with_the_connection() -> None:
    async with serving(answering(b"HTTP/1.1 500 Oops\r\n\r\nall of it", OK,
                                 then_close=True)) as raw, pool() as p:
        first = await post(p, raw.url())
        second = await post(p, raw.url())
    assert (first.status, first.body, first.broken) == (500, b"all of it", None)
    assert second.status == 204 and len(set(raw.peers)) == 2


async def test_only_the_first_bytes_of_a_body_are_kept_and_its_connection_closed() -> None:
    big = b"x" * 100_000
    async with serving(answering(
            b"HTTP/1.1 400 Bad\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big), OK,
            then_close=False)) as raw, pool() as p:
        first = await post(p, raw.url(), max_body=4096)
        second = await post(p, raw.url())
    assert first.body == big[:4096] and second.status == 204
    assert len(set(raw.peers)) == 2


async def test_headers_are_a_case_insensitive_multidict() -> None:
    async with serving(answering(b"HTTP/1.1 429 Slow\r\nretry-after: 7\r\nX-V: a\r\n"
                                 b"X-V: b\r\nContent-Length: 0\r\n\r\n")) as raw, pool() as p:
        got = await post(p, raw.url())
    assert got.headers.get("Retry-After") == "7" and got.headers.getall("x-v") == ["a", "b"]


@pytest.mark.parametrize(("answer", "said"), [
    (b"HTTP/1.1 abc\r\n\r\n", "Invalid status code"),
    (b"HTTP/2 200\r\n\r\n", "Invalid status code"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "Invalid status code"),
    (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n\r\n", "not a header"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header"),
    (b"HTTP/1.1 200 OK\r\nX-A: a\r\n folded\r\n\r\n", "not a header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "not one length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "not one length"),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "longer than"),
    (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * MAX_LINE + b"\r\n\r\n", "8190"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * 129 + b"\r\n", "128 header lines"),
])
async def test_a_malformed_answer_is_refused(answer: bytes, said: str) -> None:
    async with serving(answering(answer)) as raw, pool() as p:
        with pytest.raises(MalformedAnswer, match=said):
            await post(p, raw.url())


async def test_a_head_that_never_ends_is_refused_at_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile upstream's endless head (header lines that never end, or one line) grows
    no memory past the bound: the exchange fails there, the rest never read."""
    most = [0]
    received = upstream_http._Connection.data_received

    def data_received(self: upstream_http._Connection, data: bytes) -> None:
        received(self, data)
        most[0] = max(most[0], len(self._buf))

    monkeypatch.setattr(upstream_http._Connection, "data_received", data_received)

    def endless(line: bytes) -> Callable[[Raw], Handler]:
        def make(raw: Raw) -> Handler:
            async def handle(reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
                await read_request(reader, raw)
                writer.write(b"HTTP/1.1 200 OK\r\n")
                batch = line * (65536 // len(line))
                with contextlib.suppress(ConnectionError):
                    for _ in range(64):  # 4 MiB, 4x the bound
                        writer.write(batch)
                        await writer.drain()
            return handle
        return make

    for line, said in [(b"X-A: " + b"a" * 120 + b"\r\n", "head is longer than"),
                       (b"a" * 128, "longer than 8190")]:
        most[0] = 0
        async with serving(endless(line)) as raw, pool() as p:
            with pytest.raises(MalformedAnswer, match=said):
                await post(p, raw.url())
        assert most[0] <= upstream_http.MAX_HEAD, most


async def test_a_2xx_whose_body_breaks_off_is_returned_broken() -> None:
    async with serving(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nstored",
                                 then_close=True)) as raw, pool() as p:
        got = await post(p, raw.url())
    assert (got.status, got.body) == (200, b"stored")
    assert isinstance(got.broken, ConnectionEnded)
    assert "after 6 bytes of the answer's body" in str(got.broken)


@pytest.mark.parametrize("reset", [False, True])
async def test_a_connection_that_ends_before_an_answer(reset: bool) -> None:
    """Closed or reset before any byte of an answer (an idle close that crossed the
    request, or a lost answer: which, the client cannot tell, so it never resends)."""
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader, raw)
            if reset:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            writer.transport.abort() if reset else writer.close()
        return handle

    async with serving(make) as raw, pool() as p:
        with pytest.raises(ConnectionEnded, match="before any byte of an answer") as e:
            await post(p, raw.url())
    assert ("reset" in str(e.value)) is reset, e.value
    assert len(raw.heads) == 1  # sent once, not again


async def test_an_early_answer_then_close_is_the_answer() -> None:
    """An upstream that refuses a body by its head (a 413 before reading it) and closes:
    its answer, not a broken write, is what the client returns."""
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw.heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 8\r\n"
                         b"Connection: close\r\n\r\ntoo big!")
            await writer.drain()
            writer.close()
        return handle

    async with serving(make) as raw, pool() as p:
        got = await post(p, raw.url(), b"\0" * (8 << 20))
        got_again = await post(p, raw.url(), b"\0" * (8 << 20))
    assert (got.status, got.body) == (413, b"too big!")
    assert got_again.status == 413 and len(set(raw.peers)) == 2


async def test_the_pool_holds_at_most_its_limit_and_the_rest_wait() -> None:
    release = asyncio.Event()
    async with serving(answering(release=release)) as raw, pool(limit=2) as p:
        posts = [asyncio.create_task(post(p, raw.url())) for _ in range(5)]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(raw.heads) == 2:
                break
        await asyncio.sleep(0.05)
        assert len(raw.heads) == 2 and raw.most == 2  # three wait for a connection
        release.set()
        assert [a.status for a in await asyncio.gather(*posts)] == [204] * 5
    assert len(set(raw.peers)) == 2 and raw.most == 2


async def test_a_waiter_cancelled_leaves_the_pool_whole() -> None:
    release = asyncio.Event()
    async with serving(answering(release=release)) as raw, pool(limit=1) as p:
        holder = asyncio.create_task(post(p, raw.url()))
        waiter = asyncio.create_task(post(p, raw.url()))
        await asyncio.sleep(0.1)
        waiter.cancel()
        release.set()
        assert (await holder).status == 204
        assert (await post(p, raw.url())).status == 204
    assert len(set(raw.peers)) == 1


async def test_a_connection_idle_past_its_idle_time_is_not_used_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = [0.0]
    real = time.monotonic
    monkeypatch.setattr(upstream_http, "_connection_clock", lambda: real() + ahead[0])
    async with serving(answering()) as raw, pool(idle=4.0) as p:
        for idle in (0.0, 3.9, 4.1, 3.0):
            ahead[0] += idle
            assert (await post(p, raw.url())).status == 204
    first, after_3_9, after_4_1, after_3 = raw.served
    assert first == after_3_9 != after_4_1 == after_3


async def test_a_connection_300_s_old_is_not_used_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = [0.0]
    real = time.monotonic
    monkeypatch.setattr(upstream_http, "_connection_clock", lambda: real() + ahead[0])
    async with serving(answering()) as raw, pool() as p:
        for _ in range(17):  # at 0, 20, ... 320 s, never idle past 30 s
            assert (await post(p, raw.url())).status == 204
            ahead[0] += 20.0
    assert raw.served[:15] == [raw.served[0]] * 15 and raw.served[15] != raw.served[0]
    assert raw.served[15] == raw.served[16]


async def test_an_idle_connection_is_closed_by_the_pool_after_its_idle_time() -> None:
    async with serving(answering(OK)) as raw, pool(idle=0.2) as p:
        assert (await post(p, raw.url())).status == 204
        for _ in range(100):
            await asyncio.sleep(0.02)
            if raw.ends:
                break
        assert raw.ends == ["eof"]


async def test_a_cancelled_exchange_closes_its_connection_and_frees_its_place() -> None:
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader, raw)
            if len(raw.heads) == 1:  # never answers; the client's end is noted
                raw.ends.append("eof" if await reader.read() == b"" else "data")
                return
            writer.write(OK)
            await writer.drain()
        return handle

    async with serving(make) as raw, pool(limit=1) as p:
        task = asyncio.create_task(post(p, raw.url()))
        while not raw.heads:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await post(p, raw.url())).status == 204
        for _ in range(100):
            if raw.ends:
                break
            await asyncio.sleep(0.02)
    assert raw.ends == ["eof"] and len(set(raw.peers)) == 2


async def test_a_refused_connect_and_a_name_not_found_fail_to_connect() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with pool() as p:
        with pytest.raises(ConnectFailed, match=f"cannot connect to 127.0.0.1:{port}"):
            await post(p, URL(f"http://127.0.0.1:{port}/w"))
        with pytest.raises(ConnectFailed, match=r"cannot look up no-such-host\.invalid"):
            await post(p, URL("http://no-such-host.invalid/w"))


async def test_an_http_upstream_through_a_proxy_is_sent_in_absolute_form() -> None:
    """As Go sends it: the proxy's name looked up, never the upstream's (a name only the
    proxy can resolve), the request line in absolute form, Proxy-Authorization with it."""
    async with serving(answering()) as proxy, pool() as p:
        egress = parse_egress(f"http://u:p%3Aw@127.0.0.1:{proxy.port}")
        url = URL("http://tsdb.only-the-proxy-knows.invalid:9090/api/v1/write?x=1")
        assert (await post(p, url, egress=egress)).status == 204
        assert (await post(p, url, egress=egress)).status == 204
        head = proxy.heads[0].decode()
        assert head.startswith("POST http://tsdb.only-the-proxy-knows.invalid:9090"
                               "/api/v1/write?x=1 HTTP/1.1\r\n"), head
        assert "\r\nHost: tsdb.only-the-proxy-knows.invalid:9090\r\n" in head
        assert "\r\nProxy-Authorization: Basic dTpwOnc=\r\n" in head  # u:p:w
        assert len(set(proxy.peers)) == 1  # kept alive, as any connection


def connect_answering(answer: bytes) -> Callable[[Raw], Handler]:
    """A proxy that reads a CONNECT's head and writes ``answer``, then waits."""
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw.heads.append(await reader.readuntil(b"\r\n\r\n"))
            if answer:
                writer.write(answer)
                await writer.drain()
                await reader.read()
        return handle
    return make


@pytest.mark.parametrize(("answer", "said"), [
    (b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
     "answered 407 to CONNECT tsdb.invalid:443: its credentials"),
    (b"HTTP/1.0 403 Forbidden\r\nContent-Length: 0\r\n\r\n", "answered 403 to CONNECT"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "answered CONNECT with something not HTTP"),
    (b"HTTP/1.1 200 OK\r\n\r\nHTTP/1.1 204", "sent bytes after its answer"),
    (b"", "closed the connection before answering CONNECT tsdb.invalid:443"),
])
async def test_a_connect_the_proxy_refuses_or_breaks_is_no_connection(
    answer: bytes, said: str, pki: tuple[Authority, ssl.SSLContext],
) -> None:
    ca, _ = pki
    async with serving(connect_answering(answer)) as proxy, pool() as p:
        egress = parse_egress(f"http://127.0.0.1:{proxy.port}")
        tls = ssl.create_default_context(cafile=str(ca.ca_file))
        with pytest.raises(ConnectFailed, match=said):
            await post(p, URL("https://tsdb.invalid/api/v1/write"), tls=tls, egress=egress)
        assert proxy.heads == [b"CONNECT tsdb.invalid:443 HTTP/1.1\r\n"
                               b"Host: tsdb.invalid:443\r\n\r\n"]


async def test_proxy_connect_header_goes_with_the_connect_after_its_credentials(
    pki: tuple[Authority, ssl.SSLContext],
) -> None:
    """Go's order: Host, the URL's Proxy-Authorization, then ProxyConnectHeader's
    values, each a line; a 407 names both places the credentials come from."""
    ca, _ = pki
    answer = b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n"
    async with serving(connect_answering(answer)) as proxy, pool() as p:
        egress = parse_egress(f"http://u:p@127.0.0.1:{proxy.port}",
                              {"X-Egress-Token": ["t1", "t2"], "X-Team": ["obs"]},
                              source="upstream.proxy_url")
        tls = ssl.create_default_context(cafile=str(ca.ca_file))
        with pytest.raises(ConnectFailed, match=r"upstream\.proxy_url, or "
                                                r"upstream\.proxy_connect_header"):
            await post(p, URL("https://tsdb.invalid/api/v1/write"), tls=tls, egress=egress)
        assert proxy.heads == [b"CONNECT tsdb.invalid:443 HTTP/1.1\r\n"
                               b"Host: tsdb.invalid:443\r\n"
                               b"Proxy-Authorization: Basic dTpw\r\n"
                               b"X-Egress-Token: t1\r\nX-Egress-Token: t2\r\n"
                               b"X-Team: obs\r\n\r\n"]
        assert "t1" not in repr(egress) and "dTpw" not in repr(egress)


def socks_answering(*replies: bytes, then: bytes = b"") -> Callable[[Raw], Handler]:
    """A SOCKS5 proxy that answers each message of the client's (the greeting, the
    login, the CONNECT: one read each) with the next of ``replies``, kept in ``heads``;
    after the last, ``then`` as the upstream's answer (the tunnel's far end), or it
    closes."""
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for reply in replies:
                raw.heads.append(await reader.read(1024))
                writer.write(reply)
                await writer.drain()
            if then:
                raw.heads.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(then)
                await writer.drain()
                await reader.read()
        return handle
    return make


#: a SOCKS5 CONNECT granted, the bound address given as a name (atyp 3), as a proxy
#: may: its bytes read and dropped, the tunnel's first byte the upstream's
GRANTED_BY_NAME = b"\x05\x00\x00\x03\x05proxy\x04\x38"


async def test_a_socks5_tunnel_carries_the_request_as_sent_directly() -> None:
    """RFC 1928 as Go's dialer speaks it: no-auth and username/password offered with a
    login, the name sent unresolved (an IPv6 address as one), then the request in
    origin form, as directly, on a connection kept alive."""
    async with serving(socks_answering(b"\x05\x02", b"\x01\x00", GRANTED_BY_NAME,
                                       then=OK)) as proxy, pool() as p:
        egress = parse_egress(f"socks5://u:pw@127.0.0.1:{proxy.port}")
        r = await post(p, URL("http://tsdb.only-the-proxy-knows.invalid:9090/w"),
                       egress=egress)
        assert r.status == 204
        greeting, login, connect, head = proxy.heads
        assert greeting == b"\x05\x02\x00\x02" and login == b"\x01\x01u\x02pw"
        name = b"tsdb.only-the-proxy-knows.invalid"
        assert connect == b"\x05\x01\x00\x03" + bytes([len(name)]) + name + b"\x23\x82"
        assert head.startswith(b"POST /w HTTP/1.1\r\n"), head
        assert b"Proxy-Authorization" not in head
    async with serving(socks_answering(b"\x05\x00", b"\x05\x00\x00\x04" + bytes(18),
                                       then=OK)) as proxy, pool() as p:
        egress = parse_egress(f"socks5h://127.0.0.1:{proxy.port}")
        assert (await post(p, URL("http://[2001:db8::1]:80/w"), egress=egress)).status == 204
        greeting, connect, _ = proxy.heads
        assert greeting == b"\x05\x01\x00"
        assert connect == b"\x05\x01\x00\x04" + bytes.fromhex("20010db8" + "0" * 23 + "1") \
            + b"\x00\x50"


@pytest.mark.parametrize(("replies", "login", "said"), [
    ((b"\x04\x00",), False, "answered as no SOCKS5 proxy \\(version 4\\)"),
    ((b"\x05\xff",), False, "accepts none of the authentication methods offered: it likely "
                           "asks for a user:password"),
    ((b"\x05\x01",), True, "accepts none of the authentication methods offered$"),  # GSSAPI
    ((b"\x05\x02", b"\x01\x01"), True, "refused the user:password of upstream.proxy_url"),
    ((b"\x05\x00", b"\x05\x02\x00\x01"), False,
     "refused CONNECT tsdb.invalid:80: connection not allowed by ruleset"),
    ((b"\x05\x00", b"\x05\x09\x00\x01"), False, "refused CONNECT tsdb.invalid:80: reply 9"),
    ((b"\x05\x00", b"\x05\x00\x00\x07"), False, "an unknown address type \\(7\\)"),
    ((b"\x05\x00",), False, "closed the connection before answering CONNECT tsdb.invalid:80"),
    ((b"\x05\x00", b"\x05\x00\x00\x01\x7f"), False, "closed the connection in its answer"),
])
async def test_a_socks5_proxy_that_refuses_or_breaks_is_no_connection(
        replies: tuple[bytes, ...], login: bool, said: str) -> None:
    async with serving(socks_answering(*replies)) as proxy, pool() as p:
        user = "u:hunter2@" if login else ""
        egress = parse_egress(f"socks5://{user}127.0.0.1:{proxy.port}",
                              source="upstream.proxy_url")
        with pytest.raises(ConnectFailed, match=said) as e:
            await post(p, URL("http://tsdb.invalid/w"), egress=egress)
        assert "hunter2" not in str(e.value)


def tls_proxy(upstream_tls: ssl.SSLContext) -> Callable[[Raw], Handler]:
    """An HTTPS proxy (the server's TLS is ``serving``'s) that is also the far end: a
    request in absolute form answered; a CONNECT granted, then TLS with
    ``upstream_tls`` inside its own, and the request in it answered."""
    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"CONNECT "):
                raw.heads.append(head)
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await writer.start_tls(upstream_tls)
                await read_request(reader, raw)
            else:
                raw.heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
            writer.write(OK)
            await writer.drain()
            await reader.read()
        return handle
    return make


async def test_an_https_proxy_carries_either_upstream_inside_its_tls(
        pki: tuple[Authority, ssl.SSLContext]) -> None:
    """https:// proxy_url: TLS to the proxy, verified against the proxy's name; an
    http:// upstream's request in absolute form inside it, an https:// one's TLS inside
    that (TLS in TLS, asyncio's ``start_tls`` over a TLS transport), its name the
    upstream's. Without the proxy's context, no request is made."""
    ca, server = pki
    trust = ssl.create_default_context(cafile=str(ca.ca_file))
    async with serving(tls_proxy(server), ssl_context=server) as proxy, pool() as p:
        egress = parse_egress(f"https://u:p@localhost:{proxy.port}")
        assert (egress.tls, egress.port, egress.url, egress.kind) == \
            (True, proxy.port, f"https://localhost:{proxy.port}", "HTTPS proxy")
        r = await post(p, URL("http://tsdb.invalid:9090/w"), egress=egress, proxy_tls=trust)
        assert r.status == 204
        r = await post(p, URL("https://localhost:8443/w"), tls=trust, egress=egress,
                       proxy_tls=trust)
        assert r.status == 204
        absolute, connect, inner = proxy.heads
        assert absolute.startswith(b"POST http://tsdb.invalid:9090/w HTTP/1.1\r\n")
        assert b"\r\nProxy-Authorization: Basic dTpw\r\n" in absolute
        assert connect.startswith(b"CONNECT localhost:8443 HTTP/1.1\r\n")
        assert inner.startswith(b"POST /w HTTP/1.1\r\n") and b"Proxy-Auth" not in inner
        with pytest.raises(ValueError, match="an HTTPS proxy needs a TLS context"):
            await post(p, URL("http://tsdb.invalid/w"), egress=egress)
        assert parse_egress("https://proxy").port == 443


async def test_a_connect_that_gets_no_answer_times_out() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filling = []
    for _ in range(3):  # the accept queue full: later SYNs dropped
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        filling.append(c)
    try:
        async with pool(connect=0.3) as p:
            with pytest.raises(ConnectTimeout, match=r"within 0\.3 s"):
                await post(p, URL(f"http://127.0.0.1:{port}/w"))
    finally:
        for c in (*filling, listener):
            c.close()


class Lookups:
    """The loop's resolver answering ``upstream.test`` with ``addresses``, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, addresses: list[tuple[int, str]]
                 ) -> None:
        self.addresses = addresses
        self.count = 0
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", self._answer)

    async def _answer(self, host: str, port: int, **kw: Any) -> list[Any]:
        assert host == "upstream.test"
        self.count += 1
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 (address, port, 0, 0) if family == socket.AF_INET6 else (address, port))
                for family, address in self.addresses]


async def test_names_are_kept_10_s_and_looked_up_again_after_a_clear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = [0.0]
    real = time.monotonic
    monkeypatch.setattr(upstream_http, "_connection_clock", lambda: real() + ahead[0])
    names = Lookups(monkeypatch, [(socket.AF_INET, "127.0.0.1")])
    async with serving(answering(*[CLOSE] * 4, then_close=True)) as raw, pool() as p:
        url = raw.url("upstream.test")
        await post(p, url)
        await post(p, url)  # a new connection (closed after each), the name kept
        assert names.count == 1
        ahead[0] += 11
        await post(p, url)
        assert names.count == 2
        p.clear_dns_cache()
        await post(p, url)
        assert names.count == 3


@needs_ipv6
async def test_ipv6_literals_and_a_name_whose_first_address_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An IPv6 address in brackets, and a name whose IPv6 address refuses and IPv4 one
    answers: the next address is tried."""
    async with serving(answering(OK), host="::1") as raw6, pool() as p:
        assert (await post(p, raw6.url("[::1]"))).status == 204
    assert raw6.heads[0].split(b"\r\n")[1] == f"Host: [::1]:{raw6.port}".encode()
    Lookups(monkeypatch, [(socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")])
    async with serving(answering(OK)) as raw4, pool() as p:
        assert (await post(p, raw4.url("upstream.test"))).status == 204


async def test_a_silent_first_address_gives_way_to_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Happy eyeballs: an address that neither connects nor refuses does not hold the
    next one up for the connect timeout."""
    started: list[str] = []
    real_connect = upstream_http._connect_one

    async def connect(loop: asyncio.AbstractEventLoop, info: Any) -> socket.socket:
        started.append(info[4][0])
        if info[4][0] == "127.0.0.2":
            await asyncio.sleep(30)  # a dead address
        return await real_connect(loop, info)

    monkeypatch.setattr(upstream_http, "_connect_one", connect)
    Lookups(monkeypatch, [(socket.AF_INET, "127.0.0.2"), (socket.AF_INET, "127.0.0.1")])
    async with serving(answering(OK)) as raw, pool(connect=5.0) as p:
        began = time.monotonic()
        assert (await post(p, raw.url("upstream.test"))).status == 204
        assert time.monotonic() - began < 2.0
    assert started == ["127.0.0.2", "127.0.0.1"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Authority, ssl.SSLContext]:
    folder: Path = tmp_path_factory.mktemp("pki")
    ca = Authority(folder)
    return ca, ca.issue("server", server=True).server_context()


async def test_tls_with_a_server_name(pki: tuple[Authority, ssl.SSLContext]) -> None:
    """The server name sent and verified is the one given (``tls_server_name``), else the
    URL's host; connections of another context are not shared."""
    ca, server = pki
    names: list[str | None] = []

    def sni(sock: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        names.append(name)

    server.sni_callback = sni
    client = ssl.create_default_context(cafile=str(ca.ca_file))
    other = ssl.create_default_context(cafile=str(ca.ca_file))
    url = None
    async with serving(answering(*[OK] * 4), ssl_context=server) as raw, pool() as p:
        url = URL(f"https://127.0.0.1:{raw.port}/w")
        assert (await post(p, url, tls=client, server_hostname="localhost")).status == 204
        assert (await post(p, url, tls=client, server_hostname="localhost")).status == 204
        assert (await post(p, url, tls=other, server_hostname="localhost")).status == 204
        with pytest.raises(ConnectFailed, match=r"TLS.*certificate verify failed"):
            await post(p, url, tls=client, server_hostname="elsewhere.test")
        assert (await post(p, URL(f"https://localhost:{raw.port}/w"), tls=client)).status == 204
    assert names == ["localhost", "localhost", "elsewhere.test", "localhost"]
    # one connection for the first two, reused; the refused handshake served nothing
    assert len(raw.served) == 4 and len(set(raw.served)) == 3


def _one_tls_exchange(listener: socket.socket, ctx: ssl.SSLContext) -> str:
    """Serve one request on a blocking TLS socket, then say how the client ended the
    connection: "closed" with TLS's close_notify, else the error (a TCP close without it
    is an error here, not passed off as a close)."""
    conn, _ = listener.accept()
    conn.settimeout(5)
    with ctx.wrap_socket(conn, server_side=True, suppress_ragged_eofs=False) as tls:
        data = b""
        while b"\r\n\r\n" not in data:
            data += tls.recv(65536)
        tls.sendall(OK)
        try:
            return "closed" if tls.recv(1) == b"" else "data"
        except (ssl.SSLError, OSError) as e:
            return f"{type(e).__name__}: {e}"


async def test_a_tls_connection_is_closed_with_close_notify(
        pki: tuple[Authority, ssl.SSLContext]) -> None:
    ca, server = pki
    client = ssl.create_default_context(cafile=str(ca.ca_file))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        ended = asyncio.create_task(asyncio.to_thread(_one_tls_exchange, listener, server))
        p = Pool(limit=1, idle_seconds=30.0, connect_timeout=2.0)
        url = URL(f"https://127.0.0.1:{listener.getsockname()[1]}/w")
        assert (await post(p, url, b"", tls=client)).status == 204
        await p.close()
        assert await asyncio.wait_for(ended, 10) == "closed"


async def test_a_second_address_connecting_with_the_first_is_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Happy eyeballs: two addresses that connect in the same turn of the loop; the one not
    used is closed, not left to the garbage collector (an open connection to the upstream
    meanwhile)."""
    made: list[socket.socket] = []
    real_connect = upstream_http._connect_one
    second_started = asyncio.Event()

    async def connect(loop: asyncio.AbstractEventLoop, info: Any) -> socket.socket:
        if info[4][0] == "127.0.0.2":  # slow, then ready as the next one is
            await second_started.wait()
            info = (*info[:4], ("127.0.0.1", info[4][1]))
        else:
            second_started.set()
        sock = await real_connect(loop, info)
        made.append(sock)
        return sock

    monkeypatch.setattr(upstream_http, "_connect_one", connect)
    Lookups(monkeypatch, [(socket.AF_INET, "127.0.0.2"), (socket.AF_INET, "127.0.0.1")])
    async with serving(answering(OK)) as raw, pool() as p:
        assert (await post(p, raw.url("upstream.test"))).status == 204
        assert len(made) == 2
        assert sum(s.fileno() != -1 for s in made) == 1, made


async def test_waiters_are_served_in_the_order_they_came() -> None:
    """A connection made is no slot freed: it wakes no waiter, which would find the pool
    full and queue again behind the later ones (an upstream closing after each answer
    made every request connect, and every other waiter lost its place)."""
    order: list[bytes] = []

    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            order.append(await read_request(reader, raw))
            writer.write(CLOSE)
            await writer.drain()
        return handle

    async with serving(make) as raw, pool(limit=1) as p:
        posts = []
        for i in range(5):
            posts.append(asyncio.create_task(post(p, raw.url(), b"%d" % i)))
            await asyncio.sleep(0)  # each in the queue before the next
        assert [a.status for a in await asyncio.gather(*posts)] == [204] * 5
    assert order == [b"0", b"1", b"2", b"3", b"4"]


async def test_a_freed_connection_goes_to_the_first_waiter_not_to_a_request_arriving_then(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request arriving as a connection is freed (its task already ready to run when
    the woken waiter's is not) found room and took it; the waiter, finding none, queued
    again at the back: under steady load a waiter could wait for ever. The freed slot is
    the first waiter's."""
    order: list[bytes] = []
    release = asyncio.Event()

    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    order.append(await read_request(reader, raw))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                await release.wait()
                writer.write(OK)
                await writer.drain()
        return handle

    async with serving(make) as raw, pool(limit=1) as p:
        holder = asyncio.create_task(post(p, raw.url(), b"holder"))
        while not order:
            await asyncio.sleep(0.01)
        waiters = []
        for name in (b"first", b"second"):
            waiters.append(asyncio.create_task(post(p, raw.url(), name)))
            await asyncio.sleep(0)  # each in the queue before the next
        await asyncio.sleep(0.05)
        late: list[asyncio.Task[Response]] = []
        release_conn = p._release

        def released(conn: Any) -> None:
            if not late:  # ready to run before the waiter is woken
                late.append(asyncio.create_task(post(p, raw.url(), b"late")))
            release_conn(conn)
        monkeypatch.setattr(p, "_release", released)
        release.set()
        answers = await asyncio.gather(holder, *waiters)
        assert len(late) == 1
        answers.append(await late[0])
        assert [a.status for a in answers] == [204] * 4
    assert order == [b"holder", b"first", b"second", b"late"]


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_hands_it_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()
    async with serving(answering(release=release)) as raw, pool(limit=1) as p:
        holder = asyncio.create_task(post(p, raw.url()))
        while not raw.heads:
            await asyncio.sleep(0.01)
        first = asyncio.create_task(post(p, raw.url()))
        await asyncio.sleep(0)
        second = asyncio.create_task(post(p, raw.url()))
        await asyncio.sleep(0.05)
        release_conn = p._release

        def released(conn: Any) -> None:
            release_conn(conn)
            first.cancel()  # handed the slot, cancelled before it runs
        monkeypatch.setattr(p, "_release", released)
        release.set()
        assert (await holder).status == (await second).status == 204
        with pytest.raises(asyncio.CancelledError):
            await first
        assert p._handed == 0 and not p._waiters
        assert (await post(p, raw.url())).status == 204
    assert len(set(raw.peers)) == 1


async def test_an_idle_connection_of_another_url_is_no_way_past_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit holds across the pool's keys (another host of one upstream, a tenant's):
    an idle connection of one is taken only when the pool has room."""
    Lookups(monkeypatch, [(socket.AF_INET, "127.0.0.1")])
    release = asyncio.Event()
    release.set()
    async with serving(answering(release=release)) as raw, pool(limit=1) as p:
        assert (await post(p, raw.url())).status == 204  # idle now, of 127.0.0.1
        release.clear()
        other = asyncio.create_task(post(p, raw.url("upstream.test")))
        while len(raw.heads) < 2:
            await asyncio.sleep(0.01)
        again = asyncio.create_task(post(p, raw.url()))
        await asyncio.sleep(0.1)
        assert len(raw.heads) == 2 and raw.most == 2  # waits: one in use already
        release.set()
        assert (await other).status == (await again).status == 204
    assert len(raw.heads) == 3


async def test_the_names_kept_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """``{tenant}`` in the URL's host makes a name per tenant, and senders choose tenants:
    under a wildcard DNS name every one resolves, and each was kept for good (1,500
    tenants, 1,500 entries). Past ``MAX_NAMES`` the aged ones go, then the oldest."""

    async def any_name(host: str, port: int, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                 ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", any_name)
    names = upstream_http._Names()
    for i in range(upstream_http.MAX_NAMES + 500):
        await names.addresses(f"t{i}.upstream.test", 9, False)
    assert len(names._cache) == upstream_http.MAX_NAMES
    assert ("t0.upstream.test", 9) not in names._cache  # the oldest went
    assert (f"t{upstream_http.MAX_NAMES + 499}.upstream.test", 9) in names._cache


async def test_a_failed_look_up_nobody_waits_for_is_not_logged_as_never_retrieved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its asker's deadline passed first: the shared look-up then failed with no one to
    take its error, and asyncio logged "Task exception was never retrieved"."""
    import gc

    loop = asyncio.get_running_loop()

    async def failing(host: str, port: int, **kw: Any) -> list[Any]:
        await asyncio.sleep(0.05)
        raise OSError("no such name")

    monkeypatch.setattr(loop, "getaddrinfo", failing)
    reported: list[dict[str, Any]] = []
    monkeypatch.setattr(loop, "call_exception_handler", reported.append)
    names = upstream_http._Names()
    asker = asyncio.create_task(names.addresses("gone.upstream.test", 9, False))
    await asyncio.sleep(0.01)
    asker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asker
    await asyncio.sleep(0.1)  # the look-up fails meanwhile
    gc.collect()
    assert not names._asking
    assert [r for r in reported if "never retrieved" in str(r.get("message"))] == []


async def test_a_waiter_handed_a_slot_as_the_pool_closes_makes_no_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot freed, handed to the waiter, then the pool closed before the waiter's task
    ran: it ends with ``ConnectionEnded`` without connecting (it made a connection to the
    upstream after close(), then closed it; up to the connect timeout at a stop with the
    upstream unreachable)."""
    release = asyncio.Event()
    async with serving(answering(release=release)) as raw, pool(limit=1) as p:
        holder = asyncio.create_task(post(p, raw.url()))
        while not raw.heads:
            await asyncio.sleep(0.01)
        waiter = asyncio.create_task(post(p, raw.url()))
        await asyncio.sleep(0.05)
        closing: list[asyncio.Task[None]] = []
        release_conn = p._release

        def released(conn: Any) -> None:
            closing.append(asyncio.create_task(p.close()))  # runs before the waiter
            release_conn(conn)
        monkeypatch.setattr(p, "_release", released)
        release.set()
        assert (await holder).status == 204
        with pytest.raises(ConnectionEnded, match="the client is closed"):
            await waiter
        await closing[0]
        assert p._handed == 0
    assert len(raw.peers) == 1


@pytest.mark.parametrize("seed", range(8))
async def test_the_pool_keeps_its_count_under_random_cancellations(seed: int) -> None:
    """Requests arriving at random against a server that answers, closes after answering
    or ends before answering, some to a port that refuses, some with short deadlines and
    some cancelled at random (as their slot is freed, handed to them, or meanwhile): the
    pool never counts more than its limit, hands no slot it does not account for, and
    ends with nothing in use, connecting, handed or waiting."""
    rng = random.Random(seed)

    def make(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await read_request(reader, raw)
                await asyncio.sleep(rng.random() * 0.004)
                r = rng.random()
                if r < 0.1:
                    return  # ends before an answer
                writer.write(CLOSE if r < 0.35 else OK)
                await writer.drain()
                if r < 0.35:
                    return
        return handle

    refused = URL("http://127.0.0.1:1/api/v1/write")
    tasks: list[asyncio.Task[None]] = []
    broken: list[tuple[str, int, int, int]] = []
    async with serving(make) as raw, pool(limit=3, connect=0.5) as p:
        def check(where: str) -> None:
            used = len(p._in_use) + p._connecting
            if p._handed < 0 or used + p._handed > p.limit:
                broken.append((where, len(p._in_use), p._connecting, p._handed))

        wake, release = p._wake, p._release

        def woken() -> None:
            wake()
            check("wake")

        def released(conn: Any) -> None:
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()  # cancelled as a slot is freed
            release(conn)
            check("release")
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()  # handed the slot, cancelled before it runs

        p._wake, p._release = woken, released  # type: ignore[method-assign]

        async def one() -> None:
            url = refused if rng.random() < 0.05 else raw.url()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(rng.random() * 0.05 if rng.random() < 0.3 else 5):
                    await p.post(url, {}, b"x", tls=None, server_hostname=None, max_body=100)

        for _ in range(80):
            tasks.append(asyncio.create_task(one()))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() * 0.002)
            if rng.random() < 0.05:
                rng.choice(tasks).cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        check("end")
        assert (p._handed, p._connecting, len(p._in_use), len(p._waiters)) == (0, 0, 0, 0)
    assert not broken
