"""The proxy's write endpoint against a real receiver's: each request, byte for byte the
same, sent to a Prometheus 2.42 receiver directly and to the proxy (the demo snapshot)
in front of a second one; the status each answers, and the samples each receiver then
holds.

The promise checked: a 2xx means stored, nothing is lost silently, and bad input gets a
clear 4xx (dropped by the sender) or 5xx (retried). Where the proxy answers otherwise
than Prometheus, the row says why; each such difference is one docs/operations.md
states ("Status codes the sender gets"). A row that no longer holds means the proxy or
the receiver changed: find which, and update the documentation with it.
"""

from __future__ import annotations

import asyncio
import gzip
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import pytest_asyncio
import snappy

from proxy.compression import compress
from proxy.demo_exporter import DEMO_SNAPSHOT
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import types_pb2
from proxy.runtime import Proxy
from proxy.wire.primitives import STALE_NAN
from tests.peers.conftest import Peer, Peers, proxy_settings, query
from tests.proxy_harness import CT_V1, CT_V2
from tests.raw_http import read_answer
from tests.wire_fixtures import request_v1

pytestmark = [pytest.mark.peers, pytest.mark.asyncio(loop_scope="module")]

#: every sample's time (a few seconds ago: within what Prometheus' head takes)
NOW = int(time.time() * 1000) - 5000
#: far older than the head takes: Prometheus answers 400 "out of bounds"
TOO_OLD = NOW - 30 * 86_400_000
POD = (("namespace", "web"), ("pod", "frontend-6d8f7b9c5d-4xkqp"))  # in the demo snapshot

Labels = tuple[tuple[str, str], ...]


def series(labels: Labels, samples: tuple[tuple[float, int], ...] = ((1.0, NOW),), *,
           exemplar: bool = False, histogram: bool = False) -> types_pb2.TimeSeries:
    """One RW 1.0 series, its labels in the order given (unsorted, repeated: as sent)."""
    ts = types_pb2.TimeSeries()
    for k, v in labels:
        ts.labels.add(name=k, value=v)
    for value, t in samples:
        ts.samples.add(value=value, timestamp=t)
    if exemplar:
        ts.exemplars.add(value=1.0, timestamp=NOW).labels.add(name="trace_id", value="abc")
    if histogram:
        h = ts.histograms.add(count_int=10, sum=3.5, schema=3, zero_threshold=1e-128,
                              zero_count_int=1, timestamp=NOW)
        h.positive_spans.add(offset=-2, length=2)
        h.positive_deltas.extend([4, -1])
    return ts


def write(*ts: types_pb2.TimeSeries, metadata: bool = False) -> bytes:
    return bytes(request_v1(*ts, metadata=metadata))


def named(name: str, *more: tuple[str, str],
          samples: tuple[tuple[float, int], ...] = ((1.0, NOW),), exemplar: bool = False,
          histogram: bool = False) -> bytes:
    """A request of one series of the metric ``parity_<name>``."""
    return write(series((("__name__", f"parity_{name}"), *more), samples,
                        exemplar=exemplar, histogram=histogram))


def v2_write(name: str) -> bytes:
    req = v2.Request()
    req.symbols.extend(["", "__name__", f"parity_{name}", "job", "parity"])
    ts = req.timeseries.add()
    ts.labels_refs.extend([1, 2, 3, 4])
    ts.samples.add(value=1.0, timestamp=NOW)
    return bytes(req.SerializeToString())


def headers(ct: str | None = CT_V1, ce: str | None = "snappy", version: str | None = "0.1.0"
            ) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in (("Content-Type", ct), ("Content-Encoding", ce),
                                     ("X-Prometheus-Remote-Write-Version", version))
                 if v is not None)


class Seen(NamedTuple):
    """What one side answered and how many samples of the case its receiver then holds
    (None: not read, the series cannot be queried by name)."""

    status: int
    stored: int | None


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    #: Prometheus directly, then through the proxy
    direct: Seen
    proxied: Seen
    #: why they differ, where they do (docs/operations.md, "Status codes the sender gets")
    why: str = ""
    #: the body as it goes on the wire (None: ``body`` snappy-compressed)
    wire: bytes | None = None
    headers: tuple[tuple[str, str], ...] = headers()
    method: str = "POST"
    path: str = "/api/v1/write"
    version: str = "1.1"
    chunked: bool = False
    expect: bool = False
    #: the sender shuts its side after the request (``shutdown(SHUT_WR)``)
    half_close: bool = False
    #: sent first, the same way to both (a sample the case's then comes before)
    setup: bytes | None = None
    #: the series whose samples are counted (default: the metric ``parity_<name>``)
    selector: str = ""
    #: the range they are counted over, before now
    window: str = "[1h]"

    def count_query(self) -> str:
        sel = self.selector or f'{{__name__="parity_{self.name}"}}'
        return f"sum(count_over_time({sel}{self.window}))"


#: both answer 204 and store the one sample
OK = (Seen(204, 1), Seen(204, 1))
OLD_GOOD = series((("__name__", "parity_too_old_and_good"), ("s", "good")))
OLD_BAD = series((("__name__", "parity_too_old_and_good"), ("s", "old")), ((1.0, TOO_OLD),))
OOO = (("__name__", "parity_out_of_order"), ("s", "a"))
DUP = (("__name__", "parity_duplicate_timestamp"), ("s", "a"))
FORMAT_NOTED = "documented: the Content-Type names the protocol; Prometheus 2.42 reads none"
ENCODING_NOTED = "documented: snappy or zstd; Prometheus 2.42 reads no Content-Encoding"
REFUSED_NOTED = "documented: refused 400 (what Prometheus stores broken or 500s forever)"

CASES = [
    Case("valid", named("valid"), *OK),
    Case("ct_proto_v1", named("ct_proto_v1"), *OK,
         headers=headers(ct=CT_V1 + ";proto=prometheus.WriteRequest")),
    Case("ct_missing", named("ct_missing"), *OK, headers=headers(ct=None)),
    Case("ct_upper_case", named("ct_upper_case"), *OK,
         headers=headers(ct="Application/X-Protobuf; charset=utf-8")),
    Case("ct_v2_with_v1_body", named("ct_v2_with_v1_body"), Seen(204, 1), Seen(400, 0),
         FORMAT_NOTED + " (a body of the other protocol)",
         headers=headers(ct=CT_V2, version="2.0.0")),
    Case("ct_v2_with_v2_body", v2_write("ct_v2_with_v2_body"), Seen(204, 0), Seen(204, 1),
         "documented: 2.42 answers 204 to RW 2.0 and stores nothing; the proxy converts",
         headers=headers(ct=CT_V2, version="2.0.0")),
    Case("ct_unknown_proto", named("ct_unknown_proto"), Seen(204, 1), Seen(415, 0),
         FORMAT_NOTED, headers=headers(ct=CT_V1 + ";proto=foo.Bar")),
    Case("ct_text_plain", named("ct_text_plain"), Seen(204, 1), Seen(415, 0),
         FORMAT_NOTED, headers=headers(ct="text/plain")),
    Case("ce_upper_case", named("ce_upper_case"), *OK, headers=headers(ce="SNAPPY")),
    Case("ce_missing", named("ce_missing"), *OK, headers=headers(ce=None)),
    Case("ce_zstd", named("ce_zstd"), Seen(400, 0), Seen(204, 1),
         "documented: the proxy reads zstd", wire=compress(named("ce_zstd"), "zstd"),
         headers=headers(ce="zstd")),
    Case("ce_gzip", named("ce_gzip"), Seen(400, 0), Seen(415, 0), ENCODING_NOTED,
         wire=gzip.compress(named("ce_gzip")), headers=headers(ce="gzip")),
    Case("ce_identity_snappy_body", named("ce_identity_snappy_body"), Seen(204, 1),
         Seen(415, 0), ENCODING_NOTED, headers=headers(ce="identity")),
    Case("version_missing", named("version_missing"), *OK, headers=headers(version=None)),
    Case("version_2_0_0", named("version_2_0_0"), *OK, headers=headers(version="2.0.0")),
    Case("version_garbage", named("version_garbage"), *OK,
         headers=headers(version="garbage")),
    Case("http10", named("http10"), *OK, version="1.0"),
    Case("http10_half_close", named("http10_half_close"), *OK, version="1.0",
         half_close=True),
    Case("http11_half_close", named("http11_half_close"), *OK, half_close=True),
    Case("chunked", named("chunked"), *OK, chunked=True),
    Case("expect_100_continue", named("expect_100_continue"), *OK, expect=True),
    Case("empty_body", b"", Seen(400, 0), Seen(400, 0), wire=b""),
    Case("empty_body_half_close", b"", Seen(400, 0), Seen(400, 0), wire=b"",
         half_close=True),
    Case("empty_write_request", write(), Seen(204, 0), Seen(204, 0)),
    Case("metadata_only", write(metadata=True), Seen(204, 0), Seen(204, 0)),
    Case("nan", named("nan", samples=((math.nan, NOW),)), *OK),
    Case("stale_marker", named("stale_marker", samples=((1.0, NOW - 1000), (STALE_NAN, NOW))),
         *OK),  # the marker is no sample to a query: the one before it is counted
    Case("too_old_and_good", write(OLD_GOOD, OLD_BAD), Seen(400, 0), Seen(400, 0)),
    Case("out_of_order", write(series(OOO, ((1.0, NOW - 10_000),))), Seen(400, 1),
         Seen(400, 1), setup=write(series(OOO))),
    Case("duplicate_timestamp", write(series(DUP, ((2.0, NOW),))), Seen(400, 1),
         Seen(400, 1), setup=write(series(DUP))),
    Case("out_of_order_in_request", named("out_of_order_in_request",
                                          samples=((1.0, NOW), (2.0, NOW - 1000))), *OK),
    Case("future", named("future", samples=((1.0, NOW + 50 * 60_000),)), *OK,
         window="[1h] offset -50m"),
    Case("duplicate_labels", named("duplicate_labels", ("a", "1"), ("a", "2")),
         Seen(500, 0), Seen(400, 0), REFUSED_NOTED),
    Case("unsorted_labels", write(series((("job", "x"), ("__name__", "parity_unsorted_labels"),
                                          ("b", "1"), ("a", "1")))), *OK),
    Case("empty_label_value", named("empty_label_value", ("a", ""), ("job", "x")), *OK),
    Case("label_name_dash", named("label_name_dash", ("a-b", "1")), *OK),
    Case("label_name_digit", write(series((("0abc", "1"),
                                           ("__name__", "parity_label_name_digit")))), *OK),
    Case("metric_name_invalid", write(series((("__name__", "parity-metric.name"),))), *OK,
         selector='{__name__="parity-metric.name"}'),
    Case("no_name", write(series((("job", "parity_no_name"),))), *OK,
         selector='{job="parity_no_name"}'),
    Case("no_labels", write(series(())), Seen(500, 0), Seen(400, 0), REFUSED_NOTED,
         selector='{__name__="parity_no_labels"}'),
    Case("empty_label_name", named("empty_label_name", ("", "x")), Seen(204, 1),
         Seen(400, 0), REFUSED_NOTED),
    Case("invalid_utf8_value", named("invalid_utf8_value", ("v", "\x01")).replace(
        b"\x12\x01\x01", b"\x12\x01\xff"), Seen(204, 1), Seen(400, 0), REFUSED_NOTED),
    Case("long_label_value", named("long_label_value", ("v", "x" * 100_000)), *OK),
    Case("exemplar", named("exemplar", exemplar=True), *OK),
    Case("native_histogram", named("native_histogram", samples=(), histogram=True),
         Seen(500, 0), Seen(502, 0),
         "documented: 2.42 without native histograms answers 500, passed on as 502"),
    Case("pod_series_stamped", named("pod_series_stamped", *POD), *OK),
    Case("pod_series_unsorted", write(series((("pod", POD[1][1]), ("__name__",
                                                                 "parity_pod_series_unsorted"),
                                              ("namespace", "web")))), *OK),
    Case("method_get", b"", Seen(405, 0), Seen(405, 0), wire=b"", method="GET", headers=()),
    Case("method_head", b"", Seen(405, 0), Seen(405, 0), wire=b"", method="HEAD", headers=()),
    Case("method_put", named("method_put"), Seen(405, 0), Seen(405, 0), method="PUT"),
    Case("trailing_slash", named("trailing_slash"), Seen(307, 0), Seen(404, 0),
         "Prometheus redirects to /write (a 404 when followed): lost either way, said",
         path="/api/v1/write/"),
]


def raw_request(case: Case, port: int) -> tuple[bytes, bytes]:
    """The request line and headers, and the body as framed."""
    body = case.wire if case.wire is not None else snappy.compress(case.body)
    head = [f"{case.method} {case.path} HTTP/{case.version}", f"Host: 127.0.0.1:{port}",
            *(f"{k}: {v}" for k, v in case.headers)]
    if case.chunked:
        head.append("Transfer-Encoding: chunked")
        half = len(body) // 2
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:])
                        if p) + b"0\r\n\r\n"
    elif case.method in ("POST", "PUT"):
        head.append(f"Content-Length: {len(body)}")
    if case.expect:
        head.append("Expect: 100-continue")
    return ("\r\n".join(head) + "\r\n\r\n").encode(), body


async def send(case: Case, port: int) -> int:
    """``case``'s request on a new connection; the final status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head, body = raw_request(case, port)
        writer.write(head)
        if case.expect:  # both send 100 Continue once they read the body
            async with asyncio.timeout(5):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 ")
        writer.write(body)
        if case.half_close:
            writer.write_eof()
        return (await read_answer(reader, head_only=case.method == "HEAD")).status
    finally:
        writer.close()


async def samples(peer: Peer, case: Case) -> int:
    rows = await query(peer.base_url, case.count_query())
    return int(float(rows[0]["value"][1])) if rows else 0


@dataclass
class Sides:
    direct: Peer
    behind: Peer
    proxy: Proxy


@pytest.fixture(scope="module")
def receivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Peer, Peer]]:
    """Two Prometheus receivers on the defaults, one per module (a start takes seconds)."""
    peers = Peers(tmp_path_factory.mktemp("parity"))

    async def start() -> tuple[Peer, Peer]:
        return await asyncio.gather(peers.prometheus_receiver("direct"),
                                    peers.prometheus_receiver("behind"))
    try:
        yield asyncio.run(start())
    finally:
        peers.stop_all()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sides(receivers: tuple[Peer, Peer]) -> AsyncIterator[Sides]:
    direct, behind = receivers
    proxy = Proxy(proxy_settings(DEMO_SNAPSHOT, behind.base_url + "/api/v1/write"))
    await proxy.start()
    try:
        assert (await proxy.upstream.check()).outcome == "rw1"
        yield Sides(direct, behind, proxy)
    finally:
        await proxy.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_proxy_answers_and_stores_as_prometheus_does(sides: Sides, case: Case
                                                               ) -> None:
    if case.setup is not None:
        setup = Case(case.name, case.setup, *OK)
        assert (await send(setup, sides.direct.port), await send(setup, sides.proxy.port)) \
            == (204, 204)
    direct = await send(case, sides.direct.port)
    proxied = await send(case, sides.proxy.port)
    seen = (Seen(direct, await samples(sides.direct, case)),
            Seen(proxied, await samples(sides.behind, case)))
    assert seen == (case.direct, case.proxied), case.why or "the same request, answered alike"
    assert (case.direct == case.proxied) == (not case.why), "a difference says why"
