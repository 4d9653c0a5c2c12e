"""The upstream's OAuth 2.0 token (proxy/upstream_oauth2.py): fetched as x/oauth2's
client credentials grant fetches it, against a token endpoint on 127.0.0.1
(tests/oauth2_endpoint.py); cached until 10 s before it expires, one fetch for every
request that waits, failures said and held a moment, a refused token dropped."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import quote_plus

import pytest

from proxy import upstream_oauth2
from proxy.config import OAuth2Settings, UpstreamSettings
from proxy.metrics import ProxyMetrics
from proxy.upstream import Upstream
from proxy.upstream_oauth2 import (
    EXPIRY_DELTA,
    FAILURE_HOLD_SECONDS,
    PARSED_ON_LOOP,
    REFUSED_MIN_AGE,
    TokenFailure,
    TokenSource,
    parse_answer,
    token_type,
)
from tests.clock import ManualClock
from tests.oauth2_endpoint import Canned, TokenEndpoint
from tests.scripted import Reply, ScriptedUpstream, redirect_to
from tests.test_upstream import fixed_then_checked
from tests.tls_certs import Authority

#: a secret with characters the Basic credentials form-escape first (RFC 6749 2.3.1)
SECRET = "s3c r:t/+&="


@pytest.fixture
async def endpoint() -> AsyncIterator[TokenEndpoint]:
    async with TokenEndpoint(clients={"karta id": SECRET}) as e:
        yield e


def source(tmp_path: Path, endpoint: TokenEndpoint | str, clock: ManualClock | None = None,
           *, timeout: float = 10.0, on_fetch: Callable[[str], None] | None = None,
           **settings: object) -> TokenSource:
    secret = tmp_path / "client-secret"
    if not secret.exists():
        secret.write_text(f"{SECRET}\n")
    url = endpoint if isinstance(endpoint, str) else endpoint.url
    o = OAuth2Settings(client_id="karta id", client_secret_file=str(secret), token_url=url)
    for k, v in settings.items():
        setattr(o, k, v)
    return TokenSource(o, timeout=timeout, connect_timeout=2.0, on_fetch=on_fetch,
                       **({"clock": clock} if clock is not None else {}))


async def test_the_request_is_x_oauth2s_and_the_token_is_the_authorization(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    """A form POST of grant_type, the scopes joined by spaces and the endpoint params,
    keys sorted, the client's id and secret form-escaped as Basic credentials; the
    answer's token, typed Bearer."""
    tokens = source(tmp_path, endpoint, scopes=["metrics:write", "openid"],
                    endpoint_params={"audience": "https://mimir"})
    got = await tokens.authorization()
    assert isinstance(got, str) and endpoint.live(got) and got.startswith("Bearer tok-1-")
    (req,) = endpoint.requests
    assert req.form == {"grant_type": ["client_credentials"], "scope": ["metrics:write openid"],
                        "audience": ["https://mimir"]}
    assert req.headers["Content-Type"] == "application/x-www-form-urlencoded"
    basic = base64.b64decode(req.headers["Authorization"].removeprefix("Basic ")).decode()
    assert basic == f"{quote_plus('karta id')}:{quote_plus(SECRET)}"
    assert tokens.current() == got
    await tokens.close()


async def test_credentials_go_in_the_form_when_the_header_fails_and_that_is_kept(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    """x/oauth2's auth style probe: the header first, the form after any failure, and
    the way that worked for every later fetch."""
    endpoint.styles = frozenset({"params"})
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    assert isinstance(await tokens.authorization(), str)
    assert [r.style for r in endpoint.requests] == ["header", "params"]
    assert endpoint.requests[1].form["client_secret"] == [SECRET]
    clock.now += 3600
    assert isinstance(await tokens.authorization(), str)
    assert [r.style for r in endpoint.requests] == ["header", "params", "params"]
    await tokens.close()


async def test_requests_that_wait_share_one_fetch(tmp_path: Path,
                                                  endpoint: TokenEndpoint) -> None:
    endpoint.hold = asyncio.Event()
    tokens = source(tmp_path, endpoint)
    waiting = [asyncio.create_task(tokens.authorization()) for _ in range(50)]
    for _ in range(100):  # until the one request reached the endpoint
        if endpoint.requests:
            break
        await asyncio.sleep(0.01)
    waiting[0].cancel()  # a request that gives up does not end the fetch for the others
    endpoint.hold.set()
    got = await asyncio.gather(*waiting[1:])
    assert len(set(got)) == 1 and len(endpoint.requests) == 1
    assert isinstance(got[0], str) and endpoint.live(got[0])
    await tokens.close()


async def test_the_token_is_kept_until_ten_seconds_before_it_expires(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    endpoint.expires_in = 60
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    first = await tokens.authorization()
    clock.now += 60 - EXPIRY_DELTA - 0.5
    assert tokens.current() == first and await tokens.authorization() == first
    clock.now += 0.5
    assert tokens.current() == ""
    second = await tokens.authorization()
    assert second != first and endpoint.granted == 2 and tokens.current() == second
    await tokens.close()


async def test_a_token_without_a_lifetime_is_kept(tmp_path: Path,
                                                  endpoint: TokenEndpoint) -> None:
    """No expires_in (or 0): x/oauth2 reuses it for ever; only a refusal or a new secret
    ends it here."""
    endpoint.expires_in = None
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    first = await tokens.authorization()
    clock.now += 10 * 86400
    assert tokens.current() == first
    await tokens.close()


async def test_a_new_secret_drops_the_token_and_fetches_with_it(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    first = await tokens.authorization()
    endpoint.clients["karta id"] = "rotated"
    (tmp_path / "client-secret").write_text("rotated")
    clock.now += 1.5  # the file is stat'ed at most once a second
    assert tokens.current() == ""
    second = await tokens.authorization()
    assert isinstance(second, str) and second != first and endpoint.live(second)
    basic = base64.b64decode(endpoint.requests[-1].headers["Authorization"][6:]).decode()
    assert basic.endswith(":rotated")
    await tokens.close()


@pytest.mark.parametrize(("canned", "result", "error"), [
    (Canned(401, b'{"error":"invalid_client","error_description":"bad secret"}'),
     "refused", "invalid_client"),
    (Canned(400, b'{"error":"invalid_scope"}'), "refused", "invalid_scope"),
    (Canned(403, b"<html>forbidden</html>", "text/html"), "refused", "status_403"),
    # some endpoints answer 200 with an error (x/oauth2 takes it as one)
    (Canned(200, b'{"error":"unauthorized_client"}'), "refused", "unauthorized_client"),
    (Canned(503, b'{"error":"temporarily_unavailable"}'), "unavailable",
     "temporarily_unavailable"),
    (Canned(429, b""), "unavailable", "status_429"),
    (Canned(200, b"<html>login</html>", "text/html"), "invalid_answer", "not_json"),
    (Canned(200, b'{"token_type":"Bearer"}'), "invalid_answer", "no_access_token"),
    (Canned(200, b'{"access_token":"a","expires_in":3600.5}'), "invalid_answer",
     "bad_field"),
    (Canned(200, b'{"access_token":"a\\nb"}'), "invalid_answer", "bad_token"),
])
async def test_a_failing_token_endpoint_is_a_failure_said_once(
        tmp_path: Path, endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture,
        canned: Canned, result: str, error: str) -> None:
    """What the waiting requests get and the log line: the token URL and the OAuth
    error, never the secret; counted by result."""
    caplog.set_level(logging.DEBUG)
    endpoint.answer = canned
    results: list[str] = []
    tokens = source(tmp_path, endpoint, on_fetch=results.append)
    got = await tokens.authorization()
    assert isinstance(got, TokenFailure), got
    assert (got.result, got.error) == (result, error)
    assert results == [result]
    lines = [r for r in caplog.records if "token not fetched" in r.getMessage()]
    assert len(lines) == 1 and lines[0].__dict__["token_url"] == endpoint.url
    assert lines[0].__dict__["error"] == error
    for r in caplog.records:
        assert SECRET not in repr(r.__dict__)
    await tokens.close()


async def test_no_answer_and_no_token_in_time_are_unavailable(tmp_path: Path) -> None:
    down = await source(tmp_path, "http://127.0.0.1:1/token").authorization()
    assert isinstance(down, TokenFailure) and (down.result, down.error) == (
        "unavailable", "no_answer")
    async with TokenEndpoint(hold=asyncio.Event()) as hung:
        tokens = source(tmp_path, hung, timeout=0.5)
        late = await tokens.authorization()
        assert isinstance(late, TokenFailure) and (late.result, late.error) == (
            "unavailable", "timeout")
        await tokens.close()
        assert hung.hold is not None
        hung.hold.set()


async def test_a_failure_answers_for_a_second_then_a_fetch_again(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    endpoint.down = True
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    failures = [await tokens.authorization() for _ in range(5)]
    assert all(isinstance(f, TokenFailure) for f in failures)
    # the probe's two tries, once: the four after it were the first's answer
    assert len(endpoint.requests) == 2
    endpoint.down = False
    clock.now += FAILURE_HOLD_SECONDS
    assert isinstance(await tokens.authorization(), str)
    await tokens.close()


async def test_a_refused_token_is_dropped_once_old_enough(tmp_path: Path,
                                                          endpoint: TokenEndpoint) -> None:
    """The upstream's 401: a token fetched a moment ago is kept (a new one would be
    refused as well: a fetch per request otherwise), an older one dropped."""
    clock = ManualClock(1000.0)
    tokens = source(tmp_path, endpoint, clock)
    first = await tokens.authorization()
    assert isinstance(first, str)
    tokens.refused(first)
    assert tokens.current() == first
    clock.now += REFUSED_MIN_AGE
    tokens.refused("Bearer another")
    assert tokens.current() == first
    tokens.refused(first)
    assert tokens.current() == ""
    assert await tokens.authorization() != first and endpoint.granted == 2
    await tokens.close()


async def test_an_https_token_endpoint_is_verified_with_its_ca(tmp_path: Path) -> None:
    """oauth2.tls_ca_file: the token endpoint's own CA (the system's without it)."""
    ca = Authority(tmp_path / "pki")
    server = ca.issue("127.0.0.1", server=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(server.cert, server.key)
    async with TokenEndpoint(clients={"karta id": SECRET}, tls=ctx) as e:
        tokens = source(tmp_path, e.url, tls_ca_file=str(ca.ca_file))
        assert isinstance(await tokens.authorization(), str)
        await tokens.close()
        unverified = await source(tmp_path, e.url).authorization()
        assert isinstance(unverified, TokenFailure) and unverified.result == "unavailable"


@pytest.mark.parametrize(("content_type", "body", "want"), [
    ("application/json", b'{"access_token":"t","expires_in":"3600"}', ("t", "", 3600)),
    ("application/json; charset=utf-8", b'{"access_token":"t","expires_in":null}',
     ("t", "", 0)),
    ("application/json", b'{"access_token":"t","expires_in":99999999999}',
     ("t", "", 2**31 - 1)),
    ("text/plain", b"access_token=t&token_type=bearer&expires_in=30", ("t", "bearer", 30)),
    ("application/x-www-form-urlencoded", b"access_token=t&expires_in=x", ("t", "", 0)),
    ("", b'{"access_token":"t","token_type":"mac"}', ("t", "mac", 0)),
])
def test_answers_are_read_as_x_oauth2_reads_them(content_type: str, body: bytes,
                                                 want: tuple[str, str, int]) -> None:
    got = parse_answer(content_type, body)
    assert not isinstance(got, str)
    assert (got.access_token, got.token_type, got.expires_in) == want


@pytest.mark.parametrize("body", [b'{"access_token":"t","expires_in":"1e3"}',
                                  b'{"access_token":"t","expires_in":true}',
                                  b'{"access_token":1}', b"[1]", b"not json"])
def test_answers_x_oauth2_cannot_read_are_refused(body: bytes) -> None:
    assert isinstance(parse_answer("application/json", body), str)


def test_the_token_type_names_the_scheme_as_x_oauth2s() -> None:
    assert [token_type(t) for t in ("", "bearer", "BEARER", "mac", "basic", "DPoP")] == [
        "Bearer", "Bearer", "Bearer", "MAC", "Basic", "DPoP"]


async def test_an_error_quoting_the_clients_credentials_has_them_withheld(
        tmp_path: Path, endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint's error text is the senders' 503 and the log line: the secret it
    quotes, as sent (form-escaped, in the Basic credentials) or decoded, is not shown
    (it was, as the upstream's answers quoting the proxy's token are not)."""
    caplog.set_level(logging.DEBUG)
    basic = base64.b64encode(f"{quote_plus('karta id')}:{quote_plus(SECRET)}".encode()).decode()
    endpoint.answer = Canned(401, json.dumps({
        "error": f"invalid_client:{SECRET}",
        "error_description": f"secret {SECRET!r} ({quote_plus(SECRET)}) of Basic {basic}",
    }).encode())
    tokens = source(tmp_path, endpoint)
    got = await tokens.authorization()
    assert isinstance(got, TokenFailure) and got.result == "refused"
    said = got.said()
    assert got.error == "invalid_client:(credential not shown)", said
    assert said.count("(credential not shown)") == 4, said
    for form in (SECRET, quote_plus(SECRET), basic):
        assert form not in said
        assert not [r for r in caplog.records if form in repr(r.__dict__)]
    await tokens.close()


async def test_a_long_answer_is_read_off_the_event_loop(
        tmp_path: Path, endpoint: TokenEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A form answer of x/oauth2's most (1 MiB of ``a=&``) held the loop 0.5 s a fetch,
    every sender's request with it; one past PARSED_ON_LOOP is read in a thread, a
    usual one (a few KiB) where it came."""
    loop_thread = threading.get_ident()
    readers: list[bool] = []

    def parse(content_type: str, body: bytes) -> object:
        readers.append(threading.get_ident() == loop_thread)
        return parse_answer(content_type, body)

    monkeypatch.setattr(upstream_oauth2, "parse_answer", parse)
    endpoint.answer = Canned(200, b"a=&" * (PARSED_ON_LOOP // 3) + b"access_token=t",
                             "text/plain")
    tokens = source(tmp_path, endpoint)
    assert await tokens.authorization() == "Bearer t"
    await tokens.close()
    endpoint.answer = Canned(200, b'{"access_token":"u"}')
    tokens = source(tmp_path, endpoint)
    assert await tokens.authorization() == "Bearer u"
    await tokens.close()
    assert readers == [False, True]


async def test_a_307_or_308_of_the_token_endpoint_is_followed_as_gos_client_does(
        tmp_path: Path, endpoint: TokenEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    """prometheus/common's token client follows redirects (Go's default): the same form
    to the Location. On the token URL's site the Basic credentials go on; to another
    (127.0.0.1 -> localhost) they stop, the endpoint refuses, and the form's credentials
    go, as x/oauth2's probe sends them through Go's client. Said once per (from, to)."""
    caplog.set_level(logging.WARNING)
    for status, host, styles in ((308, "127.0.0.1", ["header"]),
                                 (307, "localhost", ["", "params"])):
        endpoint.requests.clear()
        async with ScriptedUpstream(rule=redirect_to(endpoint.url, status, host)) as front:
            tokens = source(tmp_path, front.url.replace("/api/v1/write", "/token"))
            got = await tokens.authorization()
            await tokens.close()
        assert isinstance(got, str) and endpoint.live(got), got
        assert [r.style for r in endpoint.requests] == styles
        assert all(r.form["grant_type"] == ["client_credentials"] for r in endpoint.requests)
        assert all(r.headers["Referer"].startswith(front.url[:-len("/api/v1/write")])
                   for r in endpoint.requests)
    lines = [r for r in caplog.records if r.getMessage().endswith("token_url to the target")]
    assert len(lines) == 2 and lines[1].__dict__["to"].startswith("http://localhost:")


@pytest.mark.parametrize(("reply", "result", "said"), [
    (Reply(301, {"Location": "/oauth/token"}), "refused",
     "redirects to http://127.0.0.1:{port}/oauth/token, not followed"),
    (Reply(308, {"Location": "/token"}), "unavailable", "a redirect loop"),
    (Reply(307), "unavailable", "no Location header"),
])
async def test_a_token_redirect_not_followed_is_a_failure_naming_it(
        tmp_path: Path, reply: Reply, result: str, said: str) -> None:
    """A 3xx was a refusal of the client, ``status_308 (not_json answer)``: the
    misconfiguration alert for the proxy's credentials, naming no Location."""
    async with ScriptedUpstream(reply) as front:
        tokens = source(tmp_path, front.url.replace("/api/v1/write", "/token"))
        got = await tokens.authorization()
        await tokens.close()
    assert isinstance(got, TokenFailure) and got.result == result, got
    assert said.format(port=front.port) in got.detail, got


async def test_the_check_that_found_the_client_refused_is_made_again_once_a_token_comes(
        tmp_path: Path, endpoint: TokenEndpoint) -> None:
    """The start's check found the token endpoint refusing the client (a secret not yet
    rotated in): once the file holds the right one and a token comes, the check runs
    again, and ``karta_proxy_upstream_info{check}`` says what the upstream finds. It
    said credentials_refused until a restart, KartaProxyUpstreamMisconfigured firing
    while every write went through."""
    secret = tmp_path / "client-secret"
    secret.write_text("not yet rotated")
    oauth2 = OAuth2Settings(client_id="karta id", client_secret_file=str(secret),
                            token_url=endpoint.url)
    async with ScriptedUpstream() as up:
        u = Upstream(UpstreamSettings(url=up.url, timeout_seconds=5.0, protocol="v1",
                                      oauth2=oauth2), ProxyMetrics())
        assert (await u.check()).outcome == "credentials_refused"
        await fixed_then_checked(u, secret, SECRET)
        await u.close()
    assert len(up.empty_writes) == 1  # the check made again, with the token
