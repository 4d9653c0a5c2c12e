"""Prometheus 2.42 agent -> karta-proxy over HTTPS with mutual TLS (``remote_write.tls_config``)
-> Prometheus 2.42 receiver, with a throw-away CA (the agent's certificate of an intermediate
CA, the proxy's client CA file that intermediate alone). A second queue of the same agent without
a client certificate, and a third that does not trust the proxy's CA, are refused in the
handshake, deliver nothing, and are counted by the proxy; a certificate rotated under the
running proxy keeps the writes flowing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Settings, validate
from proxy.demo_exporter import DEMO_SNAPSHOT, FixtureExporter
from proxy.runtime import Proxy
from tests.peers.conftest import Peer, Peers, query, remote_write, scrape_configs, wait_until
from tests.scripted import ScriptedUpstream
from tests.test_tls import fetch
from tests.tls_certs import Authority, install, without_aki

pytestmark = pytest.mark.peers


@pytest.fixture
async def tls_proxy_factory() -> AsyncIterator[list[Proxy]]:
    started: list[Proxy] = []
    yield started
    for p in started:
        await p.stop()


async def agent_values(agent: Peer, name: str) -> dict[str, float]:
    """``name`` (a family of the agent's /metrics) by ``remote_name``."""
    async with aiohttp.ClientSession() as s, s.get(agent.base_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for sample in fam.samples:
                if sample.name in (name, name + "_total"):
                    out[sample.labels.get("remote_name", "")] = sample.value
    return out


async def test_agent_writes_over_mtls_and_one_without_a_cert_is_refused(
    peers: Peers, exporter: FixtureExporter, tmp_path: Path, tls_proxy_factory: list[Proxy],
) -> None:
    ca = Authority(tmp_path / "pki", "test-ca")
    server = ca.issue("karta-proxy", server=True)
    # the agents' certificates come from an intermediate CA, and the proxy trusts that
    # one alone, as Prometheus' web config takes it (every CA in the file an anchor)
    agents_ca = ca.intermediate("agents-ca")
    client = agents_ca.issue("prom-agent", server=False)
    receiver = await peers.prometheus_receiver()

    s = Settings()
    s.snapshot = str(DEMO_SNAPSHOT)
    s.upstream.url = receiver.base_url + "/api/v1/write"
    s.server.listen_address = "127.0.0.1:0"
    s.server.tls_cert_file = str(server.cert)
    s.server.tls_key_file = str(server.key)
    s.server.tls_client_ca_file = str(agents_ca.ca_file)  # RequireAndVerifyClientCert
    s.facts.enabled = False
    validate(s)
    proxy = Proxy(s, tls_check_interval=0.2)
    await proxy.start()
    tls_proxy_factory.append(proxy)
    url = f"https://127.0.0.1:{proxy.port}/api/v1/write"

    with_cert = {**remote_write(url), "name": "with-cert", "tls_config": {
        "ca_file": str(ca.ca_file), "cert_file": str(client.cert), "key_file": str(client.key)}}
    no_cert = {**remote_write(url), "name": "no-cert",
               "tls_config": {"ca_file": str(ca.ca_file)}}
    # a client certificate, but the proxy's own certificate is of a CA it does not trust
    elsewhere = Authority(tmp_path / "elsewhere", "elsewhere-ca")
    wrong_ca = {**remote_write(url), "name": "wrong-ca", "tls_config": {
        "ca_file": str(elsewhere.ca_file), "cert_file": str(client.cert),
        "key_file": str(client.key)}}
    agent = await peers.prometheus_agent({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": scrape_configs(exporter),
        "remote_write": [with_cert, no_cert, wrong_ca],
    })
    n_pods = len(exporter.model.pods)

    async def landed() -> bool:
        # every pod's series (a scrape's samples may arrive over several sends), enriched
        got = await query(receiver.base_url, "count(pod_memory_working_set_bytes)")
        stamped = await query(receiver.base_url,
                              "count(pod_memory_working_set_bytes{karta_workload!=''})")
        return (bool(got) and int(float(got[0]["value"][1])) == n_pods
                and bool(stamped) and int(float(stamped[0]["value"][1])) > 0)

    await wait_until(landed, timeout=30, what="enriched series through the mTLS proxy")

    async def refused_queue_retrying() -> bool:
        retried = await agent_values(agent, "prometheus_remote_storage_samples_retried")
        return retried.get("no-cert", 0.0) > 0

    await wait_until(refused_queue_retrying, timeout=30,
                     what="the queue without a client certificate to retry")
    # the refused queue delivered nothing, the certified one did (the gauge moves only on
    # a successful send)
    sent = await agent_values(
        agent, "prometheus_remote_storage_queue_highest_sent_timestamp_seconds")
    assert sent.get("with-cert", 0.0) > 0, sent
    assert sent.get("no-cert", 0.0) == 0.0, sent
    assert sent.get("wrong-ca", 0.0) == 0.0, sent

    async def refusals_counted() -> bool:
        # Go's TLS sends an alert when it refuses the proxy's certificate
        counts = {r: proxy.metrics.registry.get_sample_value(
            "karta_proxy_tls_handshake_failures_total", {"reason": r}) or 0.0
            for r in ("no_client_certificate", "server_certificate_rejected")}
        return all(v > 0 for v in counts.values())

    await wait_until(refusals_counted, timeout=30,
                     what="both refused queues counted as handshake failures")
    ok = proxy.metrics.registry.get_sample_value(
        "karta_proxy_requests_total", {"path": "/api/v1/write", "protocol": "v1", "code": "204"})
    assert ok and ok > 0

    # -- rotation: a new certificate of the same CA, swapped under the running proxy ----
    assert proxy.tls is not None
    install(ca.issue("karta-proxy-rotated", server=True), server)

    async def rotated() -> bool:
        v = proxy.metrics.registry.get_sample_value(
            "karta_proxy_tls_certificate_reloads_total", {"result": "success"})
        return bool(v)

    await wait_until(rotated, timeout=10, what="the rotated certificate loaded")
    # a new handshake gets the new certificate (the agent may keep its connection)
    seen = await fetch(proxy.port, ca.ca_file, client)
    assert (seen.server_cn, seen.status) == ("karta-proxy-rotated", "HTTP/1.1 200 OK"), seen
    before = ok
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = proxy.metrics.registry.get_sample_value(
            "karta_proxy_requests_total",
            {"path": "/api/v1/write", "protocol": "v1", "code": "204"}) or 0.0
        if now > before + 2:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("writes stopped after the certificate rotation")
    # the refused queue retries through the agent's shutdown flush: do not wait for it
    await agent.astop(timeout=2)


async def test_victoria_metrics_over_tls_is_written_once_its_ca_is_fixed_and_reloaded(
    peers: Peers, tmp_path: Path, tls_proxy_factory: list[Proxy],
) -> None:
    """VictoriaMetrics serving HTTPS (-tls) with a certificate of a CA the proxy's
    upstream.tls_ca_file does not hold: writes 502. The CA file fixed on disk and a
    reload (SIGHUP's): the next write is stored. The client context was built once at
    start: it stayed 502 until a restart (audit tls/upstream_ca_rotate.sh)."""
    import copy
    import json
    import ssl

    from proxy.sender import Series, send_series
    from tests.peers.conftest import free_port, need

    binary = need("victoria-metrics")
    right = Authority(tmp_path / "right", "right-ca")
    wrong = Authority(tmp_path / "wrong", "wrong-ca")
    served = right.issue("tsdb", server=True)
    port = free_port()
    vm = peers._peer("vm-tls", [
        binary, f"-httpListenAddr=127.0.0.1:{port}", f"-storageDataPath={tmp_path / 'vm'}",
        "-search.latencyOffset=0s", "-search.disableCache", "-loggerLevel=WARN",
        "-tls", f"-tlsCertFile={served.cert}", f"-tlsKeyFile={served.key}",
    ], port, "/health")
    base = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(right.ca_file))

    async def healthy() -> bool:
        assert vm.proc is not None and vm.proc.poll() is None, vm.log_tail()
        async with aiohttp.ClientSession() as c, c.get(base + "/health", ssl=trust) as r:
            return r.status == 200

    await wait_until(healthy, timeout=30, what="victoria-metrics over TLS")

    ca_file = tmp_path / "upstream-ca.pem"
    ca_file.write_bytes(wrong.ca_file.read_bytes())
    s = Settings()
    s.snapshot = str(DEMO_SNAPSHOT)
    s.upstream.url = base + "/api/v1/write"
    s.upstream.tls_ca_file = str(ca_file)
    s.upstream.timeout_seconds, s.upstream.connect_timeout_seconds = 5.0, 2.0
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    validate(s)
    p = Proxy(s, loader=lambda: copy.deepcopy(s))
    await p.start()
    tls_proxy_factory.append(p)
    write = f"http://127.0.0.1:{p.port}/api/v1/write"
    labels = {"__name__": "tls_probe", "namespace": "web", "pod": "frontend-6d8f7b9c5d-4xkqp"}
    async with aiohttp.ClientSession() as c:
        now = int(time.time() * 1000)
        status, _, _ = await send_series(write, [Series({**labels, "try": "1"}, [(now, 1.0)])],
                                         session=c)
        assert status == 502
        ca_file.write_bytes(right.ca_file.read_bytes())
        outcome = await p.reload()
        assert outcome.ok, outcome
        status, _, body = await send_series(
            write, [Series({**labels, "try": "2"}, [(now, 2.0)])], session=c)
        assert status == 204, body
        stored: list[dict[str, str]] = []

        async def exported() -> bool:
            async with c.get(base + "/internal/force_flush", ssl=trust) as r:
                assert r.status == 200
            async with c.get(base + "/api/v1/export", ssl=trust, params={
                    "match[]": '{__name__="tls_probe"}', "start": f"{now / 1000 - 60:.0f}"}) as r:
                stored[:] = [json.loads(line)["metric"] for line in (await r.text()).splitlines()]
            return bool(stored)

        await wait_until(exported, timeout=15, what="the write in VictoriaMetrics")
    assert [(m["try"], m.get("karta_workload")) for m in stored] == [("2", "frontend")], stored


async def test_prometheus_takes_a_server_certificate_without_aki(
    peers: Peers, exporter: FixtureExporter, tmp_path: Path,
) -> None:
    """What the proxy's clients verify as (``tests/test_tls_verification.py``): Go's
    ``crypto/x509`` takes a server certificate a CA issued without an Authority Key
    Identifier, which Python 3.13's default context refuses."""
    tsdb = without_aki(tmp_path / "pki", "tsdb")
    async with ScriptedUpstream(ssl_context=tsdb.pem.server_context()) as up:
        agent = await peers.prometheus_agent({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": scrape_configs(exporter),
            "remote_write": [{**remote_write(up.url),
                              "tls_config": {"ca_file": str(tsdb.ca_file)}}],
        })

        async def written() -> bool:
            return bool(up.received)

        await wait_until(written, timeout=30, what="a write over TLS from the agent")
        await agent.astop(timeout=5)
