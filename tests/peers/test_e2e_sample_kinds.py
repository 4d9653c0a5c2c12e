"""Every kind of data a real sender writes, through karta-proxy and beside it.

The other end-to-end tests send float samples; the RW 2.0 conversion tests build
histograms and exemplars by hand. Here a Prometheus 2.42 agent with native histograms,
exemplars and metadata on scrapes a target of each kind and writes to four places at once:
a Prometheus 2.42 receiver (native histograms and exemplar storage on) through the proxy
and another directly, and a recording upstream through a second proxy and another
directly. The receivers tell what a TSDB makes of it (floats, native histograms,
exemplars, where each series went stale); the recordings tell what was on the wire (every
sample's bits, every histogram's fields, exemplars, and the metadata, which a 2.42
receiver takes and does not store). The two paths must agree but for the karta_* labels,
which must be the index's stamp wherever the series names a pod it knows.

vmagent (Debian's 1.79) is checked for what it can send: floats and staleness markers.
It has no exemplars, native histograms or metadata to send: its scraper asks for the text
format only (no protobuf, so no native histogram; no OpenMetrics, so no exemplar), and it
has no flag for any of the three.
"""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client.exposition import choose_encoder

from proxy.aux_server import AuxServer
from proxy.handler import PART_DECODED_BYTES
from proxy.pb.prometheus import remote_pb2
from proxy.runtime import Proxy
from proxy.wire.primitives import STALE_NAN_BITS, encode_uvarint, len_field
from tests.peers.conftest import (
    InProcessProxy,
    Peer,
    Peers,
    agent_metrics,
    query,
    remote_write,
    series_set,
    wait_until,
)
from tests.scripted import Received, ScriptedUpstream

pytestmark = pytest.mark.peers
WriteRequest: Any = cast(Any, remote_pb2).WriteRequest

#: the pods the targets are labelled with: two the demo snapshot attributes, one it lacks
OM_POD = ("web", "frontend-6d8f7b9c5d-4xkqp")
NH_POD = ("ml", "llm-finetune-raycluster-k7x2p-head-8jz5c")
UNKNOWN_POD = ("web", "not-in-the-snapshot-0")
#: what Prometheus asks for first with native-histograms on
PROTOBUF = ("application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; "
            "encoding=delimited")
#: the series the targets expose
APP_SERIES = '{__name__=~"app_.+"}'
EVERY = '{__name__=~".+"}'
KARTA = "karta_"

LabelSet = frozenset[tuple[str, str]]


def strip_karta(s: LabelSet) -> LabelSet:
    return frozenset((k, v) for k, v in s if not k.startswith(KARTA))


# -- the scraped target -------------------------------------------------------------------


def _varint(number: int, value: int) -> bytes:
    return encode_uvarint(number << 3) + encode_uvarint(value)


def _sint(number: int, value: int) -> bytes:
    return _varint(number, (value << 1) ^ (value >> 63))


def _double(number: int, value: float) -> bytes:
    return encode_uvarint(number << 3 | 1) + struct.pack("<d", value)


def _text(number: int, text: str) -> bytes:
    return len_field(number, text.encode())


def _family(name: str, help_text: str, kind: int, metric: bytes) -> bytes:
    """One length-prefixed ``io.prometheus.client.MetricFamily`` (client_model's field
    numbers; ``kind``: 1 gauge, 4 histogram)."""
    body = _text(1, name) + _text(2, help_text) + _varint(3, kind) + len_field(4, metric)
    return encode_uvarint(len(body)) + body


def _label(name: str, value: str) -> bytes:
    return len_field(1, _text(1, name) + _text(2, value))


def native_histogram_page(n: int, width: int) -> bytes:
    """The protobuf exposition of scrape ``n``: ``width`` series of ``app_latency_seconds``
    (``path``, a cAdvisor-long ``id``), each a native histogram of schema 1 with a zero
    bucket, a negative bucket and positive buckets in two spans (a gap between them), all
    growing with ``n``; and a gauge. No Python client writes native histograms, and
    Prometheus 2.42's own are classic ones."""
    metrics = []
    for i in range(width):
        k = n + i
        histogram = b"".join((
            _varint(1, 8 * k),               # sample_count: zero k, negative k, positive 6k
            _double(2, 1.25 * k),            # sample_sum
            _sint(5, 1),                     # schema
            _double(6, 1e-9),                # zero_threshold
            _varint(7, k),                   # zero_count
            len_field(9, _sint(1, -1) + _varint(2, 1)),    # negative span
            _sint(10, k),                    # negative deltas
            len_field(12, _sint(1, 0) + _varint(2, 2)),    # positive spans: [0, 1], [4]
            len_field(12, _sint(1, 2) + _varint(2, 1)),
            _sint(13, k), _sint(13, k), _sint(13, k),      # positive counts k, 2k, 3k
        ))
        metrics.append(len_field(4, _label("id", long_id(i)) + _label("path", f"/api/{i}")
                                 + len_field(7, histogram)))
    family = _text(1, "app_latency_seconds") + _text(2, "Latency of the API.") + _varint(3, 4)
    family += b"".join(metrics)
    gauge = len_field(2, _double(1, float(n)))
    return (encode_uvarint(len(family)) + family
            + _family("app_nh_gauge", "A gauge beside the histograms.", 1, gauge))


def long_id(i: int) -> str:
    """A label value as long as cAdvisor's ``id``: requests of a few thousand series are
    over a megabyte, which the proxy splices in parts (``PART_DECODED_BYTES``)."""
    return f"/kubepods/burstable/pod{i:08d}/" + "c" * 400


class KindsTarget(AuxServer):
    """The scraped application. ``/om``: a prometheus_client counter whose every increment
    carries an exemplar (a trace id), and a gauge, in OpenMetrics when the scraper asks for
    it (Prometheus does; only OpenMetrics carries exemplars), else the text format (vmagent).
    ``/nh``: the protobuf exposition of a native histogram (``native_histogram_page``).
    ``down``: every scrape answered 503, the target gone, so the sender marks what it
    scraped from it stale."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.registry = CollectorRegistry()
        self.requests = Counter("app_requests", "Requests served.", ["id", "route"],
                                registry=self.registry)
        self.queue = Gauge("app_queue_depth", "Requests waiting.", registry=self.registry)
        # one of each other type OpenMetrics has: OM_OTHERS series in all, with the gauge
        self.payload = Histogram("app_payload_bytes", "Request sizes.",
                                 buckets=(100, 1e3, 1e4), registry=self.registry)
        self.handling = Summary("app_handle_seconds", "Handling time.",
                                registry=self.registry)
        Info("app_build", "The build.", registry=self.registry).info({"version": "1.2.3"})
        self.state = Enum("app_state", "Serving or not.",
                          states=["starting", "serving", "draining"], registry=self.registry)
        self.scrapes: Tally[str] = Tally()
        self.down = False
        self.address = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/om", self._om)
        app.router.add_get("/nh", self._nh)
        port = await self.serve(app, "127.0.0.1", 0, shutdown_timeout=0.5)
        self.address = f"127.0.0.1:{port}"
        return "http://" + self.address

    async def _om(self, request: web.Request) -> web.Response:
        if self.down:
            return web.Response(status=503)
        self.scrapes["om"] += 1
        n = self.scrapes["om"]
        for i in range(self.width):
            self.requests.labels(long_id(i), f"r{i}").inc(
                (n + i) % 3 + 1, exemplar={"trace_id": f"{n:08x}{i:08x}"})
        self.queue.set(n % 7)
        # a classic histogram's exemplar: on the bucket it falls in, le="1000"
        self.payload.observe(500 + n, exemplar={"trace_id": f"{n:08x}"})
        self.handling.observe(0.01 * n)
        self.state.state("serving")
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})

    async def _nh(self, request: web.Request) -> web.Response:
        if self.down:
            return web.Response(status=503)
        assert request.headers.get("Accept", "").startswith(PROTOBUF.replace(" ", "")), \
            "the scraper asks for protobuf first"
        self.scrapes["nh"] += 1
        return web.Response(body=native_histogram_page(self.scrapes["nh"], self.width),
                            headers={"Content-Type": PROTOBUF})

    def job(self, name: str, path: str, pod: tuple[str, str], **labels: str
            ) -> dict[str, Any]:
        """A scrape job of ``path``, its target labelled with ``pod`` (as Kubernetes service
        discovery labels a pod's target) and ``labels``."""
        return {"job_name": name, "metrics_path": path, "scrape_interval": "1s",
                "scrape_timeout": "1s", "static_configs": [{
                    "targets": [self.address],
                    "labels": {"namespace": pod[0], "pod": pod[1], **labels}}]}


def every_kind(url: str) -> dict[str, Any]:
    """A remote_write of everything Prometheus 2.42 can send: exemplars, native
    histograms, and metadata every second (its default is a minute); requests of up to
    2,000 samples, histograms and exemplars (the default from 2.44 on; 500 before)."""
    queue = {**remote_write(url)["queue_config"], "max_samples_per_send": 2000}
    return {**remote_write(url), "queue_config": queue, "send_exemplars": True,
            "send_native_histograms": True,
            "metadata_config": {"send": True, "send_interval": "1s"}}


# -- what a recording upstream got --------------------------------------------------------


class FloatSample(NamedTuple):
    timestamp: int
    #: the value's bits: a staleness marker is a NaN like any other to ``==``
    bits: int


class HistogramSample(NamedTuple):
    timestamp: int
    #: the Histogram message, every field of it
    fields: bytes


class ExemplarSample(NamedTuple):
    timestamp: int
    labels: LabelSet
    value: float


class Metadata(NamedTuple):
    type: int
    family: str
    help: str
    unit: str


@dataclass
class Recorded:
    """What the requests a recording upstream got carry, per series (label set): float
    samples, histograms, exemplars; and the metadata."""

    floats: dict[LabelSet, list[FloatSample]] = field(default_factory=dict)
    histograms: dict[LabelSet, list[HistogramSample]] = field(default_factory=dict)
    exemplars: dict[LabelSet, list[ExemplarSample]] = field(default_factory=dict)
    metadata: set[Metadata] = field(default_factory=set)
    #: every float sample, histogram and exemplar, whatever its time
    counts: Tally[str] = field(default_factory=Tally)

    def stripped(self) -> Recorded:
        """The same with the karta_* labels taken off every series, each series' samples
        in time order (two requests may arrive out of order)."""
        return Recorded(strip_keys(self.floats, sort=True),
                        strip_keys(self.histograms, sort=True),
                        strip_keys(self.exemplars, sort=True), self.metadata, self.counts)


def strip_keys(d: dict[LabelSet, Any], *, sort: bool = False) -> dict[LabelSet, Any]:
    return {strip_karta(k): sorted(v) if sort else v for k, v in d.items()}


def recorded(received: Iterable[Received], until: float = math.inf) -> Recorded:
    """What ``received`` carry; samples, histograms and exemplars stamped after ``until``
    left out (not from ``counts``)."""
    out = Recorded()
    limit = until * 1000
    for rec in received:
        req = WriteRequest.FromString(rec.raw)
        out.metadata.update(Metadata(m.type, m.metric_family_name, m.help, m.unit)
                            for m in req.metadata)
        for ts in req.timeseries:
            key = frozenset((lb.name, lb.value) for lb in ts.labels)
            out.counts.update(samples=len(ts.samples), histograms=len(ts.histograms),
                              exemplars=len(ts.exemplars))
            out.floats.setdefault(key, []).extend(
                FloatSample(x.timestamp, struct.unpack("<Q", struct.pack("<d", x.value))[0])
                for x in ts.samples if x.timestamp <= limit)
            out.histograms.setdefault(key, []).extend(
                HistogramSample(h.timestamp, h.SerializeToString(deterministic=True))
                for h in ts.histograms if h.timestamp <= limit)
            out.exemplars.setdefault(key, []).extend(
                ExemplarSample(e.timestamp, frozenset((lb.name, lb.value) for lb in e.labels),
                               e.value)
                for e in ts.exemplars if e.timestamp <= limit)
    for d in (out.floats, out.histograms, out.exemplars):
        for k in [k for k, v in d.items() if not v]:
            del d[k]
    return out


# -- what a receiver stored ---------------------------------------------------------------


async def stored(base: str, at: float, until: float
                 ) -> tuple[dict[LabelSet, list[Any]], dict[LabelSet, list[Any]]]:
    """Every float sample and every native histogram stored in the last 10 minutes, per
    series, stamped at or before ``until`` (a range-vector query: staleness markers are
    not returned, the samples before them are)."""
    floats: dict[LabelSet, list[Any]] = {}
    histograms: dict[LabelSet, list[Any]] = {}
    for r in await query(base, f"{EVERY}[10m]", at):
        key = frozenset(r["metric"].items())
        for d, points in ((floats, r.get("values", [])), (histograms, r.get("histograms", []))):
            kept = [p for p in points if float(p[0]) <= until]
            if kept:
                d[key] = kept
    return floats, histograms


async def exemplars_stored(base: str, start: float, end: float
                           ) -> dict[LabelSet, list[Any]]:
    """The exemplars a receiver holds between ``start`` and ``end``, per series."""
    async with aiohttp.ClientSession() as s, s.get(
            base + "/api/v1/query_exemplars",
            params={"query": '{job=~".+"}', "start": f"{start:.3f}", "end": f"{end:.3f}"},
            timeout=aiohttp.ClientTimeout(total=10)) as r:
        body = await r.json()
    assert body["status"] == "success", body
    return {frozenset(d["seriesLabels"].items()):
            sorted((e["timestamp"], e["value"], sorted(e["labels"].items()))
                   for e in d["exemplars"]) for d in body["data"]}


def stamp_of(proxy: Proxy, pod: tuple[str, str]) -> dict[str, str]:
    return dict(proxy.index.lookup(pod[0].encode(), pod[1].encode()) or ())


def check_stamps(series: Iterable[LabelSet], proxy: Proxy) -> Tally[str]:
    """Every series that names a pod carries exactly the index's stamp of it (none for a
    pod the index lacks); returns how many series were stamped and how many not."""
    seen: Tally[str] = Tally()
    for s in series:
        d = dict(s)
        karta = {k: v for k, v in d.items() if k.startswith(KARTA)}
        want = stamp_of(proxy, (d.get("namespace", ""), d.get("pod", "")))
        assert karta == want, (d, want)
        seen["stamped" if want else "plain"] += 1
    return seen


async def metadata_api(base: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(base + "/api/v1/metadata") as r:
        return (await r.json())["data"]


def proxy_counts(proxy: Proxy) -> dict[str, float]:
    m = proxy.metrics.registry
    return {k: m.get_sample_value(f"karta_proxy_{k}_total") or 0.0
            for k in ("samples", "histograms", "exemplars")}


def family_samples(proxy: Proxy, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of the proxy's metric family ``name`` (its ``_total``), by labels."""
    out = {}
    for family in proxy.metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def check_nothing_refused(proxy: Proxy) -> None:
    """Every request answered 204 and forwarded, none refused or failed to decode, no
    histogram left out."""
    requests = family_samples(proxy, "karta_proxy_requests_total")
    assert requests and all(dict(k)["code"] == "204" and dict(k)["protocol"] == "v1"
                            for k in requests), requests
    assert not any(family_samples(proxy, "karta_proxy_requests_rejected_total").values())
    assert not any(family_samples(proxy, "karta_proxy_decode_errors_total").values())
    upstream = family_samples(proxy, "karta_proxy_upstream_responses_total")
    assert {dict(k)["code"] for k, v in upstream.items() if v} == {"204"}, upstream
    # each request forwarded once, besides the proxy's own check of the upstream at start
    assert sum(upstream.values()) >= sum(requests.values())
    assert not proxy.metrics.registry.get_sample_value(
        "karta_proxy_upstream_histograms_not_stored_total")


async def sent_equals_received(agent: Peer, url: str, proxy: Proxy) -> None:
    """The agent's counts of what it sent to ``url`` (samples, histograms, exemplars) and
    the proxy's of what it received meet: between two of the agent's sends they are equal,
    unless the proxy counts one kind as another or some not at all."""
    last: list[Any] = []

    async def equal() -> bool:
        sent = await agent_metrics(agent, url=url)
        want = {k: sent.get(k + "_total", -1.0) for k in ("samples", "histograms",
                                                           "exemplars")}
        got = proxy_counts(proxy)
        last[:] = [want, got]
        return want == got

    try:
        await wait_until(equal, timeout=10, interval=0.05,
                         what=f"the proxy's counts to meet the agent's for {url}")
    except AssertionError as e:
        raise AssertionError(f"{e}: agent sent, proxy counted: {last}") from None
    # and the agent had nothing refused: no sample, histogram, exemplar or metadata
    # failed, retried or dropped on the way through the proxy
    sent = await agent_metrics(agent, url=url)
    assert sent["metadata_total"] > 0
    troubles = {k: v for k, v in sent.items()
                if k.endswith(("_failed_total", "_retried_total", "_dropped_total"))}
    assert len(troubles) >= 9 and not any(troubles.values()), troubles


# -- the tests ----------------------------------------------------------------------------

#: series per family of the targets: a request of one scrape is ~1 MB
WIDTH = 400
#: series of /om besides the counter's, as Prometheus 2.42 stores them (it keeps no
#: ``_created`` series): the gauge, the classic histogram's 4 buckets, _count and _sum,
#: the summary's _count and _sum, the info, the enum's 3 states
OM_OTHERS = 1 + 6 + 2 + 1 + 3
#: up and the 4 scrape_* series: a job's series besides its target's
SCRAPE_SERIES = 5
#: a label of the sender's own under the proxy's prefix, on two of the three jobs: the
#: proxy drops it (enrich.sender_karta_labels: drop), so those series are rebuilt, not
#: stamped in place: the histograms on a stamped series, the exemplars on an unstamped one
SENDERS_KARTA = {"karta_team": "payments"}


async def test_prometheus_agent_every_kind_through_the_proxy(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    features = "--enable-feature=native-histograms,exemplar-storage"
    enriched = await peers.prometheus_receiver("prom-enriched", extra=[features])
    direct = await peers.prometheus_receiver("prom-direct", extra=[features])
    start = time.time() - 5
    async with KindsTarget(WIDTH) as target, ScriptedUpstream() as behind, \
            ScriptedUpstream() as beside:
        to_rx = await make_proxy(enriched.base_url + "/api/v1/write")
        to_rec = await make_proxy(behind.url)
        for pod in (OM_POD, NH_POD):
            assert stamp_of(to_rx.proxy, pod).get("karta_workload"), pod
        assert not stamp_of(to_rx.proxy, UNKNOWN_POD)
        urls = (to_rx.write_url, direct.base_url + "/api/v1/write", to_rec.write_url,
                beside.url)
        agent = await peers.prometheus_agent({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                target.job("om", "/om", OM_POD),
                target.job("om-unknown", "/om", UNKNOWN_POD, **SENDERS_KARTA),
                target.job("nh", "/nh", NH_POD, **SENDERS_KARTA)],
            "remote_write": [every_kind(u) for u in urls],
        }, features=("native-histograms", "exemplar-storage"))

        async def landed() -> bool:
            hist = await query(enriched.base_url, "histogram_count(app_latency_seconds)")
            ex = await exemplars_stored(enriched.base_url, start, time.time() + 1)
            return (len(hist) == WIDTH and len(ex) == 2 * (WIDTH + 1)
                    and bool(recorded(behind.received).metadata))

        await wait_until(landed, timeout=30,
                         what="native histograms, exemplars and metadata through the proxy")
        seen = target.scrapes["nh"]

        async def more_scrapes() -> bool:
            return target.scrapes["nh"] >= seen + 3

        await wait_until(more_scrapes, timeout=10, what="3 more scrapes")
        live = {b: await query(b, APP_SERIES) for b in (enriched.base_url, direct.base_url)}
        names = Tally(r["metric"]["__name__"] for r in live[direct.base_url])
        # (Prometheus 2.42 keeps no series of OpenMetrics' app_requests_created)
        assert names == {
            "app_requests_total": 2 * WIDTH, "app_queue_depth": 2,
            "app_payload_bytes_bucket": 2 * 4, "app_payload_bytes_count": 2,
            "app_payload_bytes_sum": 2, "app_handle_seconds_count": 2,
            "app_handle_seconds_sum": 2, "app_build_info": 2, "app_state": 2 * 3,
            "app_latency_seconds": WIDTH, "app_nh_gauge": 1}
        n_app = names.total()
        assert len(live[enriched.base_url]) == n_app

        # -- staleness: the target goes away, and every series of it ends in both -------
        target.down = True

        async def stale() -> bool:
            return all([await query(b, APP_SERIES) == [] for b in live])

        await wait_until(stale, timeout=15, what="the target's series stale in both")
        stale_seen = time.time()

        def markers(rec: Recorded) -> set[LabelSet]:
            return {k for k, v in rec.floats.items()
                    if dict(k)["__name__"].startswith("app_") and v[-1].bits == STALE_NAN_BITS}

        async def markers_recorded() -> bool:
            return all(len(markers(recorded(r.received).stripped())) == n_app
                       for r in (behind, beside))

        await wait_until(markers_recorded, timeout=10, what="stale markers recorded")
        # -- the proxy's counts are the agent's ----------------------------------------
        for url, proxy in ((to_rx.write_url, to_rx.proxy), (to_rec.write_url, to_rec.proxy)):
            await sent_equals_received(agent, url, proxy)
        await settle(stale_seen)
        assert await agent.astop() == 0
    end = time.time() + 5
    # what was scraped before the staleness was seen reached every path: the comparisons
    # stop there (the agent's queues each send their last batch on their own at its stop)
    cutoff = stale_seen

    # -- on the wire: what the proxy forwarded is what the agent sent beside it -------------
    got = recorded(behind.received, cutoff).stripped()
    want = recorded(beside.received, cutoff).stripped()
    assert got.floats == want.floats
    assert got.histograms == want.histograms
    assert got.exemplars == want.exemplars
    assert got.metadata == want.metadata
    # ... and none of it is vacuous
    assert {m.family for m in want.metadata} >= {
        "app_requests", "app_queue_depth", "app_payload_bytes", "app_handle_seconds",
        "app_build", "app_state", "app_latency_seconds", "app_nh_gauge"}
    assert len(want.histograms) == WIDTH
    assert all(len(v) >= 4 for v in want.histograms.values())
    assert Tally(dict(k)["job"] for k in want.exemplars) == {"om": WIDTH + 1,
                                                              "om-unknown": WIDTH + 1}
    assert len(markers(want)) == n_app  # a histogram series' marker is a float stale NaN
    assert any(dict(k).get("karta_team") for k in recorded(beside.received).floats)
    # the biggest request was spliced in parts where there are two cores or more
    assert max(len(r.raw) for r in behind.received) > 2 * PART_DECODED_BYTES
    # every series the proxy forwarded carries the index's stamp of its pod, and no
    # karta_* label of the sender's
    forwarded = recorded(behind.received)
    per_om_job = WIDTH + OM_OTHERS + SCRAPE_SERIES
    assert check_stamps(forwarded.floats, to_rec.proxy) == {
        "stamped": per_om_job + WIDTH + 1 + SCRAPE_SERIES, "plain": per_om_job}
    check_counted(behind.received, to_rec.proxy)
    for p in (to_rx, to_rec):
        check_nothing_refused(p.proxy)

    # -- in the TSDB: the same series, floats, native histograms and exemplars -----------
    got_series = await series_set(enriched.base_url, EVERY, start, end)
    assert {strip_karta(s) for s in got_series} == {
        strip_karta(s) for s in await series_set(direct.base_url, EVERY, start, end)}
    check_stamps(got_series, to_rx.proxy)
    at = time.time()
    got_floats, got_hists = await stored(enriched.base_url, at, cutoff)
    want_floats, want_hists = await stored(direct.base_url, at, cutoff)
    assert strip_keys(got_floats) == strip_keys(want_floats)
    assert strip_keys(got_hists) == strip_keys(want_hists)
    assert len(want_hists) == WIDTH
    assert all(len(v) >= 4 and all(float(h["count"]) % 8 == 0 for _, h in v)
               for v in want_hists.values())
    got_ex = await exemplars_stored(enriched.base_url, start, cutoff)
    want_ex = await exemplars_stored(direct.base_url, start, cutoff)
    assert strip_keys(got_ex) == strip_keys(want_ex)
    assert len(want_ex) == 2 * (WIDTH + 1) and all(len(v) >= 3 for v in want_ex.values())
    check_stamps(got_ex, to_rx.proxy)
    # a 2.42 receiver takes remote-written metadata (204) and keeps none of it: its
    # metadata API shows its own scrapes' only, on either path
    assert await metadata_api(enriched.base_url) == await metadata_api(direct.base_url) == {}


async def settle(cutoff: float) -> None:
    """Wait until every queue of the sender has sent what was scraped up to ``cutoff``: a
    batch waits 500 ms at most (``remote_write``, vmagent's ``-remoteWrite.flushInterval``),
    then a second for the slowest."""
    await asyncio.sleep(max(0.0, cutoff + 1.5 - time.time()))


def check_counted(received: Iterable[Received], proxy: Proxy) -> None:
    """The proxy's counts of the requests it forwarded (a recording upstream got them all,
    each as the proxy sent it): every kind counted as what it is, every series stamped,
    unstamped for its reason, or stripped of the sender's karta_* label, as it went out."""
    got = recorded(received)
    assert proxy_counts(proxy) == {k: float(got.counts[k]) for k in (
        "samples", "histograms", "exemplars")}
    series = [frozenset((lb.name, lb.value) for lb in ts.labels)
              for rec in received for ts in WriteRequest.FromString(rec.raw).timeseries]
    m = proxy.metrics.registry
    assert m.get_sample_value("karta_proxy_series_attributed_total") == sum(
        1 for s in series if dict(s).get("karta_workload"))
    assert m.get_sample_value("karta_proxy_series_unattributed_total",
                              {"reason": "pod_unknown"}) == sum(
        1 for s in series if dict(s).get("pod") == UNKNOWN_POD[1])
    # the jobs labelled with the sender's karta_team: all but "om"
    assert m.get_sample_value("karta_proxy_series_sender_karta_labels_dropped_total") == sum(
        1 for s in series if dict(s)["job"] != "om")


async def test_vmagent_floats_and_staleness_through_the_proxy(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    enriched = await peers.prometheus_receiver("prom-enriched")
    direct = await peers.prometheus_receiver("prom-direct")
    start = time.time() - 5
    async with KindsTarget(WIDTH // 10) as target:
        to_rx = await make_proxy(enriched.base_url + "/api/v1/write")
        await peers.vmagent(
            {"scrape_configs": [target.job("om", "/om", OM_POD),
                                target.job("om-unknown", "/om", UNKNOWN_POD,
                                           **SENDERS_KARTA)]},
            to_rx.write_url, extra=[f"-remoteWrite.url={direct.base_url}/api/v1/write"])
        n_app = 2 * (target.width + OM_OTHERS)

        async def landed() -> bool:
            return all([len(await query(b, APP_SERIES)) == n_app
                        for b in (enriched.base_url, direct.base_url)])

        await wait_until(landed, timeout=30, what="the target's series in both")
        seen = target.scrapes["om"]

        async def more_scrapes() -> bool:
            return target.scrapes["om"] >= seen + 4

        await wait_until(more_scrapes, timeout=10, what="2 more scrapes of each job")
        target.down = True

        async def stale() -> bool:
            return all([await query(b, APP_SERIES) == []
                        for b in (enriched.base_url, direct.base_url)])

        await wait_until(stale, timeout=15, what="the target's series stale in both")
        cutoff = time.time()
        await settle(cutoff)
    end = time.time() + 5
    got_series = await series_set(enriched.base_url, EVERY, start, end)
    assert {strip_karta(s) for s in got_series} == {
        strip_karta(s) for s in await series_set(direct.base_url, EVERY, start, end)}
    assert check_stamps(got_series, to_rx.proxy)["stamped"] >= target.width + 1
    at = time.time()
    got_floats, _ = await stored(enriched.base_url, at, cutoff)
    want_floats, _ = await stored(direct.base_url, at, cutoff)
    assert strip_keys(got_floats) == strip_keys(want_floats)
    assert sum(len(v) for k, v in want_floats.items()
               if dict(k)["__name__"] == "app_requests_total") >= 4 * target.width
    check_nothing_refused(to_rx.proxy)
