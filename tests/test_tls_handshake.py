"""Failed TLS handshakes on the listening side (proxy/tls_handshake.py): counted in
``karta_proxy_tls_handshake_failures_total{reason}`` and logged, a line per reason per
interval. Real handshakes against the assembled proxy on 127.0.0.1; the clients are
Python's ssl (asyncio's, and a blocking socket where an alert must reach the proxy)."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
import ssl
import time
import tracemalloc
import warnings
from pathlib import Path

import aiohttp
import pytest
import snappy
from aiohttp import web

from proxy.connection_guard import _GuardedProtocol
from proxy.runtime import Proxy
from proxy.sender import Series, build_v1, decode_v1, send
from proxy.tls_handshake import REASONS, Reason, Refusals, TLSSite, classify
from tests.clock import ManualClock
from tests.scripted import ScriptedUpstream
from tests.test_tls import Pki, fetch, started, tls_settings, write_stored
from tests.test_tls import pki as pki  # the shared fixtures, reused
from tests.test_tls import upstream as upstream
from tests.tls_certs import Authority

FAILURES = "karta_proxy_tls_handshake_failures_total"


def failures(p: Proxy) -> dict[Reason, float]:
    return {r: p.metrics.registry.get_sample_value(FAILURES, {"reason": r}) or 0.0
            for r in REASONS}


async def counted(p: Proxy, want: dict[Reason, float], timeout: float = 5.0,
                  ) -> dict[Reason, float]:
    """The counters once they reach ``want`` (the proxy's side of a refusal may finish
    after the client's), or as they are at the deadline."""
    deadline = time.monotonic() + timeout
    got = failures(p)
    while any(got[r] < n for r, n in want.items()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        got = failures(p)
    return got


async def mtls_proxy(tmp_path: Path, upstream: ScriptedUpstream, pki: Pki,
                     caplog: pytest.LogCaptureFixture) -> Proxy:
    """A started proxy requiring client certificates, its TLS log lines captured."""
    caplog.set_level(logging.WARNING, logger="karta.tls")
    return await started(tls_settings(tmp_path, upstream.url, pki,
                                      tls_client_ca_file=str(pki.ca.ca_file)))


async def raw_send(port: int, data: bytes) -> bytes:
    """Bytes on a plain TCP connection, and what comes back before the proxy closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1024), 5)
    except ConnectionError:
        return b""
    finally:
        writer.close()


def blocking_handshake(port: int, ctx: ssl.SSLContext) -> str:
    """A handshake on a blocking socket: OpenSSL writes its alert to the socket before it
    raises, where an asyncio client's alert stays in its memory buffer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            with ctx.wrap_socket(sock, server_hostname="127.0.0.1"):
                return "connected"
        except ssl.SSLError as e:
            return f"{type(e).__name__}: {e.reason}"


def tls11_client(pki: Pki) -> ssl.SSLContext:
    ctx = pki.client.client_context(pki.ca.ca_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    ctx.set_ciphers("DEFAULT@SECLEVEL=0")
    return ctx


def lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "karta.tls" and r.getMessage() == message]


async def test_each_refusal_is_counted_and_logged_and_a_valid_client_still_writes(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    p = await mtls_proxy(tmp_path, upstream, pki, caplog)
    try:
        assert failures(p) == dict.fromkeys(REASONS, 0.0), "every reason there from the start"
        assert (await fetch(p.port, pki.ca.ca_file)).status == ""
        assert (await fetch(p.port, pki.ca.ca_file, pki.other_client)).status == ""
        assert await raw_send(p.port, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert await raw_send(p.port, b"\x00\x01 not a TLS record\r\n") == b""
        assert (await fetch(p.port, pki.ca.ca_file, context=tls11_client(pki))).status == ""
        # the proxy's certificate from a CA the client does not trust: it hangs up (asyncio)
        # or sends an alert (a blocking socket)
        other = Authority(tmp_path / "elsewhere", "elsewhere-ca")
        assert (await fetch(p.port, other.ca_file, pki.client)).status == ""
        distrusting = ssl.create_default_context(cafile=str(other.ca_file))
        assert (await asyncio.to_thread(blocking_handshake, p.port, distrusting)) \
            == "SSLCertVerificationError: CERTIFICATE_VERIFY_FAILED"
        # a TCP probe (connect, close) is no handshake
        _, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.close()

        want = {Reason.NO_CLIENT_CERTIFICATE: 1.0, Reason.UNTRUSTED_CERTIFICATE: 1.0,
                Reason.NOT_TLS: 2.0, Reason.PROTOCOL: 1.0, Reason.CLIENT_CLOSED: 1.0,
                Reason.SERVER_CERTIFICATE_REJECTED: 1.0}
        got = await counted(p, want)
        await asyncio.sleep(0.2)  # the probe's close reaches the proxy too
        assert failures(p) == {**dict.fromkeys(REASONS, 0.0), **want}, got

        # a valid client certificate: served, and a write is stored upstream
        ok = await fetch(p.port, pki.ca.ca_file, pki.client)
        assert ok.status == "HTTP/1.1 200 OK", ok
        await write_stored(p.port, pki.ca.ca_file, upstream, pki.client)
        assert failures(p) == {**dict.fromkeys(REASONS, 0.0), **want}, "nothing new counted"
    finally:
        await p.stop()

    refused = lines(caplog, "TLS handshake failed")
    by_reason = {r.__dict__["reason"]: r for r in refused}
    # one line per reason: the second not_tls is in the same interval, so it waits for the
    # summary, which the stop writes
    assert sorted(by_reason) == sorted(want), [r.__dict__ for r in refused]
    assert len(refused) == len(want)
    for r in refused:
        assert r.levelno == logging.WARNING
        assert r.__dict__["peer"].startswith("127.0.0.1:"), r.__dict__
        assert r.__dict__["error"], r.__dict__
    assert by_reason[Reason.NO_CLIENT_CERTIFICATE].__dict__["ssl_reason"] \
        == "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    assert by_reason[Reason.UNTRUSTED_CERTIFICATE].__dict__["error"] \
        == "certificate verify failed: unable to get local issuer certificate"
    assert by_reason[Reason.NO_CLIENT_CERTIFICATE].__dict__["error"] \
        == "peer did not return a certificate"
    assert by_reason[Reason.NOT_TLS].__dict__["ssl_reason"] == "HTTP_REQUEST"
    assert by_reason[Reason.CLIENT_CLOSED].__dict__["error"] == "connection closed by the client"
    assert by_reason[Reason.PROTOCOL].__dict__["ssl_reason"] == "UNSUPPORTED_PROTOCOL"
    assert by_reason[Reason.SERVER_CERTIFICATE_REJECTED].__dict__["ssl_reason"] \
        == "TLSV1_ALERT_UNKNOWN_CA"
    summaries = lines(caplog, "TLS handshakes failed")
    assert [(s.__dict__["reason"], s.__dict__["count"]) for s in summaries] \
        == [(Reason.NOT_TLS, 1)]
    assert summaries[0].__dict__["ssl_reason"] == "WRONG_VERSION_NUMBER"


async def test_a_burst_of_one_reason_is_one_line_then_one_summary_per_interval(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    p = await mtls_proxy(tmp_path, upstream, pki, caplog)
    try:
        assert p.tls is not None
        p.tls.refusals.interval = 0.5
        # the interval read on a clock the test moves: the burst is within one interval
        # however long a loaded machine takes for its six handshakes (the summary's timer
        # still runs on the loop, 0.5 s after the second refusal)
        clock = ManualClock(1000.0)
        p.tls.refusals._lines._clock = clock
        for _ in range(6):
            assert (await fetch(p.port, pki.ca.ca_file)).status == ""
        got = await counted(p, {Reason.NO_CLIENT_CERTIFICATE: 6.0})
        assert got[Reason.NO_CLIENT_CERTIFICATE] == 6.0, got
        assert len(lines(caplog, "TLS handshake failed")) == 1
        assert lines(caplog, "TLS handshakes failed") == [], "the summary waits for the interval"
        deadline = time.monotonic() + 5
        while not lines(caplog, "TLS handshakes failed") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        (summary,) = lines(caplog, "TLS handshakes failed")
        assert (summary.__dict__["count"], summary.__dict__["peers"]) == (5, "127.0.0.1")
        assert summary.__dict__["reason"] == Reason.NO_CLIENT_CERTIFICATE
        assert summary.__dict__["last_peer"].startswith("127.0.0.1:")
        # an interval later a refusal is a line of its own again
        clock.now += 0.6
        assert (await fetch(p.port, pki.ca.ca_file)).status == ""
        await counted(p, {Reason.NO_CLIENT_CERTIFICATE: 7.0})
        assert len(lines(caplog, "TLS handshake failed")) == 2
    finally:
        await p.stop()
    assert len(lines(caplog, "TLS handshakes failed")) == 1, "nothing left for the stop"


async def test_a_client_silent_past_the_handshake_timeout_is_counted(
    pki: Pki, caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy's is server.header_read_timeout_seconds; a site of 1 s shows it is counted."""
    caplog.set_level(logging.WARNING, logger="karta.tls")
    ctx = pki.server.server_context()
    seen: list[str] = []
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = TLSSite(runner, "127.0.0.1", 0, ssl_context=ctx, refusals=Refusals(seen.append),
                   handshake_timeout=1)
    await site.start()
    port = runner.addresses[0][1]
    try:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the proxy hung up"
        assert 0.9 < time.monotonic() - t0 < 4
        writer.close()
        deadline = time.monotonic() + 10  # told, however loaded the machine
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # and nothing more
        assert seen == [Reason.TIMEOUT]
        (line,) = lines(caplog, "TLS handshake failed")
        assert line.__dict__["reason"] == Reason.TIMEOUT
    finally:
        await runner.cleanup()


async def test_a_site_given_a_callable_asks_it_for_each_connection(pki: Pki) -> None:
    """proxy/tls.py makes a new context per load: the listener must take the current one
    for each connection, not the one it started with."""
    current = [pki.server.server_context()]
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = TLSSite(runner, "127.0.0.1", 0, ssl_context=lambda: current[0],
                   refusals=Refusals())
    await site.start()
    port = runner.addresses[0][1]
    try:
        assert (await fetch(port, pki.ca.ca_file)).server_cn == "proxy-a"
        current[0] = pki.ca.issue("proxy-b", server=True).server_context()
        assert (await fetch(port, pki.ca.ca_file)).server_cn == "proxy-b"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("error", "hello_seen", "reason"),
    [
        (ssl.SSLError(1, "[SSL: NO_SHARED_CIPHER] no shared cipher"), True, Reason.OTHER),
        (ConnectionResetError(), False, None),
        (ConnectionResetError(), True, Reason.CLIENT_CLOSED),
        (ConnectionAbortedError("SSL handshake is taking longer than 60.0 seconds"), False,
         Reason.TIMEOUT),
        (OSError("something else"), True, None),
    ],
)
def test_classify_without_an_openssl_reason(
    error: BaseException, hello_seen: bool, reason: str | None,
) -> None:
    """An SSLError built by hand has no ``reason`` (OpenSSL sets it): ``other``. The
    OpenSSL codes themselves are covered by the handshakes above."""
    found = classify(error, hello_seen=hello_seen)
    assert (found[0] if found else None) == reason


def test_the_reasons_are_the_documented_ones() -> None:
    """docs/operations.md lists the label values twice: the metric's row and the TLS
    section's table of what each means; both must be the closed set the code counts."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith(f"| `{FAILURES}` |")]
    listed = re.findall(r"`([a-z_]+)`", row.split("|")[3].split("(", 1)[1])
    section = doc.split("**Failed handshakes.**")[1].split("**Rotation.**")[0]
    table = re.findall(r"^\| `([a-z_]+)` \| ", section.split("|---|---|---|")[1], re.M)
    assert listed == table == [r.value for r in REASONS]


async def test_the_proxy_ends_a_silent_handshake_at_the_header_deadline(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """A client that connects to the TLS port and sends nothing holds its connection no
    longer than a plain-HTTP client holds one without a request line."""
    s = tls_settings(tmp_path, upstream.url, pki)
    s.server.header_read_timeout_seconds = 1.0
    p = await started(s)
    try:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        assert await asyncio.wait_for(reader.read(), 10) == b"", "the proxy hung up"
        assert 0.9 < time.monotonic() - t0 < 4
        writer.close()
        assert (await counted(p, {Reason.TIMEOUT: 1}))[Reason.TIMEOUT] == 1
        await write_stored(p.port, pki.ca.ca_file, upstream)  # and the port still serves
    finally:
        await p.stop()


async def test_a_silent_connection_holds_no_256_kib_read_buffer(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """asyncio's TLS protocol made a 256 KiB read buffer per connection at its accept,
    before any byte or certificate: 1,000 silent connections grew RSS by ~300 MB. The
    Python memory of 200 of them, traced, stays under 128 KiB each (it was ~270)."""
    s = tls_settings(tmp_path, upstream.url, pki)
    s.server.header_read_timeout_seconds = 30.0
    p = await started(s)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            conns.append(await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", p.port), 5))
        deadline = time.monotonic() + 5
        while (p.metrics.registry.get_sample_value("karta_proxy_open_connections") or 0) \
                < len(conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        per_connection = (tracemalloc.get_traced_memory()[0] - before) / len(conns)
        assert per_connection < 128 * 1024, f"{per_connection / 1024:.0f} KiB each"
    finally:
        tracemalloc.stop()
        for _, writer in conns:
            writer.close()
        await p.stop()


async def test_a_body_of_several_megabytes_streams_over_tls(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """The smaller read buffer takes a large body in more reads, not in part: a ~6 MB
    remote write (random label values, so snappy leaves it large) reaches the upstream
    whole."""
    p = await started(tls_settings(tmp_path, upstream.url, pki))
    rng = random.Random(7)
    series = [Series({"__name__": "m", "namespace": "shop", "pod": "cart-7d9f-abcde",
                      "id": f"{rng.getrandbits(512):0128x}"}, samples=[(1, float(i))])
              for i in range(40_000)]
    body = snappy.compress(build_v1(series))
    assert len(body) > 4 * 1024 * 1024
    ctx = ssl.create_default_context(cafile=str(pki.ca.ca_file))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            status, _, text = await send(f"https://127.0.0.1:{p.port}/api/v1/write", body,
                                         protocol="1.0", compressed=True, session=session,
                                         timeout=60)
        assert status == 204, text
        (got,) = upstream.received
        assert len(decode_v1(got.raw)) == len(series)
    finally:
        await p.stop()


async def test_a_connection_retired_as_its_handshake_completes_is_closed_not_reset(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection protocol has the connection as the handshake completes, but
    ``handshaken`` was set a turn of the loop later: a retire in that turn took it for a
    connection still in its handshake and aborted TCP, where the connection protocol
    closes it after its answer (at once, idle, with TLS's close_notify)."""
    s = tls_settings(tmp_path, upstream.url, pki)
    p = await started(s, tls_check_interval=0)
    seen: list[bool] = []
    made = _GuardedProtocol.connection_made

    def retire_in_that_turn(self: _GuardedProtocol, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        assert p.tls is not None
        connections = p.tls.connections

        def retire() -> None:
            seen.extend(proto.handshaken for proto in connections._open)
            connections.retire(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))  # the trust gone

        asyncio.get_running_loop().call_soon(retire)

    monkeypatch.setattr(_GuardedProtocol, "connection_made", retire_in_that_turn)
    ctx = ssl.create_default_context(cafile=str(pki.ca.ca_file))
    try:
        got = await asyncio.to_thread(how_it_ends, p.port, ctx)
    finally:
        await p.stop()
    assert seen == [False]
    assert got == "closed"


def how_it_ends(port: int, ctx: ssl.SSLContext) -> str:
    """How the proxy ends a connection the client only opened: "closed" with TLS's
    close_notify, else the error (a TCP close without it, a reset): read on a blocking
    socket, where ragged EOFs are not passed off as a close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            ctx.wrap_socket(sock, server_hostname="127.0.0.1",
                            suppress_ragged_eofs=False) as tls:
        try:
            return "closed" if tls.recv(1) == b"" else "data"
        except (ssl.SSLError, OSError) as e:
            return f"{type(e).__name__}: {e}"


async def test_a_site_on_an_ipv6_host_names_it_in_brackets(pki: Pki) -> None:
    """``https://::1:9091`` names no port; aiohttp's own sites bracket the host."""
    ctx = pki.server.server_context()
    runner = web.AppRunner(web.Application())
    await runner.setup()
    try:
        assert TLSSite(runner, "::1", 9091, ssl_context=ctx, refusals=Refusals()).name == \
            "https://[::1]:9091"
        assert TLSSite(runner, "127.0.0.1", 9091, ssl_context=ctx,
                       refusals=Refusals()).name == "https://127.0.0.1:9091"
    finally:
        await runner.cleanup()
