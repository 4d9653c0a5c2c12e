"""docker-compose.yml cannot run here; keep it valid and in step with the CLI and promtool."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import build_parser, settings_from_args

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def _proxy_args() -> list[str]:
    cmd = _compose()["services"]["karta-proxy"]["command"]
    script = cmd[-1]
    words = shlex.split(script)
    return words[words.index("karta-proxy") + 1 :]


def test_compose_is_valid_yaml_with_the_stack() -> None:
    services = _compose()["services"]
    assert {"exporter", "karta-proxy", "agent", "tsdb"} <= set(services)
    assert "--web.enable-remote-write-receiver" in services["tsdb"]["command"]
    assert "--enable-feature=agent" in services["agent"]["command"]
    for svc in services.values():  # every mounted file exists in the repo
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (REPO / src).exists(), src


def test_proxy_flags_are_the_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the container runs from a copy of the repo
    args = _proxy_args()
    ns = build_parser().parse_args(args)  # SystemExit on an unknown flag
    s = settings_from_args(ns, env={})
    assert s.snapshot == "proxy/demo_data/snapshot.yaml"
    assert (REPO / s.snapshot).is_file()
    assert s.upstream.url == "http://tsdb:9090/api/v1/write"
    assert s.server.listen_address == "0.0.0.0:9091"
    assert s.facts.external_labels == {"cluster": "demo"}  # from config/compose/karta-proxy.yaml


def test_agent_writes_to_the_proxy() -> None:
    agent = yaml.safe_load((REPO / "config/compose/agent.yml").read_text())
    assert [rw["url"] for rw in agent["remote_write"]] == ["http://karta-proxy:9091/api/v1/write"]
    jobs = {j["job_name"]: j for j in agent["scrape_configs"]}
    assert jobs["dcgm-exporter"]["honor_labels"] is False


@pytest.mark.parametrize("name", ["agent.yml", "tsdb.yml"])
def test_prometheus_configs_pass_promtool(name: str, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    text = (REPO / "config/compose" / name).read_text()
    text = text.replace("/etc/prometheus/rules", str(REPO / "config/rules"))
    f = tmp_path / name
    f.write_text(text)
    proc = subprocess.run(
        [promtool, "check", "config", str(f)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
