"""RW 2.0 senders in front of the real RW 1.0-only receivers, on the proxy's defaults.

Prometheus 2.42 and VictoriaMetrics answer an RW 2.0 body with 204 and store nothing. The
proxy must never pass that on as success: every sample is stored, or the sender gets a
5xx. Also: a wrong upstream path is a 503 (the sender keeps its batch), found at start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp
import pytest

from proxy.config import UpstreamSettings
from proxy.metrics import ProxyMetrics
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2
from proxy.sender import Series, build_v2, send, send_series
from proxy.upstream import WRITTEN_EXEMPLARS, WRITTEN_HISTOGRAMS, WRITTEN_SAMPLES, Upstream
from proxy.wire.primitives import STALE_NAN, Counts, Protocol
from tests.peers.conftest import InProcessProxy, Peer, Peers, query, vm_flush, wait_until

pytestmark = pytest.mark.peers

NAMESPACE, POD = "web", "frontend-6d8f7b9c5d-4xkqp"


def batch(metric: str, n_series: int = 3, n_samples: int = 4) -> list[Series]:
    now = int(time.time() * 1000) - 60_000
    return [
        Series({"__name__": metric, "namespace": NAMESPACE, "pod": POD, "idx": str(i)},
               [(now + k * 1000, float(i * 10 + k)) for k in range(n_samples)])
        for i in range(n_series)
    ]


async def receiver(peers: Peers, kind: str) -> Peer:
    return await (peers.prometheus_receiver() if kind == "prometheus"
                  else peers.victoria_metrics())


async def stored_samples(peer: Peer, kind: str, metric: str) -> float:
    if kind == "vm":
        await vm_flush(peer)
    rows = await query(peer.base_url, f"sum(count_over_time({metric}[10m]))")
    return float(rows[0]["value"][1]) if rows else 0.0


@pytest.mark.parametrize("kind", ["prometheus", "vm"])
async def test_rw2_sender_on_defaults_every_sample_is_stored(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], kind: str,
) -> None:
    rx = await receiver(peers, kind)
    proxy = await make_proxy(rx.base_url + "/api/v1/write")
    upstream = proxy.proxy.upstream
    assert (await upstream.check()).outcome == "rw1"  # the start's check, awaited
    status, headers, text = await send_series(proxy.write_url, batch("rw2_on_defaults"),
                                              protocol=Protocol.V2)
    assert status == 204, text
    assert headers[WRITTEN_SAMPLES] == "12"

    async def stored() -> bool:
        return await stored_samples(rx, kind, "rw2_on_defaults") == 12

    await wait_until(stored, timeout=15, what="12 samples stored")
    rows = await query(rx.base_url, "rw2_on_defaults")
    assert len(rows) == 3 and all(r["metric"].get("karta_workload") for r in rows)


@pytest.mark.parametrize("kind", ["prometheus", "vm"])
async def test_exemplars_a_1_0_receiver_drops_are_not_claimed_written(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], kind: str,
) -> None:
    # Prometheus 2.42 without exemplar storage and VictoriaMetrics take the request (2xx)
    # and drop its exemplars: Exemplars-Written said 1, a loss the sender was told was
    # stored; now 0 (upstream.rw1_confirms_exemplars off, the default)
    rx = await receiver(peers, kind)
    proxy = await make_proxy(rx.base_url + "/api/v1/write")
    await proxy.proxy.upstream.check()
    now = int(time.time() * 1000) - 1000
    series = Series({"__name__": "rw2_exemplar", "namespace": NAMESPACE, "pod": POD},
                    [(now, 1.0)], exemplars=[({"trace_id": "abc"}, now, 1.0)])
    status, headers, text = await send_series(proxy.write_url, [series], protocol=Protocol.V2)
    assert status == 204, text
    assert (headers[WRITTEN_SAMPLES], headers[WRITTEN_EXEMPLARS]) == ("1", "0")
    if kind == "prometheus":  # where an exemplar could be read back, there is none
        async with aiohttp.ClientSession() as s, s.get(
                rx.base_url + "/api/v1/query_exemplars",
                params={"query": "rw2_exemplar", "start": str(now / 1000 - 60),
                        "end": str(now / 1000 + 60)}) as r:
            assert (await r.json())["data"] == []


async def test_samples_written_is_only_as_true_as_the_receivers_2xx(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    """The limit docs/operations.md states (upstream 2xx): a converted request's
    Samples-Written trusts a 1.0 receiver to refuse samples it cannot take, as Prometheus
    does (400 out of bounds). VictoriaMetrics answers 204 to samples past its retention
    and stores none of them, and the proxy still claims them written. If this starts to
    fail, the receiver or the proxy changed: update the documentation with it."""
    rx = await peers.victoria_metrics(extra=["-retentionPeriod=1"])  # its default, 1 month
    proxy = await make_proxy(rx.base_url + "/api/v1/write")
    await proxy.proxy.upstream.check()
    old = int(time.time() * 1000) - 400 * 86_400_000
    series = [Series({"__name__": "rw2_out_of_retention", "namespace": NAMESPACE, "pod": POD,
                      "idx": str(i)}, [(old, 1.0)]) for i in range(3)]
    status, headers, text = await send_series(proxy.write_url, series, protocol=Protocol.V2)
    assert status == 204, text
    assert headers[WRITTEN_SAMPLES] == "3"  # claimed: nothing tells the proxy otherwise
    await vm_flush(rx)
    async with aiohttp.ClientSession() as s, s.get(
            rx.base_url + "/api/v1/export",
            params={"match[]": "rw2_out_of_retention", "start": "0"}) as r:
        assert (await r.read()).strip() == b""  # none stored


@pytest.mark.parametrize("kind", ["prometheus", "vm"])
async def test_without_the_start_check_the_first_answer_is_not_believed(
    peers: Peers, kind: str,
) -> None:
    # no probe: the first RW 2.0 request meets the receiver's 204-and-nothing-stored
    rx = await receiver(peers, kind)
    u = Upstream(UpstreamSettings(url=rx.base_url + "/api/v1/write"), ProxyMetrics())
    series = batch("rw2_unprobed", n_series=2, n_samples=3)
    try:
        first = await u.send(build_v2(series), Protocol.V2, counts=Counts(2, 6, 0, 0))
        second = await u.send(build_v2(batch("rw2_unprobed_again", 1, 2)), Protocol.V2,
                              counts=Counts(1, 2, 0, 0))
    finally:
        await u.close()
    assert first.ok and first.converted and u.v1_only
    assert first.headers[WRITTEN_SAMPLES] == "6"
    assert second.ok and second.converted

    async def stored() -> bool:
        return (await stored_samples(rx, kind, "rw2_unprobed") == 6
                and await stored_samples(rx, kind, "rw2_unprobed_again") == 2)

    await wait_until(stored, timeout=15, what="8 samples stored")


@pytest.mark.parametrize(("kind", "code"), [
    ("prometheus", "404"),
    # VictoriaMetrics and vmagent answer a path they do not serve with a 400 ("unsupported
    # path requested"): passed on, every sender would drop every batch
    ("victoria-metrics", "400"),
    ("vmagent", "400"),
])
async def test_wrong_path_is_503_and_found_at_start(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], kind: str, code: str,
) -> None:
    if kind == "vmagent":
        sink = await peers.victoria_metrics()
        rx = await peers.vmagent({"scrape_configs": []}, sink.base_url + "/api/v1/write")
    else:
        rx = await receiver(peers, kind)
    url = rx.base_url + "/api/v1/push"  # Mimir's path, which these do not serve
    proxy = await make_proxy(url)
    upstream = proxy.proxy.upstream
    assert (await upstream.check()).outcome == "not_write_endpoint"
    for protocol in (Protocol.V1, Protocol.V2):
        status, headers, text = await send_series(proxy.write_url, batch("wrong_path"),
                                                  protocol=protocol)
        assert status == 503 and headers.get("Retry-After"), text
        assert "not a remote-write endpoint" in text and url in text
    metrics = proxy.proxy.metrics.registry
    assert (metrics.get_sample_value("karta_proxy_upstream_misconfigured_total",
                                     {"url": url, "reason": "not_write_endpoint",
                                      "code": code}) or 0) >= 2


async def _nhcb_request(peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]]
                        ) -> tuple[Peer, InProcessProxy, int, Any]:
    """A Prometheus 2.42 receiver, a proxy converting for it, a time a minute ago, and an
    RW 2.0 request of one custom-bucket histogram at that time: (-Inf,0.1] = 2,
    (0.1,1] = 3, (1,+Inf] = 1."""
    rx = await receiver(peers, "prometheus")
    proxy = await make_proxy(rx.base_url + "/api/v1/write")
    assert (await proxy.proxy.upstream.check()).outcome == "rw1"
    now = int(time.time() * 1000) - 60_000
    req = v2.Request()
    req.symbols.extend(["", "__name__", "nhcb_seconds", "namespace", NAMESPACE, "pod", POD])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4, 5, 6])
    h = ts.histograms.add(count_float=6, sum=4.0, schema=-53, timestamp=now)
    h.positive_spans.add(offset=0, length=3)
    h.positive_counts.extend([2.0, 3.0, 1.0])
    h.custom_values.extend([0.1, 1.0])
    return rx, proxy, now, req


async def test_custom_bucket_histograms_are_stored_as_classic_series_in_prometheus_2(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # a native histogram with custom buckets (schema -53, what Prometheus 3 sends with
    # convert_classic_histograms_to_nhcb): (-Inf,0.1] = 2, (0.1,1] = 3, (1,+Inf] = 1. Passed
    # on as a 1.0 Histogram, Prometheus 2.42 (no custom_values) stored exponential buckets
    # and histogram_quantile(0.5) was +Inf; converted, it is the classic series
    rx, proxy, now, req = await _nhcb_request(peers, make_proxy)
    ts = req.timeseries.add()  # the integer form, a bucket left out (a gap in the spans)
    ts.labels_refs.extend([1, 2, 3, 4, 5, 6])
    h = ts.histograms.add(count_int=9, sum=7.0, schema=-53, timestamp=now + 1000)
    h.positive_spans.add(offset=1, length=1)
    h.positive_spans.add(offset=0, length=1)
    h.positive_deltas.extend([5, -1])  # (0.1,1] = 5, (1,+Inf] = 4
    h.custom_values.extend([0.1, 1.0])
    status, headers, text = await send(proxy.write_url, req.SerializeToString(),
                                       protocol=Protocol.V2)
    assert status == 204, text
    assert headers[WRITTEN_SAMPLES] == "10"  # 3 buckets, _sum, _count, twice
    assert headers["X-Prometheus-Remote-Write-Histograms-Written"] == "0"
    at = now / 1000 + 0.5

    async def stored() -> bool:
        return len(await query(rx.base_url, "nhcb_seconds_bucket", at)) == 3

    await wait_until(stored, timeout=15, what="the buckets stored")
    rows = await query(rx.base_url, "histogram_quantile(0.5, nhcb_seconds_bucket)", at)
    assert len(rows) == 1
    assert 0.1 < float(rows[0]["value"][1]) <= 1.0, rows
    buckets = {r["metric"]["le"]: float(r["value"][1])
               for r in await query(rx.base_url, "nhcb_seconds_bucket", at)}
    assert buckets == {"0.1": 2.0, "1": 5.0, "+Inf": 6.0}
    count = await query(rx.base_url, "nhcb_seconds_count", at)
    total = await query(rx.base_url, "nhcb_seconds_sum", at)
    assert float(count[0]["value"][1]) == 6.0 and float(total[0]["value"][1]) == 4.0
    assert count[0]["metric"].get("karta_workload")  # stamped
    later = {r["metric"]["le"]: float(r["value"][1])
             for r in await query(rx.base_url, "nhcb_seconds_bucket", at + 1)}
    assert later == {"0.1": 0.0, "1": 5.0, "+Inf": 9.0}
    rows = await query(rx.base_url, "histogram_quantile(0.5, nhcb_seconds_bucket)", at + 1)
    assert 0.1 < float(rows[0]["value"][1]) <= 1.0, rows
    # nothing stored as a native histogram
    assert await query(rx.base_url, "nhcb_seconds", at) == []


async def test_a_histogram_staleness_marker_is_taken_by_prometheus_2_and_ends_the_series(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # Prometheus marks a histogram series stale with Histogram{Sum: StaleNaN} (schema 0, no
    # buckets, whatever the series' schema). Passed on as a 1.0 Histogram, Prometheus 2.42
    # (native histograms off) answered 500, the proxy 502, and the sender retried the batch
    # forever; converted, it ends what the series became
    rx, proxy, now, req = await _nhcb_request(peers, make_proxy)
    # custom-bucket data, then its marker, in one request
    req.timeseries[0].histograms.add(sum=STALE_NAN, timestamp=now + 1000)
    req.symbols.append("gone_seconds")
    ts = req.timeseries.add()  # a marker alone: the series it names goes stale
    ts.labels_refs.extend([1, 7, 3, 4, 5, 6])
    ts.histograms.add(sum=STALE_NAN, timestamp=now + 1000)
    status, headers, text = await send(proxy.write_url, req.SerializeToString(),
                                       protocol=Protocol.V2)
    assert status == 204, text
    assert headers[WRITTEN_SAMPLES] == "11"  # 3 buckets, _sum, _count, twice; the float
    at = now / 1000 + 0.5

    async def stored() -> bool:
        return len(await query(rx.base_url, "nhcb_seconds_bucket", at)) == 3

    await wait_until(stored, timeout=15, what="the buckets stored")
    for name in ("nhcb_seconds_bucket", "nhcb_seconds_sum", "nhcb_seconds_count"):
        assert await query(rx.base_url, name, at + 1) == [], name  # ended by the marker
    assert await query(rx.base_url, "gone_seconds", at + 1) == []
    assert await query(rx.base_url, "nhcb_seconds", at) == []  # no histogram stored


def _floats_and_histograms(metric: str, at: int, n: int = 50, floats: bool = True) -> bytes:
    """An RW 2.0 request of ``n`` float series ``<metric>_f`` (unless not ``floats``) and
    ``n`` exponential native-histogram series ``<metric>_h`` (count 3: the zero bucket and
    two of schema 0), at ``at``, all of one pod."""
    req = v2.Request()
    req.symbols.extend(["", "__name__", f"{metric}_f", f"{metric}_h", "idx", "namespace",
                        NAMESPACE, "pod", POD])
    for i in range(n):
        req.symbols.append(str(i))
        for name in ((2, 3) if floats else (3,)):
            ts = req.timeseries.add()
            ts.labels_refs.extend([1, name, 4, len(req.symbols) - 1, 5, 6, 7, 8])
            if name == 2:
                ts.samples.add(value=float(i), timestamp=at)
                continue
            h = ts.histograms.add(count_int=3, sum=1.5, schema=0, zero_threshold=1e-128,
                                  zero_count_int=1, timestamp=at)
            h.positive_spans.add(offset=0, length=2)
            h.positive_deltas.extend([1, 0])
    return req.SerializeToString()


async def _sent(proxy: InProcessProxy, metric: str, at: int, *, floats: bool = True
                ) -> tuple[tuple[str, ...], float]:
    """``_floats_and_histograms`` sent through ``proxy`` (RW 2.0), answered 204: its
    Samples-, Histograms- and Exemplars-Written, and how many upstream requests it took."""
    before = _upstream_posts(proxy)
    status, headers, text = await send(
        proxy.write_url, _floats_and_histograms(metric, at, floats=floats), protocol=Protocol.V2)
    assert status == 204, text
    written = tuple(headers[h] for h in (WRITTEN_SAMPLES, WRITTEN_HISTOGRAMS, WRITTEN_EXEMPLARS))
    return written, _upstream_posts(proxy) - before


def _upstream_posts(proxy: InProcessProxy) -> float:
    registry = proxy.proxy.metrics.registry
    return sum(registry.get_sample_value("karta_proxy_upstream_responses_total",
                                         {"code": code}) or 0 for code in ("204", "500"))


async def _histograms_stored(rx: Peer, metric: str, at: int) -> float:
    rows = await query(rx.base_url, f"count(histogram_count({metric}_h))", at / 1000)
    return float(rows[0]["value"][1]) if rows else 0.0


async def test_native_histograms_prometheus_2_refuses_leave_its_floats_stored(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # Prometheus 2.42 on its defaults answers a write holding one native histogram with 500
    # "native histograms are disabled" and stores nothing of it: the proxy answered 502,
    # none of the float series was stored, and the sender retried the batch forever. Now
    # the request goes again without them: the floats stored, Histograms-Written 0
    rx = await receiver(peers, "prometheus")
    proxy = await make_proxy(rx.base_url + "/api/v1/write")
    upstream = proxy.proxy.upstream
    assert (await upstream.check()).outcome == "rw1"
    at = int(time.time() * 1000) - 60_000
    # refused, then sent again without the histograms: two upstream requests
    assert await _sent(proxy, "nh_off", at) == (("50", "0", "0"), 2)

    async def stored() -> bool:
        return await stored_samples(rx, "prometheus", "nh_off_f") == 50

    await wait_until(stored, timeout=15, what="the 50 float samples stored")
    assert await _histograms_stored(rx, "nh_off", at) == 0
    # remembered: the next request goes without them at once, one upstream request
    assert await _sent(proxy, "nh_off", at + 1000) == (("50", "0", "0"), 1)

    async def stored_again() -> bool:
        return await stored_samples(rx, "prometheus", "nh_off_f") == 100

    await wait_until(stored_again, timeout=15, what="100 float samples stored")
    # a request of native histograms only: nothing stored, and the sender is told so
    assert await _sent(proxy, "nh_off", at + 2000, floats=False) == (("0", "0", "0"), 1)
    registry = proxy.proxy.metrics.registry
    assert registry.get_sample_value(
        "karta_proxy_upstream_histograms_not_stored_total") == 150
    # an RW 1.0 sender's histograms: its answer is the upstream's, as without the proxy
    # (it cannot be told of a partial write)
    req = cast(Any, remote_pb2).WriteRequest()
    ts = req.timeseries.add()
    for name, value in (("__name__", "nh_off_v1"), ("namespace", NAMESPACE), ("pod", POD)):
        ts.labels.add(name=name, value=value)
    ts.samples.add(value=1.0, timestamp=at)
    ts.histograms.add(count_int=1, sum=1.0, schema=0, zero_threshold=1e-128,
                      zero_count_int=1, timestamp=at)
    status, _, text = await send(proxy.write_url, req.SerializeToString(),
                                 protocol=Protocol.V1)
    assert status == 502 and "native histograms are disabled" in text, text
    assert await stored_samples(rx, "prometheus", "nh_off_v1") == 0


async def test_native_histograms_prometheus_2_takes_are_stored_and_said_written(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    # with --enable-feature=native-histograms, Prometheus 2.42 stores them: they go with the
    # request, and with upstream.rw1_confirms_histograms its 2xx says they were written
    rx = await peers.prometheus_receiver(extra=["--enable-feature=native-histograms"])
    proxy = await make_proxy(rx.base_url + "/api/v1/write", rw1_confirms_histograms=True)
    assert (await proxy.proxy.upstream.check()).outcome == "rw1"
    at = int(time.time() * 1000) - 60_000
    assert await _sent(proxy, "nh_on", at) == (("50", "50", "0"), 1)

    async def stored() -> bool:
        return (await stored_samples(rx, "prometheus", "nh_on_f") == 50
                and await _histograms_stored(rx, "nh_on", at) == 50)

    await wait_until(stored, timeout=15, what="50 floats and 50 histograms stored")
    assert not proxy.proxy.metrics.registry.get_sample_value(
        "karta_proxy_upstream_histograms_not_stored_total")
