"""benchmarks/convert_bench.py: the RW 2.0 -> 1.0 conversion's CPU, reference against
native, run tiny so the script cannot rot (the figures are docs/performance.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.wire.native import native_available

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "convert_bench.py"


@pytest.mark.skipif(not native_available(), reason="the native extension is not built")
def test_convert_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "convert.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--series", "40", "8", "--rounds", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["series"] for r in results] == [40, 8]
    for r in results:
        assert r["converted_bytes"] > r["request_bytes"] > 0
        for key in ("size_ref_ms", "size_native_ms", "convert_ref_ms", "convert_native_ms",
                    "splice_ms", "both_ratio"):
            assert r[key] >= 0
    assert "conversion  reference" in proc.stdout and "splice" in proc.stdout
