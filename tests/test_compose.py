"""docker-compose.yml cannot run here; keep it valid and in step with the image, the CLI and
promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import build_parser, settings_from_args
from proxy.demo_exporter import build_parser as build_exporter_parser

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


#: where the Containerfile links the installed package's demo_data (the bundled snapshot)
IMAGE_DEMO = "/opt/karta-proxy/demo"
CONTAINERFILE = REPO / "config/image/Containerfile"


def _host_path(service: dict[str, Any], path: str) -> Path:
    """The repo file behind a path in a container: a mounted file, or the image's demo data."""
    for vol in service.get("volumes", []):
        src, dst = vol.split(":")[:2]
        if path == dst:
            return REPO / src
        if path.startswith(dst.rstrip("/") + "/"):
            return REPO / src / path[len(dst) :].lstrip("/")
    if path.startswith(IMAGE_DEMO + "/"):
        return REPO / "proxy/demo_data" / path[len(IMAGE_DEMO) + 1 :]
    raise AssertionError(f"{path}: neither mounted nor in the image")


def _host_args(service: dict[str, Any], flags: set[str]) -> list[str]:
    """The service's command words, the values of ``flags`` mapped to repo paths."""
    words = [str(w) for w in service["command"]]
    return [
        str(_host_path(service, w)) if i and words[i - 1] in flags else w
        for i, w in enumerate(words)
    ]


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


@pytest.mark.parametrize("name", ["exporter", "karta-proxy"])
def test_project_services_run_the_image_not_the_source_tree(name: str) -> None:
    """Built from config/image/Containerfile once: no pip at start, no tests/ code, no
    source tree mounted in."""
    svc = _compose()["services"][name]
    assert svc["build"]["context"] == "."
    assert REPO / svc["build"]["context"] / svc["build"]["dockerfile"] == CONTAINERFILE
    assert CONTAINERFILE.is_file()
    assert "BASE" in svc["build"].get("args", {})  # the Containerfile's build argument
    assert re.search(r"^ARG BASE\b", CONTAINERFILE.read_text(), re.M)
    words = " ".join(str(w) for w in [*svc.get("entrypoint", []), *svc["command"]])
    assert "pip" not in words and "tests." not in words and "tests/" not in words
    for vol in svc.get("volumes", []):
        assert vol.split(":")[0] not in (".", "./"), vol  # no source tree


def test_image_links_the_demo_data_where_compose_looks() -> None:
    text = CONTAINERFILE.read_text()
    link = re.search(r"ln -s .*/demo_data\"?\s*(?:\\\s*)?(/\S+?);", text)
    assert link and link.group(1) == IMAGE_DEMO, "the image no longer links demo_data there"
    assert "COPY proxy/ " in text  # the demo exporter ships in the image with the package


def test_exporter_command_is_the_demo_exporter() -> None:
    svc = _compose()["services"]["exporter"]
    assert svc["entrypoint"] == ["python", "-m", "proxy.demo_exporter"]
    args = build_exporter_parser().parse_args(_host_args(svc, {"--snapshot"}))
    assert args.serve == "0.0.0.0:9400"
    assert Path(args.snapshot) == REPO / "proxy/demo_data/snapshot.yaml"
    assert Path(args.snapshot).is_file()
    agent = yaml.safe_load((REPO / "config/compose/agent.yml").read_text())
    targets = {
        t for j in agent["scrape_configs"] for sc in j["static_configs"] for t in sc["targets"]
    }
    assert targets == {"exporter:9400"}


def test_proxy_flags_are_the_cli_flags() -> None:
    svc = _compose()["services"]["karta-proxy"]
    assert "entrypoint" not in svc  # the image's: karta-proxy
    assert re.search(r'^ENTRYPOINT \["karta-proxy"\]', CONTAINERFILE.read_text(), re.M)
    assert f"{IMAGE_DEMO}/snapshot.yaml" in svc["command"]
    ns = build_parser().parse_args(_host_args(svc, {"--snapshot", "--config"}))
    s = settings_from_args(ns, env={})  # SystemExit above on an unknown flag
    assert s.snapshot is not None and Path(s.snapshot) == REPO / "proxy/demo_data/snapshot.yaml"
    assert Path(s.snapshot).is_file()
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


def test_the_demo_doc_says_what_the_victoriametrics_profile_does() -> None:
    """docs/demo.md said the profile "adds VictoriaMetrics as a second TSDB"; nothing
    writes to it (karta-proxy has one upstream, the Prometheus TSDB). The doc says so now,
    and the URL it gives for switching is the profile's service and port."""
    services = _compose()["services"]
    vm = services["victoriametrics"]
    assert vm["profiles"] == ["victoriametrics"]
    port = next(a.rsplit(":", 1)[1] for a in vm["command"] if a.startswith("-httpListenAddr"))
    command = services["karta-proxy"]["command"]
    upstream = command[command.index("--upstream-url") + 1]
    assert "victoriametrics" not in upstream, "a writer to it: the doc below is then wrong"
    doc = " ".join((REPO / "docs" / "demo.md").read_text().split())
    assert "second TSDB" not in doc
    assert "nothing writes to it" in doc
    assert f"`http://victoriametrics:{port}/api/v1/write`" in doc
