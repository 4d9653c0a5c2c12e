"""The forwarding client: one upstream, pooled connections, auth, TLS, and status mapping.

What matters most here is the *class* of the answer the sender gets back. Remote-write
senders drop a batch on 4xx and retry it on 5xx, so an upstream 400 must stay a 4xx
(else bad data is retried forever) and an unreachable or failing upstream must become a
5xx (else good data is dropped). Prometheus drops 429'd batches by default, so an
upstream 429 becomes a 503 with ``Retry-After`` unless configured otherwise; the proxy
never invents a 429 of its own. An upstream answer that says "this is not a write
endpoint" (404, 405, ...) or "the proxy's credentials are wrong" is the operator's
mistake, not the sender's: it becomes a 503, so the data waits in the sender's queue
until the configuration is fixed.

RW 2.0 is honest: the ``...-Written`` headers the sender gets are the upstream's own.
A 1.0-only receiver (Prometheus 2.x, VictoriaMetrics) answers an RW 2.0 body with a 2xx
and stores nothing, and sends no Written headers; so a 2xx without them to an RW 2.0
request with data in it means "not understood": the request is converted to RW 1.0,
sent again, and the upstream is remembered as 1.0-only. Only for a request that went
out as RW 1.0 does the proxy fill the headers in itself, from the request's counts,
because a 1.0 receiver's 2xx means all of it was written. A converted request that
Prometheus refuses for its native histograms (500 ``native histograms are disabled``: none
of it stored) is sent again without them, and its sender told none of them was written.

An answer that refuses the request for its size (413, or VictoriaMetrics' 400 saying so)
would make the sender drop a batch it sized under the upstream's limit before the stamp
made it bigger: such a request is sent again in parts cut at series boundaries
(``proxy.wire.halves``), and the sender hears 2xx only when every part was stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal
from typing import Protocol as Interface
from urllib.parse import urlsplit

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy import via
from proxy.compression import (
    DecodeError,
    compress,
    decompress,
    snappy_declared_length,
    zstd_declared_length,
)
from proxy.config import (
    NEVER_FORWARDED,
    NEVER_FORWARDED_LOWER,
    UpstreamSettings,
    oauth2_on,
    sets_authorization,
    url_credentials,
)
from proxy.deadline import Deadline, deadline_in
from proxy.egress_proxy import Egress, EgressRoutes
from proxy.log import THROTTLE_SECONDS, Throttled, failure_line
from proxy.metrics import ProxyMetrics, present_at_zero
from proxy.shown import (
    one_line,
    sent_credentials,
    shown_url,
    withheld,
    without_userinfo,
)
from proxy.stored_parts import Entry, Range, StoredAnswer, StoredParts
from proxy.upstream_clock import UpstreamClock
from proxy.upstream_http import (
    ClientError,
    ConnectFailed,
    ConnectTimeout,
    Pool,
    Response,
    basic_authorization,
    default_tls_context,
)
from proxy.upstream_oauth2 import TOKEN_RESULTS, TokenFailure, TokenSource
from proxy.upstream_redirect import (
    FOLLOWED,
    REDIRECTS,
    Chain,
    RedirectRefused,
    Walked,
    said_location,
    shown_location,
)
from proxy.upstream_tls import ClientTLS, ClientTLSLoad, FileSecret, build_ssl_context
from proxy.upstream_url import extra_label_value, own_extra_label, tenant_url
from proxy.wire.conversion import check_size, v2_to_v1
from proxy.wire.convert import ConversionTooLarge, V1Form, without_histograms
from proxy.wire.halves import Layout, layout, layout_bytes
from proxy.wire.primitives import Counts, Protocol

log = logging.getLogger("karta.upstream")

WRITTEN_SAMPLES = "X-Prometheus-Remote-Write-Samples-Written"
WRITTEN_HISTOGRAMS = "X-Prometheus-Remote-Write-Histograms-Written"
WRITTEN_EXEMPLARS = "X-Prometheus-Remote-Write-Exemplars-Written"
_WRITTEN = (WRITTEN_SAMPLES, WRITTEN_HISTOGRAMS, WRITTEN_EXEMPLARS)


#: how much of an upstream's error body reaches the sender (and the log)
MAX_ERROR_BODY = 4096
#: each post's own deadline (``_post``) is this much past ``upstream.timeout_seconds``, so
#: that a request's deadline (``forward``) always ends it first, with the message the
#: docs show (``did not take the request within N s``): at the same seconds the post's
#: (then aiohttp's) fired first for timeouts of 5 s or less, and the sender read "upstream
#: timed out". It still bounds the upstream check, which has no deadline of its own
CLIENT_TIMEOUT_MARGIN = 1.0
#: Retry-After sent with a 503 when the upstream gave none
DEFAULT_RETRY_AFTER = "1"
#: Retry-After of a 503 for a misconfigured upstream: nothing changes until an operator acts
MISCONFIGURED_RETRY_AFTER = "30"
#: answers that say the URL is not a remote-write endpoint (wrong path, receiver not
#: enabled, a redirect not followed: ``proxy.upstream_redirect``): the sender's data is
#: fine, the URL is not
NOT_A_WRITE_ENDPOINT = frozenset({301, 302, 303, 307, 308, 404, 405, 410, 501})
#: a karta-proxy's answer to a request that came back to it (``proxy.via``): the URL, or
#: a redirect, leads back to the proxy; passed on as it is, so that each hop of the loop
#: (each replica on the way) says so
LOOP_DETECTED = 508
#: 4xx answers that mean "not now" rather than "not this data": the sender gets 503
TRANSIENT_4XX = frozenset({408, 425, 429})
#: how many times a request the upstream refused as too large (413) is cut in halves:
#: at most 2 ** 4 = 16 parts, 30 requests in all
MAX_SPLIT_DEPTH = 4
#: the decoded size trusted when the proxy's own outgoing body is read again to be cut
OWN_BODY_LIMIT = 1 << 31
#: a part's bytes charged to the request's byte budget, over the most it can be: the
#: part as it is made, its bytes, and its compressed form (what it costs to send)
PART_COPIES = 3
#: what converting a request to RW 1.0 holds, over the size it converts to: the converted
#: series, their join into one body, and its compressed copy (snappy's bound is ~1.17x)
CONVERT_COPIES = 3
#: VictoriaMetrics (single node and vminsert) answers a request over its
#: ``-maxInsertRequestSize`` with a 400, not a 413: "too big packed request; mustn't exceed
#: `-maxInsertRequestSize=N` bytes" (or "unpacked", for the decoded size)
_VM_TOO_LARGE = re.compile(rb"too big (?:un)?packed request; must?n't exceed")
#: the limit VictoriaMetrics names in that 400: it holds the decoded and the compressed
#: body to it alike, so a body of more decoded bytes is refused (``_Parts.refused_at``)
_VM_LIMIT = re.compile(rb"-maxInsertRequestSize=(\d{1,18})")
#: a 400 that refuses samples because the receiver holds later ones of their series:
#: Prometheus' ``out of order sample``, Mimir's ``err-mimir-sample-out-of-order``. Such a
#: part can never be stored; only the sender's answer explains it (``Upstream._explained``),
#: as the part's own earlier send, its answer lost, may be what moved the series on. Never
#: counted as stored: another writer's later sample of one series refuses the whole part
_OUT_OF_ORDER = re.compile(rb"out of order sample|sample-out-of-order")
#: Prometheus 2.x without ``--enable-feature=native-histograms`` (its default) answers a
#: write holding a native histogram with a 500 and this body (``storage.
#: ErrNativeHistogramsDisabled`` through ``http.Error``), having stored nothing of it: its
#: float samples neither. Matched whole (after the "upstream answered 500: " the sender's
#: answer starts with), so no other 5xx is taken for it
_HISTOGRAMS_DISABLED = re.compile(rb"(?:upstream answered 500: )?native histograms are disabled\n?")
#: VictoriaMetrics and vmagent answer a path they do not serve (``/api/v1/push``, a typo)
#: with a 400, where other receivers answer 404: ``unsupported path requested: "/x"``
_VM_UNSUPPORTED_PATH = re.compile(rb"unsupported path requested")
#: Mimir's and Cortex' 401 to a write that names no tenant (no ``X-Scope-OrgID``:
#: dskit's ``ErrNoOrgID``), whatever the credentials: the sender's to fix, not the proxy's
_NO_ORG_ID = re.compile(rb"^no org id$")


def _layout_and_digest(raw: bytes, protocol: Protocol) -> tuple[Layout, bytes]:
    """The layout of a body to cut, and its digest (CPU work: a worker thread's): the
    body is the same, byte for byte, when a sender sends the same batch again and the
    stamps are unchanged, so its parts are the same, cut at the same series."""
    return layout(raw, protocol), hashlib.blake2b(raw, digest_size=16).digest()


def _stored_counts(lay: Layout, stored: list[Range]) -> Counts:
    total = Counts()
    for lo, hi in stored:
        total.add(lay.counts(lo, hi))
    return total


#: headers that say how a body is encoded or who sent it, never where it is stored: a
#: resend that differs only in these is the same batch for the same place
_NOT_WHERE = frozenset({"content-type", "content-encoding", "content-length", "user-agent",
                        "x-prometheus-remote-write-version"})


def _parts_key(digest: bytes, url: URL, sent: Outgoing, headers: CIMultiDict[str]) -> bytes:
    """What a body cut in parts is remembered by: its digest, the form it went in, and
    everything that decides where the receiver stores it, so that a part stored for one
    place never answers for another: the URL (a tenant in the path, the sender's query)
    and every header that goes upstream with it but ``_NOT_WHERE`` (Mimir's
    ``X-Scope-OrgID``, Thanos' ``THANOS-TENANT``, an ``Authorization`` a gateway maps to a
    tenant, the proxy's own credentials as they are now). Names are compared
    case-insensitively, each name's values in the order they go (Go receivers read the
    first)."""
    where = sorted(((name.lower(), value) for name, value in headers.items()
                    if name.lower() not in _NOT_WHERE), key=lambda item: item[0])
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{url}\0{sent.protocol.name}\0{int(sent.converted)}".encode())
    for name, value in where:
        h.update(b"\0" + name.encode() + b"\0"
                 + value.encode("utf-8", "surrogateescape"))
    return digest + h.digest()


@functools.lru_cache(maxsize=256)
def _parsed(url: str) -> URL:
    """``url`` parsed once (the same few URLs, one per tenant, every request)."""
    return URL(url)


def upstream_target(url: str, query: str = "") -> URL:
    """What the client requests: ``url`` (the upstream URL, credentials removed) in the
    form aiohttp always made of it, then the sender's raw ``query`` after the URL's own
    query (``&``-joined).

    The sender's query goes byte for byte (``encoded``), as it reached the proxy: the
    receiver decodes it (VictoriaMetrics' ``?extra_label=env=prod``), and one decoded and
    encoded again on the way need not say the same."""
    base = _parsed(url)
    if not query:
        return base
    own = base.raw_query_string
    return URL.build(scheme=base.scheme, authority=base.raw_authority, path=base.raw_path,
                     query_string=f"{own}&{query}" if own else query, encoded=True)


def connection_named(incoming: Mapping[str, str]) -> set[str]:
    """The header names (lower case) the sender's ``Connection`` header(s) list: they
    are for the hop to the proxy only, and never forwarded (RFC 9110 7.6.1, RFC 7230
    6.1), whatever ``upstream.forward_headers`` says."""
    named: set[str] = set()
    if isinstance(incoming, CIMultiDictProxy | CIMultiDict):
        # a request's own headers: every spelling found by one case-insensitive look-up,
        # not each name folded to lower case
        values: list[str] = incoming.getall("Connection", [])
    else:
        values = [value for name, value in incoming.items() if name.lower() == "connection"]
    for value in values:
        named.update(token.strip().lower() for token in value.split(","))
    return named


class OwnHeaders(dict[str, str]):
    """Headers of a request the proxy makes itself (``facts.headers``): sent as they are,
    where a sender's are filtered by ``upstream.forward_headers``."""


#: how long the lines of what goes well but may come every request are one line: a
#: request sent in parts (a steady state while the upstream's limit is under the stamped
#: batches, and the fact writer's every interval), the check finding what it found before
QUIET_LOG_SECONDS = 300.0

#: how long an upstream that refused native histograms is remembered so: meanwhile the
#: converted requests go without them (no refused round trip each); the first one after it
#: carries them again, and finds out whether the receiver takes them now
HISTOGRAMS_RECHECK_SECONDS = 300.0

#: an upstream the check found unavailable is probed again at most this often: every RW 2.0
#: request asks for a check while it is (one probe and one log line each, in an outage)
RECHECK_SECONDS = 5.0


def histograms_disabled(answer: Answer) -> bool:
    """The upstream refused the request for its native histograms: Prometheus 2.x on its
    defaults (``_HISTOGRAMS_DISABLED``)."""
    return answer.upstream == "500" and _HISTOGRAMS_DISABLED.fullmatch(answer.body) is not None


def too_large(answer: Answer) -> bool:
    """The upstream refused the request for its size: a 413, or VictoriaMetrics' 400 for
    the same (its own words), which a sender drops just as well."""
    return answer.upstream == "413" or (
        answer.upstream == "400" and _VM_TOO_LARGE.search(answer.body) is not None)


@dataclass(slots=True)
class Answer:
    """What the proxy answers the sender for one forwarded request."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    #: the upstream's own status, or a word when none came: timeout, connect_error, error,
    #: sender_gone, overload; or redirect, for a redirect that ends the request (no
    #: Location, a bad one, a loop, too many: ``Upstream._redirect_refused``)
    upstream: str = ""
    #: True when the body went out as RW 1.0 after arriving as RW 2.0
    converted: bool = False
    #: for a request sent in parts: the sender's series in the parts this attempt sent and
    #: got a 2xx for (not those skipped as stored by an earlier one), whatever the answer;
    #: None: sent whole, its series taken when ``ok``
    series_stored: int | None = None
    #: the proxy's own 503, not the upstream's: no room in the byte budget to send the
    #: request in parts (a rejected request, not an upstream failure, in the counters)
    overload: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(slots=True)
class Outgoing:
    """One request body ready for the upstream, made by :meth:`Upstream.prepare` (in a
    worker thread: conversion and compression are the CPU-heavy part)."""

    protocol: Protocol
    #: Content-Encoding toward the upstream
    encoding: str
    #: ``raw`` compressed with ``encoding``
    encoded: bytes
    #: what the request carries; the Written headers of a converted request come from it
    counts: Counts | None = None
    #: ``raw`` is the RW 1.0 form of the sender's RW 2.0 request
    converted: bool = False
    #: a converted request that went without its native histograms (``_without_histograms``),
    #: and how many it had: its ``counts`` say 0 histograms
    without_histograms: bool = False
    histograms_left_out: int = 0


def _carries(out: Outgoing) -> bool:
    """Whether ``out`` may carry data (its counts unknown, or any sample, histogram or
    exemplar): one that carries none cannot be lost, whatever the upstream makes of it."""
    counts = out.counts
    return counts is None or bool(counts.samples or counts.histograms or counts.exemplars)


class ConversionRefused(Exception):
    """An RW 2.0 request not converted to RW 1.0 for a 1.0-only upstream: its RW 1.0 form
    would be larger than an RW 1.0 request may be (``too_large``: RW 2.0 names a string once,
    RW 1.0 repeats it in every series, so 23 KB of RW 2.0 made 262 MB), or the byte budget
    has no room for the conversion now (``overload``). Raised before the converted body is
    allocated; the handler answers 413 or 503."""

    def __init__(self, reason: Literal["too_large", "overload"], size: int, limit: int) -> None:
        super().__init__(f"conversion to RW 1.0 refused ({reason}): {size} bytes, "
                         f"limit {limit}")
        self.reason = reason
        #: the converted size (too_large), or the bytes the conversion needed (overload)
        self.size = size
        self.limit = limit


class Charge(Interface):
    """The byte budget of the request being forwarded (the handler's
    ``server.max_inflight_bytes``): what forwarding needs beyond the body it was given
    (a request sent in parts decodes its body again, and makes each part) is taken from
    it first, and given back once no longer held."""

    def take(self, n: int) -> bool:
        """Hold ``n`` bytes more, or False when they do not fit."""
        ...

    def give_back(self, n: int) -> None:
        ...


class _Unbounded:
    """The charge of a request outside the byte budget: the proxy's own fact series,
    small, one at a time."""

    def take(self, n: int) -> bool:
        return True

    def give_back(self, n: int) -> None:
        pass


def converted_counts(counts: Counts | None, form: V1Form) -> Counts | None:
    """A request's counts once converted: its custom-bucket histograms became classic
    series, counted as the samples they are (``V1Form``)."""
    if counts is None or not form.histograms:
        return counts
    return Counts(counts.series, counts.samples + form.samples,
                  counts.histograms - form.histograms, counts.exemplars)


def conversion_limit(max_decoded_bytes: int, max_inflight_bytes: int) -> int:
    """The most an RW 2.0 request may convert to: what an RW 1.0 request may be
    (``server.max_decoded_bytes``), or what the byte budget can hold of a conversion
    (``server.max_inflight_bytes`` over ``CONVERT_COPIES``), whichever is larger. RW 2.0
    names a string once and RW 1.0 repeats it in every series: a big request of real label
    sets converts to 2-3x its decoded size, and a 413 would lose it (a sender drops a
    batch refused with a 4xx); the budget is the memory the operator gave requests, and a
    request alone in flight is given its conversion even past it, so no more than that."""
    return max(max_decoded_bytes, max_inflight_bytes // CONVERT_COPIES)


def _kept(made: Outgoing, charge: Charge, taken: int, held: list[int]) -> Outgoing:
    """``made``, a request reworked in flight, once the ``taken`` bytes charged for the
    work are given back but its compressed body's, which stay charged until the request
    is answered (``held``, given back by ``Upstream._deliver``)."""
    charge.give_back(taken - len(made.encoded))
    held.append(len(made.encoded))
    return made


def _converted(out: Outgoing, raw_v2: bytes, size: int, strip: bool) -> Outgoing:
    """``out`` (its counts the converted request's) with ``raw_v2`` converted to RW 1.0 (its
    ``size`` checked and charged) as its body, compressed (:func:`_compressed`)."""
    return _compressed(out, v2_to_v1(raw_v2, size), strip)


def _claimed(counts: Counts | None, parts: _Parts) -> Counts | None:
    """The counts a request sent in parts may claim written: none of its native histograms
    once a part went without them."""
    return _no_histograms(counts) if parts.without_histograms else counts


def _no_histograms(counts: Counts | None) -> Counts | None:
    """``counts`` of a request that went without its native histograms: none claimed."""
    return replace(counts, histograms=0) if counts is not None else None


def _left_out(out: Outgoing, histograms: int) -> Outgoing:
    """``out`` (its ``encoded`` already without them) marked as gone without ``histograms``
    native histograms: its counts, which the sender's Written headers come from, hold
    none."""
    return replace(out, counts=_no_histograms(out.counts), without_histograms=True,
                   histograms_left_out=histograms)


def _may_hold_histograms(out: Outgoing) -> bool:
    """``out`` may carry native histograms to leave out: it has not gone without them yet,
    and its counts, where known, say it has some."""
    return not out.without_histograms and (out.counts is None or bool(out.counts.histograms))


def _compressed(out: Outgoing, raw: bytes, strip: bool) -> Outgoing:
    """``out`` with ``raw`` (its RW 1.0 body) compressed, without its native histograms
    when ``strip`` (the upstream refuses them): left out before the body is compressed, it
    is compressed once, not compressed, decoded and compressed again. An ``out.encoded``
    already made is ``raw`` compressed (decoded again to leave them out), kept when there
    were none. CPU work: a worker thread's."""
    if not strip:
        return replace(out, encoded=compress(raw, out.encoding))
    left = without_histograms(raw)
    encoded = (compress(left.body, out.encoding) if left.histograms or not out.encoded
               else out.encoded)
    return _left_out(replace(out, encoded=encoded), left.histograms)


def _never() -> bool:
    return False


@dataclass(slots=True)
class _Attempt:
    """What bounds the forwarding of one request: every upstream request made for it (a
    probe, a post, a converted post, every part) ends by ``deadline``, so the sender gets
    its answer within ``upstream.timeout_seconds`` rather than after it gave up and sent
    the request again, both copies then in flight."""

    #: the event loop's time when the sender gets 504
    deadline: float
    charge: Charge
    #: the sender closed its connection: no part is sent after that
    sender_gone: Callable[[], bool]
    #: the request sent in parts, once it is
    parts: _Parts | None = None
    #: counted in ``upstream_v2_to_v1_conversions_total`` (once a request, whatever its
    #: parts and resends)
    conversion_counted: bool = False


@dataclass(slots=True)
class _Parts:
    """What the parts of one request sent again in parts (after a 413) got so far."""

    layout: Layout
    encoding: str
    #: the layout is the RW 1.0 form of the sender's RW 2.0 request
    layout_converted: bool
    incoming: Mapping[str, str]
    url: URL
    #: a part went out as RW 1.0 made from RW 2.0 (the layout was, or a part was converted
    #: on the way): every part sent says so in its own flag, which :meth:`add` gathers
    converted: bool = False
    #: parts answered
    sent: int = 0
    #: the sums of the parts' RW 2.0 Written headers, for those any part sent
    written: dict[str, int] = field(default_factory=dict)
    #: the first 2xx
    ok: Answer | None = None
    #: the first answer that makes the sender retry (5xx): no part is sent after it
    retry: Answer | None = None
    #: the first answer that makes the sender drop the batch (4xx): the rest is still sent
    refused: Answer | None = None
    #: a part was refused as too large and could not be cut further
    too_large: bool = False
    #: the sender closed its connection before every part was sent
    sender_gone: bool = False
    #: the record of this body's parts (``proxy.stored_parts``), and its key
    memory: Entry | None = None
    key: bytes = b""
    #: parts not sent because an earlier attempt of the same body stored them
    skipped: int = 0
    #: the first refused part (the one ``refused`` answered for), and its place among the
    #: parts answered or skipped (1-based)
    refused_part: Range | None = None
    refused_index: int = 0
    #: the parts counted as stored: this attempt's 2xx and the ones skipped
    stored: list[Range] = field(default_factory=list)
    #: the layout's series in this attempt's parts that got a 2xx (not the ones skipped)
    series_sent_stored: int = 0
    #: what the request cut carries (the sender's series)
    counts: Counts | None = None
    #: a part went without its native histograms (``Upstream._histograms_refused``): the
    #: Written headers made for the whole claim none
    without_histograms: bool = False
    #: the body cut went without its native histograms already: its parts hold none, and
    #: are not decoded and walked again for them
    cut_without_histograms: bool = False
    #: the fewest decoded bytes of a body in the layout's form the upstream refused as too
    #: large (the whole, then any part; one more than the limit VictoriaMetrics names),
    #: and that refusal: a part whose floor
    #: (``Layout.floor``) is at least that is refused unsent (:meth:`Upstream._hopeless`)
    refused_bytes: int | None = None
    refusal: Answer | None = None

    def refused_at(self, size: int | None, answer: Answer) -> None:
        """A body of ``size`` decoded bytes (None: not known) in the layout's form was
        refused as too large with ``answer``."""
        stated = _VM_LIMIT.search(answer.body) if answer.upstream == "400" else None
        if stated is not None:  # VictoriaMetrics names its limit: one byte more is refused
            size = min(size, int(stated[1]) + 1) if size is not None else int(stated[1]) + 1
        if size is not None and (self.refused_bytes is None or size < self.refused_bytes):
            self.refused_bytes = size
            self.refusal = replace(answer, headers=dict(answer.headers))

    @property
    def series_stored(self) -> int:
        """The sender's series in this attempt's parts that got a 2xx: the layout's, or
        in proportion where the layout has more series than the sender sent (its
        custom-bucket histograms converted to classic series: which of them a part holds
        is not kept)."""
        total, counts = len(self.layout.series), self.counts
        if counts is None or counts.series == total or not total:
            return self.series_sent_stored
        return round(self.series_sent_stored * counts.series / total)

    @property
    def stopped(self) -> bool:
        """No part is sent any more: the sender retries the whole, or is gone."""
        return self.retry is not None or self.sender_gone

    def add(self, answer: Answer, converted: bool, *, too_large: bool) -> None:
        self.sent += 1
        self.converted = self.converted or converted
        for name in _WRITTEN:
            value = written_count(answer.headers.get(name, ""))
            if value is not None:
                self.written[name] = self.written.get(name, 0) + value
        if answer.ok:
            self.ok = self.ok or answer
        elif answer.status >= 500:
            self.retry = answer
        else:
            self.too_large = self.too_large or (self.refused is None and too_large)
            self.refused = self.refused or answer


#: ``Answer.upstream`` of a request the OAuth 2.0 token endpoint's refusal kept from
#: being sent (``Upstream._token_failed``)
TOKEN_REFUSED = "token_refused"

ProbeOutcome = Literal[
    "rw2", "rw1", "not_write_endpoint", "credentials_refused", "unavailable", "refused",
]


@dataclass(slots=True, frozen=True)
class Probe:
    """What an empty write told about the upstream (at start, and after a reconnect)."""

    outcome: ProbeOutcome
    #: the upstream's status code, or timeout / connect_error / error
    code: str
    detail: str = ""


#: the most digits a Written header's count may have: a count is an int64 in every
#: receiver (Prometheus' and Mimir's ``strconv.Itoa``), 19 digits at most
WRITTEN_DIGITS = 19


def written_count(value: str) -> int | None:
    """A Written header's count, None when it is not one: ASCII digits only, since
    ``str.isdigit`` takes "\u00b2" and "\u0661" too, and ``int`` refused the first (an
    upstream's header of it was a 500 with a traceback for the sender of a request sent
    in parts); ``WRITTEN_DIGITS`` at most, since no receiver counts past an int64: an
    upstream's 4,300 digits on each part made the parts' sum too long for ``str`` (a 500
    with a traceback again), and each part's answer kept in ``StoredParts`` held three
    such numbers, ~5.8 KB where its byte bound counts 448 bytes a part."""
    if len(value) > WRITTEN_DIGITS or not (value.isascii() and value.isdigit()):
        return None
    return int(value)


def has_written_headers(headers: Mapping[str, str]) -> bool:
    """True when an answer carries any RW 2.0 ``...-Written`` header."""
    return any(name in headers for name in _WRITTEN)


class UpstreamFailure(RuntimeError):
    """A request of the proxy's own (fact series) was not accepted upstream."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(
            f"upstream answered {answer.upstream}: {answer.body[:200].decode('utf-8', 'replace')}"
        )
        self.answer = answer

    @property
    def status(self) -> int:
        """What a sender would have been answered (a 4xx: this request is refused for
        good; a 5xx: the upstream, later)."""
        return self.answer.status


def map_status(
    status: int, headers: Mapping[str, str], *, pass_through_429: bool
) -> tuple[int, dict[str, str]]:
    """The upstream's status -> the status the sender gets, keeping its class where the
    sender would act on it alike.

    2xx and 4xx pass as they are, but for the ones that say "later", not "never": 429
    (unless ``pass_through_429``), 408 (the upstream, or a load balancer before it, timed
    out waiting for the body) and 425 (too early) become 503, since a sender drops a batch
    on any 4xx but 429 (Prometheus; 429 too by default); 503 and 504 pass; any other
    5xx, 1xx or 3xx becomes 502. ``Retry-After`` always passes through.
    """
    out: dict[str, str] = {}
    retry_after = headers.get("Retry-After")
    if retry_after:
        out["Retry-After"] = retry_after
    if 200 <= status < 300:
        return status, out
    if status == 429 and pass_through_429:
        return 429, out
    if status in TRANSIENT_4XX:
        out.setdefault("Retry-After", DEFAULT_RETRY_AFTER)
        return 503, out
    if 400 <= status < 500:
        return status, out
    if status in (503, 504):
        return status, out
    return 502, out


@dataclass(frozen=True, slots=True)
class Misconfigured:
    """An upstream answer that is the operator's mistake rather than the sender's: what
    it is counted as, how the sender is answered, and how the line says it."""

    #: ``karta_proxy_upstream_misconfigured_total``'s ``reason``
    reason: Literal["not_write_endpoint", "credentials_refused"]
    #: what the upstream does, as "upstream <url> answered <status>: it <what>" says it
    what: str
    #: the sender's status: a 5xx, so that it keeps its batch and retries
    answered: int = 503
    #: what the operator fixes, as the line says it
    fix: str = "upstream.url / credentials"
    #: the line names each TSDB's write path (``_PATH_HINT``): a wrong URL
    path_hint: bool = False


#: a wrong URL: 404 from Prometheus without ``--web.enable-remote-write-receiver``,
#: ``/api/v1/push`` on Prometheus, a redirect not followed, VictoriaMetrics' and vmagent's
#: 400 ``unsupported path requested``
_NOT_A_WRITE_ENDPOINT = Misconfigured("not_write_endpoint", "is not a remote-write endpoint",
                                      path_hint=True)
#: what a 407 says, from an HTTP proxy between karta-proxy and the TSDB (absolute-form
#: requests of an http:// upstream through ``upstream.proxy_url``)
PROXY_CREDENTIALS = ("asks for an HTTP proxy's credentials (407: the user:password of "
                     "upstream.proxy_url, missing or refused)")
#: the answers that are a misconfiguration whoever's credentials the request carried
_BY_STATUS: dict[int, Misconfigured] = {
    **dict.fromkeys(NOT_A_WRITE_ENDPOINT, _NOT_A_WRITE_ENDPOINT),
    # the URL, or a redirect, leads back to a karta-proxy (``proxy.via``): passed on as
    # 508, so that each replica of a loop on the way says so
    LOOP_DETECTED: Misconfigured(
        "not_write_endpoint", "leads back to a karta-proxy the request came through (508 "
        "Loop Detected: upstream.url, or a redirect of the upstream, names the proxy)",
        answered=LOOP_DETECTED, fix="upstream.url or the redirect"),
    # an HTTP proxy on the way (``upstream.proxy_url``) asks for its own credentials: a
    # sender drops a batch on a 4xx, for no fault of its data
    407: Misconfigured("credentials_refused", PROXY_CREDENTIALS),
}
#: a 401 / 403 to credentials the proxy itself sets (``_answer`` words it for an HTTP
#: proxy with credentials on the way, whose 401 cannot be told from the upstream's)
_OWN_CREDENTIALS_REFUSED = Misconfigured("credentials_refused",
                                         "refused the proxy's credentials")


def misconfigured(status: int, *, own_credentials: bool,
                  body: bytes = b"") -> Misconfigured | None:
    """Whether an upstream answer is the operator's mistake rather than the sender's
    (``_BY_STATUS``, VictoriaMetrics' 400 for a wrong path, a 401 / 403 to the proxy's
    own credentials), or None. A 401 to the sender's own forwarded credentials stays the
    sender's (as on the direct path), and so does Mimir's 401 ``no org id`` to a write
    naming no tenant, credentials or not."""
    found = _BY_STATUS.get(status)
    if found is not None:
        return found
    if status == 400 and _VM_UNSUPPORTED_PATH.search(body) is not None:
        return _NOT_A_WRITE_ENDPOINT
    if status in (401, 403) and own_credentials and not _NO_ORG_ID.match(body.strip()):
        return _OWN_CREDENTIALS_REFUSED
    return None


#: what a 401 / 403 means at the end of a redirect to another site, where the sender's
#: forwarded credentials were left out (``Chain.headers``: Go's client leaves them out)
_CREDENTIALS_NOT_SENT = Misconfigured("credentials_refused", (
    "refused the request where a redirect to another site took it: the sender's "
    "credentials are not sent there, as Go's client sends none of a request's own; set "
    "upstream.url to the target"))
#: what a 401 / 403 to the proxy's own credentials says when an HTTP proxy with
#: credentials is on the way (``upstream.proxy_url``'s user:password): the two cannot be
#: told apart (tinyproxy answers wrong credentials with a 401)
_OWN_OR_PROXY_CREDENTIALS_REFUSED = Misconfigured("credentials_refused", (
    "refused the proxy's credentials (its upstream credentials, or upstream.proxy_url's "
    "user:password for the HTTP proxy on the way)"))
#: what a 401 / 403 to a write of the proxy's own (the start-up check, the fact series)
#: means: senders' writes carry their own ``Authorization``, which the proxy forwards, so
#: a TSDB that requires credentials takes them and refuses only the proxy's own, every
#: fact write for good, unless it has credentials of its own
OWN_WRITES_NEED_CREDENTIALS = (
    "the upstream asks for credentials: senders' writes carry their own (forwarded), the "
    "proxy's own writes (this check, the fact series) need upstream.bearer_token_file, "
    "upstream.basic_auth_* or an Authorization in facts.headers")
#: the same for Mimir's 401 ``no org id``: the write named no tenant, whatever the
#: credentials; the check's empty writes and the fact writes name those of
#: ``facts.headers``
OWN_WRITES_NEED_A_TENANT = (
    "the upstream asks for a tenant (Mimir/Cortex: 401 no org id): senders' writes name "
    "theirs (X-Scope-OrgID, forwarded), and this check and the fact series name none "
    "until facts.headers (X-Scope-OrgID: <tenant>) names one")


def own_write_refused(status: int, body: bytes) -> str:
    """What a 401 / 403 to a write of the proxy's own says its settings lack: a tenant
    (:data:`OWN_WRITES_NEED_A_TENANT`) or credentials
    (:data:`OWN_WRITES_NEED_CREDENTIALS`); "" for another status."""
    if status not in (401, 403):
        return ""
    return (OWN_WRITES_NEED_A_TENANT if _NO_ORG_ID.match(body.strip())
            else OWN_WRITES_NEED_CREDENTIALS)


#: receivers whose tenant is a request header, by the end of their write path: Mimir and
#: Cortex (``/api/v1/push``, Cortex' older ``/api/prom/push``), Thanos Receive
_MIMIR_WITHOUT_TENANT = ("a multi-tenant one refuses them (401: KartaProxyFactWritesFailing), "
                         "a single-tenant one (-auth.enabled=false) stores them in its only "
                         "tenant")
_HEADER_TENANT_PATHS = (
    ("/api/v1/push", "Mimir/Cortex", "X-Scope-OrgID", _MIMIR_WITHOUT_TENANT),
    ("/api/prom/push", "Mimir/Cortex", "X-Scope-OrgID", _MIMIR_WITHOUT_TENANT),
    ("/api/v1/receive", "Thanos Receive", "THANOS-TENANT",
     "by its docs it stores them in its default tenant (--receive.default-tenant-id)"),
)
#: the header names that name a tenant there (Thanos' is its --receive.tenant-header)
_TENANT_HEADERS = frozenset({"x-scope-orgid", "thanos-tenant"})


def fact_tenant_hint(settings: UpstreamSettings, fact_headers: Mapping[str, str]) -> str:
    """The start-up hint for fact writes that name no tenant where the tenant is a header
    (a Mimir/Cortex or Thanos Receive path in ``upstream.url``), or "" for none.

    Not a warning: a single-tenant Mimir (``-auth.enabled=false``) takes writes without
    ``X-Scope-OrgID`` into its one tenant, and nothing here tells it from a multi-tenant
    one, which answers 401 (``KartaProxyFactWritesFailing`` then). Nor when the proxy has
    credentials of its own (a gateway in front may map them to a tenant)."""
    try:
        path = urlsplit(settings.url).path.rstrip("/")
    except ValueError:
        return ""
    receiver = next((r[1:] for r in _HEADER_TENANT_PATHS if path.endswith(r[0])), None)
    if receiver is None:
        return ""
    named = {h.lower() for h in (*fact_headers, *settings.headers)}
    if named & (_TENANT_HEADERS | {"authorization"}) or sets_authorization(settings):
        return ""
    name, header, without = receiver
    return (
        f"upstream.url is a {name} write path and the fact writes name no tenant "
        f"(no {header} in facts.headers or upstream.headers): {without}. Facts go to one "
        "tenant whatever tenants the senders name; set "
        f"facts.headers ({header}: <tenant>) to choose it and load the fact rules there "
        "(docs/deploy.md, Several clusters and tenants in one TSDB)")


#: what each path usually is, for the hint in a "not a write endpoint" log line
_PATH_HINT = (
    "Prometheus: /api/v1/write (needs --web.enable-remote-write-receiver); Mimir / Cortex: "
    "/api/v1/push; Thanos Receive: /api/v1/receive; VictoriaMetrics: /api/v1/write"
)


def short_pool(max_concurrent_requests: int, max_connections: int) -> str:
    """The warning of a start whose upstream pool is smaller than the requests it may
    forward at once, else "". Each request in flight holds a connection; the ones past
    the pool wait for one, unseen, inside their ``upstream.timeout_seconds``, so a slow
    upstream times them out as 504 ``upstream timed out`` though it answered each in time
    (2 connections, 8 requests at once, an upstream answering in 1 s and a 2.5 s timeout:
    4 504s, 2 of those requests stored all the same)."""
    if max_connections >= max_concurrent_requests:
        return ""
    return (f"upstream.max_connections ({max_connections}) is below "
            f"server.max_concurrent_requests ({max_concurrent_requests}): the requests past "
            "it wait for a connection within upstream.timeout_seconds, and time out as 504 "
            "'upstream timed out' when the upstream is slow; raise upstream.max_connections "
            "with it (docs/operations.md)")


class Upstream:
    """One upstream URL behind a pool of keep-alive connections
    (``proxy.upstream_http.Pool``).

    Protocol knowledge lives here: ``v1_only`` says RW 2.0 requests are converted first.
    With ``upstream.protocol: auto`` it is learned (a probe at start, a 415, or a 2xx
    without Written headers) and checked again after the upstream was unreachable,
    since what answers after a reconnect may be another receiver (an upgrade, a load
    balancer's other backend).
    """

    def __init__(self, settings: UpstreamSettings, metrics: ProxyMetrics | None = None, *,
                 max_converted_bytes: int | None = None,
                 own_headers: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        #: the headers of the check's empty writes: the fact writes' (``facts.headers``), so
        #: a receiver whose tenant is a header (a multi-tenant Mimir: 401 no org id to a
        #: write naming none) is checked in the tenant the proxy's own writes go to
        self.own_headers = OwnHeaders(own_headers or {})
        #: the most an RW 2.0 request may convert to (:func:`conversion_limit`); None: no
        #: limit
        self.max_converted_bytes = max_converted_bytes
        #: the responses by code and the round trips, counted on the event loop thread
        #: alone as plain numbers (proxy.loop_metrics; None without metrics)
        self._responses = metrics.upstream_responses.values if metrics is not None else None
        self._round_trips = (metrics.upstream_duration.series[()] if metrics is not None
                             else None)
        #: the URL without its userinfo: what logs, metrics and answers show, and what the
        #: client requests (the userinfo goes as an Authorization header: ``_basic``)
        self.url = without_userinfo(settings.url)
        #: the URL as logs, metrics and answers show it: a credential of its query
        #: (``?api_key=``) hidden too (:func:`proxy.shown.shown_url`)
        self.shown_url = shown_url(settings.url)
        #: where a request that names no tenant goes (the proxy's own, the check)
        self._default_url = upstream_target(
            tenant_url(self.url, None, settings.default_tenant) or self.url)
        self._pool: Pool | None = None
        #: the HTTP(S) or SOCKS5 proxy each upstream URL is reached through (None: none, the
        #: settings validated before)
        self.egress = EgressRoutes.from_settings(
            settings.proxy_url, settings.no_proxy, settings.proxy_from_environment,
            connect_header=settings.proxy_connect_header)
        #: the TLS context of an https upstream without TLS files: the system's CAs, or
        #: none verified (``tls_insecure_skip_verify``)
        self._default_tls: ssl.SSLContext | None = None
        #: the upstream's clock by the Date of its answers to the proxy's own requests (the
        #: check, the fact writes: ``OwnHeaders``), for the fact writer's stamps
        self.clock = UpstreamClock()
        #: send RW 1.0 only: configured (``v1``) or learned (``auto``)
        self.v1_only = settings.protocol == "v1"
        #: the last probe's finding (None before the first)
        self.probe: Probe | None = None
        #: a probe is due before the next RW 2.0 request (at start, after a reconnect)
        self._recheck = False
        #: when the last probe ended (loop time): one found unavailable is not made again
        #: before RECHECK_SECONDS
        self._probed_at = -math.inf
        self._check_lock = asyncio.Lock()
        self._check_task: asyncio.Task[Probe] | None = None
        #: the last probe found the upstream unavailable: an answer from it is a reason
        #: to make the check again (:meth:`_answered_after_unavailable`)
        self._found_unavailable = False
        self._warned_passthrough = False
        #: the protocol finding (rw1, rw2) of the last line that said one
        self._protocol_logged = ""
        #: when (``time.monotonic``) the upstream last refused a converted request for its
        #: native histograms: for ``HISTOGRAMS_RECHECK_SECONDS`` converted requests go
        #: without them (``leaves_out_histograms``); forgotten when the check runs again
        self.histograms_refused_at = -math.inf
        #: what the last line about native histograms said: "", refused, stored
        self._histograms_logged = ""
        #: the lines of failed and refused requests, by message: one per kind and interval
        #: (``proxy.log.Throttled``), since a down upstream fails every request of every
        #: sender, and a line each buried the rest of the log
        self._lines: dict[tuple[int, str], Throttled] = {}
        #: ``upstream.encoding: zstd`` toward an upstream the check found refusing zstd
        #: (Debian's VictoriaMetrics 1.79: 400 "snappy: corrupt input"): snappy instead,
        #: as vmagent falls back, rather than every write refused and dropped
        self.zstd_refused = False
        #: which parts of requests sent in parts got a 2xx, so that a sender's resend of
        #: one to the same place skips them (``proxy.stored_parts``); the ones dropped for
        #: room before their time counted (``split_records_evicted``)
        self.stored_parts = StoredParts(
            on_evict=metrics.upstream_split_records_evicted.inc if metrics is not None
            else None)
        self._forward = {h.lower() for h in settings.forward_headers} - NEVER_FORWARDED_LOWER
        self._token = (FileSecret(settings.bearer_token_file, header=True,
                                  on_change=self._credentials_changed)
                       if settings.bearer_token_file else None)
        self._password = (
            FileSecret(settings.basic_auth_password_file, header=False,
                       on_change=self._credentials_changed)
            if settings.basic_auth_password_file else None
        )
        #: ``user:password@`` in upstream.url, as the proxy's own Basic credentials: aiohttp
        #: refused a URL with userinfo beside an Authorization header (a ValueError for
        #: every request a sender sent one with), and a sender's must not replace them
        credentials = url_credentials(settings.url)
        self._basic = basic_authorization(*credentials) if credentials is not None else ""
        #: the client context when a TLS file is set, re-read when they change
        self._tls = (self._client_tls() if settings.tls_ca_file or settings.tls_cert_file
                     else None)
        #: ``upstream.oauth2``: the token every request carries (None: not set)
        self._oauth2 = self._token_source() if oauth2_on(settings) else None
        #: what a request sent in parts is remembered by in place of the token, which
        #: changes at each renewal while where the parts went does not
        self._oauth2_identity = (f"OAuth2 {settings.oauth2.client_id} "
                                 f"{settings.oauth2.token_url}" if self._oauth2 else None)
        #: an http:// upstream goes through an HTTP proxy with credentials
        #: (``upstream.proxy_url``'s user:password) in absolute form: a 401 / 403 may be
        #: that proxy's (tinyproxy answers wrong ones 401), which cannot be told from the
        #: upstream's, so it is taken as a refusal of the proxy's own credentials (a 503
        #: the sender retries), not a sender's 4xx that drops its batch
        egress = self.egress.http if self.egress is not None else None
        self._proxy_auth = (self._default_url.scheme == "http" and egress is not None
                            and bool(egress.authorization))
        self.own_credentials = bool(
            self._token is not None or self._password is not None or self._basic
            or self._oauth2 is not None
            or any(k.lower() == "authorization" for k in settings.headers)
            or self._proxy_auth
        )
        #: the names (lower case) a sender's request brings upstream: the forwarded ones the
        #: settings do not set themselves. A redirect to another site drops the sensitive
        #: ones as Go's client drops the first request's (``Chain.headers``); the
        #: settings' own go on every request of the chain, as Prometheus' RoundTrippers set
        #: its credentials and headers
        own = {name.lower() for name in settings.headers}
        if (self._token is not None or self._password is not None or self._basic
                or self._oauth2 is not None):
            own.add("authorization")
        self._sender_names = frozenset(self._forward - own)
        self._publish()

    async def start(self, *, check: bool = False) -> None:
        """Open the connection pool; ``check``: probe the upstream in the background (the
        first RW 2.0 request waits for that probe rather than racing it)."""
        if self._pool is None:
            s = self.settings
            if self._tls is None and urlsplit(s.url).scheme == "https":
                self._default_tls = build_ssl_context(s) or default_tls_context()
            # no cookies kept (Prometheus' client keeps none: aiohttp's jar took an
            # upstream's Set-Cookie from one sender's answer and sent it with every later
            # write of every sender and tenant, 8 KiB of Cookie header a write), no
            # redirect followed, no body decompressed, no User-Agent, Accept-Encoding or
            # Content-Type of the client's own: the client does none of these
            self._pool = Pool(limit=s.max_connections,
                              idle_seconds=s.idle_connection_seconds,
                              connect_timeout=s.connect_timeout_seconds)
        if check and self._check_task is None:
            self._check_again()

    def _client_tls(self) -> ClientTLS:
        """The client context, its loads counted and its certificate's end published
        (karta_proxy_upstream_tls_certificate_*), when there are metrics."""
        m = self.metrics
        if m is None:
            return ClientTLS(self.settings)
        reloads = m.upstream_tls_reloads
        m.registry.register(reloads)
        present_at_zero(reloads, ("success", "failure"))
        expiry = m.upstream_tls_certificate_expiry
        if self.settings.tls_cert_file:
            m.registry.register(expiry)
        return ClientTLS(
            self.settings, on_expiry=expiry.set,
            on_reload=lambda ok: reloads.labels("success" if ok else "failure").inc())

    def _token_source(self) -> TokenSource:
        """The OAuth 2.0 token, its fetches counted by result (each present at 0) when
        there are metrics, and each token fetched made known to the check
        (:meth:`_credentials_changed`)."""
        s, m = self.settings, self.metrics
        fetches = None
        if m is not None:
            fetches = m.upstream_oauth2_token_fetches
            m.registry.register(fetches)
            present_at_zero(fetches, TOKEN_RESULTS)

        def on_fetch(result: str) -> None:
            if fetches is not None:
                fetches.labels(result).inc()
            if result == "success":
                self._credentials_changed()
        return TokenSource(s.oauth2, timeout=s.timeout_seconds,
                           connect_timeout=s.connect_timeout_seconds, on_fetch=on_fetch)

    def _credentials_changed(self) -> None:
        """The proxy's own credentials changed (``bearer_token_file`` or
        ``basic_auth_password_file`` rewritten, an OAuth 2.0 token fetched) after the
        check found them refused: the check is made again, in the background, so that
        ``karta_proxy_upstream_info{check}`` says what the upstream finds now. It said
        ``credentials_refused`` until a restart, ``KartaProxyUpstreamMisconfigured``
        firing on it while every write went through. Once per change: a success alone
        never probes again (every write would)."""
        probe = self.probe
        if probe is not None and probe.outcome == "credentials_refused":
            self._check_again()

    def _answered_after_unavailable(self) -> None:
        """The check found the upstream unavailable, and an answer came from it since:
        the check is made again, in the background, at most once per
        ``RECHECK_SECONDS``. Only RW 2.0 requests made it again before, so with RW 1.0
        senders ``karta_proxy_upstream_info{check}`` said ``unavailable`` for good
        (while writes went through), and a self-loop found before the listener was up
        (a 508 now) was never said there."""
        if self._check_lock.locked():  # the check's own write, or a check waiting
            return
        if asyncio.get_running_loop().time() - self._probed_at < RECHECK_SECONDS:
            return
        self._check_again()

    def _check_again(self) -> None:
        """The check, made again in the background (unless it is running)."""
        running = self._check_task
        if running is not None and not running.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # read off the loop (a thread): a later read on it tells
            return
        self._recheck = True
        self._check_task = asyncio.create_task(self.check(), name="upstream-check")

    def tls_trial(self) -> ClientTLSLoad | None:
        """The upstream's TLS files built into a new context, for a reload to try before it
        applies anything (raises when they do not load); None without TLS files."""
        return self._tls.trial() if self._tls is not None else None

    def tls_adopt(self, loaded: ClientTLSLoad | None) -> None:
        """Use a context ``tls_trial`` built for the connections made from now on."""
        if self._tls is not None and loaded is not None:
            self._tls.adopt(loaded)

    async def close(self) -> None:
        for lines in self._lines.values():
            lines.close()  # the summaries that wait, written before the proxy stops
        if self._check_task is not None and not self._check_task.done():
            self._check_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._check_task
        self._check_task = None
        if self._oauth2 is not None:
            await self._oauth2.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    # -- headers --------------------------------------------------------------------------

    def unforwardable(self, incoming: Mapping[str, str]) -> str:
        """The name of a header to forward whose value is not UTF-8 (aiohttp's server
        keeps such bytes as surrogates; its client left them out, ``X-Scope-OrgID:
        caf\\xe9`` reaching the upstream as ``caf``, another tenant, and the proxy's own
        refuses to send them: a 502 for the sender's every retry), or "".

        Per request, on the event loop: one join of the values in C, and the names looked
        at only when one of them is not ASCII."""
        if "".join(incoming.values()).isascii():
            return ""
        for name, value in incoming.items():
            if not value.isascii() and name.lower() in self._forward:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    if name.lower() not in connection_named(incoming):  # not forwarded
                        return name
        return ""

    def _headers(self, incoming: Mapping[str, str], protocol: Protocol, encoding: str,
                 authorization: str | None = None) -> CIMultiDict[str]:
        """The upstream request's headers, case-insensitive as HTTP's are.

        The sender's forwarded headers go with every value, in the order they came, each
        name spelled as the sender first spelled it: Go receivers (Mimir, Thanos) read the
        first of two ``X-Scope-OrgID``, so keeping only one would store proxied data in
        another tenant than a direct write's. Then the proxy's own (``upstream.headers``, its
        credentials, the body's headers) replace every value of theirs the sender sent,
        whatever its spelling: with a plain dict, ``x-scope-orgid: evil`` outlived a
        configured ``X-Scope-OrgID`` and the client sent both, the receiver reading the
        sender's. ``authorization``: the proxy's own, when the caller has it (the OAuth
        2.0 token it awaited), else :meth:`_authorization`'s."""
        out: CIMultiDict[str] = CIMultiDict()
        named = connection_named(incoming)
        #: each name as the sender first spelled it: aiohttp's session kept the values of
        #: one spelling only (``_prepare_headers`` told names apart by case, then set
        #: them case-insensitively: ``THANOS-TENANT: a`` + ``thanos-tenant: b`` left ``b``)
        spelling: dict[str, str] = {}
        own = isinstance(incoming, OwnHeaders)
        for name, value in incoming.items():
            if not own and name in NEVER_FORWARDED:
                continue  # never forwarded, spelled as senders do: no case to fold
            low = name.lower()
            if (own or low in self._forward) and low not in named:
                out.add(spelling.setdefault(low, name), value)
        for name, value in self.settings.headers.items():
            out[name] = value  # replaces every value of the name, any spelling
        if authorization is None:
            authorization = self._authorization()
        if authorization:
            out["Authorization"] = authorization
        if "User-Agent" not in out:
            out["User-Agent"] = "karta-proxy"
        # the sender's hops and this one: a request back here is refused (proxy.via)
        out["Via"] = (via.ENTRY if own or "Via" not in incoming
                      else via.forwarded(via.sent(incoming)))
        out["Content-Type"] = protocol.content_type
        out["Content-Encoding"] = encoding
        out["X-Prometheus-Remote-Write-Version"] = protocol.version_header
        return out

    def _sent_credentials(self, headers: Mapping[str, str], incoming: Mapping[str, str]
                          ) -> list[bytes]:
        """The credentials of a request sent with ``headers``: the configured headers are
        upstream.headers, and facts.headers for the proxy's own requests (``OwnHeaders``)."""
        configured = {name.lower() for name in self.settings.headers}
        if isinstance(incoming, OwnHeaders):
            configured.update(name.lower() for name in incoming)
        return sent_credentials(headers, configured - _TENANT_HEADERS)

    def _authorization(self) -> str:
        """The Authorization of the proxy's own credentials (a bearer token file, basic
        auth, the userinfo of upstream.url, the OAuth 2.0 token in force: at most one of
        them, ``proxy.config`` sees to that), "" when it has none of these; it replaces
        the sender's."""
        if self._oauth2 is not None:
            return self._oauth2.current()
        if self._token is not None:
            return f"Bearer {self._token.get()}"
        if self._password is not None:
            return basic_authorization(self.settings.basic_auth_username, self._password.get())
        return self._basic

    # -- what goes out --------------------------------------------------------------------

    def out_encoding(self, encoding: str) -> str:
        """The Content-Encoding sent upstream for a request the sender encoded so."""
        out = encoding if self.settings.encoding == "same" else self.settings.encoding
        return "snappy" if self.zstd_refused else out

    def extra_label(self, label: bytes, tenant: str | None, query: str
                    ) -> tuple[bytes, str] | None:
        """The value a VictoriaMetrics upstream sets ``label`` to on every series of a
        request (``tenant`` and ``query`` as the sender's path and URL gave them), from the
        ``extra_label`` parameters of the URL as forwarded (:func:`upstream_target`: the
        upstream URL's own query, then the sender's), and whose they are: ``"sender"`` or
        ``"upstream.url"``. None: they name none (the series keep theirs)."""
        if query:
            value = extra_label_value(query, label)
            if value is not None:  # the sender's come last: the last one wins
                return value, "sender"
        url = tenant_url(self.url, tenant, self.settings.default_tenant)
        value = own_extra_label(url, label) if url is not None else None
        return (value, "upstream.url") if value is not None else None

    def leaves_out_histograms(self) -> bool:
        """True while converted requests go without their native histograms: the upstream
        refused them less than ``HISTOGRAMS_RECHECK_SECONDS`` ago (``_histograms_refused``).
        Read in the worker threads too (``prepare``): hence ``time.monotonic``, not the
        event loop's clock (the same clock, by default)."""
        return time.monotonic() - self.histograms_refused_at < HISTOGRAMS_RECHECK_SECONDS

    def _leaves_out(self, out: Outgoing) -> bool:
        """``out`` (converted, not compressed yet) goes without its native histograms: the
        upstream refuses them now, and it may hold some."""
        return self.leaves_out_histograms() and _may_hold_histograms(out)

    def converts(self, protocol: Protocol) -> bool:
        """True when a request of this protocol is converted to RW 1.0 before sending."""
        return (protocol is Protocol.V2 and self.v1_only
                and self.settings.protocol != "passthrough")

    def prepare(self, raw: bytes, protocol: Protocol, encoding: str,
                counts: Counts | None = None, charge: Charge | None = None) -> Outgoing:
        """The body as it goes out: converted when the upstream is 1.0-only, compressed.

        CPU work only (the handler calls it in a worker thread). Raises ``DecodeError``
        for an RW 2.0 body that cannot be converted (a sender's error: 400), and
        ``ConversionRefused`` for one whose conversion is too large or does not fit
        ``charge`` (the request's byte budget) now (:meth:`_to_v1`).
        """
        out_encoding = self.out_encoding(encoding)
        if not self.converts(protocol):
            return Outgoing(protocol, out_encoding, compress(raw, out_encoding), counts)
        charge = charge or _Unbounded()
        converted, form, held = self._to_v1(raw, charge)
        out = Outgoing(Protocol.V1, out_encoding, b"", converted_counts(counts, form), True)
        try:
            # left out in the room of the converted series (``CONVERT_COPIES``), freed by then
            return _compressed(out, converted, self._leaves_out(out))
        finally:
            del converted
            charge.give_back(held)

    def _to_v1(self, raw: bytes, charge: Charge) -> tuple[bytes, V1Form, int]:
        """``raw`` (RW 2.0) converted to RW 1.0, and what was taken from ``charge`` for it
        (the caller gives it back once the body is compressed): its size is computed first,
        allocating nothing of it, and refused (``ConversionRefused``) past
        ``max_converted_bytes`` or when ``charge`` has no room for ``CONVERT_COPIES`` times
        it."""
        try:
            form = check_size(raw, self.max_converted_bytes)
        except ConversionTooLarge as e:
            raise ConversionRefused("too_large", e.size, e.limit) from None
        need = CONVERT_COPIES * form.size
        if not charge.take(need):
            raise self._overload(need)
        try:
            return v2_to_v1(raw, form.size), form, need
        except BaseException:
            charge.give_back(need)
            raise

    def prepared(self, encoded: bytes, protocol: Protocol, counts: Counts | None = None
                 ) -> Outgoing:
        """A body the handler's splice wrote as a snappy block itself (in parts at once,
        or made from the sender's block), in the protocol it arrived in; an RW 2.0 one is
        decoded again only should it need converting (``_convert``)."""
        return Outgoing(protocol, "snappy", encoded, counts)

    async def send(
        self,
        raw: bytes,
        protocol: Protocol,
        *,
        incoming_headers: Mapping[str, str] | None = None,
        encoding: str = "snappy",
        counts: Counts | None = None,
    ) -> Answer:
        """Prepare (off the event loop) and forward an uncompressed body."""
        out = await asyncio.to_thread(self.prepare, raw, protocol, encoding, counts)
        return await self.forward(out, incoming_headers)

    # -- forwarding -----------------------------------------------------------------------

    async def forward(self, out: Outgoing, incoming_headers: Mapping[str, str] | None = None,
                      *, tenant: str | None = None, query: str = "",
                      charge: Charge | None = None,
                      sender_gone: Callable[[], bool] | None = None) -> Answer:
        """Send one prepared request; return what to answer the sender.

        ``tenant``: the one the request's path named (``/insert/<tenant>/prometheus/...``),
        sent to the same tenant upstream (:func:`tenant_url`); ``query``: the request's raw
        query string, sent after the upstream URL's own (:func:`upstream_target`; the
        handler refused one with a ``karta_*`` ``extra_label``). An RW 2.0 request the
        upstream did not take (415, or a 2xx without Written headers to a request with
        data) is converted and sent again, and the upstream remembered as 1.0-only.
        Raises ``DecodeError`` when that conversion fails.

        Everything sent for the request shares one deadline, ``upstream.timeout_seconds``
        from now (504 past it); ``charge`` is the request's byte budget (what a request
        sent in parts needs is taken from it, 503 when it does not fit), ``sender_gone``
        says the sender closed its connection (no part is sent after that).
        """
        # not ``or {}``: an empty OwnHeaders (the fact writes' without facts.headers) is
        # falsy, and as a plain dict its answer's Date went unread (the fact writer's
        # clock reading was the start's check's, for ever) and its headers were filtered
        # as a sender's
        incoming = {} if incoming_headers is None else incoming_headers
        path = tenant_url(self.url, tenant, self.settings.default_tenant)
        if path is None:
            return self._no_tenant_place(tenant or "")
        url = upstream_target(path, query)
        loop = asyncio.get_running_loop()
        attempt = _Attempt(loop.time() + self.settings.timeout_seconds,
                           charge or _Unbounded(), sender_gone or _never)
        try:
            async with Deadline(attempt.deadline) as deadline:
                answer, sent = await self._deliver(out, incoming, url, attempt)
                if too_large(answer):
                    answer = await self._in_parts(sent, answer, incoming, url, attempt)
        except TimeoutError:
            if not deadline.expired():
                raise
            return self._out_of_time(attempt)
        return answer

    def _out_of_time(self, attempt: _Attempt) -> Answer:
        """The request's time ran out: 504 (as for one upstream request that timed out).
        Parts that got a 2xx meanwhile stay stored, and are remembered (``stored_parts``):
        the sender's resend skips them rather than have Prometheus refuse them as out of
        order or VictoriaMetrics keep them twice. The part the deadline cut off got no 2xx,
        so it is sent again (:meth:`_explained` when it is refused then as out of
        order)."""
        timeout = self.settings.timeout_seconds
        parts = attempt.parts
        done = f"; {parts.sent} of its parts answered" if parts is not None else ""
        self._recheck = self.settings.protocol == "auto"
        # throttled as every other failure: a TSDB that hangs times out every request in
        # flight, each sender's every shard (10 lines at once from one agent's 10 shards)
        self._line(logging.WARNING, "upstream did not take the request within "
                   "upstream.timeout_seconds (every upstream request for it together): the "
                   "sender gets 504", "timeout",
                   {"upstream_url": self.shown_url, "timeout_s": timeout,
                    "parts": parts.sent if parts is not None else 0})
        answer = Answer(504, f"upstream {self.shown_url} did not take the request within "
                             f"{timeout:g} s{done}".encode(), {}, "timeout")
        if parts is not None:
            answer.series_stored = parts.series_stored
            self._count_split("timeout", answer)
        return answer

    async def _deliver(self, out: Outgoing, incoming: Mapping[str, str], url: URL,
                       attempt: _Attempt) -> tuple[Answer, Outgoing]:
        """One request to the upstream, converted first or resent converted as the
        upstream's protocol needs; the answer, and the request as it last went out."""
        held: list[int] = []  # what bodies converted here hold of the budget until answered
        try:
            return await self._deliver_converting(out, incoming, url, attempt, held)
        finally:
            if held:  # none converted here, the usual case: nothing to give back
                attempt.charge.give_back(sum(held))

    async def _deliver_converting(self, out: Outgoing, incoming: Mapping[str, str], url: URL,
                                  attempt: _Attempt, held: list[int]
                                  ) -> tuple[Answer, Outgoing]:
        if self.settings.protocol == "auto" and (out.protocol is Protocol.V2 or out.converted):
            # a request that carries nothing (another karta-proxy's check) is not held for
            # this one's: in a loop of replicas each check waited for the other's until
            # the timeout, and never found the loop; it is taken as it is answered
            if self._recheck and _carries(out):
                await self.check()
            if self.v1_only and out.protocol is Protocol.V2:
                out = await self._convert(out, attempt.charge, held)
        if out.converted and self.leaves_out_histograms():
            out = await self._without_histograms(out, attempt.charge, held)
        if out.encoding == "zstd":
            # the check at start tells whether zstd is taken
            if self.probe is None and _carries(out):
                await self.check()
            if self.zstd_refused:  # prepared as zstd before the check found it refused
                out = await asyncio.to_thread(self._as_snappy, out)
        if out.converted:
            self._count_conversion(attempt)
        answer = await self._post(out, incoming, url)
        if out.protocol is Protocol.V2:
            refused = self._refused_v2(answer, out)
            if refused and self.settings.protocol == "auto":
                self._learn_v1_only(refused, answer)
                out = await self._convert(out, attempt.charge, held)
                self._count_conversion(attempt)
                answer = await self._post(out, incoming, url)
            elif refused == "no_written_headers" and not self._warned_passthrough:
                self._warned_passthrough = True
                log.warning(
                    "upstream answered an RW 2.0 request with 2xx but no Written headers: "
                    "it probably does not take RW 2.0, and RW 2.0 senders count such "
                    "answers as failures; upstream.protocol is passthrough, so nothing is "
                    "converted", extra={"upstream_url": self.shown_url})
        if out.converted:
            out, answer = await self._histograms_refused(out, answer, incoming, url, attempt,
                                                         held)
        answer.converted = out.converted
        if answer.ok and out.converted:
            self._written_headers(answer, out.counts)
        return answer, out

    def _count_conversion(self, attempt: _Attempt) -> None:
        """Count the request ``attempt`` forwards as converted to RW 1.0, once: each part
        of a converted request sent in parts goes through here too, and counted there one
        RW 2.0 request in 4 parts read 5 conversions."""
        if not attempt.conversion_counted and self.metrics is not None:
            attempt.conversion_counted = True
            self.metrics.upstream_conversions.inc()

    async def _histograms_refused(self, out: Outgoing, answer: Answer,
                                  incoming: Mapping[str, str], url: URL, attempt: _Attempt,
                                  held: list[int]) -> tuple[Outgoing, Answer]:
        """The answer to a converted request, and the request as it last went out, once a
        refusal of its native histograms (:func:`histograms_disabled`: Prometheus 2.x on its
        defaults, which then stores none of the request) is dealt with: the request is sent
        again without them (``_without_histograms``), so that its float samples, the
        classic series of its custom-bucket histograms and its exemplars are stored rather
        than retried by the sender forever, and the sender's Written headers say 0 of the
        histograms (a partial write it is told of). Remembered for
        ``HISTOGRAMS_RECHECK_SECONDS``, logged when that finding changes, and the histograms
        left out of a stored request counted
        (``karta_proxy_upstream_histograms_not_stored_total``).

        Only for a request converted from RW 2.0: an RW 1.0 sender's request passes as it
        came and gets the upstream's answer (its sender has no way to hear of a partial
        write, so a 2xx would tell it histograms were stored that are not)."""
        if not out.without_histograms:
            if not histograms_disabled(answer):
                if answer.ok and out.counts is not None and out.counts.histograms:
                    self._histograms_found(stored=True, answer=answer)
                return out, answer
            self.histograms_refused_at = time.monotonic()
            self._histograms_found(stored=False, answer=answer)
            out = await self._without_histograms(out, attempt.charge, held)
            if not out.histograms_left_out:  # not what was refused, after all: as it is
                return out, answer
            answer = await self._post(out, incoming, url)
        if answer.ok and out.histograms_left_out and self.metrics is not None:
            self.metrics.upstream_histograms_not_stored.inc(out.histograms_left_out)
        return out, answer

    def _histograms_found(self, *, stored: bool, answer: Answer) -> None:
        """Say what the upstream does with native histograms when that changes: a warning
        when it refuses them (then, while it still does, one summary line per
        ``QUIET_LOG_SECONDS``: the finding is made again after every
        ``HISTOGRAMS_RECHECK_SECONDS``), an info line when it takes them again. An upstream
        never found refusing them is never talked about."""
        state = "stored" if stored else "refused"
        if stored and self._histograms_logged != "refused":
            return
        changed = state != self._histograms_logged
        self._histograms_logged = state
        if stored:
            self.histograms_refused_at = -math.inf
            self._line(logging.INFO, "upstream stores native histograms again: converted "
                       "RW 2.0 requests carry them", state,
                       {"upstream_url": self.shown_url}, interval=QUIET_LOG_SECONDS,
                       at_once=changed)
            return
        self._line(logging.WARNING, "upstream refuses native histograms (Prometheus without "
                   "--enable-feature=native-histograms): converted RW 2.0 requests are sent "
                   "without them, the rest stored and the sender told Histograms-Written 0 "
                   "for them", state,
                   {"upstream_url": self.shown_url, "upstream_status": answer.upstream,
                    "body": answer.body[:200].decode("utf-8", "replace"),
                    "recheck_s": HISTOGRAMS_RECHECK_SECONDS},
                   interval=QUIET_LOG_SECONDS, at_once=changed)

    async def _without_histograms(self, out: Outgoing, charge: Charge, held: list[int]
                                  ) -> Outgoing:
        """``out`` (converted, as it goes out) without its native histograms, compressed
        again (in a worker thread); as it is when it went so already, or its counts say it
        has none. For a body compressed with them: one the upstream refused for them, or
        one prepared before it did (a body converted or cut once they are refused goes
        without them before it is compressed, :func:`_compressed`). What it holds is
        charged to the request's byte budget first: the body decoded again and the copy
        made of it; the new compressed body stays charged until the request is answered
        (``held``, as in :meth:`_convert`). ``ConversionRefused`` (``overload``: 503) when
        it does not fit."""
        if not _may_hold_histograms(out):
            return out
        # the body decoded, its copy without them, and that compressed
        raw, taken = await self._decoded_again(out, charge, 3)
        try:
            left = await asyncio.to_thread(_compressed, out, raw, True)
            del raw
        except BaseException:
            charge.give_back(taken)
            raise
        return _kept(left, charge, taken, held)

    def _overload(self, need: int) -> ConversionRefused:
        """What refuses reworking a request in flight whose ``need`` bytes do not fit the
        byte budget now: 503 (the handler's answer to ``ConversionRefused``)."""
        return ConversionRefused("overload", need, self.max_converted_bytes or 0)

    async def _decoded_again(self, out: Outgoing, charge: Charge, copies: int
                             ) -> tuple[bytes, int]:
        """``out``'s body decoded again (in a worker thread: a request in flight holds it
        compressed only), and what was taken from ``charge`` for it: ``copies`` times its
        decoded size, before it is allocated when the frame says that size (a zstd frame
        that does not: once decoded). ``_overload`` when it does not fit (a request to cut
        in parts answers that with its own 503, ``_no_room``); the caller gives back what
        was taken, this gives back its own when the decoding fails or is cancelled."""
        decoded = self._decoded_size(out)
        if decoded is not None and not charge.take(copies * decoded):
            raise self._overload(copies * decoded)
        try:
            raw = await asyncio.to_thread(self._raw, out)
        except BaseException:
            if decoded is not None:
                charge.give_back(copies * decoded)
            raise
        if decoded is None:
            decoded = len(raw)
            if not charge.take(copies * decoded):
                raise self._overload(copies * decoded)
        return raw, copies * decoded

    def _no_tenant_place(self, tenant: str) -> Answer:
        """A request for a tenant, and an upstream URL with no place for one: sending it
        to the URL as it is would store it outside the tenant the sender named."""
        # throttled, one key for every tenant: a sender picks the path, and so the count
        self._line(logging.ERROR, "a request named a tenant, but upstream.url has no place "
                   "for a tenant: use a VictoriaMetrics cluster URL (.../insert/{tenant}/"
                   "prometheus/api/v1/write) or put {tenant} in it; answered 503",
                   "no_tenant_place", {"upstream_url": self.shown_url, "tenant": tenant})
        if self.metrics is not None:
            self.metrics.upstream_misconfigured.labels(self.shown_url, "no_tenant_place", "").inc()
        return Answer(503, (f"the request names tenant {tenant!r} but the proxy's upstream "
                            f"{self.shown_url} has no place for a tenant (proxy misconfigured; "
                            "retry later)").encode(),
                      {"Retry-After": MISCONFIGURED_RETRY_AFTER}, "")

    async def _convert(self, out: Outgoing, charge: Charge, held: list[int]) -> Outgoing:
        """``out`` (RW 2.0, as it went out) converted to RW 1.0: decoded again, its
        converted size computed, then converted and compressed (in worker threads), each
        charged to the request's byte budget (on the event loop) before it is allocated:
        ``ConversionRefused`` when it does not fit, or would convert past
        ``max_converted_bytes`` (as in :meth:`_to_v1`). The compressed result stays
        charged until the request is answered (appended to ``held``, given back by
        :meth:`_deliver`). While the upstream refuses native histograms it goes without
        them, left out before it is compressed."""
        raw, taken = await self._decoded_again(out, charge, 1)
        try:
            try:
                form = await asyncio.to_thread(check_size, raw, self.max_converted_bytes)
            except ConversionTooLarge as e:
                raise ConversionRefused("too_large", e.size, e.limit) from None
            need = CONVERT_COPIES * form.size
            if not charge.take(need):
                raise self._overload(need)
            taken += need
            v1 = Outgoing(Protocol.V1, out.encoding, b"", converted_counts(out.counts, form),
                          True)
            v1 = await asyncio.to_thread(_converted, v1, raw, form.size, self._leaves_out(v1))
            del raw
        except BaseException:
            charge.give_back(taken)
            raise
        return _kept(v1, charge, taken, held)

    @staticmethod
    def _refused_v2(answer: Answer, out: Outgoing) -> str:
        """Why an answer to an RW 2.0 request (``out``, as it went out) says the upstream
        did not take RW 2.0. A 415 says "this Content-Type or this Content-Encoding": to a
        body sent as snappy it can only be the first, but to one sent as zstd
        (``encoding: same``, the sender's) it may be the second (Prometheus 3 answers any
        encoding but snappy so), and it passes to the sender as it does for RW 1.0 (a
        sender of zstd falls back to snappy after a 415): taken for the first, the
        upstream was remembered as 1.0-only, every RW 2.0 request converted from then on,
        and this one sent again as zstd RW 1.0, refused all the same."""
        if answer.upstream == "415":
            return "unsupported_media_type" if out.encoding == "snappy" else ""
        if answer.ok and _carries(out) and not has_written_headers(answer.headers):
            return "no_written_headers"
        return ""

    def _learn_v1_only(self, reason: str, answer: Answer) -> None:
        log.warning(
            "upstream did not take RW 2.0; converting RW 2.0 requests to RW 1.0 from now on",
            extra={"upstream_url": self.shown_url, "reason": reason,
                   "upstream_status": answer.upstream},
        )
        self.v1_only = True
        if self.metrics is not None:
            self.metrics.upstream_rw2_fallbacks.labels(reason).inc()
        self._publish()

    def _written_headers(self, answer: Answer, counts: Counts | None) -> None:
        """Written headers for a request that went out as RW 1.0 (an RW 2.0 sender drops
        data on a 2xx without them): a 1.0 receiver's 2xx means its samples were written
        (it refuses a request whose samples it cannot take), but not its histograms or
        exemplars, which VictoriaMetrics, and Prometheus without exemplar storage, drop
        and still answer 2xx; those are claimed only where the operator says the upstream
        keeps them (``rw1_confirms_*``), else 0, so the sender sees a partial write
        rather than a loss it was told was stored. The upstream's own headers win."""
        if counts is None or has_written_headers(answer.headers):
            return
        s = self.settings
        answer.headers[WRITTEN_SAMPLES] = str(counts.samples)
        answer.headers[WRITTEN_HISTOGRAMS] = str(
            counts.histograms if s.rw1_confirms_histograms else 0)
        answer.headers[WRITTEN_EXEMPLARS] = str(
            counts.exemplars if s.rw1_confirms_exemplars else 0)

    # -- a request too large for the upstream --------------------------------------------

    async def _in_parts(self, sent: Outgoing, answer: Answer, incoming: Mapping[str, str],
                        url: URL, attempt: _Attempt) -> Answer:
        """The upstream refused ``sent`` as too large (:func:`too_large`): send it again
        in halves cut at series boundaries (``proxy.wire.halves``), a half refused so cut
        again, down to ``MAX_SPLIT_DEPTH`` levels (16 parts). Senders drop a 413'd batch,
        and the stamp makes a body ~20% bigger than the sender sized it under the
        upstream's limit.

        The sender gets 2xx only when every part got 2xx. A part that would make the sender
        retry (5xx) ends it: that answer, and the whole is retried. What each part got is
        remembered for a few minutes (``proxy.stored_parts``, by the body's digest and
        where it goes): the retry skips the parts that got a 2xx (sent again, Prometheus
        refuses a part whose series a later part moved past, "out of order sample", a 400
        the sender drops for a batch stored whole; VictoriaMetrics keeps them twice). Only
        a 2xx counts: a part whose answer was lost is sent again, and its refusal as out of
        order is the sender's answer, explained (:meth:`_explained`), since nothing sent
        again could store more and a 2xx could cover samples never stored. A part the
        sender would drop (4xx) is answered, but the other parts are still sent, so
        whatever can be stored is. RW 2.0's Written
        headers are the sums of the parts' own. The parts go one after the other, in the
        body's order, within the request's deadline: a sender's batch may hold one series
        more than once (Prometheus writes a TimeSeries per sample: two samples of a series,
        or many after an outage), and parts at once could store its later sample first, the
        earlier then refused as out of order (the whole part rolled back, a 400 the sender
        drops).

        What it holds is charged to the request's byte budget before it is allocated (the
        body decoded again, its layout, the part being made, the parts in flight): a 413
        for a big request, to many senders at once, held 2.3 GiB for a 256 MiB budget.
        Past the budget: 503."""
        taken = 0
        try:
            try:
                raw, taken = await self._decoded_again(sent, attempt.charge, 1)
                need = await asyncio.to_thread(layout_bytes, raw)
                if not attempt.charge.take(need):
                    return self._no_room(answer, need)
                taken += need
                lay, digest = await asyncio.to_thread(_layout_and_digest, raw, sent.protocol)
                del raw
            except ConversionRefused as e:  # the body decoded again does not fit
                return self._no_room(answer, e.size)
            except DecodeError as e:  # pragma: no cover - the splice read the same fields
                log.error("cannot cut a request the upstream refused as too large",
                          extra={"upstream_url": self.shown_url, "error": e.message})
                return self._count_split("too_large", answer)
            key = _parts_key(digest, url, sent,
                             self._headers(incoming, sent.protocol, sent.encoding,
                                           self._oauth2_identity))
            return await self._send_parts(lay, key, sent, answer, incoming, url, attempt)
        finally:
            attempt.charge.give_back(taken)

    async def _send_parts(self, lay: Layout, key: bytes, sent: Outgoing, answer: Answer,
                          incoming: Mapping[str, str], url: URL, attempt: _Attempt
                          ) -> Answer:
        if len(lay.series) < 2:
            return self._count_split(
                "too_large", self._too_large(answer, len(sent.encoded), len(lay.series)))
        self._line(logging.INFO, "upstream refused a request as too large: sending it in "
                   "parts cut at series boundaries", "split", {
                       "upstream_url": self.shown_url, "bytes": len(sent.encoded),
                       "decoded_bytes": len(lay.raw), "series": len(lay.series)},
                   interval=QUIET_LOG_SECONDS)
        parts = _Parts(lay, sent.encoding, sent.converted, incoming, url)
        parts.cut_without_histograms = sent.without_histograms
        parts.refused_at(len(lay.raw), answer)
        parts.key, parts.memory = key, self.stored_parts.entry(key)
        parts.counts = sent.counts
        attempt.parts = parts
        await self._send_halves(parts, 0, len(lay.series), 1, attempt)
        result = "stored"
        if parts.retry is not None or parts.refused is not None:
            final = parts.retry or parts.refused
            assert final is not None
            result = ("overload" if final.overload
                      else "too_large" if parts.retry is None and parts.too_large
                      else "failed")
        elif parts.sender_gone:
            final = Answer(499, b"the sender closed its connection: the rest of the "
                                b"request was not sent", {}, "sender_gone")
            result = "sender_gone"
        else:
            assert parts.ok is not None
            final = Answer(parts.ok.status, b"", {
                k: v for k, v in parts.ok.headers.items() if k not in _WRITTEN},
                parts.ok.upstream)
        if final is parts.refused and parts.retry is None and not parts.sender_gone:
            final = self._explained(parts, final)
        for name, total in parts.written.items():
            final.headers[name] = str(total)
        final.converted = parts.converted
        if final.ok and sent.histograms_left_out and self.metrics is not None:
            # the whole went without them (its parts, cut from it, had none to leave out)
            self.metrics.upstream_histograms_not_stored.inc(sent.histograms_left_out)
        if final.ok and parts.converted:
            self._written_headers(final, _claimed(sent.counts, parts))
        elif parts.converted and parts.stored and not final.ok:
            # the batch is refused, but some of it is stored: the sender hears how much,
            # counted from the parts a 1.0 receiver took (it sent no Written headers)
            stored = await asyncio.to_thread(_stored_counts, lay, parts.stored)
            self._written_headers(final, _claimed(stored, parts))
        final.series_stored = parts.series_stored
        quiet = final.ok or parts.sender_gone
        self._line(logging.INFO if quiet else logging.WARNING,
                   "request sent in parts after the upstream refused it as too large",
                   result, {"upstream_url": self.shown_url, "parts": parts.sent,
                            "status": final.status, "result": result,
                            "skipped": parts.skipped},
                   interval=QUIET_LOG_SECONDS if quiet else THROTTLE_SECONDS)
        return self._count_split(result, final)

    async def _send_halves(self, parts: _Parts, lo: int, hi: int, depth: int,
                           attempt: _Attempt) -> None:
        """Send ``series[lo:hi]`` of ``parts`` as two halves, the first (cut again if it
        must be) before the second: in the body's order (:meth:`_in_parts`)."""
        mid = parts.layout.middle(lo, hi)
        await self._send_part(parts, lo, mid, depth, attempt)
        await self._send_part(parts, mid, hi, depth, attempt)

    async def _send_part(self, parts: _Parts, a: int, b: int, depth: int,
                         attempt: _Attempt) -> None:
        """Send ``series[a:b]`` as one part, cut again if the upstream refuses it."""
        if parts.stopped:
            return
        if self._stored_before(parts, a, b):
            return
        if attempt.sender_gone():
            self._line(logging.INFO, "the sender closed its connection: the rest of a "
                       "request sent in parts is not sent", "sender_gone",
                       {"upstream_url": self.shown_url, "parts": parts.sent})
            parts.sender_gone = True
            return
        if self._hopeless(parts, a, b):
            return
        # made one at a time: making one holds PART_COPIES times its bytes, sending it only
        # its compressed form
        need = PART_COPIES * parts.layout.part_bytes(a, b)
        if not attempt.charge.take(need):
            parts.retry = self._no_room(None, need)
            return
        try:
            out = await asyncio.to_thread(self._part, parts, a, b,
                                          parts.layout_converted and self.leaves_out_histograms())
        except BaseException:
            attempt.charge.give_back(need)
            raise
        attempt.charge.give_back(need - len(out.encoded))
        need = len(out.encoded)
        if self._stored_before(parts, a, b):
            # stored by an identical attempt at once (a sender's retry of a request still
            # in flight) while this one made the part in a worker thread: looked up again
            # once made, as a part sent again would be refused as out of order or kept
            # twice
            attempt.charge.give_back(need)
            return
        try:
            answer, sent = await self._deliver(out, parts.incoming, parts.url, attempt)
            del out
        finally:
            attempt.charge.give_back(need)
        self._remember(parts, a, b, answer, sent)
        parts.without_histograms = parts.without_histograms or sent.without_histograms
        refused = too_large(answer)
        if refused and sent.protocol is parts.layout.protocol:
            parts.refused_at(self._decoded_size(sent), answer)
        if refused and b - a > 1 and depth < MAX_SPLIT_DEPTH:
            await self._send_halves(parts, a, b, depth + 1, attempt)
            return
        if refused:
            answer = self._too_large(answer, len(sent.encoded), b - a)
        if self.metrics is not None:
            self.metrics.upstream_split_parts.inc()
        if not answer.ok and answer.status < 500 and parts.refused is None:
            parts.refused_part, parts.refused_index = (a, b), parts.sent + parts.skipped + 1
        parts.add(answer, sent.converted, too_large=refused)
        if answer.ok:
            parts.series_sent_stored += b - a

    def _hopeless(self, parts: _Parts, a: int, b: int) -> bool:
        """``series[a:b]`` carries, whatever its series, at least as many bytes as a body
        the upstream already refused as too large (its floor: the other top-level fields,
        which go with the first part): it is refused too, unsent and not cut further, as
        cutting leaves the floor in its first part. Its answer is that refusal's.

        Measured in decoded bytes: a receiver that limits the compressed body limits the
        decoded one at that size or less (Mimir's ``max_recv_msg_size`` and Thanos' limit
        on both, VictoriaMetrics' ``-maxInsertRequestSize`` on both), so a body refused for
        either is over the limit decoded. Not when the part would be converted on its way
        (an upstream found 1.0-only since): the conversion drops the RW 2.0 floor."""
        refusal = parts.refusal
        if (refusal is None or parts.refused_bytes is None
                or self.converts(parts.layout.protocol)):
            return False
        floor = parts.layout.floor(a, b)
        if floor < parts.refused_bytes:
            return False
        answer = self._too_large(replace(refusal, headers=dict(refusal.headers)), floor,
                                 b - a)
        if self.metrics is not None:
            self.metrics.upstream_split_parts.inc()
        parts.add(answer, parts.layout_converted, too_large=True)
        return True

    def _stored_before(self, parts: _Parts, a: int, b: int) -> bool:
        """``series[a:b]`` got a 2xx in an earlier attempt of the same body to the same
        place (in one part or several, :func:`_parts_key`): counted as answered with what
        they were answered, and not sent again.
        Prometheus would refuse it as out of order once a later part was stored (a 400 the
        sender drops, for a batch stored whole), VictoriaMetrics would keep it twice."""
        if parts.memory is None:
            return False
        stored = parts.memory.covered(a, b)
        if stored is None:
            return False
        for part, s in stored:
            headers = {name: str(n) for name, n in zip(_WRITTEN, s.written, strict=True)
                       if n >= 0}
            parts.add(Answer(s.status, b"", headers, str(s.status)), s.converted,
                      too_large=False)
            parts.sent -= 1  # not sent: answered from the record
            parts.skipped += 1
            # a part stored without its histograms: the whole claims none of them
            parts.without_histograms = parts.without_histograms or s.without_histograms
            parts.stored.append(part)
        return True

    def _remember(self, parts: _Parts, a: int, b: int, answer: Answer,
                  sent: Outgoing) -> None:
        """Record part ``series[a:b]`` as stored when it got a 2xx, and only then: a 5xx
        or a refusal leave it unknown or not stored, and an answer made up for it could
        tell the sender a batch is stored when samples of it are not. Any answer keeps the
        body's entry in the record as recently used (``StoredParts.answered``)."""
        if parts.memory is None:
            return
        if not answer.ok:
            self.stored_parts.answered(parts.key, parts.memory)
            return
        parts.stored.append((a, b))
        written = tuple(-1 if (n := written_count(answer.headers.get(name, ""))) is None
                        else n for name in _WRITTEN)
        self.stored_parts.stored(parts.key, parts.memory, (a, b), StoredAnswer(
            answer.status, sent.converted, (written[0], written[1], written[2]),
            sent.without_histograms))

    def _explained(self, parts: _Parts, answer: Answer) -> Answer:
        """The 400 of a part refused as out of order, on an attempt after an earlier one of
        the same batch that got no 2xx for that part, said in one line for the sender's
        log: that earlier send, its answer lost, most likely stored it (what moved its
        series on), but that is not known, so the 400 stays (a part refused so can never
        be stored: a 2xx would save nothing, and may cover samples never stored, as when
        another writer moved a series on). The other parts' fate is said too."""
        if (parts.memory is None or parts.memory.attempts < 2 or parts.refused_part is None
                or answer.upstream != "400" or _OUT_OF_ORDER.search(answer.body) is None):
            return answer
        total = parts.sent + parts.skipped
        stored = len(parts.stored)
        others = ("the other parts are stored" if stored == total - 1
                  else f"{stored} of {total} parts are stored")
        said = b" ".join(answer.body.split()).decode("utf-8", "replace")
        self._line(logging.WARNING, "a part of a batch sent again is refused as out of order "
                   "(an earlier attempt of it got no 2xx; most likely stored then): the "
                   "sender gets the 400", "out_of_order_again",
                   {"upstream_url": self.shown_url, "part": parts.refused_index, "parts": total,
                    "stored": stored, "body": said[:200]})
        body = (f"part {parts.refused_index} of {total} refused as out of order after an "
                "earlier attempt of this batch got no 2xx for it (if that answer was lost, "
                f"most likely stored then); {others}; upstream: {said}").encode()
        return Answer(answer.status, body[:MAX_ERROR_BODY], answer.headers, answer.upstream,
                      answer.converted)

    def _no_room(self, answer: Answer | None, need: int) -> Answer:
        """What a request sent in parts needs does not fit the byte budget now: 503, and
        the sender sends it again (the budget freed by then, or it is alone in flight,
        which always may)."""
        log.warning("no room in the byte budget (server.max_inflight_bytes) to send a "
                    "request the upstream refused as too large in parts: 503",
                    extra={"upstream_url": self.shown_url, "bytes": need})
        refusal = Answer(503, f"overloaded: no room for the {need} bytes it takes to send "
                              "the request in parts (the upstream refused it as too large); "
                              "send it again".encode(),
                         {"Retry-After": DEFAULT_RETRY_AFTER}, "overload", overload=True)
        if answer is not None:
            return self._count_split("overload", refusal)
        return refusal

    @staticmethod
    def _decoded_size(sent: Outgoing) -> int | None:
        """The size ``sent`` decodes to, from its own header (None: a zstd frame that
        does not say)."""
        if sent.encoding == "snappy":
            return snappy_declared_length(sent.encoded)
        try:
            return zstd_declared_length(sent.encoded)
        except DecodeError:  # pragma: no cover - the proxy's own frame
            return None

    @classmethod
    def _as_snappy(cls, out: Outgoing) -> Outgoing:
        """``out`` compressed with snappy instead (CPU work: a worker thread's)."""
        return replace(out, encoding="snappy", encoded=compress(cls._raw(out), "snappy"))

    @staticmethod
    def _raw(sent: Outgoing) -> bytes:
        """A request's body as it went out, uncompressed: decoded again, as a request in
        flight holds it compressed only (an RW 2.0 body kept decoded was ~10x its
        compressed size for the whole round trip, uncharged)."""
        if not sent.encoded:
            return b""
        return decompress(sent.encoded, sent.encoding, max_decoded=OWN_BODY_LIMIT)

    @staticmethod
    def _part(parts: _Parts, lo: int, hi: int, refused: bool) -> Outgoing:
        """Part ``series[lo:hi]`` of ``parts`` as it goes out, compressed; without its
        native histograms when ``refused`` (a part of a converted body while the upstream
        refuses them) and it may hold some, left out before it is compressed. CPU work."""
        out = Outgoing(parts.layout.protocol, parts.encoding, b"", None, parts.layout_converted,
                       without_histograms=parts.cut_without_histograms)
        return _compressed(out, parts.layout.part(lo, hi), refused and _may_hold_histograms(out))

    def _too_large(self, answer: Answer, size: int, series: int) -> Answer:
        """A 413 the proxy cannot cut further (one series, or ``MAX_SPLIT_DEPTH`` levels):
        it reaches the sender, which drops the batch; said loudly, the fix is the
        operator's (the upstream's limit, or the sender's batch size). Throttled: a
        request cut into parts has up to ``2 ** MAX_SPLIT_DEPTH`` of them, and an error
        line for each let one sender write ~300 lines a second."""
        self._line(logging.ERROR,
                   "upstream refused a request as too large and it cannot be cut "
                   "further: the sender drops it; raise the upstream's request size limit "
                   "(Mimir distributor.max_recv_msg_size, VictoriaMetrics "
                   "-maxInsertRequestSize, ...) or lower the sender's batch size",
                   "too_large",
                   {"upstream_url": self.shown_url, "bytes": size, "series": series,
                    "body": answer.body[:512].decode("utf-8", "replace")})
        answer.body = (f"upstream {self.shown_url} refused {size} bytes ({series} series) as too "
                       "large: ").encode() + answer.body
        answer.body = answer.body[:MAX_ERROR_BODY]
        return answer

    def _count_split(self, result: str, answer: Answer) -> Answer:
        if self.metrics is not None:
            self.metrics.upstream_splits.labels(result).inc()
        return answer

    async def _post(self, out: Outgoing, incoming: Mapping[str, str], url: URL | None = None
                    ) -> Answer:
        """Send one request; every way it can end is an answer for the sender, counted in
        ``upstream_responses_total`` by code and logged when it failed: a 2xx, the
        upstream's status mapped (:meth:`_answer`), 504 (timeout), 502 (no connection, a
        broken transport, or a request the client could not even make). A redirect is
        followed (:meth:`_follow`) within the same deadline, counted as one request: the
        last answer's code and the whole chain's time."""
        if self._pool is None:
            await self.start()
        assert self._pool is not None
        pool = self._pool
        authorization: str | None = None
        if self._oauth2 is not None:
            got = await self._oauth2.authorization()  # a cached read, but when it expired
            if isinstance(got, TokenFailure):
                return self._token_failed(got)
            authorization = got
        started = time.perf_counter()
        code = "error"
        try:
            headers = self._headers(incoming, out.protocol, out.encoding, authorization)
            tls = self._tls.get() if self._tls is not None else self._default_tls
            target = url if url is not None else self._default_url
            chain: Chain | None = None
            async with deadline_in(self.settings.timeout_seconds + CLIENT_TIMEOUT_MARGIN):
                egress = self._egress_for(target)
                resp = await pool.post(
                    target, headers, out.encoded, tls=tls,
                    server_hostname=self.settings.tls_server_name or None,
                    max_body=MAX_ERROR_BODY, egress=egress,  # no call a request without one
                    proxy_tls=None if egress is None else self._proxy_tls(egress, tls))
                if 300 <= resp.status < 400:  # a 2xx costs this one comparison, no more
                    walked = await self._follow(pool, resp, target, headers, out.encoded,
                                                incoming)
                    resp, chain = walked.resp, walked.chain
                    if walked.refused is not None:
                        code = str(resp.status)
                        return self._redirect_refused(walked, walked.refused)
            code = str(resp.status)
            if self._found_unavailable:  # one attribute read a request, no more
                self._answered_after_unavailable()
            if incoming.__class__ is OwnHeaders:  # not a sender's: no cost per request
                self.clock.note(resp.headers.get("Date"))
            text = self._body(resp)
            if resp.status == 401 and authorization and not _NO_ORG_ID.match(text.strip()):
                assert self._oauth2 is not None
                self._oauth2.refused(authorization)
            if text:  # before the body is classified, logged or answered
                # the first request's headers: the later ones of a chain carry no more
                text = withheld(text, self._sent_credentials(headers, incoming))
            return self._answer(resp.status, resp.headers, text, code, out.converted, chain)
        except ConnectTimeout as e:
            # an upstream whose SYNs are dropped (a firewall, a dead address) is
            # unreachable, not slow to answer
            code = "connect_error"
            limit = self.settings.connect_timeout_seconds
            return self._no_answer(502, code, "upstream unreachable",
                                   f"no connection within {limit:g} s "
                                   "(upstream.connect_timeout_seconds)",
                                   error=str(e), connect_timeout_s=limit)
        except TimeoutError:
            code = "timeout"
            return self._no_answer(504, code, "upstream timed out",
                                   timeout_s=self.settings.timeout_seconds)
        except asyncio.CancelledError:  # the request's deadline (``forward``), or a stop
            code = "timeout"
            raise
        except ConnectFailed as e:
            code = "connect_error"
            return self._no_answer(502, code, "upstream unreachable", str(e), error=str(e))
        except ClientError as e:
            # the error's type and text, never the request's headers (aiohttp's
            # ClientResponseError's repr held them, the proxy's Authorization among them,
            # and went to the sender and the log)
            code = "error"
            why = failure_line(e, self.settings.timeout_seconds)
            return self._no_answer(502, code, "upstream request failed", why, error=why)
        except Exception as e:
            # the client refused to make the request (a ValueError for a header it will not
            # send): the proxy's fault, not the sender's data's, and not a 500 with a
            # traceback and no count: a 502 the sender retries, a line, the count under
            # "error"
            code = "error"
            log.debug("upstream request could not be made", exc_info=True)
            why = failure_line(e, self.settings.timeout_seconds)
            self._line(logging.ERROR, "upstream request could not be made (a proxy bug or "
                       "misconfiguration): senders get 502 and keep their data",
                       type(e).__name__, {"upstream_url": self.shown_url, "error": why})
            return Answer(502, f"upstream request could not be made: {why}".encode(), {}, code)
        finally:
            if code == "connect_error":
                # the addresses kept for ``DNS_TTL_SECONDS`` (10 s) are looked up again by
                # the next connect: a headless Service's pod replaced, or a Service made
                # again, had every request fail to connect to the old address until its
                # entry aged out (20 writes at 5 a second, 502 each, the new address in
                # DNS for 4 s)
                pool.clear_dns_cache()
            if self._round_trips is not None and self._responses is not None:
                self._round_trips.observe(time.perf_counter() - started)
                self._responses[(code,)] += 1

    def _token_failed(self, failure: TokenFailure) -> Answer:
        """No OAuth 2.0 token for the request (the token endpoint's line is logged once
        per fetch, throttled, by ``proxy.upstream_oauth2``): 503, never sent, so nothing
        of it is stored and the sender sends it again. A refusal of the client is the
        configuration's, as a 401 to the proxy's own credentials: counted so, and retried
        after ``MISCONFIGURED_RETRY_AFTER``."""
        assert self._oauth2 is not None
        retry_after = DEFAULT_RETRY_AFTER
        if failure.refused:
            retry_after = MISCONFIGURED_RETRY_AFTER
            if self.metrics is not None:
                self.metrics.upstream_misconfigured.labels(
                    self.shown_url, "credentials_refused", f"token_{failure.status}").inc()
        said = (f"upstream {self.shown_url}: no OAuth 2.0 token from "
                f"{self._oauth2.shown_url} ({failure.result}, {failure.said()}); retry later")
        return Answer(503, one_line(said).encode()[:MAX_ERROR_BODY],
                      {"Retry-After": retry_after}, f"token_{failure.result}")

    async def _follow(self, pool: Pool, resp: Response, url: URL, headers: CIMultiDict[str],
                      body: bytes, incoming: Mapping[str, str]) -> Walked[Response]:
        """The last answer of the chain ``resp`` (a 3xx to ``url``) begins: while it is a
        307 or 308 and ``upstream.follow_redirects`` is on, the same ``body`` goes to its
        Location with the headers Go's client would send there (``Chain.walk``: the
        proxy's own settings on every request, a sender's sensitive headers not past its
        first URL's site), counted and logged as a round trip spent
        (:meth:`_followed`). Another 3xx ends it as the answer (301, 302, 303, or any
        redirect with the setting off: a misconfiguration, :meth:`_answer`); so does a
        redirect that cannot be followed (``Walked.refused``: a 502).

        Only what a redirect answers is known not stored, so following one never turns a
        request that may have been stored into a second one: the answer at the end of the
        chain is the only one taken."""
        chain = Chain([url])
        if not self.settings.follow_redirects:
            walked = Walked(resp, chain)
        else:
            brought = () if isinstance(incoming, OwnHeaders) else self._sender_names

            async def send(target: URL, hop_headers: CIMultiDict[str]) -> Response:
                tls = None
                if target.scheme == "https":
                    tls = self._tls.get() if self._tls is not None else self._hop_tls()
                egress = self._egress_for(target)
                return await pool.post(target, hop_headers, body, tls=tls,
                                       server_hostname=self.settings.tls_server_name or None,
                                       max_body=MAX_ERROR_BODY, egress=egress,
                                       proxy_tls=self._proxy_tls(egress, tls))

            walked = await chain.walk(resp, headers, brought, send, self._followed)
        if walked.refused is None and walked.resp.status in REDIRECTS:
            self._count_redirect("not_followed")
        return walked

    def _egress_for(self, target: URL) -> Egress | None:
        """The HTTP(S) or SOCKS5 proxy a request to ``target`` goes through
        (``upstream.proxy_url``, or the environment's by Go's rules), None for a direct
        one."""
        egress = self.egress
        if egress is None:
            return None
        return egress.proxy_for(target.scheme, target.raw_host or "", target.port or 0)

    def _proxy_tls(self, egress: Egress | None, tls: ssl.SSLContext | None
                   ) -> ssl.SSLContext | None:
        """The context an HTTPS proxy (``upstream.proxy_url: https://``) is verified with:
        the upstream's TLS settings (its CA, its client certificate), as Go's transport
        has one TLS configuration for the proxy and the upstream alike."""
        if egress is None or not egress.tls:
            return None
        if tls is not None:  # an https:// upstream's
            return tls
        return self._tls.get() if self._tls is not None else self._hop_tls()

    def _hop_tls(self) -> ssl.SSLContext:
        """The context of an https:// request when ``upstream.url`` is http:// (its
        redirect to https://, ingress-nginx's ``force-ssl-redirect``): made of the
        upstream's TLS settings, as Prometheus' one transport has them for every host,
        at the first such request."""
        if self._default_tls is None:
            self._default_tls = build_ssl_context(self.settings) or default_tls_context()
        return self._default_tls

    def _count_redirect(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.upstream_redirects.labels(result).inc()

    def _followed(self, chain: Chain, status: int) -> None:
        """A redirect followed costs every such request a round trip more, for good: said
        once per (from, to) at once, then in one summary per ``QUIET_LOG_SECONDS`` while it
        goes on (the throttle's keys are bounded)."""
        self._count_redirect("followed")
        hop = chain.hop()
        self._line(logging.WARNING, "upstream redirected a request and it was followed: each "
                   "such request costs a round trip more; set upstream.url to the target",
                   str(hop),
                   {"upstream_url": self.shown_url, "upstream_status": status,
                    "from": hop.came, "to": hop.went,
                    "sender_credentials_dropped": chain.dropped},
                   interval=QUIET_LOG_SECONDS)

    def _redirect_refused(self, hop: Walked[Response], refused: RedirectRefused) -> Answer:
        """A redirect that cannot be followed (no Location, one that does not parse or is
        not http/https, a loop, the 10th): a 502, which the sender retries (nothing of the
        request is stored: every answer of the chain was a redirect), one line per reason
        and interval, counted by reason."""
        self._count_redirect(refused.result)
        where = shown_location(hop.chain.url)
        self._line(logging.WARNING, "upstream redirect not followed: the sender gets 502 "
                   "(fix the upstream's redirects, or set upstream.url to where it should "
                   "go)", refused.result,
                   {"upstream_url": self.shown_url, "upstream_status": hop.resp.status,
                    "url": where, "reason": refused.result, "error": refused.why})
        return Answer(502, (f"upstream {where} answered {hop.resp.status}, a redirect not "
                            f"followed: {refused.why}").encode()[:MAX_ERROR_BODY],
                      {}, "redirect")

    def _body(self, resp: Response) -> bytes:
        """The first ``MAX_ERROR_BODY`` bytes of an answer's body; none when the body of a
        2xx breaks off (the connection reset after its head): the upstream said it stored
        the request, and that stays the sender's answer. A 502 made the sender send again
        what was stored: VictoriaMetrics keeps it twice, Prometheus refuses a batch with
        several samples of a series as out of order (a 400 the sender drops). Another
        answer's body broken off is what came of it, or, when none did, no answer (502)."""
        if resp.broken is None:
            return resp.body
        if not 200 <= resp.status < 300:
            if resp.body:
                return resp.body
            raise resp.broken
        why = failure_line(resp.broken, self.settings.timeout_seconds)
        self._line(logging.WARNING, "upstream answered 2xx, then its body broke off: "
                   "the sender gets the 2xx", str(resp.status),
                   {"upstream_url": self.shown_url, "upstream_status": resp.status,
                    "error": why})
        return b""

    def _no_answer(self, status: int, code: str, what: str, detail: str = "",
                   **extra: object) -> Answer:
        """No HTTP answer came (timeout, no connection, broken transport): the sender gets
        ``status`` and ``what: detail``, and with protocol auto the upstream may have been
        replaced meanwhile, so a probe is due before the next RW 2.0 request."""
        self._recheck = self.settings.protocol == "auto"
        self._line(logging.WARNING, what, code, {"upstream_url": self.shown_url, **extra})
        body = f"{what}: {detail}" if detail else what
        return Answer(status, body.encode(), {}, code)

    def _answer(self, upstream_status: int, upstream_headers: Mapping[str, str], text: bytes,
                code: str, converted: bool = False, chain: Chain | None = None) -> Answer:
        """The sender's answer to the upstream's (``chain``: the requests it took, when its
        first answer was a 3xx: a redirect not followed is said with its Location, an
        answer at the end of redirects with where it came from)."""
        status, out = map_status(upstream_status, upstream_headers,
                                 pass_through_429=self.settings.pass_through_429)
        for name in _WRITTEN:
            if name in upstream_headers:
                out[name] = upstream_headers[name]
        found = misconfigured(upstream_status, own_credentials=self.own_credentials,
                              body=text)
        if (found is None and chain is not None and chain.dropped
                and upstream_status in (401, 403) and not _NO_ORG_ID.match(text.strip())):
            # the sender's credentials were left out at a redirect to another site (Go's
            # rule): the refusal is the chain's, not the sender's, whose batch a 4xx drops
            found = _CREDENTIALS_NOT_SENT
        elif found is _OWN_CREDENTIALS_REFUSED and self._proxy_auth:
            found = _OWN_OR_PROXY_CREDENTIALS_REFUSED
        if found is not None:
            reason, what, answered = found.reason, found.what, found.answered
            line = (f"upstream {what}: fix {found.fix}; senders get {answered} and keep "
                    "their data meanwhile")
            extra: dict[str, object] = {"upstream_url": self.shown_url,
                                        "upstream_status": upstream_status, "reason": reason}
            where = self.shown_url
            if chain is not None and len(chain.urls) > 1:
                extra["redirected_to"] = went = shown_location(chain.url)
                where = f"{where} (redirected to {went})"
            if chain is not None and upstream_status in REDIRECTS:
                # the Location in the fields and the answer, never in the message: the
                # lines are throttled per message, which an upstream must not choose
                given = upstream_headers.get("Location")
                extra["location"] = location = said_location(chain.url, given)
                why = ("upstream.follow_redirects is off" if upstream_status in FOLLOWED
                       else f"a {upstream_status} makes a client's POST a GET without its "
                       "body, as Go's does")
                what = (f"redirects to {location}, which is not followed ({why}): set "
                        "upstream.url to it" if given else
                        f"redirects without a Location, which is not followed ({why})")
                line = ("upstream redirects the writes and the redirect is not followed: set "
                        "upstream.url to its location; senders get 503 and keep their data "
                        "meanwhile")
            elif found.path_hint:
                extra["hint"] = _PATH_HINT
            extra["body"] = text[:512].decode("utf-8", "replace")
            self._line(logging.ERROR, line, f"{reason}:{upstream_status}", extra)
            if self.metrics is not None:
                self.metrics.upstream_misconfigured.labels(self.shown_url, reason, code).inc()
            message = (f"upstream {where} answered {upstream_status}: it {what} "
                       f"(proxy misconfigured; retry later)").encode() + (
                           b": " + text if text.strip() else b"")
            return Answer(answered, message[:MAX_ERROR_BODY],
                          {"Retry-After": MISCONFIGURED_RETRY_AFTER}, code)
        if status != upstream_status and not 200 <= upstream_status < 300:
            # an empty body said as such, not as a line ending in ": " (nor as nothing:
            # a 1xx made 502 reached the sender with an empty body)
            text = f"upstream answered {upstream_status}: ".encode() + (
                text if text.strip() else b"(an empty body)")
        if status >= 500 or upstream_status >= 300:
            said = Answer(status, text, upstream=str(upstream_status))
            if not too_large(said) and not (converted and histograms_disabled(said)):
                # a refusal for size is sent in parts (``forward``), one of a converted
                # request's native histograms without them (``_histograms_refused``):
                # said there, if it must be
                self._line(
                    logging.WARNING, "upstream did not accept the request",
                    f"{upstream_status}:{status}",
                    {"upstream_status": upstream_status, "status": status,
                     "body": text[:512].decode("utf-8", "replace")},
                )
        return Answer(status, text[:MAX_ERROR_BODY], out, code)

    def _line(self, level: int, message: str, key: str, extra: dict[str, object], *,
              interval: float = THROTTLE_SECONDS, at_once: bool = False) -> None:
        """Log a line of what can come with every request, throttled per message, level
        and ``key`` (a status, a kind): the first at once, the rest of ``interval`` in one
        summary with its count (``at_once``: this one at once too, ``Throttled.event``).
        The messages are a fixed few, so is the number of throttles."""
        if not log.isEnabledFor(level):
            return
        lines = self._lines.get((level, message))
        if lines is None:
            lines = self._lines[(level, message)] = Throttled(
                log, message, f"{message} (repeated)", peer_field=None, level=level,
                interval=interval)
        lines.event(key, extra, at_once=at_once)

    # -- what the upstream is -------------------------------------------------------------

    async def check(self) -> Probe:
        """Probe the upstream with an empty write and say loudly what was found.

        With ``protocol: auto`` the empty write is RW 2.0: a 2.0 receiver answers 2xx
        with Written headers (of 0), a 1.0-only one 2xx without them (it reads the body
        as an empty 1.0 request) or 415. Otherwise it is RW 1.0, an endpoint check only.
        Concurrent callers share one probe.
        """
        async with self._check_lock:
            now = asyncio.get_running_loop().time()
            if self.probe is not None and (not self._recheck or (
                    self.probe.outcome == "unavailable"
                    and now - self._probed_at < RECHECK_SECONDS)):
                return self.probe
            probe = await self._probe()
            self._probed_at = asyncio.get_running_loop().time()
            self.probe = probe
            self._found_unavailable = probe.outcome == "unavailable"
            # checked again after no answer: what answers now may take native histograms
            self.histograms_refused_at = -math.inf
            self._recheck = probe.outcome == "unavailable" and self.settings.protocol == "auto"
            if self.settings.protocol == "auto":
                if probe.outcome == "rw2":
                    self.v1_only = False
                elif probe.outcome == "rw1":
                    self.v1_only = True
            self._log_probe(probe)
            self._publish()
            return probe

    async def _probe(self) -> Probe:
        auto = self.settings.protocol == "auto"
        protocol = Protocol.V2 if auto else Protocol.V1
        empty = Outgoing(protocol, self.out_encoding("snappy"),
                         compress(b"", self.out_encoding("snappy")))
        answer = await self._post(empty, OwnHeaders(self.own_headers))
        if empty.encoding == "zstd" and answer.upstream in ("400", "415"):
            answer = await self._zstd_refused(answer, empty)
        if answer.upstream == "415" and auto:
            answer = await self._post(
                Outgoing(Protocol.V1, empty.encoding, empty.encoded), OwnHeaders(self.own_headers))
            if answer.ok:
                return Probe("rw1", answer.upstream, "answered 415 to RW 2.0")
        detail = answer.body[:200].decode("utf-8", "replace")
        if answer.ok:
            if not auto:
                return Probe("rw1", answer.upstream)
            return Probe("rw2" if has_written_headers(answer.headers) else "rw1",
                         answer.upstream)
        code = int(answer.upstream) if answer.upstream.isdigit() else 0
        found = (misconfigured(code, own_credentials=self.own_credentials, body=answer.body)
                 if code else None)
        reason = (found.reason if found is not None else "credentials_refused"
                  if answer.upstream == TOKEN_REFUSED else "")
        if reason == "not_write_endpoint":
            return Probe("not_write_endpoint", answer.upstream, detail)
        if reason == "credentials_refused":
            return Probe("credentials_refused", answer.upstream, detail)
        if answer.status >= 500:
            return Probe("unavailable", answer.upstream, detail)
        return Probe("refused", answer.upstream, detail)

    async def _zstd_refused(self, answer: Answer, empty: Outgoing) -> Answer:
        """The check's zstd write was refused: if the same write as snappy is taken,
        the upstream does not read zstd, and every request goes out as snappy from now on
        (else every write would be refused, and dropped by its sender). The answer to
        the snappy write, or ``answer`` when snappy fares no better."""
        snappy_empty = Outgoing(empty.protocol, "snappy", compress(b"", "snappy"))
        retry = await self._post(snappy_empty, OwnHeaders(self.own_headers))
        if retry.upstream in ("400", "415"):
            return answer
        if retry.ok:
            self.zstd_refused = True
            log.warning("upstream refused zstd but takes snappy: sending snappy, whatever "
                        "upstream.encoding says (set it to snappy to silence this)",
                        extra={"upstream_url": self.shown_url, "upstream_status": answer.upstream,
                               "body": answer.body[:200].decode("utf-8", "replace")})
        return retry

    def _log_probe(self, probe: Probe) -> None:
        extra = {"upstream_url": self.shown_url, "upstream_status": probe.code,
                 "outcome": probe.outcome}
        if probe.outcome in ("rw2", "rw1"):
            message = ("upstream takes remote write 2.0: RW 2.0 requests pass through"
                       if probe.outcome == "rw2" else
                       "upstream takes remote write 1.0 only: RW 2.0 requests are converted")
            # checked again after every request that got no answer: the same finding again
            # in one summary a while, but a finding other than the last one logged at once
            # (rw1 -> rw2 -> rw1 in one interval left rw2 the last line while rw1 held)
            changed = probe.outcome != self._protocol_logged
            self._protocol_logged = probe.outcome
            self._line(logging.INFO, message, probe.outcome, {**extra},
                       interval=QUIET_LOG_SECONDS, at_once=changed)
        elif probe.outcome == "not_write_endpoint" and probe.code == str(LOOP_DETECTED):
            log.error("upstream URL leads back to a karta-proxy (a loop: upstream.url, or a "
                      "redirect of the upstream, names the proxy): every write will be "
                      "answered 508 until it is fixed", extra={**extra, "body": probe.detail})
        elif probe.outcome == "not_write_endpoint":
            log.error("upstream URL is NOT a remote-write endpoint: every write will be "
                      "answered 503 until upstream.url is fixed",
                      extra={**extra, "hint": _PATH_HINT, "body": probe.detail})
        elif probe.outcome == "credentials_refused":
            log.error(
                f"upstream {PROXY_CREDENTIALS}: every write will be answered 503 until "
                "they are fixed" if probe.code == "407" else
                "the upstream's OAuth 2.0 token endpoint (upstream.oauth2.token_url) "
                "refused the proxy's client: every write will be answered 503 until "
                "upstream.oauth2 is fixed" if probe.code == TOKEN_REFUSED else
                # the HTTP proxy's 401 cannot be told from the upstream's (tinyproxy
                # answers wrong credentials so): which one refused, its body may say
                "the upstream, or the HTTP proxy on the way (upstream.proxy_url's "
                "user:password), refused credentials: writes so refused are answered 503 "
                "until they are fixed" if self._proxy_auth else
                "upstream refused the proxy's credentials: every write will be answered 503 "
                "until they are fixed", extra={**extra, "body": probe.detail})
        elif probe.outcome == "unavailable":  # again at most every RECHECK_SECONDS: throttled
            self._line(logging.WARNING, "upstream not available at the check; checked again "
                       "when it answers", probe.code, {**extra, "body": probe.detail})
        elif probe.code in ("401", "403"):  # none of its own (else credentials_refused)
            log.warning("upstream refused an empty write: %s",
                        own_write_refused(int(probe.code), probe.detail.encode()),
                        extra={**extra, "body": probe.detail})
        else:
            log.warning("upstream refused an empty write", extra={**extra, "body": probe.detail})

    def _publish(self) -> None:
        if self.metrics is None:
            return
        if self.v1_only:
            protocol = "rw1"
        elif self.settings.protocol == "passthrough" or (
                self.probe is not None and self.probe.outcome == "rw2"):
            protocol = "as_received"
        else:
            protocol = "unknown"
        check = self.probe.outcome if self.probe is not None else "pending"
        self.metrics.upstream_info.clear()
        self.metrics.upstream_info.labels(self.shown_url, protocol, check).set(1)

    async def send_v1(self, raw: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Post an uncompressed RW 1.0 body of the proxy's own (fact series), with
        ``headers`` of its own (``facts.headers``: a tenant's, not subject to
        ``upstream.forward_headers``; ``upstream.headers`` and the credentials still win).

        Raises ``UpstreamFailure`` unless the upstream accepted it, so the caller can
        count and retry on its own schedule.
        """
        answer = await self.send(raw, Protocol.V1, incoming_headers=OwnHeaders(headers or {}))
        if not answer.ok:
            raise UpstreamFailure(answer)
