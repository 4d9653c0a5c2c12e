"""A scripted remote-write receiver on 127.0.0.1: answers as told, records what arrived.

Real HTTP over loopback (aiohttp server), so the proxy's client, pooling, timeouts and
header handling run for real; only the receiver's decisions are scripted.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import snappy
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.aux_server import AuxServer
from proxy.compression import decompress


@dataclass
class Reply:
    status: int = 204
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: seconds to wait before answering (timeouts)
    delay: float = 0.0
    #: answered only once the test sets it (after ``delay``): a request held upstream for
    #: exactly as long as the test needs, however slow the machine
    gate: asyncio.Event | None = None


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: bytes
    #: (host, port) of the client connection: one per pooled connection
    peer: tuple[str, int] | None = None
    #: the raw query string, as it arrived (percent-encoding untouched)
    query: str = ""

    @property
    def raw(self) -> bytes:
        """The decoded body (snappy or zstd per Content-Encoding)."""
        enc = self.headers.get("Content-Encoding", "snappy")
        if enc == "snappy":
            return bytes(snappy.uncompress(self.body))
        return decompress(self.body, enc, max_decoded=1 << 30)


def rw2_receiver(rec: Received) -> Reply:
    """Answer as an RW 2.0 receiver does (Prometheus 3, Mimir): RW 2.0 requests get the
    Written headers, counted from the body; RW 1.0 requests a plain 204."""
    if "io.prometheus.write.v2.Request" not in rec.headers.get("Content-Type", ""):
        return Reply(204)
    from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2

    req = cast(Any, v2).Request.FromString(rec.raw)
    from proxy.upstream import WRITTEN_EXEMPLARS, WRITTEN_HISTOGRAMS, WRITTEN_SAMPLES

    series = req.timeseries
    return Reply(204, {
        WRITTEN_SAMPLES: str(sum(len(t.samples) for t in series)),
        WRITTEN_HISTOGRAMS: str(sum(len(t.histograms) for t in series)),
        WRITTEN_EXEMPLARS: str(sum(len(t.exemplars) for t in series)),
    })


def size_limit(max_bytes: int, then: Callable[[Received], Reply] | None = None, *,
               refusal: Reply | None = None) -> Callable[[Received], Reply]:
    """A receiver with a request size limit (Mimir's ``distributor.max_recv_msg_size``,
    Thanos Receive's): ``refusal`` (a 413) for a compressed body over ``max_bytes``, else
    ``then`` (a plain 204 by default)."""

    def rule(rec: Received) -> Reply:
        if len(rec.body) > max_bytes:
            return refusal or Reply(413, body=b"request body too large")
        return then(rec) if then is not None else Reply(204)

    return rule


def redirect_to(receiver: str, status: int = 308, host: str = "127.0.0.1"
                ) -> Callable[[Received], Reply]:
    """A redirecting front: every request answered ``status`` with a Location on
    ``receiver``'s scheme and port (its host replaced by ``host``), the request's path and
    query kept, as ingress-nginx's ``force-ssl-redirect`` answers http:// with https://."""
    base = URL(receiver)

    def rule(rec: Received) -> Reply:
        where = base.with_host(host).with_path(rec.path, encoded=True)
        where = where.with_query(rec.query) if rec.query else where.with_query(None)
        return Reply(status, {"Location": str(where)})

    return rule


def _is_empty_write(rec: Received) -> bool:
    try:
        return rec.raw == b""
    except Exception:  # not a compressed body at all: a request like any other
        return False


class ScriptedUpstream(AuxServer):
    """``replies`` are used in order; the last one repeats. ``rule`` overrides per request."""

    def __init__(self, *replies: Reply, rule: Callable[[Received], Reply | None] | None = None,
                 ssl_context: ssl.SSLContext | None = None, port: int = 0,
                 record_empty: bool = False) -> None:
        self.replies = list(replies) or [Reply()]
        self.rule = rule
        self.received: list[Received] = []
        #: empty writes (the proxy's upstream check) are answered like the next request
        #: but kept here, not in ``received``, unless ``record_empty``
        self.empty_writes: list[Received] = []
        self._record_empty = record_empty
        self.url = ""
        self.port = port
        self._ssl = ssl_context

    async def _handle(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        rec = Received(request.path, CIMultiDict(request.headers), await request.read(),
                       tuple(peer[:2]) if peer else None, request.rel_url.raw_query_string)
        if not self._record_empty and _is_empty_write(rec):
            self.empty_writes.append(rec)
            index = min(len(self.received), len(self.replies) - 1)
        else:
            self.received.append(rec)
            index = min(len(self.received) - 1, len(self.replies) - 1)
        reply = self.rule(rec) if self.rule is not None else None
        if reply is None:
            reply = self.replies[index]
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.gate is not None:
            await reply.gate.wait()
        return web.Response(status=reply.status, headers=reply.headers, body=reply.body)

    async def start(self) -> str:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.port = await self.serve(app, "127.0.0.1", self.port, ssl_context=self._ssl,
                                     auto_decompress=False, shutdown_timeout=0.5)
        scheme = "https" if self._ssl else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/api/v1/write"
        return self.url
