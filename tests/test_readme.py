"""The README works as written: its first two commands, the interpreter ``.ci/run`` picks,
and the no-cluster walkthrough, run line by line against the real Debian Prometheus. And
what every page of docs/ names exists: settings, metric families, ``karta-proxy`` flags."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from proxy import cli
from proxy.config import _REMOVED, schema
from proxy.demo import NEXT_QUERIES
from tests.peers.conftest import Peer, free_port, need, query, wait_until

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PYTHON_ENV = REPO / ".ci" / "python-env"
SETUP = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/karta-proxy demo"
TESTS = "bash .ci/run"
WALKTHROUGH = "### Without a cluster: the walkthrough"
#: the walkthrough's loopback ports, each replaced by a free one when the test runs it
PORTS = (9090, 9091, 9095, 9400)
SCRATCH = "/tmp/karta-walkthrough"
#: Prometheus' remote-write batching, a 5 s scrape interval, rule evaluation: well inside
WAIT_SECONDS = 90.0


@dataclass(frozen=True)
class Block:
    """A fenced code block of the README: its language and its lines."""

    lang: str
    lines: list[str]


def blocks(text: str) -> Iterator[Block]:
    for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.M | re.S):
        yield Block(m.group(1), [line.strip() for line in m.group(2).splitlines()])


def commands(block: Block) -> list[str]:
    """The commands of a shell block: comments and trailing ``# ...`` dropped."""
    out = []
    for line in block.lines:
        cmd = re.sub(r"\s+#.*$", "", line).strip()
        if cmd and not cmd.startswith("#"):
            out.append(cmd)
    return out


def section(title: str) -> list[Block]:
    text = README.read_text()
    start = text.index(title + "\n")
    end = text.find("\n## ", start)
    return list(blocks(text[start : end if end > 0 else len(text)]))


# -- the first two commands --------------------------------------------------------------------


def test_readme_starts_with_the_set_up_and_the_test_command() -> None:
    first = next(blocks(README.read_text()))
    assert first.lang == "sh"
    assert commands(first) == [SETUP, TESTS]
    assert README.read_text().index("```") < README.read_text().index("\n## ")  # at the top


def test_set_up_makes_the_virtualenv_before_any_pip() -> None:
    """A stock Debian python3 refuses ``pip install`` (externally-managed-environment): the
    set-up never calls the system pip, only the virtualenv's, after making it."""
    steps = [shlex.split(s) for s in SETUP.split("&&")]
    assert steps[0][:3] == ["python3", "-m", "venv"]
    venv = steps[0][3]
    for step in steps[1:]:
        assert step[0].startswith(venv + "/bin/"), step
    assert not re.search(r"(^|\s)(pip3?|python3 -m pip)\s", SETUP)
    # what the user types next is said
    assert f". {venv}/bin/activate" in README.read_text()


def test_ci_run_installs_and_runs_with_the_chosen_interpreter() -> None:
    text = (REPO / ".ci" / "run").read_text()
    assert 'PY=$(bash .ci/python-env)' in text
    body = text[text.index("PY=$(bash .ci/python-env)") :]
    for step in ("-m pip install", "-m ruff check .", "-m mypy proxy tests benchmarks",
                 "-m pytest -q"):
        assert f'"$PY" {step}' in body, step
    assert not re.search(r"^python3 -m", text, re.M)  # nothing bypasses the choice


def _python_env(tmp: Path, python: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHON": python, "KARTA_VENV": str(tmp / "venv")}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(["bash", str(PYTHON_ENV)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


def _interpreter(python: str) -> str:
    out = subprocess.run([python, "-c", "import sys; print(sys.executable)"],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


def test_python_env_keeps_a_running_virtualenv(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "ci")],
                   check=True, timeout=60)
    python = str(tmp_path / "ci" / "bin" / "python")
    got, _ = _python_env(tmp_path, python)
    assert got == _interpreter(python)
    assert not (tmp_path / "venv").exists()  # in a virtualenv, nothing else is made


def test_python_env_keeps_a_python_whose_pip_takes_installs(tmp_path: Path) -> None:
    if sys.prefix != sys.base_prefix:
        pytest.skip("the tests run in a virtualenv: no system python of theirs to look at")
    if (Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists():
        pytest.skip("this python3 is externally managed")
    got, _ = _python_env(tmp_path, sys.executable)
    assert got == _interpreter(sys.executable)
    assert not (tmp_path / "venv").exists()


def _refusing_pythons(tmp: Path) -> Iterator[tuple[str, str]]:
    """Interpreters whose pip refuses: Debian's (the PEP 668 marker), and one whose
    ``-m pip`` fails (no python3-pip), made by wrapping this one."""
    debian = Path("/usr/bin/python3")
    stdlib = subprocess.run(
        [str(debian), "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True, text=True, timeout=30,
    ).stdout.strip() if debian.exists() else ""
    if stdlib and (Path(stdlib) / "EXTERNALLY-MANAGED").exists():
        yield "externally-managed", str(debian)
    base = Path(sys.base_prefix) / "bin" / "python3"
    wrapper = tmp / "no-pip-python3"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "No module named pip" >&2; exit 1; fi\n'
        f'exec {shlex.quote(str(base))} "$@"\n'
    )
    wrapper.chmod(0o755)
    yield "no-pip", str(wrapper)


def test_python_env_makes_and_reuses_a_virtualenv_when_pip_refuses(tmp_path: Path) -> None:
    cases = list(_refusing_pythons(tmp_path))
    assert cases  # at least the wrapper
    for name, python in cases:
        case = tmp_path / name
        case.mkdir()
        got, err = _python_env(case, python)
        assert got == str(case / "venv" / "bin" / "python"), (name, err)
        assert "creating the virtualenv" in err
        pip = subprocess.run([got, "-m", "pip", "--version"], capture_output=True, text=True,
                             timeout=60)
        assert pip.returncode == 0 and str(case / "venv") in pip.stdout, (name, pip)
        again, err = _python_env(case, python)  # the second run reuses it
        assert again == got and "creating" not in err, (name, err)


# -- the walkthrough ---------------------------------------------------------------------------


def test_walkthrough_names_files_that_exist() -> None:
    sh = next(b for b in section(WALKTHROUGH) if b.lang == "sh")
    for cmd in commands(sh):
        for word in shlex.split(cmd):
            value = word.split("=", 1)[-1]
            if value.startswith(("config/", "proxy/")):
                assert (REPO / value).is_file(), value
    text = " ".join(commands(sh))
    assert "--web.enable-remote-write-receiver" in text
    assert "--snapshot proxy/demo_data/snapshot.yaml" in text


def test_walkthrough_agent_config_is_the_shipped_one() -> None:
    shown = [b for b in section(WALKTHROUGH) if b.lang == "yaml"]
    assert shown, "the README shows the agent's remote_write block"
    agent = yaml.safe_load((REPO / "config/walkthrough/agent.yml").read_text())
    assert yaml.safe_load("\n".join(shown[0].lines)) == {"remote_write": agent["remote_write"]}


def test_walkthrough_queries_are_the_ones_the_demo_ends_with() -> None:
    promql = [q for b in section(WALKTHROUGH) if b.lang == "promql" for q in b.lines if q]
    assert promql == list(NEXT_QUERIES)


def _substitute(text: str, ports: dict[int, int], scratch: Path) -> str:
    for old, new in ports.items():
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    return text.replace(SCRATCH, str(scratch))


def _quicker(config: str, interval: str, shorter: str) -> str:
    """A walkthrough config with a shorter interval: the agent's scrapes (5 s), the
    TSDB's rule evaluations (15 s) and its scrape of the proxy (Prometheus' default, 1 m)
    every second, so the walk waits seconds for what the user waits half a minute for.
    The interval is as shipped, or the test says so."""
    assert config.count(interval) == 1, (interval, config)
    return config.replace(interval, shorter)


def _argv(cmd: str, agent_config: Path, tsdb_config: Path) -> list[str]:
    """A README line as argv: the binaries of this machine, the port-substituted agent
    and TSDB configs; every other word as written."""
    words = shlex.split(cmd)
    if words[0] == "prometheus":
        words[0] = need("prometheus")
    elif words[0] == "karta-proxy":  # the same command line as the console script
        words[:1] = [sys.executable, "-m", "proxy"]
    elif words[0] == "python3":
        words[0] = sys.executable
    return [w.replace("config/walkthrough/agent.yml", str(agent_config))
            .replace("config/walkthrough/tsdb.yml", str(tsdb_config)) for w in words]


def _ready_path(argv: list[str]) -> tuple[str, str]:
    """The address a walkthrough process serves on, and its readiness path."""
    joined = " ".join(argv)
    m = re.search(r"(?:--web\.listen-address=|--listen-address |--serve )127\.0\.0\.1:(\d+)",
                  joined)
    assert m, joined
    path = "/metrics" if "proxy.demo_exporter" in joined else "/-/ready"
    return f"http://127.0.0.1:{m.group(1)}", path


@pytest.mark.peers
async def test_walkthrough_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need("prometheus")
    monkeypatch.chdir(REPO)  # "from the repository root"
    blocks_ = section(WALKTHROUGH)
    sh = next(b for b in blocks_ if b.lang == "sh")
    promql = [q for b in blocks_ if b.lang == "promql" for q in b.lines if q]
    assert len(commands(sh)) == 4 and len(promql) >= 3
    ports = {p: free_port() for p in PORTS}
    agent_config = tmp_path / "agent.yml"
    agent_config.write_text(_quicker(
        _substitute((REPO / "config/walkthrough/agent.yml").read_text(), ports, tmp_path),
        "  scrape_interval: 5s\n", "  scrape_interval: 1s\n"))
    tsdb_config = tmp_path / "tsdb.yml"  # its rules found where the shipped file finds them
    tsdb_config.write_text(_quicker(
        _substitute((REPO / "config/walkthrough/tsdb.yml").read_text(), ports, tmp_path)
        .replace("../rules/", str(REPO / "config/rules") + "/"),
        "  evaluation_interval: 15s\n", "  evaluation_interval: 1s\n  scrape_interval: 1s\n"))
    started: list[Peer] = []
    try:
        for i, cmd in enumerate(commands(sh)):
            argv = _argv(_substitute(cmd, ports, tmp_path), agent_config, tsdb_config)
            base, ready = _ready_path(argv)
            peer = Peer(f"step{i + 1}", argv, tmp_path / f"step{i + 1}.log", base, ready)
            peer.start()
            started.append(peer)
            await peer.wait_ready(timeout=30)
        tsdb = f"http://127.0.0.1:{ports[9090]}"
        deadline = time.monotonic() + WAIT_SECONDS
        for q in promql:
            async def answered(q: str = q) -> bool:
                rows = await query(tsdb, q)
                # the idle GPU and the undescribed MPIJob's pod are a row without one
                return any(r["metric"].get("karta_workload") for r in rows)

            left = max(1.0, deadline - time.monotonic())
            try:
                await wait_until(answered, timeout=left, what=q, interval=1.0)
            except AssertionError as e:
                logs = "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in started)
                raise AssertionError(f"{e}\n{logs}") from None
        gpu = {r["metric"].get("karta_workload"): float(r["value"][1])
               for r in await query(tsdb, promql[0])}
        assert {"pretrain", "llm-finetune"} <= gpu.keys()
        # a utilisation in percent (the mean over a workload's GPUs, as the demo's summary
        # says it), not the sum of its GPUs' (pretrain's three read 214)
        assert all(0 <= v <= 100 for v in gpu.values()), gpu

        async def facts_written() -> bool:
            return bool(await query(tsdb, "karta_workload_info"))

        await wait_until(facts_written, timeout=max(1.0, deadline - time.monotonic()),
                         what="the facts", interval=1.0)
        # the facts carry the enriched series' cluster: a join on it (the shipped age rule,
        # the advice of docs/metrics.md) finds its rows
        clusters = {r["metric"].get("cluster")
                    for q in ("karta_workload_info", "DCGM_FI_DEV_GPU_UTIL")
                    for r in await query(tsdb, q)}
        assert clusters == {"walkthrough"}, clusters

        async def proxy_scraped() -> bool:
            # the karta-proxy dashboard's series (its "All" is the proxies' jobs); the
            # facts on /metrics are dropped from the scrape, the written copy stays alone
            return bool(await query(tsdb, 'karta_proxy_series_total{job="karta-proxy"}'))

        await wait_until(proxy_scraped, timeout=max(1.0, deadline - time.monotonic()),
                         what="karta-proxy's /metrics scraped", interval=1.0)
        assert not await query(tsdb, 'karta_workload_info{job="karta-proxy"}')
    finally:
        for peer in reversed(started):
            await peer.astop()


# -- what the docs name exists ----------------------------------------------------------------

DOCS = [*sorted((REPO / "docs").rglob("*.md")), README]
#: a dotted settings key as the docs write it (``server.max_body_bytes``,
#: ``upstream.basic_auth_*``, ``facts.external_labels.cluster``, ``snapshot_reload_seconds``
#: misspelt as a section's), not in a path (``docs/karta.md``)
SETTING = re.compile(r"(?<![\w./-])((?:server|upstream|enrich|karta|kube|facts|snapshot)\."
                     r"[a-z][a-z0-9_]*\*?(?:\.[A-Za-z][\w-]*)?)(?![\w/-])")
#: the metric families the docs name: the proxy's own, the sources'
FAMILY = re.compile(r"(?<!\w)(karta_(?:proxy|source)_[a-z0-9_]*[a-z0-9])(?![\w*])")
#: families the docs name as gone (docs/metrics.md, Changes)
GONE_FAMILIES = {"karta_proxy_build_info"}


def _code_spans(text: str) -> list[str]:
    """The inline code of a Markdown page, its fenced blocks left out."""
    return re.findall(r"`([^`]+)`", re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S))


def _is_module_name(dotted: str) -> bool:
    """``kube.client``, ``upstream.histograms_disabled``: a module of the project, or a name
    in one, as the docs name code (not a setting)."""
    for name in (f"proxy.{dotted}", f"proxy.{dotted.rsplit('.', 1)[0]}"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return name == f"proxy.{dotted}" or hasattr(module, dotted.rsplit(".", 1)[1])
    return False


def test_every_setting_the_docs_name_exists() -> None:
    """A user sets what the docs name: each ``section.key`` in their code spans is a key of
    proxy/config.py (an entry of a dict setting, a ``*`` family of keys, or a removed key the
    docs say is removed), unless it names a file or the project's code (``kube.client``).
    operations.md named ``snapshot.reload_seconds``, which no file or flag takes (the key
    is the top-level ``snapshot_reload_seconds``)."""
    infos = schema()
    keys = {i.key for i in infos}
    dicts = {i.key for i in infos if isinstance(i.default, dict)}

    def exists(key: str) -> bool:
        # a section within a section (``upstream.oauth2``) is named as a key is
        return (key in keys or key in _REMOVED or any(key.startswith(d + ".") for d in dicts)
                or any(k.startswith(key + ".") for k in keys)
                or (key.endswith("*") and any(k.startswith(key[:-1]) for k in keys)))

    def not_a_setting(key: str) -> bool:
        return key.rsplit(".", 1)[1] in ("md", "py", "yaml", "yml", "json") or _is_module_name(key)

    wrong = [f"{page.relative_to(REPO)}: {key}" for page in DOCS
             for span in _code_spans(page.read_text()) for key in SETTING.findall(span)
             if not exists(key) and not not_a_setting(key)]
    assert not wrong, wrong


def test_every_metric_family_the_docs_name_has_a_row() -> None:
    """A family a page names is one an operator can look up: it has a row in a metric table
    (operations.md, metrics.md, kubernetes.md), which tests/test_runtime.py holds to what
    /metrics serves; or the docs name it as gone."""
    rows: set[str] = set()
    for page in ("operations.md", "metrics.md", "kubernetes.md"):
        rows |= set(re.findall(r"^\| `(karta_[a-z0-9_]+)`", (REPO / "docs" / page).read_text(),
                               re.M))
    named = {(page.relative_to(REPO), n) for page in DOCS
             for n in FAMILY.findall(page.read_text())}
    # a counter named as its family (prometheus_client's name, without _total) counts too
    missing = sorted(f"{page}: {n}" for page, n in named
                     if n not in rows and n + "_total" not in rows and n not in GONE_FAMILIES)
    assert not missing, missing


def _command_lines(text: str) -> Iterator[list[str]]:
    """The ``karta-proxy`` command lines of a page's shell blocks (continuations joined;
    each command of a ``&&`` chain; the image's arguments in ``docker run IMAGE ...``), as
    the arguments after ``karta-proxy``."""
    for block in blocks(text):
        if block.lang not in ("sh", "bash"):
            continue
        joined = re.sub(r"\\\n\s*", " ", "\n".join(block.lines))
        for line in joined.splitlines():
            for cmd in re.sub(r"\s+#.*$", "", line).split(" && "):
                if "karta-proxy" not in cmd or "[" in cmd or "$(" in cmd:  # a usage line
                    continue
                words = shlex.split(cmd)
                for i, word in enumerate(words):
                    if word == "karta-proxy" or word.endswith("/karta-proxy") or (
                            words[:2] in (["docker", "run"], ["podman", "run"])
                            and word.startswith("karta-proxy:")):
                        yield words[i + 1:]
                        break


def test_every_karta_proxy_command_line_of_the_docs_parses() -> None:
    """Each ``karta-proxy ...`` line a page shows is one the command line takes: its flags
    exist (no abbreviations), its values are of the flag's kind."""
    lines = [(page, argv) for page in DOCS for argv in _command_lines(page.read_text())]
    assert (README, ["demo"]) in lines and any(page.name == "deploy.md" for page, _ in lines)
    for page, argv in lines:
        try:
            if argv[:1] == ["demo"]:
                cli.build_demo_parser().parse_args(argv[1:])
            else:
                cli.build_parser().parse_args(argv)
        except SystemExit as e:  # --version exits 0
            if e.code != 0:
                pytest.fail(f"{page.relative_to(REPO)}: karta-proxy {shlex.join(argv)}")
