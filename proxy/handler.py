"""The remote-write HTTP handler: receive -> decode -> enrich -> forward, with bounded load.

Decompressing, splicing and compressing one request run together in a worker thread (the
splice and cramjam release the GIL), so one process uses every core and health checks,
watches, fact writes and ``/metrics`` never wait behind a big request on the event loop.

Every refusal is a 4xx or 5xx with a one-line message, a log line and a counter, and
nothing is allocated past the configured limits: the compressed body is read in chunks
against ``max_body_bytes`` and the decoded size is taken from the body's own header
before decompressing. Load is bounded by a request count and a byte budget; past either
the answer is 503 with ``Retry-After`` at once (never a queue, never a 429 of our own).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import typing
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from proxy.compression import (
    DecodeError,
    compress,
    decompress,
    snappy_declared_length,
    zstd_declared_length,
)
from proxy.config import ServerSettings
from proxy.index import PodIndex
from proxy.metrics import ProxyMetrics
from proxy.upstream import Answer, Upstream
from proxy.wire.plan import SpliceResult
from proxy.wire.primitives import Protocol

log = logging.getLogger("karta.handler")

WRITE_PATHS = ("/api/v1/write", "/api/v1/push", "/api/v1/receive")
ENCODINGS = ("snappy", "zstd")
#: Retry-After (seconds) sent with our own 503s (overload, not ready)
RETRY_AFTER = "1"
#: requests that decode to at most this many bytes are decompressed, spliced and
#: compressed on the event loop: their work (~0.2 ms at 64 KiB) costs less than handing
#: them to a worker thread and back; bigger ones go to the worker threads
INLINE_DECODED_BYTES = 64 * 1024


class Enriching(typing.Protocol):
    """What the handler needs of ``proxy.attribution.Enricher`` (called from worker
    threads)."""

    def enrich_v1(self, raw: bytes) -> SpliceResult: ...

    def enrich_v2(self, raw: bytes) -> SpliceResult: ...


def protocol_from_content_type(ct: str) -> Protocol:
    """RW 1.0 or 2.0 from a Content-Type; :class:`DecodeError` 415 for anything else."""
    parts = [p.strip() for p in ct.split(";")]
    media = parts[0].lower()
    if media != "application/x-protobuf":
        raise DecodeError(
            "unsupported_content_type",
            415,
            f"unsupported Content-Type {ct!r}: remote write needs application/x-protobuf",
        )
    proto = ""
    for param in parts[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "proto":
            proto = value.strip().strip('"')
    if proto in ("", Protocol.V1.value):
        return Protocol.V1
    if proto == Protocol.V2.value:
        return Protocol.V2
    raise DecodeError(
        "unsupported_content_type",
        415,
        f"unsupported remote-write message {proto!r}: expected {Protocol.V1.value} "
        f"or {Protocol.V2.value}",
    )


def worker_count(configured: int) -> int:
    """Worker threads for the request work: ``configured``, or one per usable core."""
    if configured > 0:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(slots=True)
class Prepared:
    """One request after its worker-thread part: the enrichment and the body to send."""

    result: SpliceResult
    #: ``result.body`` compressed for the upstream; None when the upstream converts first
    encoded: bytes | None


def declared_decoded_size(body: bytes, encoding: str) -> int | None:
    """The decoded size a body declares in its own header (None: a zstd frame without one).

    Used to reserve memory before decompressing; ``decompress`` enforces the hard limit.
    Raises ``DecodeError`` for a header that is already corrupt.
    """
    if encoding == "snappy":
        return snappy_declared_length(body)
    return zstd_declared_length(body)


class LoadBudget:
    """Requests and bytes held at once; ``try_*`` never waits, so nothing queues."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0

    def try_enter(self) -> bool:
        if self.requests >= self.max_requests:
            return False
        self.requests += 1
        return True

    def leave(self) -> None:
        self.requests -= 1

    def try_reserve(self, n: int) -> bool:
        if self.bytes + n > self.max_bytes:
            return False
        self.bytes += n
        return True

    def release(self, n: int) -> None:
        self.bytes -= n


class _Held:
    """Bytes one request holds in the budget, released when it is answered."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class _Refusal(Exception):
    """An answer decided before forwarding (limits, bad input, overload)."""

    def __init__(self, status: int, message: str, *, counter: str, kind: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: "decode" -> decode_errors{kind}; "reject" -> requests_rejected{reason}
        self.counter = counter
        self.kind = kind
        self.headers = dict(headers or {})


def _text(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=message + "\n", headers=headers)


class RemoteWriteHandler:
    def __init__(
        self,
        settings: ServerSettings,
        index: PodIndex,
        enricher: Enriching,
        upstream: Upstream,
        metrics: ProxyMetrics,
    ) -> None:
        self.settings = settings
        self.index = index
        self.enricher = enricher
        self.upstream = upstream
        self.metrics = metrics
        self.budget = LoadBudget(settings.max_concurrent_requests, settings.max_inflight_bytes)
        self.workers = worker_count(settings.worker_threads)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="karta-splice")

    def close(self) -> None:
        """Stop the worker threads (after the server stopped taking requests)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        protocol_label = "unknown"
        try:
            if request.method != "POST":
                raise _Refusal(405, f"method {request.method} not allowed: remote write is POST",
                               counter="reject", kind="method", headers={"Allow": "POST"})
            protocol = self._protocol(request)
            protocol_label = protocol.name.lower()
            encoding = self._encoding(request)
            response = await self._within_budget(request, protocol, encoding)
        except _Refusal as r:
            response = self._refuse(request, r)
        self.metrics.requests.labels(request.path, protocol_label, str(response.status)).inc()
        self.metrics.request_duration.labels(protocol_label).observe(
            time.perf_counter() - started
        )
        return response

    # -- request checks -------------------------------------------------------------------

    def _protocol(self, request: web.Request) -> Protocol:
        try:
            return protocol_from_content_type(request.headers.get("Content-Type", ""))
        except DecodeError as e:
            raise _Refusal(e.status, e.message, counter="reject",
                           kind="unsupported_media_type") from None

    def _encoding(self, request: web.Request) -> str:
        # both RW versions require a compressed body: a missing header is refused too
        enc = request.headers.get("Content-Encoding", "").strip().lower()
        if enc not in ENCODINGS:
            shown = enc or "none"
            raise _Refusal(415, f"unsupported Content-Encoding {shown!r}: remote write needs "
                           "snappy or zstd", counter="reject", kind="unsupported_media_type")
        return enc

    def _refuse(self, request: web.Request, r: _Refusal) -> web.Response:
        if r.counter == "decode":
            self.metrics.decode_errors.labels(r.kind).inc()
        else:
            self.metrics.rejected.labels(r.kind).inc()
        level = logging.INFO if r.kind in ("overload", "not_ready") else logging.WARNING
        log.log(level, "request refused", extra={
            "status": r.status, "kind": r.kind, "reason": r.message, "path": request.path,
            "remote": request.remote, "user_agent": request.headers.get("User-Agent", ""),
        })
        return _text(r.status, r.message, r.headers)

    # -- the bounded part -----------------------------------------------------------------

    async def _within_budget(self, request: web.Request, protocol: Protocol, encoding: str
                             ) -> web.StreamResponse:
        s = self.settings
        if not self.index.ready and not s.forward_before_ready:
            raise _Refusal(503, "index not ready yet (cluster state still loading)",
                           counter="reject", kind="not_ready",
                           headers={"Retry-After": RETRY_AFTER})
        length = request.content_length
        if length is not None and length > s.max_body_bytes:
            raise _Refusal(413, f"request body of {length} bytes exceeds the limit of "
                           f"{s.max_body_bytes} bytes", counter="reject", kind="too_large")
        if not self.budget.try_enter():
            raise _Refusal(503, "overloaded: too many requests in flight", counter="reject",
                           kind="overload", headers={"Retry-After": RETRY_AFTER})
        held = _Held()
        self.metrics.inflight.inc()
        try:
            self._reserve(held, length if length is not None else s.max_body_bytes)
            body = await self._read_body(request)
            return await self._process(request, protocol, encoding, body, held)
        finally:
            self.budget.leave()
            self.metrics.inflight.dec()
            self.budget.release(held.bytes)
            self.metrics.inflight_bytes.dec(held.bytes)

    def _reserve(self, held: _Held, n: int) -> None:
        if not self.budget.try_reserve(n):
            raise _Refusal(503, "overloaded: too many request bytes in flight",
                           counter="reject", kind="overload",
                           headers={"Retry-After": RETRY_AFTER})
        held.bytes += n
        self.metrics.inflight_bytes.inc(n)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        buf = bytearray()
        async for chunk in request.content.iter_any():
            if len(buf) + len(chunk) > limit:
                raise _Refusal(413, f"request body exceeds the limit of {limit} bytes",
                               counter="reject", kind="too_large")
            buf += chunk
        return bytes(buf)

    async def _process(self, request: web.Request, protocol: Protocol, encoding: str,
                       body: bytes, held: _Held) -> web.StreamResponse:
        s = self.settings
        try:
            declared = declared_decoded_size(body, encoding) if body else 0
        except DecodeError as e:
            raise _Refusal(e.status, e.message, counter="decode", kind=e.kind) from None
        # a declared size past the limit is refused by decompress without allocating
        self._reserve(held, min(declared if declared is not None else s.max_decoded_bytes,
                                s.max_decoded_bytes))
        out_encoding = self.upstream.out_encoding(encoding) if not self.upstream.converts(
            protocol) else None
        try:
            if declared is not None and declared <= INLINE_DECODED_BYTES:
                # shorter than a round trip through the pool (two thread switches)
                prepared = self._prepare(body, encoding, protocol, out_encoding)
            else:
                prepared = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._prepare, body, encoding, protocol, out_encoding)
        except DecodeError as e:
            raise _Refusal(e.status, e.message, counter="decode", kind=e.kind) from None
        except ValueError as e:
            raise _Refusal(400, f"cannot decode the remote-write message: {e}",
                           counter="decode", kind="protobuf") from None
        del body
        result = prepared.result
        self._count(result)
        answer = await self.upstream.forward(
            result.body, protocol, incoming_headers=request.headers, encoding=encoding,
            counts=result.counts, encoded=prepared.encoded,
        )
        if answer.ok:
            self.metrics.series.labels("out").inc(result.counts.series)
        return self._answer(answer)

    def _prepare(self, body: bytes, encoding: str, protocol: Protocol,
                 out_encoding: str | None) -> Prepared:
        """The worker-thread part of a request: decompress, splice, compress."""
        raw = decompress(body, encoding, max_decoded=self.settings.max_decoded_bytes)
        result = (self.enricher.enrich_v2(raw) if protocol is Protocol.V2
                  else self.enricher.enrich_v1(raw))
        encoded = compress(result.body, out_encoding) if out_encoding is not None else None
        return Prepared(result, encoded)

    def _count(self, result: SpliceResult) -> None:
        m, c = self.metrics, result.counts
        m.series.labels("in").inc(c.series)
        m.samples.inc(c.samples)
        if c.histograms:
            m.histograms.inc(c.histograms)
        if c.exemplars:
            m.exemplars.inc(c.exemplars)
        if result.attributed:
            m.attributed.inc(result.attributed)
        for reason, n in result.unattributed.items():
            m.unattributed.labels(reason).inc(n)

    @staticmethod
    def _answer(answer: Answer) -> web.Response:
        if answer.ok:
            return web.Response(status=answer.status, headers=answer.headers)
        body = answer.body.decode("utf-8", "replace").rstrip("\n")
        return _text(answer.status, body, answer.headers)
