"""The remote-write HTTP handler: receive -> decode -> enrich -> forward, with bounded load.

Decompressing, splicing and compressing one request run together in a worker thread (the
splice and cramjam release the GIL), so one process uses every core and health checks,
watches, fact writes and ``/metrics`` never wait behind a big request on the event loop.
Snappy in and out, nothing is compressed again: the upstream's block is made from the
sender's (``Splicer.splice_snappy``, ``proxy/wire/_snappy_edit.c``).

Every refusal is a 4xx or 5xx with a one-line message, a log line and a counter, and
nothing is allocated past the configured limits: the compressed body is read in chunks
against ``max_body_bytes`` and the decoded size is taken from the body's own header
before decompressing. Load is bounded by a request count and a byte budget; past either
the answer is 503 with ``Retry-After`` (never a 429 of our own): at once for the bytes,
and for a slot after at most ``admission_wait_seconds`` in line for one
(``proxy.admission``), with the body unread meanwhile.

Admission is decided on the headers alone, before a byte of the body is read: a refused
request is answered with ``Connection: close``, so its body is never parsed into the
process (aiohttp discards what is already in flight). The overload refusal, by far the
most frequent, is answered by the connection itself (``proxy.connection_guard``), which
keeps the connection open when the body can be skipped cheaply. An admitted body holds budget
only for the bytes that have arrived, and must arrive within a deadline and above a
minimum rate, so a sender that stalls mid-body holds a slot for seconds, not forever.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import re
import time
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

from aiohttp import web

from proxy import via
from proxy.admission import Outcome, Slots
from proxy.budget import Held, LoadBudget, Room
from proxy.compression import (
    DecodeError,
    SnappyPart,
    block_part,
    decompress_scratch,
    join_snappy,
    snappy_declared_length,
    zstd_declared_length,
)
from proxy.config import ServerSettings
from proxy.connection_guard import Canned, Wait, admitted, canned, holding, skippable
from proxy.cpus import usable_cpus
from proxy.deadline import Deadline
from proxy.index import PodIndex
from proxy.log import Throttled
from proxy.loop_metrics import LabelValues
from proxy.loop_workers import THREAD_LIMITS, LoopWorkers, ThreadStartError
from proxy.metrics import ProxyMetrics
from proxy.part_threads import PartThreads
from proxy.shown import one_line
from proxy.upstream import Answer, ConversionRefused, Outgoing, Upstream
from proxy.upstream_url import karta_extra_label
from proxy.wire.native import Splicer, split_v1
from proxy.wire.plan import (
    REASON_LABEL_LIMIT,
    REASON_OTHER_CLUSTER,
    SPLICE_REASONS,
    OverLimit,
    SplicePlan,
    SpliceResult,
    renumbered,
)
from proxy.wire.primitives import Counts, Protocol, protocol_from_content_type
from proxy.wire.splice_v1 import series_before

log = logging.getLogger("karta.handler")

WRITE_PATHS = ("/api/v1/write", "/api/v1/push", "/api/v1/receive")
#: VictoriaMetrics cluster (vminsert) write paths: the tenant goes to the same upstream path
TENANT_WRITE_PATHS = (
    "/insert/{tenant}/prometheus/api/v1/write",
    "/insert/{tenant}/prometheus",
    "/insert/{tenant}/prometheus/",
)
#: the routes of TENANT_WRITE_PATHS as one pattern (what the router serves, no more)
_TENANT_PATH = re.compile("(?:" + "|".join(
    re.escape(p).replace(re.escape("{tenant}"), "[^/]+") for p in TENANT_WRITE_PATHS) + r")\Z")
#: a tenant in a path: VictoriaMetrics' ``accountID[:projectID]``, or ``multitenant``.
#: ASCII digits only: ``\d`` also matches other scripts' digits (``/insert/%D9%A1%D9%A2/``
#: passed), which no receiver reads as a number
_TENANT = re.compile(r"[0-9]{1,10}(:[0-9]{1,10})?|multitenant")


def write_route(path: str) -> str | None:
    """The remote-write route a path is served by, as ``requests_total`` names it (the
    tenant path's template, not the tenant); None: not a remote-write path."""
    if path in WRITE_PATHS:
        return path
    if _TENANT_PATH.match(path) is None:
        return None
    return "/insert/{tenant}/" + path.split("/", 3)[3]  # /insert/<tenant>/<the rest>


ENCODINGS = ("snappy", "zstd")
#: Retry-After (seconds) sent with our own 503s (overload, not ready)
RETRY_AFTER = "1"
#: requests that decode to at most this many bytes are decompressed, spliced and
#: compressed on the event loop: their work (~0.2 ms at 64 KiB) costs less than handing
#: them to a worker thread and back; bigger ones go to the worker threads
INLINE_DECODED_BYTES = 64 * 1024
#: an RW 1.0 request that reaches an idle worker pool is spliced and compressed in parts
#: of at least this many decoded bytes, one per worker, at once: its latency is then about
#: decompress + (splice + compress) / workers (docs/wire.md, "Requests in parts"). Below
#: 2 x 256 KiB the hand-offs cost what the parts save: a 500-series request (~300 KiB,
#: what Prometheus before 2.44 sends) relayed 12% more samples/s whole (five pairs)
PART_DECODED_BYTES = 256 * 1024


class Enriching(typing.Protocol):
    """What the handler needs of ``proxy.enrichment.Enricher``: the splice of the plan in
    force, taken once per request, and the same plan over no pods, for a request none of
    whose series may be stamped (relayed before the index is ready, or stored under
    another cluster by its URL)."""

    @property
    def splicer(self) -> Splicer: ...

    @property
    def unstamped_splicer(self) -> Splicer: ...


def worker_count(configured: int) -> int:
    """Worker threads for the request work: ``configured``, or one per usable core (the
    affinity and the cgroup's CPU quota: ``proxy.cpus``)."""
    return configured if configured > 0 else usable_cpus()


@dataclass(slots=True)
class Prepared:
    """One request after its worker-thread part: the enrichment and the body to send."""

    result: SpliceResult
    #: ``result.body`` as it goes upstream (converted, compressed)
    outgoing: Outgoing


def splice_in_parts(raw: bytes | memoryview, block: bytes, cuts: list[int],
                    enrich: Callable[[bytes | memoryview, bytes, int], SpliceResult],
                    pool: Executor) -> tuple[SpliceResult, bytes]:
    """An RW 1.0 request spliced in parts at once (cut at ``cuts``, from ``split_v1``),
    the first part in this thread, the others in ``pool``: each part's output a snappy
    block made from the sender's ``block`` (``enrich(part, block, offset)``), the blocks
    joined into one, their results summed (the body left empty: it went out compressed).

    The same body, counts and errors as the whole (the 1.0 splice keeps no state across
    series); the first part's error in request order wins."""
    spans = list(itertools.pairwise([0, *cuts, len(raw)]))

    def part(a: int, b: int) -> tuple[SpliceResult, SnappyPart]:
        try:
            result = enrich(raw[a:b], block, a)
        except DecodeError as err:  # it names its series by the index in the whole request
            raise renumbered(err, series_before(raw, a) if a else 0) from None
        return result, block_part(result.body)

    futures: list[Future[tuple[SpliceResult, SnappyPart]]] = []
    try:
        for a, b in spans[1:]:  # a part thread that cannot start raises here
            futures.append(pool.submit(part, a, b))
        done = [part(*spans[0])]
    finally:
        wait(futures)  # every part ends before its request does
    while futures:  # a failed part raises, the first in order; its future is out of
        # this frame by then (the failure's traceback holds the frame: no cycle through it)
        done.append(futures.pop(0).result())
    merged = SpliceResult(b"", Counts())
    for result, _ in done:
        merged.add(result)
    return merged, join_snappy([block for _, block in done])


#: requests that may wait for a slot, per slot (past them: 503 at once). Three: at 4x more
#: connections than slots every fast-retrying sender has a place to wait in, and the
#: overload bench's 503s/s at 4x fell from ~1,100 to ~40 (one per slot left ~1,200);
#: a waiter holds a connection, its headers and what arrived with them (docs/operations.md)
WAITERS_PER_SLOT = 3

OVERLOAD_MESSAGE = "overloaded: too many requests in flight"
#: the whole answer when every slot is taken, written by ``proxy.connection_guard`` as
#: soon as the headers are parsed (see ``RemoteWriteHandler.shed``)
OVERLOAD_ANSWER = canned("503 Service Unavailable", {"Retry-After": RETRY_AFTER},
                         OVERLOAD_MESSAGE + "\n")

#: (route, Content-Type) pairs whose shed-request counter is kept at hand
SHED_COUNTERS_CACHED = 64
#: Content-Types whose protocol is kept at hand, not parsed again per request
PROTOCOLS_CACHED = 64
#: the series_total labels of what came in and what the upstream accepted
_IN: LabelValues = ("in",)
_OUT: LabelValues = ("out",)

#: the first second of a body is not held to ``min_body_bytes_per_second`` (connection
#: start, a sender's first write): the rate is what arrived over the time past it
BODY_RATE_GRACE_SECONDS = 1.0


#: what a 413 for the compressed body says after its limit: the setting, and what the
#: sender can do
BODY_LIMIT_SAID = "server.max_body_bytes; send fewer series per request"


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


def _no_room() -> _Refusal:
    """The answer when the byte budget has no room for a request now."""
    return _Refusal(503, "overloaded: too many request bytes in flight", counter="reject",
                    kind="overload", headers={"Retry-After": RETRY_AFTER})


def _out_of_memory(where: str) -> _Refusal:
    """The answer when an allocation failed while handling a request (``MemoryError``, or
    ``ENOMEM`` from a mapping): the process is at its memory limit (an address-space
    limit, ``ulimit -v``), which a retry may find freed. An allocation failure inside the
    snappy library's Rust code (cramjam) aborts the process instead and cannot be
    answered: ``server.max_inflight_bytes`` is what keeps requests within the memory."""
    return _Refusal(503, f"out of memory {where}: the proxy could not allocate what the "
                    "request needs now (its memory limit; server.max_inflight_bytes bounds "
                    "what requests hold); send it again", counter="reject",
                    kind="out_of_memory", headers={"Retry-After": RETRY_AFTER})


def _no_thread(message: str) -> _Refusal:
    """The answer when the thread a request needs cannot start (a pids limit): a retry may
    find one free (``proxy.loop_workers`` tries again at the next request)."""
    return _Refusal(503, f"{message}; send it again", counter="reject", kind="thread_limit",
                    headers={"Retry-After": RETRY_AFTER})


def _decode_refusal(e: DecodeError) -> _Refusal:
    """A body refused as it was decoded. The decoded-size limit is the proxy's setting,
    which the decoder does not know by name: said, as the other 413s say theirs, so the
    sender's log names what to raise (or to send less)."""
    message = e.message
    if e.kind == "too_large":
        message += " (server.max_decoded_bytes); send fewer series per request"
    return _Refusal(e.status, message, counter="decode", kind=e.kind)


def _thread_start_failed(e: RuntimeError) -> bool:
    return "can't start new thread" in str(e)


def _socket_fd(request: web.Request) -> int:
    """The connection's socket descriptor, for ``Slots.enter`` to notice a sender that
    goes away while waiting (-1: none)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock.fileno() if sock is not None else -1


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
        self.budget = LoadBudget(settings.max_inflight_bytes)
        #: request slots, and requests that may wait for one (proxy.admission)
        self.slots = Slots(settings.max_concurrent_requests,
                           settings.max_concurrent_requests * WAITERS_PER_SLOT,
                           settings.admission_wait_seconds)
        self._wait = Wait(self.slots.unpromise)
        self.workers = worker_count(settings.worker_threads)
        self._overload_rejected = metrics.rejected.labels("overload")
        #: (route, Content-Type) -> the labels of its requests_total{code="503"}, for ``shed``
        self._shed_counters: dict[tuple[str, str], LabelValues] = {}
        #: Content-Type -> its protocol and that protocol's label, for ``handle``
        self._protocols: dict[str, tuple[Protocol, str]] = {}
        self._pool = LoopWorkers("karta-splice", self.workers)
        metrics.watch_workers(self._pool)
        # the request path's metric updates, cheap: plain numbers the event loop thread adds
        # to (proxy.loop_metrics: this handler runs on it alone), the in-flight gauges read
        # at scrape time from what the handler keeps anyway
        self._requests = metrics.requests.values
        self._durations = metrics.request_duration.series
        self._series = metrics.series.values
        self._unattributed = metrics.unattributed.values
        for reason in SPLICE_REASONS:  # present at 0 before the first (plan.SPLICE_REASONS)
            self._unattributed[(reason,)] += 0
        #: requests admitted and not yet answered (karta_proxy_inflight_requests)
        self._inflight = 0
        metrics.inflight.set_function(lambda: self._inflight)
        metrics.inflight_bytes.set_function(lambda: self.budget.bytes)
        #: the other parts of a request in parts (a part never waits on another part, so
        #: this pool cannot deadlock); None with one worker
        self._parts = PartThreads(self.workers - 1) if self.workers > 1 else None
        #: requests in the worker threads now (counted on the event loop)
        self._in_workers = 0
        #: header timeouts come by the thousand from idle or slowloris connections
        self._header_timeouts = Throttled(log, "request refused", "requests refused",
                                          peer_field="remote")
        #: so do connections past the limit, and headers past theirs (a flood of either)
        self._connections_refused = Throttled(log, "connection refused", "connections refused",
                                              peer_field="remote")
        #: and so do refused requests, from one broken or overloaded sender as from a fleet
        #: (500 corrupt bodies made 500 warnings in 0.4 s): a line per kind and status and
        #: interval, the counters exact. Overload and its kin are info, the rest warnings
        self._refusals = Throttled(log, "request refused", "requests refused",
                                   peer_field="remote")
        self._refusals_info = Throttled(log, "request refused", "requests refused",
                                        peer_field="remote", level=logging.INFO)
        #: and so do series the stamp would push past the TSDB's label limit (a metric with
        #: many labels comes in every request): a line per interval naming the metric
        self._label_limited = Throttled(
            log, "a series over the TSDB's label limit with the stamp, forwarded unattributed",
            "series over the TSDB's label limit with the stamp, forwarded unattributed",
            peer_field=None)
        #: and so do series of another cluster (a misconfigured agent sends them in every
        #: request, and after an upgrade whose facts.external_labels does not match the
        #: agents' every series is one): a line per interval naming the value seen, this
        #: proxy's, the sender and what to change, the summary how many values. One key:
        #: the value is the sender's to choose (one a request made a line and a window
        #: each, for good)
        self._other_cluster = Throttled(
            log, "series of another cluster forwarded unattributed: their cluster label is "
            "not this proxy's (facts.external_labels), so this cluster's pods are not theirs",
            "series of another cluster forwarded unattributed", peer_field="remote",
            distinct_field="seen")
        #: and so do RW 2.0 requests whose symbol index was flooded (one sender's, in every
        #: request it sends): a line per interval naming the request's size and the sender
        self._index_flooded = Throttled(
            log, "an RW 2.0 request's symbols collide in the splice's hash (a hash flood?): "
            "its symbol index was rebuilt with a keyed hash, the request forwarded",
            "RW 2.0 requests whose symbols collide in the splice's hash, forwarded",
            peer_field="remote")
        #: answers not taken by their clients come by the dozen from one scraper or
        #: browser that hangs, by the thousand from a flood
        self._send_timeouts = Throttled(log, "connection aborted", "connections aborted",
                                        peer_field="remote")
        #: idle connections closed to make room: the way a full proxy works, not a fault
        self._idle_closed = Throttled(log, "idle connection closed", "idle connections closed",
                                      peer_field="remote", level=logging.INFO)
        metrics.connections_refused.labels("max_connections")  # present from the start, at 0
        metrics.connections_closed.labels("idle_at_limit")
        metrics.connections_closed.labels("unused")
        #: connections that sent nothing closed at the header deadline: a sender's pool
        self._unused_closed = Throttled(log, "unused connection closed",
                                        "unused connections closed", peer_field="remote",
                                        level=logging.INFO)
        #: the child a splice that takes more counts in (looked up once, not per request)
        self._splices_grown = metrics.splice_limits.labels("grown")

    def relaying(self) -> bool:
        """Whether a remote-write request is being handled now (it holds a slot: from its
        headers to its answer); background work on the event loop (a fact write, a standby's
        walk, a ``/metrics`` page: ``proxy.yielding``) waits for it."""
        return self.slots.requests > 0

    def flush_logs(self) -> None:
        """Write the throttled lines that wait for their summary (on the event loop, at
        stop)."""
        self._header_timeouts.close()
        self._connections_refused.close()
        self._send_timeouts.close()
        self._idle_closed.close()
        self._refusals.close()
        self._refusals_info.close()
        self._label_limited.close()
        self._other_cluster.close()
        self._index_flooded.close()

    def close(self) -> None:
        """Stop the worker threads (after the server stopped taking requests)."""
        self._pool.shutdown()
        if self._parts is not None:
            self._parts.shutdown(wait=True, cancel_futures=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        protocol_label = "unknown"
        # the connection stopped reading while the request waits its turn (a ``Wait``):
        # known before the first await, and no other request of the connection is handed
        # a ``Wait`` while this one is in progress (``proxy.connection_guard``)
        waiting = holding(request)
        try:
            if request.method != "POST":
                raise _Refusal(405, f"method {request.method} not allowed: remote write is POST",
                               counter="reject", kind="method", headers={"Allow": "POST"})
            headers = request.headers
            if "Via" in headers:  # forwarded by a proxy: by this one, it is a loop
                came = via.sent(headers)
                if came is not None and via.came_through_here(came):
                    raise _Refusal(508, via.LOOP_SAID, counter="reject", kind="loop")
            tenant = request.match_info.get("tenant")
            if tenant is not None and not _TENANT.fullmatch(tenant):
                raise _Refusal(400, f"invalid tenant {tenant[:64]!r} in the path: expected "
                               "accountID, accountID:projectID or multitenant",
                               counter="reject", kind="invalid_tenant")
            query = request.rel_url.raw_query_string
            forged = karta_extra_label(query) if query else ""
            if forged:
                raise _Refusal(400, f"query parameter extra_label={forged[:128]!r} names a "
                               "karta_* label: VictoriaMetrics would set it on every series "
                               "over the labels the proxy stamps; karta_* labels are the "
                               "proxy's own: remove it from the sender's URL",
                               counter="reject", kind="karta_extra_label")
            protocol, protocol_label = self._protocol(headers)
            encoding = self._encoding(headers)
            header = self.upstream.unforwardable(headers)
            if header:
                raise _Refusal(400, f"header {header} is not valid UTF-8: it cannot be "
                               "forwarded to the upstream as it came", counter="reject",
                               kind="invalid_header")
            try:
                response = await self._within_budget(request, protocol, encoding, tenant,
                                                     query, waiting)
            except MemoryError:  # forwarding (a body decoded again to send it in parts);
                # its slot and budget were released on the way out
                raise _out_of_memory("forwarding the request") from None
        except _Refusal as r:
            response = self._refuse(request, r)
        finally:
            if waiting:  # else there is no place in line to give back
                self._unhold(request)
        self._count_request(request, protocol_label, response.status, started)
        return response

    def _count_request(self, request: web.Request, protocol_label: str, status: int,
                       started: float) -> None:
        """A request answered: counted, and timed from ``started`` (``perf_counter``)."""
        # the route, not the path: one series per tenant path template, not per tenant
        route = request.match_info.route.resource
        path = route.canonical if route is not None else request.path
        self._requests[(path, protocol_label, str(status))] += 1
        self._durations[(protocol_label,)].observe(time.perf_counter() - started)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """The route's ``Expect`` handler: never ``100 Continue`` here (aiohttp's default
        sends it before the handler runs, so a sender over the limits would send its body
        anyway); ``_read_body`` sends it once the request is admitted."""
        started = time.perf_counter()
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            refusal = _Refusal(417, f"unsupported Expect {expect[:64]!r}: only 100-continue",
                               counter="reject", kind="expectation")
            response = self._refuse(request, refusal)
            response.force_close()
            self._unhold(request)
            self._count_request(request, "unknown", 417, started)
            return response
        return None

    def bad_http(self, remote: str, message: str, *, quiet: bool = False) -> None:
        """A request aiohttp's parser refused (400 before any handler: a malformed request
        line, header or chunk, Content-Length and Transfer-Encoding both): counted and
        logged like every refusal, throttled (``quiet``: at debug, for a first request
        that is not HTTP at all, a port scan or TLS to a plain port). Each closes its
        connection, so a broken sender retrying made a warning per connection: 1,130
        lines a minute from one sender at 19 a second, unthrottled as they were."""
        self.metrics.rejected.labels("bad_http").inc()
        refusal = {"status": 400, "kind": "bad_http", "reason": message[:200], "remote": remote}
        if quiet:
            log.debug("request refused", extra=refusal)
        elif log.isEnabledFor(self._refusals.level):
            self._refusals.event("bad_http:400", refusal)

    def connection_refused(self, remote: str) -> None:
        """A connection closed as soon as it was made, ``server.max_connections`` being
        open: every one counted, the lines throttled (they come by the thousand when a
        fleet reconnects)."""
        self.metrics.connections_refused.labels("max_connections").inc()
        self._connections_refused.event("max_connections", {
            "reason": "max_connections", "remote": remote,
            "limit": self.settings.max_connections,
        })

    def idle_connection_closed(self, remote: str) -> None:
        """An idle keep-alive connection aborted to make room for a new one at
        ``server.max_connections`` (its client reconnects when it next sends): counted,
        the lines throttled, at info."""
        self.metrics.connections_closed.labels("idle_at_limit").inc()
        self._idle_closed.event("idle_at_limit", {
            "reason": "idle_at_limit", "remote": remote,
            "limit": self.settings.max_connections,
        })

    def send_timed_out(self, remote: str, unsent: int) -> None:
        """A connection aborted because its client left bytes of an answer unsent for
        ``server.send_timeout_seconds`` (it does not read: its answer's memory and its
        place are released): every one counted, the lines throttled."""
        self.metrics.rejected.labels("send_timeout").inc()
        self._send_timeouts.event("send_timeout", {
            "kind": "send_timeout", "remote": remote, "unsent_bytes": unsent,
            "reason": "the client did not take the rest of its answer within "
                      f"{self.settings.send_timeout_seconds:g} s",
        })

    def header_too_large(self, remote: str, reason: str) -> None:
        """A request whose line and headers passed ``server.max_header_bytes`` (or one of
        aiohttp's per-line limits): 431 and closed; counted, the lines throttled, as a
        sender that sends them once sends them on every retry."""
        self.metrics.rejected.labels("header_too_large").inc()
        self._header_timeouts.event("header_too_large", {
            "status": 431, "kind": "header_too_large", "remote": remote, "reason": reason})

    def _unhold(self, request: web.Request) -> None:
        """A request refused before it waited its turn: its connection reads again (to skip
        its body, or the next request) and its promised place is given back."""
        if admitted(request):
            self.slots.unpromise()

    def shed(self, method: str, path: str, headers: Mapping[str, str],
             remote: Callable[[], str]) -> Canned | Wait | None:
        """The whole answer to a remote write refused for overload on its headers, before
        aiohttp makes a request of it (``proxy.connection_guard``); a ``Wait``: handle it,
        it waits for a slot with the connection not reading, its place in line promised;
        None: handle it. ``remote()``: the sender's address, for the refusal's line.

        Only the slot check is made here, the one that fails by the hundreds per second
        under overload; every other refusal stays in ``handle``."""
        if not self.slots.full() or method != "POST":
            return None
        route = write_route(path)
        if route is None:
            return None
        if self.slots.may_wait():
            self.slots.promise()
            return self._wait
        started = time.perf_counter()
        content_type = headers.get("Content-Type", "")
        labels = self._shed_counters.get((route, content_type))
        if labels is None:
            labels = self._shed_labels(route, content_type)
        self._overload_rejected.inc()
        self._requests[labels] += 1
        if log.isEnabledFor(logging.INFO):
            self._refusals_info.event("overload:503", {
                "status": 503, "kind": "overload", "reason": OVERLOAD_MESSAGE, "path": path,
                "remote": remote(), "user_agent": headers.get("User-Agent", ""),
            })
        # timed as every request counted is (its protocol is the counter's): left out,
        # the duration's count fell short of the requests by every overload refusal, and
        # its quantiles said nothing of the answers senders got most under overload
        self._durations[(labels[1],)].observe(time.perf_counter() - started)
        return OVERLOAD_ANSWER

    def _shed_labels(self, route: str, content_type: str) -> LabelValues:
        """The labels of a shed request's ``requests_total``, cached by route and
        Content-Type for the next ones (the Content-Type parse costs more than the rest of
        a refusal); the cache is bounded, the Content-Type being the sender's to choose."""
        try:
            protocol_label = protocol_from_content_type(content_type).name.lower()
        except DecodeError:
            protocol_label = "unknown"
        labels = (route, protocol_label, "503")
        if len(self._shed_counters) < SHED_COUNTERS_CACHED:
            self._shed_counters[(route, content_type)] = labels
        return labels

    def ended_at_stop(self, count: int) -> None:
        """``count`` requests still in flight when the stop's drain ran out were ended,
        unanswered (their connections closed: their senders send them again): one line,
        where their cancelled handlers logged nothing. No counter: the listener, /metrics
        with it, is closed by then, and no scrape would see it."""
        log.warning("%d request%s still in flight ended at stop, unanswered (their senders "
                    "send them again)", count, "" if count == 1 else "s",
                    extra={"kind": "ended_at_stop", "count": count})

    def header_timed_out(self, remote: str, *, unused: bool = False) -> None:
        """A connection closed because its request headers did not arrive in time: every
        one counted, the lines throttled (3,000 idle connections made 3,000 lines). One
        that sent no byte (``unused``) refused no request: it is a closed connection, at
        info (a Prometheus leaves a few after every scale-up of its shards)."""
        if unused:
            self.metrics.connections_closed.labels("unused").inc()
            self._unused_closed.event("unused", {
                "reason": "unused", "remote": remote,
                "seconds": self.settings.header_read_timeout_seconds,
            })
            return
        self.metrics.rejected.labels("header_timeout").inc()
        self._header_timeouts.event("header_timeout", {
            "status": 408, "kind": "header_timeout", "remote": remote,
            "reason": "request line and headers not received within "
                      f"{self.settings.header_read_timeout_seconds:g} s",
        })

    # -- request checks -------------------------------------------------------------------

    def _protocol(self, headers: Mapping[str, str]) -> tuple[Protocol, str]:
        """The protocol a request's Content-Type names, and its label in the metrics; a
        Content-Type seen before is not parsed again (a sender sends the same one every
        request; the map is bounded, the Content-Type being the sender's to choose)."""
        content_type = headers.get("Content-Type", "")
        known = self._protocols.get(content_type)
        if known is not None:
            return known
        try:
            protocol = protocol_from_content_type(content_type)
        except DecodeError as e:
            raise _Refusal(e.status, e.message, counter="reject",
                           kind="unsupported_media_type") from None
        known = protocol, protocol.name.lower()
        if len(self._protocols) < PROTOCOLS_CACHED:
            self._protocols[content_type] = known
        return known

    def _encoding(self, headers: Mapping[str, str]) -> str:
        # no Content-Encoding is snappy, as Prometheus' receiver takes it (both RW versions
        # require a compressed body, and snappy is the one every sender speaks)
        enc = headers.get("Content-Encoding", "")
        if enc in ENCODINGS:  # as every sender spells it: nothing to strip or fold
            return enc
        enc = enc.strip().lower() or "snappy"
        if enc not in ENCODINGS:
            raise _Refusal(415, f"unsupported Content-Encoding {enc!r}: remote write needs "
                           "snappy or zstd", counter="reject", kind="unsupported_media_type")
        return enc

    def _refuse(self, request: web.Request, r: _Refusal) -> web.Response:
        if r.counter == "decode":
            self.metrics.decode_errors.labels(r.kind).inc()
        else:
            self.metrics.rejected.labels(r.kind).inc()
        lines = (self._refusals_info if r.kind in ("overload", "not_ready", "client_closed")
                 else self._refusals)
        if log.isEnabledFor(lines.level):
            lines.event(f"{r.kind}:{r.status}", {
                "status": r.status, "kind": r.kind, "reason": r.message, "path": request.path,
                "remote": request.remote, "user_agent": request.headers.get("User-Agent", ""),
            })
        response = _text(r.status, r.message, r.headers)
        if not request.content.is_eof() and not (
                r.kind == "overload"
                and skippable(request.version, request.keep_alive, request.headers)):
            # the body was not (all) read: closing is cheaper than reading it to keep the
            # connection, and a stalled one goes away. Not for overload (a slot taken
            # between the headers and the handler, or the byte budget): that sender retries
            # at once, and its reconnect costs more than aiohttp's lingering read of a body
            # small enough to skip (LINGER_SECONDS at most, then it closes)
            response.force_close()
        return response

    # -- the bounded part -----------------------------------------------------------------

    async def _within_budget(self, request: web.Request, protocol: Protocol, encoding: str,
                             tenant: str | None, query: str, waiting: bool
                             ) -> web.StreamResponse:
        """The request within its slot and byte budget; ``tenant`` and ``query`` as its
        path and URL gave them (forwarded as they came), ``waiting``: its connection
        stopped reading while it waits its turn."""
        s = self.settings
        if not self.index.ready and not s.forward_before_ready:
            raise _Refusal(503, "index not ready yet (cluster state still loading)",
                           counter="reject", kind="not_ready",
                           headers={"Retry-After": RETRY_AFTER})
        length = request.content_length
        if length is not None and length > s.max_body_bytes:
            raise _Refusal(413, f"request body of {length} bytes exceeds the limit of "
                           f"{s.max_body_bytes} bytes ({BODY_LIMIT_SAID})", counter="reject",
                           kind="too_large")
        # a free slot is taken at once (what ``enter`` does first); else the request waits
        # in line, its sender's socket watched for a hang-up
        if waiting or not self.slots.try_enter():
            outcome = await self.slots.enter(_socket_fd(request), promised=waiting)
            if waiting:
                admitted(request)
            if outcome is not Outcome.ADMITTED:
                # GONE: the sender closed while waiting, so this answer goes nowhere;
                # counted and logged as the overload refusal it was
                raise _Refusal(503, OVERLOAD_MESSAGE if outcome is Outcome.REFUSED
                               else "overloaded: the sender left while waiting for a slot",
                               counter="reject", kind="overload",
                               headers={"Retry-After": RETRY_AFTER})
        held = Held(self.budget)
        self._inflight += 1
        try:
            # the body passed straight on: a local here would keep it (and its budget's
            # worth of memory) alive until the answer, after _process let it go
            return await self._process(request, protocol, encoding, tenant, query,
                                       await self._read_body(request, held), held)
        finally:
            self.slots.leave()
            self._inflight -= 1
            self.budget.release(held.bytes)

    def _reserve(self, held: Held, n: int) -> None:
        if not held.take(n):
            raise _no_room()

    async def _read_body(self, request: web.Request, held: Held) -> bytes:
        """The body, reserved chunk by chunk as it arrives (never the maximum up front:
        a sender that stalls holds only what it sent), within the read deadline and above
        the minimum rate; a stall past either is a 503 that releases the slot."""
        s = self.settings
        limit = s.max_body_bytes
        headers = request.headers
        if "Expect" in headers and headers["Expect"].lower() == "100-continue" and \
                request.version >= (1, 1):
            # only now that the request holds a slot: a refused sender never sends its body
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + s.body_read_timeout_seconds
        rate = s.min_body_bytes_per_second
        content = request.content
        chunks: list[bytes] = []
        received = 0
        try:
            while True:
                # what has arrived is taken as it is; a deadline only for a wait (by the time a
                # request holds its slot its body is usually all here: no timer, and a body of
                # one chunk is returned without a copy)
                chunk = content.read_nowait()
                if not chunk:
                    if content.at_eof():
                        break
                    # the next byte is due when the bytes so far stop covering the minimum rate
                    due = started + BODY_RATE_GRACE_SECONDS + (received + 1) / rate
                    try:
                        async with Deadline(min(deadline, due)):
                            chunk = await content.readany()
                    except TimeoutError:
                        raise self._stalled(received, loop.time() - started,
                                            due < deadline) from None
                    if not chunk:
                        break
                size = len(chunk)
                if received + size > limit:
                    raise _Refusal(413, f"request body exceeds the limit of {limit} bytes "
                                   f"({BODY_LIMIT_SAID})", counter="reject", kind="too_large")
                self._reserve(held, size)
                received += size
                chunks.append(chunk)
        except ConnectionError:  # the sender hung up mid-body: nobody to answer, but counted
            # and logged as every refusal is (499: nginx's "client closed request"), not an
            # error with a traceback from aiohttp
            raise _Refusal(499, f"the sender closed the connection after {received} bytes "
                           "of its body", counter="reject", kind="client_closed") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _stalled(self, received: int, elapsed: float, too_slow: bool) -> _Refusal:
        """A body that stopped coming (or came too slowly) is refused with a 503, not a
        408: a sender keeps a batch it gets a 5xx for and sends it again, but drops one it
        gets any other 4xx for (Prometheus; 408 included), and a slow link or a stalled
        connection is no fault of the data."""
        s = self.settings
        if too_slow:
            return _Refusal(503, f"request body too slow: {received} bytes in {elapsed:.1f} s, "
                            f"below {s.min_body_bytes_per_second} bytes/s; send it again",
                            counter="reject", kind="body_too_slow",
                            headers={"Retry-After": RETRY_AFTER})
        return _Refusal(503, f"request body not received within "
                        f"{s.body_read_timeout_seconds:g} s ({received} bytes arrived); "
                        "send it again", counter="reject", kind="body_timeout",
                        headers={"Retry-After": RETRY_AFTER})

    async def _process(self, request: web.Request, protocol: Protocol, encoding: str,
                       tenant: str | None, query: str, body: bytes, held: Held
                       ) -> web.StreamResponse:
        s = self.settings
        # the decoded size the body declares in its own header (None: a zstd frame without
        # one), to reserve memory before decompressing (``decompress`` enforces the hard
        # limit); a header already corrupt is refused here
        try:
            declared = (0 if not body else snappy_declared_length(body)
                        if encoding == "snappy" else zstd_declared_length(body))
        except DecodeError as e:
            raise _decode_refusal(e) from None
        # a declared size past the limit is refused by decompress without allocating.
        # Reserved twice: the decoded body, and the output the splice makes beside it (a
        # snappy block of the sender's elements and the stamps, or the enriched body and
        # its compressed copy), about the decoded size for real series (stamps ~20%);
        # settled to what the request holds once spliced
        decoded = (declared if declared is not None and declared < s.max_decoded_bytes
                   else s.max_decoded_bytes)
        self._reserve(held, 2 * decoded)
        # the second decoded size is the splice's to hold beside the decoded body; past it
        # the splice takes more as it grows, up to what one request may hold: the larger
        # of the budget and a request at the body and decoded limits (LoadBudget.fits)
        whole = max(s.max_inflight_bytes, s.max_body_bytes + 2 * s.max_decoded_bytes)
        room = Room(held, decoded, whole - held.bytes + decoded, self._splices_grown)
        splicer, elsewhere = self._splicer_for(tenant, query)
        try:
            if declared is not None and declared <= INLINE_DECODED_BYTES \
                    and len(body) <= INLINE_DECODED_BYTES:
                # shorter than a round trip through the pool (two thread switches)
                prepared = self._prepare(body, encoding, protocol, splicer, 1, room)
            else:
                parts = self._parts_for(declared, protocol, encoding)
                self._in_workers += 1
                try:
                    prepared = await self._pool.submit(self._prepare, body, encoding, protocol,
                                                       splicer, parts, room)
                finally:
                    self._in_workers -= 1
        except ThreadStartError as e:
            raise _no_thread(str(e)) from None
        except RuntimeError as e:  # a part thread (``PartThreads``) that could not start
            if not _thread_start_failed(e):
                raise
            raise _no_thread(f"cannot start a part thread ({e}): {THREAD_LIMITS}") from None
        except MemoryError:
            raise _out_of_memory("decoding the request") from None
        except OSError as e:  # a scratch buffer's mapping (proxy.compression): ENOMEM
            if e.errno != errno.ENOMEM:
                raise
            raise _out_of_memory("decoding the request") from None
        except OverLimit as e:
            raise self._no_room_to_splice(e.need, room.refused) from None
        except ConversionRefused as e:
            raise self._not_converted(e) from None
        except DecodeError as e:
            raise _decode_refusal(e) from None
        except ValueError as e:
            raise _Refusal(400, f"cannot decode the remote-write message: {e}",
                           counter="decode", kind="protobuf") from None
        body_bytes = len(body)
        del body
        result = prepared.result
        if elsewhere is not None:
            result.stored_elsewhere(elsewhere[0])
        # from here to the answer it holds its outgoing body only, compressed: its own
        # body and the decoded one are gone
        held.settle(len(prepared.outgoing.encoded))
        self._count(result)
        if result.other_cluster is not None:
            self._other_cluster_seen(splicer.plan, result, request,
                                     elsewhere[1] if elsewhere is not None else "", tenant)
        if result.index_flooded:
            self.metrics.symbol_index_floods.inc()
            self._index_flooded.event("index_flooded", {
                "remote": request.remote, "symbols": result.index_flooded,
                "series": result.counts.series, "body_bytes": body_bytes,
                "user_agent": request.headers.get("User-Agent", "")})
        try:
            answer = await self.upstream.forward(
                prepared.outgoing, request.headers, tenant=tenant, query=query, charge=held,
                sender_gone=lambda: request.transport is None)
        except DecodeError as e:  # an RW 2.0 body converted only after the upstream refused it
            raise _decode_refusal(e) from None
        except ConversionRefused as e:  # the same, refused for its size or the budget
            raise self._not_converted(e) from None
        if answer.series_stored is not None:  # sent in parts: those the upstream took now
            self._series[_OUT] += answer.series_stored
        elif answer.ok:
            self._series[_OUT] += result.counts.series
        if answer.overload:
            # no room in the byte budget to send it in parts: the proxy's own 503, as
            # every overload refusal is (KartaProxyUpstreamFailing blamed it upstream)
            self._overload_rejected.inc()
        return self._answer(answer)

    def _no_room_to_splice(self, need: int, refused: str) -> _Refusal:
        """The answer to a request whose splice was refused the room it needs (about
        ``need`` bytes beside its decoded body): 413 when one request may not hold that
        much, 503 when the byte budget has no room for it now."""
        self.metrics.splice_limits.labels(refused or "too_large").inc()
        if refused == "overload":
            return _no_room()
        return _Refusal(413, f"the enriched request would hold about {need} bytes beside its "
                        "decoded body, more than one request may (server.max_inflight_bytes, "
                        "or max_body_bytes + 2 x max_decoded_bytes if larger): its series are "
                        "small beside the labels stamped onto them; send fewer series per "
                        "request", counter="reject", kind="too_large")

    def _not_converted(self, e: ConversionRefused) -> _Refusal:
        """The answer to an RW 2.0 request a 1.0-only upstream needs converted, whose
        conversion was refused before it was made: 413 when its RW 1.0 form would be larger
        than a conversion may make (:func:`proxy.upstream.conversion_limit`: RW 2.0 names a
        string once, RW 1.0 repeats it in every series that has it), 503 when the byte
        budget has no room for it now."""
        if e.reason == "overload":
            return _no_room()
        return _Refusal(413, f"the request converted to RW 1.0 (the upstream takes RW 1.0 "
                        f"only) would be {e.size} bytes, more than a conversion may make "
                        f"({e.limit}: the larger of server.max_decoded_bytes and a third of "
                        "server.max_inflight_bytes): RW 2.0 names a string once, RW 1.0 "
                        "repeats it in every series that has it; send fewer series per "
                        "request, or shorter label values", counter="reject",
                        kind="too_large")

    def _parts_for(self, declared: int | None, protocol: Protocol, encoding: str) -> int:
        """How many parts to splice a request in: one per worker for a big RW 1.0 request
        in and out as snappy while no other request is in the workers (under load every
        worker has a request of its own already, and parts would only add hand-offs)."""
        if (self._parts is None or self._in_workers or declared is None
                or protocol is not Protocol.V1 or encoding != "snappy"
                or self.upstream.out_encoding(encoding) != "snappy"):
            return 1
        return max(1, min(self.workers, declared // PART_DECODED_BYTES))

    def _splicer_for(self, tenant: str | None, query: str
                     ) -> tuple[Splicer, tuple[bytes, str] | None]:
        """The splice of a request (one plan for the whole request, its parts too), and
        the other cluster its URL stores it under with whose ``extra_label`` that is
        (``Upstream.extra_label``), None when it does not.

        Over no pods (``Enricher.unstamped_splicer``) before the index is ready
        (``forward_before_ready``: a half-listed cluster stamps phantoms), and when the
        URL as forwarded sets the cluster label (``enrich.cluster_label``) to another
        value than the proxy's: VictoriaMetrics sets it on every series over the series'
        own (the last ``extra_label`` of the name wins), so each would be stored in that
        cluster with this one's workloads, whatever label the body carries. On a
        receiver that ignores ``extra_label`` (Prometheus, Mimir, Thanos) the request is
        unstamped all the same: which receiver is behind ``upstream.url`` is not known
        (vmagent, a gateway in front of VictoriaMetrics), and the parameter says the
        sender means another cluster. The URL's own ``extra_label`` of another cluster is a
        settings error (``proxy.config.check_stored_cluster``) where requests naming no
        tenant go; here it is found for a tenant a request names through a ``{tenant}``
        in the label's value (``cluster=c{tenant}``: each tenant a cluster). On the event
        loop, as a reload's ``replan``: the two splicers are of one plan."""
        enricher = self.enricher
        splicer = enricher.splicer
        check = splicer.plan.cluster
        elsewhere = None
        if check is not None:
            elsewhere = self.upstream.extra_label(check[0], tenant, query)
            if elsewhere is not None and elsewhere[0] == check[1]:
                elsewhere = None  # this cluster's: the series' own labels decide
        if elsewhere is not None or not self.index.ready:
            return enricher.unstamped_splicer, elsewhere
        return splicer, None

    def _prepare(self, body: bytes, encoding: str, protocol: Protocol, splicer: Splicer,
                 parts: int = 1, room: Room | None = None) -> Prepared:
        """The worker-thread part of a request: decompress, splice (with ``splicer``,
        ``_splicer_for``), convert, compress. ``room``: what the splice may hold beside the
        decoded body (``OverLimit`` past it)."""
        limit = room.limit if room is not None else None
        # the splice copies what it keeps (an untouched body included), so the body may be
        # decoded into the thread's scratch buffer (proxy.compression._Scratch)
        raw = decompress_scratch(body, encoding, max_decoded=self.settings.max_decoded_bytes)
        cuts = split_v1(raw, parts) if parts > 1 else []
        if cuts:
            assert self._parts is not None
            # the parts on other cores than this one (else Linux may wake the part thread
            # here, and the parts take turns on one core: proxy.part_threads)
            self._parts.elsewhere()
            merged, encoded = splice_in_parts(
                raw, body, cuts, self._part_splice(splicer, len(raw), room), self._parts)
            return Prepared(merged, self.upstream.prepared(encoded, Protocol.V1, merged.counts))
        if encoding == "snappy" and self.upstream.out_encoding(encoding) == "snappy" \
                and not self.upstream.converts(protocol):
            # snappy in and out: the output block is made from the sender's (the splice's
            # edits applied to its elements), not compressed again
            result = splicer.splice_snappy(protocol, raw, body, 0, limit, room)
            outgoing = self.upstream.prepared(result.body, protocol, result.counts)
        else:
            result = (splicer.splice_v2(raw, limit, room) if protocol is Protocol.V2
                      else splicer.splice_v1(raw, limit, room))
            # a conversion to RW 1.0 is charged to the request's budget (``charge``)
            outgoing = self.upstream.prepare(result.body, protocol, encoding, result.counts,
                                             room.held if room is not None else None)
        # it goes out compressed: the decoded body is not held while the request is in
        # flight (as in parts; 1.5 MB per 2,000-series request)
        result.body = b""
        return Prepared(result, outgoing)

    @staticmethod
    def _part_splice(splicer: Splicer, whole: int, room: Room | None
                     ) -> Callable[[bytes | memoryview, bytes, int], SpliceResult]:
        """The splice of one part of a request of ``whole`` decoded bytes, with the
        request's ``splicer``: its share of the request's room, and past it the estimate
        for the whole request."""
        def splice(raw: bytes | memoryview, block: bytes, base: int) -> SpliceResult:
            if room is None:
                return splicer.splice_snappy(Protocol.V1, raw, block, base)
            share = len(raw) / max(1, whole)
            mine = Room(room.held, int(room.limit * share), int(room.most * share),
                         room.grown)
            try:
                return splicer.splice_snappy(Protocol.V1, raw, block, base, mine.limit, mine)
            except OverLimit as e:
                room.refused = mine.refused
                raise OverLimit(int(e.need / share)) from None
        return splice

    def _count(self, result: SpliceResult) -> None:
        m, c = self.metrics, result.counts
        self._series[_IN] += c.series
        m.samples.values[()] += c.samples
        if c.histograms:
            m.histograms.values[()] += c.histograms
        if c.exemplars:
            m.exemplars.values[()] += c.exemplars
        if result.attributed:
            m.attributed.values[()] += result.attributed
        if result.stripped:
            m.sender_karta_dropped.values[()] += result.stripped
        unattributed = self._unattributed
        for reason, n in result.unattributed.items():
            unattributed[(reason,)] += n
        limited = result.label_limited
        if limited is not None and log.isEnabledFor(self._label_limited.level):
            self._label_limited.event(REASON_LABEL_LIMIT, {
                "metric": limited.metric.decode("utf-8", "replace") or "(no __name__)",
                "labels": limited.labels, "limit": limited.limit,
                "series": result.unattributed.get(REASON_LABEL_LIMIT, 0),
                "setting": "upstream.max_labels_per_series",
            })

    def _other_cluster_seen(self, plan: SplicePlan, result: SpliceResult,
                            request: web.Request, source: str, tenant: str | None) -> None:
        """The throttled line of a request with series of another cluster: which label,
        the value seen (the request's first, or its URL's), this proxy's value, where the
        value came from (``source``: "" the series, else whose ``extra_label``; ``tenant``:
        the one the request named, which upstream.url's names), the sender, and the change
        that makes them agree, spelled out (after an upgrade to the check, a proxy whose
        facts.external_labels was never set to the agents' value sees every series so)."""
        check = plan.cluster
        if check is None or result.other_cluster is None \
                or not log.isEnabledFor(self._other_cluster.level):
            return
        label, expected = (x.decode("utf-8", "replace") for x in check)
        seen = result.other_cluster.decode("utf-8", "replace")[:200]
        if source == "sender":
            where = f"extra_label={label}={seen} in the sender's URL"
            fix = (f"the TSDB stores every series of these requests under {label}=\"{seen}\" "
                   "(VictoriaMetrics sets an extra_label over the series' own): if they are "
                   f"this cluster's, remove extra_label={label}=... from the sender's "
                   "remote-write URL (or make it "
                   f"{label}={expected}); enrich.cluster_label: \"\" turns the check off")
        elif source:
            tenant = tenant if tenant is not None else "(none named)"
            where = f"extra_label={label}={seen} in upstream.url (tenant {tenant})"
            fix = (f"upstream.url stores every series of tenant {tenant} under "
                   f"{label}=\"{seen}\" (its extra_label, with the tenant in its {{tenant}}): "
                   f"if they are this cluster's, make that extra_label {label}={expected} for "
                   "every tenant, as facts.external_labels says (a restart); "
                   f"enrich.cluster_label: \"\" turns the check off")
        else:
            where = f"the series' {label} label"
            fix = (f'if these series are this cluster\'s, make the agents\' external label '
                   f'{label}="{expected}", or set facts.external_labels.{label}: '
                   f'"{seen}" here (a restart); enrich.cluster_label: "" turns the '
                   'check off')
        self._other_cluster.event("other_cluster", {
            "label": label, "seen": seen, "expected": expected, "source": where,
            "series": result.unattributed.get(REASON_OTHER_CLUSTER, 0),
            "remote": request.remote, "user_agent": request.headers.get("User-Agent", ""),
            "fix": fix,
        })

    @staticmethod
    def _answer(answer: Answer) -> web.Response:
        if answer.ok:
            return web.Response(status=answer.status, headers=answer.headers)
        return _text(answer.status, one_line(answer.body.decode("utf-8", "replace")),
                     answer.headers)
