"""The Kubernetes client's connector through a SOCKS5 proxy, against scripted proxies:
the API server's name sent unresolved and the request then as sent directly; a refusal,
a proxy not there and one that never answers, each a connection error of aiohttp's kind
(the source's retry handles it) saying what happened. Through a real SOCKS5 proxy
(microsocks), lists from the API simulator: tests/peers/test_e2e_egress_proxy.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.egress_proxy import Egress, parse_egress
from proxy.kube.socks5_connector import tunnel_through
from tests.kubesim.server import free_port
from tests.test_upstream_http import (
    GRANTED_BY_NAME,
    OK,
    Handler,
    Raw,
    serving,
    socks_answering,
)


@contextlib.asynccontextmanager
async def session_through(egress: Egress, timeout: aiohttp.ClientTimeout | None = None
                          ) -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose connector is turned as the pool's is (``as_client_go``)."""
    connector = aiohttp.TCPConnector()
    tunnel_through(connector, egress)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=timeout or aiohttp.ClientTimeout()) as s:
        yield s


async def test_the_api_servers_name_goes_to_the_proxy_unresolved() -> None:
    """The name sent as a name (only the proxy's side may resolve it; the handshake's
    bytes: tests/test_upstream_http.py), then the request as sent directly."""
    async with serving(socks_answering(b"\x05\x00", GRANTED_BY_NAME, then=OK)) as proxy:
        egress = parse_egress(f"socks5://127.0.0.1:{proxy.port}")
        async with session_through(egress) as s, \
                s.get("http://api.only-the-bastion-knows.invalid:6443/api") as r:
            assert r.status == 204
        _, connect, head = proxy.heads
    assert connect.endswith(b"\x03\x22api.only-the-bastion-knows.invalid\x19\x2b")
    assert head.startswith(b"GET /api HTTP/1.1\r\n"), head


@pytest.mark.parametrize(("replies", "said"), [
    ((b"\x05\x02", b"\x01\x01"), "refused the user:password of the proxy URL"),
    ((b"\x05\x00", b"\x05\x05\x00\x01"),
     "refused CONNECT api.invalid:6443: connection refused"),
    ((b"\x04\x00",), "answered as no SOCKS5 proxy \\(version 4\\)"),
])
async def test_a_refusal_is_a_connection_error_saying_what_the_proxy_said(
        replies: tuple[bytes, ...], said: str) -> None:
    async with serving(socks_answering(*replies)) as proxy:
        egress = parse_egress(f"socks5://u:hunter2@127.0.0.1:{proxy.port}")
        async with session_through(egress) as s:
            with pytest.raises(aiohttp.ClientConnectorError, match=said) as e:
                await s.get("https://api.invalid:6443/api")
    assert "hunter2" not in str(e.value)


async def test_a_proxy_not_there_is_named() -> None:
    port = free_port()
    egress = parse_egress(f"socks5://127.0.0.1:{port}")
    async with session_through(egress) as s:
        with pytest.raises(aiohttp.ClientConnectorError,
                           match=f"through the SOCKS5 proxy socks5://127.0.0.1:{port}: "):
            await s.get("https://api.invalid:6443/api")


async def test_a_proxy_that_never_answers_times_out() -> None:
    """It takes the connection and says nothing: the connect's bound ends the wait (a
    watch's request sets no total)."""
    def silent(raw: Raw) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()
        return handle

    async with serving(silent) as proxy:
        egress = parse_egress(f"socks5://127.0.0.1:{proxy.port}")
        async with session_through(egress, aiohttp.ClientTimeout(sock_connect=0.3)) as s:
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await s.get("https://api.invalid:6443/api")
            assert time.monotonic() - started < 5


async def test_only_aiohttps_own_connector_is_turned() -> None:
    class Other(aiohttp.TCPConnector):
        pass

    other = Other()
    try:
        with pytest.raises(TypeError, match="not aiohttp's TCPConnector"):
            tunnel_through(other, parse_egress("socks5://p"))
    finally:
        await other.close()
