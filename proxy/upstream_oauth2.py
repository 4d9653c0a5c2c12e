"""The upstream's OAuth 2.0 token (``upstream.oauth2``): the client credentials grant
(RFC 6749 section 4.4), got and kept as Prometheus' remote_write ``oauth2`` gets it
(prometheus/common's ``oauth2RoundTripper`` over golang.org/x/oauth2's
``clientcredentials``), so that a ``remote_write`` with ``oauth2:`` can be moved behind
karta-proxy as it is.

As x/oauth2 does:

- the request: ``POST token_url``, a form of ``grant_type=client_credentials``, ``scope``
  (the scopes joined by spaces, when there are any) and ``endpoint_params`` (which may
  set another ``grant_type``), keys sorted; the client's id and secret first as HTTP
  Basic credentials (each form-escaped), and when that fails, in the form
  (``client_id``, ``client_secret``); the way that worked is kept for the next requests;
- the answer: JSON (``access_token``, ``token_type``, ``expires_in`` a number or a
  string of one) or, for ``application/x-www-form-urlencoded`` and ``text/plain``, a
  form; a non-2xx status or an ``error`` field is a refusal, an answer without an
  ``access_token`` an error; the ``Authorization`` sent is ``<type> <token>``, the type
  ``Bearer`` unless the answer names another (``bearer`` is ``Bearer``);
- a 307 or 308 is followed as Go's client follows x/oauth2's request (prometheus/common
  sets no ``CheckRedirect`` on its token client): the same form to the Location, the
  Basic credentials not past the token URL's site (``proxy.upstream_redirect``'s rule); a
  301, 302 or 303 (Go's GET without the form, which no token endpoint answers with a
  token) is a refusal naming the Location;
- the token is used until 10 s before it expires (x/oauth2's ``expiryDelta``), and
  without ``expires_in`` (or 0) for as long as it is not refused;
- the secret file is read again when it changes (a stamp checked at most once a second,
  :class:`proxy.upstream_tls.FileSecret`), and a new secret drops the token held, as
  Prometheus builds a new token source when the file's text changes. A file gone keeps
  the last secret (the proxy's rule for every credential file), where Prometheus fails
  the request.

What the proxy adds, since its senders wait on it: a fetch is one task every request
that finds no token waits for (one fetch, however many requests), bounded in time
(:data:`FETCH_SECONDS`, and ``upstream.timeout_seconds``; x/oauth2 gives it none), made
on the event loop's own I/O (the TLS context built in a thread, and a long answer read
there: :data:`PARSED_ON_LOOP`); a failed fetch answers
the requests of the next :data:`FAILURE_HOLD_SECONDS` without another; and a token the
upstream refuses (401) is dropped, so the next request fetches another
(:meth:`TokenSource.refused`), where Prometheus sends it until it expires. Nothing of
the secret or the token reaches a log line, a metric or an answer: an endpoint's error
text that quotes the secret has it withheld (x/oauth2's error quotes the body as it
came).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, quote_plus, urlencode

from multidict import CIMultiDict
from yarl import URL

from proxy.config import OAuth2Settings
from proxy.deadline import deadline_in
from proxy.egress_proxy import Egress, parse_egress
from proxy.log import Throttled, failure_line
from proxy.shown import one_line, sent_credentials, shown_url, withheld
from proxy.tls_files import HEADER_VALUE_FORBIDDEN, FileStamp, client_context, stamp
from proxy.upstream_http import (
    ClientError,
    Pool,
    Response,
    basic_authorization,
    default_tls_context,
)
from proxy.upstream_redirect import (
    REDIRECTS,
    Chain,
    said_location,
)
from proxy.upstream_tls import FileSecret

log = logging.getLogger("karta.upstream")

#: a token is not used past its expiry less this (x/oauth2's ``expiryDelta``): a request
#: sent with it still reaches the upstream before it expires
EXPIRY_DELTA = 10.0
#: the most one fetch takes, both ways of sending the credentials together (and never
#: more than ``upstream.timeout_seconds``): x/oauth2 gives a token request no deadline
#: of its own, so one that hung held every write of Prometheus' queue
FETCH_SECONDS = 10.0
#: a failed fetch is the answer of the requests that come this long after it, without
#: another fetch: in an outage of the token endpoint every request of every sender would
#: otherwise make one (the senders retry after their backoff anyway)
FAILURE_HOLD_SECONDS = 1.0
#: a token the upstream refuses (401) is dropped only when it was fetched this long ago
#: or more: one refused as soon as it came is not the token's age (a wrong audience, a
#: client the upstream does not know), and fetching again at every refusal would fetch
#: at the senders' rate
REFUSED_MIN_AGE = 10.0
#: the most of an answer read (x/oauth2 reads 1 MiB)
MAX_ANSWER = 1 << 20
#: an answer longer than this is read in a thread: a form answer of ``MAX_ANSWER``
#: (``a=&`` over and over) held the event loop, every sender's request with it, 0.5 s a
#: fetch, and a failed fetch comes again every ``FAILURE_HOLD_SECONDS``; a token
#: endpoint's answer is a few KiB
PARSED_ON_LOOP = 64 * 1024
#: the most of an OAuth error's text a line or an answer shows
SHOWN_ERROR = 200

TokenResult = Literal["success", "refused", "unavailable", "invalid_answer"]
#: ``result`` of the fetch counter: ``refused`` (a 4xx but 408, 425, 429, or an ``error``
#: in the answer: the client's credentials, scopes or parameters; an operator's to fix),
#: ``unavailable`` (no answer, a timeout, a 5xx or another "later"), ``invalid_answer``
#: (a 2xx the proxy cannot use: not JSON or a form, no ``access_token``, ...)
TOKEN_RESULTS: tuple[TokenResult, ...] = ("success", "refused", "unavailable",
                                          "invalid_answer")
#: token endpoint statuses that say "later", not "this client is refused"
_LATER = frozenset({408, 425, 429})

AuthStyle = Literal["header", "params"]


@dataclass(frozen=True, slots=True)
class Token:
    """A token in force: the ``Authorization`` it makes and when it stops being used."""

    authorization: str
    #: the clock's time from which it is not used (its expiry less ``EXPIRY_DELTA``);
    #: ``inf`` for a token the endpoint gave no lifetime
    stale_at: float
    #: the clock's time it was fetched at
    fetched_at: float
    #: its lifetime as the endpoint said it (seconds; 0: none said)
    expires_in: int


@dataclass(frozen=True, slots=True)
class TokenFailure:
    """Why no token came; what the waiting requests are answered with."""

    result: TokenResult
    #: the token endpoint's status, or None when no answer came
    status: int | None
    #: the OAuth error code (``invalid_client``, ...), or a word of the proxy's
    #: (``timeout``, ``no_connection``, ``not_json``, ...)
    error: str
    #: one line: the error's description, or what went wrong
    detail: str
    #: the clock's time it happened
    at: float

    @property
    def refused(self) -> bool:
        """The endpoint refused the client (its settings'), not "later"."""
        return self.result == "refused"

    def said(self) -> str:
        """One line naming the status, the error and its description."""
        status = f"answered {self.status}" if self.status is not None else "no answer"
        return f"{status}: {self.error}" + (f" ({self.detail})" if self.detail else "")


def token_type(name: str) -> str:
    """The scheme of the ``Authorization`` for an answer's ``token_type``, as x/oauth2's
    ``Token.Type``: ``Bearer`` for none or any case of ``bearer``, ``MAC`` and ``Basic``
    in their case, another as the answer spells it."""
    for known in ("Bearer", "MAC", "Basic"):
        if name.lower() == known.lower():
            return known
    return name or "Bearer"


#: a JSON integer, as a string may hold one for Go's ``json.Number``
_JSON_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
#: what Go's ``strconv.Atoi`` reads (a form's ``expires_in``)
_ATOI = re.compile(r"[+-]?[0-9]+")
_INT64 = 2**63
_INT32_MAX = 2**31 - 1


def _expires_in(value: Any) -> int | None:
    """``expires_in`` as x/oauth2 reads it from JSON: a number, or a string holding one
    (PayPal's), an integer in an int64 (3600.0 is refused, as Go's ``json.Number.Int64``
    refuses it), clamped to an int32's most; null or absent: 0. None: not one."""
    if value is None:
        return 0
    if isinstance(value, str) and _JSON_INTEGER.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -_INT64 <= value < _INT64:
        return None
    return min(value, _INT32_MAX)


@dataclass(frozen=True, slots=True)
class _Answer:
    """What a token endpoint's answer says: a token's parts, or an error's."""

    access_token: str = ""
    token_type: str = ""
    expires_in: int = 0
    error: str = ""
    description: str = ""


#: what an answer the proxy cannot read is, by the word ``parse_answer`` says
_UNREADABLE = {
    "not_form": "a form answer that is not UTF-8",
    "not_json": "not a JSON object (nor a form: Content-Type)",
    "bad_field": "a field of the wrong type (expires_in an integer, the rest strings)",
    "broken_off": "the answer broke off before its end",
}


def parse_answer(content_type: str, body: bytes) -> _Answer | str:
    """The token endpoint's answer read as x/oauth2's ``doTokenRoundTrip`` reads it: a
    form for ``application/x-www-form-urlencoded`` and ``text/plain`` (an ``expires_in``
    that is no number read as 0), JSON for any other type. Why it cannot be read, as a
    short word, when it cannot."""
    media = content_type.partition(";")[0].strip().lower()
    if media in ("application/x-www-form-urlencoded", "text/plain"):
        try:
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True,
                            strict_parsing=False)
        except UnicodeDecodeError:
            return "not_form"

        def one(name: str) -> str:
            return form.get(name, [""])[0]

        expires = one("expires_in")
        seconds = int(expires) if _ATOI.fullmatch(expires) else 0
        seconds = seconds if -_INT64 <= seconds < _INT64 else 0  # Atoi's range error: 0
        return _Answer(one("access_token"), one("token_type"), seconds,
                       one("error"), one("error_description"))
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "not_json"
    if not isinstance(data, dict):
        return "not_json"

    def text(name: str) -> str | None:
        value = data.get(name)
        return "" if value is None else value if isinstance(value, str) else None

    fields = [text(n) for n in ("access_token", "token_type", "error", "error_description")]
    lifetime = _expires_in(data.get("expires_in"))
    if lifetime is None or any(f is None for f in fields):
        return "bad_field"  # a field of the wrong type: Go's json.Unmarshal fails
    access, kind, error, description = (f or "" for f in fields)
    return _Answer(access, kind, lifetime, error, description)


class TokenSource:
    """The OAuth 2.0 token of the upstream's requests: :meth:`current` is what a request
    reads (a cached value), :meth:`authorization` what it awaits when there is none (the
    one fetch under way, or a new one)."""

    def __init__(self, settings: OAuth2Settings, *, timeout: float, connect_timeout: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_fetch: Callable[[TokenResult], None] | None = None) -> None:
        """``timeout``: ``upstream.timeout_seconds`` (a fetch takes at most that, and
        ``FETCH_SECONDS``); ``on_fetch`` is told each fetch's result."""
        self.settings = settings
        self.url = settings.token_url
        self.shown_url = shown_url(settings.token_url)
        self._target = URL(settings.token_url)
        self._timeout = min(FETCH_SECONDS, timeout)
        self._connect_timeout = connect_timeout
        self._clock = clock
        self._on_fetch = on_fetch
        self._secret = FileSecret(settings.client_secret_file, header=False, clock=clock)
        self._egress: Egress | None = (
            parse_egress(settings.proxy_url, source="upstream.oauth2.proxy_url")
            if settings.proxy_url else None)
        #: the form of every token request, but the client's credentials (x/oauth2's
        #: ``url.Values``: grant_type, scope, then the endpoint params over them)
        form = {"grant_type": "client_credentials"}
        if settings.scopes:
            form["scope"] = " ".join(settings.scopes)
        form.update(settings.endpoint_params)
        self._form = form
        self._token: Token | None = None
        #: the secret the token (or the failure) was got with: another drops it
        self._with_secret = ""
        self._failure: TokenFailure | None = None
        self._fetching: asyncio.Task[str | TokenFailure] | None = None
        #: how the credentials went the last time a token came (x/oauth2's auth style
        #: cache): None until then, both tried in turn
        self._style: AuthStyle | None = None
        self._pool: Pool | None = None
        self._tls: ssl.SSLContext | None = None
        self._tls_stamps: tuple[FileStamp | None, ...] | None = None
        self._lines = Throttled(log, "upstream OAuth 2.0 token not fetched: senders get 503 "
                                "and keep their data", "upstream OAuth 2.0 token not "
                                "fetched (repeated)", peer_field=None)
        message = ("upstream OAuth 2.0 token endpoint redirected the token request and it "
                   "was followed: set upstream.oauth2.token_url to the target")
        self._redirects = Throttled(log, message, f"{message} (repeated)", peer_field=None)
        self._failing = False

    # -- what a request reads ---------------------------------------------------------

    def current(self) -> str:
        """The ``Authorization`` of the token in force, "" when there is none: not
        fetched yet, within ``EXPIRY_DELTA`` of its expiry, refused, or got with a secret
        the file no longer holds. A clock read and a comparison or two."""
        token = self._token
        if token is None:
            return ""
        if self._secret.get() != self._with_secret:
            self._token = None
            return ""
        if self._clock() >= token.stale_at:
            return ""
        return token.authorization

    async def authorization(self) -> str | TokenFailure:
        """The ``Authorization`` to send, fetched first when none is in force; the
        failure when none came (a fetch's within the last ``FAILURE_HOLD_SECONDS``
        included). Concurrent callers share one fetch, which a caller's cancellation
        does not end."""
        value = self.current()
        if value:
            return value
        failure = self._failure
        if failure is not None and self._clock() - failure.at < FAILURE_HOLD_SECONDS \
                and self._secret.get() == self._with_secret:
            return failure
        task = self._fetching
        if task is None:
            task = self._fetching = asyncio.create_task(self._fetch(),
                                                        name="upstream-oauth2-token")
        return await asyncio.shield(task)

    def refused(self, authorization: str) -> None:
        """The upstream answered 401 to a request sent with ``authorization``: drop the
        token when it is still the one in force and old enough (``REFUSED_MIN_AGE``),
        so that the next request fetches another (one revoked, or signed with a key the
        upstream no longer takes, before its expiry)."""
        token = self._token
        if token is not None and token.authorization == authorization \
                and self._clock() - token.fetched_at >= REFUSED_MIN_AGE:
            self._token = None
            log.warning("upstream refused the OAuth 2.0 token (401): dropped, the next "
                        "request fetches another", extra={"token_url": self.shown_url})

    async def close(self) -> None:
        self._lines.close()
        self._redirects.close()
        task, self._fetching = self._fetching, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # -- a fetch ----------------------------------------------------------------------

    async def _fetch(self) -> str | TokenFailure:
        secret = self._secret.get()
        try:
            try:
                async with deadline_in(self._timeout):
                    got = await self._retrieve(secret)
            except TimeoutError:
                got = TokenFailure("unavailable", None, "timeout",
                                   f"no token within {self._timeout:g} s", self._clock())
            except Exception as e:  # a bug: the waiting requests get a 503, not a 500
                log.exception("upstream OAuth 2.0 token fetch failed")
                got = TokenFailure("unavailable", None, "error",
                                   failure_line(e, self._timeout), self._clock())
            self._with_secret = secret
            if isinstance(got, TokenFailure):
                self._failure = got
                self._failed(got)
                return got
            self._token, self._failure = got, None
            self._fetched(got)
            return got.authorization
        finally:
            self._fetching = None

    async def _retrieve(self, secret: str) -> Token | TokenFailure:
        """The token, the credentials sent the way that worked last, else in the header
        and then, that failing whatever the failure, in the form (x/oauth2's probe)."""
        styles: tuple[AuthStyle, ...] = (self._style,) if self._style else ("header",
                                                                              "params")
        got: Token | TokenFailure | None = None
        for style in styles:
            got = await self._attempt(style, secret)
            if isinstance(got, Token):
                self._style = style
                return got
        assert got is not None
        return got

    async def _attempt(self, style: AuthStyle, secret: str) -> Token | TokenFailure:
        form = dict(self._form)
        headers = {"Content-Type": "application/x-www-form-urlencoded",
                   "User-Agent": "karta-proxy"}
        client_id = self.settings.client_id
        if style == "header":
            headers["Authorization"] = basic_authorization(quote_plus(client_id, safe=""),
                                                           quote_plus(secret, safe=""))
        else:
            form["client_id"] = client_id
            if secret:
                form["client_secret"] = secret
        body = urlencode(sorted(form.items())).encode()
        try:
            resp = await self._post(headers, body)
        except (ClientError, OSError, ValueError) as e:
            return TokenFailure("unavailable", None, "no_answer",
                                failure_line(e, self._timeout), self._clock())
        if isinstance(resp, TokenFailure):
            return resp
        if len(resp.body) > PARSED_ON_LOOP:
            return await asyncio.to_thread(self._token_of, resp, secret)
        return self._token_of(resp, secret)

    async def _post(self, headers: dict[str, str], body: bytes) -> Response | TokenFailure:
        """The token request's answer, a 307 or 308 followed as Go's client follows
        x/oauth2's request (prometheus/common gives its token client no
        ``CheckRedirect``, whatever ``follow_redirects`` says): the same form to the
        Location, at most 10 requests, the Basic credentials not past the token URL's
        host and its subdomains (``Chain.headers``; a form's ``client_secret`` goes on
        with the body, as Go sends it). A redirect that cannot be followed, or a 301 /
        302 / 303 (Go makes the POST a GET without its form), is the failure, naming
        where it points."""
        if self._pool is None:
            # its own pool: the token endpoint is another host, reached its own way
            # (oauth2.tls_*, oauth2.proxy_url); connections kept 10 s, as Prometheus'
            self._pool = Pool(limit=2, idle_seconds=10.0,
                              connect_timeout=self._connect_timeout)
        pool = self._pool
        tls: ssl.SSLContext | None = None

        async def send(target: URL, sent: CIMultiDict[str]) -> Response:
            nonlocal tls
            if target.scheme == "https" and tls is None:  # the files stat'ed once a fetch
                tls = await self._context()
            proxy_tls = None
            if self._egress is not None and self._egress.tls:  # oauth2.tls_*, as Go's
                proxy_tls = tls = tls or await self._context()
            return await pool.post(target, sent, body,
                                   tls=tls if target.scheme == "https" else None,
                                   server_hostname=None, max_body=MAX_ANSWER, egress=self._egress,
                                   proxy_tls=proxy_tls)

        first: CIMultiDict[str] = CIMultiDict(headers)
        walked = await Chain([self._target]).walk(
            await send(self._target, first), first, ("authorization",), send, self._followed)
        resp, chain = walked.resp, walked.chain
        if walked.refused is not None:
            return TokenFailure("unavailable", resp.status, "redirect",
                                f"a redirect not followed: {walked.refused.why}", self._clock())
        if resp.status in REDIRECTS:
            return self._refusal(resp.status, "", (
                f"redirects to {said_location(chain.url, resp.headers.get('Location'))}, "
                f"not followed (a {resp.status} makes a client's POST a GET without its "
                "form, as Go's does): set upstream.oauth2.token_url to it"), self._clock())
        return resp

    def _followed(self, chain: Chain, status: int) -> None:
        """A redirect of the token request followed: said once per (from, to), throttled."""
        hop = chain.hop()
        self._redirects.event(str(hop), {
            "token_url": self.shown_url, "token_status": status, "from": hop.came,
            "to": hop.went})

    async def _context(self) -> ssl.SSLContext:
        """The token endpoint's TLS context, built again in a thread when its files
        changed (stat'ed there too, at each fetch): a fetch comes once a token's life."""
        self._tls = await asyncio.to_thread(self._load_tls)
        return self._tls

    def _load_tls(self) -> ssl.SSLContext:
        s = self.settings
        if not (s.tls_ca_file or s.tls_cert_file or s.tls_insecure_skip_verify):
            return self._tls or default_tls_context()
        try:
            stamps = (stamp(s.tls_ca_file), stamp(s.tls_cert_file), stamp(s.tls_key_file))
            if self._tls is not None and stamps == self._tls_stamps:
                return self._tls
            ctx = client_context(s.tls_ca_file, s.tls_cert_file, s.tls_key_file,
                                 s.tls_insecure_skip_verify)
        except (OSError, ssl.SSLError) as e:
            if self._tls is None:
                raise
            log.warning("upstream.oauth2 TLS files not loaded; the context in use stays",
                        extra={"token_url": self.shown_url, "error": str(e)})
            return self._tls
        assert ctx is not None
        ctx.set_alpn_protocols(["http/1.1"])
        self._tls_stamps = stamps
        return ctx

    def _token_of(self, resp: Response, secret: str) -> Token | TokenFailure:
        """The token of an answer, or why there is none: its status, then its
        ``error`` (a 2xx may carry one), then its ``access_token``. Pure but for the
        clock: run in a thread for a long answer."""
        now = self._clock()
        status = resp.status
        failed = not 200 <= status < 300
        parsed = parse_answer(resp.headers.get("Content-Type", ""), resp.body)
        if resp.broken is not None and not failed:
            parsed = "broken_off"
        if isinstance(parsed, str):
            if failed:
                return self._refusal(status, "", f"{parsed} answer", now)
            return TokenFailure("invalid_answer", status, parsed, _UNREADABLE[parsed], now)
        if failed or parsed.error:
            return self._refusal(status, parsed.error, parsed.description, now, secret)
        access = parsed.access_token
        if not access:
            return TokenFailure("invalid_answer", status, "no_access_token",
                                "server response missing access_token", now)
        scheme = token_type(parsed.token_type)
        authorization = f"{scheme} {access}" if scheme else access
        if not authorization.isascii() or HEADER_VALUE_FORBIDDEN.search(authorization):
            return TokenFailure("invalid_answer", status, "bad_token",
                                "the token is not one line of ASCII text", now)
        lifetime = parsed.expires_in
        stale_at = now + lifetime - EXPIRY_DELTA if lifetime else math.inf
        return Token(authorization, stale_at, now, lifetime)

    def _refusal(self, status: int, error: str, description: str, now: float,
                 secret: str = "") -> TokenFailure:
        """A non-2xx answer, or one with an ``error``: the client refused, or "later"
        (a 5xx, 408, 425, 429). The endpoint's text is the senders' answer and a log
        line: the client's credentials it quotes (``secret``, as sent or form-escaped,
        the Basic credentials) are withheld, as an upstream's answer quoting the
        proxy's token is."""
        later = status >= 500 or status in _LATER
        detail = one_line(self._withheld(description, secret))[:SHOWN_ERROR]
        error = one_line(self._withheld(error, secret))[:SHOWN_ERROR]
        return TokenFailure("unavailable" if later else "refused", status,
                            error or f"status_{status}", detail, now)

    def _withheld(self, text: str, secret: str) -> str:
        """``text`` without the client's credentials as a token request carries them
        (:func:`proxy.shown.sent_credentials`, both ways of sending them)."""
        if not text or not secret:
            return text
        basic = basic_authorization(quote_plus(self.settings.client_id, safe=""),
                                    quote_plus(secret, safe=""))
        sent = sent_credentials({"Authorization": basic, "client_secret": secret}, set())
        # a JSON answer's text may hold a lone surrogate, which UTF-8 does not encode
        raw = text.encode("utf-8", "surrogatepass")
        return withheld(raw, sent).decode("utf-8", "surrogatepass")

    def _fetched(self, token: Token) -> None:
        if self._on_fetch is not None:
            self._on_fetch("success")
        level = logging.INFO if self._failing else logging.DEBUG
        self._failing = False
        log.log(level, "upstream OAuth 2.0 token fetched", extra={
            "token_url": self.shown_url, "expires_in": token.expires_in,
            "style": self._style})

    def _failed(self, failure: TokenFailure) -> None:
        if self._on_fetch is not None:
            self._on_fetch(failure.result)
        self._failing = True
        self._lines.event(f"{failure.result}:{failure.status}:{failure.error}", {
            "token_url": self.shown_url, "result": failure.result,
            "token_status": failure.status, "error": failure.error,
            "detail": failure.detail})
