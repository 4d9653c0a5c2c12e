"""The bundled demo: runs end to end on loopback, every sample arrives, workloads add up."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import contract
from proxy.demo import (
    BUNDLED_SERIES,
    BUNDLED_SNAPSHOT,
    NEXT_QUERIES,
    UNATTRIBUTED,
    run,
    run_demo,
)
from proxy.demo_cluster import ClusterModel
from proxy.demo_exporter import demo_series_text, load_objects

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model() -> ClusterModel:
    return ClusterModel.from_objects(load_objects(BUNDLED_SNAPSHOT))


async def test_demo_end_to_end(model: ClusterModel) -> None:
    out = io.StringIO()
    result = await run(out=out)
    text = out.getvalue()
    assert result.ok, (result.errors, result.statuses)
    assert result.statuses == [204, 204]
    assert "samples sent 472, received 472 (none lost, none added)" in text

    rows = {r["workload"]: r for r in result.summary}
    assert set(rows) == {
        "nightly-etl",
        "debug-shell",
        "dcgm-exporter",
        "pretrain",
        "llm-finetune",
        "frontend",
        "postgres",
        UNATTRIBUTED,
    }
    for name in rows:
        assert name in text  # every workload is printed in the table
    # figures: what the fixture model says each workload's containers use
    expected_cpu = {
        "frontend": ("web", ["frontend-6d8f7b9c5d-4xkqp", "frontend-6d8f7b9c5d-9zt2m"]),
        "postgres": ("web", ["postgres-0", "postgres-1"]),
        "pretrain": (
            "ml",
            [
                "pretrain-driver-0-0-bq9tw",
                "pretrain-workers-0-0-h5k8s",
                "pretrain-workers-1-0-m2n4r",
            ],
        ),
    }
    for wl, (ns, pods) in expected_cpu.items():
        containers = [c for p in pods for c in model.pod(ns, p).containers]
        assert rows[wl]["cpu_cores"] == pytest.approx(sum(c.cpu_cores for c in containers))
        assert rows[wl]["memory_bytes"] == pytest.approx(sum(c.memory_bytes for c in containers))
        assert rows[wl]["kind"] in ("Deployment", "StatefulSet", "JobSet")
    assert rows["pretrain"]["gpus"] == 3
    assert rows["llm-finetune"]["gpus"] == 2 and rows["llm-finetune"]["kind"] == "RayJob"
    gpu_utils = [g.util for g in model.gpus if g.holder and g.holder.pod.startswith("pretrain-")]
    assert rows["pretrain"]["gpu_util"] == pytest.approx(sum(gpu_utils) / 3)


async def test_demo_stamps_what_it_should_and_nothing_else() -> None:
    result = await run(out=io.StringIO())
    sent = {tuple(sorted(s.labels.items())) for s in result.sent}
    for s in result.received:
        stamped = {k: v for k, v in s.labels.items() if k.startswith(contract.STAMPED_PREFIX)}
        rest = {k: v for k, v in s.labels.items() if not k.startswith(contract.STAMPED_PREFIX)}
        assert tuple(sorted(rest.items())) in sent  # only karta_ labels were added
        pod = s.labels.get("exported_pod") or s.labels.get("pod")
        # an idle GPU has only the exporter's own pod labels: not charged to it
        idle_gpu = s.name.startswith("DCGM_") and not s.labels.get("exported_pod")
        if pod in ("allreduce-bench-worker-0", "notebook-5f7c9-zx2lq", None) or idle_gpu:
            assert not stamped, s.labels
        elif s.labels.get("exported_pod"):
            assert stamped["karta_workload"] != "dcgm-exporter"  # the GPU's pod, not the exporter
        else:
            assert stamped["karta_workload"] and stamped["karta_kind"], s.labels


def test_run_demo_prints_the_summary() -> None:
    out = io.StringIO()
    assert run_demo(None, out=out) == 0
    text = out.getvalue()
    assert "Per workload" in text and "JobSet" in text and "RayJob" in text
    assert "+karta_workload=" in text


def test_demo_ends_with_the_queries_to_paste_and_the_next_step() -> None:
    out = io.StringIO()
    assert run_demo(None, out=out) == 0
    tail = out.getvalue().split("none lost, none added)", 1)[1]
    assert "Next:" in tail and "README.md's walkthrough" in tail
    assert "--web.enable-remote-write-receiver" in tail
    for q in NEXT_QUERIES:  # the walkthrough runs these (tests/test_readme.py)
        assert f"\n  {q}\n" in tail, q
    assert 'rate() at "now" reads low' in tail


def test_cli_demo_subcommand() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "demo"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "none lost, none added" in proc.stdout


def test_bundled_series_match_the_generator() -> None:
    """series.prom is generated from snapshot.yaml: regenerate it when the snapshot changes."""
    want = demo_series_text(load_objects(BUNDLED_SNAPSHOT))
    assert BUNDLED_SERIES.read_text() == want, "run: python -m proxy.demo_exporter --demo-series"


async def test_demo_sends_the_names_of_the_batch() -> None:
    """The demo plays a Prometheus agent: it writes the names the exposition holds, as
    Prometheus would, not a client library's renaming of them."""
    text = BUNDLED_SERIES.read_text()
    exposed = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
               if line and not line.startswith("#")}
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in exposed  # a counter without _total
    result = await run(out=io.StringIO())
    assert {s.name for s in result.sent} == exposed


def test_demo_input_errors_are_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing snapshot was chained tracebacks; a bad series file a float error naming
    neither the file nor the line."""
    out = io.StringIO()
    missing = tmp_path / "nonexist"
    assert run_demo(None, snapshot=str(missing), out=out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"karta-proxy demo: error: snapshot {missing}: ") and (
        err.count("\n") == 1), err
    series = tmp_path / "s.prom"
    series.write_text('a 1\nb{x="1"} 2\nc nope\n')
    assert run_demo(None, series=str(series), out=out) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"karta-proxy demo: error: {series}:3: not Prometheus text") and (
        err.count("\n") == 1), err
