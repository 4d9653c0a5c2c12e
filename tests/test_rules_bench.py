"""Keeps ``benchmarks/rules_bench.py`` working: a tiny cluster, a real Prometheus and
karta-proxy, no timing assertion (the figures are the benchmark's, in
docs/recording-rules.md, "Cost at scale")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "rules_bench.py"

#: two records in the form the rules had before 1.10.0 (a karta_workload!="" matcher)
BASELINE = """
groups:
  - name: before
    rules:
      - record: karta_workload:container_memory_working_set_bytes:sum
        expr: |
          sum by (cluster, karta_namespace, karta_group, karta_kind, karta_workload) (
            container_memory_working_set_bytes{container!="", container!="POD", image!="",
                                               karta_workload!=""}
          )
      - record: karta_workload:DCGM_FI_DEV_FB_USED:sum
        expr: |
          sum by (cluster, karta_namespace, karta_group, karta_kind, karta_workload) (
            DCGM_FI_DEV_FB_USED{karta_workload!=""}
            / on (cluster, Hostname, gpu, UUID, GPU_I_ID) group_left ()
              count by (cluster, Hostname, gpu, UUID, GPU_I_ID) (DCGM_FI_DEV_FB_USED)
          )
"""


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_rules_bench_quick(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(BASELINE)
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--baseline-rules", str(baseline),
         "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [size] = json.loads(out.read_text())
    assert size["pods"] == 100 and size["refused"] == 0 and size["workloads"] > 0
    rules = {r["name"]: r for g in size["groups"].values() for r in g["rules"]}
    assert all(r["health"] == "ok" for r in rules.values()), {
        n: r["last_error"] for n, r in rules.items() if r["health"] != "ok"}
    # every recording rule was read at least once, and the corpus feeds the main ones
    assert all(r["seconds"] for r in rules.values())
    for name in ("karta_workload:container_cpu_usage_seconds:rate5m",
                 "karta_workload:DCGM_FI_DEV_FB_USED:sum",
                 "karta_workload:karta_component_observed_pods:sum"):
        assert rules[name]["series_out"] > 0, name
    # the shipped expressions answer what the old form did, on the proxy's real labels
    compared = {c["record"]: c for c in size["compared"]}
    assert set(compared) == {"karta_workload:container_memory_working_set_bytes:sum",
                             "karta_workload:DCGM_FI_DEV_FB_USED:sum"}
    assert all(c["same"] and c["series"] > 0 for c in compared.values()), compared
