"""A redirecting front before the TSDB (no nginx on the test hosts: an aiohttp front that
answers as ingress-nginx's ``force-ssl-redirect`` does, ``308`` with a Location): a
Prometheus agent's writes through karta-proxy land stamped in a Prometheus 2.42 receiver
behind it, as they land when the agent writes through the front itself (Prometheus
follows a 308 with the same body); a 301, which no remote-write client follows with its
body, stays a 503 that names where it points."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy import via
from proxy.compression import compress
from proxy.config import UpstreamSettings
from proxy.metrics import ProxyMetrics
from proxy.upstream import Upstream
from proxy.wire.primitives import Protocol
from tests.peers.conftest import (
    InProcessProxy,
    Peers,
    query,
    remote_write,
    scrape_configs,
    wait_stamped,
    wait_until,
)
from tests.scripted import Received, ScriptedUpstream, redirect_to
from tests.test_upstream import v1_body

pytestmark = pytest.mark.peers

MakeProxy = Callable[..., Awaitable[InProcessProxy]]


async def test_agent_writes_land_stamped_through_a_308(
    peers: Peers, exporter: Any, make_proxy: MakeProxy,
) -> None:
    receiver = await peers.prometheus_receiver()
    async with ScriptedUpstream(
            rule=redirect_to(receiver.base_url + "/api/v1/write")) as front:
        proxy = await make_proxy(front.url)
        await peers.prometheus_agent({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": scrape_configs(exporter),
            "remote_write": [remote_write(proxy.write_url)],
        })
        await wait_stamped(receiver.base_url, what="stamped series through the redirect")
        upstream = proxy.proxy.upstream
        assert upstream.probe is not None and upstream.probe.outcome == "rw1"
        assert upstream.metrics is not None
        followed = upstream.metrics.registry.get_sample_value(
            "karta_proxy_upstream_redirects_total", {"result": "followed"})
        assert followed is not None and followed >= 2  # the check, then the writes
        assert len(front.received) + len(front.empty_writes) >= followed


async def test_a_301_is_a_503_naming_its_location(peers: Peers, make_proxy: MakeProxy
                                                  ) -> None:
    receiver = await peers.prometheus_receiver()
    target = receiver.base_url + "/api/v1/write"
    async with ScriptedUpstream(rule=redirect_to(target, 301)) as front:
        proxy = await make_proxy(front.url)
        async with aiohttp.ClientSession() as s, s.post(
                proxy.write_url, data=compress(v1_body(), "snappy"),
                headers={"Content-Type": "application/x-protobuf",
                         "Content-Encoding": "snappy",
                         "X-Prometheus-Remote-Write-Version": "0.1.0"}) as r:
            status, body, retry = r.status, await r.text(), r.headers.get("Retry-After")
    assert (status, retry) == (503, "30"), body
    assert f"it redirects to {target}, which is not followed" in body, body
    assert not await query(receiver.base_url, "up{job='a'}")


async def test_the_redirected_request_carries_what_prometheus_sends_there(
    peers: Peers, exporter: Any, tmp_path: Path,
) -> None:
    """The same redirect to another site (127.0.0.1 -> localhost), taken by a Prometheus
    agent writing straight through the front and by the proxy: the request that reaches
    the receiver carries the same headers (the credentials of the settings on it, as
    Prometheus' RoundTrippers set them on every request; a Referer naming the front),
    but the ``Accept: */*`` the proxy's client sends on every request."""
    token = tmp_path / "token"
    token.write_text("own-token\n")
    async with ScriptedUpstream() as receiver, ScriptedUpstream(
            rule=redirect_to(receiver.url, host="localhost")) as front:
        await peers.prometheus_agent({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": scrape_configs(exporter),
            "remote_write": [{**remote_write(front.url),
                              "authorization": {"credentials_file": str(token)}}],
        })

        async def arrived() -> bool:
            return bool(receiver.received)

        await wait_until(arrived, timeout=30, what="the agent's write through the front")
        u = Upstream(UpstreamSettings(url=front.url, bearer_token_file=str(token)),
                     ProxyMetrics())
        try:
            assert (await u.send(v1_body(), Protocol.V1)).ok
        finally:
            await u.close()
    agents, proxys = receiver.received[0], receiver.received[-1]

    def said(rec: Received) -> dict[str, str]:
        return {k.lower(): v for k, v in rec.headers.items()
                if k.lower() not in ("accept", "user-agent", "content-length", "via")}

    # the proxy's Via entry, where the agent (a user agent, no gateway) sends none
    assert "Via" not in agents.headers and proxys.headers["Via"] == via.ENTRY

    assert said(agents) == said(proxys)
    assert said(proxys)["authorization"] == "Bearer own-token"
    assert said(proxys)["referer"] == front.url
