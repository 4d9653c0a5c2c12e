"""The forwarding client: one upstream, pooled connections, auth, TLS, and status mapping.

What matters most here is the *class* of the answer the sender gets back. Remote-write
senders drop a batch on 4xx and retry it on 5xx, so an upstream 400 must stay a 4xx
(else bad data is retried forever) and an unreachable or failing upstream must become a
5xx (else good data is dropped). Prometheus drops 429'd batches by default, so an
upstream 429 becomes a 503 with ``Retry-After`` unless configured otherwise; the proxy
never invents a 429 of its own.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from proxy.compression import compress
from proxy.config import UpstreamSettings
from proxy.metrics import ProxyMetrics
from proxy.wire.convert import v2_to_v1
from proxy.wire.primitives import Counts, Protocol

log = logging.getLogger("karta.upstream")

WRITTEN_SAMPLES = "X-Prometheus-Remote-Write-Samples-Written"
WRITTEN_HISTOGRAMS = "X-Prometheus-Remote-Write-Histograms-Written"
WRITTEN_EXEMPLARS = "X-Prometheus-Remote-Write-Exemplars-Written"
_WRITTEN = (WRITTEN_SAMPLES, WRITTEN_HISTOGRAMS, WRITTEN_EXEMPLARS)

#: headers the proxy sets itself or that only mean something on one hop
_NEVER_FORWARD = frozenset(
    h.lower()
    for h in (
        "Host", "Content-Length", "Content-Type", "Content-Encoding", "Connection",
        "Keep-Alive", "Transfer-Encoding", "TE", "Trailer", "Upgrade", "Proxy-Authorization",
        "Proxy-Connection", "Accept-Encoding", "X-Prometheus-Remote-Write-Version",
    )
)

#: how much of an upstream's error body reaches the sender (and the log)
MAX_ERROR_BODY = 4096
#: Retry-After sent with a 503 when the upstream gave none
DEFAULT_RETRY_AFTER = "1"


@dataclass(slots=True)
class Answer:
    """What the proxy answers the sender for one forwarded request."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    #: the upstream's own status, or a word when none came: timeout, connect_error, error
    upstream: str = ""
    #: True when the body went out as RW 1.0 after arriving as RW 2.0
    converted: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class UpstreamFailure(RuntimeError):
    """A request of the proxy's own (fact series) was not accepted upstream."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(
            f"upstream answered {answer.upstream}: {answer.body[:200].decode('utf-8', 'replace')}"
        )
        self.answer = answer


class FileSecret:
    """A credential read from a file and re-read when the file changes (rotated tokens).

    The file is stat'ed at most once per ``check_interval`` seconds, so the request path
    pays one clock read in the common case. A file that vanishes keeps the last value.
    """

    def __init__(
        self, path: str, *, check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._interval = check_interval
        self._clock = clock
        self._next_check = 0.0
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""
        self.get()

    def get(self) -> str:
        now = self._clock()
        if now < self._next_check:
            return self._value
        self._next_check = now + self._interval
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                with open(self.path, encoding="utf-8") as f:
                    self._value = f.read().strip()
                self._stamp = stamp
        except OSError as e:
            log.warning("cannot read credential file, keeping the last value",
                        extra={"path": self.path, "error": str(e)})
        return self._value


def build_ssl_context(s: UpstreamSettings) -> ssl.SSLContext | None:
    """TLS settings -> an SSLContext, or None when the defaults of aiohttp do."""
    if not (s.tls_ca_file or s.tls_cert_file or s.tls_insecure_skip_verify):
        return None
    ctx = ssl.create_default_context(cafile=s.tls_ca_file or None)
    if s.tls_cert_file:
        ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file or None)
    if s.tls_insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def map_status(
    status: int, headers: Mapping[str, str], *, pass_through_429: bool
) -> tuple[int, dict[str, str]]:
    """The upstream's status -> the status the sender gets, keeping its class.

    2xx and 4xx pass as they are; 429 becomes 503 (Prometheus would drop the batch on a
    429); 503 and 504 pass; any other 5xx, 1xx or 3xx becomes 502. ``Retry-After``
    always passes through.
    """
    out: dict[str, str] = {}
    retry_after = headers.get("Retry-After")
    if retry_after:
        out["Retry-After"] = retry_after
    if 200 <= status < 300:
        return status, out
    if status == 429:
        if pass_through_429:
            return 429, out
        out.setdefault("Retry-After", DEFAULT_RETRY_AFTER)
        return 503, out
    if 400 <= status < 500:
        return status, out
    if status in (503, 504):
        return status, out
    return 502, out


class Upstream:
    """One upstream URL behind a pooled keep-alive ``ClientSession``."""

    def __init__(self, settings: UpstreamSettings, metrics: ProxyMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        #: learned from a 415 to an RW 2.0 request (or configured): send RW 1.0 only
        self.v1_only = settings.protocol == "v1"
        self._forward = {h.lower() for h in settings.forward_headers} - _NEVER_FORWARD
        self._token = FileSecret(settings.bearer_token_file) if settings.bearer_token_file else None
        self._password = (
            FileSecret(settings.basic_auth_password_file)
            if settings.basic_auth_password_file else None
        )

    async def start(self) -> None:
        if self._session is not None:
            return
        s = self.settings
        ctx = build_ssl_context(s)
        connector = aiohttp.TCPConnector(
            limit=s.max_connections,
            ssl=ctx if ctx is not None else True,
            keepalive_timeout=60.0,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=s.timeout_seconds, sock_connect=s.connect_timeout_seconds
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- headers --------------------------------------------------------------------------

    def _headers(self, incoming: Mapping[str, str], protocol: Protocol, encoding: str
                 ) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in incoming.items():
            if name.lower() in self._forward:
                out[name] = value
        out.update(self.settings.headers)
        if self._token is not None:
            out = {k: v for k, v in out.items() if k.lower() != "authorization"}
            out["Authorization"] = f"Bearer {self._token.get()}"
        elif self._password is not None:
            out = {k: v for k, v in out.items() if k.lower() != "authorization"}
            pair = f"{self.settings.basic_auth_username}:{self._password.get()}"
            out["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        if not any(k.lower() == "user-agent" for k in out):
            out["User-Agent"] = "karta-proxy"
        out["Content-Type"] = protocol.content_type
        out["Content-Encoding"] = encoding
        out["X-Prometheus-Remote-Write-Version"] = protocol.version_header
        return out

    # -- forwarding -----------------------------------------------------------------------

    def out_encoding(self, encoding: str) -> str:
        """The Content-Encoding sent upstream for a request the sender encoded so."""
        return encoding if self.settings.encoding == "same" else self.settings.encoding

    def converts(self, protocol: Protocol) -> bool:
        """True when a request of this protocol is converted to RW 1.0 before sending."""
        return (protocol is Protocol.V2 and self.v1_only
                and self.settings.protocol != "passthrough")

    async def forward(
        self,
        raw: bytes,
        protocol: Protocol,
        *,
        incoming_headers: Mapping[str, str] | None = None,
        encoding: str = "snappy",
        counts: Counts | None = None,
        encoded: bytes | None = None,
    ) -> Answer:
        """Send one uncompressed request body upstream; return what to answer the sender.

        ``encoding`` is the sender's; ``settings.encoding`` decides what goes out.
        ``encoded``: ``raw`` already compressed with :meth:`out_encoding` (the handler does
        it in its worker thread); otherwise it is compressed here, off the event loop.
        ``counts`` lets the RW 2.0 ``...-Written`` headers be computed when the upstream
        gives none (a v1 upstream never does).
        """
        incoming = incoming_headers or {}
        out_encoding = self.out_encoding(encoding)
        converted = False
        if self.converts(protocol):
            raw, protocol, converted = await asyncio.to_thread(v2_to_v1, raw), Protocol.V1, True
            encoded = None
            if self.metrics is not None:
                self.metrics.upstream_conversions.inc()
        answer = await self._post(raw, encoded, protocol, incoming, out_encoding)
        if (
            answer.upstream == "415"
            and protocol is Protocol.V2
            and self.settings.protocol == "auto"
        ):
            log.warning(
                "upstream refused RW 2.0 with 415; converting to RW 1.0 from now on",
                extra={"upstream_url": self.settings.url},
            )
            self.v1_only = True
            raw, protocol, converted = await asyncio.to_thread(v2_to_v1, raw), Protocol.V1, True
            if self.metrics is not None:
                self.metrics.upstream_conversions.inc()
            answer = await self._post(raw, None, protocol, incoming, out_encoding)
        answer.converted = converted
        if answer.ok and (converted or protocol is Protocol.V2):
            self._written_headers(answer, counts)
        return answer

    def _written_headers(self, answer: Answer, counts: Counts | None) -> None:
        if counts is None:
            return
        have = {k.lower() for k in answer.headers}
        computed = {
            WRITTEN_SAMPLES: counts.samples,
            WRITTEN_HISTOGRAMS: counts.histograms,
            # RW 1.0 cannot carry RW 2.0 exemplar refs differently; a v1 upstream that
            # accepted the request accepted the exemplars too
            WRITTEN_EXEMPLARS: counts.exemplars,
        }
        for name, value in computed.items():
            if name.lower() not in have:
                answer.headers[name] = str(value)

    async def _post(
        self, raw: bytes, encoded: bytes | None, protocol: Protocol,
        incoming: Mapping[str, str], encoding: str,
    ) -> Answer:
        if self._session is None:
            await self.start()
        assert self._session is not None
        body = encoded if encoded is not None else await asyncio.to_thread(compress, raw, encoding)
        headers = self._headers(incoming, protocol, encoding)
        server_hostname = self.settings.tls_server_name or None
        started = time.perf_counter()
        code = "error"
        try:
            async with self._session.post(
                self.settings.url, data=body, headers=headers, allow_redirects=False,
                server_hostname=server_hostname,
            ) as resp:
                code = str(resp.status)
                text = await resp.content.read(MAX_ERROR_BODY)
                status, out = map_status(resp.status, resp.headers,
                                         pass_through_429=self.settings.pass_through_429)
                for name in _WRITTEN:
                    if name in resp.headers:
                        out[name] = resp.headers[name]
                if status != resp.status and resp.status >= 300:
                    text = f"upstream answered {resp.status}: ".encode() + text
                if status >= 500 or resp.status >= 300:
                    log.warning(
                        "upstream did not accept the request",
                        extra={"upstream_status": resp.status, "status": status,
                               "body": text[:512].decode("utf-8", "replace")},
                    )
                return Answer(status, text[:MAX_ERROR_BODY], out, code)
        except TimeoutError:
            code = "timeout"
            log.warning("upstream timed out", extra={"upstream_url": self.settings.url,
                                                     "timeout_s": self.settings.timeout_seconds})
            return Answer(504, b"upstream timed out", {}, code)
        except aiohttp.ClientConnectorError as e:
            code = "connect_error"
            log.warning("upstream unreachable", extra={"upstream_url": self.settings.url,
                                                       "error": str(e)})
            return Answer(502, f"upstream unreachable: {e}".encode(), {}, code)
        except aiohttp.ClientError as e:
            code = "error"
            log.warning("upstream request failed", extra={"upstream_url": self.settings.url,
                                                          "error": repr(e)})
            return Answer(502, f"upstream request failed: {e!r}".encode(), {}, code)
        finally:
            if self.metrics is not None:
                self.metrics.upstream_duration.observe(time.perf_counter() - started)
                self.metrics.upstream_responses.labels(code).inc()

    async def send_v1(self, raw: bytes) -> None:
        """Post an uncompressed RW 1.0 body of the proxy's own (fact series).

        Raises ``UpstreamFailure`` unless the upstream accepted it, so the caller can
        count and retry on its own schedule.
        """
        answer = await self.forward(raw, Protocol.V1)
        if not answer.ok:
            raise UpstreamFailure(answer)
