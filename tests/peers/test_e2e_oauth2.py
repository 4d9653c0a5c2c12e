"""``upstream.oauth2`` end to end: a Prometheus 2.42 agent writing through karta-proxy into
a Prometheus 2.42 receiver that takes only writes bearing a live token of an OAuth 2.0
token endpoint (a small gate in front of it: Prometheus has no bearer check of its own,
and no OAuth 2.0 server is installed, so the endpoint is tests/oauth2_endpoint.py's).

The agent writes the same scrapes straight into a second receiver, so what went through
the proxy is compared sample for sample: the tokens renewed as they near their expiry,
and an outage of the token endpoint is 503s the agent retries, nothing lost."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.aux_server import AuxServer
from proxy.config import OAuth2Settings, Settings
from proxy.demo_exporter import FixtureExporter
from tests.oauth2_endpoint import TokenEndpoint
from tests.peers.conftest import (
    InProcessProxy,
    Peers,
    agent_metrics,
    pod_sample_times,
    query,
    remote_write,
    scrape_configs,
    wait_until,
)

pytestmark = pytest.mark.peers

#: the headers of a remote write the gate passes on
_WRITE_HEADERS = ("Content-Type", "Content-Encoding", "X-Prometheus-Remote-Write-Version",
                  "User-Agent")


class BearerGate(AuxServer):
    """An authenticating gateway before a receiver: a write whose Authorization is not a
    live token of ``idp`` gets 401; one that is goes on, and its token is counted."""

    def __init__(self, idp: TokenEndpoint, target: str) -> None:
        self.idp = idp
        self.target = target
        #: Authorization -> writes passed with it
        self.passed: dict[str, int] = {}
        self.refused = 0
        self.url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/api/v1/write", self._write)
        port = await self.serve(app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}/api/v1/write"
        return self.url

    async def stop(self) -> None:
        await super().stop()
        if self._session is not None:
            await self._session.close()

    async def _write(self, request: web.Request) -> web.Response:
        authorization = request.headers.get("Authorization", "")
        if not self.idp.live(authorization):
            self.refused += 1
            return web.Response(status=401, text="invalid token\n",
                                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        self.passed[authorization] = self.passed.get(authorization, 0) + 1
        assert self._session is not None
        headers = {h: request.headers[h] for h in _WRITE_HEADERS if h in request.headers}
        async with self._session.post(self.target, data=await request.read(),
                                      headers=headers) as r:
            return web.Response(status=r.status, body=await r.read())


def _after(exp: FixtureExporter, n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return exp.scrapes["resource"] >= n

    return check


async def test_writes_go_with_the_token_renewed_and_ride_through_an_idp_outage(
    tmp_path: Path, peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    behind = await peers.prometheus_receiver("prom-behind-gate")
    direct = await peers.prometheus_receiver("prom-direct")
    secret = tmp_path / "client-secret"
    secret.write_text("s3cret\n")
    # 12 s tokens, used until 10 s before they expire: a new one every 2 s or so
    async with TokenEndpoint(clients={"karta": "s3cret"}, expires_in=12) as idp, \
            BearerGate(idp, behind.base_url + "/api/v1/write") as gate:

        def configure(s: Settings) -> None:
            s.upstream.oauth2 = OAuth2Settings(client_id="karta",
                                               client_secret_file=str(secret),
                                               token_url=idp.url, scopes=["write"])
            s.facts.enabled = True
            s.facts.interval_seconds = 1.0

        proxy = await make_proxy(gate.url, configure=configure)
        agent = await peers.prometheus_agent({
            "global": {"scrape_interval": "500ms"},
            "scrape_configs": scrape_configs(exporter, "500ms")[1:2],  # kubelet resource
            "remote_write": [remote_write(proxy.write_url),
                             remote_write(direct.base_url + "/api/v1/write")],
        })

        async def renewed() -> bool:
            got = await query(behind.base_url, "count(pod_memory_working_set_bytes)")
            return bool(got) and len(gate.passed) >= 3

        await wait_until(renewed, timeout=60, what="writes through the gate, tokens renewed")
        # the check at start and the fact writes went with the token too
        probe = proxy.proxy.upstream.probe
        assert probe is not None and probe.outcome in ("rw1", "rw2"), probe
        assert await query(behind.base_url, 'karta_build_info{karta_writer!=""}')
        assert all(idp.requests[i].form["scope"] == ["write"] for i in range(len(idp.requests)))

        # the token endpoint down: the next renewal fails, the agent is answered 503
        idp.down = True
        registry = proxy.proxy.metrics.registry

        def answered(code: str) -> float:
            return sum(s.value for f in registry.collect() if f.name == "karta_proxy_requests"
                       for s in f.samples if s.name == "karta_proxy_requests_total"
                       and s.labels.get("code") == code)

        async def refusing() -> bool:
            return answered("503") > 0

        await wait_until(refusing, timeout=30, what="503s while the token endpoint is down")
        await wait_until(_after(exporter, exporter.scrapes["resource"] + 4), timeout=20,
                         what="scrapes during the outage")
        idp.down = False
        await wait_until(_after(exporter, exporter.scrapes["resource"] + 4), timeout=20,
                         what="scrapes after recovery")
        metrics = await agent_metrics(agent, url=proxy.write_url)
        assert await agent.astop() == 0  # flushes what is queued
    assert metrics["samples_failed_total"] == 0, metrics  # no batch dropped for good
    assert metrics["samples_retried_total"] > 0, metrics  # the 503s were retried
    assert gate.refused == 0  # never a token past its expiry, nor none
    assert answered("401") == 0 and answered("400") == 0
    assert (registry.get_sample_value("karta_proxy_upstream_oauth2_token_fetches_total",
                                      {"result": "unavailable"}) or 0) > 0
    at = time.time()

    async def samples(base: str) -> dict[tuple[str, str], list[float]]:
        return await pod_sample_times(base, at)

    async def complete() -> bool:
        return await samples(behind.base_url) == await samples(direct.base_url)

    await wait_until(complete, timeout=20, what="every sample, through the outage too")
    got = await samples(behind.base_url)
    assert min(len(v) for v in got.values()) >= 8  # before, during and after the outage
