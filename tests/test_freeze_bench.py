"""benchmarks/freeze_bench.py: the fact writer's collection before a write, run tiny so
the script cannot rot (the figures are docs/operations.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "freeze_bench.py"


def test_freeze_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "freeze.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--pods", "2000", "--workloads", "40",
                           "--rounds", "2", "--json", str(out)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["pods"] == 2000 and result["rounds"] == 2
    for key in ("before_build_ms", "after_build_ms"):
        assert result[key] > 0
