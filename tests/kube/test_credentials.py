"""Kubeconfig credentials renewed under a running client (proxy/kube/client.py
``Kubeconfig``): a token file, an exec plugin's token, a client certificate. The client
loaded a kubeconfig once, and every request was refused after a renewal until a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import incluster_config
from prometheus_client import CollectorRegistry

from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.kube.client import KubeApiError, KubeClient, Kubeconfig
from proxy.kube.source import KubeSource
from proxy.lease import LeaseElector
from tests.kube.conftest import deployment, eventually, labels, pod
from tests.kubesim import KubeSim
from tests.tls_certs import Authority, Pem, install

Obj = dict[str, Any]


def write_kubeconfig(path: Path, server: str, user: Obj, cluster: Obj | None = None) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "s", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "s", "user": "u"}}],
        "current-context": "c",
    }))
    return path


def exec_plugin(tmp: Path, token_file: Path, lifetime: float | None) -> Obj:
    """A kubeconfig user whose exec plugin prints the token in ``token_file``, valid for
    ``lifetime`` seconds (no expirationTimestamp for None), and counts its runs."""
    script = tmp / "plugin.py"
    runs = tmp / "runs"
    script.write_text(f"""import datetime, json
status = {{"token": open({str(token_file)!r}).read().strip()}}
if {lifetime!r} is not None:
    end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds={lifetime!r})
    status["expirationTimestamp"] = end.strftime("%Y-%m-%dT%H:%M:%SZ")
with open({str(runs)!r}, "a") as f:
    f.write("run\\n")
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": status}}))
""")
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1",
                     "command": sys.executable, "args": [str(script)],
                     "interactiveMode": "Never"}}


def plugin_runs(tmp: Path) -> int:
    runs = tmp / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


@pytest.fixture
async def rotating_sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(token="token-1", bookmark_interval=0.2, max_watch_seconds=3.0) as s:
        yield s


async def test_a_token_file_renewed_on_disk_is_used_at_the_next_request(
        rotating_sim: KubeSim, tmp_path: Path) -> None:
    """The old client kept the token it read at start: 401 on every request after."""
    token = tmp_path / "token"
    token.write_text("token-1")
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, {"tokenFile": str(token)})
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        await client.request_json("/api/v1/pods")
        token.write_text("token-2")
        rotating_sim.token = "token-2"
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        # the Lease's typed client shares the configuration
        assert client.api.configuration.api_key["BearerToken"] == "Bearer token-2"
    finally:
        await client.close()


async def test_a_credential_refused_for_good_fails_as_401_after_one_reload(
        rotating_sim: KubeSim, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A renewal that renews nothing is not retried: the watchers fail their own way
    ("API error 401"), warned of once by the source."""
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, {"token": "token-1"})
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        rotating_sim.token = "token-2"
        rotating_sim.requests.clear()
        with pytest.raises(KubeApiError) as info:
            await client.request_json("/api/v1/pods")
        assert info.value.status == 401
        assert len(rotating_sim.requests) == 1  # not sent again: nothing was renewed
        with pytest.raises(KubeApiError):
            await client.request_json("/api/v1/pods")
        # the kubeconfig itself renewed (a new token written into it): loaded again
        # before the next request
        write_kubeconfig(kc, rotating_sim.url, {"token": "token-2"})
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
    finally:
        await client.close()


async def test_an_exec_credential_is_renewed_before_it_expires(
        rotating_sim: KubeSim, tmp_path: Path) -> None:
    """A plugin's token that lives 20 s (EKS: 15 min) is renewed a fifth of its life
    before it ends, before the request: no request goes out with an expired one."""
    token = tmp_path / "token"
    token.write_text("token-1")
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url,
                          exec_plugin(tmp_path, token, lifetime=2))
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        await client.request_json("/api/v1/pods")
        runs = plugin_runs(tmp_path)
        await client.request_json("/api/v1/pods")
        assert plugin_runs(tmp_path) == runs  # cached while valid
        token.write_text("token-2")
        rotating_sim.token = "token-2"  # the old token refused from now on
        await asyncio.sleep(2.2)  # past its expiry (whole seconds: within 2 s)
        rotating_sim.requests.clear()
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        assert len(rotating_sim.requests) == 1  # renewed before: not refused first
        assert plugin_runs(tmp_path) == runs + 1
    finally:
        await client.close()


async def test_an_exec_credential_without_expiry_is_renewed_when_refused(
        rotating_sim: KubeSim, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As client-go: a plugin that names no expiry is run again on a 401, and the
    request sent again, with a warning naming the kubeconfig and what was renewed."""
    token = tmp_path / "token"
    token.write_text("token-1")
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url,
                          exec_plugin(tmp_path, token, lifetime=None))
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        await client.request_json("/api/v1/pods")
        token.write_text("token-2")
        rotating_sim.token = "token-2"
        with caplog.at_level(logging.WARNING, logger="proxy.kube.client"):
            assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        assert any(f"kubeconfig {kc}: the API server refused its credentials (401 "
                   "Unauthorized); loaded it again: renewed the token" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        await client.close()


async def test_the_source_follows_a_token_file_renewed(
        rotating_sim: KubeSim, tmp_path: Path) -> None:
    """The audit's case end to end: after the rotation every watch got 401 until a
    restart, the index stale and a pod created meanwhile never attributed (75 s)."""
    _, rs, _ = deployment(rotating_sim, "web", "shop", replicas=1)
    token = tmp_path / "token"
    token.write_text("token-1")
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, {"tokenFile": str(token)})
    source = KubeSource(KubeSettings(kubeconfig=str(kc), resync_backoff_max_seconds=0.5),
                        Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                        watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5)
    await source.start()
    try:
        token.write_text("token-2")
        rotating_sim.token = "token-2"
        rotating_sim.disconnect_watches()
        rotating_sim.create(pod("web-new", "shop", owner_obj=rs, labels={"app": "web"}))
        await eventually(lambda: labels(source, "shop", "web-new"), 5)
        assert not source.index.stale
    finally:
        await source.stop()


def _server_context(ca: Authority, server: Pem, client_ca: Authority) -> ssl.SSLContext:
    ctx = server.server_context()
    ctx.load_verify_locations(cafile=str(client_ca.ca_file))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@dataclass
class CertCluster:
    """A simulator that requires client certificates of one CA, a client whose kubeconfig
    names its certificate on disk, and the renewal: a certificate of another CA installed
    on disk, the server restarted trusting only that CA."""
    client: KubeClient
    sim: KubeSim
    renew: Callable[[], Awaitable[None]]


@contextlib.asynccontextmanager
async def _cert_cluster(tmp_path: Path) -> AsyncIterator[CertCluster]:
    ca = Authority(tmp_path / "ca")
    server = ca.issue("apiserver", server=True)
    old_ca, new_ca = Authority(tmp_path / "old", "old-ca"), Authority(tmp_path / "new", "new-ca")
    live = Pem(tmp_path / "client.crt", tmp_path / "client.key")
    install(old_ca.issue("proxy", server=False), live)
    sim = KubeSim(token="", ssl_context=_server_context(ca, server, old_ca))
    await sim.start()
    kc = write_kubeconfig(tmp_path / "kubeconfig", sim.url,
                          {"client-certificate": str(live.cert), "client-key": str(live.key)},
                          {"certificate-authority": str(ca.ca_file)})
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))

    async def renew() -> None:
        install(new_ca.issue("proxy", server=False), live)
        await sim.stop()
        sim.ssl_context = _server_context(ca, server, new_ca)
        await sim.start()

    try:
        yield CertCluster(client, sim, renew)
    finally:
        await client.close()
        await sim.close()


async def test_a_client_certificate_renewed_on_disk_is_used_at_the_next_connection(
        tmp_path: Path) -> None:
    """The client's SSL context was made once: a client certificate renewed on disk (and
    the old one refused) failed every handshake until a restart. The server here
    requires certificates of the client CA it is started with; it restarts trusting only
    a new one, as the certificate on disk is renewed to one of that CA."""
    async with _cert_cluster(tmp_path) as c:
        assert (await c.client.request_json("/api/v1/pods"))["kind"] == "PodList"
        await c.renew()
        assert (await c.client.request_json("/api/v1/pods"))["kind"] == "PodList"



async def test_a_kubeconfig_half_written_keeps_the_credentials_in_use(
        rotating_sim: KubeSim, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A kubeconfig caught mid-write does not load: the credentials in use stay (one
    warning), and it is not loaded again on every request."""
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, {"token": "token-1"})
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        kc.write_text('{"apiVersion": "v1", "kind": "Con')
        with caplog.at_level(logging.WARNING, logger="proxy.kube.client"):
            for _ in range(3):
                assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        warned = [r.getMessage() for r in caplog.records if "loading it again failed" in
                  r.getMessage()]
        assert len(warned) == 1 and str(kc) in warned[0], warned
    finally:
        await client.close()


# -- every API call through one check (CheckedApiClient): the Lease's too ---------------

LEASE_NS, LEASE_NAME, LEASE_SECONDS = "karta-proxy", "karta-proxy-facts", 1.5


def _lease_version(sim: KubeSim) -> int:
    lease = sim.get("coordination.k8s.io/v1", "Lease", LEASE_NAME, LEASE_NS)
    return int(lease["metadata"]["resourceVersion"])


async def _keeps_its_lease(client: KubeClient, sim: KubeSim,
                           rotate: Callable[[], Awaitable[None]]) -> None:
    """A LeaseElector alone on ``client`` (no source beside it: the fact writer of a
    ``--snapshot`` proxy) takes the lease, ``rotate`` renews the credentials and has the
    simulator refuse the old ones, and the elector must lead at every sample of the next
    4/3 lease durations (it steps down after 2/3 of one without a renewal) and have
    renewed the lease since."""
    elector = LeaseElector(client.api, LEASE_NS, LEASE_NAME, "only", LEASE_SECONDS)
    task = asyncio.create_task(elector.run())
    try:
        await eventually(lambda: elector.is_leader, 5)
        await rotate()
        rotated_at = _lease_version(sim)
        lost = 0
        for _ in range(int(LEASE_SECONDS * 4 / 3 / 0.05)):
            await asyncio.sleep(0.05)
            lost += not elector.is_leader
        assert _lease_version(sim) > rotated_at, \
            f"not renewed since the rotation: {elector.last_error}"
        assert lost == 0 and elector.acquisitions == 1, (lost, elector.last_error)
    finally:
        await elector.stop(release=False)
        await task


@pytest.mark.parametrize("credentials", ["token_file", "exec_plugin"])
async def test_a_lease_only_client_follows_a_token_renewed(
        rotating_sim: KubeSim, tmp_path: Path, credentials: str) -> None:
    """A token file: a guard, not a fix (the client's token hook looked at the
    kubeconfig's files before each call with a bearer token, the Lease's too, and still
    does so once, through CheckedApiClient). An exec plugin whose token names no expiry:
    only ``KubeClient.open`` renewed refused credentials, so a Lease call refused (401)
    failed every round, the replica no longer leading from 1 s after the rotation, until
    a restart."""
    token = tmp_path / "token"
    token.write_text("token-1")
    user = ({"tokenFile": str(token)} if credentials == "token_file"
            else exec_plugin(tmp_path, token, lifetime=None))
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, user)
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))

    async def rotate() -> None:
        token.write_text("token-2")
        rotating_sim.token = "token-2"

    try:
        await _keeps_its_lease(client, rotating_sim, rotate)
    finally:
        await client.close()


async def test_a_lease_only_client_follows_a_client_certificate_renewed(
        tmp_path: Path) -> None:
    """The token hook is the client's only call-time hook, and it runs only for a bearer
    token: with a client certificate the Lease never looked at the files, and every
    handshake after the server trusted only the renewed certificate failed until a
    restart (ServerDisconnectedError each round)."""
    async with _cert_cluster(tmp_path) as c:
        await _keeps_its_lease(c.client, c.sim, c.renew)


async def test_each_call_checks_the_credentials_once(
        rotating_sim: KubeSim, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source's request looked at the files twice (``KubeClient.open`` and the token
    hook inside the call); a Lease call with a client certificate never."""
    checks = 0
    current = Kubeconfig.current

    async def counted(self: Kubeconfig, *args: object) -> None:
        nonlocal checks
        checks += 1
        await current(self, *args)

    monkeypatch.setattr(Kubeconfig, "current", counted)
    token = tmp_path / "token"
    token.write_text("token-1")
    kc = write_kubeconfig(tmp_path / "kubeconfig", rotating_sim.url, {"tokenFile": str(token)})
    client = await KubeClient.connect(KubeSettings(kubeconfig=str(kc)))
    try:
        for _ in range(3):
            await client.request_json("/api/v1/pods")
        assert checks == 3
        with pytest.raises(ApiException):  # 404: no such Lease; a call all the same
            await k8s.CoordinationV1Api(client.api).read_namespaced_lease("x", "y")
        assert checks == 4
    finally:
        await client.close()


# -- the in-cluster service account -------------------------------------------------------

@dataclass(frozen=True)
class InClusterFiles:
    """A simulator serving HTTPS as the in-cluster API server, and the service account
    token file the client reads (with the CA beside it)."""

    sim: KubeSim
    token: Path


@pytest.fixture
async def in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     ) -> AsyncIterator[InClusterFiles]:
    """The pod's environment, pointed at temporary files: KUBERNETES_SERVICE_HOST and
    _PORT name the simulator, and the client's own in-cluster paths (which the old code
    read too) its token and CA."""
    ca = Authority(tmp_path / "ca")
    server = ca.issue("apiserver", server=True)
    sim = KubeSim(token="sa-token-1", ssl_context=server.server_context())
    await sim.start()
    token = tmp_path / "token"
    token.write_text("sa-token-1")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(sim.port))
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca.ca_file))
    yield InClusterFiles(sim, token)
    await sim.close()


async def test_an_in_cluster_token_renewed_is_used_at_the_next_request(
        in_cluster: InClusterFiles) -> None:
    """The client's in-cluster loader reads its token file again only once its copy is
    60 s old: a token the server stopped taking was refused (401) for up to a minute."""
    client = await KubeClient.connect(KubeSettings())
    try:
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        in_cluster.token.write_text("sa-token-2")
        in_cluster.sim.token = "sa-token-2"
        in_cluster.sim.requests.clear()
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        assert len(in_cluster.sim.requests) == 1  # read before the request: not refused
    finally:
        await client.close()


async def test_an_in_cluster_token_refused_is_read_again_once(
        in_cluster: InClusterFiles, caplog: pytest.LogCaptureFixture) -> None:
    """A 401 reads the token file again, and the request is sent once more if that found
    a new token: here one written in place with the old size and mtime restored (what a
    file system with coarse timestamps shows), which the stat before each request cannot
    tell. The client's loader never read the file on a 401. Refused again with nothing
    new, the refusal stands, sent once."""
    client = await KubeClient.connect(KubeSettings())
    try:
        assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        before = in_cluster.token.stat()
        with in_cluster.token.open("r+") as f:
            f.write("sa-token-2")
        os.utime(in_cluster.token, ns=(before.st_atime_ns, before.st_mtime_ns))
        in_cluster.sim.token = "sa-token-2"
        with caplog.at_level(logging.WARNING, logger="proxy.kube.client"):
            assert (await client.request_json("/api/v1/pods"))["kind"] == "PodList"
        assert any(f"service account token {in_cluster.token}: the API server refused its "
                   "credentials (401 Unauthorized); loaded it again: renewed the token"
                   in r.getMessage() for r in caplog.records), caplog.text
        in_cluster.sim.token = "sa-token-3"
        in_cluster.sim.requests.clear()
        with pytest.raises(KubeApiError) as info:
            await client.request_json("/api/v1/pods")
        assert info.value.status == 401 and len(in_cluster.sim.requests) == 1
    finally:
        await client.close()


async def test_an_in_cluster_lease_follows_a_token_renewed(
        in_cluster: InClusterFiles) -> None:
    """The fact writer's Lease in a pod: with the client's loader the renewals were
    refused for up to 60 s after the rotation, the replica no longer leading after 1 s
    of them (at the shipped 15 s lease: 10 s)."""
    client = await KubeClient.connect(KubeSettings())

    async def rotate() -> None:
        in_cluster.token.write_text("sa-token-2")
        in_cluster.sim.token = "sa-token-2"

    try:
        await _keeps_its_lease(client, in_cluster.sim, rotate)
    finally:
        await client.close()
