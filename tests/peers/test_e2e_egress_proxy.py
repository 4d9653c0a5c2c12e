"""The upstream reached through an HTTP proxy (``upstream.proxy_url``, Debian's tinyproxy):
a Prometheus agent's writes through karta-proxy and the HTTP proxy into a Prometheus
receiver, stamped; an https:// upstream through a CONNECT tunnel; the proxy's refusal of
missing credentials (407) never a 4xx a sender drops; loopback reached directly once
``no_proxy`` is set, as Go's rules say. Through a SOCKS5 proxy (Debian's microsocks) the
same: the writes stamped, TLS end to end, the name resolved by the proxy, and its every
refusal a 502 the sender retries. The Kubernetes client through each kind of proxy a
kubeconfig's proxy-url may name (HTTP, HTTPS, SOCKS5), the proxy's lists and watches
through SOCKS5."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from proxy.config import KubeSettings, UpstreamSettings
from proxy.demo_exporter import FixtureExporter
from proxy.kube.client import KubeClient
from proxy.metrics import ProxyMetrics
from proxy.pb.prometheus.remote_pb2 import WriteRequest
from proxy.upstream import Upstream
from proxy.wire.primitives import Protocol
from tests.kube.conftest import deployment
from tests.kube.conftest import pod as pod_object
from tests.kubesim.server import KubeSim
from tests.oauth2_endpoint import TokenEndpoint
from tests.peers.conftest import (
    InProcessProxy,
    Peer,
    Peers,
    free_port,
    remote_write,
    scrape_configs,
    wait_stamped,
    wait_until,
)
from tests.scripted import ScriptedUpstream
from tests.test_e2e_kube import kube_settings, start_proxy
from tests.test_upstream_oauth2 import SECRET, source
from tests.tls_certs import Authority

pytestmark = pytest.mark.peers

USER, PASSWORD = "karta", "s3cr3t-pa55"


def _one_series() -> bytes:
    req = WriteRequest()
    ts = req.timeseries.add()
    ts.labels.add(name="__name__", value="up")
    ts.samples.add(value=1.0, timestamp=1000)
    return req.SerializeToString()


async def _send(settings: UpstreamSettings) -> tuple[int, str]:
    """One RW 1.0 write through a fresh ``Upstream``: its status and body for the sender."""
    u = Upstream(settings, ProxyMetrics())
    try:
        answer = await u.send(_one_series(), Protocol.V1)
    finally:
        await u.close()
    return answer.status, answer.body.decode("utf-8", "replace")


async def _egress_with_login(peers: Peers, kind: str, ca: Authority | None = None
                             ) -> tuple[Peer, str]:
    """A proxy of ``kind`` (``http``: tinyproxy; ``https``: stunnel4 before it, its
    certificate from ``ca``, named localhost; ``socks5``: microsocks) that asks for
    USER:PASSWORD: the peer whose log says what it relayed, and its URL with the login."""
    if kind == "socks5":
        socks = await peers.microsocks(login=(USER, PASSWORD))
        return socks, f"socks5://{USER}:{PASSWORD}@127.0.0.1:{socks.port}"
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    if kind == "http":
        return http_proxy, f"http://{USER}:{PASSWORD}@127.0.0.1:{http_proxy.port}"
    assert ca is not None
    edge = ca.issue("egress", server=True)
    front = await peers.stunnel(http_proxy.port, edge.cert, edge.key)
    return http_proxy, f"https://{USER}:{PASSWORD}@localhost:{front.port}"


@pytest.mark.parametrize("scheme", ["http", "socks5"])
async def test_agent_writes_land_stamped_through_the_proxy(
    peers: Peers, exporter: FixtureExporter, make_proxy: object, scheme: str,
) -> None:
    """http://: absolute-form requests to tinyproxy with its Basic credentials; socks5://:
    a tunnel through microsocks, which asked for the login (RFC 1929). Loopback included:
    proxy_url alone sends every request through it, as Go's http.ProxyURL does."""
    receiver = await peers.prometheus_receiver()
    egress, proxy_url = await _egress_with_login(peers, scheme)
    relayed = (f"POST http://127.0.0.1:{receiver.port}/api/v1/write" if scheme == "http"
               else f"connected to 127.0.0.1:{receiver.port}")
    assert callable(make_proxy)
    proxy: InProcessProxy = await make_proxy(receiver.base_url + "/api/v1/write",
                                             proxy_url=proxy_url)
    await peers.prometheus_agent({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": scrape_configs(exporter),
        "remote_write": [remote_write(proxy.write_url)],
    })
    await wait_stamped(receiver.base_url, what=f"stamped series through the {scheme} proxy")
    log = egress.log_tail(200_000)
    assert relayed in log, log[-2000:]
    assert PASSWORD not in proxy.proxy.upstream.egress.describe()  # type: ignore[union-attr]


async def test_an_https_upstream_goes_through_a_connect_tunnel(
    peers: Peers, tmp_path: Path,
) -> None:
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    ca = Authority(tmp_path / "pki")
    tsdb = ca.issue("tsdb", server=True)
    async with ScriptedUpstream(ssl_context=tsdb.server_context()) as up:
        status, body = await _send(UpstreamSettings(
            url=up.url, tls_ca_file=str(ca.ca_file), timeout_seconds=5,
            connect_timeout_seconds=3,
            proxy_url=f"http://{USER}:{PASSWORD}@127.0.0.1:{http_proxy.port}"))
        assert status == 204, body
        assert len(up.received) == 1
        # the tunnel carried TLS end to end: the proxy saw the CONNECT, never the POST
        log = http_proxy.log_tail(200_000)
        assert f"CONNECT 127.0.0.1:{up.port}" in log, log[-2000:]
        assert "POST" not in log


async def test_proxy_connect_header_carries_the_connects_credentials(
    peers: Peers, tmp_path: Path,
) -> None:
    """Prometheus' proxy_connect_header: the proxy's credentials in the CONNECT's own
    headers, not the URL. tinyproxy takes the tunnel with them, and refuses it (407)
    without them: the header is what let it through."""
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    ca = Authority(tmp_path / "pki")
    tsdb = ca.issue("tsdb", server=True)
    credential = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    async with ScriptedUpstream(ssl_context=tsdb.server_context()) as up:
        for header, expected in (({"Proxy-Authorization": [credential]}, 204), ({}, 502)):
            status, body = await _send(UpstreamSettings(
                url=up.url, tls_ca_file=str(ca.ca_file), timeout_seconds=5,
                connect_timeout_seconds=3, proxy_url=f"http://127.0.0.1:{http_proxy.port}",
                proxy_connect_header=header))
            assert status == expected, body
        assert len(up.received) == 1
        assert "answered 407 to CONNECT" in body, body


async def test_missing_proxy_credentials_are_never_a_4xx_a_sender_drops(
    peers: Peers, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """tinyproxy refuses missing credentials with 407 and wrong ones with 401 (its own
    way). To an absolute-form request either is a 503 + Retry-After (the configuration's
    fault, counted as credentials_refused); to a CONNECT, no connection (502). A sender
    retries both and keeps its data; no answer or log says the password."""
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    where = f"127.0.0.1:{http_proxy.port}"
    bodies: list[str] = []
    ca = Authority(tmp_path / "pki")
    tls = ca.issue("tsdb", server=True).server_context()
    for proxy_url, said in ((f"http://{where}", "407"),
                            (f"http://{USER}:not-{PASSWORD}@{where}", "401")):
        metrics = ProxyMetrics()
        async with ScriptedUpstream() as up:
            u = Upstream(UpstreamSettings(url=up.url, timeout_seconds=5,
                                          proxy_url=proxy_url), metrics)
            try:
                answer = await u.send(_one_series(), Protocol.V1)
                assert metrics.registry.get_sample_value(
                    "karta_proxy_upstream_misconfigured_total",
                    {"url": up.url, "reason": "credentials_refused", "code": said}) == 1.0
                # the start-up check says so too, naming the HTTP proxy's credentials
                caplog.clear()
                with caplog.at_level(logging.ERROR, logger="karta.upstream"):
                    assert (await u.check()).outcome == "credentials_refused"
                assert "HTTP proxy" in caplog.records[-1].getMessage(), caplog.text
            finally:
                await u.close()
            body = answer.body.decode()
            assert (answer.status, answer.headers.get("Retry-After")) == (503, "30"), body
            assert f"answered {said}" in body and "upstream.proxy_url" in body, body
            assert not up.received
            bodies.append(body)
        async with ScriptedUpstream(ssl_context=tls) as up:
            status, body = await _send(UpstreamSettings(
                url=up.url, tls_ca_file=str(ca.ca_file), timeout_seconds=5,
                proxy_url=proxy_url))
            assert status == 502, body
            assert f"answered {said} to CONNECT" in body, body
            assert not up.received
            bodies.append(body)
    for text in (*bodies, http_proxy.log_tail()):
        assert f"not-{PASSWORD}" not in text


async def test_no_proxy_reaches_loopback_directly() -> None:
    """With no_proxy set, Go's rules: localhost and loopback addresses are reached
    directly (here the proxy_url names a port nothing listens on)."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with ScriptedUpstream() as up:
        status, body = await _send(UpstreamSettings(
            url=up.url, timeout_seconds=5, connect_timeout_seconds=2, proxy_url=dead,
            no_proxy="tsdb.example.com"))
        assert status == 204, body
        status, body = await _send(UpstreamSettings(
            url=up.url, timeout_seconds=5, connect_timeout_seconds=2, proxy_url=dead))
        assert status == 502 and "through the HTTP proxy" in body, body


async def test_an_https_upstream_goes_through_socks5_by_name(
    peers: Peers, tmp_path: Path,
) -> None:
    """TLS from karta-proxy to the upstream inside the SOCKS5 tunnel, verified against
    the upstream's name, which the proxy resolved (``socks5h`` is the same, as in Go)."""
    socks = await peers.microsocks()
    ca = Authority(tmp_path / "pki")
    tsdb = ca.issue("tsdb", server=True)
    async with ScriptedUpstream(ssl_context=tsdb.server_context()) as up:
        for scheme in ("socks5", "socks5h"):
            status, body = await _send(UpstreamSettings(
                url=f"https://localhost:{up.port}/api/v1/write", tls_ca_file=str(ca.ca_file),
                timeout_seconds=5, connect_timeout_seconds=3,
                proxy_url=f"{scheme}://127.0.0.1:{socks.port}"))
            assert status == 204, body
        assert len(up.received) == 2
    assert f"connected to localhost:{up.port}" in socks.log_tail(200_000)


async def test_an_https_proxy_is_spoken_to_over_tls(peers: Peers, tmp_path: Path) -> None:
    """``proxy_url: https://`` (Go's transport takes it): TLS to the proxy (stunnel before
    tinyproxy), verified with the upstream's TLS settings as Go verifies it; an http://
    upstream's requests in absolute form over it, an https:// one's TLS inside it. A
    proxy whose certificate the CA did not sign is a 502 saying so."""
    ca = Authority(tmp_path / "pki")
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    edge = ca.issue("egress", server=True)
    https_proxy = await peers.stunnel(http_proxy.port, edge.cert, edge.key)
    proxy_url = f"https://{USER}:{PASSWORD}@localhost:{https_proxy.port}"
    tsdb = ca.issue("tsdb", server=True)
    async with ScriptedUpstream() as plain, \
            ScriptedUpstream(ssl_context=tsdb.server_context()) as secure:
        for up in (plain, secure):
            status, body = await _send(UpstreamSettings(
                url=up.url, tls_ca_file=str(ca.ca_file), timeout_seconds=5,
                connect_timeout_seconds=3, proxy_url=proxy_url))
            assert status == 204, body
            assert len(up.received) == 1
        log = http_proxy.log_tail(200_000)
        assert f"POST http://127.0.0.1:{plain.port}/api/v1/write" in log, log[-2000:]
        assert f"CONNECT 127.0.0.1:{secure.port}" in log, log[-2000:]
        other = Authority(tmp_path / "other-pki")
        status, body = await _send(UpstreamSettings(
            url=plain.url, tls_ca_file=str(other.ca_file), timeout_seconds=5,
            connect_timeout_seconds=3, proxy_url=proxy_url))
        assert status == 502, body
        assert "cannot speak TLS to the HTTPS proxy https://localhost:" in body, body
        assert "CERTIFICATE_VERIFY_FAILED" in body and PASSWORD not in body, body
        assert len(plain.received) == 1


async def test_a_socks5_proxys_refusals_are_502s_a_sender_retries(peers: Peers) -> None:
    """No login where one is asked for, a wrong one, an upstream the proxy cannot reach:
    each a 502 naming what the SOCKS5 proxy said, never the password, nothing sent."""
    socks = await peers.microsocks(login=(USER, PASSWORD))
    where = f"127.0.0.1:{socks.port}"
    dead = free_port()
    async with ScriptedUpstream() as up:
        for proxy_url, url, said in (
                (f"socks5://{where}", up.url, "accepts none of the authentication methods "
                                              "offered: it likely asks for a user:password"),
                (f"socks5://{USER}:not-{PASSWORD}@{where}", up.url,
                 "refused the user:password of upstream.proxy_url"),
                (f"socks5://{USER}:{PASSWORD}@{where}", f"http://127.0.0.1:{dead}/write",
                 f"refused CONNECT 127.0.0.1:{dead}: connection refused")):
            status, body = await _send(UpstreamSettings(
                url=url, timeout_seconds=5, connect_timeout_seconds=3, proxy_url=proxy_url))
            assert status == 502, body
            assert "SOCKS5 proxy socks5://" in body and said in body, body
            assert PASSWORD not in body
        assert not up.received


async def test_the_oauth2_token_is_fetched_through_its_own_proxy(
        peers: Peers, tmp_path: Path) -> None:
    """``upstream.oauth2.proxy_url`` (x/oauth2's client has its own, as Prometheus'
    config does), an HTTP proxy, an HTTPS one (verified with ``oauth2.tls_ca_file``) or
    a SOCKS5 one: the token comes through it."""
    http_proxy = await peers.tinyproxy(basic_auth=(USER, PASSWORD))
    socks = await peers.microsocks(login=(USER, PASSWORD))
    ca = Authority(tmp_path / "pki")
    edge = ca.issue("egress", server=True)
    https_proxy = await peers.stunnel(http_proxy.port, edge.cert, edge.key)
    async with TokenEndpoint(clients={"karta id": SECRET}) as endpoint:
        for proxy_url in (f"http://{USER}:{PASSWORD}@127.0.0.1:{http_proxy.port}",
                          f"https://{USER}:{PASSWORD}@127.0.0.1:{https_proxy.port}",
                          f"socks5://{USER}:{PASSWORD}@127.0.0.1:{socks.port}"):
            tokens = source(tmp_path, endpoint, proxy_url=proxy_url,
                            tls_ca_file=str(ca.ca_file))
            try:
                got = await tokens.authorization()
            finally:
                await tokens.close()
            assert isinstance(got, str) and endpoint.live(got), got
        assert len(endpoint.requests) == 3
    where = endpoint.url.removeprefix("http://").split("/")[0]
    assert f"POST {endpoint.url}" in http_proxy.log_tail(200_000)
    assert f"connected to {where}" in socks.log_tail(200_000)


async def _namespaces(kubeconfig: Path) -> list[str]:
    """The namespaces the kube client lists through ``kubeconfig``."""
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kubeconfig)))
    try:
        namespaces = await client.request_json("/api/v1/namespaces")
    finally:
        await client.close()
    return [n["metadata"]["name"] for n in namespaces["items"]]


@pytest.mark.parametrize(("kind", "api_tls"), [
    ("http", False), ("http", True), ("socks5", False), ("socks5", True),
    # an http:// API server's (kubectl proxy's, on loopback) HTTPS proxy would be
    # verified with the system's CAs: kubernetes-asyncio reads the cluster's CA for an
    # https:// server only (docs/kubernetes.md)
    ("https", True)])
async def test_the_kubeconfigs_proxy_url_is_followed(
        peers: Peers, tmp_path: Path, kind: str, api_tls: bool) -> None:
    """A cluster's proxy-url, of each kind kubectl takes: an HTTP proxy, one spoken to
    over TLS (verified with the cluster's CA, as client-go's TLS configuration verifies
    it), a SOCKS5 one (kubectl's way to a private cluster through ``ssh -D``). The lists
    go through it with its login from user:password@, to an http:// API server and to
    an https:// one by its name, TLS end to end."""
    ca = Authority(tmp_path / "pki")
    seen, proxy_url = await _egress_with_login(peers, kind, ca)
    server_tls = ca.issue("apiserver", server=True).server_context() if api_tls else None
    async with KubeSim(ssl_context=server_tls) as sim:
        server = sim.url.replace("127.0.0.1", "localhost")
        config = json.loads(sim.write_kubeconfig().read_text())
        config["clusters"][0]["cluster"] = {"server": server, "proxy-url": proxy_url,
                                            "certificate-authority": str(ca.ca_file)}
        path = tmp_path / "kubeconfig"
        path.write_text(json.dumps(config))
        assert "kube-system" in await _namespaces(path)
    log = seen.log_tail(200_000)
    # the API server's name, not an address: the proxy resolved it
    said = (f"connected to localhost:{sim.port}" if kind == "socks5" else
            f"CONNECT localhost:{sim.port}" if api_tls else f"GET {server}/api/v1/namespaces")
    assert said in log, log[-2000:]


async def test_the_proxy_lists_and_watches_its_cluster_through_socks5(
        peers: Peers, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """karta-proxy itself on a kubeconfig whose proxy-url is a SOCKS5 proxy: its lists
    fill the index, and a pod created afterwards comes in by the watch, streamed
    through the tunnel. The start log names the proxy, not its password."""
    socks = await peers.microsocks(login=(USER, PASSWORD))
    async with KubeSim() as sim, ScriptedUpstream() as up:
        _, rs, pods = deployment(sim, "web", "shop", replicas=2)
        settings = kube_settings(sim, up.url)
        config = json.loads(Path(settings.kube.kubeconfig).read_text())
        config["clusters"][0]["cluster"] = {
            "server": sim.url.replace("127.0.0.1", "localhost"),
            "proxy-url": f"socks5://{USER}:{PASSWORD}@127.0.0.1:{socks.port}"}
        path = tmp_path / "kubeconfig"
        path.write_text(json.dumps(config))
        settings.kube.kubeconfig = str(path)
        with caplog.at_level(logging.INFO, logger="proxy"):
            proxy = await start_proxy(settings)
        try:
            said = (f"the Kubernetes API server {config['clusters'][0]['cluster']['server']}"
                    f" is reached through the SOCKS5 proxy socks5://127.0.0.1:{socks.port}")
            assert said in caplog.text and PASSWORD not in caplog.text, caplog.text[-3000:]
            for p in pods:
                assert proxy.index.lookup(b"shop", p["metadata"]["name"].encode())
            assert proxy.index.lookup(b"shop", b"web-late") is None
            sim.create(pod_object("web-late", "shop", owner_obj=rs, labels={"app": "web"}))

            async def watched() -> bool:
                return proxy.index.lookup(b"shop", b"web-late") is not None

            await wait_until(watched, timeout=10, what="the pod created later indexed")
        finally:
            await proxy.stop()
    assert f"connected to localhost:{sim.port}" in socks.log_tail(200_000)


async def test_a_socks5_proxys_refusal_names_the_kubeconfig(
        peers: Peers, tmp_path: Path) -> None:
    """A login the SOCKS5 proxy refuses: the request fails saying so, never the
    password."""
    socks = await peers.microsocks(login=(USER, PASSWORD))
    async with KubeSim() as sim:
        config = json.loads(sim.write_kubeconfig().read_text())
        config["clusters"][0]["cluster"]["proxy-url"] = \
            f"socks5://{USER}:not-{PASSWORD}@127.0.0.1:{socks.port}"
        path = tmp_path / "kubeconfig"
        path.write_text(json.dumps(config))
        with pytest.raises(aiohttp.ClientConnectorError) as info:
            await _namespaces(path)
    said = str(info.value)
    assert f"the SOCKS5 proxy socks5://127.0.0.1:{socks.port} refused the user:password " \
        "of the kubeconfig cluster's proxy-url" in said, said
    assert PASSWORD not in said


async def test_a_loopback_api_server_is_reached_directly_despite_the_environments_proxy(
        peers: Peers, monkeypatch: pytest.MonkeyPatch) -> None:
    """kind's API server, or ``kubectl proxy``, at 127.0.0.1 with HTTP(S)_PROXY set (a
    corporate laptop): Go's rules reach loopback directly. The library's session read the
    environment by Python's, and sent every list and watch to the proxy, which here can
    reach loopback too: a proxy that cannot (most) failed them all."""
    http_proxy = await peers.tinyproxy()
    for name in ("NO_PROXY", "no_proxy", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{http_proxy.port}")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{http_proxy.port}")
    async with KubeSim() as sim:
        assert "kube-system" in await _namespaces(sim.write_kubeconfig())
    log = http_proxy.log_tail(200_000)
    assert "/api/v1/namespaces" not in log, log[-2000:]
