"""The Kubernetes client's connections through a SOCKS5 proxy (a kubeconfig cluster's
``proxy-url: socks5://...``, or ``HTTPS_PROXY`` naming one), as client-go makes them:
kubectl's way to a private cluster through a bastion (``ssh -D 1080 bastion``).

aiohttp speaks only HTTP(S) to a proxy, so the pool's connector opens each connection
itself: to the proxy, the SOCKS5 handshake (``proxy.socks5``, the upstream's own), the
API server's name sent unresolved (it may resolve only on the proxy's side), then the
API server's TLS inside the tunnel, verified as a direct connection's is. The connector
is kubernetes-asyncio's own, made in its pool's constructor, with the one method that
makes a direct connection replaced (``tunnel_through``); its pool limit, TLS context and
keep-alive stay as they were.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from typing import Any

import aiohappyeyeballs
import aiohttp

from proxy import socks5
from proxy.egress_proxy import Egress

#: the bound of the connection and the handshake when the request sets none (aiohttp's
#: default ``sock_connect``): a proxy that takes the connection and never answers would
#: otherwise hold a watch's connect for good
CONNECT_SECONDS = 30.0


class Socks5Connector(aiohttp.TCPConnector):
    """An aiohttp connector whose every connection is a SOCKS5 tunnel to the request's
    host. Never made: ``tunnel_through`` turns the pool's connector into one."""

    _karta_egress: Egress

    async def _create_direct_connection(
            self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout, *,
            client_error: type[Exception] = aiohttp.ClientConnectorError) -> Any:
        egress = self._karta_egress
        host = (req.url.raw_host or "").rstrip(".")
        port = req.port
        sslcontext = self._get_ssl_context(req)
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout.sock_connect or timeout.connect
                                       or CONNECT_SECONDS):
                infos = await loop.getaddrinfo(egress.host, egress.port,
                                               type=socket.SOCK_STREAM)
                sock = await aiohappyeyeballs.start_connection(infos, loop=loop)
                await socks5.open_tunnel(loop, sock, egress, host, port)
                return await loop.create_connection(
                    self._factory, sock=sock, ssl=sslcontext,
                    server_hostname=(req.server_hostname or host) if sslcontext else None)
        except BaseException as e:
            if sock is not None:
                sock.close()
            if isinstance(e, ssl.SSLCertVerificationError):
                raise aiohttp.ClientConnectorCertificateError(req.connection_key, e) from e
            if isinstance(e, ssl.SSLError):
                raise aiohttp.ClientConnectorSSLError(req.connection_key, e) from e
            if isinstance(e, socks5.SocksRefused):
                raise client_error(req.connection_key,
                                   OSError(errno.ECONNREFUSED, str(e))) from e
            if isinstance(e, OSError) and not isinstance(e, TimeoutError):
                raise client_error(
                    req.connection_key,
                    OSError(e.errno, f"through the SOCKS5 proxy {egress.shown}: "
                                     f"{e.strerror or e}")) from e
            raise


def tunnel_through(connector: aiohttp.BaseConnector, egress: Egress) -> None:
    """Make ``connector`` (a kubernetes-asyncio pool's, before its first connection) open
    every connection through the SOCKS5 proxy ``egress``. TypeError from a library that
    made another kind of connector."""
    if type(connector) is not aiohttp.TCPConnector:
        raise TypeError(f"kubernetes-asyncio's pool has a {type(connector).__name__}, not "
                        "aiohttp's TCPConnector: a SOCKS5 proxy cannot be put in it")
    connector.__class__ = Socks5Connector
    connector._karta_egress = egress  # type: ignore[attr-defined]

