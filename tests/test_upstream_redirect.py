"""An upstream that redirects: the rule (``proxy.upstream_redirect``, Go's client and
Prometheus' ``follow_redirects``), then the forwarding client against real HTTP receivers
on loopback, a redirecting front before them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from multidict import CIMultiDict
from yarl import URL

from proxy.compression import compress
from proxy.config import OAuth2Settings
from proxy.upstream import Upstream
from proxy.upstream_redirect import (
    MAX_REQUESTS,
    Chain,
    Hop,
    RedirectRefused,
    resolve,
    same_site,
)
from proxy.wire.primitives import Protocol
from tests.oauth2_endpoint import TokenEndpoint
from tests.scripted import (
    Received,
    Reply,
    ScriptedUpstream,
    redirect_to,
    rw2_receiver,
    size_limit,
)
from tests.test_upstream import COUNTS, many_v1, opened, series_of, v1_body, v2_body
from tests.tls_certs import Authority

FIRST = URL("http://tsdb.example.com:8080/api/v1/write?x=1")

# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(("location", "target"), [
    ("https://tsdb.example.com/api/v1/write", "https://tsdb.example.com/api/v1/write"),
    ("/other", "http://tsdb.example.com:8080/other"),
    ("other", "http://tsdb.example.com:8080/api/v1/other"),
    ("//mimir:9009/api/v1/push", "http://mimir:9009/api/v1/push"),
    ("?y=2", "http://tsdb.example.com:8080/api/v1/write?y=2"),
    # a fragment is never sent, a userinfo never taken for credentials
    ("http://u:p@vm:8428/api/v1/write#f", "http://vm:8428/api/v1/write"),
    ("HTTP://VM.Example/api/v1/write", "http://vm.example/api/v1/write"),
    # a byte that is not UTF-8 (kept by the client as a surrogate) goes percent-encoded, as
    # Go's; yarl dropped it, and the request went to another path
    ("/a\udce9b", "http://tsdb.example.com:8080/a%E9b"),
])
def test_a_location_resolves_against_the_request_it_answers(location: str, target: str
                                                            ) -> None:
    assert str(resolve(FIRST, location)) == target


@pytest.mark.parametrize(("location", "result", "said"), [
    (None, "no_location", "no Location header"),
    ("  ", "no_location", "no Location header"),
    ("ftp://files/x", "bad_location", "is not http:// or https://"),
    ("mailto:ops@example.com", "bad_location", "is not http:// or https://"),
    ("http:/x", "bad_location", "does not parse"),
    ("http://h:99999/", "bad_location", "does not parse"),
    ("http://[::1/", "bad_location", "does not parse"),
    ("/a\tb", "bad_location", "control character"),
])
def test_a_location_that_cannot_be_followed_says_why(location: str | None, result: str,
                                                     said: str) -> None:
    with pytest.raises(RedirectRefused) as caught:
        resolve(FIRST, location)
    assert caught.value.result == result and said in caught.value.why


@pytest.mark.parametrize(("location", "absolute"), [
    ("//tsdb\udce9.example/w", False),
    ("http://tsdb\udce9.example/w", True),
])
def test_a_location_with_a_byte_not_utf8_in_its_host_is_taken_as_resolved(
        location: str, absolute: bool) -> None:
    """The chain read such a Location again unsanitized (for Go's ``IsAbs``): a
    UnicodeError out of ``follow``, the sender's 502 said as a proxy bug at error level
    and no redirect counted."""
    chain = Chain([FIRST])
    assert chain.follow(location) == resolve(FIRST, location)
    assert chain.absolute is absolute


def test_the_hop_a_log_line_says_shows_no_credentials() -> None:
    """Both the writes' and the token requests' lines read the last redirect here."""
    chain = Chain([URL("http://u:pw@tsdb.example.com/w?api_key=k1")])
    chain.follow("https://tsdb.example.com/w?token=t2")
    hop = chain.hop()
    assert hop == Hop("http://tsdb.example.com/w?api_key=(hidden)",
                      "https://tsdb.example.com/w?token=(hidden)")
    assert str(hop) == f"{hop.came} -> {hop.went}"
    assert not {"pw", "k1", "t2"} & set(str(hop).replace("/", " ").replace("=", " ").split())


def test_a_loop_ends_at_once_and_a_chain_at_go_s_tenth_redirect() -> None:
    loop = Chain([FIRST])
    loop.follow("https://tsdb.example.com/w")
    with pytest.raises(RedirectRefused) as caught:
        loop.follow("http://tsdb.example.com:8080/api/v1/write?x=1#again")
    assert caught.value.result == "loop"
    chain = Chain([FIRST])
    for n in range(1, MAX_REQUESTS):  # 9 followed: 10 requests, as Go's client makes
        chain.follow(f"/hop/{n}")
    assert len(chain.urls) == MAX_REQUESTS == 10
    with pytest.raises(RedirectRefused) as caught:
        chain.follow("/hop/10")
    assert caught.value.result == "too_many" and "stopped after 10 redirects" in caught.value.why


@pytest.mark.parametrize(("dest", "same"), [
    ("https://tsdb.example.com/w", True),  # another scheme and port: the same host
    ("http://eu.tsdb.example.com/w", True),  # a subdomain
    ("http://TSDB.Example.COM/w", True),
    ("http://badtsdb.example.com/w", False),  # a suffix, not a subdomain
    ("http://example.com/w", False),  # the parent is another site
    ("http://10.0.0.1/w", False),
])
def test_the_site_the_sensitive_headers_may_go_to(dest: str, same: bool) -> None:
    assert same_site(FIRST, URL(dest)) is same
    assert same_site(URL("http://[::1]:1/"), URL("http://[::1]:2/"))
    assert not same_site(URL("http://[::1]/"), URL("http://[fe80::1%25eth0]/"))


def test_a_senders_sensitive_headers_stop_at_another_site_for_the_rest_of_the_chain() -> None:
    """Go 1.24's rule: from the first hop that is neither the first URL's host nor a
    subdomain of it, for good (back on the first host too: CVE-2024-45336). Only the
    names the sender's request brought: the proxy's own go on every request."""
    first = CIMultiDict([("Authorization", "Bearer sender"), ("Cookie", "a=b"),
                         ("X-Scope-OrgID", "team-a"), ("X-Api-Key", "own"),
                         ("Content-Type", "application/x-protobuf")])
    brought = {"authorization", "cookie", "x-scope-orgid"}
    chain = Chain([FIRST])
    chain.follow("https://eu.tsdb.example.com/api/v1/write")
    kept = chain.headers(first, brought)
    assert kept["Authorization"] == "Bearer sender" and kept["Cookie"] == "a=b"
    chain.follow("https://vm.other.net/api/v1/write")
    chain.follow("https://tsdb.example.com/api/v1/write")
    left = chain.headers(first, brought)
    assert "Authorization" not in left and "Cookie" not in left
    assert left["X-Scope-OrgID"] == "team-a" and left["X-Api-Key"] == "own"
    assert left["Content-Type"] == "application/x-protobuf"
    # the proxy's own Authorization (not among the names a sender brought) goes on
    assert Chain([FIRST], left_site=True).headers(first, {"cookie"})["Authorization"]


def test_referer_and_host_as_go_sets_them() -> None:
    first = CIMultiDict([("Host", "vhost.example"), ("X-Scope-OrgID", "t")])
    chain = Chain([URL("https://tsdb.example.com/api/v1/write")])
    chain.follow("/v2/write")  # relative: the request's own Host goes on (Go issue 22233)
    hop = chain.headers(first, ())
    assert hop["Host"] == "vhost.example"
    assert hop["Referer"] == "https://tsdb.example.com/api/v1/write"
    chain.follow("http://tsdb.example.com/v3/write")  # absolute, and https -> http
    hop = chain.headers(first, ())
    assert "Host" not in hop and "Referer" not in hop
    explicit = CIMultiDict([("Referer", "set-by-the-request")])
    assert chain.headers(explicit, ())["Referer"] == "set-by-the-request"


# -- the forwarding client -----------------------------------------------------------------


def redirects(u: Upstream, result: str) -> float | None:
    assert u.metrics is not None
    return u.metrics.registry.get_sample_value("karta_proxy_upstream_redirects_total",
                                               {"result": result})


def responses(u: Upstream) -> dict[str, float]:
    assert u.metrics is not None
    return {s.labels["code"]: s.value
            for m in u.metrics.registry.collect() if m.name == "karta_proxy_upstream_responses"
            for s in m.samples if s.value}


async def test_a_308_is_followed_with_the_same_body_and_headers(
        caplog: pytest.LogCaptureFixture) -> None:
    """The answer at the end of the chain is the sender's; the request went again as it
    went first (Go keeps the method and the body of a 307 / 308), one request counted in
    upstream_responses_total (its last answer), the redirect in its own counter, and a
    warning per (from, to) naming both."""
    sender = {"X-Scope-OrgID": "team-a", "Authorization": "Bearer sender",
              "User-Agent": "Prometheus/2.42.0"}
    caplog.set_level(logging.WARNING, logger="karta.upstream")
    async with (ScriptedUpstream(rule=rw2_receiver) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front,
                opened(front.url, headers={"X-Extra": "1"}) as u):
        answers = [await u.send(v2_body(), Protocol.V2, incoming_headers=sender,
                                counts=COUNTS) for _ in range(3)]
    assert [a.status for a in answers] == [204] * 3, answers[0].body
    assert answers[0].headers["X-Prometheus-Remote-Write-Samples-Written"] == "2"
    assert len(front.received) == len(receiver.received) == 3
    for came, went in zip(front.received, receiver.received, strict=True):
        assert went.body == came.body and went.raw == v2_body()
        for name in ("Content-Type", "Content-Encoding", "X-Prometheus-Remote-Write-Version",
                     "X-Scope-OrgID", "Authorization", "User-Agent", "X-Extra"):
            assert went.headers[name] == came.headers[name], name
        assert went.headers["Referer"] == front.url
    assert redirects(u, "followed") == 3
    assert responses(u) == {"204": 3.0}  # one request each, its last answer
    line, summary = [r for r in caplog.records if "was followed" in r.getMessage()]
    assert (line.__dict__["from"], line.__dict__["to"]) == (front.url, receiver.url)
    # the same (from, to) again: in one summary (written at the close), not a line each
    assert summary.getMessage().endswith("(repeated)") and summary.__dict__["count"] == 2


async def test_a_307_to_another_site_drops_the_senders_credentials_not_the_proxys(
        tmp_path: Path) -> None:
    """127.0.0.1 -> localhost is another site by Go's rule: the sender's Authorization and
    Cookie (forwarded) stop there, the proxy's own bearer token and upstream.headers go,
    as Prometheus' RoundTrippers set them on every request."""
    token = tmp_path / "token"
    token.write_text("own-token\n")
    sender = {"Authorization": "Bearer sender", "Cookie": "session=s", "X-Scope-OrgID": "t"}
    async with (ScriptedUpstream() as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url, 307, host="localhost")) as front):
        async with opened(front.url, forward_headers=["Cookie", "X-Scope-OrgID"],
                          headers={"X-Api-Key": "k"}) as u:
            assert (await u.send(v1_body(), Protocol.V1, incoming_headers=sender)).ok
        async with opened(front.url, bearer_token_file=str(token),
                          forward_headers=["Authorization", "Cookie"]) as u:
            assert (await u.send(v1_body(), Protocol.V1, incoming_headers=sender)).ok
    first, second = receiver.received
    assert first.headers["X-Scope-OrgID"] == "t" and first.headers["X-Api-Key"] == "k"
    assert "Cookie" not in first.headers and "Cookie" in front.received[0].headers
    assert second.headers["Authorization"] == "Bearer own-token"
    assert "Cookie" not in second.headers


async def test_the_oauth2_token_goes_through_a_redirect_to_another_site(
        tmp_path: Path) -> None:
    """The proxy's OAuth 2.0 token is its own credential, as Prometheus' oauth2
    RoundTripper sets it on every request: not dropped where a sender's is."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    async with (TokenEndpoint() as idp, ScriptedUpstream() as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url, 307, host="localhost")) as front,
                opened(front.url, forward_headers=["Authorization"], oauth2=OAuth2Settings(
                    client_id="karta", client_secret_file=str(secret), token_url=idp.url)) as u):
        answer = await u.send(v1_body(), Protocol.V1,
                              incoming_headers={"Authorization": "Bearer sender"})
    assert answer.ok, answer.body
    (went,) = receiver.received
    assert idp.live(went.headers["Authorization"])
    assert went.headers["Authorization"] == front.received[0].headers["Authorization"]


async def test_a_refusal_where_the_senders_credentials_were_left_out_is_no_4xx() -> None:
    """A 401 at the end of a redirect to another site, the sender's Authorization left out
    there, is the chain's doing: a 503 the sender retries (a 4xx drops its batch), saying
    so. On the same site the credentials went, and the 401 is the sender's, as ever."""
    sender = {"Authorization": "Bearer sender"}
    async with ScriptedUpstream(Reply(401, body=b"unauthorized")) as receiver:
        for host, status in (("localhost", 503), ("127.0.0.1", 401)):
            async with (ScriptedUpstream(rule=redirect_to(receiver.url, 307, host)) as front,
                        opened(front.url) as u):
                answer = await u.send(v1_body(), Protocol.V1, incoming_headers=sender)
            said = answer.body.decode()
            assert answer.status == status, said
            assert u.metrics is not None
            refused = u.metrics.registry.get_sample_value(
                "karta_proxy_upstream_misconfigured_total",
                {"url": front.url, "reason": "credentials_refused", "code": "401"})
            if status == 503:
                assert answer.headers["Retry-After"] == "30" and refused == 1
                assert "the sender's credentials are not sent there" in said
                assert f"(redirected to {receiver.url.replace('127.0.0.1', host)})" in said
            else:
                assert refused is None and said == "unauthorized"
    first, second = receiver.received
    assert "Authorization" not in first.headers
    assert second.headers["Authorization"] == "Bearer sender"


async def test_the_proxys_own_writes_carry_their_headers_through_any_redirect() -> None:
    """facts.headers are the proxy's settings: on every request, whatever the site."""
    async with (ScriptedUpstream() as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url, host="localhost")) as front,
                opened(front.url) as u):
        await u.send_v1(v1_body(), {"Authorization": "Bearer facts", "X-Scope-OrgID": "ops"})
    [rec] = receiver.received
    assert rec.headers["Authorization"] == "Bearer facts" and rec.headers["X-Scope-OrgID"] == "ops"


@pytest.mark.parametrize(("status", "settings", "why"), [
    (301, {}, "a 301 makes a client's POST a GET without its body"),
    (302, {}, "a 302 makes"),
    (303, {}, "a 303 makes"),
    (308, {"follow_redirects": False}, "upstream.follow_redirects is off"),
    (307, {"follow_redirects": False}, "upstream.follow_redirects is off"),
])
async def test_a_redirect_not_followed_stays_a_misconfiguration_naming_the_location(
        caplog: pytest.LogCaptureFixture, status: int, settings: dict[str, object],
        why: str) -> None:
    caplog.set_level(logging.ERROR, logger="karta.upstream")
    async with (ScriptedUpstream() as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url, status)) as front,
                opened(front.url, **settings) as u):
        answer = await u.send(v1_body(), Protocol.V1)
    assert (answer.status, answer.headers.get("Retry-After")) == (503, "30"), answer.body
    said = answer.body.decode()
    assert f"answered {status}: it redirects to {receiver.url}, which is not followed" in said
    assert why in said and "set upstream.url to it" in said
    assert not receiver.received
    assert redirects(u, "not_followed") == 1 and redirects(u, "followed") == 0
    assert u.metrics is not None
    assert u.metrics.registry.get_sample_value(
        "karta_proxy_upstream_misconfigured_total",
        {"url": front.url, "reason": "not_write_endpoint", "code": str(status)}) == 1
    [line] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert line.__dict__["location"] == receiver.url


def _hops(base: str) -> Callable[[Received], Reply]:
    """A front redirecting each request one step further, for ever."""
    def rule(rec: Received) -> Reply:
        n = int(rec.path.rsplit("/", 1)[1]) if rec.path.startswith("/hop/") else 0
        return Reply(308, {"Location": f"{base}/hop/{n + 1}"})
    return rule


@pytest.mark.parametrize(("reply", "result", "said"), [
    (Reply(308), "no_location", "no Location header"),
    (Reply(307, {"Location": "ftp://files.example/w"}), "bad_location",
     "is not http:// or https://"),
    (Reply(308, {"Location": "http://h:99999/w"}), "bad_location", "does not parse"),
    (Reply(308, {"Location": "/api/v1/write"}), "loop", "a redirect loop"),
    (None, "too_many", "stopped after 10 redirects"),
])
async def test_a_redirect_that_cannot_be_followed_is_a_502_the_sender_retries(
        caplog: pytest.LogCaptureFixture, reply: Reply | None, result: str, said: str
) -> None:
    """Never a 2xx guessed, never a 4xx a sender drops: every answer was a redirect,
    nothing is stored, and the sender sends the batch again."""
    caplog.set_level(logging.WARNING, logger="karta.upstream")
    front = ScriptedUpstream(*([reply] if reply else []))
    async with front:
        if reply is None:
            front.rule = _hops(f"http://127.0.0.1:{front.port}")
        async with opened(front.url) as u:
            answer = await u.send(v1_body(), Protocol.V1)
    assert answer.status == 502 and answer.upstream == "redirect", answer.body
    assert said in answer.body.decode()
    assert redirects(u, result) == 1
    assert len(front.received) == (MAX_REQUESTS if result == "too_many"
                                   else 1)  # a loop to itself: seen at once
    assert responses(u) == {str((reply or Reply(308)).status): 1.0}
    [line] = [r for r in caplog.records if "redirect not followed" in r.getMessage()]
    assert line.__dict__["reason"] == result


@pytest.mark.parametrize(("reply", "outcome", "said"), [
    (Reply(308), "unavailable", "no Location header"),  # a 502: checked again
    (Reply(301, {"Location": "/api/v2/write"}), "not_write_endpoint",
     "it redirects to http://127.0.0.1:"),
])
async def test_the_check_says_what_a_redirect_it_does_not_follow_is(
        reply: Reply, outcome: str, said: str) -> None:
    async with ScriptedUpstream(reply) as front, opened(front.url) as u:
        probe = await u.check()
    assert probe.outcome == outcome and said in probe.detail, probe


async def test_the_split_of_a_413_goes_through_the_redirect_part_by_part() -> None:
    raw = many_v1(64)
    limit = len(compress(raw, "snappy")) * 6 // 10
    async with (ScriptedUpstream(rule=size_limit(limit)) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front,
                opened(front.url) as u):
        answer = await u.send(raw, Protocol.V1)
    assert answer.status == 204, answer.body
    assert len(front.received) == len(receiver.received) == 3
    parts = [r.raw for r in receiver.received[1:]]
    assert [s for p in parts for s in series_of(p, Protocol.V1)] == series_of(raw, Protocol.V1)
    assert redirects(u, "followed") == 3


@pytest.mark.parametrize(("reply", "status", "retry_after"), [
    (Reply(429, {"Retry-After": "7"}), 503, "7"),
    (Reply(503, {"Retry-After": "9"}), 503, "9"),
    (Reply(400, body=b"out of bounds"), 400, None),
])
async def test_the_last_answer_maps_as_any_answer(reply: Reply, status: int,
                                                  retry_after: str | None) -> None:
    async with (ScriptedUpstream(reply) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front,
                opened(front.url) as u):
        answer = await u.send(v1_body(), Protocol.V1)
    assert (answer.status, answer.headers.get("Retry-After")) == (status, retry_after)
    assert answer.upstream == str(reply.status)


async def test_a_tenants_request_and_the_check_go_through_the_redirect() -> None:
    async with (ScriptedUpstream(rule=rw2_receiver, record_empty=True) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front,
                opened(front.url.replace("/api/v1/write", "/insert/{tenant}/api/v1/write"),
                       default_tenant="0") as u):
        assert (await u.check()).outcome == "rw2"
        out = u.prepare(v1_body(), Protocol.V1, "snappy")
        assert (await u.forward(out, {}, tenant="7", query="extra_label=env=prod")).ok
    check, write = receiver.received
    assert check.path == "/insert/0/api/v1/write"
    assert (write.path, write.query) == ("/insert/7/api/v1/write", "extra_label=env=prod")


async def test_a_redirect_to_https_takes_the_upstreams_tls_settings(tmp_path: Path) -> None:
    """ingress-nginx's force-ssl-redirect: http:// upstream.url, a 308 to https://, the
    certificate verified with upstream.tls_ca_file (Prometheus' one transport's
    tls_config, for every host)."""
    ca = Authority(tmp_path / "pki")
    tls = ca.issue("tsdb", server=True).server_context()
    async with (ScriptedUpstream(ssl_context=tls) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front):
        async with opened(front.url, tls_ca_file=str(ca.ca_file)) as u:
            assert (await u.send(v1_body(), Protocol.V1)).status == 204
        async with opened(front.url) as u:  # the system's CAs: refused, no answer
            refused = await u.send(v1_body(), Protocol.V1)
    assert refused.status == 502 and refused.upstream == "connect_error", refused.body
    assert receiver.url.startswith("https://") and len(receiver.received) == 1


async def test_each_request_of_a_chain_takes_its_own_route(tmp_path: Path) -> None:
    """The HTTP proxy route is the target's (EgressRoutes.via): loopback is reached
    directly once no_proxy is set, the redirect's other host through the proxy (here a
    port nothing listens on: the 502 says so)."""
    dead = ScriptedUpstream()
    async with dead:
        proxy_url = f"http://127.0.0.1:{dead.port}"
    front = ScriptedUpstream(Reply(308, {"Location": "http://tsdb.karta.test:9/api/v1/write"}))
    async with front, opened(front.url, proxy_url=proxy_url, no_proxy="other.test") as u:
        answer = await u.send(v1_body(), Protocol.V1)
    assert len(front.received) == 1
    assert answer.status == 502 and "through the HTTP proxy" in answer.body.decode(), answer.body


async def test_a_chain_ends_within_the_requests_deadline() -> None:
    import asyncio

    gate = asyncio.Event()
    async with (ScriptedUpstream(Reply(204, gate=gate)) as receiver,
                ScriptedUpstream(rule=redirect_to(receiver.url)) as front,
                opened(front.url, timeout_seconds=0.5) as u):
        answer = await u.forward(u.prepare(v1_body(), Protocol.V1, "snappy"))
        gate.set()
    assert answer.status == 504 and b"did not take the request within 0.5 s" in answer.body


async def test_a_2xx_makes_no_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path of every stored request is as it was: no redirect work on a 2xx."""
    async def never(*args: object) -> None:
        raise AssertionError("followed a 2xx")

    monkeypatch.setattr(Upstream, "_follow", never)
    async with ScriptedUpstream() as up, opened(up.url) as u:
        assert (await u.send(v1_body(), Protocol.V1)).status == 204
