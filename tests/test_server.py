"""Routes of the application: /metrics, health, readiness, landing page."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import snappy
from prometheus_client.parser import text_string_to_metric_families

from proxy import __version__
from proxy.config import ServerSettings, UpstreamSettings
from proxy.enrichment import Enricher
from proxy.facts import FactsCollector
from proxy.handler import RemoteWriteHandler
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet
from proxy.metrics import ProxyMetrics
from proxy.sender import Series, build_v1
from proxy.server import build_app, start_site
from proxy.upstream import Upstream
from tests.scripted import ScriptedUpstream


class App:
    def __init__(self, index: PodIndex, url: str, handler: RemoteWriteHandler) -> None:
        self.index, self.url, self.handler = index, url, handler


async def _serve(forward_before_ready: bool) -> AsyncIterator[tuple[App, ScriptedUpstream]]:
    async with ScriptedUpstream() as up:
        index = PodIndex()
        metrics = ProxyMetrics()
        metrics.watch_index(index)
        metrics.registry.register(FactsCollector(index))  # the page as the runtime fills it
        upstream = Upstream(UpstreamSettings(url=up.url), metrics)
        handler = RemoteWriteHandler(
            ServerSettings(forward_before_ready=forward_before_ready), index,
            Enricher(index, [("namespace", "pod")]), upstream, metrics,
        )
        app = build_app(handler, index, metrics, upstream_url=up.url, source="test")
        runner, port = await start_site(app, "127.0.0.1", 0)
        try:
            yield App(index, f"http://127.0.0.1:{port}", handler), up
        finally:
            await runner.cleanup()
            await upstream.close()


@pytest.fixture
async def app() -> AsyncIterator[tuple[App, ScriptedUpstream]]:
    async for a in _serve(False):
        yield a


@pytest.fixture
async def app_forwarding() -> AsyncIterator[tuple[App, ScriptedUpstream]]:
    async for a in _serve(True):
        yield a


BODY = snappy.compress(build_v1([Series({"__name__": "up", "namespace": "a", "pod": "b"},
                                        [(1000, 1.0)])]))
HEADERS = {"Content-Type": "application/x-protobuf", "Content-Encoding": "snappy"}


async def test_health_and_readiness_follow_the_index(app: tuple[App, ScriptedUpstream]) -> None:
    a, up = app
    async with aiohttp.ClientSession() as s:
        async with s.get(a.url + "/-/healthy") as r:
            assert r.status == 200
        async with s.get(a.url + "/-/ready") as r:
            assert r.status == 503
        async with s.post(a.url + "/api/v1/write", data=BODY, headers=HEADERS) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert up.received == []
        a.index.ready = True
        async with s.get(a.url + "/-/ready") as r:
            assert r.status == 200
        async with s.post(a.url + "/api/v1/write", data=BODY, headers=HEADERS) as r:
            assert r.status == 204
        assert len(up.received) == 1


async def test_stale_index_stays_ready(app: tuple[App, ScriptedUpstream]) -> None:
    """An API-server outage keeps the last index: still enriching, so still ready."""
    a, up = app
    a.index.ready = True
    a.index.stale = True
    async with aiohttp.ClientSession() as s:
        async with s.get(a.url + "/-/ready") as r:
            assert r.status == 200 and "stale" in await r.text()
        async with s.post(a.url + "/api/v1/write", data=BODY, headers=HEADERS) as r:
            assert r.status == 204
    assert len(up.received) == 1


async def test_forward_before_ready(app_forwarding: tuple[App, ScriptedUpstream]) -> None:
    a, up = app_forwarding
    async with aiohttp.ClientSession() as s:
        async with s.get(a.url + "/-/ready") as r:
            # ready for traffic (a Service routes on it), and says why
            assert r.status == 200 and "forwarding unenriched" in await r.text()
        async with s.post(a.url + "/api/v1/write", data=BODY, headers=HEADERS) as r:
            assert r.status == 204
    assert up.received[0].raw == snappy.uncompress(BODY)  # unenriched, byte for byte


async def test_metrics_exposition(app: tuple[App, ScriptedUpstream]) -> None:
    a, _ = app
    a.index.ready = True
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/api/v1/push", data=BODY, headers=HEADERS) as r:
            assert r.status == 204
        async with s.get(a.url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    for line in (
        'karta_proxy_requests_total{code="204",path="/api/v1/push",protocol="v1"} 1.0',
        'karta_proxy_series_total{direction="in"} 1.0',
        'karta_proxy_series_total{direction="out"} 1.0',
        'karta_proxy_samples_total 1.0',
        'karta_proxy_series_unattributed_total{reason="pod_unknown"} 1.0',
        'karta_proxy_upstream_responses_total{code="204"} 1.0',
        'karta_proxy_upstream_request_duration_seconds_count 1.0',
        'karta_proxy_inflight_requests 0.0',
        'process_resident_memory_bytes ', 'process_start_time_seconds ',
        'process_open_fds ', 'python_info{', 'python_gc_collections_total{generation="0"}',
        'karta_proxy_index_ready 1.0',
    ):
        assert line in text, line


async def _sample_names(url: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return {smp.name for fam in text_string_to_metric_families(await r.text())
                for smp in fam.samples}


async def test_metrics_name_filter_keeps_only_the_series_named(
        app: tuple[App, ScriptedUpstream]) -> None:
    # prometheus_client's convention (scrape_config ``params: {name[]: [...]}``): sample
    # names, so a counter is asked for as ..._total and a histogram by its parts
    a, _ = app
    a.index.ready = True
    async with aiohttp.ClientSession() as s, s.post(a.url + "/api/v1/push", data=BODY,
                                                    headers=HEADERS) as r:
        assert r.status == 204
    whole = await _sample_names(a.url + "/metrics")
    assert {"karta_build_info", "karta_contract_info", "karta_proxy_samples_total"} <= whole
    wanted = ["karta_proxy_samples_total", "karta_build_info", "process_open_fds",
              "karta_proxy_upstream_request_duration_seconds_count", "no_such_series"]
    query = "&".join(f"name[]={n}" for n in wanted)
    assert await _sample_names(f"{a.url}/metrics?{query}") == set(wanted) - {"no_such_series"}
    # a family asked for by its family name only: a counter has no sample of that name
    assert await _sample_names(a.url + "/metrics?name[]=karta_proxy_samples") == set()
    # nothing asked for (no name[], or another parameter): the whole page
    assert await _sample_names(a.url + "/metrics?other=1") == whole


async def test_metrics_without_the_facts_serves_every_other_series(
        app: tuple[App, ScriptedUpstream]) -> None:
    """``facts=false``: the page less the fact families a scrape drops where the facts are
    remote-written (the ServiceMonitor's drop), which are never rendered then; build and
    contract info (one per replica) and every operational series stay, a family added
    later too. With ``name[]`` both apply; any other value is a 400."""
    from proxy.server import SCRAPED_FACTS
    from tests.facts.helpers import PODS, dep_facts, ray_facts

    a, _ = app
    a.index.apply(ChangeSet(pods=dict(PODS), workloads={"w-ray": ray_facts(),
                                                         "w-dep": dep_facts()}))
    a.index.mark_fresh("pods", 1_700_000_500.0)
    a.index.ready = True
    whole = await _sample_names(a.url + "/metrics")
    facts = {n for n in whole if n in SCRAPED_FACTS}
    assert facts, "the test app serves fact families"
    lean = await _sample_names(a.url + "/metrics?facts=false")
    assert lean == whole - facts
    assert {"karta_build_info", "karta_contract_info", "karta_proxy_samples_total"} <= lean
    assert await _sample_names(a.url + "/metrics?facts=true") == whole
    named = [*sorted(facts)[:1], "karta_build_info"]
    query = "&".join(f"name[]={n}" for n in named)
    assert await _sample_names(f"{a.url}/metrics?facts=false&{query}") == {"karta_build_info"}
    async with aiohttp.ClientSession() as s, s.get(a.url + "/metrics?facts=no") as r:
        assert r.status == 400 and "facts must be true or false" in await r.text()


async def test_a_scraper_that_hangs_up_before_the_answer_logs_no_error(
    app: tuple[App, ScriptedUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    """A scraper gone before /metrics answered (its timeout while the loop was held, a
    pause, a port scan) is nothing to report: the answer's headers went to a closed
    connection, and each had logged an error with a traceback, one per scraper, a flood
    anyone reaching the port could make (an audit: 100 of 100 hang-ups logged)."""
    import asyncio
    import logging
    import socket
    import struct

    a, _ = app
    caplog.set_level(logging.DEBUG)
    host, port = a.url.removeprefix("http://").split(":")
    for linger in (False, True):  # FIN, then RST
        for _ in range(10):
            sock = socket.create_connection((host, int(port)))
            if linger:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.close()
    async with aiohttp.ClientSession() as s:  # every hang-up handled before this answer
        for _ in range(3):
            await asyncio.sleep(0.2)
            async with s.get(a.url + "/metrics") as r:
                assert r.status == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_landing_page(app: tuple[App, ScriptedUpstream]) -> None:
    a, up = app
    async with aiohttp.ClientSession() as s, s.get(a.url + "/") as r:
        assert r.status == 200 and r.content_type == "text/html"
        page = await r.text()
    assert __version__ in page and up.url in page
    for link in ('href="/metrics"', 'href="/-/healthy"', 'href="/-/ready"'):
        assert link in page


async def test_every_answer_names_the_product_not_its_runtime(
    app: tuple[App, ScriptedUpstream],
) -> None:
    """No ``Server: Python/3.11 aiohttp/3.14.5``: not on a write's answer (stored, refused
    or not yet ready), a page, or a path that does not exist."""
    from proxy.server import SERVER_HEADER
    a, _ = app
    answers = []
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/api/v1/write", data=BODY, headers=HEADERS) as r:
            answers.append((r.status, r.headers.get("Server")))
        a.index.ready = True
        for method, path, body in (("POST", "/api/v1/write", BODY),
                                   ("POST", "/api/v1/write", b"not snappy"),
                                   ("GET", "/api/v1/write", b""), ("GET", "/metrics", b""),
                                   ("GET", "/", b""), ("GET", "/-/healthy", b""),
                                   ("GET", "/nowhere", b"")):
            async with s.request(method, a.url + path, data=body, headers=HEADERS) as r:
                answers.append((r.status, r.headers.get("Server")))
    assert [status for status, _ in answers] == [503, 204, 400, 405, 200, 200, 200, 404]
    assert {server for _, server in answers} == {SERVER_HEADER}, answers


def test_a_metrics_page_waits_for_requests_a_share_of_the_scrape_timeout() -> None:
    from proxy.server import PAGE_DEFER_SECONDS, page_defer_budget

    assert page_defer_budget({"X-Prometheus-Scrape-Timeout-Seconds": "10"}) == 2.5
    assert page_defer_budget({"X-Prometheus-Scrape-Timeout-Seconds": "2"}) == 0.5
    for odd in ({}, {"X-Prometheus-Scrape-Timeout-Seconds": "soon"},
                {"X-Prometheus-Scrape-Timeout-Seconds": "-1"},
                {"X-Prometheus-Scrape-Timeout-Seconds": "inf"}):
        assert page_defer_budget(odd) == PAGE_DEFER_SECONDS


def test_operations_doc_says_the_endpoints_are_unauthenticated_and_what_to_do() -> None:
    """POST /-/reload and the attribution endpoints are served on the listening port to
    anyone who connects; docs/operations.md's Endpoints section says so and what limits
    it (a NetworkPolicy, TLS client certificates)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    section = doc.split("## Endpoints", 1)[1].split("\n## ", 1)[0]
    words = " ".join(section.split())
    assert "No endpoint is authenticated" in words
    for needle in ("`POST /-/reload`", "`/attribution`", "NetworkPolicy",
                   "`server.tls_client_ca_file`", "`RequireAndVerifyClientCert`"):
        assert needle in words, needle
