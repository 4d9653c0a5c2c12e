"""Keeps ``benchmarks/relay_bench.py`` working: tiny sizes, real processes, no timing
assertions (figures come from the benchmark itself, see docs/performance.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import snappy

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from relay import corpus  # noqa: E402
from relay.null_upstream import KARTA_WORKLOAD_LABEL, count_series  # noqa: E402


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
