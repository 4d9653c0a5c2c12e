"""Real remote-write peers on 127.0.0.1: Prometheus 2.42 (agent sender, receiver),
VictoriaMetrics, vmagent; the fixture exporter; karta-proxy in-process on the demo snapshot.

Every peer runs on a free port, logs to a file in the test's tmp dir, is stopped by its PID
(SIGTERM, then SIGKILL after a deadline), and is skipped cleanly when its binary is absent.
Every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.config import Settings
from proxy.demo_exporter import DEMO_SNAPSHOT, FixtureExporter
from proxy.runtime import Proxy

#: the repository: ``python -m proxy`` run there imports this tree's proxy
REPO = Path(__file__).resolve().parents[2]
#: the pod the DCGM exporter target is labelled with (a pod of the demo's DaemonSet)
DCGM_TARGET_NAMESPACE = "gpu-monitoring"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.peers)


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not installed (Debian packages: prometheus, victoria-metrics, "
                    "tinyproxy, microsocks, stunnel4)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(
    check: Callable[[], Awaitable[bool]], *, timeout: float, what: str, interval: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await check():
                return
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Peer:
    """One peer process, stopped by its PID."""

    name: str
    argv: list[str]
    log_path: Path
    base_url: str
    ready_path: str
    proc: subprocess.Popen[bytes] | None = None
    #: the directory it runs in (None: this process's)
    cwd: Path | None = None

    @property
    def port(self) -> int:
        """The port it listens on (``base_url``'s), for what connects below HTTP."""
        return int(self.base_url.rsplit(":", 1)[1])

    def start(self) -> None:
        """Start the process (again, after :meth:`stop`: a restart on the same port)."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.cwd)
        log.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        async def ok() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {self.log_tail()}")
            async with aiohttp.ClientSession() as s, s.get(
                self.base_url + self.ready_path, timeout=aiohttp.ClientTimeout(total=2)
            ) as r:
                return r.status == 200

        try:
            await wait_until(ok, timeout=timeout, what=f"{self.name} ready")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log_tail()}") from None

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        return proc.returncode

    async def astop(self, timeout: float = 20.0) -> int | None:
        return await asyncio.to_thread(self.stop, timeout)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Peers:
    """Factory of peers for one test; everything it started is stopped at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Peer] = []

    def _peer(self, name: str, argv: list[str], port: int, ready_path: str,
              cwd: Path | None = None) -> Peer:
        p = Peer(name, argv, self.tmp / f"{name}.log", f"http://127.0.0.1:{port}", ready_path,
                 cwd=cwd)
        p.start()
        self.started.append(p)
        return p

    def _dir(self, name: str) -> Path:
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        return d

    async def prometheus_receiver(
        self, name: str = "prom-receiver", *, rule_files: Sequence[Path] = (),
        evaluation_interval: str = "1m", extra: Sequence[str] = (),
        scrape_configs: Sequence[dict[str, Any]] = (),
        history: str = "",
    ) -> Peer:
        """A receiving Prometheus; ``rule_files`` are evaluated every ``evaluation_interval``
        over what is written into it (the shipped recording rules, for the dashboards);
        ``extra``: more flags (``--enable-feature=native-histograms``); ``scrape_configs``:
        what it scrapes besides (a proxy's /metrics, for the alerts that read it);
        ``history``: OpenMetrics text (timestamps in the past) put into its TSDB before it
        starts, with ``promtool tsdb create-blocks-from openmetrics``, for the rules that
        compare with hours ago."""
        binary = need("prometheus")
        port = free_port()
        if history:
            source = self.tmp / f"{name}-history.om"
            source.write_text(history)
            subprocess.run([need("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                            str(source), str(self._dir(name))],
                           check=True, capture_output=True, timeout=60)
        cfg = self.tmp / f"{name}.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1m", "evaluation_interval": evaluation_interval},
            "rule_files": [str(f) for f in rule_files],
            "scrape_configs": list(scrape_configs),
        }))
        p = self._peer(name, [
            binary, f"--config.file={cfg}", f"--storage.tsdb.path={self._dir(name)}",
            f"--web.listen-address=127.0.0.1:{port}", "--web.enable-remote-write-receiver",
            "--log.level=warn", *extra,
        ], port, "/-/ready")
        await p.wait_ready()
        return p

    async def prometheus_agent(self, config: dict[str, Any], name: str = "prom-agent",
                               features: Sequence[str] = ()) -> Peer:
        """A Prometheus in agent mode; ``features``: more ``--enable-feature`` names
        (``native-histograms``: scrapes ask for protobuf and keep native histograms)."""
        binary = need("prometheus")
        port = free_port()
        cfg = self.tmp / f"{name}.yml"
        cfg.write_text(yaml.safe_dump(config))
        p = self._peer(name, [
            binary, f"--enable-feature={','.join(('agent', *features))}", f"--config.file={cfg}",
            f"--storage.agent.path={self._dir(name)}", f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ], port, "/-/ready")
        await p.wait_ready()
        return p

    async def victoria_metrics(self, name: str = "vm", port: int | None = None,
                               extra: Sequence[str] = ()) -> Peer:
        binary = need("victoria-metrics")
        port = port or free_port()
        p = self._peer(name, [
            binary, f"-httpListenAddr=127.0.0.1:{port}", f"-storageDataPath={self._dir(name)}",
            "-search.latencyOffset=0s", "-search.disableCache", "-retentionPeriod=100y",
            "-loggerLevel=WARN", *extra,
        ], port, "/health")
        await p.wait_ready()
        return p

    async def vmagent(self, scrape_config: dict[str, Any], remote_write_url: str,
                      extra: Sequence[str] = (), name: str = "vmagent") -> Peer:
        binary = need("vmagent")
        port = free_port()
        cfg = self.tmp / f"{name}.yml"
        cfg.write_text(yaml.safe_dump(scrape_config))
        p = self._peer(name, [
            binary, f"-promscrape.config={cfg}", f"-remoteWrite.url={remote_write_url}",
            f"-remoteWrite.tmpDataPath={self._dir(name)}", f"-httpListenAddr=127.0.0.1:{port}",
            "-remoteWrite.flushInterval=500ms", "-loggerLevel=WARN", *extra,
        ], port, "/health")
        await p.wait_ready()
        return p

    async def karta_proxy(self, name: str, port: int, args: Sequence[str]) -> Peer:
        """karta-proxy as a process of its own (``python -m proxy``, this tree's) on
        ``port``: for what acts on a process (a restart, a resource limit), which the
        proxies in this process cannot stand for."""
        p = self._peer(name, [
            sys.executable, "-m", "proxy", "--listen-address", f"127.0.0.1:{port}", *args,
        ], port, "/-/ready", cwd=REPO)
        await p.wait_ready()
        return p

    async def tinyproxy(self, name: str = "tinyproxy", *,
                        basic_auth: tuple[str, str] | None = None) -> Peer:
        """An HTTP proxy (Debian's tinyproxy) on 127.0.0.1, admitting 127.0.0.1 only,
        ``CONNECT`` to any port; ``basic_auth`` (user, password) makes it ask for them
        (407). Its log (``log_tail``) has a line per request it relayed."""
        binary = need("tinyproxy")
        port = free_port()
        conf = self.tmp / f"{name}.conf"
        conf.write_text("\n".join([
            f"Port {port}", "Listen 127.0.0.1", "Allow 127.0.0.1", "Timeout 30",
            "MaxClients 32", "LogLevel Connect",
            *([f"BasicAuth {basic_auth[0]} {basic_auth[1]}"] if basic_auth else []), ""]))
        # -d: in the foreground, its log on stderr
        p = self._peer(name, [binary, "-d", "-c", str(conf)], port, "")
        await _listening(p)
        return p

    async def stunnel(self, forward_to: int, cert: Path, key: Path,
                      name: str = "stunnel") -> Peer:
        """TLS on 127.0.0.1 in front of ``forward_to`` (Debian's stunnel4, with ``cert``
        and ``key``): an HTTPS proxy, put before tinyproxy."""
        binary = need("stunnel4")
        port = free_port()
        conf = self.tmp / f"{name}.conf"
        conf.write_text("\n".join([
            "foreground = yes", f"pid = {self.tmp / (name + '.pid')}", "debug = 4",
            f"[{name}]", f"accept = 127.0.0.1:{port}", f"connect = 127.0.0.1:{forward_to}",
            f"cert = {cert}", f"key = {key}", ""]))
        p = self._peer(name, [binary, str(conf)], port, "")
        await _listening(p)
        return p

    async def microsocks(self, name: str = "microsocks", *,
                         login: tuple[str, str] | None = None) -> Peer:
        """A SOCKS5 proxy (Debian's microsocks) on 127.0.0.1; ``login`` (user, password)
        makes it ask for them (RFC 1929). Its log (``log_tail``) has a line per
        connection it made, naming the host it was asked for."""
        binary = need("microsocks")
        port = free_port()
        argv = [binary, "-i", "127.0.0.1", "-p", str(port)]
        if login is not None:
            argv += ["-u", login[0], "-P", login[1]]
        p = self._peer(name, argv, port, "")
        await _listening(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            p.stop()


async def _listening(p: Peer) -> None:
    """Until ``p`` (a peer with no HTTP endpoint) takes a TCP connection on its port."""
    async def listening() -> bool:
        assert p.proc is not None
        if p.proc.poll() is not None:
            raise AssertionError(f"{p.name} exited: {p.log_tail()}")
        _, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.close()
        await writer.wait_closed()
        return True

    await wait_until(listening, timeout=10, what=f"{p.name} listening")


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Peers]:
    ps = Peers(tmp_path)
    try:
        yield ps
    finally:
        ps.stop_all()


@pytest.fixture
async def exporter() -> AsyncIterator[FixtureExporter]:
    async with FixtureExporter(DEMO_SNAPSHOT) as exp:
        yield exp


def dcgm_target_pod(exp: FixtureExporter) -> str:
    pods = [p.name for p in exp.model.pods if p.namespace == DCGM_TARGET_NAMESPACE]
    assert pods, "the demo snapshot has a dcgm-exporter DaemonSet"
    return sorted(pods)[0]


def scrape_configs(exp: FixtureExporter, interval: str = "1s") -> list[dict[str, Any]]:
    """cAdvisor, kubelet resource and DCGM jobs against the fixture exporter.

    The DCGM target carries the exporter pod's own ``namespace``/``pod`` target labels and
    ``honor_labels: false``, so the GPU's pod arrives as ``exported_namespace``/``exported_pod``
    exactly as in a cluster.
    """
    target = exp.url.removeprefix("http://")
    common = {"scrape_interval": interval, "scrape_timeout": interval}
    return [
        {"job_name": "cadvisor", "metrics_path": "/metrics/cadvisor",
         "static_configs": [{"targets": [target]}], **common},
        {"job_name": "kubelet-resource", "metrics_path": "/metrics/resource",
         "static_configs": [{"targets": [target]}], **common},
        {"job_name": "dcgm", "metrics_path": "/metrics", "honor_labels": False,
         "static_configs": [{"targets": [target], "labels": {
             "namespace": DCGM_TARGET_NAMESPACE, "pod": dcgm_target_pod(exp)}}], **common},
    ]


def remote_write(url: str) -> dict[str, Any]:
    return {"url": url, "queue_config": {"batch_send_deadline": "500ms", "min_backoff": "50ms",
                                         "max_backoff": "500ms"}}


@dataclass
class InProcessProxy:
    proxy: Proxy
    url: str = ""
    write_url: str = ""


def proxy_settings(snapshot: Path, upstream_url: str) -> Settings:
    """karta-proxy on ``snapshot`` and a free port, facts off, with upstream timeouts that
    a peer on loopback never reaches unless it is down."""
    s = Settings()
    s.snapshot = str(snapshot)
    s.upstream.url = upstream_url
    s.upstream.timeout_seconds = 5.0
    s.upstream.connect_timeout_seconds = 2.0
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    return s


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[..., Awaitable[InProcessProxy]]]:
    """karta-proxy in this process on the demo snapshot, on a free port."""
    started: list[Proxy] = []

    async def make(upstream_url: str, configure: Callable[[Settings], None] | None = None,
                   **upstream: Any) -> InProcessProxy:
        """``configure`` changes the settings last (e.g. turns the fact writer on)."""
        s = proxy_settings(DEMO_SNAPSHOT, upstream_url)
        for k, v in upstream.items():
            setattr(s.upstream, k, v)
        if configure is not None:
            configure(s)
        p = Proxy(s)
        await p.start()
        started.append(p)
        url = f"http://127.0.0.1:{p.port}"
        return InProcessProxy(p, url, url + "/api/v1/write")

    try:
        yield make
    finally:
        for p in started:
            await p.stop()


async def agent_metrics(agent: Peer, prefix: str = "prometheus_remote_storage_",
                        url: str | None = None) -> dict[str, float]:
    """An agent's own counters whose names start with ``prefix``, summed over their
    labels and keyed by the rest of the name (what it sent, retried, failed, dropped);
    ``url``: only those of the queue writing there."""
    async with aiohttp.ClientSession() as s, s.get(agent.base_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    only = f'url="{url}"'
    for line in text.splitlines():
        if line.startswith(prefix) and (url is None or only in line):
            name = line.split("{")[0].split(" ")[0].removeprefix(prefix)
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# -- PromQL over the HTTP API (Prometheus and VictoriaMetrics speak the same) ---------------


async def pod_sample_times(base: str, at: float) -> dict[tuple[str, str], list[float]]:
    """The timestamps of each pod's kubelet series (the fixture exporter's) the receiver
    at ``base`` holds at ``at``, oldest first: two paths' are compared whole."""
    q = 'pod_memory_working_set_bytes{pod!=""}[10m]'
    return {(r["metric"]["namespace"], r["metric"]["pod"]): [float(t) for t, _ in r["values"]]
            for r in await query(base, q, at)}


async def wait_stamped(base: str, *, what: str, timeout: float = 30) -> None:
    """Wait until the receiver at ``base`` holds a stamped cAdvisor series (an agent's
    writes came through the proxy, enriched)."""
    async def landed() -> bool:
        got = await query(base, "count(pod_memory_working_set_bytes{karta_workload!=''})")
        return bool(got) and int(float(got[0]["value"][1])) > 0

    await wait_until(landed, timeout=timeout, what=what)


async def _api(base: str, endpoint: str, params: dict[str, str]) -> Any:
    """The ``data`` of one HTTP API call (``/api/v1/<endpoint>``), asserted a success."""
    async with aiohttp.ClientSession() as s, s.get(
        f"{base}/api/v1/{endpoint}", params=params, timeout=aiohttp.ClientTimeout(total=10)
    ) as r:
        body = await r.json()
    assert body.get("status") == "success", body
    return body["data"]


async def query(base: str, promql: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": promql}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return list((await _api(base, "query", params))["result"])


async def query_range(base: str, promql: str, start: float, end: float, step: float
                      ) -> list[dict[str, Any]]:
    """``promql`` evaluated at every ``step`` seconds from ``start`` to ``end``, as a graph
    reads it (each instant sees the last sample within the lookback)."""
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
    return list((await _api(base, "query_range", params))["result"])


async def scalar_by(base: str, promql: str, by: Sequence[str], at: float | None = None
                    ) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(k, "") for k in by): float(r["value"][1])
            for r in await query(base, promql, at)}


async def series_set(base: str, match: str, start: float, end: float
                     ) -> set[frozenset[tuple[str, str]]]:
    data = await _api(base, "series", {"match[]": match, "start": f"{start:.0f}",
                                       "end": f"{end:.0f}"})
    return {frozenset(d.items()) for d in data}


async def vm_flush(vm: Peer) -> None:
    """Make VictoriaMetrics' freshly ingested rows searchable now."""
    async with aiohttp.ClientSession() as s, s.get(vm.base_url + "/internal/force_flush") as r:
        assert r.status == 200


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-6)


@dataclass
class Expected:
    """Per-workload figures the fixture exporter serves, keyed by the stamped identity."""

    memory: dict[tuple[str, str, str], float] = field(default_factory=dict)
    gpu_util: dict[tuple[str, str, str], float] = field(default_factory=dict)
    unattributed_pods: set[tuple[str, str]] = field(default_factory=set)


WORKLOAD_KEY = ("karta_namespace", "karta_kind", "karta_workload")


def expected_by_workload(exp: FixtureExporter, proxy: Proxy) -> Expected:
    """What ``sum by (karta_namespace, karta_kind, karta_workload)`` must give, from the
    exporter's model and the index's answer per pod."""
    out = Expected()

    def key(ns: str, pod: str) -> tuple[str, str, str] | None:
        pairs = proxy.index.lookup(ns.encode(), pod.encode())
        if not pairs:
            return None
        d = dict(pairs)
        return (d.get("karta_namespace", ""), d.get("karta_kind", ""),
                d.get("karta_workload", ""))

    for pod in exp.model.pods:
        k = key(pod.namespace, pod.name)
        if k is None:
            out.unattributed_pods.add((pod.namespace, pod.name))
            continue
        out.memory[k] = out.memory.get(k, 0.0) + pod.memory_bytes
    for g in exp.model.gpus:
        # an idle GPU (no holder) names only the exporter's own pod: the default DCGM
        # pod-label rule leaves it unattributed rather than charging it to the exporter
        k = key(g.holder.namespace, g.holder.pod) if g.holder else None
        if k is not None:
            out.gpu_util[k] = out.gpu_util.get(k, 0.0) + g.util
    return out
