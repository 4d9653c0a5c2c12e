"""``proxy.egress_proxy``: the proxy URL read as Go's ``httpproxy`` reads it, NO_PROXY's
rules as Go applies them (cases of golang.org/x/net/http/httpproxy's own tests), and which
settings or environment give which route. The requests through a real HTTP proxy are in
``tests/peers/test_e2e_egress_proxy.py``."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from proxy.config import ConfigError, Settings, load_settings, validate
from proxy.demo_exporter import DEMO_SNAPSHOT
from proxy.egress_proxy import Egress, EgressRoutes, NoProxy, environment_route, parse_egress


def test_a_proxy_url_is_read_as_go_reads_it() -> None:
    e = parse_egress("http://user:p%40ss@proxy.corp:3128")
    assert (e.host, e.port, e.literal) == ("proxy.corp", 3128, False)
    assert e.authorization == "Basic " + base64.b64encode(b"user:p@ss").decode()
    assert "p%40ss" not in e.shown and "p@ss" not in e.shown
    # no scheme: http://; no port: 80; an address is not looked up
    assert parse_egress("10.0.0.1") == Egress("10.0.0.1", 80, True, "", "http://10.0.0.1")
    assert parse_egress("[::1]:8080").host == "::1"
    assert parse_egress("proxy:3128").port == 3128


@pytest.mark.parametrize("text", ["ftp://proxy:3128", "socks4://proxy:1080",
                                  "http://:3128", "http://proxy:99999",
                                  "https://user:hunter2@proxy:99999",
                                  "socks5://user:hunter2@:1080"])
def test_what_is_no_proxy_is_refused_without_its_password(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_egress(text)
    assert "hunter2" not in str(e.value)


def test_a_socks5_proxy_url_is_read_as_go_reads_it() -> None:
    """socks5:// and socks5h:// alike (Go's transport: the name sent to the proxy either
    way), port 1080 unless given, a user:password@ as RFC 1929's request, hidden."""
    e = parse_egress("socks5://user:p%40ss@proxy.corp")
    assert (e.host, e.port, e.socks, e.kind) == ("proxy.corp", 1080, True, "SOCKS5 proxy")
    assert e.socks_login == b"\x01\x04user\x04p@ss" and e.authorization == ""
    assert "p%40ss" not in e.shown and "p@ss" not in e.shown and "p@ss" not in repr(e)
    h = parse_egress("SOCKS5H://[::1]:9050")
    assert (h.host, h.port, h.literal, h.socks_login) == ("::1", 9050, True, b"")
    # an empty password is a password (Go's dialer sends it); the user is not optional
    assert parse_egress("socks5://u@p").socks_login == b"\x01\x01u\x00"
    routes = EgressRoutes.from_settings("socks5://proxy", "", False)
    assert routes is not None and routes.proxy_for("https", "tsdb", 443) == routes.https
    assert routes.describe() == "socks5://proxy"


@pytest.mark.parametrize(("no_proxy", "host", "port", "direct"), [
    # localhost and loopback: always direct once the rules apply
    ("", "localhost", 80, True), ("", "127.0.0.1", 9090, True), ("", "::1", 80, True),
    ("", "example.com", 80, False),
    # a domain: itself and its subdomains, not a name that merely ends the same
    ("foo.com", "foo.com", 80, True), ("foo.com", "bar.foo.com", 443, True),
    ("foo.com", "foofoo.com", 80, False),
    # .domain and *.domain: the subdomains only
    (".foo.com", "foo.com", 80, False), (".foo.com", "x.foo.com", 80, True),
    ("*.foo.com", "x.foo.com", 80, True), ("*.foo.com", "foo.com", 80, False),
    # a port: that port only
    ("foo.com:8080", "foo.com", 8080, True), ("foo.com:8080", "foo.com", 80, False),
    # addresses and ranges; a name never matches an address's entry
    ("10.0.0.0/8", "10.1.2.3", 80, True), ("10.0.0.0/8", "11.0.0.1", 80, False),
    ("192.168.1.1", "192.168.1.1", 443, True), ("192.168.1.1:80", "192.168.1.1", 443, False),
    ("[2001:db8::1]:80", "2001:db8::1", 80, True), ("2001:db8::/32", "2001:db8::5", 1, True),
    # everything; case and spaces; an entry Go cannot read is skipped
    ("*", "anything.example", 80, True), (" FOO.com , bar.com", "x.foo.com", 80, True),
    ("10.0.0.0/99, foo.com", "foo.com", 80, True),
])
def test_no_proxy_follows_gos_rules(no_proxy: str, host: str, port: int, direct: bool) -> None:
    assert NoProxy(no_proxy).direct(host, port) is direct


def test_proxy_url_alone_takes_every_request_through_it_loopback_too() -> None:
    """prometheus/common's ``http.ProxyURL`` without no_proxy: no exception at all."""
    routes = EgressRoutes.from_settings("http://proxy:3128", "", False)
    assert routes is not None
    assert routes.proxy_for("http", "127.0.0.1", 9090) == routes.http
    assert routes.proxy_for("https", "localhost", 443) == routes.https
    routes = EgressRoutes.from_settings("http://proxy:3128", "mimir.internal", False)
    assert routes is not None
    assert routes.proxy_for("http", "127.0.0.1", 9090) is None
    assert routes.proxy_for("https", "mimir.internal", 443) is None
    assert routes.proxy_for("https", "prod.grafana.net", 443) == routes.https
    assert EgressRoutes.from_settings("", "", False) is None


def test_the_environment_names_a_proxy_per_scheme() -> None:
    env = {"HTTPS_PROXY": "http://secure:3128", "https_proxy": "http://ignored:1",
           "http_proxy": "plain:3128", "no_proxy": ".internal"}
    routes = EgressRoutes.from_settings("", "", True, env)
    assert routes is not None
    assert routes.proxy_for("https", "tsdb.example", 443) == parse_egress("http://secure:3128")
    assert routes.proxy_for("http", "tsdb.example", 80) == parse_egress("http://plain:3128")
    assert routes.proxy_for("http", "mimir.internal", 80) is None
    assert routes.proxy_for("http", "localhost", 80) is None
    assert EgressRoutes.from_settings("", "", True, {"NO_PROXY": "*"}) is None
    only_https = EgressRoutes.from_settings("", "", True, {"HTTPS_PROXY": "p:1"})
    assert only_https is not None and only_https.proxy_for("http", "tsdb", 80) is None
    with pytest.raises(ValueError, match="HTTPS_PROXY"):
        EgressRoutes.from_settings("", "", True, {"HTTPS_PROXY": "socks4://p:1"})


def test_the_routes_kept_are_bounded() -> None:
    routes = EgressRoutes.from_settings("http://proxy:3128", "internal", False)
    assert routes is not None
    for i in range(3000):
        routes.proxy_for("https", f"t{i}.example", 443)
    assert len(routes._routes) <= 1024


@pytest.mark.parametrize(("upstream", "error"), [
    ({"proxy_url": "http://p:1", "proxy_from_environment": True}, "set one or the other"),
    ({"no_proxy": "foo.com"}, "upstream.proxy_url is not"),
    ({"proxy_url": "socks4://user:hunter2@p:1"},
     "only http://, https:// and socks5:// proxies are supported"),
    ({"proxy_url": f"socks5://{'u' * 256}:hunter2@p"}, "user must be 1 to 255 bytes"),
    ({"proxy_url": "socks5://:hunter2@p"}, "user must be 1 to 255 bytes"),
    ({"proxy_url": "socks5://p", "proxy_connect_header": {"X-Auth": ["hunter2"]}},
     r"SOCKS5 proxy \(socks5://p\), which takes no headers"),
    ({"proxy_url": "http://p\t:1"}, "whitespace"),
    # proxy_connect_header: only beside a proxy, only where a CONNECT is sent, never a
    # header the CONNECT writes itself, never a value that is no one line
    ({"proxy_connect_header": {"X-Auth": ["hunter2"]}}, "upstream.proxy_url and"),
    ({"proxy_url": "http://p:1", "proxy_connect_header": {"Host": ["hunter2"]}},
     "proxy_connect_header.Host: never sent, the CONNECT writes its own"),
    ({"proxy_url": "http://p:1", "proxy_connect_header": {"X-Auth": []}}, "no value"),
    ({"proxy_url": "http://p:1", "proxy_connect_header": {"X-Auth": ["a", "hunter2\r\n"]}},
     r"X-Auth\[1\]: the value holds a control character"),
    ({"proxy_url": "http://p:1", "proxy_connect_header": {"X Auth": ["hunter2"]}},
     "not a header name"),
    ({"proxy_url": "http://p:1",
      "proxy_connect_header": {"x-auth": ["hunter2"], "X-Auth": ["hunter2"]}},
     "are one header"),
    ({"proxy_url": "http://u:hunter2@p:1",
      "proxy_connect_header": {"Proxy-Authorization": ["Bearer hunter2"]}}, "choose one"),
])
def test_settings_errors(upstream: dict[str, object], error: str) -> None:
    s = Settings()
    s.upstream.url = "https://tsdb:9090/api/v1/write" if "proxy_connect_header" in \
        upstream else "http://tsdb:9090/api/v1/write"
    s.snapshot = str(DEMO_SNAPSHOT)
    for k, v in upstream.items():
        setattr(s.upstream, k, v)
    with pytest.raises(ConfigError, match=error) as e:
        validate(s)
    assert "hunter2" not in str(e.value)
    for k in upstream:  # the same settings less these validate
        setattr(s.upstream, k, getattr(Settings().upstream, k))
    validate(s)


def test_proxy_connect_header_is_never_sent_to_an_http_upstream() -> None:
    """Go sends ProxyConnectHeader with a CONNECT alone, and an http:// upstream is
    never reached through one: set, it would silently go nowhere."""
    s = Settings()
    s.upstream.url = "http://tsdb:9090/api/v1/write"
    s.snapshot = str(DEMO_SNAPSHOT)
    s.upstream.proxy_url = "http://p:1"
    s.upstream.proxy_connect_header = {"X-Auth": ["hunter2"]}
    with pytest.raises(ConfigError, match="never sent: only an https:// upstream") as e:
        validate(s)
    assert "hunter2" not in str(e.value)


def test_proxy_connect_header_read_from_yaml(tmp_path: Path) -> None:
    """As Prometheus writes it (a name: a list of values), or one value without its
    list; a value of another type is named without being shown."""
    f = tmp_path / "c.yaml"
    f.write_text("upstream:\n  proxy_connect_header:\n    X-A: [one, two]\n    X-B: three\n")
    assert load_settings(f).upstream.proxy_connect_header == {"X-A": ["one", "two"],
                                                              "X-B": ["three"]}
    f.write_text("upstream:\n  proxy_connect_header:\n    X-A: [hunter2, {k: v}]\n")
    with pytest.raises(ConfigError, match=r"proxy_connect_header\.X-A: expected a list of "
                                          r"strings, got mapping \(not shown") as e:
        load_settings(f)
    assert "hunter2" not in str(e.value)


def test_a_user_agent_goes_with_the_connect_as_go_sends_it() -> None:
    """Go's Request.Write takes a ProxyConnectHeader User-Agent in place of its own (Host,
    Content-Length and Transfer-Encoding it drops: refused above)."""
    s = Settings()
    s.upstream.url = "https://tsdb:9090/api/v1/write"
    s.snapshot = str(DEMO_SNAPSHOT)
    s.upstream.proxy_url = "http://p:1"
    s.upstream.proxy_connect_header = {"User-Agent": ["egress-client/1"]}
    validate(s)


def test_the_start_up_line_names_the_connect_headers_never_their_values() -> None:
    routes = EgressRoutes.from_settings("http://proxy:3128", "", False,
                                        connect_header={"X-Auth": ["hunter2"]})
    assert routes is not None
    assert routes.describe() == "http://proxy:3128; CONNECT with X-Auth"
    assert routes.proxy_for("https", "tsdb", 443) is routes.https
    assert routes.https is not None and b"X-Auth: hunter2\r\n" in \
        routes.https.connect_request("tsdb:443")


def test_the_environments_route_for_one_url_is_gos_proxy_from_environment() -> None:
    env = {"HTTPS_PROXY": "http://u:p@corp:3128", "http_proxy": "socks4://s:1080",
           "NO_PROXY": "10.0.0.0/8,.internal"}
    route = environment_route("https", "api.example", 443, env)
    assert route is not None and route.variable == "HTTPS_PROXY"
    assert route.egress.url == "http://corp:3128" and route.egress.authorization
    for host in ("10.96.0.1", "k8s.internal", "127.0.0.1", "localhost", "::1"):
        assert environment_route("https", host, 443, env) is None, host
    # only the variable that applies is read: the other's SOCKS4 URL is an error of its own
    with pytest.raises(ValueError, match=r"^http_proxy: only http://, https:// and socks5"):
        environment_route("http", "api.example", 80, env)
    assert environment_route("https", "api.example", 443, {}) is None


def test_a_proxy_knows_where_it_is_written_for_the_message_of_its_login() -> None:
    """A login missing or refused is said with the place to fix it; where it is
    written is no part of the proxy's identity (the connection pool's key)."""
    routes = EgressRoutes.from_settings("socks5://u:p@proxy", "", False)
    assert routes is not None and routes.https is not None
    assert routes.https.source == "upstream.proxy_url"
    routes = EgressRoutes.from_settings("", "", True, {"https_proxy": "http://u:p@corp:3128"})
    assert routes is not None and routes.https is not None
    assert routes.https.source == "https_proxy"
    route = environment_route("https", "api.example", 443, {"HTTPS_PROXY": "corp:3128"})
    assert route is not None and route.egress.source == "HTTPS_PROXY"
    assert parse_egress("corp:3128").source == "the proxy URL"
    assert parse_egress("corp:3128", source="a") == parse_egress("corp:3128", source="b")
