"""benchmarks/http_layer_bench.py: the HTTP layers' CPU per request against a minimal
exchange's, run tiny so the script cannot rot (the figures are docs/performance.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "http_layer_bench.py"


def test_http_layer_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "http.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--requests", "20", "--rounds", "1",
                           "--body-bytes", "20000", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results["median_ms"]) == {"Upstream.forward", "aiohttp client",
                                         "minimal client", "aiohttp server", "minimal server"}
    # the server side's CPU is read in 10 ms ticks: 20 requests may read 0
    assert all(ms >= 0 for ms in results["median_ms"].values())
    assert results["median_ms"]["aiohttp client"] > 0
    assert "a leaner HTTP layer could take off" in proc.stdout
