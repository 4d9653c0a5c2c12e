"""Senders of four tenants through one karta-proxy into a receiver with a size limit, as
in front of Mimir, Cortex or Thanos Receive: two Prometheus 2.42 agents whose tenant is
their credentials (``authorization:``, a gateway's tenant; Debian's 2.42 does not send
``remote_write.headers``, prometheus/prometheus#13030) and two vmagents whose tenant is
``X-Scope-OrgID`` and ``THANOS-TENANT``. Every request that reaches the receiver, each
part of a request sent in parts included, carries its sender's tenant and that sender's
series only; the fact series go to the tenant ``facts.headers`` names, with no sender's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from proxy.config import Settings
from proxy.demo_exporter import FixtureExporter
from proxy.sender import decode_v1
from tests.peers.conftest import (
    InProcessProxy,
    Peers,
    remote_write,
    scrape_configs,
    wait_until,
)
from tests.scripted import Received, ScriptedUpstream, size_limit

pytestmark = pytest.mark.peers

#: the receiver's limit of a compressed body: a scrape's batch stamped is over it, its
#: halves or quarters are not
LIMIT = 6000
#: tenants by credential (Prometheus agents) and by header (vmagents)
BY_CREDENTIAL = ("team-a", "team-b")
BY_HEADER = ("team-c", "team-d")
#: the facts' tenant
OPS = "ops"


def sender_of(rec: Received) -> str:
    """The ``agent`` external label of a request's series ("" for the facts); more than
    one is a request that mixed senders."""
    [agent] = {s.labels.get("agent", "") for s in decode_v1(rec.raw)}
    return agent


def tenant_headers(rec: Received) -> tuple[list[str], list[str], list[str]]:
    return (rec.headers.getall("Authorization", []), rec.headers.getall("X-Scope-OrgID", []),
            rec.headers.getall("THANOS-TENANT", []))


def expected(agent: str) -> tuple[list[str], list[str], list[str]]:
    if agent in BY_CREDENTIAL:
        return [f"Bearer {agent}"], [], []
    if agent in BY_HEADER:
        return [], [agent], [agent]
    return [], [OPS], []


async def test_four_tenants_through_one_proxy_keep_their_own_parts_included(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    def facts_to_ops(s: Settings) -> None:
        s.facts.enabled = True
        s.facts.interval_seconds = 0.5
        s.facts.headers = {"X-Scope-OrgID": OPS}

    async with ScriptedUpstream(rule=size_limit(LIMIT)) as up:
        proxy = await make_proxy(up.url, facts_to_ops)
        for tenant in BY_CREDENTIAL:
            await peers.prometheus_agent({
                "global": {"external_labels": {"agent": tenant}},
                "scrape_configs": scrape_configs(exporter),
                "remote_write": [{**remote_write(proxy.write_url),
                                  "authorization": {"credentials": tenant}}],
            }, name=f"agent-{tenant}")
        for tenant in BY_HEADER:
            await peers.vmagent(
                {"global": {"external_labels": {"agent": tenant}},
                 "scrape_configs": scrape_configs(exporter)}, proxy.write_url,
                extra=[f"-remoteWrite.headers=X-Scope-OrgID: {tenant}^^THANOS-TENANT: {tenant}"],
                name=f"vmagent-{tenant}")

        def parts(agent: str) -> int:
            return sum(1 for r in up.received
                       if r.body and len(r.body) <= LIMIT and sender_of(r) == agent)

        async def all_sent_in_parts() -> bool:
            return all(parts(t) >= 2 for t in BY_CREDENTIAL + BY_HEADER) and parts("") > 0

        await wait_until(all_sent_in_parts, timeout=30,
                         what="every sender's batches sent in parts, and a fact write")
        received = [r for r in up.received if r.body]
        # the senders first, then the proxy, while the receiver answers: a sender's stop
        # flushes its queue (20 s each against a proxy gone), the proxy's its facts
        for peer in peers.started:
            await peer.astop()
        await proxy.proxy.stop()
    stored = proxy.proxy.metrics.registry.get_sample_value(
        "karta_proxy_upstream_split_requests_total", {"result": "stored"})
    assert stored and stored >= 4, stored
    wrong = [(sender_of(r), tenant_headers(r)) for r in received
             if tenant_headers(r) != expected(sender_of(r))]
    assert not wrong, wrong[:5]
