"""benchmarks/heavy_object_bench.py: run tiny so the script cannot rot (the figures are
docs/performance.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "heavy_object_bench.py"


def test_heavy_object_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "heavy.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    # every write answered 2xx, every update the simulator made seen by the proxy
    assert r["writes_not_2xx"] == 0, r["statuses"]
    assert r["updates"] > 0 and r["events_once_quiet"] == r["updates"]
    assert r["writes_updating"]["n"] > 0 and r["healthy"]["n"] > 0
    assert "Workflow updates made" in proc.stdout
