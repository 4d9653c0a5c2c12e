"""Every client context of the proxy (the upstream's, with or without TLS settings, and the
Kubernetes client's) verifies a server's certificate as Go's ``crypto/x509`` does, the
verifier of Prometheus, vmagent and kubectl, on every Python (``proxy.tls_files.verify_as_go``);
and so does the listener verify client certificates, as Prometheus' own web config does.

Python 3.13's ``ssl.create_default_context`` added ``VERIFY_X509_STRICT``: the proxy on 3.13
refused an upstream or API server whose certificate a CA issued without an Authority Key
Identifier (``Missing Authority Key Identifier``), which it took on 3.11 and 3.12 and which
Prometheus takes (``tests/peers/test_e2e_tls.py``)."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.config import KubeSettings, UpstreamSettings
from proxy.kube.client import KubeClient, pool_context
from proxy.metrics import ProxyMetrics
from proxy.pb.prometheus.remote_pb2 import WriteRequest
from proxy.tls_files import client_context, server_context
from proxy.upstream import Upstream
from proxy.upstream_http import default_tls_context
from proxy.wire.primitives import Protocol
from tests.kubesim import KubeSim
from tests.scripted import Reply, ScriptedUpstream
from tests.tls_certs import Authority, Issued, without_aki


@pytest.fixture(scope="module")
def no_aki(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    """An internal CA's file and a server certificate it issued without an Authority Key
    Identifier."""
    return without_aki(tmp_path_factory.mktemp("pki"), "server")


def _verifies_as_go(ctx: ssl.SSLContext) -> None:
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert not ctx.verify_flags & ssl.VERIFY_X509_STRICT, ctx.verify_flags
    assert ctx.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN, ctx.verify_flags


def _pool_context(client: KubeClient) -> ssl.SSLContext:
    """The context the client's connection pool makes its connections with."""
    return pool_context(client.api.rest_client)


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext) -> None:
    """One TLS handshake between the two contexts in memory; raises the client's refusal."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, out, peer_in in ((c, c_out, s_in), (s, s_out, c_in)):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
            peer_in.write(out.read())
        if c.version() is not None and s.version() is not None:
            return
    raise AssertionError("handshake did not finish")


def test_a_strict_verifier_refuses_the_certificate(no_aki: Issued) -> None:
    """What the tests below stand on: the certificate is one strict verification refuses."""
    strict = ssl.create_default_context(cafile=str(no_aki.ca_file))
    strict.verify_flags |= ssl.VERIFY_X509_STRICT
    with pytest.raises(ssl.SSLCertVerificationError, match="Authority Key Identifier"):
        _handshake(strict, no_aki.pem.server_context())


def test_the_upstream_contexts_verify_as_go(no_aki: Issued) -> None:
    _verifies_as_go(default_tls_context())
    ctx = client_context(str(no_aki.ca_file), "", "", False)
    assert ctx is not None
    _verifies_as_go(ctx)
    _handshake(ctx, no_aki.pem.server_context())


async def test_the_upstream_takes_a_certificate_without_aki(no_aki: Issued) -> None:
    req = WriteRequest()
    ts = req.timeseries.add()
    ts.labels.add(name="__name__", value="up")
    ts.samples.add(value=1.0, timestamp=1000)
    async with ScriptedUpstream(Reply(204), ssl_context=no_aki.pem.server_context()) as up:
        u = Upstream(UpstreamSettings(url=up.url,
                                      tls_ca_file=str(no_aki.ca_file),
                                      timeout_seconds=2.0, connect_timeout_seconds=1.0),
                     ProxyMetrics())
        try:
            answer = await u.send(req.SerializeToString(), Protocol.V1)
        finally:
            await u.close()
    assert answer.status == 204, answer


@pytest.fixture
async def kube_client(no_aki: Issued, tmp_path: Path) -> AsyncIterator[KubeClient]:
    """A client of an API server whose certificate has no AKI, its CA in the kubeconfig."""
    sim = KubeSim(token="t", ssl_context=no_aki.pem.server_context())
    await sim.start()
    kc = tmp_path / "kubeconfig"
    kc.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "s", "cluster": {
            "server": sim.url, "certificate-authority": str(no_aki.ca_file)}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "s", "user": "u"}}],
    }))
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    yield client
    await client.close()
    await sim.close()


async def test_the_kube_client_takes_a_certificate_without_aki(kube_client: KubeClient) -> None:
    assert (await kube_client.request_json("/api/v1/pods"))["kind"] == "PodList"
    _verifies_as_go(_pool_context(kube_client))
    # a pool made again for renewed TLS files verifies the same way
    assert kube_client.credentials is not None
    await kube_client._new_pool(kube_client.credentials.cfg)
    _verifies_as_go(_pool_context(kube_client))
    assert (await kube_client.request_json("/api/v1/pods"))["kind"] == "PodList"


def test_the_listener_verifies_client_certificates_as_go(tmp_path: Path) -> None:
    """``server.tls_client_ca_file`` holding an intermediate CA alone: Go's verifier (the
    client CAs of Prometheus' web config) takes a client certificate it issued, every
    certificate of the pool being an anchor; OpenSSL's default asked for the issuer's
    issuer and refused (``unable to get issuer certificate``). A certificate of another
    CA is refused still."""
    root = Authority(tmp_path, "root")
    intermediate = root.intermediate("intermediate")
    server = root.issue("karta-proxy", server=True)
    listener = server_context(str(server.cert), str(server.key), str(intermediate.ca_file),
                              ssl.CERT_REQUIRED)
    assert not listener.verify_flags & ssl.VERIFY_X509_STRICT, listener.verify_flags
    assert listener.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN, listener.verify_flags
    _handshake(intermediate.issue("agent", server=False).client_context(root.ca_file),
               listener)
    stranger = Authority(tmp_path / "other", "other").issue("stranger", server=False)
    with pytest.raises(ssl.SSLError):
        _handshake(stranger.client_context(root.ca_file), listener)
