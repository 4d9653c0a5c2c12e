"""A loop through two karta-proxy processes (each one's ``upstream.url`` names the other,
as a Service in front of replicas named in their own ``upstream.url`` would): a real
Prometheus 2.42 agent writing into one of them is answered 508 at the first replica
reached twice (``proxy.via``), keeps its batches and retries them, each replica counts
and says the loop, and once the loop is mended every sample lands, stamped, as it lands
in a receiver the agent writes to directly."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo_exporter import DEMO_SNAPSHOT, FixtureExporter
from tests.peers.conftest import (
    Peer,
    Peers,
    agent_metrics,
    free_port,
    pod_sample_times,
    query,
    remote_write,
    scrape_configs,
    wait_stamped,
    wait_until,
)

pytestmark = pytest.mark.peers


async def scraped(peer: Peer, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` that ``peer`` serves now."""
    async with aiohttp.ClientSession() as s, s.get(
            peer.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def replica_args(upstream_url: str) -> list[str]:
    return ["--snapshot", str(DEMO_SNAPSHOT), "--upstream-url", upstream_url, "--no-facts",
            "--log-format", "json"]


async def test_a_loop_through_two_replicas_is_508_and_nothing_is_lost_once_mended(
        peers: Peers, exporter: FixtureExporter, tmp_path: Path) -> None:
    receiver = await peers.prometheus_receiver("prom-behind")
    direct = await peers.prometheus_receiver("prom-direct")
    port_a, port_b = free_port(), free_port()
    a = await peers.karta_proxy("proxy-a", port_a, replica_args(
        f"http://127.0.0.1:{port_b}/api/v1/write"))
    b = await peers.karta_proxy("proxy-b", port_b, replica_args(
        f"http://127.0.0.1:{port_a}/api/v1/write"))
    agent = await peers.prometheus_agent({
        "global": {"scrape_interval": "500ms"},
        "scrape_configs": scrape_configs(exporter, "500ms")[1:2],  # kubelet resource
        "remote_write": [remote_write(a.base_url + "/api/v1/write"),
                         remote_write(direct.base_url + "/api/v1/write")],
    })

    async def looped() -> bool:
        return await scraped(a, "karta_proxy_requests_rejected_total", reason="loop") >= 3

    await wait_until(looped, timeout=30, what="the agent's writes coming back to proxy-a")
    # the agent's write: agent -> a -> b -> a, refused there; b, then a, pass the 508 on
    assert await scraped(a, "karta_proxy_requests_total", path="/api/v1/write",
                         code="508") > 0
    for replica in (a, b):
        assert await scraped(replica, "karta_proxy_upstream_misconfigured_total",
                             reason="not_write_endpoint", code="508") > 0
        assert "leads back to a karta-proxy the request came through" in replica.log_tail(
            20_000)
    # each replica's check, made before the other was up, is made again once an answer
    # came, and finds the loop
    for replica in (a, b):
        async def said(replica: Peer = replica) -> bool:
            return await scraped(replica, "karta_proxy_upstream_info",
                                 check="not_write_endpoint") == 1

        await wait_until(said, timeout=30, what=f"{replica.name}'s check finding the loop")
    assert not await query(receiver.base_url, "count(pod_memory_working_set_bytes)")

    async def retried() -> bool:
        sent = await agent_metrics(agent, url=a.base_url + "/api/v1/write")
        return sent.get("samples_retried_total", 0) > 0

    await wait_until(retried, timeout=30, what="the agent retrying its 508-answered batches")
    # mended: proxy-b restarted on its port, writing to the receiver
    mended = time.time()
    await b.astop()
    await peers.karta_proxy("proxy-b-mended", port_b, replica_args(
        receiver.base_url + "/api/v1/write"))
    await wait_stamped(receiver.base_url, what="stamped series once the loop is mended")
    scrapes = exporter.scrapes["resource"]

    async def scraped_on() -> bool:
        return exporter.scrapes["resource"] >= scrapes + 4

    await wait_until(scraped_on, timeout=20, what="scrapes after the loop was mended")
    metrics = await agent_metrics(agent, url=a.base_url + "/api/v1/write")
    assert await agent.astop() == 0  # flushes what is queued
    assert metrics["samples_failed_total"] == 0, metrics  # no batch dropped for good
    assert metrics["samples_retried_total"] > 0, metrics  # the 508s were retried
    at = time.time()

    async def complete() -> bool:
        return (await pod_sample_times(receiver.base_url, at)
                == await pod_sample_times(direct.base_url, at))

    await wait_until(complete, timeout=20, what="every sample, those of the loop too")
    got = await pod_sample_times(receiver.base_url, at)
    # the samples the agent kept through the loop are there too
    assert min(t for times in got.values() for t in times) < mended
    assert await query(receiver.base_url,
                       "count(pod_memory_working_set_bytes{karta_workload!=''})")
