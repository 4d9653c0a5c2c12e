"""The SOCKS5 handshake (RFC 1928, with RFC 1929's username/password), made as Go's SOCKS
dialer makes it, on a socket already connected to the proxy: the name of the host asked
for sent unresolved (the proxy looks it up, so a name only the proxy's side resolves is
reached), the proxy's bound address read and dropped. After it the socket is a tunnel to
that host, and the requests go as they would directly (TLS end to end for https://).

Shared by the two clients that reach through a proxy: the upstream's
(``upstream.proxy_url``, ``proxy.upstream_http``) and the Kubernetes client's (the
kubeconfig's ``proxy-url``, ``proxy.kube.socks5_connector``). A leaf but for
``proxy.egress_proxy``, which reads the proxy's URL.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from proxy.egress_proxy import Egress

#: RFC 1928's replies to a CONNECT, by code: what the proxy says went wrong
REPLIES = {1: "general failure", 2: "connection not allowed by ruleset",
           3: "network unreachable", 4: "host unreachable", 5: "connection refused",
           6: "TTL expired", 7: "command not supported", 8: "address type not supported"}


class SocksRefused(Exception):
    """The SOCKS5 proxy refused the tunnel, or answered what no SOCKS5 proxy answers; the
    message says which, and never holds the password."""


async def open_tunnel(loop: asyncio.AbstractEventLoop, sock: socket.socket, egress: Egress,
                      host: str, port: int) -> None:
    """Open a tunnel to ``host:port`` through the SOCKS5 proxy ``sock`` (non-blocking) is
    connected to: an IP address ``host`` sent as one, a name (IDNA) sent unresolved. A
    login asked for or refused is said with where the proxy's URL is written
    (``egress.source``). ``SocksRefused`` saying what went wrong."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    offered = b"\x00\x02" if egress.socks_login else b"\x00"
    await loop.sock_sendall(sock, bytes([5, len(offered)]) + offered)
    version, method = await _recv_exactly(loop, sock, 2, egress, "before choosing a method")
    if version != 5:
        raise SocksRefused(f"the SOCKS5 proxy {egress.shown} answered as no SOCKS5 proxy "
                           f"(version {version})")
    if method == 0xFF or method not in offered:
        raise SocksRefused(f"the SOCKS5 proxy {egress.shown} accepts none of the "
                           "authentication methods offered"
                           + ("" if egress.socks_login else
                              f": it likely asks for a user:password in {egress.source}"))
    if method == 2:
        await loop.sock_sendall(sock, egress.socks_login)
        _, status = await _recv_exactly(loop, sock, 2, egress, "before answering the login")
        if status != 0:
            raise SocksRefused(f"the SOCKS5 proxy {egress.shown} refused the user:password "
                               f"of {egress.source}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        address = bytes([1 if ip.version == 4 else 4]) + ip.packed
    else:
        name = host.encode("ascii")
        if len(name) > 255:
            raise SocksRefused(f"{host[:40]}...: a name too long for a SOCKS5 proxy "
                               f"({len(name)} bytes, at most 255)")
        address = bytes([3, len(name)]) + name
    await loop.sock_sendall(sock, b"\x05\x01\x00" + address + port.to_bytes(2, "big"))
    version, reply, _, kind = await _recv_exactly(loop, sock, 4, egress,
                                                  f"before answering CONNECT {where}")
    if version != 5:
        raise SocksRefused(f"the SOCKS5 proxy {egress.shown} answered CONNECT {where} as no "
                           f"SOCKS5 proxy (version {version})")
    if reply != 0:
        raise SocksRefused(f"the SOCKS5 proxy {egress.shown} refused CONNECT {where}: "
                           f"{REPLIES.get(reply, f'reply {reply}')}")
    if kind == 3:
        length = (await _recv_exactly(loop, sock, 1, egress, "in its answer"))[0]
    elif kind in (1, 4):
        length = 4 if kind == 1 else 16
    else:
        raise SocksRefused(f"the SOCKS5 proxy {egress.shown} answered CONNECT {where} with "
                           f"an unknown address type ({kind})")
    await _recv_exactly(loop, sock, length + 2, egress, "in its answer")


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int,
                        egress: Egress, doing: str) -> bytes:
    data = b""
    while len(data) < n:
        more = await loop.sock_recv(sock, n - len(data))
        if not more:
            raise SocksRefused(f"the SOCKS5 proxy {egress.shown} closed the connection "
                               f"{doing}")
        data += more
    return data
