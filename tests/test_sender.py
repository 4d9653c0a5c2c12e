"""The project's remote-write client: bodies parse with proxy/pb, round-trip, and send."""

from __future__ import annotations

import math

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.demo import Receiver
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2pb
from proxy.pb.prometheus import remote_pb2
from proxy.sender import (
    Series,
    build_v1,
    build_v2,
    decode_v1,
    decode_v2,
    send,
    send_series,
    series_from_exposition,
)
from proxy.wire.primitives import STALE_NAN, Protocol
from tests.facts.helpers import is_stale

SERIES = [
    Series(
        {"__name__": "up", "job": "kubelet", "instance": "n1", "empty": ""},
        [(1000, 1.0), (16000, 1.0)],
        metric_type="gauge",
        help="target up",
    ),
    Series(
        {"__name__": "http_requests_total", "code": "200", "UUID": "GPU-1"},
        [(1000, 5.0)],
        exemplars=[({"trace_id": "abc"}, 900, 1.0)],
        metric_type="counter",
    ),
]


def test_v1_body_parses_with_the_generated_module() -> None:
    req = remote_pb2.WriteRequest()
    req.ParseFromString(build_v1(SERIES))
    assert len(req.timeseries) == 2
    names = [lb.name for lb in req.timeseries[0].labels]
    assert names == sorted(names) == ["__name__", "instance", "job"]  # empty value left out
    assert [lb.name for lb in req.timeseries[1].labels] == ["UUID", "__name__", "code"]
    assert [(s.timestamp, s.value) for s in req.timeseries[0].samples] == [(1000, 1), (16000, 1)]
    assert req.timeseries[1].exemplars[0].labels[0].value == "abc"
    meta = {m.metric_family_name: (m.type, m.help) for m in req.metadata}
    assert meta == {"up": (2, "target up"), "http_requests_total": (1, "")}


def test_v2_body_has_a_valid_symbol_table() -> None:
    req = v2pb.Request()
    req.ParseFromString(build_v2(SERIES))
    assert req.symbols[0] == ""
    assert len(set(req.symbols)) == len(req.symbols)
    for ts in req.timeseries:
        refs = list(ts.labels_refs)
        assert len(refs) % 2 == 0 and all(0 < r < len(req.symbols) for r in refs)
        names = [req.symbols[r] for r in refs[::2]]
        assert names == sorted(names)
    assert req.timeseries[0].metadata.type == 2
    assert req.symbols[req.timeseries[0].metadata.help_ref] == "target up"


def test_a_v1_body_is_an_empty_v2_request() -> None:
    """The 2.0 spec reserves fields 1-3 so that a 1.0 body parses as an empty request."""
    req = v2pb.Request()
    req.ParseFromString(build_v1(SERIES))
    assert len(req.timeseries) == 0 and len(req.symbols) == 0


def test_stale_markers_keep_their_bits() -> None:
    s = [Series({"__name__": "x"}, [(1, STALE_NAN), (2, math.nan)])]
    for got in (decode_v1(build_v1(s)), decode_v2(build_v2(s))):
        (_, a), (_, b) = got[0].samples
        assert is_stale(a) and math.isnan(b) and not is_stale(b)


_label_names = st.sampled_from(["__name__", "UUID", "container", "namespace", "pod", "le", "a_1"])
_series = st.builds(
    Series,
    labels=st.dictionaries(_label_names, st.text(min_size=1, max_size=20), min_size=1, max_size=8),
    samples=st.lists(
        st.tuples(st.integers(-(2**62), 2**62), st.floats(allow_nan=False)), max_size=5
    ),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_series, max_size=8))
def test_round_trip(series: list[Series]) -> None:
    for got in (decode_v1(build_v1(series)), decode_v2(build_v2(series))):
        assert [(s.labels, s.samples) for s in got] == [(s.labels, s.samples) for s in series]


def test_series_from_exposition() -> None:
    text = (
        "# HELP c_total A counter.\n# TYPE c_total counter\n"
        'c_total{pod="a",container=""} 1 1700000000123\n'
        'c_total{pod="a",container=""} 4 1700000015123\n'
        "# TYPE g gauge\n"
        'g{pod="a"} 2.5\n'
        'g{pod="b",esc="q\\"uote"} NaN\n'
    )
    got = series_from_exposition(text, 42, extra_labels={"job": "kubelet"})
    by = {(s.name, s.labels.get("pod")): s for s in got}
    c = by[("c_total", "a")]
    assert c.labels == {"__name__": "c_total", "pod": "a", "job": "kubelet"}
    assert c.samples == [(1700000000123, 1.0), (1700000015123, 4.0)]
    assert c.metric_type == "counter" and c.help == "A counter."
    assert by[("g", "a")].samples == [(42, 2.5)]
    assert by[("g", "b")].labels["esc"] == 'q"uote'
    assert math.isnan(by[("g", "b")].samples[0][1])
    req = remote_pb2.WriteRequest()
    req.ParseFromString(build_v1(got))
    assert {m.metric_family_name for m in req.metadata} == {"c_total", "g"}


async def test_send_v1_snappy_and_v2_zstd_with_headers() -> None:
    rx = Receiver()
    url = await rx.start()
    try:
        async with aiohttp.ClientSession() as session:
            status, headers, _ = await send_series(
                url,
                SERIES,
                protocol="v1",
                encoding="snappy",
                headers={"X-Scope-OrgID": "team-a"},
                session=session,
            )
            assert status == 204
            status, headers, _ = await send_series(
                url, SERIES, protocol=Protocol.V2, encoding="zstd"
            )
            assert status == 204
            assert headers["X-Prometheus-Remote-Write-Samples-Written"] == "3"
            assert headers["X-Prometheus-Remote-Write-Exemplars-Written"] == "1"
            status, _, text = await send(url, b"\x00garbage", protocol="v1", compressed=True)
            assert status == 400, text
    finally:
        await rx.stop()
    (r1, r2) = rx.requests
    assert r1.protocol is Protocol.V1 and r1.encoding == "snappy"
    assert r1.headers["X-Scope-OrgID"] == "team-a"
    assert r1.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert r2.protocol is Protocol.V2 and r2.encoding == "zstd"
    assert r2.headers["X-Prometheus-Remote-Write-Version"] == "2.0.0"
    want = [({k: v for k, v in s.labels.items() if v}, s.samples) for s in SERIES]
    assert [(s.labels, s.samples) for s in r1.series] == want
    assert [(s.labels, s.samples) for s in r2.series] == want


def test_counter_names_as_written_not_as_the_client_library_renames_them() -> None:
    text = ("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"
            'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"} 12345\n'
            "# TYPE requests_total counter\n"
            "requests_total 3\n")
    names = {s.name for s in series_from_exposition(text, 1000)}
    assert names == {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "requests_total"}
