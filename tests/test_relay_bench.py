"""Keeps ``benchmarks/relay_bench.py`` working: tiny sizes, real processes, no timing
assertions (figures come from the benchmark itself, see docs/performance.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import snappy

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from relay import corpus, highcard  # noqa: E402
from relay.null_upstream import (  # noqa: E402
    CORPUS_SAMPLE,
    KARTA_WORKLOAD_LABEL,
    Stats,
    count,
    count_series,
    scan_v2,
)
from relay.workdir import results_path  # noqa: E402


def test_corpus_bodies_are_valid_write_requests() -> None:
    cluster = corpus.build_cluster(pods=120, seed=3)
    stream = corpus.SeriesStream(cluster)
    first, second = stream.next_body(50), stream.next_body(50)
    assert count_series(first) == count_series(second) == 50
    assert snappy.uncompress(snappy.compress(first)) == first
    # the same series (labels) as a by-the-book encoder, only samples advance
    assert first != second
    pb = pytest.importorskip("proxy.pb.prometheus.remote_pb2")
    req = pb.WriteRequest()
    req.ParseFromString(first)
    assert len(req.timeseries) == 50
    for ts in req.timeseries:
        names = [label.name for label in ts.labels]
        assert names == sorted(names, key=str.encode)
        assert len(ts.samples) == 1
        assert ts.samples[0].timestamp == corpus.BASE_TIMESTAMP_MS
    later = pb.WriteRequest()
    later.ParseFromString(stream.next_body(50))
    assert later.timeseries[0].samples[0].timestamp > corpus.BASE_TIMESTAMP_MS


def test_corpus_mixes_cadvisor_dcgm_and_unknown_pods(tmp_path: Path) -> None:
    cluster = corpus.build_cluster(pods=400, seed=5)
    rows = [labels for labels, _ in corpus.series_labels(cluster)]
    names = {labels["__name__"] for labels in rows}
    assert "container_cpu_usage_seconds_total" in names
    assert "DCGM_FI_DEV_GPU_UTIL" in names
    dcgm_owned = [r for r in rows if "exported_pod" in r]
    assert dcgm_owned and all(r["namespace"] == "gpu-operator" for r in dcgm_owned)
    stream = corpus.SeriesStream(cluster)
    assert 0.85 < stream.attributable / stream.universe < 1.0
    kinds = {o["kind"] for o in cluster.objects}
    assert {"Deployment", "ReplicaSet", "StatefulSet", "Job", "DaemonSet", "Pod"} <= kinds
    snap = corpus.write_snapshot(cluster, tmp_path / "snap.yaml")
    import yaml

    doc = yaml.safe_load(snap.read_text())
    assert doc["kind"] == "List" and len(doc["items"]) == len(cluster.objects)


def test_encoder_matches_protobuf_reference() -> None:
    pb = pytest.importorskip("proxy.pb.prometheus.remote_pb2")
    labels = {"pod": "p-0", "__name__": "m", "Hostname": "h", "namespace": "ns"}
    body = corpus.encode_series(labels, 1.5, corpus.BASE_TIMESTAMP_MS + 7)
    req = pb.WriteRequest()
    ts = req.timeseries.add()
    for name in sorted(labels, key=str.encode):
        ts.labels.add(name=name, value=labels[name])
    ts.samples.add(value=1.5, timestamp=corpus.BASE_TIMESTAMP_MS + 7)
    assert body == req.SerializeToString()
    assert KARTA_WORKLOAD_LABEL not in body


def test_relay_bench_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, str(BENCH / "relay_bench.py"), "--quick", "--pods", "150",
        "--series-per-request", "200", "--requests", "4", "--rounds", "1", "--warmup", "2",
        "--json", str(out), "--max-seconds", "120",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    relays = result["relays"]
    assert relays["pass-through"]["delivered_fraction"] == 1.0
    # a few tiny requests may fit in one clock tick: a number, not necessarily above 0
    assert relays["pass-through"]["cpu_per_million"] >= 0
    if shutil.which("vmagent"):
        assert relays["vmagent"]["delivered_fraction"] == 1.0
        assert relays["vmagent+relabel"]["stamped_fraction"] > 0
    else:
        assert "vmagent" in result["skipped"]
    if (BENCH.parent / "proxy" / "cli.py").exists():
        assert "karta-proxy" in relays, result["skipped"]
        kp = relays["karta-proxy"]
        assert kp["delivered_fraction"] >= 1.0  # fact series may come on top
        assert kp["stamped_fraction"] > 0.5
    assert "karta-proxy / pass-through" in proc.stdout


# -- the high-cardinality mode ----------------------------------------------------------------


def _universe(pods: int = 120, series: int = 3000) -> highcard.Universe:
    cluster = corpus.build_cluster(pods, seed=3, long_names=True)
    return highcard.build_universe(cluster, series)


def test_high_cardinality_universe_holds_each_series_once_per_pass() -> None:
    u = _universe()
    assert u.series == 3000
    labels = [u.labels(p) for p in range(u.series)]
    keys = {tuple(sorted(lb.items())) for lb in labels}
    assert len(keys) == u.series  # distinct
    # the next pass goes through the same series, in the same order
    assert u.labels(u.series + 17) == labels[17]
    names = {lb["__name__"] for lb in labels}
    assert {"container_cpu_usage_seconds_total", "container_network_receive_bytes_total"} <= names
    assert any(n.startswith("DCGM_") for n in names)
    assert 0.85 < u.attributable / u.series < 1.0
    assert u.attributable_between(0, 2 * u.series) == 2 * u.attributable
    stats = highcard.describe(u)
    assert 500 < stats["label_bytes_per_series"] < 700
    assert 11 < stats["labels_per_series"] < 15
    with pytest.raises(ValueError, match="at most"):
        highcard.build_universe(corpus.build_cluster(20, seed=3), 1_000_000)


def test_high_cardinality_bodies_v1_and_v2_hold_the_same_samples() -> None:
    pb1 = pytest.importorskip("proxy.pb.prometheus.remote_pb2")
    pb2 = pytest.importorskip("proxy.pb.io.prometheus.write.v2.types_pb2")
    u = _universe()
    n = 400
    for pos in (0, u.series - 100):  # the second one wraps into the next pass
        v1 = pb1.WriteRequest()
        v1.ParseFromString(u.body_v1(pos, n))
        v2 = pb2.Request()
        v2.ParseFromString(u.body_v2(pos, n))
        assert v2.symbols[0] == ""
        assert len(v1.timeseries) == len(v2.timeseries) == n
        for k, (a, b) in enumerate(zip(v1.timeseries, v2.timeseries, strict=True)):
            pairs = [(x.name, x.value) for x in a.labels]
            refs = b.labels_refs
            assert pairs == [
                (v2.symbols[refs[i]], v2.symbols[refs[i + 1]]) for i in range(0, len(refs), 2)
            ]
            assert pairs == sorted(u.labels(pos + k).items(), key=lambda kv: kv[0].encode())
            assert len(a.samples) == len(b.samples) == 1
            assert a.samples[0].value == b.samples[0].value
            assert a.samples[0].timestamp == b.samples[0].timestamp
    # a later pass: same labels, later timestamp, counters grown
    first, later = pb1.WriteRequest(), pb1.WriteRequest()
    first.ParseFromString(u.body_v1(0, 50))
    later.ParseFromString(u.body_v1(u.series, 50))
    assert [t.labels for t in first.timeseries] == [t.labels for t in later.timeseries]
    dt = later.timeseries[0].samples[0].timestamp - first.timeseries[0].samples[0].timestamp
    assert dt == highcard.PASS_MS
    assert [t.samples[0].value for t in first.timeseries] != [
        t.samples[0].value for t in later.timeseries
    ]


def test_high_cardinality_bodies_built_in_workers_match() -> None:
    u = _universe()
    segs = [highcard.Segment(0, 200, 5), highcard.Segment(1000, 50, 3)]
    bodies = highcard.build_bodies(u, segs, ("v1", "v2"), workers=2, chunk=2)
    assert len(bodies["v1"]) == len(bodies["v2"]) == 8
    assert snappy.uncompress(bodies["v1"][1]) == u.body_v1(200, 200)
    assert snappy.uncompress(bodies["v2"][6]) == u.body_v2(1050, 50)


def _stamp_v2(body: bytes, extra_symbols: int) -> bytes:
    """An RW 2.0 body with every second series given karta_workload="w" (by re-encoding
    it the way a proxy might: new symbols appended after the existing ones)."""
    pb2 = pytest.importorskip("proxy.pb.io.prometheus.write.v2.types_pb2")
    req = pb2.Request()
    req.ParseFromString(body)
    for i in range(extra_symbols):
        req.symbols.append(f"pad-{i}")
    k = len(req.symbols)
    req.symbols.extend(["karta_workload", "w"])
    for i, ts in enumerate(req.timeseries):
        if i % 2 == 0:
            ts.labels_refs.extend([k, k + 1])
    out: bytes = req.SerializeToString()
    return out


@pytest.mark.parametrize("extra_symbols", [0, 200])  # the symbol's ref below / above 128
def test_null_upstream_counts_rw2_series_samples_and_stamps(extra_symbols: int) -> None:
    u = _universe()
    plain = u.body_v2(0, 30)
    assert scan_v2(plain) == (30, 0)
    stamped = _stamp_v2(plain, extra_symbols)
    assert scan_v2(stamped) == (30, 15)
    stats = Stats()
    count(stats, stamped, v2=True, corpus_only=True)
    assert (stats.series, stats.v2_series, stats.samples, stats.stamped) == (30, 30, 30, 15)


def test_null_upstream_tells_corpus_samples_from_other_series() -> None:
    u = _universe()
    body = u.body_v1(0, 40)
    assert len(CORPUS_SAMPLE.findall(body)) == 40
    now_ms = 1_790_000_000_000  # the wall clock of a fact write, not the corpus' clock
    fact = corpus.encode_series(
        {"__name__": "karta_workload_info", "karta_workload": "w"}, 1.0, now_ms
    )
    stats = Stats()
    count(stats, body, v2=False, corpus_only=True)
    count(stats, fact, v2=False, corpus_only=True)
    assert (stats.series, stats.samples, stats.other_series, stats.stamped) == (41, 40, 1, 0)


@pytest.mark.skipif(not (BENCH.parent / "proxy" / "cli.py").exists(), reason="no proxy")
def test_relay_bench_row_of_rw2_converted_for_a_1_0_upstream(tmp_path: Path) -> None:
    """The on-request row: RW 2.0 senders, every request converted to RW 1.0 by the proxy
    (as for Prometheus 2.x or VictoriaMetrics), every sample delivered and stamped."""
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, str(BENCH / "relay_bench.py"), "--corpus", "high-cardinality", "--quick",
        "--pods", "120", "--series", "3000", "--sizes", "100", "--samples-per-round", "500",
        "--paced-requests", "6", "--rate", "40", "--json", str(out), "--max-seconds", "120",
        "--relays", "pass-through,karta-proxy,karta-proxy-rw2-v1", "--taskset-rounds", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    relays = json.loads(out.read_text())["sizes"]["100"]["relays"]
    row = relays["karta-proxy-rw2-v1"]
    assert row["delivered_fraction"] == 1.0
    assert row["stamped_fraction"] == row["expected_stamped_fraction"] > 0.5
    assert row["rw2_fraction"] == 0.0  # sent as RW 2.0, arrived as RW 1.0: converted
    assert "direct-rw2" in relays  # its latency baseline
    assert "karta-proxy RW2->1" in proc.stdout and "arrived as RW 2.0" not in proc.stdout


def test_relay_bench_high_cardinality_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, str(BENCH / "relay_bench.py"), "--corpus", "high-cardinality", "--quick",
        "--pods", "120", "--series", "3000", "--sizes", "100,25", "--samples-per-round", "500",
        "--paced-requests", "6", "--rate", "40", "--json", str(out), "--max-seconds", "120",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "high-cardinality"
    assert result["corpus"]["series"] == 3000
    assert set(result["sizes"]) == {"100", "25"}
    for size in result["sizes"].values():
        relays = size["relays"]
        assert relays["direct"]["delivered_fraction"] == 1.0
        assert relays["pass-through"]["delivered_fraction"] == 1.0
        assert relays["pass-through"]["latency_p99_ms"] > 0
        # every relay paced with every paced request (at once, taking turns)
        assert len(relays["direct"]["paced_latencies_ms"]) == 6
        assert len(relays["pass-through"]["paced_latencies_ms"]) == 6
        # where the Python relays' CPU went, by thread: the event loop at least
        loop = relays["pass-through"]["threads_per_request"]["main"]
        assert loop["threads"] == 1 and loop["cpu_ms"] >= 0 and loop["voluntary_switches"] > 0
        if shutil.which("vmagent"):
            assert relays["vmagent"]["delivered_fraction"] == 1.0
            assert relays["vmagent+relabel"]["stamped_fraction"] > 0
        if (BENCH.parent / "proxy" / "cli.py").exists():
            for key in ("karta-proxy", "karta-proxy-rw2"):
                row = relays[key]
                assert row["delivered_fraction"] == 1.0
                assert row["stamped_fraction"] == row["expected_stamped_fraction"] > 0.5
                assert row["peak_rss_mb"] > 0
            assert relays["karta-proxy-rw2"]["rw2_fraction"] == 1.0  # forwarded as RW 2.0
            assert relays["karta-proxy"]["rw2_fraction"] == 0.0
            assert "main" in relays["karta-proxy"]["threads_per_request"]
    if not shutil.which("vmagent"):
        assert "vmagent" in result["skipped"]
    if (BENCH.parent / "proxy" / "cli.py").exists():
        targets = result["targets"]
        assert targets["peak_rss_mb"] > 0
        assert "samples/s, 2 cores / 1 core" in proc.stdout
        if len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset"):
            assert result["taskset"]["rounds"] == 1
            assert targets["two_core_speedup"] > 0
            # the load's own CPU is measured (in clock ticks: 0 is possible at this size),
            # and with it the most this machine allows
            harness = result["taskset"]["harness_cpu_per_million"]
            assert harness["karta-proxy"] >= 0 and harness["karta-proxy-1core"] >= 0
            bound = result["taskset"]["speedup_bound"]
            assert math.isnan(bound) or 0 < bound <= 2.0 + 1e-9
    assert "karta-proxy / pass-through (CPU)" in proc.stdout


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_thread_use_tells_threads_apart_by_their_os_names() -> None:
    from relay.procs import MAIN_THREAD, thread_role, thread_use, thread_use_between

    from proxy.thread_names import name_os_thread

    assert thread_role("karta-splice_1") == "karta-splice"
    assert thread_role("karta-aux") == "karta-aux" and thread_role("x_y") == "x_y"
    go, done, read = threading.Event(), threading.Event(), threading.Event()

    def busy() -> None:
        name_os_thread()
        go.wait(10)
        end = time.thread_time() + 0.15
        while time.thread_time() < end:
            pass
        time.sleep(0.05)  # a switch given up, between the readings
        done.set()
        read.wait(10)  # alive until the second reading is taken (not for 0.2 s: a loaded
        # machine took longer for it, and the thread was gone from it)

    t = threading.Thread(target=busy, name="bench-busy_0")
    t.start()
    before = thread_use(os.getpid())
    go.set()
    done.wait(10)
    after = thread_use(os.getpid())
    read.set()
    spent = thread_use_between(before, after)
    t.join()
    assert MAIN_THREAD in spent and spent["bench-busy"].threads == 1
    assert spent["bench-busy"].cpu_seconds >= 0.1  # in clock ticks
    assert spent["bench-busy"].voluntary_switches >= 1  # it slept
    assert spent["bench-busy"].run_wait_seconds >= 0


def test_scaling_bound_counts_the_load_on_a_two_core_machine() -> None:
    import relay_bench

    # the 1-core relay has its core; the 2-core one shares two cores with the load
    assert relay_bench._scaling_bound(1.5, 1.5, 0.0, 2) == 2.0
    assert relay_bench._scaling_bound(1.43, 1.50, 0.33, 2) == pytest.approx(1.563, abs=1e-3)
    # cores to spare for the load: only the relay's own costs count
    assert relay_bench._scaling_bound(1.5, 1.6, 0.33, 8) == pytest.approx(1.875)
    assert math.isnan(relay_bench._scaling_bound(math.nan, 1.5, 0.3, 2))
    assert math.isnan(relay_bench._scaling_bound(0.0, 1.5, 0.3, 2))  # no tick measured
    # a short phase's ticks: the 1-core relay read at twice the 2-core one's CPU, and more
    assert relay_bench._scaling_bound(0.04, 0.02, 0.0, 2) == 2.0


class _Recorder(ThreadingHTTPServer):
    """A sink on 127.0.0.1 that answers 204 and notes when each body arrived, and which."""

    def __init__(self, arrivals: list[tuple[float, int, bytes]], mark: int) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                arrivals.append((time.monotonic(), server.mark, body))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.mark = mark


def test_paced_turns_give_each_relay_the_rate_the_relays_evenly_apart() -> None:
    from relay.load import turn

    turns = [turn(c, 3, 20.0) for c in range(9)]
    assert [(k, j) for _, k, j in turns] == [(k, j) for k in range(3) for j in range(3)]
    due = [after for after, _, _ in turns]
    assert due == sorted(due)
    for j in range(3):  # each relay: 20 requests a second
        assert [b - a for a, b in itertools.pairwise(due[j::3])] == pytest.approx([0.05] * 2)
    assert [b - a for a, b in itertools.pairwise(due)] == pytest.approx([0.05 / 3] * 8)
    assert turn(5, 1, 20.0) == (0.25, 5, 0)  # one relay: the plain paced schedule


def test_paced_together_gives_every_relay_each_request_in_turns() -> None:
    from relay import load

    bodies = {"v1": [b"body-%d" % i for i in range(6)]}
    arrivals: list[tuple[float, int, bytes]] = []
    sinks = [_Recorder(arrivals, mark) for mark in range(3)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in sinks]
    for t in threads:
        t.start()
    pool = load.SenderPool(bodies, size=2)
    try:
        items = [1, 3, 5, 0]
        # 4/s: turns 83 ms apart, each answered long before the next is due
        results = pool.run_together([(s.server_address[1], "v1") for s in sinks], items, 4)
    finally:
        pool.close()
        for s in sinks:
            s.shutdown()
            s.server_close()
    assert [r.errors for r in results] == [0, 0, 0]
    for result in results:  # each relay got every item once, timed from its due time
        assert sorted(item for item, _ in result.latencies) == sorted(items)
        assert all(0 <= lat < 5 for _, lat in result.latencies)
    arrivals.sort()
    assert [(mark, body) for _, mark, body in arrivals] == [
        (mark, b"body-%d" % item) for item in items for mark in range(3)]


def test_saturating_sends_go_to_one_relay() -> None:
    from relay import load

    pool = load.SenderPool({"v1": [b"x"]}, size=1)
    try:
        with pytest.raises(ValueError, match="one relay"):
            pool._run([(1, "v1"), (2, "v1")], [0], None)
    finally:
        pool.close()


def test_a_results_file_is_checked_before_the_run(tmp_path: Path) -> None:
    made = results_path(str(tmp_path / "new" / "dir" / "out.json"))
    assert made.parent.is_dir() and not made.exists()
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        results_path(str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot make"):
        results_path(str(tmp_path / "file" / "out.json"))
