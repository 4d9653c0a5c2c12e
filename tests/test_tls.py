"""TLS on the listening side (proxy/tls.py, server.tls_* settings): HTTPS, client
certificates (mTLS) refused or verified per ``tls_client_auth_type``, and certificates
rotated under a running proxy. The real assembled proxy, real handshakes on 127.0.0.1.
The Prometheus agent writing over ``tls_config`` is in tests/peers/test_e2e_tls.py."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import snappy

from proxy.config import ConfigError, Settings, validate
from proxy.runtime import Proxy
from proxy.sender import Series, build_v1, request_headers, send_series
from proxy.tls_handshake import REASONS
from tests.proxy_harness import SNAPSHOT
from tests.scripted import ScriptedUpstream
from tests.tls_certs import Authority, Pem, install, self_signed_client


@dataclass(frozen=True)
class Seen:
    """One handshake and ``GET /-/healthy`` as a client saw them."""

    #: the server certificate's common name ("" when the handshake failed)
    server_cn: str
    #: the status line ("" when the server refused the connection)
    status: str
    error: str = ""


async def fetch(port: int, ca: Path, client: Pem | None = None,
                context: ssl.SSLContext | None = None) -> Seen:
    """A fresh connection (so a fresh handshake) and one request on it; ``context``, when
    given, is the client's instead of one made of ``ca`` and ``client``."""
    ctx = context if context is not None else ssl.create_default_context(cafile=str(ca))
    if client is not None and context is None:
        ctx.load_cert_chain(client.cert, client.key)
    cn = ""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=ctx), 5)
    except (ssl.SSLError, OSError) as e:
        return Seen("", "", f"{type(e).__name__}: {e}")
    try:
        cert = writer.get_extra_info("peercert") or {}
        cn = dict(x[0] for x in cert.get("subject", ())).get("commonName", "")
        writer.write(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 5)
        return Seen(cn, line.decode().strip())
    except (ssl.SSLError, OSError, asyncio.IncompleteReadError) as e:
        # TLS 1.3: the client's side of the handshake ends before the server has checked
        # the client's certificate, so a refusal shows on the first read
        return Seen(cn, "", f"{type(e).__name__}: {e}")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def write_stored(port: int, ca: Path, upstream: ScriptedUpstream,
                       client: Pem | None = None) -> None:
    """A remote write over HTTPS is answered 204 and reaches the upstream."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    before = len(upstream.received)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        status, _, body = await send_series(
            f"https://127.0.0.1:{port}/api/v1/write",
            [Series({"__name__": "m", "namespace": "shop", "pod": "cart-7d9f-abcde"})],
            session=session)
    assert status == 204, body
    assert len(upstream.received) > before, "the write reached the upstream"


@dataclass
class Pki:
    ca: Authority
    server: Pem
    client: Pem
    #: a CA the proxy does not trust, and a client certificate of it
    other_client: Pem


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = Authority(tmp_path / "pki", "test-ca")
    other = Authority(tmp_path / "other", "other-ca")
    return Pki(ca, ca.issue("proxy-a", server=True), ca.issue("agent", server=False),
               other.issue("intruder", server=False))


def tls_settings(tmp_path: Path, upstream_url: str, pki: Pki, **server: str) -> Settings:
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    s = Settings()
    s.snapshot = str(snap)
    s.upstream.url = upstream_url
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    s.server.tls_cert_file = str(pki.server.cert)
    s.server.tls_key_file = str(pki.server.key)
    for k, v in server.items():
        setattr(s.server, k, v)
    validate(s)
    return s


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    async with ScriptedUpstream() as up:
        yield up


async def started(s: Settings, tls_check_interval: float | None = None) -> Proxy:
    p = Proxy(s, tls_check_interval=tls_check_interval)
    await p.start()
    return p


async def test_https_remote_write_is_enriched_and_plain_http_is_not_served(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    p = await started(tls_settings(tmp_path, upstream.url, pki))
    try:
        seen = await fetch(p.port, pki.ca.ca_file)
        assert (seen.server_cn, seen.status) == ("proxy-a", "HTTP/1.1 200 OK"), seen
        await write_stored(p.port, pki.ca.ca_file, upstream)
        # plain HTTP on the TLS port: no answer, and the proxy keeps serving
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await session.get(f"http://127.0.0.1:{p.port}/-/healthy",
                                  timeout=aiohttp.ClientTimeout(total=5))
        assert (await fetch(p.port, pki.ca.ca_file)).status == "HTTP/1.1 200 OK"
    finally:
        await p.stop()


async def test_require_client_cert_refuses_without_one_or_from_another_ca(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    # tls_client_auth_type left empty: a client CA means RequireAndVerifyClientCert
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(pki.ca.ca_file))
    p = await started(s)
    try:
        no_cert = await fetch(p.port, pki.ca.ca_file)
        assert no_cert.status == "", no_cert
        foreign = await fetch(p.port, pki.ca.ca_file, pki.other_client)
        assert foreign.status == "", foreign
        ok = await fetch(p.port, pki.ca.ca_file, pki.client)
        assert ok.status == "HTTP/1.1 200 OK", ok
    finally:
        await p.stop()


async def test_verify_if_given_takes_no_cert_but_refuses_a_bad_one(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(pki.ca.ca_file),
                     tls_client_auth_type="VerifyClientCertIfGiven")
    p = await started(s)
    try:
        assert (await fetch(p.port, pki.ca.ca_file)).status == "HTTP/1.1 200 OK"
        assert (await fetch(p.port, pki.ca.ca_file, pki.client)).status == "HTTP/1.1 200 OK"
        assert (await fetch(p.port, pki.ca.ca_file, pki.other_client)).status == ""
    finally:
        await p.stop()


async def test_rotated_certificate_is_served_on_new_handshakes(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """A Secret-volume style swap: new files renamed over the old. The watcher loads them;
    a pair caught half-swapped (new certificate, old key) is not loaded, and the old
    certificate keeps serving meanwhile."""
    s = tls_settings(tmp_path, upstream.url, pki)
    p = await started(s, tls_check_interval=0.1)
    rotated = pki.ca.issue("proxy-b", server=True)
    try:
        assert p.tls is not None
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-a"
        # half done: the certificate of b with the key of a
        pki.server.cert.write_bytes(rotated.cert.read_bytes())
        assert p.tls.check() is False
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-a"
        install(rotated, pki.server)  # now the key too

        deadline = time.monotonic() + 10
        seen = await fetch(p.port, pki.ca.ca_file)
        while seen.server_cn != "proxy-b" and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            seen = await fetch(p.port, pki.ca.ca_file)
        assert (seen.server_cn, seen.status) == ("proxy-b", "HTTP/1.1 200 OK"), seen
        async with aiohttp.ClientSession() as session, session.get(
            f"https://127.0.0.1:{p.port}/metrics",
            ssl=ssl.create_default_context(cafile=str(pki.ca.ca_file))) as r:
            text = await r.text()
        counts = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("karta_proxy_tls_certificate_reloads_total{")}
        # the watcher may also catch the install between its two renames: a second failure
        assert counts["failure"] >= 1.0 and counts["success"] == 1.0, counts
    finally:
        await p.stop()


async def test_a_new_client_ca_is_trusted_after_it_is_added(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """CA rotation: the bundle gains the new CA; its clients get in without a restart."""
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    newer = Authority(tmp_path / "newer", "newer-ca")
    newer_client = newer.issue("agent-2", server=False)
    try:
        assert p.tls is not None
        assert (await fetch(p.port, pki.ca.ca_file, newer_client)).status == ""
        bundle.write_bytes(pki.ca.ca_file.read_bytes() + newer.ca_file.read_bytes())
        assert p.tls.check() is True
        assert (await fetch(p.port, pki.ca.ca_file, newer_client)).status == "HTTP/1.1 200 OK"
        assert (await fetch(p.port, pki.ca.ca_file, pki.client)).status == "HTTP/1.1 200 OK"
    finally:
        await p.stop()


def _ecdsa_only_client(ca: Path) -> ssl.SSLContext:
    """A client that takes an ECDSA server certificate only (TLS 1.2, ECDSA suites)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384")
    return ctx


async def test_a_certificate_rotated_to_another_key_type_replaces_the_old_one(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """ECDSA -> RSA: loaded into the live context, the RSA certificate sat beside the
    ECDSA one (OpenSSL keeps one per key type) and clients offering ECDSA, the default
    client among them, kept getting the old certificate. Each load is a new context."""
    s = tls_settings(tmp_path, upstream.url, pki)
    p = await started(s, tls_check_interval=0)
    rsa_cert = pki.ca.issue("proxy-rsa", server=True, rsa_key=True)
    try:
        assert p.tls is not None
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-a"
        ecdsa_only = await fetch(p.port, pki.ca.ca_file,
                                 context=_ecdsa_only_client(pki.ca.ca_file))
        assert ecdsa_only.server_cn == "proxy-a", ecdsa_only
        install(rsa_cert, pki.server)
        assert p.tls.check() is True
        seen = await fetch(p.port, pki.ca.ca_file)
        assert (seen.server_cn, seen.status) == ("proxy-rsa", "HTTP/1.1 200 OK"), seen
        # no ECDSA certificate is left to serve: that client is refused, not given proxy-a
        ecdsa_only = await fetch(p.port, pki.ca.ca_file,
                                 context=_ecdsa_only_client(pki.ca.ca_file))
        assert ecdsa_only.server_cn == "" and ecdsa_only.status == "", ecdsa_only
        # and back to ECDSA
        install(pki.ca.issue("proxy-c", server=True), pki.server)
        assert p.tls.check() is True
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-c"
    finally:
        await p.stop()


async def test_a_client_ca_removed_from_the_bundle_is_no_longer_trusted(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """A CA taken out of the bundle: its clients are refused from the next handshake on
    (a live context could only add CAs, so it stayed trusted until a restart)."""
    newer = Authority(tmp_path / "newer", "newer-ca")
    newer_client = newer.issue("agent-2", server=False)
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes() + newer.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    try:
        assert p.tls is not None
        assert (await fetch(p.port, pki.ca.ca_file, newer_client)).status == "HTTP/1.1 200 OK"
        bundle.write_bytes(pki.ca.ca_file.read_bytes())
        assert p.tls.check() is True
        assert (await fetch(p.port, pki.ca.ca_file, newer_client)).status == ""
        assert (await fetch(p.port, pki.ca.ca_file, pki.client)).status == "HTTP/1.1 200 OK"
    finally:
        await p.stop()


async def open_tls(port: int, ca: Path, client: Pem,
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    ctx = client.client_context(ca)
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 5)


async def answer(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """The status line and headers of one response (its body read and dropped); ("", {})
    when the connection ends first."""
    try:
        status = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
        headers: dict[str, str] = {}
        while status:
            line = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
            if not line:
                break
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 5)
        return status, headers
    except (ssl.SSLError, OSError, asyncio.IncompleteReadError):
        return "", {}


async def closed(reader: asyncio.StreamReader) -> bool:
    """The proxy ended the connection (EOF, or a reset) within 5 s."""
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except (ssl.SSLError, OSError):
        return True


HEALTHY = b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def trusting_two_cas(tmp_path: Path, pki: Pki, upstream: ScriptedUpstream
                           ) -> tuple[Proxy, Authority, Path]:
    """A proxy whose client CA bundle (returned, to rotate) trusts ``pki``'s CA and a
    second one (returned): the first is the one the tests take away."""
    kept = Authority(tmp_path / "kept", "kept-ca")
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes() + kept.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    return await started(s, tls_check_interval=0), kept, bundle


async def test_a_keep_alive_connection_of_a_removed_client_ca_is_not_served_again(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """Its connection was verified under the old bundle, once: it went on being served
    for as long as the client kept it (56 s and more measured). Now the idle connection
    is closed when the bundle loses the CA, its next request is not answered, and a new
    handshake is refused."""
    p, kept, bundle = await trusting_two_cas(tmp_path, pki, upstream)
    reader, writer = await open_tls(p.port, pki.ca.ca_file, pki.client)
    try:
        assert p.tls is not None
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
        # and one whose handshake has not begun: it would end under the old bundle
        pending, _ = await asyncio.open_connection("127.0.0.1", p.port)
        for _ in range(100):
            if len(p.tls.connections) == 2:
                break
            await asyncio.sleep(0.01)
        bundle.write_bytes(kept.ca_file.read_bytes())
        assert p.tls.check() is True
        with contextlib.suppress(OSError):
            writer.write(HEALTHY)
        assert (await answer(reader))[0] == ""
        assert await closed(reader)
        assert await closed(pending)
        assert not any(p.metrics.registry.get_sample_value(
            "karta_proxy_tls_handshake_failures_total", {"reason": r}) for r in REASONS)
        assert (await fetch(p.port, pki.ca.ca_file, pki.client)).status == ""
        assert (await fetch(p.port, pki.ca.ca_file,
                            kept.issue("agent-k", server=False))).status == "HTTP/1.1 200 OK"
    finally:
        writer.close()
        await p.stop()


async def test_a_write_in_flight_when_its_client_ca_is_removed_is_answered_then_closed(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """Half its body sent when the CA goes: the rest is read, the write stored and
    answered 204 (the sender must not resend what was stored), and the connection then
    closed (with no retire at all, it stays open)."""
    p, kept, bundle = await trusting_two_cas(tmp_path, pki, upstream)
    body = snappy.compress(build_v1(
        [Series({"__name__": "m", "namespace": "shop", "pod": "cart-7d9f-abcde"},
                samples=[(1, 1.0)])]))
    head = "".join(f"{k}: {v}\r\n" for k, v in request_headers("1.0", "snappy").items())
    reader, writer = await open_tls(p.port, pki.ca.ca_file, pki.client)
    try:
        assert p.tls is not None
        writer.write(f"POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        deadline = time.monotonic() + 5
        while not p.metrics.registry.get_sample_value("karta_proxy_inflight_requests") \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        bundle.write_bytes(kept.ca_file.read_bytes())
        assert p.tls.check() is True
        writer.write(body[10:])
        status, headers = await answer(reader)
        assert (status, headers.get("connection")) == ("HTTP/1.1 204 No Content", "close")
        assert len(upstream.received) == 1
        assert await closed(reader)
    finally:
        writer.close()
        await p.stop()


async def test_a_client_ca_added_to_the_bundle_closes_no_connection(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """Only a CA taken away ends connections: a rotation that adds one (or changes the
    serving certificate) leaves the open ones be, or every agent would reconnect."""
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    reader, writer = await open_tls(p.port, pki.ca.ca_file, pki.client)
    try:
        assert p.tls is not None
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
        more = Authority(tmp_path / "more", "more-ca")
        bundle.write_bytes(pki.ca.ca_file.read_bytes() + more.ca_file.read_bytes())
        install(pki.ca.issue("proxy-b", server=True), pki.server)
        assert p.tls.check() is True
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
    finally:
        writer.close()
        await p.stop()


@pytest.mark.parametrize("ca", [False, None], ids=["ca-false", "no-basic-constraints"])
async def test_a_pinned_client_certificate_removed_from_the_bundle_ends_its_connection(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, ca: bool | None,
) -> None:
    """A bundle may pin a client's own self-signed certificate (CA:FALSE, or no
    basicConstraints): OpenSSL trusts it, but ``get_ca_certs`` lists CAs only, so taking
    it out of the bundle retired nothing and its keep-alive connection went on being
    served."""
    pinned = self_signed_client(tmp_path / "pinned", "pinned-agent", ca=ca)
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes() + pinned.cert.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    reader, writer = await open_tls(p.port, pki.ca.ca_file, pinned)
    try:
        assert p.tls is not None
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
        bundle.write_bytes(pki.ca.ca_file.read_bytes())
        assert p.tls.check() is True
        with contextlib.suppress(OSError):
            writer.write(HEALTHY)
        assert (await answer(reader))[0] == ""
        assert await closed(reader)
        assert (await fetch(p.port, pki.ca.ca_file, pinned)).status == ""
    finally:
        writer.close()
        await p.stop()


async def test_a_client_ca_removed_while_client_certificates_are_not_asked_for_closes_nothing(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """No client certificate is verified, so no connection was let in by the CA that
    went: closing them would make every sender reconnect for nothing. (The settings
    refuse a bundle with NoClientCert; ``ServerTLS`` is not to rely on that.)"""
    kept = Authority(tmp_path / "kept", "kept-ca")
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes() + kept.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    s.server.tls_client_auth_type = "NoClientCert"
    p = await started(s, tls_check_interval=0)
    ctx = ssl.create_default_context(cafile=str(pki.ca.ca_file))
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", p.port, ssl=ctx), 5)
    try:
        assert p.tls is not None
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
        bundle.write_bytes(kept.ca_file.read_bytes())
        assert p.tls.check() is True
        writer.write(HEALTHY)
        assert (await answer(reader))[0] == "HTTP/1.1 200 OK"
    finally:
        writer.close()
        await p.stop()


async def test_both_reload_results_are_served_from_the_start(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """A series that appears only at its first increment is missed by ``increase()`` and
    by an alert on it: the first failed reload went unseen."""
    p = await started(tls_settings(tmp_path, upstream.url, pki))
    try:
        for result in ("success", "failure"):
            assert p.metrics.registry.get_sample_value(
                "karta_proxy_tls_certificate_reloads_total", {"result": result}) == 0
    finally:
        await p.stop()


async def test_a_load_that_fails_names_the_file(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    """OpenSSL's words (``no certificate or crl found``, ``PEM lib``) name no file, and the
    line listed all three: which one to fix was a guess."""
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    caplog.set_level(logging.ERROR, logger="karta.tls")
    try:
        assert p.tls is not None
        bundle.write_text("not a certificate\n")
        assert p.tls.check() is False
        (line,) = [r for r in caplog.records if r.getMessage() == "TLS files not loaded; "
                   "the certificate in use stays"]
        assert line.__dict__["error"].startswith(f"cannot load {str(bundle)!r}: ")
        bundle.write_bytes(pki.ca.ca_file.read_bytes())
        pki.server.key.write_bytes(pki.ca.issue("other", server=True).key.read_bytes())
        outcome = await p.reload()
        assert not outcome.ok and f"cannot load {str(pki.server.cert)!r} with " \
            f"{str(pki.server.key)!r}: " in outcome.error, outcome
    finally:
        await p.stop()


#: a comment line in a CA bundle, as the Mozilla bundle (and certifi) carry them
NON_ASCII_COMMENT = "# Issuer: CN=Zürich Root CA, O=Grüezi AG\n".encode()


async def test_a_client_ca_bundle_with_non_ascii_comments_loads(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    """The validation loads the bundle as a file (it passed); the listener read it as
    ASCII text with replacement characters and gave it to ``cadata=``: a TypeError at
    start (exit 1), and at every rotation a traceback."""
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(NON_ASCII_COMMENT + pki.ca.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    try:
        assert p.tls is not None
        assert (await fetch(p.port, pki.ca.ca_file, pki.client)).status == "HTTP/1.1 200 OK"
        newer = Authority(tmp_path / "newer", "newer-ca")
        bundle.write_bytes(NON_ASCII_COMMENT + pki.ca.ca_file.read_bytes()
                           + NON_ASCII_COMMENT + newer.ca_file.read_bytes())
        caplog.clear()
        assert p.tls.check() is True
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        client2 = newer.issue("agent-2", server=False)
        assert (await fetch(p.port, pki.ca.ca_file, client2)).status == "HTTP/1.1 200 OK"
        outcome = await p.reload()
        assert outcome.ok, outcome
    finally:
        await p.stop()


async def test_a_check_that_fails_in_any_way_is_logged_once_and_keeps_serving(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only ``SSLError`` and ``OSError``: whatever a load raises is a failed load,
    logged once per state of the files, never a traceback at every check."""
    s = tls_settings(tmp_path, upstream.url, pki)
    p = await started(s, tls_check_interval=0)
    try:
        assert p.tls is not None

        def broken(*_: object, **__: object) -> None:
            raise TypeError("something unforeseen")

        monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", broken)
        pki.server.cert.write_bytes(pki.server.cert.read_bytes())  # a new stamp
        caplog.clear()
        for _ in range(3):
            assert p.tls.check(force=True) is False
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "something unforeseen" in errors[0].__dict__["error"], errors
        assert not any(r.exc_info for r in errors)
        monkeypatch.undo()
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-a"
    finally:
        await p.stop()


def tls_loads(p: Proxy, result: str) -> float:
    return p.metrics.registry.get_sample_value(
        "karta_proxy_tls_certificate_reloads_total", {"result": result}) or 0.0


async def test_each_failed_reload_is_counted_and_logged_and_a_check_counts_a_state_once(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
) -> None:
    """A reload failing as the last check had was neither counted nor logged (the
    check's "each distinct failure once" swallowed it): an operator's SIGHUP left no
    trace of its TLS files. Checks still count files that stay broken once."""
    bundle = tmp_path / "clients.pem"
    bundle.write_bytes(pki.ca.ca_file.read_bytes())
    s = tls_settings(tmp_path, upstream.url, pki, tls_client_ca_file=str(bundle))
    p = await started(s, tls_check_interval=0)
    try:
        assert p.tls is not None
        bundle.write_text("not a certificate\n")
        caplog.clear()
        for _ in range(2):
            assert p.tls.check() is False
        assert tls_loads(p, "failure") == 1
        for _ in range(2):
            assert not (await p.reload()).ok
        assert p.tls.check() is False  # the state the reloads failed on: counted by them
        assert tls_loads(p, "failure") == 3
        lines = [r for r in caplog.records if r.getMessage().startswith("TLS files not loaded")]
        assert len(lines) == 3, lines
    finally:
        await p.stop()


async def test_a_reload_does_not_put_back_files_older_than_a_check_loaded_meanwhile(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload builds its TLS context, awaits the rest of its work, then adopts the
    context: a check that loaded rotated files in between was overwritten by the older
    one, served until the files changed again."""
    s = tls_settings(tmp_path, upstream.url, pki)
    p = await started(s, tls_check_interval=0)
    follow = p._follow_kinds

    async def rotated_meanwhile() -> None:
        install(pki.ca.issue("proxy-b", server=True), pki.server)
        assert p.tls is not None and p.tls.check() is True
        await follow()

    monkeypatch.setattr(p, "_follow_kinds", rotated_meanwhile)
    try:
        assert (await p.reload()).ok
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-b"
        assert tls_loads(p, "success") == 2  # the check's and the reload's
    finally:
        await p.stop()


async def test_a_reload_whose_tls_files_fail_applies_nothing(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    """All or nothing: the TLS files are tried before anything is applied. The new enrich
    settings were in force while the reload answered 500 "the configuration in force
    stays"."""
    s = tls_settings(tmp_path, upstream.url, pki)
    loaded = copy.deepcopy(s)
    root = logging.getLogger()
    level = root.level
    p = Proxy(s, loader=lambda: copy.deepcopy(loaded), tls_check_interval=0)
    await p.start()
    try:
        assert p.tls is not None
        before, plan = copy.deepcopy(p.settings), p.enricher.plan
        loaded.enrich.pod_label_pairs = [("app_ns", "app_pod")]
        loaded.log_level = "debug"
        pki.server.key.write_bytes(pki.ca.issue("someone-else", server=True).key.read_bytes())
        outcome = await p.reload()
        assert not outcome.ok and "TLS" in outcome.error, outcome
        assert p.settings == before
        assert p.enricher.plan is plan
        assert root.level == level
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-a"
        assert p.metrics.registry.get_sample_value(
            "karta_proxy_config_last_reload_successful", {}) == 0.0
        # files fixed: the same reload goes through
        install(pki.ca.issue("proxy-b", server=True), pki.server)
        outcome = await p.reload()
        assert outcome.ok and "enrich.pod_label_pairs" in outcome.applied, outcome
        assert (await fetch(p.port, pki.ca.ca_file)).server_cn == "proxy-b"
    finally:
        root.setLevel(level)
        await p.stop()


@pytest.mark.parametrize(("valid", "words"), [
    ((datetime.timedelta(days=-3), datetime.timedelta(days=-1)), "has expired"),
    ((datetime.timedelta(days=1), datetime.timedelta(days=3)), "is not valid yet"),
])
async def test_a_certificate_out_of_its_validity_is_loaded_with_an_error_and_its_expiry(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture,
    valid: tuple[datetime.timedelta, datetime.timedelta], words: str,
) -> None:
    """An expired (or not yet valid) serving certificate loaded without a word: every
    verifying client refused, nothing on the proxy said why. Its notAfter is a gauge."""
    bad = pki.ca.issue("proxy-old", server=True, valid=valid)
    install(bad, pki.server)
    caplog.set_level(logging.INFO, logger="karta.tls")
    p = await started(tls_settings(tmp_path, upstream.url, pki), tls_check_interval=0)
    try:
        assert p.tls is not None
        (line,) = [r for r in caplog.records if words in r.getMessage()]
        assert line.levelno == logging.ERROR and line.__dict__["cert_file"] == p.tls.cert_file
        expiry = p.metrics.registry.get_sample_value(
            "karta_proxy_tls_certificate_expiry_timestamp_seconds", {})
        want = (datetime.datetime.now(datetime.UTC) + valid[1]).timestamp()
        assert expiry is not None and abs(expiry - want) < 120, (expiry, want)
        # a good one rotated in: no error, the gauge follows
        caplog.clear()
        install(pki.ca.issue("proxy-new", server=True), pki.server)
        assert p.tls.check() is True
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        later = p.metrics.registry.get_sample_value(
            "karta_proxy_tls_certificate_expiry_timestamp_seconds", {})
        assert later is not None and later > time.time() + 3600
    finally:
        await p.stop()


@pytest.mark.parametrize(
    ("server", "fragment"),
    [
        ({"tls_key_file": ""}, "set both or neither"),
        ({"tls_cert_file": ""}, "set both or neither"),
        ({"tls_key_file": "OTHER_KEY"}, "cannot load"),
        ({"tls_cert_file": "/nonexistent.pem"}, "does not exist or is not readable"),
        ({"tls_client_auth_type": "RequireAnyClientCert"}, "expected one of"),
        ({"tls_client_auth_type": "RequireAndVerifyClientCert"}, "needs server.tls_client_ca"),
        ({"tls_client_ca_file": "CA", "tls_client_auth_type": "NoClientCert"},
         "no client certificate would be checked"),
        ({"tls_client_ca_file": "NOT_PEM"}, "server.tls_client_ca_file: cannot load"),
        ({"tls_cert_file": "", "tls_key_file": "", "tls_client_ca_file": "CA"}, "TLS is off"),
    ],
)
def test_invalid_tls_settings_name_the_key(
    tmp_path: Path, pki: Pki, server: dict[str, str], fragment: str,
) -> None:
    other_key = pki.ca.issue("someone-else", server=True).key
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    subst = {"OTHER_KEY": str(other_key), "CA": str(pki.ca.ca_file), "NOT_PEM": str(not_pem)}
    s = Settings()
    s.upstream.url = "http://127.0.0.1:1/api/v1/write"
    s.server.tls_cert_file = str(pki.server.cert)
    s.server.tls_key_file = str(pki.server.key)
    for k, v in server.items():
        setattr(s.server, k, subst.get(v, v))
    with pytest.raises(ConfigError, match=r"server\.tls_") as e:
        validate(s)
    assert fragment in str(e.value)


async def test_connections_past_the_limit_are_closed_before_their_handshake(
    tmp_path: Path, pki: Pki, upstream: ScriptedUpstream,
) -> None:
    s = tls_settings(tmp_path, upstream.url, pki)
    s.server.max_connections = 2
    p = await started(s)

    def value(name: str, **labels: str) -> float:
        return p.metrics.registry.get_sample_value(name, labels) or 0.0

    async def until_open(n: int) -> None:
        for _ in range(200):
            if value("karta_proxy_open_connections") == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never {n} open: {value('karta_proxy_open_connections')}")

    try:
        # two clients that never start their handshake hold both places
        idle = [await asyncio.open_connection("127.0.0.1", p.port) for _ in range(2)]
        await until_open(2)
        refused = await fetch(p.port, pki.ca.ca_file)
        assert refused.status == "" and refused.server_cn == "", refused
        assert value("karta_proxy_connections_refused_total", reason="max_connections") == 1
        assert value("karta_proxy_tls_handshake_failures_total", reason="client_closed") == 0
        # a handshake that fails gives its place back, as a closed connection does
        idle[0][1].write(b"GET / HTTP/1.1\r\n\r\n")
        idle[0][1].close()
        await until_open(1)
        assert (await fetch(p.port, pki.ca.ca_file)).status == "HTTP/1.1 200 OK"
        idle[1][1].close()
        await until_open(0)
    finally:
        await p.stop()
