"""The command line: flags, precedence over the config file, exit codes, and a real process
started with ``python -m proxy`` and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from msgspec import inspect as mi

from proxy.cli import build_parser, main, settings_from_args
from proxy.config import ConfigError, schema
from proxy.sender import Series, send_series
from tests.peers.conftest import free_port
from tests.process import stop
from tests.proxy_harness import CART, SNAPSHOT
from tests.scripted import Received, Reply, ScriptedUpstream

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_help_documents_every_flag() -> None:
    text = build_parser().format_help()
    for flag in ("--listen-address", "--upstream-url", "--snapshot", "--config", "--log-level",
                 "--snapshot-reload-seconds",
                 "--kubeconfig", "--namespace", "--node-name", "--description",
                 "--no-builtin-descriptions", "karta-proxy demo", "--tls-cert-file",
                 "--tls-key-file", "--tls-client-ca-file", "--tls-client-auth-type",
                 "/-/reload", "SIGHUP"):
        assert flag in text, flag


def test_help_names_every_route_the_app_serves() -> None:
    """The epilog's endpoint list left out /attribution, its JSON twins and PUT /-/reload:
    every path the assembled app routes, and each method of /-/reload, is in it (as in
    docs/operations.md's Endpoints table, held by tests/test_attribution_page.py too)."""
    from unittest import mock

    from proxy.index import PodIndex
    from proxy.server import build_app

    handler = mock.MagicMock(handle=mock.AsyncMock(), expect=mock.AsyncMock())
    app = build_app(handler, PodIndex(), mock.MagicMock(), reload=mock.AsyncMock())
    text = " ".join(build_parser().format_help().split())
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    for path in sorted(paths):
        if path.startswith("/insert/"):  # the tenant paths: their write path stands for all
            continue
        # the path itself, not a longer one it begins
        assert re.search(re.escape(path) + r"(?=[\s,;?(.]|$)", text), path
    assert "/insert/<tenant>/prometheus/api/v1/write" in text
    assert "POST or PUT /-/reload" in text
    assert "without authentication" in text


def test_help_names_every_key_a_reload_applies() -> None:
    """The epilog's list of what a reload applies left out the jq sandbox's limits, which a
    reload applies (proxy.reload.LIVE_KEYS, docs/configuration.md's Reload table): read as
    restart keys, an operator restarted for a change a SIGHUP makes."""
    from proxy.reload import LIVE_KEYS

    text = " ".join(build_parser().format_help().split())
    applies = text[text.index("Reload:"):text.index("Exit codes:")]
    for key in LIVE_KEYS:
        shown = key if "." in key or key == "log_level" else f"{key}.*"  # a section: key.*
        assert re.search(re.escape(shown) + r"(?=[\s,;.]|$)", applies), key


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "upstream.url: required"),
        (["--upstream-url", "ftp://x"], "upstream.url: expected an http"),
        (["--upstream-url", "http://x", "--listen-address", "nope"], "expected HOST:PORT"),
        (["--upstream-url", "http://x", "--snapshot", "/nonexistent"], "snapshot:"),
    ],
)
def test_invalid_settings_exit_2_with_one_line(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("karta-proxy: error: ") and fragment in err


def test_no_upstream_is_one_clear_line_and_exit_2() -> None:
    r = run_cli()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "karta-proxy: error: upstream.url: required: the TSDB's remote-write URL, e.g. "
        "--upstream-url http://prometheus:9090/api/v1/write"
    ]


def test_an_upstream_url_storing_another_cluster_is_one_line_and_exit_2(
        tmp_path: Path) -> None:
    """The start refuses, before anything listens, an upstream.url whose extra_label makes
    VictoriaMetrics store every series under another cluster than the proxy's: it relayed
    every request unstamped (other_cluster), found a request at a time. The line names
    the file both values came from, both values and what to change."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstream: {url: 'http://127.0.0.1:9/api/v1/write?extra_label=cluster=c2'}\n"
                   "facts: {external_labels: {cluster: c1}}\n")
    r = run_cli("--config", str(cfg))
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith(
        f"karta-proxy: error: {cfg}: upstream.url: its extra_label sets cluster=c2 on every "
        "series VictoriaMetrics stores through it, but this proxy's cluster is cluster=c1 "
        "(facts.external_labels.cluster, checked by enrich.cluster_label)"), line
    assert "make the extra_label cluster=c1 (or remove it)" in line


#: a credential the audit table puts where a message could quote it
SECRET = "s3cr3t-token-value"


#: (file name -> bytes, config YAML, the dotted key the line must name): bad settings the
#: error-message audit collected; ``{dir}`` is the test's folder
AUDIT_TABLE = [
    # credential files the client cannot send: a UnicodeDecodeError traceback and exit 1,
    # or a start that answered every request 502 naming neither file nor header
    ({"token": SECRET.encode() + b"\xff"},
     "upstream: {url: 'http://127.0.0.1:9/w', bearer_token_file: '{dir}/token'}\n",
     "upstream.bearer_token_file"),
    ({"token": f"{SECRET}\nanother\n".encode()},
     "upstream: {url: 'http://127.0.0.1:9/w', bearer_token_file: '{dir}/token'}\n",
     "upstream.bearer_token_file"),
    ({"pw": b"\xfe" + SECRET.encode()},
     "upstream: {url: 'http://127.0.0.1:9/w', basic_auth_username: u, "
     "basic_auth_password_file: '{dir}/pw'}\n",
     "upstream.basic_auth_password_file"),
    # a header value refused: it was quoted whole
    ({}, f"upstream: {{url: 'http://127.0.0.1:9/w', headers: {{Authorization: \"Bearer "
     f"{SECRET}\\r\\nX: y\"}}}}\n", "upstream.headers.Authorization"),
    ({}, "upstream: {url: 'http://127.0.0.1:9/w', headers: {X-Key: 313371234}}\n",
     "upstream.headers.X-Key"),
    # a URL's password: never shown
    ({}, f"upstream: {{url: 'http://u:{SECRET}@127.0.0.1:99999/w'}}\n", "upstream.url"),
    ({}, f"upstream: {{url: 'http://u:{SECRET}/x@127.0.0.1:9/w{{tenant'}}\n", "upstream.url"),
]


@pytest.mark.parametrize(("files", "yaml_text", "key"), AUDIT_TABLE)
def test_a_bad_setting_is_one_line_naming_its_key_exit_2_no_secret(
        tmp_path: Path, files: dict[str, bytes], yaml_text: str, key: str) -> None:
    """The audit's table in a real process: exit 2, one line on stderr naming the file and
    the dotted key, no traceback, and no credential in it."""
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text.replace("{dir}", str(tmp_path)))
    r = run_cli("--config", str(cfg), "--snapshot", str(REPO / "proxy/demo_data/snapshot.yaml"),
                "--listen-address", "127.0.0.1:0")
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"karta-proxy: error: {cfg}: {key}"), line
    assert SECRET not in line and "313371234" not in line, line


def test_a_message_quoting_a_line_break_is_still_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The line quotes what the operator gave (a path, a value): a line break in it made a
    second line, which a supervisor's log reads as a line of its own."""
    assert main(["--config", "/nonexistent\nkarta-proxy: error: forged"]) == 2
    err = capsys.readouterr().err
    assert err == ("karta-proxy: error: /nonexistent\\x0akarta-proxy: error: forged: cannot "
                   "read config file: No such file or directory\n"), err


def test_help_texts() -> None:
    r = run_cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: karta-proxy ")
    for section in ("serving:", "upstream:", "index source:", "descriptions:", "facts:",
                    "Exit codes:"):
        assert section in r.stdout, section
    r = run_cli("demo", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: karta-proxy demo ")
    assert "--snapshot" in r.stdout and "--series" in r.stdout


def test_unknown_config_key_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstream:\n  url: http://x\n  timeout: 3\n")
    r = run_cli("--config", str(cfg))
    assert r.returncode == 2
    assert "unknown key 'upstream.timeout'" in r.stderr and str(cfg) in r.stderr


def test_bad_flag_exits_2() -> None:
    r = run_cli("--log-level", "loud")
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.parametrize(("argv", "said"), [
    # a prefix was taken for the flag: --name watched the namespace "web" alone
    (["--name", "web"], "unrecognized arguments: --name web"),
    (["--upstream-time", "5"], "unrecognized arguments: --upstream-time 5"),
    (["--config", "a.yaml", "--config", "b.yaml"],
     "--config: given more than once (--config/--config.file); give it once"),
    (["--config", "a.yaml", "--config.file", "b.yaml"], "--config.file: given more than once"),
    (["--upstream-url", "http://a:1/", "--upstream-url", "http://b:1/"],
     "--upstream-url: given more than once (--upstream-url); give it once"),
    (["--log-level", "info", "--log-level", "debug"], "--log-level: given more than once"),
])
def test_a_flag_abbreviated_or_given_twice_is_refused(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took a prefix of a flag for it and kept the last of a flag given twice,
    silently; Prometheus' flags do neither. A repeatable flag (--namespace) repeats."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"karta-proxy: error: {said}")
    args = build_parser().parse_args(["--namespace", "a", "--namespace", "b"])
    assert getattr(args, "kube.namespaces") == ["a", "b"]


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "server: {listen_address: '127.0.0.1:1111'}\n"
        "upstream: {url: 'http://from-file:9090/api/v1/write', timeout_seconds: 7}\n"
        "karta: {description_paths: [/tmp]}\n"
        "kube: {namespaces: [a], node_name: file-node}\n"
    )
    args = build_parser().parse_args([
        "--config", str(cfg), "--upstream-url", "http://from-flag:9090/api/v1/write",
        "--namespace", "b", "--namespace", "c", "--description", str(tmp_path),
        "--no-builtin-descriptions", "--log-level", "debug",
    ])
    s = settings_from_args(args, env={"NODE_NAME": "env-node"})
    assert s.upstream.url == "http://from-flag:9090/api/v1/write"
    assert s.upstream.timeout_seconds == 7.0  # from the file
    assert s.server.listen_address == "127.0.0.1:1111"
    assert s.kube.namespaces == ["b", "c"]
    assert s.kube.node_name == "env-node"
    assert s.karta.description_paths == ["/tmp", str(tmp_path)]
    assert s.karta.builtins is False
    assert s.log_level == "debug"
    s = settings_from_args(build_parser().parse_args(
        ["--config", str(cfg), "--node-name", "flag-node"]), env={"NODE_NAME": "env-node"})
    assert s.kube.node_name == "flag-node"
    s = settings_from_args(build_parser().parse_args(["--config", str(cfg)]), env={})
    assert s.kube.node_name == "file-node"


def test_snapshot_reload_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstream: {url: 'http://x:1/api/v1/write'}\nsnapshot_reload_seconds: 5\n")
    s = settings_from_args(build_parser().parse_args(["--config", str(cfg)]), env={})
    assert s.snapshot_reload_seconds == 5.0
    s = settings_from_args(build_parser().parse_args(
        ["--config", str(cfg), "--snapshot-reload-seconds", "0"]), env={})
    assert s.snapshot_reload_seconds == 0.0
    assert settings_from_args(build_parser().parse_args(
        ["--upstream-url", "http://x:1"]), env={}).snapshot_reload_seconds == 30.0


def test_snapshot_reload_help_says_when_a_change_is_applied() -> None:
    """The flag said only "apply what changed", and an operator who saw a change land a
    whole interval late took it for a bug: a change waits one poll for the files to stop
    changing. ``--help``, the generated example and the flag table say so."""
    import re

    r = run_cli("--help")
    assert r.returncode == 0
    flag = r.stdout[r.stdout.index("--snapshot-reload-seconds SECONDS\n"):]
    flag = " ".join(flag[:flag.index("default 30.0)")].split())
    assert "a change is applied one poll after it is seen (two polls in a row must find " \
           "the files unchanged" in flag, flag
    example = (REPO / "config" / "karta-proxy.yaml").read_text()
    assert "# poll the snapshot's files this often and apply what changed: a change is " \
           "applied one poll\n# after it is seen" in example
    doc = (REPO / "docs" / "configuration.md").read_text()
    (row,) = re.findall(r"^\| `--snapshot-reload-seconds S` \|.*$", doc, re.M)
    assert "applied one poll after it is seen" in row, row


def test_tls_flags_set_the_server_keys(tmp_path: Path) -> None:
    from tests.tls_certs import Authority

    ca = Authority(tmp_path / "pki")
    pem = ca.issue("proxy", server=True)
    s = settings_from_args(build_parser().parse_args([
        "--upstream-url", "http://x:1", "--tls-cert-file", str(pem.cert),
        "--tls-key-file", str(pem.key), "--tls-client-ca-file", str(ca.ca_file),
        "--tls-client-auth-type", "VerifyClientCertIfGiven"]), env={})
    assert (s.server.tls_cert_file, s.server.tls_key_file, s.server.tls_client_ca_file,
            s.server.tls_client_auth_type) == (str(pem.cert), str(pem.key), str(ca.ca_file),
                                               "VerifyClientCertIfGiven")
    r = run_cli("--upstream-url", "http://x:1", "--tls-cert-file", str(pem.cert))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "karta-proxy: error: server.tls_cert_file and server.tls_key_file: set both or neither"]


def test_prometheus_flag_names_are_aliases(tmp_path: Path) -> None:
    """--web.listen-address and --config.file, as Prometheus and the exporters spell them."""
    cfg = tmp_path / "k.yaml"
    cfg.write_text("upstream: {url: 'http://tsdb:9090/api/v1/write'}\nlog_format: text\n")
    s = settings_from_args(build_parser().parse_args(
        ["--config.file", str(cfg), "--web.listen-address", "127.0.0.1:19091"]), env={})
    assert s.upstream.url == "http://tsdb:9090/api/v1/write" and s.log_format == "text"
    assert s.server.listen_address == "127.0.0.1:19091"
    same = settings_from_args(build_parser().parse_args(
        ["--config", str(cfg), "--listen-address", "127.0.0.1:19091"]), env={})
    assert same == s
    text = build_parser().format_help()
    assert "--web.listen-address" in text and "--config.file" in text


def test_log_format_flag_takes_auto() -> None:
    args = ["--upstream-url", "http://x:1"]
    assert settings_from_args(build_parser().parse_args(args), env={}).log_format == "auto"
    s = settings_from_args(build_parser().parse_args([*args, "--log-format", "json"]), env={})
    assert s.log_format == "json"


def test_validation_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        settings_from_args(build_parser().parse_args([]), env={})


def test_every_flag_comes_from_the_schema() -> None:
    """Names, choices and the key each flag sets are the declaration's, not a second list."""
    actions = {a.dest: a for a in build_parser()._actions}
    flagged = [i for i in schema() if i.flag is not None]
    assert {i.key for i in flagged} == set(actions) - {"help", "version", "config"}
    for info in flagged:
        assert info.flag is not None
        action = actions[info.key]
        assert tuple(action.option_strings) == info.flag.names, info.key
        assert info.key in (action.help or ""), info.key
        if isinstance(info.type, mi.LiteralType):
            assert tuple(action.choices or ()) == info.choices, info.key
    assert actions["server.tls_client_auth_type"].choices == (
        "NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


def test_flag_values_get_the_schema_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--upstream-url", "http://x:1", "--upstream-timeout", "0"]) == 2
    assert capsys.readouterr().err == (
        "karta-proxy: error: upstream.timeout_seconds: must be more than 0 and at most 600, "
        "got 0.0\n")


def test_kubeconfig_env_is_a_default_below_the_file(tmp_path: Path) -> None:
    """KUBECONFIG stands in for an absent --kubeconfig only where the file sets none either
    (NODE_NAME, by contrast, beats the file, as its flag would)."""
    a, b = tmp_path / "a.kubeconfig", tmp_path / "b.kubeconfig"
    a.write_text("{}")
    b.write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"upstream: {{url: 'http://x:1'}}\nkube: {{kubeconfig: '{a}'}}\n")
    env = {"KUBECONFIG": str(b)}
    assert settings_from_args(build_parser().parse_args(
        ["--upstream-url", "http://x:1"]), env=env).kube.kubeconfig == str(b)
    assert settings_from_args(build_parser().parse_args(
        ["--config", str(cfg)]), env=env).kube.kubeconfig == str(a)
    assert settings_from_args(build_parser().parse_args(
        ["--config", str(cfg), "--kubeconfig", str(b)]), env={}).kube.kubeconfig == str(b)


async def wait_for_200(session: aiohttp.ClientSession, url: str,
                       proc: asyncio.subprocess.Process, timeout: float = 20) -> None:
    """Poll ``url`` until it answers 200, while the process lives; bounded in time."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            async with session.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert asyncio.get_running_loop().time() < deadline, f"{url} never answered 200"
        assert proc.returncode is None, "the process ended"
        await asyncio.sleep(0.1)


async def _on_the_snapshot(tmp_path: Path, up: ScriptedUpstream
                           ) -> tuple[asyncio.subprocess.Process, int]:
    """The real process on the test snapshot, facts off, writing to ``up``: the process
    (its log on stderr) and its port."""
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--snapshot", str(snap), "--upstream-url", up.url,
        "--listen-address", f"127.0.0.1:{port}", "--no-facts", cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    return proc, port


async def test_process_serves_enriches_and_stops_on_sigterm(tmp_path: Path) -> None:
    async with ScriptedUpstream() as up:
        proc, port = await _on_the_snapshot(tmp_path, up)
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                await wait_for_200(session, base + "/-/ready", proc)
                labels = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
                status, _, _ = await send_series(base + "/api/v1/write",
                                                 [Series(labels, [(1000, 1.0)])], session=session)
                assert status == 204
        finally:
            log = await stop(proc)
    assert proc.returncode == 0
    from proxy.sender import decode_v1

    (got,) = decode_v1(up.received[0].raw)
    assert got.labels == {**labels, **CART}
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    msgs = [rec["msg"] for rec in lines]
    assert "karta-proxy started" in msgs and "karta-proxy stopped" in msgs
    assert all({"ts", "level", "logger", "msg"} <= rec.keys() for rec in lines)


#: a kind whose description's phase path doubles a string of the object 20 times (8 MiB)
#: and lists where its first 640,000 bytes occur in it: it loads (no name refused), and
#: costs libjq ~40 minutes (each of the 1,048,576 matches searched for anew), which held
#: the proxy's event loop (it never became ready)
HOSTILE_SNAPSHOT = SNAPSHOT + """\
---
apiVersion: example.com/v1
kind: Hostile
metadata: {name: h1, namespace: shop, uid: h-1}
spec: {s: abcdefgh, template: {}}
---
apiVersion: v1
kind: Pod
metadata:
  name: h1-0
  namespace: shop
  uid: p-h1
  ownerReferences:
  - {apiVersion: example.com/v1, kind: Hostile, name: h1, uid: h-1, controller: true}
spec: {nodeName: n1, containers: [{name: h, image: h:1}]}
status: {phase: Running}
"""
HOSTILE_KARTA = """\
apiVersion: run.ai/v1alpha1
kind: Karta
metadata: {name: hostile}
spec:
  structureDefinition:
    rootComponent:
      name: hostile
      kind: {group: example.com, version: v1, kind: Hostile}
      specDefinition: {podTemplateSpecPath: .spec.template}
      statusDefinition:
        phaseDefinition: {path: '.spec.s%s | . as $x | $x | indices($x[0:640000]) | length'}
        statusMappings: {running: [{byPhase: Running}]}
""" % (" | (.+.)" * 20)


def _samples(text: str, name: str) -> dict[str, float]:
    """The samples of one family on a /metrics page, by their label text."""
    return {m[1]: float(m[2]) for m in re.finditer(
        rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


async def test_a_hostile_description_costs_a_jq_error_not_the_process(
        tmp_path: Path) -> None:
    """The jq sandbox end to end: a description whose status path runs for minutes is
    stopped at the sandbox's time limit, not on the proxy's event loop (held there, the
    process never became ready): the proxy serves, its health answers, the error and the
    restart are counted, and the other workloads are still attributed."""
    snap = tmp_path / "snap.yaml"
    snap.write_text(HOSTILE_SNAPSHOT)
    desc = tmp_path / "hostile.yaml"
    desc.write_text(HOSTILE_KARTA)
    port = free_port()
    async with ScriptedUpstream() as up:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "--snapshot", str(snap), "--description", str(desc),
            "--upstream-url", up.url, "--listen-address", f"127.0.0.1:{port}", "--no-facts",
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                await wait_for_200(session, base + "/-/ready", proc, timeout=30)
                await wait_for_200(session, base + "/-/healthy", proc)
                cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
                hostile = {"__name__": "up", "namespace": "shop", "pod": "h1-0"}
                status, _, _ = await send_series(
                    base + "/api/v1/write", [Series(cart, [(1000, 1.0)]),
                                             Series(hostile, [(1000, 1.0)])], session=session)
                assert status == 204
                async with session.get(base + "/metrics") as r:
                    metrics = await r.text()
        finally:
            try:
                log = await stop(proc)
            except TimeoutError:  # held in libjq, deaf to SIGTERM: not left behind
                proc.kill()
                await proc.wait()
                raise
    assert proc.returncode == 0, log[-2000:]
    from proxy.sender import decode_v1

    got = {s.labels["pod"]: s.labels for s in decode_v1(up.received[0].raw)}
    assert got["cart-7d9f8-abcde"] == {**cart, **CART}
    assert got["h1-0"]["karta_workload"] == "h1"  # placed: only its phase is unknown
    errors = _samples(metrics, "karta_proxy_jq_errors_total")
    assert errors['{description="hostile",where="status"}'] >= 1  # named
    restarts = _samples(metrics, "karta_proxy_jq_sandbox_restarts_total")
    assert restarts['{reason="died"}'] + restarts['{reason="timeout"}'] >= 1
    assert restarts['{reason="start_failed"}'] == 0
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(rec["msg"].startswith(("the jq sandbox child died", "jq evaluation exceeded"))
               for rec in lines), log[-2000:]


def _start_failure(args: list[str], env: dict[str, str] | None = None
                   ) -> tuple[int, str, list[dict[str, object]]]:
    """Run the real process to its failed start: exit code, the plain lines, the log."""
    r = subprocess.run([sys.executable, "-m", "proxy", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=env)
    lines = r.stderr.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    plain = [line for line in lines if not line.startswith("{")]
    return r.returncode, "\n".join(plain), records


def _assert_reported(code: int, plain: str, records: list[dict[str, object]],
                     *fragments: str) -> None:
    assert code == 1
    assert plain.count("\n") == 0 and plain.startswith("karta-proxy: error: "), plain
    for fragment in fragments:
        assert fragment in plain, (fragment, plain)
    msgs = [rec["msg"] for rec in records]
    assert "listening" not in msgs and "karta-proxy started" not in msgs, msgs
    assert not any(rec["level"] == "error" for rec in records), records


def test_a_taken_port_is_one_line_and_exit_1(tmp_path: Path) -> None:
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, plain, records = _start_failure([
            "--snapshot", str(snap), "--upstream-url", "http://127.0.0.1:9/api/v1/write",
            "--no-facts", "--web.listen-address", f"127.0.0.1:{port}"])
    _assert_reported(code, plain, records, f"cannot listen on 127.0.0.1:{port}",
                     "another process holds the port", "--listen-address")


def test_an_unloadable_snapshot_is_one_line_and_exit_1(tmp_path: Path) -> None:
    snap = tmp_path / "snap.yaml"
    snap.write_text("kind: [unclosed\n  : : :\n")
    code, plain, records = _start_failure([
        "--snapshot", str(snap), "--upstream-url", "http://127.0.0.1:9/api/v1/write",
        "--no-facts", "--listen-address", f"127.0.0.1:{free_port()}"])
    _assert_reported(code, plain, records, f"snapshot {snap}", "nothing could be loaded",
                     "--snapshot")


def test_a_removed_setting_is_logged_in_the_log_format_with_its_key(tmp_path: Path) -> None:
    # read before logging is set up (the settings say how to log): it was printed as the
    # bare message by Python's last-resort handler, no key, no reason, not JSON
    snap = tmp_path / "snap.yaml"
    snap.write_text("kind: [unclosed\n  : : :\n")
    cfg = tmp_path / "karta.yaml"
    cfg.write_text("enrich:\n  cache_size: 5\n")
    code, plain, records = _start_failure([
        "--config", str(cfg), "--snapshot", str(snap), "--log-format", "json",
        "--upstream-url", "http://127.0.0.1:9/api/v1/write", "--no-facts",
        "--listen-address", f"127.0.0.1:{free_port()}"])
    _assert_reported(code, plain, records, "nothing could be loaded")
    (warning,) = [r for r in records if r["msg"] == "ignoring a removed setting"]
    assert warning["key"] == "enrich.cache_size" and warning["reason"]
    assert warning["level"] == "warning"


def test_no_cluster_to_watch_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """No kubeconfig, no service account, no ~/.kube/config: nothing to wait for."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    env["HOME"] = str(tmp_path)
    code, plain, records = _start_failure([
        "--upstream-url", "http://127.0.0.1:9/api/v1/write", "--no-facts",
        "--listen-address", f"127.0.0.1:{free_port()}"], env=env)
    _assert_reported(code, plain, records,
                     "no Kubernetes cluster to watch: no kubeconfig (--kubeconfig and "
                     "KUBECONFIG unset, no ~/.kube/config) and not in a pod "
                     "(KUBERNETES_SERVICE_HOST unset); set --kubeconfig", "--snapshot")
    # the client's default loader's words, of a file there is not
    assert "current-context" not in plain


def test_a_broken_kubeconfig_is_one_line_naming_the_file_and_exit_1(tmp_path: Path) -> None:
    """docs/operations.md promises one plain line: PyYAML's error made it three, the
    position on a line of its own."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("garbage: [\n")
    code, plain, records = _start_failure([
        "--upstream-url", "http://127.0.0.1:9/api/v1/write", "--no-facts",
        "--kubeconfig", str(kubeconfig), "--listen-address", f"127.0.0.1:{free_port()}"])
    _assert_reported(code, plain, records,
                     f"no Kubernetes cluster to watch: kubeconfig {kubeconfig}: invalid YAML: "
                     "line 2, column 1", "fix the file, or set --kubeconfig", "--snapshot")


def test_demo_subcommand() -> None:
    r = run_cli("demo", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "none lost, none added" in r.stdout


async def test_sigterm_while_waiting_for_the_cluster_exits_0(tmp_path: Path) -> None:
    """The API server never answers: the process serves /-/healthy, is not ready, and a
    SIGTERM still ends it cleanly (the start waits for the initial sync)."""
    from tests.kubesim import KubeSim

    sim = KubeSim()  # never started: connection refused
    kubeconfig = sim.write_kubeconfig(tmp_path / "kubeconfig")
    await sim.close()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
        "--upstream-url", "http://127.0.0.1:9/api/v1/write", "--no-facts",
        "--listen-address", f"127.0.0.1:{port}", "--log-level", "error", cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await wait_for_200(session, base + "/-/healthy", proc)
            async with session.get(base + "/-/ready") as r:
                assert r.status == 503
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0


def _catches_sighup(pid: int) -> bool:
    """The process has a handler of its own for SIGHUP (``SigCgt`` of /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGHUP - 1)))


async def test_a_sighup_while_starting_is_a_reload_not_the_end(tmp_path: Path) -> None:
    """A SIGHUP as soon as the process catches one, while it still imports its runtime
    and reads its settings: it reloads once started, and serves. Before the event loop's
    handler, SIGHUP's default action ended it (exit 129) for the first ~0.5-0.9 s."""
    async with ScriptedUpstream() as up:
        proc, port = await _on_the_snapshot(tmp_path, up)
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while not _catches_sighup(proc.pid):
                assert asyncio.get_running_loop().time() < deadline, "SIGHUP never caught"
                await asyncio.sleep(0.002)
            proc.send_signal(signal.SIGHUP)
            async with aiohttp.ClientSession() as session:
                await wait_for_200(session, f"http://127.0.0.1:{port}/-/ready", proc)
        finally:
            log = await stop(proc)
    assert proc.returncode == 0, log[-2000:]
    msgs = [json.loads(line)["msg"] for line in log.splitlines()
            if line.startswith("{")]
    assert msgs.count("SIGHUP received while starting: reloading") == 1, msgs
    assert "configuration reloaded" in msgs, msgs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_starting_exits_0(sig: signal.Signals) -> None:
    """A SIGTERM or SIGINT while the settings are read (before the event loop has its
    handlers) ends the process with 0, as the documented stop does: their default
    actions ended it with 143 and no line, or a KeyboardInterrupt traceback."""
    script = (
        "import os, signal, sys\n"
        "import proxy.cli as cli\n"
        "def read(args):\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    raise AssertionError('the signal did not stop the start')\n"
        "cli.settings_from_args = read\n"
        "sys.exit(cli.main(['--upstream-url', 'http://127.0.0.1:9/api/v1/write']))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr


def test_an_infinite_flag_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--upstream-url", "http://x:1", "--snapshot-reload-seconds", "inf"]) == 2
    assert capsys.readouterr().err == (
        "karta-proxy: error: snapshot_reload_seconds: must be a finite number, got inf\n")


def test_leader_election_with_a_snapshot_and_no_cluster_names_the_setting(
        tmp_path: Path) -> None:
    """The Lease needs a cluster even in snapshot mode: the line said "or use --snapshot",
    which was given."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    env["HOME"] = str(tmp_path)
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("facts: {leader_election: true}\n")
    code, plain, records = _start_failure([
        "--config", str(cfg), "--snapshot", str(snap),
        "--upstream-url", "http://127.0.0.1:9/api/v1/write",
        "--listen-address", f"127.0.0.1:{free_port()}"], env=env)
    _assert_reported(code, plain, records, "facts.leader_election needs a Kubernetes cluster",
                     "--kubeconfig", "facts.leader_election: false")
    assert "use --snapshot" not in plain


def test_log_level_flag_is_case_insensitive_as_in_the_file() -> None:
    args = build_parser().parse_args(["--upstream-url", "http://x:1", "--log-level", "INFO"])
    assert settings_from_args(args, env={}).log_level == "info"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # an unset variable in a manifest: the file silently skipped, the defaults run
        (["--config", ""], "--config: the path is empty"),
        # "" reads as every namespace: the whole cluster watched
        (["--namespace", ""], "--namespace: the value is empty"),
        (["--namespace", "a", "--namespace", ""], "--namespace: the value is empty"),
        # "" read as "not set" (the settings audit): a snapshot proxy watched the cluster
        # of ~/.kube/config, no upstream credentials were sent, and so on
        (["--snapshot", ""], "--snapshot: the value is empty; give one, or leave the flag "
         "out"),
        (["--upstream-bearer-token-file", ""], "--upstream-bearer-token-file: the value is "
         "empty"),
        (["--kubeconfig", ""], "--kubeconfig: the value is empty"),
        (["--node-name", ""], "--node-name: the value is empty"),
        (["--description", ""], "--description: the value is empty"),
        (["--tls-client-ca-file", ""], "--tls-client-ca-file: the value is empty"),
        (["--listen-address", ""], "--listen-address: the value is empty"),
        (["--web.listen-address", ""], "--listen-address: the value is empty"),
        (["--upstream-url", ""], "--upstream-url: the value is empty"),
        # a name no node has: ready, nothing attributed, nothing said
        (["--node-name", " "], "kube.node_name: ' ' has whitespace around it"),
        (["--node-name", "Node_1"], "kube.node_name: 'Node_1' is not a valid node name"),
        (["--namespace", "Bad_NS!"], "kube.namespaces[0]: 'Bad_NS!' is not a valid "
         "namespace"),
    ],
)
def test_empty_values_that_meant_something_else_exit_2(
        args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    # an upstream, unless the case gives its own: a flag given twice is refused first
    upstream = [] if "--upstream-url" in args else ["--upstream-url", "http://x:1"]
    assert main([*upstream, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"karta-proxy: error: {expected}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        # checks that run after the file is parsed (proxy.config.validate): only the
        # parse errors named the file
        ("upstream: {url: 'prometheus:9090/api/v1/write'}\n",
         "upstream.url: expected an http:// or https:// URL"),
        ("upstream: {url: 'http://x:1', default_tenant: abc}\n",
         "upstream.default_tenant: a VictoriaMetrics tenant"),
        ("upstream: {url: 'http://x:1'}\nserver: {max_inflight_bytes: 1000}\n",
         "server.max_inflight_bytes: must be at least server.max_body_bytes"),
        ("upstream: {url: 'http://x:1'}\nkube: {namespaces: ['']}\n",
         "kube.namespaces[0]: empty"),
        ("upstream: {url: 'http://x:1'}\nserver: {listen_address: 'localhost:99999'}\n",
         "server.listen_address: port 99999 out of range"),
        # node mode's facts without an election: every node's replica a writer
        ("upstream: {url: 'http://x:1'}\nkube: {node_name: n1}\n"
         "facts: {allow_in_node_mode: true}\n",
         "facts.allow_in_node_mode: true needs facts.leader_election: true"),
        # left at its default, which the file is where to set
        ("log_level: info\n", "upstream.url: required"),
    ],
)
def test_a_config_error_found_after_parsing_names_the_file(
        tmp_path: Path, yaml_text: str, expected: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "karta.yaml"
    cfg.write_text(yaml_text)
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    # the one-line format of a parse error: "FILE: key: what is wrong"
    assert err.startswith(f"karta-proxy: error: {cfg}: {expected}"), err
    assert err.count("\n") == 1, err


def test_a_config_error_names_the_file_in_the_real_process(tmp_path: Path) -> None:
    cfg = tmp_path / "karta.yaml"
    cfg.write_text("upstream:\n  url: http://x:1\n  default_tenant: abc\n")
    r = run_cli("--config", str(cfg))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"karta-proxy: error: {cfg}: upstream.default_tenant: a VictoriaMetrics tenant: "
        "accountID or accountID:projectID (numbers), got 'abc'"]


def test_a_config_error_of_a_flag_value_does_not_blame_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "karta.yaml"
    cfg.write_text("upstream: {url: 'http://x:1'}\n")
    assert main(["--config", str(cfg), "--listen-address", "localhost:99999"]) == 2
    assert capsys.readouterr().err == (
        "karta-proxy: error: server.listen_address: port 99999 out of range 0-65535\n")


def test_a_kubeconfig_from_the_environment_is_said_to_come_from_it(tmp_path: Path) -> None:
    """KUBECONFIG=/nonexistent was reported as the setting kube.kubeconfig, which nothing
    had set."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "nonexistent")}
    r = subprocess.run([sys.executable, "-m", "proxy", "--upstream-url", "http://x:1"],
                       cwd=REPO, capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"karta-proxy: error: kube.kubeconfig (from $KUBECONFIG): file "
        f"'{tmp_path / 'nonexistent'}' does not exist or is not readable"]
    cfg = tmp_path / "karta.yaml"
    cfg.write_text(f"upstream: {{url: 'http://x:1'}}\nkube: {{kubeconfig: '{tmp_path / 'no'}'}}\n")
    r = subprocess.run([sys.executable, "-m", "proxy", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2  # the file's setting wins over $KUBECONFIG, and is named so
    assert r.stderr.splitlines() == [
        f"karta-proxy: error: {cfg}: kube.kubeconfig: file '{tmp_path / 'no'}' does not "
        "exist or is not readable"]


def test_empty_tls_flags_do_not_switch_off_the_files_tls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The settings audit: --tls-cert-file "" --tls-key-file "" (a variable left unset in
    a manifest) over a file that sets both served plain HTTP, flags winning."""
    from tests.tls_certs import Authority

    pem = Authority(tmp_path / "pki").issue("proxy", server=True)
    cfg = tmp_path / "karta.yaml"
    cfg.write_text(f"upstream: {{url: 'http://x:1'}}\nserver: {{tls_cert_file: '{pem.cert}', "
                   f"tls_key_file: '{pem.key}'}}\n")
    assert settings_from_args(build_parser().parse_args(["--config", str(cfg)]),
                              env={}).server.tls_cert_file == str(pem.cert)
    assert main(["--config", str(cfg), "--tls-cert-file", "", "--tls-key-file", ""]) == 2
    assert capsys.readouterr().err == (
        "karta-proxy: error: --tls-cert-file: the value is empty; give one, or leave the "
        "flag out (to unset what the config file sets, edit the file)\n")


def test_an_empty_environment_variable_is_still_not_set() -> None:
    """NODE_NAME="" (an unset downward-API field, say) is no node filter, as KUBECONFIG=""
    is no kubeconfig for kubectl: only a flag's empty value is refused."""
    args = build_parser().parse_args(["--upstream-url", "http://x:1"])
    s = settings_from_args(args, env={"NODE_NAME": "", "KUBECONFIG": ""})
    assert (s.kube.node_name, s.kube.kubeconfig) == ("", "")


def test_a_node_name_from_the_environment_that_names_no_node_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--upstream-url", "http://x:1"])
    with pytest.raises(ConfigError, match=r"^kube\.node_name \(from \$NODE_NAME\): ' ' has "
                       "whitespace"):
        settings_from_args(args, env={"NODE_NAME": " "})


def test_choice_flags_take_any_case() -> None:
    args = build_parser().parse_args(["--upstream-url", "http://x:1", "--log-format", "JSON",
                                      "--upstream-protocol", "V1", "--tls-client-auth-type",
                                      "noclientcert"])
    assert (args.log_format, getattr(args, "upstream.protocol"),
            getattr(args, "server.tls_client_auth_type")) == ("json", "v1", "NoClientCert")


def test_a_label_limit_past_a_c_size_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The settings audit: 2**63 was taken, then the native plan's compile raised at start:
    a traceback and exit 1."""
    cfg = tmp_path / "karta.yaml"
    cfg.write_text(f"upstream: {{url: 'http://x:1', max_labels_per_series: {2**63}}}\n")
    r = run_cli("--config", str(cfg), "--snapshot", str(REPO / "proxy/demo_data/snapshot.yaml"),
                "--listen-address", f"127.0.0.1:{free_port()}")
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        f"karta-proxy: error: {cfg}: upstream.max_labels_per_series: must be 0 to 65536, got "
        f"{2**63}"])


def test_a_lease_kubeconfig_that_does_not_exist_exits_2_with_a_snapshot(
        tmp_path: Path) -> None:
    """docs/operations.md: a file a setting names that does not exist is exit 2; with
    --snapshot and facts.leader_election it was the start's failure, exit 1."""
    cfg = tmp_path / "karta.yaml"
    cfg.write_text("upstream: {url: 'http://x:1'}\nfacts: {leader_election: true}\n"
                   "kube: {kubeconfig: /nonexistent}\n")
    r = run_cli("--config", str(cfg), "--snapshot", str(REPO / "proxy/demo_data/snapshot.yaml"),
                "--listen-address", f"127.0.0.1:{free_port()}")
    assert (r.returncode, r.stderr.splitlines()) == (2, [
        f"karta-proxy: error: {cfg}: kube.kubeconfig: file '/nonexistent' does not exist or "
        "is not readable"])


def test_at_a_thread_limit_the_cannot_start_line_is_the_last_on_stderr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # at pids.max=1 the start failed with the plain line, and asyncio.run's shutdown of
    # its default pool (in a thread, which could not start either) added a traceback
    import threading

    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    # main() sets the root logger's handler up on this test's captured stderr, closed
    # after it: the handlers are put back, or every later test's log line is a
    # "Logging error" on stderr
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    try:
        code = main(["--snapshot", str(snap), "--upstream-url",
                     "http://127.0.0.1:9/api/v1/write", "--listen-address", "127.0.0.1:0",
                     "--no-facts", "--log-format", "json"])
    finally:
        monkeypatch.undo()
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1] == (
        "karta-proxy: error: cannot start: RuntimeError: can't start new thread"), err
    assert "Traceback" not in err


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare and root for a PID namespace")
def test_as_pid_1_a_sigterm_during_the_imports_stops_the_start(tmp_path: Path) -> None:
    # PID 1 gets no default signal actions: a SIGTERM before the CLI's handlers were set
    # was dropped, and the proxy started and ran on. The signal is sent by the process
    # itself right after importing the CLI (before main), which is as early as it gets
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    code = ("import os, signal, sys\n"
            "from proxy.cli import main\n"
            "assert os.getpid() == 1\n"
            "os.kill(1, signal.SIGTERM)\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code,
         "--snapshot", str(snap),
         "--upstream-url", "http://127.0.0.1:9/api/v1/write", "--listen-address",
         f"127.0.0.1:{free_port()}", "--no-facts"],
        cwd=REPO, capture_output=True, text=True, timeout=20,  # it ran on: TimeoutExpired
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "karta-proxy started" not in r.stderr


#: a credential of each kind the process below is given, none of which any answer, page,
#: reload answer or log line may show
SECRETS = {"url": "url-passw0rd", "token": "upstream-headers-key", "fact": "facts-headers-key",
           "sender": "senders-t0ken", "query": "query-api-k3y"}


def _echo_as(mode: list[int]) -> Callable[[Received], Reply]:
    """An upstream that answers ``mode[0]`` with the request's headers quoted in its body
    (an auth proxy's or a debug handler's "you sent: ...")."""
    def rule(rec: Received) -> Reply:
        return Reply(mode[0], body=b"you sent:\n" + "\n".join(
            f"{k}: {v}" for k, v in rec.headers.items()).encode())
    return rule


async def test_no_credential_shows_in_any_answer_page_or_log_line(tmp_path: Path) -> None:
    """The real process at debug level, a credential everywhere (upstream.url's userinfo
    and a query parameter's, upstream.headers, facts.headers, the senders'
    Authorization), driven through the paths that quote what they refuse: an upstream's
    refusals quoting the request, the start-up check's, malformed requests (a folded
    Authorization line, a credential header with a control character), a reload of a
    file whose headers are a list. The upstream was sent every credential; no answer,
    page or line of the log shows one."""
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    mode = [400]  # the start-up check's empty write is refused, its body logged
    async with ScriptedUpstream(rule=_echo_as(mode)) as up:
        settings: dict[str, Any] = {
            "snapshot": str(snap),
            "server": {"enable_lifecycle": True},
            "upstream": {"url": up.url.replace("//", f"//proxy:{SECRETS['url']}@")
                         + f"?api_key={SECRETS['query']}",
                         "headers": {"X-Api-Key": SECRETS["token"]}},
            "facts": {"headers": {"X-Fact-Key": SECRETS["fact"]}},
        }
        config = tmp_path / "karta-proxy.yaml"
        config.write_text(json.dumps(settings))
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "--config", str(config), "--listen-address",
            f"127.0.0.1:{port}", "--log-level", "debug", "--log-format", "json", cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        said: list[str] = []
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                await wait_for_200(s, base + "/-/ready", proc)
                cart = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
                for mode[0] in (500, 401, 400, 413):
                    said.append(str(await send_series(
                        base + "/api/v1/write", [Series(cart, [(1000, 1.0)])], session=s,
                        headers={"Authorization": f"Bearer {SECRETS['sender']}"})))
                for extra in (f"Authorization: Bearer\r\n {SECRETS['sender']}\r\n",
                              f"X-Auth-Token: {SECRETS['sender']}\x01\r\n"):
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                    w.write(f"POST /api/v1/write HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
                    said.append((await asyncio.wait_for(r.read(), 5)).decode("latin-1"))
                    w.close()
                config.write_text(json.dumps({**settings, "upstream": {
                    **settings["upstream"],
                    "headers": [f"X-Api-Key: {SECRETS['token']}"]}}))
                async with s.post(base + "/-/reload") as answer:
                    assert answer.status == 500
                    said.append(await answer.text())
                for page in ("/", "/metrics", "/attribution"):
                    async with s.get(base + page) as answer:
                        said.append(await answer.text())
        finally:
            log = await stop(proc)
    assert proc.returncode == 0, log[-2000:]
    basic = base64.b64encode(f"proxy:{SECRETS['url']}".encode()).decode()
    sent = [str(rec.headers) for rec in up.received + up.empty_writes]
    # each was sent (the senders' replaced by the proxy's own), and echoed
    assert all(any(v in h for h in sent) for v in (basic, SECRETS["token"], SECRETS["fact"]))
    assert all(rec.query == f"api_key={SECRETS['query']}" for rec in up.received)
    for text in [*said, log]:
        shown = [v for v in (*SECRETS.values(), basic) if v in text]
        assert not shown, (shown, text[:3000])
    assert "(credential not shown)" in log
