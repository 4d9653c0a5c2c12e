"""An upstream that answers a write with a redirect: which answers are followed, where to,
and with which headers, as Prometheus' ``remote_write`` follows them (prometheus/common's
``follow_redirects``, on by default, over Go's ``net/http`` client), so that a
``remote_write.url`` that worked straight through a redirecting front (ingress-nginx's
``force-ssl-redirect``: ``308`` from http:// to https://) works behind the proxy too.

Go's client (``Client.do``, ``redirectBehavior``):

- **307 and 308** are followed with the same method and the same body; **301, 302 and
  303** turn a POST into a GET without its body, which no write endpoint takes: never
  followed here, they stay the misconfiguration they were (``proxy.upstream``);
- the ``Location`` is resolved against the URL of the request it answers; one that does
  not parse ends the request (Go: "failed to parse Location header"), and so does a scheme
  other than http/https (Go's transport: "unsupported protocol scheme"). A redirect
  without one is the answer itself for today's Go (issues 17773, 49281), which
  Prometheus drops as any answer but a 5xx: here it ends the request with a 502 too, so
  the sender keeps its batch;
- at most 10 requests: the 10th redirect answer ends it (``defaultCheckRedirect``,
  "stopped after 10 redirects"); here a Location the chain requested already ends it at
  once (a loop would only spend the 10);
- the next request carries the first request's headers, but ``Authorization``,
  ``WWW-Authenticate``, ``Cookie``, ``Cookie2``, ``Proxy-Authorization`` and
  ``Proxy-Authenticate`` once the chain reached a host that is neither the first URL's
  host nor one of its subdomains (for the rest of the chain, even back there: Go 1.24's
  rule, CVE-2024-45336 and CVE-2025-4673); a ``Referer`` naming the previous URL unless it
  goes from https to http or the request set one itself; a ``Host`` set by the request
  only while every ``Location`` was relative (Go issue 22233).

Prometheus sets its own credentials (``authorization``, ``basic_auth``) and its
``headers`` in RoundTrippers below that client: on every request of the chain, wherever
it goes. So do the proxy's own settings here (``Chain.headers``): ``upstream.headers``,
the credentials (``bearer_token_file``, ``basic_auth_*``, and the ``user:password@`` of
``upstream.url``, the proxy's Basic credentials as those are: where Go drops a URL's
userinfo at an absolute ``Location``), and for the proxy's own writes ``facts.headers``.
What a sender's request brought (``upstream.forward_headers``: its ``Authorization``, a
``Cookie`` listed there) is the first request's headers in Go's sense, its sensitive ones
dropped as above (``Chain.dropped``: a 401 / 403 from there is then the chain's doing, a
503, not the 4xx that would drop the sender's batch: ``Upstream._answer``).

The rule alone, and the walk along a chain (``Chain.walk``: the upstream's writes and the
OAuth 2.0 token requests follow redirects alike), apart from the requests themselves
(``proxy.upstream`` and ``proxy.upstream_oauth2`` send them), so it is tested as a rule
(``tests/test_upstream_redirect.py``); it imports nothing of the project but
``proxy.shown``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from multidict import CIMultiDict
from yarl import URL

from proxy.shown import one_line, shown_url

#: the answers followed with the same method and body (Go's ``redirectBehavior``)
FOLLOWED = frozenset({307, 308})
#: the answers Go's client calls redirects: 301, 302, 303 only as a GET without the body
REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: the most requests one upstream request may take, redirects included: Go's
#: ``defaultCheckRedirect`` refuses the 10th redirect ("stopped after 10 redirects")
MAX_REQUESTS = 10
#: the headers Go's client drops once a redirect chain left the first URL's host and its
#: subdomains (``makeHeadersCopier``), lower case
SENSITIVE = frozenset({"authorization", "www-authenticate", "cookie", "cookie2",
                       "proxy-authorization", "proxy-authenticate"})
#: the most characters of a URL a log line or an answer shows of a Location (an
#: upstream's header line may be 8,190 bytes)
SHOWN_CHARS = 512

#: a byte of a header value that is not UTF-8, as the client decodes it (surrogateescape)
_RAW_BYTE = re.compile("[\udc80-\udcff]")

#: why a redirect was not followed, as ``karta_proxy_upstream_redirects_total`` counts it
Refusal = Literal["no_location", "bad_location", "loop", "too_many"]
#: every ``result`` of that counter: a redirect followed, one left to the misconfiguration
#: answer (301/302/303, or 307/308 with ``upstream.follow_redirects`` off), the refusals
RESULTS: tuple[str, ...] = ("followed", "not_followed", "no_location", "bad_location",
                            "loop", "too_many")


class RedirectRefused(Exception):
    """A redirect answer that ends the request: the sender gets a 502 and sends it again
    (whatever the Location says, nothing of the request is stored by a redirect)."""

    def __init__(self, result: Refusal, why: str) -> None:
        super().__init__(why)
        self.result: Refusal = result
        self.why = why


def same_site(first: URL, dest: URL) -> bool:
    """``dest`` is ``first``'s host or one of its subdomains, ports aside (Go's
    ``shouldCopyHeaderOnRedirect`` and ``isDomainOrSubdomain``): the sensitive headers may
    go there. yarl's ``raw_host`` is what Go compares: IDNA, lower case, an IPv6 address
    without brackets, which is never a subdomain of anything."""
    sub, parent = dest.raw_host or "", first.raw_host or ""
    if sub == parent:
        return True
    if ":" in sub or "%" in sub:
        return False
    return sub.endswith("." + parent) and bool(parent)


def _place(url: URL) -> tuple[str, str, int | None, str, str]:
    """Where a request goes: what tells two requests of a chain apart (a fragment is never
    sent; ``:80`` on http:// is the same place as none)."""
    return (url.scheme, url.raw_host or "", url.port, url.raw_path, url.raw_query_string)


def _reference(location: str) -> URL:
    """A Location as a URL reference, a byte that is not UTF-8 (the client keeps it as a
    surrogate) percent-encoded, as Go encodes such a byte of a path: yarl dropped it, and
    sent the request elsewhere (and failed on it in a host). Raises as yarl does."""
    return URL(_RAW_BYTE.sub(lambda m: f"%{ord(m.group()) - 0xDC00:02X}", location.strip()))


def resolve(base: URL, location: str | None) -> URL:
    """The URL a ``Location`` names, resolved against ``base`` (the request it answers)
    as RFC 3986 and Go's ``URL.Parse`` resolve a reference, without its fragment and its
    userinfo (the proxy's credentials are its settings'). ``RedirectRefused`` when there is
    none, it does not parse, names no host, or its scheme is not http or https."""
    if location is None or not location.strip():
        raise RedirectRefused("no_location", "no Location header")
    if any(c < " " or c == "\x7f" for c in location):  # Go's Parse refuses ASCII controls
        raise RedirectRefused("bad_location",
                              f"its Location {shown_location(location)} holds a control "
                              "character")
    try:
        ref = _reference(location)
        if ref.scheme and ref.scheme not in ("http", "https"):
            raise RedirectRefused(
                "bad_location", f"its Location {shown_location(location)} is not http:// "
                "or https://")
        if ref.scheme and not ref.raw_host:  # http:/x: a scheme with no authority
            raise ValueError("no host")
        target = base.join(ref)
        if not target.raw_host:
            raise ValueError("no host")
        target.port  # noqa: B018 - a port out of range raises here
        return target.with_fragment(None).with_user(None)
    except (ValueError, TypeError) as e:  # UnicodeError too
        raise RedirectRefused("bad_location",
                              f"its Location {shown_location(location)} does not parse "
                              f"({e})") from None


def shown_location(location: str | URL) -> str:
    """A Location as a log line or an answer shows it: one line (control characters as
    ``\\xNN``), without its userinfo, a credential query value hidden, at most
    ``SHOWN_CHARS`` characters."""
    text = one_line(shown_url(str(location)))
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def said_location(url: URL, location: str | None) -> str:
    """What a redirect not followed names, for the operator to set ``upstream.url`` to:
    its Location resolved against ``url`` (the request it answered), as it came when it
    does not resolve, or that there was none."""
    try:
        return shown_location(resolve(url, location))
    except RedirectRefused:
        return shown_location(location) if location else "(no Location)"


class Answered(Protocol):
    """An answer as far as a redirect goes: the HTTP client's ``Response``."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


A = TypeVar("A", bound=Answered)


@dataclass(slots=True)
class Walked(Generic[A]):
    """Where a request's redirects led (``Chain.walk``): the last answer, the chain of
    requests, and why the last redirect was not followed, if that ended the walk."""

    resp: A
    chain: Chain
    refused: RedirectRefused | None = None


@dataclass(frozen=True, slots=True)
class Hop:
    """The redirect a chain followed last, as a log line shows it (``shown_location``:
    no userinfo, a credential's query value hidden): both the upstream's writes and the
    token requests say it, each in its own throttled line."""

    came: str
    went: str

    def __str__(self) -> str:
        return f"{self.came} -> {self.went}"


@dataclass(slots=True)
class Chain:
    """The requests of one upstream request so far, redirects followed: Go's
    ``Client.do`` loop, as far as a write's redirects go."""

    #: the URLs requested, the first one first
    urls: list[URL]
    #: the chain reached a host that is neither the first URL's nor a subdomain of it:
    #: the sensitive headers a sender brought are dropped from then on
    left_site: bool = False
    #: a Location with a scheme was followed: a ``Host`` of the request's own is no
    #: longer sent (Go keeps it through relative ones only)
    absolute: bool = False
    #: the previous request's URL, for the next one's ``Referer``
    previous: URL | None = field(default=None, repr=False)
    #: a sensitive header the sender's request brought was left out (:meth:`headers`): a
    #: 401 / 403 then is the chain's doing, not the sender's
    dropped: bool = False

    @property
    def url(self) -> URL:
        """Where the last request went."""
        return self.urls[-1]

    def hop(self) -> Hop:
        """The redirect followed last (the chain has two URLs at least)."""
        return Hop(shown_location(self.urls[-2]), shown_location(self.url))

    def follow(self, location: str | None) -> URL:
        """The next request's URL for a 307 / 308 answer to the last one, taken as the
        chain's (``RedirectRefused`` when it ends the request instead)."""
        target = resolve(self.url, location)
        place = _place(target)
        if any(_place(u) == place for u in self.urls):
            raise RedirectRefused("loop", f"its Location {shown_location(target)} was "
                                          "requested before in this chain (a redirect loop)")
        if len(self.urls) >= MAX_REQUESTS:
            raise RedirectRefused("too_many", f"stopped after {MAX_REQUESTS} redirects (as "
                                              "Go's client, and Prometheus, stop)")
        self.left_site = self.left_site or not same_site(self.urls[0], target)
        # parsed by ``resolve`` already, as it parsed it: Go's ``url.Parse(loc).IsAbs()``
        # (the raw text again raised a UnicodeError for a byte that is not UTF-8 in a
        # host, a 502 said as a proxy bug)
        self.absolute = self.absolute or bool(_reference(location or "").scheme)
        self.previous = self.url
        self.urls.append(target)
        return target

    def headers(self, first: CIMultiDict[str], brought: Iterable[str]) -> CIMultiDict[str]:
        """The headers of the last request followed: ``first``'s (the first request's, the
        proxy's own settings in them), but the sensitive ones of the names the sender's
        request ``brought`` (lower case) once the chain left the first URL's site, a
        ``Host`` of the settings' once a Location was absolute, and a ``Referer`` naming
        the previous URL as Go sets it."""
        out = CIMultiDict(first)
        if self.left_site:
            for name in SENSITIVE.intersection(brought):
                if out.popall(name, None) is not None:
                    self.dropped = True
        if self.absolute:
            out.popall("Host", None)
        previous = self.previous
        if (previous is not None and "Referer" not in out
                and not (previous.scheme == "https" and self.url.scheme == "http")):
            out["Referer"] = str(previous)
        return out

    async def walk(self, resp: A, first: CIMultiDict[str], brought: Iterable[str],
                   send: Callable[[URL, CIMultiDict[str]], Awaitable[A]],
                   followed: Callable[[Chain, int], None]) -> Walked[A]:
        """Go's ``Client.do`` loop from the answer ``resp`` to the chain's last request:
        while it is a 307 or 308, the same request goes to its Location (``send``, with
        :meth:`headers` of the first request's ``first`` and the sender's ``brought``),
        ``followed`` told of each redirect taken, once its headers are known (whether a
        sender's were dropped). Another answer ends the walk as the answer, a 301 / 302 /
        303 among them (the caller's to refuse); so does a redirect that cannot be
        followed (``Walked.refused``)."""
        while resp.status in FOLLOWED:
            try:
                target = self.follow(resp.headers.get("Location"))
            except RedirectRefused as e:
                return Walked(resp, self, e)
            headers = self.headers(first, brought)
            followed(self, resp.status)
            resp = await send(target, headers)
        return Walked(resp, self)
