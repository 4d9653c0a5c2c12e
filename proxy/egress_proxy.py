"""The HTTP proxy the upstream is reached through, chosen per upstream URL as Prometheus'
``remote_write`` chooses it (prometheus/common's ``proxy_url``, ``no_proxy`` and
``proxy_from_environment``, over Go's ``net/http`` and ``golang.org/x/net/http/httpproxy``),
so that a sender's ``remote_write`` moved behind karta-proxy reaches its TSDB the way it
did:

- ``proxy_url`` alone: every upstream request goes through it (``http.ProxyURL``);
- with ``no_proxy``, or from the environment (``HTTP_PROXY`` for an http:// upstream,
  ``HTTPS_PROXY`` for an https:// one, ``NO_PROXY``; each upper case first, then lower
  case): Go's rules, so ``localhost`` and loopback addresses are always reached directly,
  and a ``NO_PROXY`` entry is ``*`` (everything), an IP address or a CIDR range, a domain
  (itself and its subdomains) or ``.domain`` (its subdomains only), a name or an address
  optionally with ``:port``.

An http:// upstream is sent through an HTTP proxy in absolute form (``POST
http://host/path``), an https:// one through a ``CONNECT`` tunnel, as Go does
(``proxy.upstream_http``); a ``user:password@`` in the proxy's URL goes as
``Proxy-Authorization: Basic``. The upstream (and its OAuth2 token endpoint) may also be
reached through an HTTPS proxy (``https://``: the same, spoken to over TLS, an https://
upstream's TLS inside that, as Go's transport does), or a SOCKS5 proxy (``socks5://`` or
``socks5h://``, as Go's transport takes both): the upstream's name is sent to the proxy
unresolved, a ``user:password@`` is RFC 1929's username/password, and the requests then
go as they would directly. Other schemes are settings errors, said at start.

The Kubernetes client takes the same proxies (its kubeconfig's ``proxy-url``, as
client-go takes it), and the same rules for the API server when its kubeconfig has none
(``environment_route``: client-go's ``http.ProxyFromEnvironment``).

A leaf of the upstream's and the Kubernetes client: it imports nothing of the project but
``proxy.shown``.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from proxy.shown import shown_url

#: the most (scheme, host, port) whose route is kept: ``{tenant}`` in the upstream URL's
#: host makes a name per tenant, as for the client's names (``upstream_http.MAX_NAMES``)
MAX_ROUTES = 1024

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_NET = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Egress:
    """One HTTP proxy: where to connect, and what to tell it."""

    host: str  # as looked up: IDNA, no brackets
    port: int
    #: the host is an IP address: not looked up
    literal: bool
    #: the value of ``Proxy-Authorization`` (from the URL's user:password), or ""
    authorization: str = field(repr=False)
    #: the URL with its password hidden, for messages
    shown: str
    #: ``upstream.proxy_connect_header`` as header lines (``Name: value\r\n`` each), sent
    #: with every ``CONNECT`` and with nothing else, as Go's ``ProxyConnectHeader``
    connect_lines: str = field(default="", repr=False)
    #: a SOCKS5 proxy (``socks5://``): a tunnel to every upstream, http:// or https://
    socks: bool = False
    #: an HTTPS proxy (``https://``): an HTTP proxy spoken to over TLS
    tls: bool = False
    #: a SOCKS5 proxy's RFC 1929 username/password request (from the URL's
    #: user:password), or b"" to offer no authentication
    socks_login: bytes = field(default=b"", repr=False)
    #: where the proxy's URL is written (``upstream.proxy_url``, ``HTTPS_PROXY``, ...),
    #: for a message that its login is missing or refused: the place to fix it
    source: str = field(default="the proxy URL", compare=False)

    @property
    def kind(self) -> str:
        """What the proxy is, for messages."""
        if self.socks:
            return "SOCKS5 proxy"
        return "HTTPS proxy" if self.tls else "HTTP proxy"

    @property
    def url(self) -> str:
        """The proxy's URL without its credentials (they go as ``authorization``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def connect_request(self, host_port: str) -> bytes:
        """The ``CONNECT`` that opens a tunnel to ``host_port`` (as a ``Host`` header
        writes it), as Go's transport sends it."""
        auth = f"Proxy-Authorization: {self.authorization}\r\n" if self.authorization else ""
        return (f"CONNECT {host_port} HTTP/1.1\r\nHost: {host_port}\r\n{auth}"
                f"{self.connect_lines}\r\n").encode()


def parse_egress(text: str, connect_header: Mapping[str, Sequence[str]] | None = None,
                 *, source: str = "the proxy URL") -> Egress:
    """The proxy ``text`` names, read as Go's ``httpproxy`` reads it (no scheme: http://;
    ``https://`` and ``socks5://`` as Go's transport takes them), its ``CONNECT`` carrying
    ``connect_header`` too (each value a line of its own, in order, as Go writes a
    header's values); ``source``: where ``text`` is written. ``ValueError`` saying why,
    its password hidden."""
    text = text.strip()
    parts = urlsplit(text)
    if not parts.scheme or not parts.netloc:
        parts = urlsplit("http://" + text)
    shown = shown_url(parts.geturl())
    scheme = parts.scheme.lower()
    is_socks = scheme in SOCKS_SCHEMES
    tls = scheme == "https"
    if scheme != "http" and not (is_socks or tls):
        raise ValueError("only http://, https:// and socks5:// proxies are supported, got "
                         f"{shown!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(f"not a valid proxy URL: {shown!r}") from None
    if not host:
        raise ValueError(f"the proxy URL names no host: {shown!r}")
    literal = _ip(host) is not None
    try:
        host = host if literal else _idna(host)
    except UnicodeError:
        raise ValueError(f"the proxy URL's host is not a valid name: {shown!r}") from None
    lines = "".join(f"{name}: {value}\r\n" for name, values in (connect_header or {}).items()
                    for value in values)
    user = None if parts.username is None else unquote(parts.username)
    password = unquote(parts.password or "")
    if is_socks:  # no CONNECT, so no connect_header (config.py refuses it there)
        return Egress(host, port or 1080, literal, "", shown, socks=True,
                      socks_login=b"" if user is None else _socks_login(user, password, shown),
                      source=source)
    authorization = ""
    if user is not None:
        pair = f"{user}:{password}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Egress(host, port or (443 if tls else 80), literal, authorization, shown, lines,
                  tls=tls, source=source)


#: the schemes of a SOCKS5 proxy, as Go's transport takes them (both send the upstream's
#: name to the proxy unresolved)
SOCKS_SCHEMES = ("socks5", "socks5h")


def _socks_login(user: str, password: str, shown: str) -> bytes:
    """RFC 1929's username/password request; ``ValueError`` where Go's SOCKS dialer
    refuses the pair (a user of 1 to 255 bytes, a password of at most 255)."""
    u, p = user.encode(), password.encode()
    if not 0 < len(u) <= 255 or len(p) > 255:
        raise ValueError(f"a SOCKS5 proxy's user must be 1 to 255 bytes and its password "
                         f"at most 255: {shown!r}")
    return bytes([1, len(u)]) + u + bytes([len(p)]) + p


#: the variables that name the proxy for each scheme, upper case first, as Go's
#: ``httpproxy.FromEnvironment`` reads them
PROXY_VARIABLES = {"http": ("HTTP_PROXY", "http_proxy"), "https": ("HTTPS_PROXY", "https_proxy")}
NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy")


def _variable(env: Mapping[str, str], names: Sequence[str]) -> str:
    """The first of ``names`` set (not empty) in ``env``, or ""."""
    return next((n for n in names if env.get(n)), "")


@dataclass(frozen=True, slots=True)
class EnvironmentRoute:
    """A proxy the environment names, and the variable that named it (for messages)."""

    egress: Egress
    variable: str


def environment_route(scheme: str, host: str, port: int,
                      environ: Mapping[str, str] | None = None) -> EnvironmentRoute | None:
    """The proxy the environment names for ``scheme://host:port``, as Go's
    ``http.ProxyFromEnvironment`` chooses it (client-go's, for an API server whose
    kubeconfig has no ``proxy-url``); None when none is set, or ``NO_PROXY`` (CIDR ranges
    included), ``localhost`` or a loopback address has it reached directly.
    ``ValueError`` naming the variable when the one that applies names no proxy that
    can be spoken to."""
    env = os.environ if environ is None else environ
    name = _variable(env, PROXY_VARIABLES.get(scheme, ()))
    if not name:
        return None
    if NoProxy(env.get(_variable(env, NO_PROXY_VARIABLES), "")).direct(host, port):
        return None
    try:
        return EnvironmentRoute(parse_egress(env[name], source=name), name)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _ip(host: str) -> _IP | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _idna(name: str) -> str:
    """``name`` as DNS looks it up (IDNA, ASCII); ``UnicodeError`` when it is no name."""
    return name.encode("idna").decode("ascii")


@dataclass(frozen=True, slots=True)
class _Domain:
    #: starts with "."
    suffix: str
    #: the name itself matches too (written without the leading ".")
    itself: bool
    port: int | None


@dataclass(frozen=True, slots=True)
class _Address:
    ip: _IP
    port: int | None


class NoProxy:
    """The hosts reached directly, from a ``NO_PROXY`` text, with Go's ``httpproxy`` rules
    (an entry it cannot read is skipped, as Go skips it)."""

    def __init__(self, text: str) -> None:
        self.everything = False
        self._networks: list[_NET] = []
        self._addresses: list[_Address] = []
        self._domains: list[_Domain] = []
        for entry in text.split(","):
            entry = entry.strip().lower()
            if not entry:
                continue
            if entry == "*":
                self.everything = True
                return
            if "/" in entry:
                with contextlib.suppress(ValueError):
                    self._networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            host, port = _split_host_port(entry)
            if not host:
                continue
            ip = _ip(host)
            if ip is not None:
                self._addresses.append(_Address(ip, port))
                continue
            if host.startswith("*."):
                host = host[1:]
            itself = not host.startswith(".")
            name = host.lstrip(".")
            with contextlib.suppress(UnicodeError):
                name = _idna(name)
            self._domains.append(_Domain("." + name, itself, port))

    def direct(self, host: str, port: int) -> bool:
        """Whether ``host``:``port`` is reached without the proxy (Go's ``useProxy``
        negated): ``localhost`` and loopback addresses always are."""
        host = host.strip().lower()
        if host == "localhost":
            return True
        ip = _ip(host)
        if ip is not None:
            if ip.is_loopback:
                return True
            if self.everything or any(ip in n for n in self._networks):
                return True
            return any(a.ip == ip and a.port in (None, port) for a in self._addresses)
        if self.everything:
            return True
        return any((host.endswith(d.suffix) or (d.itself and host == d.suffix[1:]))
                   and d.port in (None, port) for d in self._domains)


def _split_host_port(entry: str) -> tuple[str, int | None]:
    """``host:port``, ``[v6]:port``, or a host alone (an IPv6 address without brackets
    too); a port that is not a number leaves the entry a host, as Go's split fails."""
    if entry.startswith("["):
        end = entry.find("]")
        if end < 0:
            return entry, None
        rest = entry[end + 1:]
        if rest.startswith(":") and rest[1:].isdigit():
            return entry[1:end], int(rest[1:])
        return (entry[1:end], None) if not rest else (entry, None)
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None


class EgressRoutes:
    """Which proxy each upstream URL is reached through, or none."""

    def __init__(self, http: Egress | None, https: Egress | None,
                 no_proxy: NoProxy | None) -> None:
        self.http = http
        self.https = https
        #: None: every request through the proxy (``proxy_url`` without ``no_proxy``:
        #: Go's ``http.ProxyURL``, loopback too); else Go's rules
        self.no_proxy = no_proxy
        self._routes: dict[tuple[str, str, int], Egress | None] = {}

    @classmethod
    def from_settings(cls, proxy_url: str, no_proxy: str, from_environment: bool,
                      environ: Mapping[str, str] | None = None, *,
                      connect_header: Mapping[str, Sequence[str]] | None = None
                      ) -> EgressRoutes | None:
        """The routes the settings ask for (None: no proxy at all), every proxy's
        ``CONNECT`` carrying ``connect_header``. ``ValueError`` naming the setting or the
        variable that is wrong."""
        if from_environment:
            env = os.environ if environ is None else environ
            found: dict[str, Egress | None] = {}
            for scheme, names in PROXY_VARIABLES.items():
                name = _variable(env, names)
                try:
                    found[scheme] = (parse_egress(env[name], connect_header, source=name)
                                     if name else None)
                except ValueError as e:
                    raise ValueError(f"upstream.proxy_from_environment: {name}: {e}") from None
            if found["http"] is None and found["https"] is None:
                return None
            text = env.get(_variable(env, NO_PROXY_VARIABLES), "")
            return cls(found["http"], found["https"], NoProxy(text))
        if not proxy_url:
            return None
        try:
            egress = parse_egress(proxy_url, connect_header, source="upstream.proxy_url")
        except ValueError as e:
            raise ValueError(f"upstream.proxy_url: {e}") from None
        return cls(egress, egress, NoProxy(no_proxy) if no_proxy.strip() else None)

    def proxy_for(self, scheme: str, host: str, port: int) -> Egress | None:
        """The proxy a request to ``scheme://host:port`` goes through, or None."""
        key = (scheme, host, port)
        routes = self._routes
        try:
            return routes[key]
        except KeyError:
            pass
        egress = self.https if scheme == "https" else self.http
        if egress is not None and self.no_proxy is not None and \
                self.no_proxy.direct(host, port):
            egress = None
        if len(routes) >= MAX_ROUTES:
            routes.clear()
        routes[key] = egress
        return egress

    def describe(self) -> str:
        """What the start-up line says of them (passwords hidden)."""
        if self.http is not None and self.http == self.https:
            out = self.http.shown
        else:
            out = ", ".join(f"{s}: {e.shown}" for s, e in (("http", self.http),
                                                          ("https", self.https)) if e)
        connect = self.https.connect_lines if self.https is not None else ""
        names = dict.fromkeys(line.partition(":")[0] for line in connect.splitlines())
        return out + ("" if self.no_proxy is None else
                      "; directly to NO_PROXY's hosts, localhost and loopback") + (
            f"; CONNECT with {', '.join(names)}" if names else "")
