"""The remote-write handler through real HTTP: a proxy assembled by ``proxy.runtime`` on a
small snapshot, forwarding to a scripted loopback receiver."""

from __future__ import annotations

import ast
import asyncio
import gc
import itertools
import logging
import struct
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import cramjam
import pytest
import snappy
from yarl import URL

from proxy import upstream, via
from proxy.config import UpstreamProtocol, validate
from proxy.contract import REJECT_REASONS
from proxy.handler import INLINE_DECODED_BYTES, PART_DECODED_BYTES
from proxy.runtime import Proxy
from proxy.wire.plan import SPLICE_REASONS
from proxy.wire.primitives import Protocol
from tests.peers.conftest import free_port
from tests.proxy_harness import (
    CART,
    CT_V1,
    CT_V2,
    RequestV2,
    WriteRequest,
    metric,
    proxy_running,
    series_v1,
    series_v2,
    start_proxy,
)
from tests.raw_http import Answer as RawAnswer
from tests.raw_http import read_answer
from tests.scripted import (
    Received,
    Reply,
    ScriptedUpstream,
    redirect_to,
    rw2_receiver,
    size_limit,
)
from tests.wire_fixtures import amplifying_v2, request_v2

STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]


def labels_of(raw: bytes) -> list[dict[str, str]]:
    series = WriteRequest.FromString(raw).timeseries
    return [{lb.name: lb.value for lb in ts.labels} for ts in series]


@dataclass
class Running:
    proxy: Proxy
    upstream: ScriptedUpstream
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    async def post(self, body: bytes, *, path: str = "/api/v1/write", ct: str = CT_V1,
                   encoding: str | None = "snappy", compress: bool = True,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        h = {"Content-Type": ct, **(headers or {})}
        if encoding is not None:
            h["Content-Encoding"] = encoding
        if compress:
            body = (bytes(cramjam.zstd.compress(body)) if encoding == "zstd"
                    else snappy.compress(body))
        async with self.session.post(self.url + path, data=body, headers=h) as resp:
            await resp.read()
            return resp

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        v = self.proxy.metrics.registry.get_sample_value(name, labels or {})
        return v or 0.0


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        yield Running(p, up, session)


async def test_every_refusal_and_unattributed_reason_is_exposed_at_0_from_the_start(
        running: Running) -> None:
    # a counter made by its first increment shows no increase() for it: the first
    # refusal of a kind, or a burst of them, never reached an alert's rate
    registry = running.proxy.metrics.registry
    for reason in REJECT_REASONS:
        assert registry.get_sample_value("karta_proxy_requests_rejected_total",
                                         {"reason": reason}) == 0.0, reason
    for reason in SPLICE_REASONS:
        assert registry.get_sample_value("karta_proxy_series_unattributed_total",
                                         {"reason": reason}) == 0.0, reason


async def test_a_request_that_came_through_this_proxy_before_is_508_and_not_forwarded(
        running: Running) -> None:
    """Its Via names this process: it was forwarded here and came back (a loop). Refused
    on its headers, before its body is read; another proxy's entry is any hop."""
    loop = await running.post(series_v1({"__name__": "up", "pod": "p"}),
                              headers={"Via": f"1.1 ingress, {via.ENTRY}"})
    assert loop.status == 508
    assert running.metric("karta_proxy_requests_rejected_total", {"reason": "loop"}) == 1
    other = await running.post(series_v1({"__name__": "up", "pod": "p"}),
                               headers={"Via": "1.1 karta-proxy-00000000"})
    assert other.status == 204
    # a Via that is not UTF-8 (an old proxy's Latin-1) is no 502: this hop's entry alone
    r, w = await asyncio.open_connection("127.0.0.1", running.proxy.port)
    body = snappy.compress(series_v1({"__name__": "up", "pod": "p"}))
    w.write(b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Type: " + CT_V1.encode()
            + b"\r\nContent-Encoding: snappy\r\nVia: 1.1 caf\xe9\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await w.drain()
    head = await r.read()
    w.close()
    assert head.startswith(b"HTTP/1.1 204"), head
    assert [r.headers["Via"] for r in running.upstream.received] == [
        f"1.1 karta-proxy-00000000, {via.ENTRY}", via.ENTRY]


async def test_an_upstream_url_that_names_the_proxy_is_found_at_once_not_64_deep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """upstream.url names the proxy's own address: every write went round until every
    request slot was held by it (64 deep, 2.1 s, other senders refused meanwhile). Now
    the first write in comes back once and is refused; the sender gets 508 (retried,
    nothing lost), counted as the configuration's fault (KartaProxyUpstreamMisconfigured).
    The check at start ran before the listener (unavailable); made again once an answer
    came, it finds the URL not a write endpoint, and says so in
    ``karta_proxy_upstream_info{check}``."""
    monkeypatch.setattr(upstream, "RECHECK_SECONDS", 0.0)
    port = free_port()
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up, upstream_url=f"http://127.0.0.1:{port}/api/v1/write",
                      listen_address=f"127.0.0.1:{port}") as p,
    ):
        h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}
        async with session.post(f"http://127.0.0.1:{port}/api/v1/write", headers=h,
                                data=snappy.compress(series_v1({"__name__": "up"}))) as resp:
            body = await resp.text()
        assert resp.status == 508 and resp.headers["Retry-After"] == "30", body
        assert "leads back to a karta-proxy" in body and via.PSEUDONYM in body
        assert metric(p, "karta_proxy_requests_rejected_total", reason="loop") == 1
        assert metric(p, "karta_proxy_upstream_misconfigured_total", url=p.upstream.shown_url,
                      reason="not_write_endpoint", code="508") == 1
        # the sender's, and its return refused on its headers
        for protocol in ("v1", "unknown"):
            assert metric(p, "karta_proxy_requests_total", path="/api/v1/write",
                          protocol=protocol, code="508") == 1
        for _ in range(50):  # the start's check may still be running at the first 508
            probe = p.upstream.probe
            if probe is not None and probe.outcome == "not_write_endpoint":
                break
            async with session.post(f"http://127.0.0.1:{port}/api/v1/write", headers=h,
                                    data=snappy.compress(series_v1({"__name__": "up"}))):
                pass
            await asyncio.sleep(0.05)
        assert probe is not None and (probe.outcome, probe.code) == ("not_write_endpoint",
                                                                     "508")
        assert metric(p, "karta_proxy_upstream_info", url=p.upstream.shown_url,
                      protocol="unknown", check="not_write_endpoint") == 1
    assert up.received == []


async def test_a_redirect_back_to_the_proxy_is_found_at_once(running: Running) -> None:
    """The upstream redirects (308) to the proxy itself: the request, followed, came
    back once and was refused; one request went to the upstream."""
    running.upstream.rule = redirect_to(running.url)
    resp = await running.post(series_v1({"__name__": "up", "pod": "p"}))
    assert resp.status == 508
    assert len(running.upstream.received) == 1
    assert running.metric("karta_proxy_requests_rejected_total", {"reason": "loop"}) == 1
    assert running.metric("karta_proxy_upstream_redirects_total", {"result": "followed"}) == 1


def _refusal_reasons_counted(source: str) -> set[str]:
    """The reasons a module's code counts in requests_rejected_total: a refusal's
    ``kind`` with ``counter="reject"``, or ``.rejected.labels("...")``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        counter, kind = keywords.get("counter"), keywords.get("kind")
        if (isinstance(counter, ast.Constant) and counter.value == "reject"
                and isinstance(kind, ast.Constant)):
            found.add(str(kind.value))
        if (isinstance(node.func, ast.Attribute) and node.func.attr == "labels"
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "rejected" and node.args
                and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    return found


def test_every_refusal_reason_the_code_counts_is_in_the_contract() -> None:
    import proxy.handler
    # the contract's list is what the handler counts: none unlisted (it would be born
    # at its first increment), none listed that nothing counts
    counted = _refusal_reasons_counted(Path(proxy.handler.__file__).read_text())
    assert counted == set(REJECT_REASONS)


async def test_v1_enriches_attributable_series_and_passes_the_rest(running: Running) -> None:
    cart = {"__name__": "container_memory_working_set_bytes", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}
    unknown = {"__name__": "container_memory_working_set_bytes", "namespace": "shop",
               "pod": "gone-1"}
    node = {"__name__": "node_memory_working_set_bytes", "instance": "n1"}
    resp = await running.post(series_v1(cart, unknown, node))
    assert resp.status == 204
    (rec,) = running.upstream.received
    out = labels_of(rec.raw)
    assert out[0] == {**cart, **CART}
    assert out[1] == unknown and out[2] == node
    assert running.metric("karta_proxy_series_total", {"direction": "in"}) == 3
    assert running.metric("karta_proxy_series_total", {"direction": "out"}) == 3
    assert running.metric("karta_proxy_samples_total") == 3
    assert running.metric("karta_proxy_series_attributed_total") == 1
    assert running.metric("karta_proxy_series_unattributed_total", {"reason": "pod_unknown"}) == 1
    assert running.metric("karta_proxy_series_unattributed_total",
                          {"reason": "no_pod_label"}) == 1
    assert running.metric("karta_proxy_requests_total",
                          {"path": "/api/v1/write", "protocol": "v1", "code": "204"}) == 1


async def test_big_requests_are_spliced_in_a_worker_thread(running: Running) -> None:
    # past INLINE_DECODED_BYTES the request goes through the worker threads
    cart = {"__name__": "container_cpu_usage_seconds_total", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}
    sets = [{**cart, "id": f"/kubepods/{i:06d}" + "x" * 200} for i in range(2000)]
    raw = series_v1(*sets)
    assert len(raw) > max(INLINE_DECODED_BYTES, 2 * PART_DECODED_BYTES)
    calls: list[str] = []
    os_names: list[str] = []
    enrich = running.proxy.enricher.splicer.splice_snappy

    def spy(protocol: Protocol, body: bytes, block: bytes, base: int = 0,
            limit: int | None = None, grow: Any = None) -> Any:
        calls.append(threading.current_thread().name)
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        if comm.exists():
            os_names.append(comm.read_text().strip())
        return enrich(protocol, body, block, base, limit, grow)

    splicer = running.proxy.enricher.splicer
    running.proxy.handler.enricher = cast(Any, type("E", (), {"splicer": type("S", (), {
        "splice_snappy": staticmethod(spy), "splice_v1": splicer.splice_v1,
        "splice_v2": splicer.splice_v2, "plan": splicer.plan})()}))()
    resp = await running.post(raw)
    assert resp.status == 204
    # with two workers or more, a request alone in the pool is spliced in parts at once
    threads = {"karta-splice", "karta-part"} if running.proxy.handler.workers > 1 \
        else {"karta-splice"}
    assert calls and {c.split("_")[0] for c in calls} == threads
    assert len(calls) == min(running.proxy.handler.workers, len(raw) // PART_DECODED_BYTES)
    # top -H and ps -L tell the workers apart too (proxy.thread_names)
    assert sorted(os_names) in ([], sorted(calls))
    (rec,) = running.upstream.received
    assert all(out == {**sent, **CART} for out, sent in zip(labels_of(rec.raw), sets,
                                                              strict=True))
    assert running.metric("karta_proxy_series_attributed_total") == len(sets)
    # the workers' use, for capacity: threads, busy time, nothing left waiting
    assert running.metric("karta_proxy_worker_threads") == running.proxy.handler.workers
    assert running.metric("karta_proxy_worker_busy_seconds_total") > 0
    assert running.metric("karta_proxy_worker_queued_requests") == 0

    # under 2 x PART_DECODED_BYTES (~300 KiB, what a 500-series request of real labels
    # decodes to) it is spliced whole: parts would cost more hand-offs than they save
    calls.clear()
    small = series_v1(*sets[:850])
    assert 280 * 1024 < len(small) < 320 * 1024  # relay_bench's are 301 KiB
    assert (await running.post(small)).status == 204
    assert [c.split("_")[0] for c in calls] == ["karta-splice"]


async def test_a_reload_between_the_parts_of_a_request_leaves_it_one_plan(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that changes ``enrich`` while a request is spliced in parts: every part
    splices with the plan the request started with. Each part asked the enricher anew,
    so the parts after a reload took the new plan: an audit stored 4 of 60 requests half
    one way, half the other."""
    if running.proxy.handler.workers < 2:
        pytest.skip("a request is cut in parts only with two workers or more")
    import proxy.handler as handler_module
    from proxy.enrichment import build_plan

    cart = {"__name__": "container_cpu_usage_seconds_total", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}
    sets = [{**cart, "id": f"/kubepods/{i:06d}" + "x" * 200} for i in range(2000)]
    enricher = running.proxy.enricher
    elsewhere = build_plan([("ns_b", "pod_b")], [])  # names no pod of these series
    cut = handler_module.splice_in_parts
    parts: list[int] = []

    def replanned_in_every_part(raw: Any, block: bytes, cuts: list[int], splice: Any,
                                  threads: Any) -> Any:
        def part(raw: Any, block: bytes, base: int) -> Any:
            enricher.replan(elsewhere)  # what a reload does, once the request has begun
            parts.append(base)
            return splice(raw, block, base)
        return cut(raw, block, cuts, part, threads)

    monkeypatch.setattr(handler_module, "splice_in_parts", replanned_in_every_part)
    resp = await running.post(series_v1(*sets))
    assert resp.status == 204
    assert len(parts) >= 2
    (rec,) = running.upstream.received
    assert all(out == {**sent, **CART} for out, sent in zip(labels_of(rec.raw), sets,
                                                              strict=True))
    assert enricher.plan is elsewhere  # and the next request takes the new one


async def test_bodies_decoded_into_scratch_buffers_go_out_as_sent(running: Running) -> None:
    """A worker decodes each body into its thread's reusable buffer; whatever goes
    upstream is a copy, so requests untouched by the splice (no pod label: it hands back
    the body itself) and stamped ones, many at once, each reach the upstream as sent."""
    cart = {"__name__": "container_cpu_usage_seconds_total", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}

    def body(i: int, stamped: bool) -> tuple[bytes, list[dict[str, str]]]:
        base = cart if stamped else {"__name__": "node_cpu_seconds_total", "instance": "n1"}
        sets = [{**base, "id": f"/req{i:02d}/{k:05d}" + "y" * 40} for k in range(1500)]
        return series_v1(*sets, value=float(i)), sets

    sent = [body(i, stamped=i % 3 == 0) for i in range(12)]
    assert all(len(raw) > INLINE_DECODED_BYTES for raw, _ in sent)
    statuses = await asyncio.gather(*(running.post(raw) for raw, _ in sent))
    assert [r.status for r in statuses] == [204] * len(sent)
    got = {labels_of(rec.raw)[0]["id"].split("/")[1]: rec.raw for rec in running.upstream.received}
    assert len(got) == len(sent)
    for i, (raw, sets) in enumerate(sent):
        out = got[f"req{i:02d}"]
        if i % 3:
            assert out == raw  # untouched: byte for byte
        else:
            assert labels_of(out) == [{**s, **CART} for s in sets]


async def test_dcgm_exported_labels_name_the_gpu_pod(running: Running) -> None:
    dcgm = {"__name__": "DCGM_FI_DEV_GPU_UTIL", "namespace": "gpu-monitoring",
            "pod": "dcgm-exporter-x", "exported_namespace": "shop",
            "exported_pod": "cart-7d9f8-abcde", "gpu": "0"}
    assert (await running.post(series_v1(dcgm))).status == 204
    assert labels_of(running.upstream.received[0].raw) == [{**dcgm, **CART}]


async def test_stale_markers_get_the_same_labels(running: Running) -> None:
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    assert (await running.post(series_v1(cart, value=STALE_NAN))).status == 204
    out = WriteRequest.FromString(running.upstream.received[0].raw).timeseries[0]
    assert {lb.name: lb.value for lb in out.labels} == {**cart, **CART}
    assert struct.pack("<d", out.samples[0].value) == struct.pack("<d", STALE_NAN)


async def test_zstd_and_all_three_paths(running: Running) -> None:
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    for path in ("/api/v1/write", "/api/v1/push", "/api/v1/receive"):
        assert (await running.post(series_v1(cart), path=path, encoding="zstd")).status == 204
    assert len(running.upstream.received) == 3
    assert all(labels_of(r.raw) == [{**cart, **CART}] for r in running.upstream.received)


@pytest.fixture
async def running_rw2(tmp_path: Path) -> AsyncIterator[Running]:
    """The proxy in front of an RW 2.0 receiver."""
    async with (
        ScriptedUpstream(rule=rw2_receiver) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        yield Running(p, up, session)


async def test_v2_enriched_with_written_headers(running_rw2: Running) -> None:
    running = running_rw2
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    async with running.session.post(
        running.url + "/api/v1/write", data=snappy.compress(series_v2(cart, {"__name__": "x"})),
        headers={"Content-Type": CT_V2, "Content-Encoding": "snappy",
                 "X-Prometheus-Remote-Write-Version": "2.0.0"},
    ) as resp:
        assert resp.status == 204
        assert resp.headers["X-Prometheus-Remote-Write-Samples-Written"] == "2"
        assert resp.headers["X-Prometheus-Remote-Write-Histograms-Written"] == "0"
        assert resp.headers["X-Prometheus-Remote-Write-Exemplars-Written"] == "0"
    rec = running.upstream.received[0]
    assert rec.headers["Content-Type"] == CT_V2
    req = RequestV2.FromString(rec.raw)
    syms = list(req.symbols)
    refs = list(req.timeseries[0].labels_refs)
    got = {syms[refs[i]]: syms[refs[i + 1]] for i in range(0, len(refs), 2)}
    assert got == {**cart, **CART}


async def test_end_to_end_headers_reach_the_upstream(running: Running) -> None:
    resp = await running.post(series_v1({"__name__": "up"}),
                              headers={"X-Scope-OrgID": "team-a", "Authorization": "Bearer t"})
    assert resp.status == 204
    h = running.upstream.received[0].headers
    assert h["X-Scope-OrgID"] == "team-a" and h["Authorization"] == "Bearer t"


async def test_a_forwarded_header_not_utf8_is_400_never_altered(running: Running) -> None:
    # aiohttp keeps a header's non-UTF-8 bytes as surrogates and its client leaves them
    # out: "caf\xe9" reached the upstream as "caf", the data stored in another tenant
    body = snappy.compress(series_v1({"__name__": "up"}))

    async def raw_post(tenant: bytes) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", running.proxy.port)
        w.write(b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Type: " + CT_V1.encode()
                + b"\r\nX-Scope-OrgID: " + tenant + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        answer = await asyncio.wait_for(r.read(), 5)
        w.close()
        return answer

    refused = await raw_post(b"caf\xe9")
    assert refused.startswith(b"HTTP/1.1 400") and b"X-Scope-OrgID is not valid UTF-8" in refused
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "invalid_header"}) == 1
    assert running.upstream.received == []
    taken = await raw_post("équipe".encode())  # UTF-8 passes, byte for byte
    assert taken.startswith(b"HTTP/1.1 204"), taken
    assert running.upstream.received[0].headers["X-Scope-OrgID"] == "équipe"


async def raw_write(p: Proxy, headers: list[tuple[str, str]], *,
                    target: str = "/api/v1/write") -> RawAnswer:
    """One write to the proxy written byte for byte: headers repeated or spelled as given
    (an HTTP client would merge them), ``target`` as given (no client re-encodes it)."""
    body = snappy.compress(series_v1({"__name__": "up", "namespace": "shop",
                                      "pod": "cart-7d9f8-abcde"}))
    head = f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: {CT_V1}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    head += f"Content-Length: {len(body)}\r\n\r\n"
    r, w = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        w.write(head.encode("latin-1") + body)
        return await read_answer(r)
    finally:
        w.close()


async def test_a_configured_header_wins_over_every_spelling_a_sender_sends(
        tmp_path: Path) -> None:
    # upstream.headers win over forwarded ones: a plain dict kept the sender's
    # "x-scope-orgid: evil" beside the configured "X-Scope-OrgID", the client sent both
    # and the receiver stored the data in tenant evil
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up,
                      upstream_settings={"headers": {"X-Scope-OrgID": "operator-tenant"}}) as p,
    ):
        answer = await raw_write(p, [("X-Scope-OrgID", "x"), ("x-scope-orgid", "evil"),
                                     ("X-SCOPE-ORGID", "evil2")])
    assert answer.status == 204, answer.body
    assert up.received[0].headers.getall("X-Scope-OrgID") == ["operator-tenant"]


async def test_a_repeated_forwarded_header_reaches_the_upstream_with_every_value(
        running: Running) -> None:
    # Mimir and Thanos (Go) read the first of two X-Scope-OrgID: forwarding only the last
    # stored proxied data in another tenant than a direct write's
    answer = await raw_write(running.proxy, [("X-Scope-OrgID", "first"),
                                             ("X-Scope-OrgID", "second"),
                                             ("THANOS-TENANT", "a"), ("thanos-tenant", "b")])
    assert answer.status == 204, answer.body
    h = running.upstream.received[0].headers
    assert h.getall("X-Scope-OrgID") == ["first", "second"]
    assert h.getall("THANOS-TENANT") == ["a", "b"]


def _tenants_of(rec: Received) -> set[str]:
    """The ``t`` label of every series a request that reached the upstream holds."""
    if rec.headers["Content-Type"] == CT_V2:
        req = RequestV2.FromString(rec.raw)
        return {req.symbols[ts.labels_refs[i + 1]] for ts in req.timeseries
                for i in range(0, len(ts.labels_refs), 2)
                if req.symbols[ts.labels_refs[i]] == "t"}
    return {d["t"] for d in labels_of(rec.raw)}


async def test_tenants_in_flight_together_keep_their_headers_in_parts_and_conversion(
        tmp_path: Path) -> None:
    # 5 tenants' requests at once, RW 2.0 ones refused 415 and sent again converted, each
    # too large (413) and sent in parts: every request upstream carries one tenant's
    # series and that tenant's headers, none of another's
    def receiver(rec: Received) -> Reply:
        if rec.headers["Content-Type"] == CT_V2:
            return Reply(415)
        return Reply(413) if len(rec.body) > 700 else Reply(204, delay=0.002)

    def body(tenant: str, i: int) -> bytes:
        series = [{"__name__": "m", "t": tenant, "i": f"{k}-{i}-" + "x" * (k * 37 % 23),
                   "namespace": "shop", "pod": "cart-7d9f8-abcde"} for k in range(40)]
        return series_v2(*series) if i % 2 else series_v1(*series)

    async with ScriptedUpstream(rule=receiver) as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up) as p:
        running = Running(p, up, session)
        sent = [(f"tenant-{i % 5}", i) for i in range(30)]
        answers = await asyncio.gather(*(running.post(
            body(t, i), ct=CT_V2 if i % 2 else CT_V1,
            headers={"X-Scope-OrgID": t, "THANOS-TENANT": t}) for t, i in sent))
    assert [a.status for a in answers] == [204] * len(sent)
    assert sum(len(r.body) <= 700 for r in up.received) >= 2 * len(sent)  # parts
    wrong = [(_tenants_of(r), r.headers.getall("X-Scope-OrgID", []),
              r.headers.getall("THANOS-TENANT", [])) for r in up.received
             if r.headers["Content-Type"] == CT_V1 and len(r.body) <= 700]
    wrong = [w for w in wrong if len(w[0]) != 1 or [*w[0]] != w[1] or w[1] != w[2]]
    assert not wrong, wrong[:3]


async def test_headers_the_connection_header_names_are_not_forwarded(running: Running) -> None:
    # RFC 9110 7.6.1 / RFC 7230 6.1: a header the Connection header names is for this hop
    answer = await raw_write(running.proxy, [("Connection", "keep-alive, X-Scope-OrgID"),
                                             ("X-Scope-OrgID", "hop"), ("THANOS-TENANT", "t"),
                                             ("Connection", "authorization"),
                                             ("Authorization", "Bearer hop")])
    assert answer.status == 204, answer.body
    h = running.upstream.received[0].headers
    assert "X-Scope-OrgID" not in h and "Authorization" not in h
    assert h.getall("THANOS-TENANT") == ["t"]


async def test_url_userinfo_is_the_proxys_own_basic_credentials(tmp_path: Path) -> None:
    # aiohttp refused every request with both a URL userinfo and a (forwarded)
    # Authorization: a 500 and a traceback per request, no count
    async with ScriptedUpstream() as up:
        url = up.url.replace("http://", "http://karta:p%40ss@")
        async with proxy_running(tmp_path, up, upstream_url=url) as p:
            sent = await raw_write(p, [("Authorization", "Bearer sender"),
                                       ("authorization", "Bearer sender-2")])
            plain = await raw_write(p, [])
    assert sent.status == 204 and plain.status == 204, (sent.body, plain.body)
    for rec in up.received:
        assert rec.headers.getall("Authorization") == ["Basic a2FydGE6cEBzcw=="]  # karta:p@ss


async def test_the_write_paths_query_reaches_the_upstream(tmp_path: Path) -> None:
    # VictoriaMetrics honours ?extra_label=env=prod on a direct write; the proxy dropped the
    # query (204, stored without env)
    async with ScriptedUpstream() as up:
        base = up.url.removesuffix("/api/v1/write")
        url = base + "/insert/0/prometheus/api/v1/write?extra_label=site=a"
        async with proxy_running(tmp_path, up, upstream_url=url) as p:
            tenant = await raw_write(
                p, [], target="/insert/7/prometheus/api/v1/write?extra_label=env%3Dprod&x=1+2")
            plain = await raw_write(p, [], target="/api/v1/write?Extra_Label=karta_w=x")
    assert tenant.status == 204 and plain.status == 204, (tenant.body, plain.body)
    first, second = up.received
    assert first.path == "/insert/7/prometheus/api/v1/write"
    assert first.query == "extra_label=site=a&extra_label=env%3Dprod&x=1+2"  # as sent
    # another name than VictoriaMetrics' extra_label (Go compares names exactly): passed
    assert second.path == "/insert/0/prometheus/api/v1/write"
    assert second.query == "extra_label=site=a&Extra_Label=karta_w=x"


@pytest.mark.parametrize("query", [
    "extra_label=karta_workload=evil",
    "env=1&extra_label=karta%5Fworkload%3Devil",
    "extra%5Flabel=karta_team=x",
    "extra_label=env=prod&extra_label=+karta_component=x",
])
async def test_an_extra_label_naming_a_karta_label_is_400(running: Running, query: str
                                                          ) -> None:
    # VictoriaMetrics sets an extra_label on every series, over the stamped labels: a
    # sender's URL could forge any attribution
    answer = await raw_write(running.proxy, [], target="/api/v1/write?" + query)
    assert answer.status == 400 and b"names a karta_* label" in answer.body, answer.body
    assert running.upstream.received == []
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "karta_extra_label"}) == 1


@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"ct": "text/plain"}, 415, "Content-Type"),
        ({"ct": "application/x-protobuf;proto=foo.Bar"}, 415, "foo.Bar"),
        ({"encoding": "gzip"}, 415, "gzip"),
        ({"encoding": "identity"}, 415, "identity"),
    ],
)
async def test_unsupported_media_is_415(running: Running, kwargs: dict[str, Any], status: int,
                                        fragment: str) -> None:
    async with running.session.post(
        running.url + "/api/v1/write", data=snappy.compress(series_v1({"__name__": "up"})),
        headers={k: v for k, v in {
            "Content-Type": kwargs.get("ct", CT_V1),
            "Content-Encoding": kwargs.get("encoding", "snappy"),
        }.items() if v is not None},
    ) as resp:
        text = await resp.text()
    assert resp.status == status and fragment in text
    assert running.upstream.received == []
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "unsupported_media_type"}) == 1


@pytest.mark.parametrize("missing", [("Content-Type",), ("Content-Encoding",),
                                     ("Content-Type", "Content-Encoding")])
async def test_missing_headers_are_rw1_snappy_as_prometheus_takes_them(
        running: Running, missing: tuple[str, ...]) -> None:
    # Prometheus' own receiver reads a request without them as RW 1.0 + snappy
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    headers = {k: v for k, v in {"Content-Type": CT_V1, "Content-Encoding": "snappy"}.items()
               if k not in missing}
    async with aiohttp.ClientSession(skip_auto_headers=("Content-Type",)) as session, \
            session.post(running.url + "/api/v1/write", data=snappy.compress(series_v1(cart)),
                         headers=headers) as resp:
        assert resp.status == 204, await resp.text()
    assert labels_of(running.upstream.received[0].raw) == [{**cart, **CART}]


def _snappy_bomb() -> bytes:
    # declares 4 GiB - 1 decoded bytes in its header; nothing behind it
    return bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + b"\x00" * 16


@pytest.mark.parametrize(
    ("body", "compress", "status", "kind"),
    [
        (b"", False, 400, "empty_body"),
        (b"\xff\xff\xff", False, 400, "snappy_corrupt"),
        (snappy.compress(b"x" * 1000)[:-5], False, 400, "snappy_corrupt"),
        (_snappy_bomb(), False, 413, "too_large"),
        (b"\x0a\x05\x0a\x03\x0a\x01", True, 400, "protobuf_invalid"),  # truncated fields
        (b"\xff" * 64, True, 400, "protobuf_invalid"),
        (series_v1({"__name__": "up", "pod": "aXb"}).replace(b"aXb", b"a\xffb"), True, 400,
         "invalid_utf8"),
    ],
)
async def test_bad_input_is_4xx_and_the_process_lives_on(
    running: Running, body: bytes, compress: bool, status: int, kind: str
) -> None:
    resp = await running.post(body, compress=compress)
    assert resp.status == status
    assert running.metric("karta_proxy_decode_errors_total", {"kind": kind}) == 1, (
        [(s.labels, s.value) for m in running.proxy.metrics.registry.collect()
         if m.name == "karta_proxy_decode_errors" for s in m.samples])
    assert running.upstream.received == []
    # the next good request goes through
    assert (await running.post(series_v1({"__name__": "up"}))).status == 204


async def test_a_flood_of_bad_requests_logs_a_few_lines_and_counts_every_one(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    """500 corrupt bodies made 500 warnings in 0.4 s: now the first of each kind is logged
    at once and the rest in one summary line with their count (at stop at the latest),
    while the counters count every request."""
    caplog.set_level(logging.INFO, logger="karta.handler")
    for _ in range(200):
        assert (await running.post(b"\xff\xff\xff", compress=False)).status == 400
    for _ in range(50):
        assert (await running.post(b"x", encoding="gzip", compress=False)).status == 415
    assert running.metric("karta_proxy_decode_errors_total", {"kind": "snappy_corrupt"}) == 200
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "unsupported_media_type"}) == 50
    running.proxy.handler.flush_logs()
    lines = [r for r in caplog.records if r.name == "karta.handler"
             and r.getMessage() in ("request refused", "requests refused")]
    assert [(r.getMessage(), r.__dict__["kind"], r.__dict__.get("count")) for r in lines] == [
        ("request refused", "snappy_corrupt", None),
        ("request refused", "unsupported_media_type", None),
        ("requests refused", "snappy_corrupt", 199),
        ("requests refused", "unsupported_media_type", 49),
    ]
    assert all(r.levelno == logging.WARNING for r in lines)
    assert lines[2].__dict__["peers"] == "127.0.0.1"


async def test_wrong_method_is_405(running: Running) -> None:
    async with running.session.get(running.url + "/api/v1/write") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
    async with running.session.put(running.url + "/api/v1/push", data=b"x") as resp:
        assert resp.status == 405


async def test_body_over_the_limit_is_413_declared_or_streamed(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up, max_body_bytes=1000, max_inflight_bytes=1 << 20) as p,
    ):
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}
        async with session.post(url, data=b"x" * 5000, headers=h) as resp:
            assert resp.status == 413
            # the limit and the setting that raises it (the sender's log is all its
            # operator sees)
            assert await resp.text() == ("request body of 5000 bytes exceeds the limit of "
                                         "1000 bytes (server.max_body_bytes; send fewer "
                                         "series per request)\n")

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            for _ in range(10):
                yield b"y" * 400

        async with session.post(url, data=chunks(), headers=h) as resp:
            assert resp.status == 413
            assert await resp.text() == ("request body exceeds the limit of 1000 bytes "
                                         "(server.max_body_bytes; send fewer series per "
                                         "request)\n")
    assert up.received == []


async def test_decoded_limit_is_413_before_decompressing(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up, max_decoded_bytes=10_000) as p,
    ):
        body = snappy.compress(series_v1(*({"__name__": f"m{i}"} for i in range(2000))))
        async with session.post(f"http://127.0.0.1:{p.port}/api/v1/write", data=body,
                                headers={"Content-Type": CT_V1,
                                         "Content-Encoding": "snappy"}) as resp:
            assert resp.status == 413
            assert await resp.text() == (
                f"decoded body of {len(snappy.uncompress(body))} bytes exceeds the limit of "
                "10000 bytes (server.max_decoded_bytes); send fewer series per request\n")


async def _answer_to(tmp_path: Path, reply: Reply) -> tuple[int, str]:
    """The status and body a sender gets for a write the upstream answers ``reply``."""
    body = snappy.compress(series_v1({"__name__": "u"}))
    headers = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}
    async with (
        ScriptedUpstream(reply) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
        session.post(f"http://127.0.0.1:{p.port}/api/v1/write", data=body,
                     headers=headers) as resp,
    ):
        return resp.status, await resp.text()


@pytest.mark.parametrize("said", [
    b"upstream boom\nsecond line",
    b"<html>\r\n<body>\r\n  <h1>502 Bad Gateway</h1>\r\n</body>\r\n</html>\r\n",
    b"err: series 1 refused\n\nerr: series 2 refused\n",
])
async def test_an_upstream_error_body_reaches_the_sender_on_one_line(
        tmp_path: Path, said: bytes) -> None:
    """A sender logs the first line of an error body alone (Prometheus reads up to its
    first line break): an upstream's body of several lines lost all but its first to the
    sender, the words after ``upstream answered 500:`` included."""
    status, text = await _answer_to(tmp_path, Reply(500, body=said))
    assert status == 502
    assert text.endswith("\n") and "\n" not in text[:-1] and "\r" not in text, text
    words = said.decode().split()
    assert text == "upstream answered 500: " + " ".join(words) + "\n", text


async def test_an_upstream_error_body_reaches_the_sender_without_control_characters(
        tmp_path: Path) -> None:
    # relayed raw, an upstream's ANSI escape cleared or recoloured the terminal of an
    # operator reading the sender's log (vmagent logs the answer's body as it is)
    said = b"refused \x1b[2J\x1b[31mred\x00 \xc2\x9b"
    status, text = await _answer_to(tmp_path, Reply(400, body=said))
    assert status == 400
    assert text == "refused \\x1b[2J\\x1b[31mred\\x00 \\x9b\n", text  # a 4xx's own words


async def test_series_out_counts_only_series_the_upstream_accepted(tmp_path: Path) -> None:
    """karta_proxy_series_total{direction="out"} is "forwarded and accepted upstream"
    (its HELP, docs/operations.md): a request the upstream refuses counts in, not out."""
    async with (
        ScriptedUpstream(Reply(400, body=b"bad"), Reply(500), Reply(204)) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        running = Running(p, up, session)
        body = series_v1({"__name__": "up", "job": "a"}, {"__name__": "up", "job": "b"})
        assert [(await running.post(body)).status for _ in range(3)] == [400, 502, 204]
        assert running.metric("karta_proxy_series_total", {"direction": "in"}) == 6
        assert running.metric("karta_proxy_series_total", {"direction": "out"}) == 2


async def test_series_out_counts_the_parts_the_upstream_accepted(tmp_path: Path) -> None:
    """A request the upstream refused as too large goes in parts: ``series_total{out}``
    counts the series of each part that got a 2xx, when it got it, and never again. It
    counted the whole on a 2xx to every part and nothing otherwise, so the stored parts of
    a batch whose other part got a 4xx (which the sender drops) were never counted, and
    those of a batch cut off by a part's 5xx only at a resend that stored the rest."""
    flaky = {"left": 1}  # the part with a "flaky" series: a 503 the first time

    def receiver(rec: Received) -> Reply:
        if len(rec.raw) > 700:
            return Reply(413, body=b"too big")
        if b"refused" in rec.raw:
            return Reply(400, body=b"bad part")
        if b"flaky" in rec.raw and flaky["left"]:
            flaky["left"] -= 1
            return Reply(503)
        return Reply(204)

    def batch(last: str) -> bytes:  # 8 series of ~130 bytes: halves fit, the whole not
        return series_v1(*({"__name__": "m", "i": str(i), "v": "x" * 100} for i in range(7)),
                         {"__name__": "m", "i": last, "v": "x" * 100})

    async with (
        ScriptedUpstream(rule=receiver) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        running = Running(p, up, session)
        out = {"direction": "out"}
        assert (await running.post(batch("refused"))).status == 400
        stored = sum(len(WriteRequest.FromString(r.raw).timeseries) for r in up.received
                     if receiver(r).status == 204)
        assert 0 < stored < 8  # the other half, in one part or more
        assert running.metric("karta_proxy_series_total", out) == stored
        assert (await running.post(batch("flaky"))).status == 503
        first = running.metric("karta_proxy_series_total", out) - stored
        assert 0 < first < 8  # the half before the flaky part's, stored
        assert (await running.post(batch("flaky"))).status == 204  # the rest
        assert running.metric("karta_proxy_series_total", out) == stored + 8
        assert running.metric("karta_proxy_series_total", {"direction": "in"}) == 24


async def test_overload_is_503_with_retry_after_never_a_queue(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=0.5)) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up, max_concurrent_requests=2,
                      admission_wait_seconds=0.0) as p,
    ):
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        body = snappy.compress(series_v1({"__name__": "up"}))
        h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}

        async def one() -> tuple[int, str | None]:
            async with session.post(url, data=body, headers=h) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(6))), 10)
    statuses = sorted(s for s, _ in results)
    assert statuses.count(204) == 2 and statuses.count(503) == 4
    assert all(ra == "1" for s, ra in results if s == 503)
    assert 429 not in statuses
    assert len(up.received) == 2


async def test_byte_budget_is_503(tmp_path: Path) -> None:
    async with ScriptedUpstream(Reply(204, delay=0.5)) as up, \
            aiohttp.ClientSession() as session:
        big = snappy.compress(series_v1(*({"__name__": f"m{i}"} for i in range(3000))))
        async with proxy_running(tmp_path, up, max_body_bytes=len(big) + 10,
                                 max_inflight_bytes=200_000) as p:
            url = f"http://127.0.0.1:{p.port}/api/v1/write"
            h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}

            async def one() -> int:
                async with session.post(url, data=big, headers=h) as resp:
                    await resp.read()
                    return resp.status

            results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(4))), 10)
            assert p.metrics.registry.get_sample_value(
                "karta_proxy_inflight_bytes") == 0
    assert 204 in results and 503 in results
    assert len(up.received) == results.count(204)


async def test_the_budget_follows_what_a_request_holds_until_its_answer(
        tmp_path: Path) -> None:
    # reserved up front: the body, its decoded size and an output about as big; once
    # spliced, the request holds its outgoing body only. The budget kept the reservation
    # for the whole upstream round trip, refusing others for memory long freed
    async with ScriptedUpstream(Reply(204, delay=1.0)) as up, \
            proxy_running(tmp_path, up) as p:
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}
        cases = {
            # unattributed series, stamped none: the outgoing body about the sender's
            "plain": series_v1(*({"__name__": "m", "i": str(i), "pad": "p" * 100}
                                 for i in range(3000))),
            # tiny series naming a pod: each gains a stamp longer than itself
            "stamped": series_v1(*({"__name__": "m", "namespace": "shop",
                                    "pod": "cart-7d9f8-abcde", "i": str(i)}
                                   for i in range(3000))),
        }
        async with aiohttp.ClientSession() as session:
            for name, raw in cases.items():
                body = snappy.compress(raw)
                seen = len(up.received)
                sent = asyncio.create_task(session.post(url, data=body, headers=h))
                while len(up.received) == seen:  # the request is at the upstream now
                    await asyncio.sleep(0.01)
                out = len(up.received[-1].body)
                held = p.handler.budget.bytes
                (await sent).close()
                assert held == out, (name, held, out, len(body), len(raw))
                assert held < len(body) + len(raw)
        assert p.handler.budget.bytes == 0


async def test_a_request_sent_in_parts_is_charged_to_the_byte_budget(tmp_path: Path) -> None:
    # after a 413 the body was decoded again and cut outside the byte budget: 12 senders
    # of a 30 MiB request held 2.3 GiB for a 256 MiB budget. A big request whose own
    # bytes fit the budget beside a small one in flight, its parts not: 503, no part sent
    big = snappy.compress(series_v1(*({"__name__": f"m{i}", "pod": "p" * 40}
                                      for i in range(3000))))
    small = snappy.compress(series_v1({"__name__": "up"}))
    decoded = len(snappy.uncompress(big))
    limit = len(big) * 6 // 10

    held = asyncio.Event()

    def answer(rec: Received) -> Reply:  # the small request stays in flight throughout
        # (held until the test lets it go, not for 2 s the big one had to fit in)
        small_write = len(rec.body) < 1000 and len(rec.raw) > 0
        return Reply(204, gate=held if small_write else None)

    rule = size_limit(limit, answer, refusal=Reply(413, body=b"too large"))
    # the big one admitted beside the small one (its body, twice its decoded size:
    # proxy.handler), and settled to its outgoing body once spliced: cutting it takes its
    # body decoded again, the layout and the part being made, past that
    budget = len(big) + 2 * decoded + 4 * len(small) + 4096
    async with (
        ScriptedUpstream(rule=rule) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up, max_body_bytes=len(big) + 10,
                      max_inflight_bytes=budget) as p,
    ):
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        h = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}

        async def one(body: bytes) -> tuple[int, str]:
            async with session.post(url, data=body, headers=h) as resp:
                return resp.status, await resp.text()

        waiting = asyncio.create_task(one(small))
        while not up.received:  # the small request is at the upstream, held there
            await asyncio.sleep(0.01)
        status, text = await asyncio.wait_for(one(big), 10)
        held.set()
        assert (await waiting)[0] == 204
        assert p.metrics.registry.get_sample_value("karta_proxy_inflight_bytes") == 0
        refused = p.metrics.registry.get_sample_value(
            "karta_proxy_upstream_split_requests_total", {"result": "overload"})
        # the proxy's own refusal, as every overload 503 is: KartaProxyUpstreamFailing
        # subtracts these from the 5xx it blames on the upstream
        rejected = metric(p, "karta_proxy_requests_rejected_total", reason="overload")
    assert status == 503 and "no room" in text, (status, text)
    assert refused == 1 and rejected == 1
    assert not [r for r in up.received if len(r.body) <= limit and len(r.body) >= 1000]


def _tiny_cart_series(count: int) -> bytes:
    """Series smaller than the stamp they get: each holds ~4x its size in the splice."""
    return series_v1(*({"__name__": "m", "namespace": "shop", "pod": "cart-7d9f8-abcde",
                        "i": str(i)} for i in range(count)))


async def test_a_splice_past_its_reservation_takes_more_from_the_budget(
        tmp_path: Path) -> None:
    # the splice held what it needed beside the body, unreserved: 44-byte series with long
    # stamps held 1.8 GiB for 64 MiB decoded, past any budget. Now it takes more as it
    # grows, and the request is stored as before
    raw = _tiny_cart_series(5000)
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        run = Running(p, up, session)
        assert (await run.post(raw)).status == 204
        assert run.metric("karta_proxy_splice_limits_total", {"result": "grown"}) >= 1
        assert p.handler.budget.bytes == 0
        (rec,) = up.received
        assert all(out.items() >= CART.items() for out in labels_of(rec.raw))
        assert len(labels_of(rec.raw)) == 5000


async def test_a_splice_no_request_may_hold_is_413(tmp_path: Path) -> None:
    raw = _tiny_cart_series(5000)
    body = snappy.compress(raw)
    async with (
        ScriptedUpstream() as up,
        aiohttp.ClientSession() as session,
        # one request may hold the budget, or its body and twice its decoded size: both
        # well below what these series need
        proxy_running(tmp_path, up, max_body_bytes=len(body) + 10,
                      max_decoded_bytes=len(raw) + 10, max_inflight_bytes=len(body) + 10) as p,
    ):
        run = Running(p, up, session)
        async with session.post(run.url + "/api/v1/write", data=body,
                                headers={"Content-Type": CT_V1,
                                         "Content-Encoding": "snappy"}) as resp:
            status, text = resp.status, await resp.text()
        assert status == 413 and "send fewer series per request" in text, text
        assert run.metric("karta_proxy_splice_limits_total", {"result": "too_large"}) == 1
        assert run.metric("karta_proxy_requests_rejected_total", {"reason": "too_large"}) == 1
        assert p.handler.budget.bytes == 0
    assert not up.received


async def test_a_splice_the_budget_has_no_room_for_now_is_503(tmp_path: Path) -> None:
    raw = _tiny_cart_series(5000)
    body = snappy.compress(raw)
    small = snappy.compress(series_v1({"__name__": "up"}))

    held = asyncio.Event()

    def answer(rec: Received) -> Reply:  # the small request stays in flight throughout
        # (held until the test lets it go, not for 2 s the big one had to fit in)
        small_write = len(rec.body) < 1000 and len(rec.raw) > 0
        return Reply(204, gate=held if small_write else None)

    async with (
        ScriptedUpstream(rule=answer) as up,
        aiohttp.ClientSession() as session,
        # room for the request's body and twice its decoded size beside the small one,
        # not for what its splice grows to
        proxy_running(tmp_path, up, max_body_bytes=len(body) + 10,
                      max_inflight_bytes=len(body) + 2 * len(raw) + 4096) as p,
    ):
        run = Running(p, up, session)
        waiting = asyncio.create_task(run.post(small, compress=False))
        async with asyncio.timeout(10):  # bounded: a request that never arrives fails
            while not up.received:
                await asyncio.sleep(0.01)
        resp = await asyncio.wait_for(run.post(raw), 10)
        held.set()
        assert resp.status == 503 and resp.headers["Retry-After"]
        assert (await waiting).status == 204
        assert run.metric("karta_proxy_splice_limits_total", {"result": "overload"}) == 1
        # alone in flight, it takes what it needs
        assert (await run.post(raw)).status == 204
        assert p.handler.budget.bytes == 0
    assert len(up.received) == 2


async def test_upstream_classes_reach_the_sender(tmp_path: Path) -> None:
    replies = [Reply(400, body=b"out of order sample"), Reply(500), Reply(429),
               Reply(503, {"Retry-After": "9"})]
    async with (
        ScriptedUpstream(*replies) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        r = Running(p, up, session)
        got = []
        for _ in replies:
            async with session.post(
                r.url + "/api/v1/write", data=snappy.compress(series_v1({"__name__": "u"})),
                headers={"Content-Type": CT_V1, "Content-Encoding": "snappy"},
            ) as resp:
                got.append((resp.status, resp.headers.get("Retry-After"), await resp.text()))
    assert got[0][0] == 400 and "out of order sample" in got[0][2]
    assert got[1][0] == 502
    assert got[2][:2] == (503, "1")
    assert got[3][:2] == (503, "9")


async def test_a_failing_upstream_logs_a_few_lines_and_counts_every_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request to an upstream that answers 500, then to one that is gone, was a
    warning each: now one line per kind at once, then one summary with the count."""
    caplog.set_level(logging.INFO, logger="karta.upstream")
    body = snappy.compress(series_v1({"__name__": "u"}))
    headers = {"Content-Type": CT_V1, "Content-Encoding": "snappy"}
    async with (
        ScriptedUpstream(Reply(500, body=b"boom")) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        for _ in range(100):
            async with session.post(url, data=body, headers=headers) as resp:
                assert resp.status == 502
        await up.stop()  # the port closed: every request now finds no upstream
        for _ in range(100):
            async with session.post(url, data=body, headers=headers) as resp:
                assert resp.status == 502
        metric = p.metrics.registry.get_sample_value
        assert len(up.received) == 100  # and the start's check, an empty write
        answers_500 = 100 + len(up.empty_writes)
        assert metric("karta_proxy_upstream_responses_total", {"code": "500"}) == answers_500
        assert metric("karta_proxy_upstream_responses_total", {"code": "connect_error"}) == 100
    lines = [(r.getMessage(), r.__dict__.get("count")) for r in caplog.records
             if r.name == "karta.upstream" and "check" not in r.getMessage()]
    assert lines == [
        ("upstream did not accept the request", None),
        ("upstream unreachable", None),
        ("upstream did not accept the request (repeated)", answers_500 - 1),
        ("upstream unreachable (repeated)", 99),
    ], lines


def _v2_with_bad_exemplar(case: str) -> bytes:
    req = RequestV2()
    req.symbols.extend(["", "__name__", "up", "namespace", "shop", "pod", "cart-7d9f8-abcde"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4, 5, 6])
    ts.samples.add(value=1.0, timestamp=1_700_000_000_000)
    ex = ts.exemplars.add(value=1.0, timestamp=1_700_000_000_000)
    if case == "ref_past_table":
        ex.labels_refs.extend([40, 41])
    else:  # odd number of refs
        ex.labels_refs.extend([1])
    return cast(bytes, req.SerializeToString())


@pytest.mark.parametrize("case", ["ref_past_table", "odd_refs"])
@pytest.mark.parametrize("protocol", ["v1", "auto"])
async def test_malformed_v2_toward_a_v1_upstream_is_400_never_500(
        tmp_path: Path, case: str, protocol: UpstreamProtocol) -> None:
    # converted up front (upstream.protocol v1) or after the upstream's 415 (auto): either
    # way a 400 with its kind, counted; a 500 would be retried by the sender forever
    def rule(rec: Any) -> Reply:
        return Reply(415) if "v2" in rec.headers["Content-Type"] else Reply(204)

    async with ScriptedUpstream(rule=rule) as up, aiohttp.ClientSession() as session:
        p = await start_proxy(tmp_path, up)
        p.upstream.settings.protocol = protocol
        p.upstream.v1_only = protocol == "v1"
        try:
            async with session.post(
                f"http://127.0.0.1:{p.port}/api/v1/write",
                data=snappy.compress(_v2_with_bad_exemplar(case)),
                headers={"Content-Type": CT_V2, "Content-Encoding": "snappy"},
            ) as resp:
                text = await resp.text()
            assert resp.status == 400, text
            errors = p.metrics.registry.get_sample_value(
                "karta_proxy_decode_errors_total", {"kind": "protobuf_invalid"})
            assert errors == 1
        finally:
            await p.stop()
    assert not any("v2" not in r.headers["Content-Type"] and len(r.raw) > 0
                   for r in up.received), "nothing converted reached the upstream"


async def test_v2_to_v1_upstream_through_the_proxy(tmp_path: Path) -> None:
    def rule(rec: Any) -> Reply:
        return Reply(415) if "v2" in rec.headers["Content-Type"] else Reply(204)

    async with (
        ScriptedUpstream(rule=rule) as up,
        aiohttp.ClientSession() as session,
        proxy_running(tmp_path, up) as p,
    ):
        cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
        async with session.post(
            f"http://127.0.0.1:{p.port}/api/v1/write",
            data=snappy.compress(series_v2(cart)),
            headers={"Content-Type": CT_V2, "Content-Encoding": "snappy"},
        ) as resp:
            assert resp.status == 204
            assert resp.headers["X-Prometheus-Remote-Write-Samples-Written"] == "1"
    assert labels_of(up.received[-1].raw) == [{**cart, **CART}]


@pytest.mark.parametrize(
    ("upstream_path", "sent_to", "arrives_at"),
    [
        ("/insert/0/prometheus/api/v1/write", "/insert/42/prometheus/api/v1/write",
         "/insert/42/prometheus/api/v1/write"),
        ("/insert/0/prometheus/api/v1/write", "/insert/7:3/prometheus",
         "/insert/7:3/prometheus/api/v1/write"),
        ("/insert/0/prometheus/", "/insert/multitenant/prometheus/",
         "/insert/multitenant/prometheus/"),
        ("/insert/0/prometheus/api/v1/write", "/api/v1/write",
         "/insert/0/prometheus/api/v1/write"),
        ("/select/{tenant}/x/api/v1/push", "/insert/9/prometheus/api/v1/write",
         "/select/9/x/api/v1/push"),
        ("/select/{tenant}/x/api/v1/push", "/api/v1/write", "/select/0/x/api/v1/push"),
    ],
)
async def test_tenant_paths_reach_the_same_tenant_upstream(
        tmp_path: Path, upstream_path: str, sent_to: str, arrives_at: str) -> None:
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        base = up.url.removesuffix("/api/v1/write")
        async with proxy_running(tmp_path, up, upstream_url=base + upstream_path) as p:
            cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
            async with session.post(
                f"http://127.0.0.1:{p.port}{sent_to}", data=snappy.compress(series_v1(cart)),
                headers={"Content-Type": CT_V1, "Content-Encoding": "snappy"},
            ) as resp:
                assert resp.status == 204, await resp.text()
    assert [r.path for r in up.received] == [arrives_at]
    assert labels_of(up.received[0].raw) == [{**cart, **CART}]


async def test_tenant_path_without_a_place_upstream_is_503(running: Running) -> None:
    # the upstream is a plain /api/v1/write: forwarding would drop the tenant the sender
    # named and store its data in the TSDB's only one
    resp = await running.post(series_v1({"__name__": "up"}),
                              path="/insert/42/prometheus/api/v1/write")
    assert resp.status == 503 and resp.headers["Retry-After"]
    assert running.upstream.received == []
    assert running.metric("karta_proxy_upstream_misconfigured_total",
                          {"url": running.upstream.url, "reason": "no_tenant_place",
                           "code": ""}) == 1


async def test_tenant_paths_without_a_place_are_one_log_line(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    # a sender picks the path: one error line each was a log flood of its choosing (found
    # by the soak audit: 1,000 requests, 1,000 lines)
    with caplog.at_level("ERROR", logger="karta.upstream"):
        for tenant in range(30):
            resp = await running.post(series_v1({"__name__": "up"}),
                                      path=f"/insert/{tenant}/prometheus/api/v1/write")
            assert resp.status == 503
    lines = [r for r in caplog.records if "no place for a tenant" in r.getMessage()]
    assert len(lines) == 1, len(lines)


@pytest.mark.parametrize("tenant", ["acme", "%D9%A1%D9%A2", "1:%DB%B3", "%EF%BC%97"])
async def test_invalid_tenant_is_400(running: Running, tenant: str) -> None:
    # other scripts' digits ("\d" matched Arabic-Indic ١٢) are no VictoriaMetrics tenant
    resp = await running.post(series_v1({"__name__": "up"}),
                              path=f"/insert/{tenant}/prometheus/api/v1/write")
    assert resp.status == 400
    assert running.upstream.received == []
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "invalid_tenant"}) == 1
    # counted under the route, not one label value per tenant
    assert running.metric("karta_proxy_requests_total", {
        "path": "/insert/{tenant}/prometheus/api/v1/write", "protocol": "unknown",
        "code": "400"}) == 1


@pytest.mark.parametrize("case", ["zstd_corrupt", "protobuf_invalid", "bad_part"])
async def test_a_refused_request_leaves_no_cycle_holding_its_buffers(
        running: Running, case: str) -> None:
    # a request refused in a worker thread: its error's traceback held the frames that
    # held the future that held the error, a cycle with the request's decoded buffers
    # (tens of MB) freed only when the cycle collector ran: 40 refused 32 KiB zstd bombs
    # took the proxy from 50 to 919 MB
    good = series_v1(*({"__name__": "m", "i": str(i), "pad": "p" * 100} for i in range(4000)))
    assert len(good) > 2 * PART_DECODED_BYTES  # in parts, in the workers
    if case == "zstd_corrupt":  # declares 1,000 bytes more than it holds: refused in
        # _zstd_into (in a worker thread) once decompressed
        frame = bytearray(cramjam.zstd.compress(good))
        fhd = frame[4]  # frame header descriptor: a 4-byte content size, no dictionary id
        assert fhd >> 6 == 2 and fhd & 3 == 0, hex(fhd)
        single_segment = fhd >> 5 & 1  # else a window descriptor byte comes first
        struct.pack_into("<I", frame, 6 - single_segment, len(good) + 1000)
        body, encoding, compress = bytes(frame), "zstd", False
    elif case == "protobuf_invalid":
        body, encoding, compress = b"\x0a\xff\xff\xff\x0f" + good, "snappy", True
    else:  # the last of the parts is broken: refused in a part thread
        body, encoding, compress = good + b"\x0a\x05\x0a\x03", "snappy", True
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            resp = await running.post(body, encoding=encoding, compress=compress)
            assert resp.status == 400, resp
        gc.collect()
        cycles = [o for o in gc.garbage
                  if isinstance(o, BaseException) or type(o).__name__ == "frame"]
        assert cycles == [], cycles[:5]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_a_body_of_many_zstd_frames_does_not_hold_the_loop(running: Running) -> None:
    # 15 MB of empty zstd frames (1.75M): the header walk ran in Python on the event loop,
    # twice, and the body was decompressed there too (it declares 0 bytes): /-/healthy
    # waited 5.8 s behind it. Now the walk stops at ZSTD_WALK_STEPS and the rest is C in
    # a worker thread
    body = bytes(cramjam.zstd.compress(b"")) * 1_500_000
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        resp = await running.post(body, encoding="zstd", compress=False)
    finally:
        ticker.cancel()
    assert resp.status == 204  # an empty write, as it declares
    # the loop kept turning: its longest stall was ~1.8 s per walk before (twice)
    gap = max(b - a for a, b in itertools.pairwise(ticks))
    assert gap < 1.0, gap


# -- RW 2.0 converted for a 1.0-only upstream: bounded and charged ---------------------


def _v1_only(rec: Any) -> Reply:
    """A 1.0-only receiver (415 to RW 2.0, as Prometheus 2.42 answers a proto it does not
    know)."""
    return Reply(415) if "v2" in rec.headers["Content-Type"] else Reply(204)


async def _post_v2(session: aiohttp.ClientSession, p: Proxy, raw: bytes
                   ) -> tuple[int, dict[str, str], str]:
    async with session.post(f"http://127.0.0.1:{p.port}/api/v1/write",
                            data=snappy.compress(raw),
                            headers={"Content-Type": CT_V2, "Content-Encoding": "snappy"}
                            ) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def test_an_unavailable_upstream_is_probed_again_at_most_every_few_seconds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # every RW 2.0 request asked for a check while the last one found the upstream
    # unavailable: one probe and one warning each, in an outage (found by the soak audit:
    # 500 requests, 500 probes and lines)
    down = Reply(503, body=b"unavailable")
    async with ScriptedUpstream(down, record_empty=True) as up, \
            aiohttp.ClientSession() as session, proxy_running(tmp_path, up) as p:
        probes = len(up.empty_writes)
        with caplog.at_level("WARNING", logger="karta.upstream"):
            for _ in range(30):
                status, _, _ = await _post_v2(session, p, request_v2({"__name__": "up"}))
                assert status == 503
        assert len(up.empty_writes) - probes <= 1, len(up.empty_writes) - probes
        assert sum("not available at the check" in r.getMessage()
                   for r in caplog.records) <= 1


@pytest.mark.parametrize("protocol", ["v1", "auto"])
async def test_a_conversion_past_what_rw1_may_hold_is_413_before_it_is_made(
        tmp_path: Path, protocol: UpstreamProtocol) -> None:
    # 23 KB of RW 2.0 converted to 263 MB of RW 1.0 (RSS 60 -> 586 MiB for a 32 MiB
    # budget, answered 204). Its converted size is known before a byte of it is made: past
    # what a conversion may make (max_decoded_bytes, 64 MiB here) it is 413. Converted up
    # front ("v1": in the handler's worker) or after the upstream's 415 ("auto": forward)
    raw = amplifying_v2(65536, 4000)
    async with ScriptedUpstream(rule=_v1_only) as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up, max_inflight_bytes=32 * 2**20) as p:
        p.upstream.settings.protocol = protocol
        p.upstream.v1_only = protocol == "v1"
        tracemalloc.start()
        try:
            status, _, text = await _post_v2(session, p, raw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert status == 413, text
        assert "converted to RW 1.0" in text and "max_decoded_bytes" in text
        assert peak < 8 * 2**20, peak
        assert metric(p, "karta_proxy_requests_rejected_total", reason="too_large") == 1
        assert p.handler.budget.bytes == 0
    assert not any("v2" not in r.headers["Content-Type"] for r in up.received), \
        "nothing converted reached the upstream"


def test_a_conversion_may_make_what_the_byte_budget_can_hold() -> None:
    # a big RW 2.0 request of real label sets converts to 2-3x its decoded size: past
    # max_decoded_bytes, a 413 would lose it (a sender drops a batch refused with a 4xx);
    # up to a third of the budget (what a conversion holds: CONVERT_COPIES) it is made
    from proxy.upstream import CONVERT_COPIES, conversion_limit

    assert conversion_limit(64 * 2**20, 512 * 2**20) == 512 * 2**20 // CONVERT_COPIES
    assert conversion_limit(64 * 2**20, 32 * 2**20) == 64 * 2**20


@pytest.mark.parametrize("protocol", ["v1", "auto"])
async def test_a_big_conversion_under_the_limit_still_passes(
        tmp_path: Path, protocol: UpstreamProtocol) -> None:
    # 64 KiB x 40 series: 2.6 MB converted, under a 4 MiB limit (max_decoded_bytes, and a
    # third of max_inflight_bytes): converted and stored whole; 64 KiB x 80 (5.2 MB) past
    # it: 413
    async with ScriptedUpstream(rule=_v1_only) as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up, max_decoded_bytes=4 * 2**20, max_body_bytes=2**20,
                          max_inflight_bytes=12 * 2**20) as p:
        p.upstream.settings.protocol = protocol
        p.upstream.v1_only = protocol == "v1"
        status, headers, text = await _post_v2(session, p, amplifying_v2(65536, 40))
        assert status == 204, text
        assert headers["X-Prometheus-Remote-Write-Samples-Written"] == "40"
        (rec,) = [r for r in up.received if "v2" not in r.headers["Content-Type"]]
        converted = labels_of(rec.raw)
        assert len(converted) == 40 and all(s["blob"] == "x" * 65536 for s in converted)
        status, _, text = await _post_v2(session, p, amplifying_v2(65536, 80))
        assert status == 413, text
        assert metric(p, "karta_proxy_requests_rejected_total", reason="too_large") == 1
        assert p.handler.budget.bytes == 0


async def test_conversions_at_once_are_held_to_the_byte_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a conversion holds about three times its converted size (the series, their join, the
    # compressed copy), charged to its request before it is made: with one conversion of
    # 6.6 MB (20 MB charged) in flight, a second does not fit a 32 MiB budget: 503 +
    # Retry-After, sent again later, never both held at once
    import proxy.upstream as upstream_module

    entered = threading.Event()
    go_on = threading.Event()
    seen: list[int] = []
    convert = upstream_module.v2_to_v1

    async with ScriptedUpstream(rule=_v1_only) as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up, max_inflight_bytes=32 * 2**20, worker_threads=2) as p:
        p.upstream.v1_only = True
        budget = p.handler.budget

        def held_open(raw: bytes, size: int | None = None) -> bytes:
            seen.append(budget.bytes)
            if not entered.is_set():
                entered.set()
                go_on.wait(10)
            return convert(raw, size)

        monkeypatch.setattr(upstream_module, "v2_to_v1", held_open)
        raw = amplifying_v2(65536, 100)
        first = asyncio.create_task(_post_v2(session, p, raw))
        assert await asyncio.to_thread(entered.wait, 10)
        try:
            second = await _post_v2(session, p, raw)
        finally:
            go_on.set()
        status, _, text = await first
        assert status == 204, text
        assert second[0] == 503, second
        assert second[1]["Retry-After"] == "1"
        assert "too many request bytes in flight" in second[2]
        assert seen and max(seen) <= 32 * 2**20 and seen[0] >= 3 * 6_000_000, seen
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 1
        # alone in flight it goes through
        status, _, text = await _post_v2(session, p, raw)
        assert status == 204, text
        assert budget.bytes == 0


@pytest.mark.parametrize(("max_decoded", "status"), [(1 * 2**20, 413), (3 * 2**20, 204)])
async def test_a_request_converted_in_parts_keeps_the_bound(
        tmp_path: Path, max_decoded: int, status: int) -> None:
    # auto, the upstream not yet known 1.0-only: the RW 2.0 request goes out as it came,
    # is refused as too large (413), cut in halves, the first half's 415 teaches it RW 1.0,
    # and every half is converted: each under the bound (a half of 64 KiB x 64 series is
    # 2.1 MB converted), or refused before it is made
    raw = amplifying_v2(65536, 64)

    def rule(rec: Any) -> Reply:
        if "v2" not in rec.headers["Content-Type"]:
            return Reply(204)
        if not rec.raw:  # the check at start: taken as an RW 2.0 receiver takes it
            return rw2_receiver(rec)
        # every part has the whole symbols table: a limit on series (VictoriaMetrics'
        # -maxRowsPerLine-like) rather than bytes
        return Reply(413) if len(RequestV2.FromString(rec.raw).timeseries) > 32 else Reply(415)

    async with ScriptedUpstream(rule=rule) as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up, max_decoded_bytes=max_decoded, max_body_bytes=2**20,
                          max_inflight_bytes=3 * max_decoded) as p:
        await p.upstream.check()
        assert not p.upstream.v1_only
        tracemalloc.start()
        try:
            got, headers, text = await _post_v2(session, p, raw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got == status, text
        assert p.handler.budget.bytes == 0
        converted = [r for r in up.received if "v2" not in r.headers["Content-Type"]]
        # the whole as it came (413), its first half as it came (415)
        assert len([r for r in up.received if "v2" in r.headers["Content-Type"]
                    and r.raw]) == 2
        if status == 413:
            assert "converted to RW 1.0" in text
            assert converted == []
            assert peak < 4 * 2**20, peak
            assert metric(p, "karta_proxy_requests_rejected_total", reason="too_large") == 1
        else:
            assert headers["X-Prometheus-Remote-Write-Samples-Written"] == "64"
            assert [len(labels_of(r.raw)) for r in converted] == [32, 32]


async def test_series_the_stamp_would_push_past_the_label_limit_are_counted_and_logged(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    """upstream.max_labels_per_series, 30 by default (VictoriaMetrics' and Mimir's): a cart
    series of 29 labels would have 34 with the stamp, so it goes as sent, counted
    label_limit, and one line a throttle interval names its metric; a narrow one of the
    same pod is stamped."""
    caplog.set_level(logging.WARNING, logger="karta.handler")
    pod = {"namespace": "shop", "pod": "cart-7d9f8-abcde"}
    wide = [{"__name__": "wide_metric", **pod, "i": str(i),
             **{f"l{j:02d}": "v" for j in range(25)}} for i in range(2)]
    narrow = {"__name__": "narrow_metric", **pod}
    for _ in range(3):
        assert (await running.post(series_v1(*wide, narrow))).status == 204
    for rec in running.upstream.received:
        assert labels_of(rec.raw) == [*wide, {**narrow, **CART}]
    assert running.metric("karta_proxy_series_unattributed_total",
                          {"reason": "label_limit"}) == 6
    assert running.metric("karta_proxy_series_attributed_total") == 3
    running.proxy.handler.flush_logs()
    lines = [(r.getMessage(), r.__dict__.get("metric"), r.__dict__.get("labels"),
              r.__dict__.get("limit"), r.__dict__.get("series"), r.__dict__.get("count"))
             for r in caplog.records if "label limit" in r.getMessage()]
    assert lines == [
        ("a series over the TSDB's label limit with the stamp, forwarded unattributed",
         "wide_metric", 34, 30, 2, None),
        ("series over the TSDB's label limit with the stamp, forwarded unattributed",
         "wide_metric", 34, 30, 2, 2),
    ]


async def test_a_flooded_symbol_index_is_counted_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request whose RW 2.0 symbols collide in the splice's hash (a hash flood: O(n^2)
    probe steps before the index was keyed past a budget) is forwarded whole, counted in
    ``karta_proxy_symbol_index_floods_total`` and said in one throttled warning naming
    the sender and the request's size. The tables hash with a known seed here (the
    process' is secret), set before the proxy makes its own."""
    from proxy.wire import _splice
    from tests.wire.test_native_flood import SEED, colliding, request

    symbols = [b"", b"__name__", b"up", b"namespace", b"shop", b"pod", b"cart-7d9f8-abcde",
               *colliding(60, 60)]
    raw = request(symbols, [[1, 2, 3, 4, 5, 6]])
    old = _splice._set_v2_seed(SEED)
    try:
        async with ScriptedUpstream(rule=rw2_receiver) as up, \
                aiohttp.ClientSession() as session, proxy_running(tmp_path, up) as p:
            with caplog.at_level("WARNING", logger="karta.handler"):
                status, _, _ = await _post_v2(session, p, raw)
            floods = metric(p, "karta_proxy_symbol_index_floods_total")
    finally:
        _splice._set_v2_seed(old)
    assert status == 204
    assert floods == 1
    (line,) = [r for r in caplog.records if "symbol index was rebuilt" in r.getMessage()]
    assert getattr(line, "symbols", None) == len(symbols), vars(line)


async def test_a_worker_thread_that_cannot_start_is_a_503_and_the_next_request_is_served(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    # at a pids limit the first request that needed a worker got aiohttp's bare 500, and
    # every later one waited for good (the pool counted as started, no thread running)
    real = threading.Thread.start
    failed: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("karta-splice") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    cart = {"__name__": "container_cpu_usage_seconds_total", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}
    raw = series_v1(*({**cart, "id": f"/kubepods/{i:06d}" + "x" * 200} for i in range(2000)))
    assert len(raw) > INLINE_DECODED_BYTES  # it goes to a worker
    async with asyncio.timeout(20):
        refused = await running.post(raw)
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"
        said = await refused.text()
        assert "cannot start a worker thread" in said
        # both limits a thread start meets, named (RLIMIT_AS stopped one in the alerts test)
        assert "pids limit" in said and "address-space limit (ulimit -v" in said, said
        assert failed == ["karta-splice_0"]
        assert running.metric("karta_proxy_requests_rejected_total",
                              {"reason": "thread_limit"}) == 1
        assert (await running.post(raw)).status == 204  # the start tried again
    assert running.metric("karta_proxy_worker_queued_requests") == 0
    assert len(running.upstream.received) == 1


@pytest.mark.parametrize("failure", [
    MemoryError(), OSError(12, "Cannot allocate memory")], ids=["MemoryError", "ENOMEM"])
async def test_an_allocation_that_fails_while_decoding_is_a_503_not_a_500(
        running: Running, monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    # under an address-space limit MemoryError (the splice, snappy) and ENOMEM (mmap of a
    # scratch buffer) reached aiohttp: a 500 with a traceback
    import proxy.handler

    real = proxy.handler.decompress_scratch
    calls: list[int] = []

    def decompress(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(proxy.handler, "decompress_scratch", decompress)
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    resp = await running.post(series_v1(cart))
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await resp.text()).startswith("out of memory decoding the request")
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "out_of_memory"}) == 1
    assert running.metric("karta_proxy_inflight_bytes") == 0  # its budget released
    assert (await running.post(series_v1(cart))).status == 204


async def test_an_allocation_that_fails_while_forwarding_is_a_503(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    async def forward(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError  # snappy.uncompress of a body sent again in parts

    monkeypatch.setattr(running.proxy.handler.upstream, "forward", forward)
    resp = await running.post(series_v1({"__name__": "up"}))
    assert resp.status == 503
    assert (await resp.text()).startswith("out of memory forwarding the request")
    assert running.metric("karta_proxy_requests_rejected_total",
                          {"reason": "out_of_memory"}) == 1
    assert running.metric("karta_proxy_inflight_requests") == 0


async def test_series_of_another_cluster_are_counted_and_logged_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy of cluster c1 (facts.external_labels) stamps a cart series labelled c1 (or
    with no cluster), forwards one labelled c2 unstamped and 2xx'd, counts it
    other_cluster, and says so in one line per interval: the label, the value
    seen, its own, the sender and what to change."""
    caplog.set_level(logging.INFO)
    pod = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    ours, theirs = {**pod, "cluster": "c1"}, {**pod, "cluster": "c2"}
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up,
                          facts_settings={"external_labels": {"cluster": "c1"}}) as p:
        running = Running(p, up, session)
        for _ in range(3):
            assert (await running.post(series_v1(ours, theirs, pod))).status == 204
        for rec in up.received:
            assert labels_of(rec.raw) == [{**ours, **CART}, theirs, {**pod, **CART}]
        assert running.metric("karta_proxy_series_unattributed_total",
                              {"reason": "other_cluster"}) == 3
        assert running.metric("karta_proxy_series_attributed_total") == 6
        p.handler.flush_logs()
    lines = [r for r in caplog.records if "another cluster" in r.getMessage()]
    assert [(r.levelname, r.__dict__.get("count")) for r in lines] == [
        ("WARNING", None), ("WARNING", 2)]
    first = lines[0].__dict__
    assert (first["label"], first["seen"], first["expected"], first["series"]) == (
        "cluster", "c2", "c1", 1)
    assert first["remote"] == "127.0.0.1"
    assert first["fix"] == (
        'if these series are this cluster\'s, make the agents\' external label '
        'cluster="c1", or set facts.external_labels.cluster: "c2" here (a restart); '
        'enrich.cluster_label: "" turns the check off')
    assert not [r for r in caplog.records if "is not checked" in r.getMessage()]


async def test_an_extra_label_of_another_cluster_leaves_the_whole_request_unstamped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """VictoriaMetrics sets an ``extra_label`` of the URL as forwarded (upstream.url's,
    then the sender's; the last non-empty one of a name wins) over the series' own label:
    one naming another cluster than the proxy's stored every series there, stamped with
    this cluster's pods, whatever the body said (the check read the body only). Such a
    request is spliced over no pods: its pod series counted other_cluster (not
    pod_unknown), the others no_pod_label, the sender's karta_* labels dropped, the data
    2xx'd with the Written headers of what was stored, one warning naming the source.
    upstream.url's own of another cluster is a settings error where requests naming no
    tenant go (tests/test_config.py); through a {tenant} in its value it is found for the
    tenant a request names: every proxy here runs on settings the CLI accepts."""
    caplog.set_level(logging.WARNING, logger="karta.handler")
    pod = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    ours = {**pod, "cluster": "c1"}
    forged = {**pod, "karta_workload": "evil"}
    node = {"__name__": "node_load1", "instance": "n1"}
    sent = [ours, pod, forged, node]
    unstamped = [ours, pod, pod, node]
    stamped = [{**ours, **CART}, {**pod, **CART}, {**pod, **CART}, node]
    c1 = {"external_labels": {"cluster": "c1"}}
    for d in "abc":
        (tmp_path / d).mkdir()
    async with ScriptedUpstream(rule=rw2_receiver) as up, \
            aiohttp.ClientSession() as session, \
            proxy_running(tmp_path / "a", up, facts_settings=c1) as plain, \
            proxy_running(tmp_path / "b", up, facts_settings=c1,
                          upstream_url=up.url + "?extra_label=cluster=c1") as url_c1, \
            proxy_running(tmp_path / "c", up, facts_settings=c1,
                          upstream_url=up.url + "?extra_label=cluster=c{tenant}",
                          upstream_settings={"default_tenant": "1"}) as per_tenant:
        proxies = {"plain": plain, "url_c1": url_c1, "per_tenant": per_tenant}
        for p in proxies.values():
            validate(p.settings)
            p.handler._other_cluster.interval = 0.0  # a line per case
        cases = [  # proxy, the tenant in the path, the sender's query, stamped, the source
            ("plain", None, "extra_label=cluster=c2", False, "the sender's URL"),
            ("plain", None, "extra%5Flabel=cluster%3Dc2", False, "the sender's URL"),
            ("plain", None, "extra_label=cluster=c2&extra_label=cluster=", False,
             "the sender's URL"),
            ("plain", None, "extra_label=cluster=c1&extra_label=env=prod", True, None),
            ("plain", None, "extra_label=%20cluster=c2", True, None),  # another label
            ("plain", None, "extra_label=cluster=c%zz", True, None),  # Go skips the pair
            ("plain", None, "Extra_Label=cluster=c2", True, None),  # another parameter
            ("url_c1", None, "extra_label=cluster=c2", False, "the sender's URL"),
            ("url_c1", None, "", True, None),
            ("per_tenant", None, "", True, None),  # the default tenant's: c1
            ("per_tenant", "1", "", True, None),
            ("per_tenant", "2", "", False, "upstream.url (tenant 2)"),
            ("per_tenant", "2", "extra_label=cluster=c1", True, None),  # the last one wins
            ("per_tenant", "1", "extra_label=cluster=c2", False, "the sender's URL"),
        ]
        for name, tenant, query, is_stamped, source in cases:
            caplog.clear()
            up.received.clear()
            p = proxies[name]
            before = {r: metric(p, "karta_proxy_series_unattributed_total", reason=r)
                      for r in ("other_cluster", "no_pod_label", "pod_unknown")}
            attributed = metric(p, "karta_proxy_series_attributed_total")
            dropped = metric(p, "karta_proxy_series_sender_karta_labels_dropped_total")
            path = ("/api/v1/write" if tenant is None
                    else f"/insert/{tenant}/prometheus/api/v1/write")
            url = f"http://127.0.0.1:{p.port}{path}" + (f"?{query}" if query else "")
            async with session.post(URL(url, encoded=True),  # the query as it is
                                    data=snappy.compress(series_v2(*sent)), headers={
                    "Content-Type": CT_V2, "Content-Encoding": "snappy",
                    "X-Prometheus-Remote-Write-Version": "2.0.0"}) as resp:
                assert resp.status == 204, (name, query)
                assert resp.headers["X-Prometheus-Remote-Write-Samples-Written"] == "4"
            (rec,) = up.received
            own = p.upstream.url.partition("?")[2].replace(
                "{tenant}", tenant or p.settings.upstream.default_tenant)
            assert rec.query == "&".join(q for q in (own, query) if q)  # as it came
            req = RequestV2.FromString(rec.raw)
            syms = list(req.symbols)
            got = [{syms[r[i]]: syms[r[i + 1]] for i in range(0, len(r), 2)}
                   for r in (list(ts.labels_refs) for ts in req.timeseries)]
            assert got == (stamped if is_stamped else unstamped), (name, tenant, query)
            counted = {r: metric(p, "karta_proxy_series_unattributed_total", reason=r)
                       - n for r, n in before.items()}
            assert counted == ({"other_cluster": 0, "no_pod_label": 1, "pod_unknown": 0}
                               if is_stamped else
                               {"other_cluster": 3, "no_pod_label": 1, "pod_unknown": 0}), \
                (name, tenant, query)
            assert metric(p, "karta_proxy_series_attributed_total") - attributed == (
                3 if is_stamped else 0)
            assert metric(p, "karta_proxy_series_sender_karta_labels_dropped_total") \
                - dropped == 1
            lines = [r.__dict__ for r in caplog.records if "another cluster" in r.getMessage()]
            if source is None:
                assert not lines, (name, tenant, query)
                continue
            (line,) = lines
            assert (line["label"], line["seen"], line["expected"], line["series"]) == (
                "cluster", "c2", "c1", 3)
            assert line["source"] == f"extra_label=cluster=c2 in {source}"
            assert line["fix"].startswith(
                'the TSDB stores every series of these requests under cluster="c2"'
                if source == "the sender's URL" else
                'upstream.url stores every series of tenant 2 under cluster="c2" (its '
                'extra_label, with the tenant in its {tenant}): if they are this '
                "cluster's, make that extra_label cluster=c1 for every tenant")


async def test_a_big_request_of_another_cluster_by_its_url_is_counted_whole(
    tmp_path: Path
) -> None:
    """A request spliced in parts (over 2 x 256 KiB decoded, two workers) whose sender's
    URL names another cluster: every part over no pods, every pod series counted
    other_cluster in the merged result."""
    cart = {"__name__": "container_cpu_usage_seconds_total", "namespace": "shop",
            "pod": "cart-7d9f8-abcde", "container": "cart"}
    raw = series_v1(*({**cart, "id": f"/kubepods/{i:06d}" + "x" * 200} for i in range(3000)))
    assert len(raw) > 2 * PART_DECODED_BYTES
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up, worker_threads=2,
                          facts_settings={"external_labels": {"cluster": "c1"}}) as p:
        running = Running(p, up, session)
        assert (await running.post(raw, path="/api/v1/write?extra_label=cluster=c2")
                ).status == 204
        (rec,) = up.received
        assert not any("karta_workload" in labels for labels in labels_of(rec.raw))
        assert running.metric("karta_proxy_series_unattributed_total",
                              {"reason": "other_cluster"}) == 3000
        assert running.metric("karta_proxy_series_unattributed_total",
                              {"reason": "pod_unknown"}) == 0


async def test_values_of_another_cluster_make_one_line_per_interval_not_one_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The line was throttled per value seen, the value the sender's to choose: 300
    requests of 300 values made 300 warnings and 300 windows kept for good. One line per
    interval now, its summary naming the last value and how many there were."""
    caplog.set_level(logging.WARNING, logger="karta.handler")
    pod = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session, \
            proxy_running(tmp_path, up,
                          facts_settings={"external_labels": {"cluster": "c1"}}) as p:
        running = Running(p, up, session)
        for i in range(300):
            resp = await running.post(series_v1({**pod, "cluster": f"x{i:03d}" + "y" * 190}))
            assert resp.status == 204
        assert len(p.handler._other_cluster._windows) == 1
        p.handler.flush_logs()
    lines = [r.__dict__ for r in caplog.records if "another cluster" in r.getMessage()]
    assert [x.get("count") for x in lines] == [None, 299]
    assert lines[0]["seen"].startswith("x000") and lines[1]["seen"].startswith("x299")
    assert lines[1]["seen_values"] == 100  # counted up to DISTINCT_COUNTED


async def test_a_proxy_without_a_cluster_of_its_own_says_it_checks_none(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    """No facts.external_labels.cluster: the check is off (a series of any cluster is
    stamped, as before), which the start said in one info line (tested in test_config)."""
    cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde", "cluster": "c2"}
    assert (await running.post(series_v1(cart))).status == 204
    assert labels_of(running.upstream.received[0].raw) == [{**cart, **CART}]
    assert running.metric("karta_proxy_series_unattributed_total",
                          {"reason": "other_cluster"}) == 0
