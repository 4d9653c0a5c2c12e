"""benchmarks/loop_bench.py: the event loop thread's calls per request, both relays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from loop_bench import package  # noqa: E402


def test_functions_are_grouped_by_the_package_they_come_from() -> None:
    assert package("proxy/handler.py:326(handle)") == "proxy"
    assert package("/work/x/proxy/upstream.py:692(_post)") == "proxy"
    assert package("aiohttp/client.py:558(_request)") == "aiohttp"
    assert package("asyncio/base_events.py:1845(_run_once)") == "asyncio"
    assert package("selectors.py:451(select)") == "selectors"
    assert package("/work/x/benchmarks/relay/passthrough.py:44(write)") == "relay"
    assert package("<method 'send' of '_socket.socket' objects>") == "builtins"


@pytest.mark.skipif(not (BENCH.parent / "proxy" / "cli.py").exists(), reason="no proxy here")
def test_loop_bench_quick_counts_both_relays(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, str(BENCH / "loop_bench.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    relays = result["relays"]
    for name in ("pass-through", "karta-proxy"):
        assert relays[name]["errors"] == 0 and relays[name]["requests"] == 20
        assert relays[name]["calls_per_request"] > 100  # a request through aiohttp at least
        assert relays[name]["by_package"]["aiohttp"] > 0
    # only karta-proxy's loop runs the proxy's code; its request path's metrics are plain
    # numbers (proxy.loop_metrics): no prometheus_client call on the loop per request
    assert relays["karta-proxy"]["by_package"]["proxy"] > 0
    assert "proxy" not in relays["pass-through"]["by_package"]
    assert relays["karta-proxy"]["by_package"].get("prometheus_client", 0) == 0
    assert result["calls_ratio"] > 0
    assert "calls on the event loop thread" in proc.stdout
