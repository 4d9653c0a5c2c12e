"""Whole-process relay benchmark: CPU per million samples and added latency of karta-proxy
against a pass-through Python relay and against vmagent, measured in the same run.

Every relay is its own process between this script (the sender) and its own null
upstream (``relay/null_upstream.py``), all on 127.0.0.1:

- ``direct``: the sender straight to a null upstream (the latency baseline);
- ``pass-through``: decompress, recompress, forward (``relay/passthrough.py``, aiohttp +
  python-snappy like the proxy);
- ``karta-proxy``: ``python -m proxy`` on a snapshot of the benchmark cluster;
- ``vmagent``: Debian's vmagent relaying (asynchronous: it acknowledges before it
  forwards, so only its CPU is reported);
- ``vmagent+relabel``: the same with three ``replace`` rules deriving labels from ``pod``,
  the nearest thing a peer does to the proxy's job.

The corpus (``relay/corpus.py``) is built and snappy-compressed before any timing. Each
relay is first warmed up with one full cycle through the series universe (steady state:
caches filled), then R rounds of N sequential requests go through every relay, in a
rotating order. Per round and relay: CPU seconds of the relay's process tree (from
``/proc``) per million samples, once the upstream has received every series; latency of
each request; added latency = relay latency minus the median direct latency of the same
round. Printed: medians over rounds, and ratios computed per round then medianed.

    python benchmarks/relay_bench.py [--requests N] [--rounds R] [--series-per-request 2000]
                                     [--pods 5000] [--quick] [--relays a,b] [--json OUT]

``--corpus high-cardinality`` is the scale of issue #8 (``relay/highcard.py``): 37,500
pods and 2,000,000 distinct series, each seen once per pass; four sender processes
(``relay/load.py``); one warm-up pass per relay; per request size (2,000 and 500) rounds
of saturating phases (CPU-s per M samples, samples/s, peak RSS from ``VmHWM``) and a
paced open-loop run at 20 requests/s per relay (p50 / p99 added latency); an RW 2.0
karta-proxy row; karta-proxy under ``taskset -c 0`` against ``taskset -c 0,1``. See
``benchmarks/README.md``.

    python benchmarks/relay_bench.py --corpus high-cardinality [--pods 37500]
        [--series 2000000] [--sizes 2000,500] [--rounds 5] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import corpus as corpus_mod
from relay import highcard, load
from relay.procs import (
    Process,
    ThreadUse,
    cpu_seconds,
    free_port,
    http_get,
    peak_rss_bytes,
    reset_peak_rss,
    thread_use,
    thread_use_between,
)
from relay.workdir import discard_work_dir, results_path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
RELAYS = ("direct", "pass-through", "karta-proxy", "vmagent", "vmagent+relabel")
WRITE_PATH = "/api/v1/write"
HEADERS = {
    "Content-Type": "application/x-protobuf",
    "Content-Encoding": "snappy",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": "karta-relay-bench/1",
}
#: three labels from ``pod`` with regexes (workload from a Deployment pod name, the
#: StatefulSet ordinal, the namespace/pod pair), as one would try with relabeling alone
VMAGENT_RELABEL = """\
- action: replace
  source_labels: [pod]
  regex: "(.+)-[a-z0-9]{9,10}-[a-z0-9]{5}"
  target_label: karta_workload
  replacement: "$1"
- action: replace
  source_labels: [pod]
  regex: ".+-([0-9]+)"
  target_label: karta_instance
  replacement: "$1"
- action: replace
  source_labels: [namespace, pod]
  regex: "([^;]+);(.+)"
  target_label: karta_namespace
  replacement: "$1"
"""


# -- relays ---------------------------------------------------------------------------------


@dataclass
class Relay:
    name: str
    upstream: Process
    proc: Process | None = None  # None: the sender talks to the upstream directly
    asynchronous: bool = False

    @property
    def port(self) -> int:
        return self.proc.port if self.proc is not None else self.upstream.port

    def upstream_stats(self) -> dict[str, int]:
        _, body = http_get(self.upstream.port, "/stats")
        stats: dict[str, int] = json.loads(body)
        return stats


def _start_upstream(name: str, work: Path, defer: bool = False) -> Process:
    port = free_port()
    sink = HERE / "relay" / "null_upstream.py"
    argv = [sys.executable, str(sink), "--listen", f"127.0.0.1:{port}"]
    return Process(
        f"{name} upstream",
        [*argv, "--defer"] if defer else argv,
        port=port,
        ready_path="/-/ready",
        log_path=work / f"{name}-upstream.log",
    )


def _importing(repo: Path) -> dict[str, str]:
    """This environment with ``repo`` first on ``PYTHONPATH`` (its ``proxy`` package)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    return env


def _start_relay(
    name: str,
    upstream: Process,
    work: Path,
    snapshot: Path,
    *,
    cpus: list[int] | None = None,
    proxy_repo: Path = REPO,
    log_name: str | None = None,
    proxy_args: Sequence[str] = (),
    wrap: Sequence[str] = (),
    protocol: str = "passthrough",
) -> Process:
    """Start relay ``name`` (one of RELAYS) forwarding to ``upstream``; ``cpus``: under
    ``taskset -c`` (inherited by every thread and child); ``wrap``: a Python relay run
    through this script and its arguments first (``relay/profiled.py OUT``);
    ``protocol``: karta-proxy's ``--upstream-protocol`` (given once: the command refuses
    a flag given twice)."""
    port = free_port()
    url = f"http://127.0.0.1:{upstream.port}{WRITE_PATH}"
    log = work / f"{log_name or name}.log"
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    if name == "pass-through":
        argv = [
            *pin,
            sys.executable,
            *wrap,
            str(HERE / "relay" / "passthrough.py"),
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream-url",
            url,
        ]
        # this repository's proxy.memory (the allocator thresholds karta-proxy has too)
        return Process(name, argv, port=port, ready_path="/-/ready", log_path=log,
                       env=_importing(REPO))
    if name == "karta-proxy":
        env = _importing(proxy_repo)
        argv = [
            *pin,
            sys.executable,
            *wrap,
            "-m",
            "proxy",
            "--listen-address",
            f"127.0.0.1:{port}",
            "--upstream-url",
            url,
            "--snapshot",
            str(snapshot),
            "--log-level",
            "warning",
            # the null sink answers 204 without Written headers, as a 1.0-only receiver
            # does: on its default (auto) the proxy would rightly convert RW 2.0 for it;
            # the RW 2.0 rows measure RW 2.0 forwarded as RW 2.0, as to a 2.0 receiver
            "--upstream-protocol",
            protocol,
            *proxy_args,
        ]
        return Process(
            name, argv, port=port, ready_path="/-/ready", log_path=log, cwd=proxy_repo, env=env
        )
    vmagent = shutil.which("vmagent")
    assert vmagent is not None
    data = work / f"{name}-data"
    argv = [
        *pin,
        vmagent,
        f"-httpListenAddr=127.0.0.1:{port}",
        f"-remoteWrite.url={url}",
        f"-remoteWrite.tmpDataPath={data}",
        "-remoteWrite.flushInterval=100ms",
        "-loggerLevel=ERROR",
    ]
    if name == "vmagent+relabel":
        rules = work / "relabel.yaml"
        rules.write_text(VMAGENT_RELABEL)
        argv.append(f"-remoteWrite.urlRelabelConfig={rules}")
    return Process(name, argv, port=port, ready_path="/health", log_path=log)


def skip_reason(name: str, proxy_repo: Path = REPO) -> str:
    if name.startswith("vmagent") and shutil.which("vmagent") is None:
        return "vmagent binary not found"
    if name == "karta-proxy" and not (proxy_repo / "proxy" / "cli.py").exists():
        return f"{proxy_repo}/proxy/cli.py not present"
    return ""


# -- sending --------------------------------------------------------------------------------


class Sender:
    """Sequential requests over one keep-alive connection, like one remote-write shard."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.errors = 0
        self.last_error = ""

    def send(self, body: bytes) -> float:
        for attempt in (0, 1):
            try:
                t0 = time.perf_counter()
                self._conn.request("POST", WRITE_PATH, body=body, headers=HEADERS)
                resp = self._conn.getresponse()
                text = resp.read()
                elapsed = time.perf_counter() - t0
            except (OSError, http.client.HTTPException) as exc:
                self._conn.close()
                self._conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=60)
                if attempt:
                    self.errors += 1
                    self.last_error = repr(exc)
                    return math.nan
                continue
            if resp.status // 100 != 2:
                self.errors += 1
                self.last_error = f"HTTP {resp.status}: {text[:200]!r}"
            return elapsed
        return math.nan

    def close(self) -> None:
        self._conn.close()


@dataclass
class Phase:
    """One relay in one round."""

    relay: str
    samples: int
    cpu_seconds: float | None
    latencies: list[float]
    delivered: int
    stamped: int
    errors: int

    @property
    def cpu_per_million(self) -> float | None:
        if self.cpu_seconds is None or not self.samples:
            return None
        return self.cpu_seconds / self.samples * 1e6


def run_phase(
    relay: Relay, bodies: list[bytes], series_per_request: int, drain_timeout: float
) -> Phase:
    before = relay.upstream_stats()
    cpu0 = relay.proc.cpu() if relay.proc is not None else None
    sender = Sender(relay.port)
    latencies = [sender.send(b) for b in bodies]
    sender.close()
    expected = before["series"] + len(bodies) * series_per_request
    deadline = time.monotonic() + drain_timeout
    after = relay.upstream_stats()
    while after["series"] < expected and time.monotonic() < deadline:
        time.sleep(0.02)
        after = relay.upstream_stats()
    cpu1 = relay.proc.cpu() if relay.proc is not None else None
    warn_failed(relay.name, sender.errors, sender.last_error)
    return Phase(
        relay=relay.name,
        samples=len(bodies) * series_per_request,
        cpu_seconds=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        latencies=[x for x in latencies if not math.isnan(x)],
        delivered=after["series"] - before["series"],
        stamped=after["stamped"] - before["stamped"],
        errors=sender.errors,
    )


# -- statistics -----------------------------------------------------------------------------


def warn_failed(relay: str, errors: int, last_error: str) -> None:
    """A phase's failed requests, on stderr (every sample must reach the sink)."""
    if errors:
        print(f"  ! {relay}: {errors} failed requests, last: {last_error}", file=sys.stderr)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: list[float]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


@dataclass
class Summary:
    relay: str
    cpu_per_million: float
    latency_p50_ms: float
    latency_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    #: latency over the pass-through relay of the same round (what enrichment adds)
    over_passthrough_p50_ms: float
    over_passthrough_p99_ms: float
    delivered_fraction: float
    stamped_fraction: float
    errors: int
    per_round_cpu: list[float] = field(default_factory=list)


def summarize(rounds: list[dict[str, Phase]], relays: list[Relay]) -> dict[str, Summary]:
    out = {}
    for relay in relays:
        phases = [r[relay.name] for r in rounds if relay.name in r]
        cpu = [p.cpu_per_million for p in phases if p.cpu_per_million is not None]
        p50, p99, add50, add99, over50, over99 = [], [], [], [], [], []
        for r in rounds:
            phase = r.get(relay.name)
            if phase is None or not phase.latencies:
                continue
            base = median(r["direct"].latencies) if "direct" in r else 0.0
            lat50 = percentile(phase.latencies, 50)
            lat99 = percentile(phase.latencies, 99)
            p50.append(lat50 * 1e3)
            p99.append(lat99 * 1e3)
            add50.append((lat50 - base) * 1e3)
            add99.append((lat99 - base) * 1e3)
            if "pass-through" in r and r["pass-through"].latencies:
                plain = median(r["pass-through"].latencies)
                over50.append((lat50 - plain) * 1e3)
                over99.append((lat99 - plain) * 1e3)
        sync = not relay.asynchronous and relay.proc is not None
        samples = sum(p.samples for p in phases) or 1
        out[relay.name] = Summary(
            relay=relay.name,
            cpu_per_million=median(cpu),
            latency_p50_ms=median(p50),
            latency_p99_ms=median(p99),
            added_p50_ms=median(add50) if sync else math.nan,
            added_p99_ms=median(add99) if sync else math.nan,
            over_passthrough_p50_ms=median(over50) if sync else math.nan,
            over_passthrough_p99_ms=median(over99) if sync else math.nan,
            delivered_fraction=sum(p.delivered for p in phases) / samples,
            stamped_fraction=sum(p.stamped for p in phases) / samples,
            errors=sum(p.errors for p in phases),
            per_round_cpu=cpu,
        )
    return out


def print_machine(info: dict[str, Any]) -> dict[str, str]:
    """Print what ran the benchmark and how loaded it was; returns it for the JSON."""
    mach = machine()
    print(
        f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory']}; Python "
        f"{mach['python']}; vmagent {mach['vmagent'] or '-'}; load average before rounds "
        f"{info.get('loadavg_before', '-')}, at end {mach['loadavg_at_end']}"
    )
    return mach


class _Costed(typing.Protocol):
    @property
    def cpu_per_million(self) -> float | None: ...


def ratio(rounds: Sequence[Mapping[str, _Costed]], a: str, b: str) -> float:
    """Median over rounds of the per-round CPU ratio a / b (same-round noise cancels)."""
    values = []
    for r in rounds:
        if a in r and b in r:
            x, y = r[a].cpu_per_million, r[b].cpu_per_million
            if x is not None and y:
                values.append(x / y)
    return median(values)


# -- report ---------------------------------------------------------------------------------


def _fmt(v: float, spec: str = ".2f") -> str:
    return "-" if v is None or math.isnan(v) else format(v, spec)


def machine() -> dict[str, str]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    vm = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        vm = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "victoria-metrics"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "vmagent": vm,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "loadavg_at_end": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def report(
    args: argparse.Namespace,
    info: dict[str, Any],
    summaries: dict[str, Summary],
    rounds: list[dict[str, Phase]],
    skipped: dict[str, str],
) -> dict[str, Any]:
    print()
    print(
        f"corpus: {info['series_per_request']} series/request, {info['pods']} pods, "
        f"{info['universe']} distinct series ({info['attributable_fraction']:.1%} "
        f"attributable), {info['compressed_kib']:.0f} KiB snappy / "
        f"{info['raw_kib']:.0f} KiB raw per request"
    )
    print(
        f"rounds: {len(rounds)} x {args.requests} requests per relay "
        f"(+{info['warmup']} warm-up requests each); medians over rounds"
    )
    print()
    head = (
        f"{'relay':<17}{'CPU-s/M samples':>16}{'(range)':>13}{'lat p50 ms':>12}{'lat p99 ms':>12}"
        f"{'added p50':>11}{'added p99':>11}{'delivered':>11}{'stamped':>9}"
    )
    print(head)
    print("-" * len(head))
    for name, s in summaries.items():
        lat_note = s.relay.startswith("vmagent")
        spread = (
            f"{min(s.per_round_cpu):.2f}-{max(s.per_round_cpu):.2f}" if s.per_round_cpu else "-"
        )
        print(
            f"{name:<17}{_fmt(s.cpu_per_million):>16}{spread:>13}"
            f"{_fmt(s.latency_p50_ms):>12}{_fmt(s.latency_p99_ms):>12}"
            f"{_fmt(s.added_p50_ms):>11}{_fmt(s.added_p99_ms):>11}"
            f"{s.delivered_fraction:>11.1%}{s.stamped_fraction:>9.1%}"
            + ("   (async: ack before forward)" if lat_note else "")
        )
    for name, why in skipped.items():
        print(f"{name:<17}skipped: {why}")
    ratios = {
        "karta-proxy / pass-through": (ratio(rounds, "karta-proxy", "pass-through"), 2.5),
        "karta-proxy / vmagent+relabel": (ratio(rounds, "karta-proxy", "vmagent+relabel"), 0.5),
        "karta-proxy / vmagent": (ratio(rounds, "karta-proxy", "vmagent"), 1.0),
    }
    print()
    mach = print_machine(info)
    print()
    print("CPU ratios (median of per-round ratios):")
    for label, (value, target) in ratios.items():
        verdict = "" if math.isnan(value) else ("ok" if value <= target else "MISSED")
        goal = "later goal" if label.endswith("/ vmagent") else "target"
        print(f"  {label:<32}{_fmt(value):>8}   {goal} <= {target:g}  {verdict}")
    kp = summaries.get("karta-proxy")
    if kp is not None and not math.isnan(kp.added_p99_ms):
        verdict = "ok" if kp.added_p99_ms <= 5.0 else "MISSED"
        print(
            f"  {'karta-proxy p99 added latency':<32}{_fmt(kp.added_p99_ms):>8}   "
            f"target <= 5 ms  {verdict}   (p50 {_fmt(kp.added_p50_ms)} ms)"
        )
        print(
            f"  {'  of which over pass-through':<32}{_fmt(kp.over_passthrough_p99_ms):>8}   "
            f"(p50 {_fmt(kp.over_passthrough_p50_ms)} ms): what enrichment itself adds"
        )
    return {
        "machine": mach,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "corpus": info,
        "rounds": len(rounds),
        "requests_per_round": args.requests,
        "relays": {k: {kk: vv for kk, vv in v.__dict__.items()} for k, v in summaries.items()},
        "skipped": skipped,
        "ratios": {k: v for k, (v, _) in ratios.items()},
    }


# -- profiling ------------------------------------------------------------------------------


def _start_profiler(out: Path | None, relays: list[Relay]) -> subprocess.Popen[bytes] | None:
    if out is None:
        return None
    kp = next((r for r in relays if r.name == "karta-proxy" and r.proc is not None), None)
    spy = shutil.which("py-spy")
    if kp is None or kp.proc is None or spy is None:
        print("--profile-proxy: needs py-spy on PATH and a running karta-proxy", file=sys.stderr)
        return None
    argv = [
        spy,
        "record",
        "--pid",
        str(kp.proc.pid),
        "--rate",
        "250",
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let it attach before the first round
    return proc


def print_hot_spots(path: Path | None, top: int = 20) -> None:
    """Self and inclusive share of on-CPU samples per function, from py-spy raw output."""
    if path is None or not path.exists():
        return
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return
    print(f"\nkarta-proxy hot spots ({total} on-CPU samples, py-spy):")
    print(f"  {'self':>6} {'incl':>6}  function")
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {n / total:>6.1%} {incl[f] / total:>6.1%}  {f}")
    print("  inclusive, top:")
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {own.get(f, 0) / total:>6.1%} {n / total:>6.1%}  {f}")


# -- high-cardinality mode ------------------------------------------------------------------

HC_RW2 = "karta-proxy-rw2"
HC_1CORE = "karta-proxy-1core"
#: on request only (``--relays``): RW 2.0 senders, the upstream taken as 1.0-only
#: (``--upstream-protocol v1``), every request converted as for Prometheus 2.x or
#: VictoriaMetrics
HC_RW2_V1 = "karta-proxy-rw2-v1"
#: the rows of the high-cardinality mode, in print order: (key, relay kind, protocol)
HC_ROWS = (
    ("direct", "direct", "v1"),
    ("direct-rw2", "direct", "v2"),
    ("pass-through", "pass-through", "v1"),
    ("karta-proxy", "karta-proxy", "v1"),
    (HC_RW2, "karta-proxy", "v2"),
    ("vmagent", "vmagent", "v1"),
    ("vmagent+relabel", "vmagent+relabel", "v1"),
)
HC_LABELS = {
    "direct": "direct",
    "direct-rw2": "direct (RW 2.0)",
    "pass-through": "pass-through",
    "karta-proxy": "karta-proxy",
    HC_RW2: "karta-proxy RW 2.0",
    "vmagent": "vmagent",
    "vmagent+relabel": "vmagent+relabel",
    HC_1CORE: "karta-proxy 1 core",
    HC_RW2_V1: "karta-proxy RW2->1",
}
#: issue #8's targets
HC_TARGETS = {
    "cpu_vs_passthrough": 1.3,
    "cpu_vs_vmagent": 1.0,
    "rw2_vs_rw1": 1.5,
    "peak_rss_mb": 300.0,
    "added_p99_ms": 3.0,
    "two_core_speedup": 1.7,
}


def _hc_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    quick = args.quick
    args.pods = args.pods or (200 if quick else highcard.DEFAULT_PODS)
    args.series = args.series or (8000 if quick else highcard.DEFAULT_SERIES)
    sizes = args.sizes or ("200,50" if quick else "2000,500")
    try:
        args.size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sizes: integers, comma-separated, not {sizes!r}")
    if not args.size_list or min(args.size_list) < 1:
        p.error("--sizes: at least one size, each >= 1")
    args.rounds = args.rounds or (1 if quick else 5)
    args.samples_per_round = args.samples_per_round or (1000 if quick else 200_000)
    # 600 (30 s per relay and size): the p99 is the 6th slowest, not the 2nd of 200
    args.paced_requests = args.paced_requests or (10 if quick else 600)
    if args.taskset_rounds is None:
        args.taskset_rounds = 1 if quick else 4
    keys = [k for k, _, _ in HC_ROWS] + [HC_1CORE, HC_RW2_V1]
    default = [k for k in keys if k != HC_RW2_V1]
    wanted = [r.strip() for r in (args.relays or ",".join(default)).split(",") if r.strip()]
    unknown = [r for r in wanted if r not in keys]
    if unknown:
        p.error(f"unknown relays {unknown}; choose from {keys}")
    if "direct" not in wanted:
        wanted.insert(0, "direct")
    if (HC_RW2 in wanted or HC_RW2_V1 in wanted) and "direct-rw2" not in wanted:
        wanted.insert(1, "direct-rw2")
    args.relay_names = [k for k in keys if k in wanted]
    return args


@dataclass
class HcRelay:
    key: str
    kind: str  # direct, pass-through, karta-proxy, vmagent, vmagent+relabel
    protocol: str  # v1 | v2
    upstream: Process
    proc: Process | None = None
    cpus: list[int] | None = None
    #: --snapshot-change-interval: this relay's copy of the snapshot, rewritten during its
    #: paced run (a karta-proxy reloads it)
    snapshot: Path | None = None

    @property
    def port(self) -> int:
        return self.proc.port if self.proc is not None else self.upstream.port

    @property
    def asynchronous(self) -> bool:
        return self.kind.startswith("vmagent")

    @property
    def label(self) -> str:
        return HC_LABELS.get(self.key, self.key)

    def stats(self) -> dict[str, Any]:
        _, body = http_get(self.upstream.port, "/stats", timeout=120)
        stats: dict[str, Any] = json.loads(body)
        return stats


@dataclass
class HcPhase:
    """One relay, one batch of requests."""

    relay: str
    samples: int
    seconds: float
    cpu_seconds: float | None
    delivered: int
    stamped: int
    expected_stamped: int
    v2_series: int
    errors: int
    latencies: list[float] = field(default_factory=list)
    #: CPU of the load's own side in the phase: the sender processes and the relay's sink,
    #: which share the machine's cores with the relay
    harness_cpu_seconds: float | None = None
    #: requests sent in the phase
    requests: int = 0
    #: what the relay's threads spent in the phase, per role (``procs.thread_use``)
    threads: dict[str, ThreadUse] = field(default_factory=dict)

    @property
    def cpu_per_million(self) -> float | None:
        return self._per_million(self.cpu_seconds)

    @property
    def harness_cpu_per_million(self) -> float | None:
        return self._per_million(self.harness_cpu_seconds)

    def _per_million(self, seconds: float | None) -> float | None:
        if seconds is None or not self.samples:
            return None
        return seconds / self.samples * 1e6

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan


@dataclass(frozen=True)
class _PhaseStart:
    """A relay's readings as a phase begins."""

    stats: dict[str, Any]
    cpu_seconds: float | None
    threads: dict[str, ThreadUse]
    harness_cpu_seconds: float


class HcRun:
    """Bodies, their stream positions, the sender pool."""

    def __init__(
        self, universe: highcard.Universe, bodies: dict[str, list[bytes]], pool: load.SenderPool
    ) -> None:
        self.universe = universe
        self.bodies = bodies
        self.pool = pool
        self.spans: list[tuple[int, int]] = []  # per body index: (stream position, size)

    def add_segment(self, seg: highcard.Segment) -> range:
        first = len(self.spans)
        self.spans += [(seg.start + i * seg.size, seg.size) for i in range(seg.count)]
        return range(first, len(self.spans))

    def phase(
        self,
        relay: HcRelay,
        items: Sequence[int],
        *,
        rate: float | None = None,
        drain_timeout: float = 120.0,
    ) -> HcPhase:
        start = self._start(relay)
        res = self.pool.run(relay.port, relay.protocol, items, rate)
        return self._finish(relay, items, start, res, drain_timeout)

    def paced_together(
        self, relays: Sequence[HcRelay], items: Sequence[int], rate: float,
        drain_timeout: float = 120.0,
    ) -> dict[str, HcPhase]:
        """``items`` paced at ``rate``/s to every relay of ``relays`` at once, their requests
        taking turns (``load.SenderPool.run_together``): each relay's latencies are taken
        through the same stretch of the machine's noise as the others'."""
        starts = [self._start(relay) for relay in relays]
        results = self.pool.run_together([(r.port, r.protocol) for r in relays], items, rate)
        return {relay.key: self._finish(relay, items, start, res, drain_timeout)
                for relay, start, res in zip(relays, starts, results, strict=True)}

    def _start(self, relay: HcRelay) -> _PhaseStart:
        """What a phase's figures are taken against: the sink's counts, the relay's CPU (and
        its threads'), the load's CPU."""
        before = relay.stats()
        cpu0 = relay.proc.cpu() if relay.proc is not None else None
        threads0 = thread_use(relay.proc.pid) if relay.proc is not None else {}
        return _PhaseStart(before, cpu0, threads0, self._harness_cpu(relay))

    def _finish(
        self,
        relay: HcRelay,
        items: Sequence[int],
        start: _PhaseStart,
        res: load.Result,
        drain_timeout: float,
    ) -> HcPhase:
        before, cpu0, harness0 = start.stats, start.cpu_seconds, start.harness_cpu_seconds
        samples = sum(self.spans[i][1] for i in items)
        stamped_expected = sum(
            self.universe.attributable_between(pos, pos + n)
            for pos, n in (self.spans[i] for i in items)
        )
        deadline = time.monotonic() + drain_timeout
        harness1 = self._harness_cpu(relay)  # before /stats: the deferred sink counts then
        after = relay.stats()
        while after["samples"] - before["samples"] < samples and time.monotonic() < deadline:
            time.sleep(0.05)
            after = relay.stats()
        cpu1 = relay.proc.cpu() if relay.proc is not None else None
        threads = (thread_use_between(start.threads, thread_use(relay.proc.pid))
                   if relay.proc is not None else {})
        ended = res.ended
        if relay.asynchronous and after["last_arrival"] > ended:
            ended = after["last_arrival"]  # it answered before forwarding
        warn_failed(relay.key, res.errors, res.last_error)
        return HcPhase(
            relay=relay.key,
            samples=samples,
            seconds=ended - res.started,
            cpu_seconds=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            delivered=after["samples"] - before["samples"],
            stamped=after["stamped"] - before["stamped"],
            expected_stamped=stamped_expected,
            v2_series=after["v2_series"] - before["v2_series"],
            errors=res.errors + after["errors"] - before["errors"],
            latencies=[x for _, x in res.latencies],
            harness_cpu_seconds=harness1 - harness0,
            requests=len(items),
            threads=threads,
        )

    def _harness_cpu(self, relay: HcRelay) -> float:
        """CPU seconds so far of the senders and of ``relay``'s sink."""
        return sum(map(cpu_seconds, self.pool.pids)) + relay.upstream.cpu()


def _scaling_bound(one_core: float, two_core: float, harness: float, cpus: int) -> float:
    """The most samples/s a relay on 2 cores can reach over the same relay on 1, on a machine
    of ``cpus`` cores that also runs the load (senders and sink, ``harness`` CPU-s per M
    samples): the 1-core relay has its core to itself (rate ``1 / one_core``) while the
    2-core one shares its two with the load (rate at most ``2 / (two_core + harness)``);
    a machine with cores to spare for the load is bounded by 2 alone. NaN when unknown
    (CPU is read in clock ticks: a short phase may read none). At most 2: a short phase's
    ticks can make the 1-core relay read twice the CPU a sample of the 2-core one (a
    quick run read 4.0)."""
    if math.isnan(one_core) or math.isnan(two_core) or math.isnan(harness) \
            or one_core <= 0 or two_core <= 0:
        return math.nan
    if cpus > 2:
        return min(2.0, 2.0 * one_core / two_core)
    return min(2.0, 2.0 * one_core / (two_core + harness))


def _chunks(items: range, n: int) -> list[range]:
    return [items[i : i + n] for i in range(0, len(items), n)]


@contextlib.contextmanager
def _periodically(name: str, every: float,
                  step: typing.Callable[[], object]) -> typing.Iterator[list[float]]:
    """Run ``step`` every ``every`` seconds (the first after ``every``) in a thread while
    the block runs; yields the list that gets the seconds each step took (a step that
    raises ``OSError`` is reported and not counted). Nothing when ``every`` is 0."""
    took: list[float] = []
    if every <= 0:
        yield took
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            started = time.monotonic()
            try:
                step()
            except OSError as exc:
                print(f"  {name} failed: {exc!r}", flush=True)
                continue
            took.append(time.monotonic() - started)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield took
    finally:
        stop.set()
        thread.join(timeout=90)


def _scraping(port: int, every: float) -> typing.ContextManager[list[float]]:
    """``GET /metrics`` of the relay on ``port`` every ``every`` seconds while the block
    runs, as a Prometheus scraping it would."""
    return _periodically("/metrics scrape", every,
                         lambda: http_get(port, "/metrics", timeout=60))


#: where a pod object begins in the high-cardinality snapshot (compact JSON)
_POD_MARK = '"kind":"Pod","metadata":{'


def _changing(path: Path | None, every: float) -> typing.ContextManager[list[float]]:
    """Rewrite the snapshot at ``path`` every ``every`` seconds while the block runs, 1%
    of its pods changed each time (an annotation, so attribution stays the same), as a
    periodic export of a live cluster would; a karta-proxy reading it polls it every
    second and reloads."""
    if path is None or every <= 0:
        return _periodically("snapshot change", 0, lambda: None)
    head, *pods = path.read_text().split(_POD_MARK)
    n = 0

    def change() -> None:
        nonlocal n
        n += 1
        text = head + "".join(
            _POD_MARK + (f'"annotations":{{"bench/rev":"{n}"}},' if i % 100 == n % 100
                         else "") + pod
            for i, pod in enumerate(pods))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    return _periodically("snapshot change", every, change)


@dataclass
class HcSize:
    """Everything measured at one request size."""

    size: int
    rounds: list[dict[str, HcPhase]] = field(default_factory=list)
    paced: dict[str, HcPhase] = field(default_factory=dict)
    #: --scrape-interval: the seconds each /metrics scrape took during the paced run
    scrapes: dict[str, list[float]] = field(default_factory=dict)
    #: --snapshot-change-interval: how often each relay's snapshot copy was rewritten
    snapshot_changes: dict[str, int] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    raw_kib: dict[str, float] = field(default_factory=dict)
    compressed_kib: dict[str, float] = field(default_factory=dict)


#: a thread role's figures per request: what ``_threads_per_request`` gives
THREAD_FIGURES = ("cpu_ms", "system_ms", "voluntary_switches", "involuntary_switches",
                  "run_wait_ms")


def _threads_per_request(phase: HcPhase) -> dict[str, dict[str, float]]:
    """What each thread role of the relay spent per request of ``phase``: CPU, context
    switches given up (voluntary: the thread waited for work or a lock) and taken
    (involuntary: preempted), time runnable but waiting for a core."""
    n = phase.requests or 1
    return {role: {"threads": use.threads,
                   "cpu_ms": use.cpu_seconds / n * 1e3,
                   "system_ms": use.system_seconds / n * 1e3,
                   "voluntary_switches": use.voluntary_switches / n,
                   "involuntary_switches": use.involuntary_switches / n,
                   "run_wait_ms": use.run_wait_seconds / n * 1e3}
            for role, use in sorted(phase.threads.items())}


def _threads_median(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    roles = sorted({role for r in rounds for role in r})
    return {role: {"threads": max(r[role]["threads"] for r in rounds if role in r),
                   **{k: median([r[role][k] for r in rounds if role in r])
                      for k in THREAD_FIGURES}}
            for role in roles}


def _hc_summary(res: HcSize, relays: list[HcRelay]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    direct = {proto: res.paced.get(key) for key, proto in (("direct", "v1"), ("direct-rw2", "v2"))}
    for relay in relays:
        if relay.key == HC_1CORE:
            continue
        phases = [r[relay.key] for r in res.rounds if relay.key in r]
        cpu = [p.cpu_per_million for p in phases if p.cpu_per_million is not None]
        paced = res.paced.get(relay.key)
        row: dict[str, Any] = {
            "cpu_per_million": median(cpu),
            "per_round_cpu": cpu,
            "samples_per_second": median([p.samples_per_second for p in phases]),
            "peak_rss_mb": res.peak_rss[relay.key] / 1e6 if relay.key in res.peak_rss else None,
        }
        for q in (50, 99):
            row[f"latency_p{q}_ms"] = math.nan
            row[f"added_p{q}_ms"] = math.nan
        base = direct.get(relay.protocol)
        if paced is not None and paced.latencies:
            for q in (50, 99):
                row[f"latency_p{q}_ms"] = percentile(paced.latencies, q) * 1e3
            # in due order: where in the run the slow ones fell, and whether the relays'
            # slow ones fell together (the box) or apart (the relay)
            row["paced_latencies_ms"] = [round(x * 1e3, 3) for x in paced.latencies]
            if paced.cpu_seconds is not None:  # the relay's CPU per paced request
                row["paced_cpu_ms_per_request"] = paced.cpu_seconds / len(paced.latencies) * 1e3
            if base is not None and base.latencies and relay.proc is not None:
                b = median(base.latencies)
                for q in (50, 99):
                    row[f"added_p{q}_ms"] = (percentile(paced.latencies, q) - b) * 1e3
        every = phases + ([paced] if paced is not None else [])
        sent = sum(p.samples for p in every) or 1
        row["delivered_fraction"] = sum(p.delivered for p in every) / sent
        row["stamped_fraction"] = sum(p.stamped for p in every) / sent
        row["expected_stamped_fraction"] = sum(p.expected_stamped for p in every) / sent
        row["rw2_fraction"] = sum(p.v2_series for p in every) / sent
        row["errors"] = sum(p.errors for p in every)
        per_round_threads = [_threads_per_request(p) for p in phases if p.threads]
        if per_round_threads:
            row["per_round_threads"] = per_round_threads
            row["threads_per_request"] = _threads_median(per_round_threads)
        out[relay.key] = row
    return out


def _hc_start(
    args: argparse.Namespace, work: Path, snapshot: Path
) -> tuple[list[HcRelay], list[Process], dict[str, str]]:
    cpus = sorted(os.sched_getaffinity(0))
    two = cpus[:2] if len(cpus) >= 2 and shutil.which("taskset") else None
    relays: list[HcRelay] = []
    procs: list[Process] = []
    skipped: dict[str, str] = {}
    rows = {k: (kind, proto) for k, kind, proto in HC_ROWS}
    rows[HC_1CORE] = ("karta-proxy", "v1")
    rows[HC_RW2_V1] = ("karta-proxy", "v2")
    config = work / "karta-proxy-bench.yaml"
    config.write_text(f"facts:\n  interval_seconds: {args.fact_interval:g}\n")
    for key in args.relay_names:
        kind, proto = rows[key]
        why = skip_reason(kind, args.proxy_repo)
        if key == HC_1CORE and not why:
            if args.taskset_rounds <= 0:
                why = "--taskset-rounds 0"
            elif two is None:
                why = "needs 2 CPUs and taskset"
        if why:
            skipped[key] = why
            continue
        up = _start_upstream(key.replace("+", "-"), work, defer=True)
        procs.append(up)
        relay = HcRelay(key, kind, proto, up)
        if args.snapshot_change_interval > 0:
            # a copy per relay, rewritten during every relay's paced run: each run then
            # has the rewriting's CPU and disk on the same cores (~0.5 s of CPU per 37 MB
            # rewrite; the direct path's p99 and karta-proxy's with reloads turned off
            # went to 20-72 ms with it), and only karta-proxy reads its copy
            relay.snapshot = work / f"snapshot-{key}.json"
            shutil.copyfile(snapshot, relay.snapshot)
        if kind != "direct":
            # the 2-core side of the scaling row: karta-proxy pinned to the first two CPUs
            # (on a 2-core box, every CPU); the 1-core side to the first one
            pin = two[:1] if key == HC_1CORE and two else (two if key == "karta-proxy" else None)
            relay.cpus = pin
            extra: list[str] = []
            own = snapshot
            if kind == "karta-proxy" and relay.snapshot is not None:
                # its own copy: only the relay being measured sees its snapshot change
                own = relay.snapshot
                extra += ["--snapshot-reload-seconds", "1"]
            relay.proc = _start_relay(
                kind,
                up,
                work,
                own,
                cpus=pin,
                proxy_repo=args.proxy_repo,
                log_name=key,
                proxy_args=["--config", str(config), *extra],
                protocol="v1" if key == HC_RW2_V1 else "passthrough",
            )
            procs.append(relay.proc)
        relays.append(relay)
    return relays, procs, skipped


def _hc_wait_ready(relays: list[HcRelay], skipped: dict[str, str]) -> list[HcRelay]:
    ready = []
    for relay in relays:
        try:
            relay.upstream.wait_ready(60)
            if relay.proc is not None:
                relay.proc.wait_ready(600 if relay.kind == "karta-proxy" else 120)
        except RuntimeError as exc:
            skipped[relay.key] = f"did not start: {exc}"
            continue
        ready.append(relay)
    return ready


def _print_threads(res: HcSize, summary: dict[str, dict[str, Any]],
                   relays: list[HcRelay]) -> None:
    """Where each Python relay's CPU went in the saturated rounds, by thread: a relay
    whose cost moves from run to run shows which of its threads moved, and whether they
    waited for cores (the box) or handed work to each other (switches)."""
    rows = [(r, summary[r.key]["threads_per_request"]) for r in relays
            if r.key in summary and "threads_per_request" in summary[r.key]
            and r.kind in ("pass-through", "karta-proxy")]
    if not rows:
        return
    print(f"  by thread, per request (medians over the {len(res.rounds)} rounds): CPU ms "
          "(of it in the kernel), context switches voluntary / involuntary, ms runnable "
          "waiting for a core")
    for relay, threads in rows:
        for role, f in threads.items():
            print(f"    {relay.label:<20}{role:<16}x{f['threads']:<3.0f}"
                  f"{f['cpu_ms']:>7.2f} ms ({f['system_ms']:.2f})"
                  f"{f['voluntary_switches']:>8.1f} /"
                  f"{f['involuntary_switches']:>5.1f}{f['run_wait_ms']:>8.2f} ms waiting")


def _hc_report(
    args: argparse.Namespace,
    info: dict[str, Any],
    sizes: list[HcSize],
    relays: list[HcRelay],
    taskset: list[dict[str, HcPhase]],
    overall_peak: dict[str, int],
    skipped: dict[str, str],
    overall_charged: dict[str, int] | None = None,
) -> dict[str, Any]:
    print()
    print(
        f"corpus: high-cardinality, {info['pods']:,} pods ({info['snapshot_objects']:,} "
        f"snapshot objects), {info['series']:,} distinct series per pass "
        f"({info['label_bytes_per_series']:.0f} label bytes, "
        f"{info['labels_per_series']:.1f} labels per series on average; "
        f"{info['attributable_fraction']:.1%} attributable; "
        f"{info['container_families']} container_* families per app container)"
    )
    print(
        f"method: {info['warmup_passes']:g} warm-up pass(es) per relay, then per request size "
        f"{args.rounds} rounds of {args.samples_per_round:,} samples per relay "
        f"(rotating order, {args.senders} sender connections, saturating) and a paced run "
        f"of {args.paced_requests} requests at {args.rate:g}/s per relay"
        + (", every relay at once, their requests taking turns" if args.paced_together
           else ", one relay after another")
        + (f" (karta-proxy's /metrics scraped every {args.scrape_interval:g} s meanwhile)"
           if args.scrape_interval > 0 else "")
        + (f" (a snapshot rewritten every {args.snapshot_change_interval:g} s meanwhile, "
           "each relay its own copy; karta-proxy reloads its copy)"
           if args.snapshot_change_interval > 0 else "")
        + "; medians over rounds"
    )
    out_sizes: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    headline = 2000 if any(s.size == 2000 for s in sizes) else (sizes[0].size if sizes else 0)
    for res in sizes:
        summary = _hc_summary(res, relays)
        ratios = {
            "karta-proxy / pass-through": ratio(res.rounds, "karta-proxy", "pass-through"),
            "karta-proxy / vmagent": ratio(res.rounds, "karta-proxy", "vmagent"),
            "karta-proxy / vmagent+relabel": ratio(
                res.rounds, "karta-proxy", "vmagent+relabel"
            ),
            "karta-proxy RW 2.0 / RW 1.0": ratio(res.rounds, HC_RW2, "karta-proxy"),
            "karta-proxy RW 2.0->1.0 / RW 1.0": ratio(res.rounds, HC_RW2_V1, "karta-proxy"),
        }
        print()
        sizes_text = ", ".join(
            f"RW {'2.0' if p == 'v2' else '1.0'} {res.raw_kib[p]:,.0f} KiB raw / "
            f"{res.compressed_kib[p]:,.0f} KiB snappy"
            for p in sorted(res.raw_kib)
        )
        print(f"{res.size} series per request ({sizes_text}), {len(res.rounds)} rounds")
        head = (
            f"{'relay':<20}{'CPU-s/M':>9}{'(range)':>13}{'samples/s':>11}{'peak RSS':>10}"
            f"{'lat p50':>9}{'lat p99':>9}{'added p50':>10}{'added p99':>10}"
            f"{'delivered':>10}{'stamped':>9}{'/pass-thr':>10}{'/vmagent':>9}"
        )
        print(head)
        print(f"{'':<20}{'':>9}{'':>13}{'':>11}{'MB':>10}{'ms':>9}{'ms':>9}{'ms':>10}{'ms':>10}")
        print("-" * len(head))
        for relay in relays:
            row = summary.get(relay.key)
            if row is None:
                continue
            per = row["per_round_cpu"]
            spread = f"{min(per):.2f}-{max(per):.2f}" if per else "-"
            rss = row["peak_rss_mb"]
            vs_pt = ratio(res.rounds, relay.key, "pass-through")
            vs_vm = ratio(res.rounds, relay.key, "vmagent")
            stamped = f"{row['stamped_fraction']:.1%}"
            if (
                relay.kind == "karta-proxy"
                and row["stamped_fraction"] != row["expected_stamped_fraction"]
            ):
                stamped += "!"
            note = ""
            if relay.asynchronous:
                note = "  (async: ack before forward)"
            elif relay.key == HC_RW2_V1:
                if row["rw2_fraction"] > 0:
                    note = f"  (! {row['rw2_fraction']:.0%} arrived as RW 2.0, not converted)"
            elif relay.protocol == "v2" and relay.proc is not None and row["rw2_fraction"] < 1:
                note = f"  (! {row['rw2_fraction']:.0%} arrived as RW 2.0)"
            print(
                f"{relay.label:<20}{_fmt(row['cpu_per_million']):>9}{spread:>13}"
                f"{_fmt(row['samples_per_second'], ',.0f'):>11}"
                f"{_fmt(rss if rss is not None else math.nan, '.0f'):>10}"
                f"{_fmt(row['latency_p50_ms']):>9}{_fmt(row['latency_p99_ms']):>9}"
                f"{_fmt(row['added_p50_ms']):>10}{_fmt(row['added_p99_ms']):>10}"
                f"{row['delivered_fraction']:>10.1%}{stamped:>9}"
                f"{_fmt(vs_pt):>10}{_fmt(vs_vm):>9}{note}"
            )
        _print_threads(res, summary, relays)
        out_sizes[str(res.size)] = {"relays": summary, "ratios": ratios,
                                    "metrics_scrape_seconds": res.scrapes}
        if res.size == headline:
            kp = summary.get("karta-proxy", {})
            rw2 = summary.get(HC_RW2, {})
            targets = {
                "series_per_request": res.size,
                "cpu_vs_passthrough": ratios["karta-proxy / pass-through"],
                "cpu_vs_vmagent": ratios["karta-proxy / vmagent"],
                "rw2_vs_rw1": ratios["karta-proxy RW 2.0 / RW 1.0"],
                "added_p99_ms": kp.get("added_p99_ms", math.nan),
                "added_p50_ms": kp.get("added_p50_ms", math.nan),
                "rw2_added_p99_ms": rw2.get("added_p99_ms", math.nan),
            }
    for key in skipped:
        print(f"{HC_LABELS.get(key, key):<20}skipped: {skipped[key]}")
    peak = {k: v / 1e6 for k, v in overall_peak.items()}
    targets["peak_rss_mb"] = max(
        (peak[k] for k in ("karta-proxy", HC_RW2) if k in peak), default=math.nan
    )
    targets["peak_rss_mb_by_relay"] = peak
    charged = {k: v / 1e6 for k, v in (overall_charged or {}).items()}
    targets["peak_charged_mb"] = max(
        (charged[k] for k in ("karta-proxy", HC_RW2) if k in charged), default=math.nan
    )
    targets["peak_charged_mb_by_relay"] = charged
    speedups = []
    rates: dict[str, list[float]] = {"karta-proxy": [], HC_1CORE: []}
    cpu_ts: dict[str, list[float]] = {"karta-proxy": [], HC_1CORE: []}
    harness: dict[str, list[float]] = {"karta-proxy": [], HC_1CORE: []}
    for r in taskset:
        if "karta-proxy" in r and HC_1CORE in r:
            speedups.append(r["karta-proxy"].samples_per_second / r[HC_1CORE].samples_per_second)
        for k, ph in r.items():
            rates[k].append(ph.samples_per_second)
            if ph.cpu_per_million is not None:
                cpu_ts[k].append(ph.cpu_per_million)
            if ph.harness_cpu_per_million is not None:
                harness[k].append(ph.harness_cpu_per_million)
    targets["two_core_speedup"] = median(speedups)
    bound = math.nan
    if taskset:
        print()
        print(
            f"scaling ({headline} series per request, {args.scaling_senders} sender connections, "
            f"saturating, {len(taskset)} rounds of {args.samples_per_round:,} samples):"
        )
        for k, label in (("karta-proxy", "taskset -c 0,1"), (HC_1CORE, "taskset -c 0")):
            print(
                f"  karta-proxy {label:<16}{_fmt(median(rates[k]), ',.0f'):>12} samples/s"
                f"   {_fmt(median(cpu_ts[k]))} CPU-s/M"
                f"   senders + sink {_fmt(median(harness[k]))} CPU-s/M"
            )
        bound = _scaling_bound(median(cpu_ts[HC_1CORE]), median(cpu_ts["karta-proxy"]),
                               median(harness["karta-proxy"]), len(os.sched_getaffinity(0)))
        if not math.isnan(bound):
            print(
                f"  the senders and the sink run on the same cores: with these CPU costs the "
                f"most the 2-core proxy can reach here is {bound:.2f}x the 1-core one "
                "(2 x 1-core CPU-s/M / (2-core CPU-s/M + senders and sink))"
            )
    print()
    mach = print_machine(info)
    print()
    print(f"targets (issue #8), {targets.get('series_per_request', headline)} series per request:")

    def line(label: str, value: float, key: str, unit: str = "", more: str = "") -> None:
        target = HC_TARGETS[key]
        if math.isnan(value):
            verdict = "-"
        elif key == "two_core_speedup":  # judged as printed (2 decimals)
            verdict = "ok" if round(value, 2) >= target else "MISSED"
        else:
            verdict = "ok" if round(value, 2) <= target else "MISSED"
        sign = ">=" if key == "two_core_speedup" else "<="
        print(
            f"  {label:<40}{_fmt(value):>8}{unit:<3} target {sign} {target:g}{unit}  "
            f"{verdict}{more}"
        )

    line(
        "karta-proxy / pass-through (CPU)",
        targets.get("cpu_vs_passthrough", math.nan),
        "cpu_vs_passthrough",
    )
    line(
        "karta-proxy / vmagent plain (CPU)",
        targets.get("cpu_vs_vmagent", math.nan),
        "cpu_vs_vmagent",
    )
    line("karta-proxy RW 2.0 / RW 1.0 (CPU)", targets.get("rw2_vs_rw1", math.nan), "rw2_vs_rw1")
    line(
        "karta-proxy peak RSS (VmHWM, whole run)",
        targets["peak_rss_mb"],
        "peak_rss_mb",
        " MB",
        "   (" + ", ".join(f"{HC_LABELS.get(k, k)} {v:.0f}" for k, v in peak.items()) + ")",
    )
    if charged:
        # beside the target, not instead of it: each page once, but the libraries cached
        # before the relay started are charged to whoever read them first
        print("  " + "peak memory cgroup charge (whole run)".ljust(40) + "   "
              + ", ".join(f"{HC_LABELS.get(k, k)} {v:.1f} MB" for k, v in charged.items())
              + "   (each page once; not the libraries cached before the start)")
    line(
        f"karta-proxy p99 added latency @{args.rate:g}/s",
        targets.get("added_p99_ms", math.nan),
        "added_p99_ms",
        " ms",
        f"   (p50 {_fmt(targets.get('added_p50_ms', math.nan))} ms)",
    )
    line("samples/s, 2 cores / 1 core", targets["two_core_speedup"], "two_core_speedup",
         more="" if math.isnan(bound) else f"   (at most {bound:.2f} on this machine, above)")
    return {
        "mode": "high-cardinality",
        "machine": mach,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "corpus": info,
        "rounds": args.rounds,
        "samples_per_round": args.samples_per_round,
        "senders": args.senders,
        "scaling_senders": args.scaling_senders,
        "paced": {"requests": args.paced_requests, "rate": args.rate,
                  "scrape_interval": args.scrape_interval,
                  "snapshot_change_interval": args.snapshot_change_interval},
        "sizes": out_sizes,
        "taskset": {
            "rounds": len(taskset),
            "samples_per_second": {k: median(v) for k, v in rates.items()},
            "cpu_per_million": {k: median(v) for k, v in cpu_ts.items()},
            "speedups": speedups,
            "harness_cpu_per_million": {k: median(v) for k, v in harness.items()},
            "speedup_bound": bound,
        },
        "targets": targets,
        "skipped": skipped,
    }


def main_high_cardinality(args: argparse.Namespace) -> int:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="relay-bench-hc-"))
    procs: list[Process] = []
    pool: load.SenderPool | None = None
    try:
        t0 = time.monotonic()
        cluster = corpus_mod.build_cluster(args.pods, long_names=True)
        snapshot = highcard.write_snapshot_json(cluster, work / "snapshot.json")
        # the relays load the snapshot while the corpus is built
        relays, procs, skipped = _hc_start(args, work, snapshot)
        universe = highcard.build_universe(cluster, args.series)
        n = universe.series
        sizes = args.size_list
        big = max(sizes)
        per_round = {s: max(1, args.samples_per_round // s) for s in sizes}
        pos = 0
        segments: list[tuple[str, int, highcard.Segment]] = []

        def seg(kind: str, size: int, count: int) -> None:
            nonlocal pos
            sg = highcard.Segment(pos, size, count)
            segments.append((kind, size, sg))
            pos = sg.stop

        seg("warmup", big, max(1, math.ceil(args.warmup_passes * n / big)))
        for s in sizes:
            seg("rounds", s, args.rounds * per_round[s])
            seg("paced", s, args.paced_requests)
        want_1core = any(r.key == HC_1CORE for r in relays)
        if want_1core:
            seg("taskset", big, args.taskset_rounds * per_round[big])
        protocols = ["v1"] + (["v2"] if any(r.protocol == "v2" for r in relays) else [])
        t1 = time.monotonic()
        measured = [sg for kind, _, sg in segments if kind != "taskset"]
        bodies = highcard.build_bodies(universe, measured, protocols)
        if want_1core:
            extra = highcard.build_bodies(universe, [segments[-1][2]], ["v1"])
            bodies["v1"] += extra["v1"]
        built = time.monotonic() - t1
        stats = highcard.describe(universe)
        info: dict[str, Any] = {
            "pods": len(cluster.pods),
            "snapshot_objects": len(cluster.objects),
            "series": n,
            "attributable_fraction": universe.attributable / n,
            "container_families": universe.container_families,
            "warmup_passes": args.warmup_passes,
            "sizes": sizes,
            "bodies": {p: len(b) for p, b in bodies.items()},
            "body_mb": {p: sum(map(len, b)) / 1e6 for p, b in bodies.items()},
            **stats,
        }
        print(
            f"corpus: {len(cluster.pods):,} pods, {n:,} series "
            f"({stats['label_bytes_per_series']:.0f} label bytes per series), "
            + ", ".join(
                f"{len(b):,} {p} bodies ({info['body_mb'][p]:,.0f} MB snappy)"
                for p, b in bodies.items()
            )
            + f"; built in {time.monotonic() - t0:.0f}s (bodies {built:.0f}s); work dir {work}"
        )
        pool = load.SenderPool(bodies, args.senders)
        run = HcRun(universe, bodies, pool)
        ranges: dict[tuple[str, int], range] = {}
        for kind, size, sg in segments:
            ranges[(kind, size)] = run.add_segment(sg)
        relays = _hc_wait_ready(relays, skipped)
        print(
            "relays: "
            + ", ".join(
                f"{r.key} (pid {r.proc.pid if r.proc else r.upstream.pid}"
                + (f", cpus {','.join(map(str, r.cpus))}" if r.cpus else "")
                + ")"
                for r in relays
            )
        )
        by_key = {r.key: r for r in relays}
        overall_peak: dict[str, int] = {}
        #: the peak charge of each relay's memory cgroup: each page once (the sum of VmHWM
        #: counts the libraries karta-proxy and its jq child both map twice)
        overall_charged: dict[str, int] = {}

        def note_peaks() -> None:
            for r in relays:
                if r.proc is not None:
                    rss = peak_rss_bytes(r.proc.pid)
                    overall_peak[r.key] = max(overall_peak.get(r.key, 0), rss)
                    charged = r.proc.peak_charged_bytes()
                    if charged is not None:
                        overall_charged[r.key] = max(overall_charged.get(r.key, 0), charged)

        # warm-up: every series once (per relay), in chunks so the sinks keep up
        t2 = time.monotonic()
        cold: dict[str, dict[str, float]] = {}
        warm = ranges[("warmup", big)]
        for relay in relays:
            if relay.proc is None:
                continue
            warm_phases = [
                run.phase(relay, chunk, drain_timeout=300)
                for chunk in _chunks(warm, max(1, 200_000 // big))
            ]
            cpu = sum(p.cpu_seconds or 0.0 for p in warm_phases)
            samples = sum(p.samples for p in warm_phases)
            cold[relay.key] = {
                "cpu_per_million": cpu / samples * 1e6,
                "samples_per_second": samples / sum(p.seconds for p in warm_phases),
                "delivered_fraction": sum(p.delivered for p in warm_phases) / samples,
            }
        note_peaks()
        info["warmup"] = cold
        print(
            f"warm-up: {len(warm)} requests of {big} per relay in {time.monotonic() - t2:.0f}s; "
            "CPU-s/M (first sight of every series): "
            + "  ".join(f"{k} {v['cpu_per_million']:.2f}" for k, v in cold.items())
        )
        info["loadavg_before"] = " ".join(f"{x:.1f}" for x in os.getloadavg())

        rotation = [r for r in relays if r.key != HC_1CORE]
        results: list[HcSize] = []
        stop = False
        for size in sizes:
            res = HcSize(size)
            first = ranges[("rounds", size)][0]
            for p in protocols:
                body = bodies[p][first]
                res.compressed_kib[p] = len(body) / 1024
                raw = universe.body_v2 if p == "v2" else universe.body_v1
                res.raw_kib[p] = len(raw(*run.spans[first])) / 1024
            note_peaks()
            for r in rotation:
                if r.proc is not None:
                    reset_peak_rss(r.proc.pid)
                    r.proc.reset_peak_charged()
            chunks = _chunks(ranges[("rounds", size)], per_round[size])
            for i, chunk in enumerate(chunks):
                if time.monotonic() - started > args.max_seconds:
                    print("stopping rounds: --max-seconds reached", file=sys.stderr)
                    stop = True
                    break
                k = i % len(rotation)
                phases: dict[str, HcPhase] = {}
                for relay in rotation[k:] + rotation[:k]:
                    phases[relay.key] = run.phase(relay, chunk)
                res.rounds.append(phases)
                print(
                    f"{size}/request round {i + 1}/{len(chunks)}: CPU-s/M "
                    + "  ".join(
                        f"{p.relay} {_fmt(p.cpu_per_million)}"
                        for p in phases.values()
                        if p.cpu_per_million is not None
                    )
                )
            paced = [r for r in rotation if not r.asynchronous]
            for group in ([paced] if args.paced_together else [[r] for r in paced]):
                with contextlib.ExitStack() as stack:
                    scrapes = {
                        r.key: stack.enter_context(_scraping(
                            r.port, args.scrape_interval if r.kind == "karta-proxy" else 0.0))
                        for r in group}
                    changes = {
                        r.key: stack.enter_context(
                            _changing(r.snapshot, args.snapshot_change_interval))
                        for r in group}
                    res.paced.update(run.paced_together(group, ranges[("paced", size)],
                                                        args.rate))
                res.scrapes.update({k: v for k, v in scrapes.items() if v})
                res.snapshot_changes.update({k: len(v) for k, v in changes.items() if v})
            print(
                f"{size}/request paced at {args.rate:g}/s, p99 ms: "
                + "  ".join(
                    f"{k} {_fmt(percentile(p.latencies, 99) * 1e3)}" for k, p in res.paced.items()
                )
                + "".join(
                    f"; {k}: {len(sc)} /metrics scrapes of {median(sc):.2f} s (median)"
                    for k, sc in res.scrapes.items()
                )
                + "".join(
                    f"; {k}: {n} snapshot rewrites"
                    for k, n in res.snapshot_changes.items()
                )
            )
            for r in rotation:
                if r.proc is not None:
                    res.peak_rss[r.key] = peak_rss_bytes(r.proc.pid)
            note_peaks()
            results.append(res)
            if stop:
                break

        taskset: list[dict[str, HcPhase]] = []
        if want_1core and "karta-proxy" in by_key and HC_1CORE in by_key and not stop:
            pair = [by_key["karta-proxy"], by_key[HC_1CORE]]
            # enough connections that the relay, not the senders' round trips, sets the
            # pace: with 4, a relay on 2 cores waits on its senders part of the time
            if args.scaling_senders != args.senders:
                pool.close()
                pool = run.pool = load.SenderPool(bodies, args.scaling_senders)
            for i, chunk in enumerate(_chunks(ranges[("taskset", big)], per_round[big])):
                phases = {}
                for relay in pair if i % 2 == 0 else pair[::-1]:
                    phases[relay.key] = run.phase(relay, chunk)
                taskset.append(phases)
                print(
                    f"scaling round {i + 1}: samples/s "
                    + "  ".join(f"{k} {p.samples_per_second:,.0f}" for k, p in phases.items())
                )
            note_peaks()

        result = _hc_report(args, info, results, relays, taskset, overall_peak, skipped,
                            overall_charged)
        print(f"\ntotal {time.monotonic() - started:.0f}s")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))
        failed = 0
        lost = []
        for size_result in result["sizes"].values():
            for key, row in size_result["relays"].items():
                failed += row["errors"]
                if row["delivered_fraction"] != 1.0:
                    lost.append(key)
        for key, row in info["warmup"].items():
            if row["delivered_fraction"] != 1.0:
                lost.append(f"{key} (warm-up)")
        if failed or lost:
            print(f"errors: {failed} failed requests; incomplete delivery: {lost}", file=sys.stderr)
            return 1
        return 0
    finally:
        if pool is not None:
            pool.close()
        for proc in reversed(procs):
            proc.stop()
        discard_work_dir(work, keep=args.keep)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus",
        choices=("default", "high-cardinality"),
        default="default",
        help="default: the ~5k-pod corpus cycled through, one sender; high-cardinality: "
        "37.5k pods, 2M series each seen once per pass, 4 sender connections, several "
        "request sizes, paced latency, the 1-core vs 2-core row",
    )
    p.add_argument("--requests", type=int, default=None, help="requests per relay per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--series-per-request", type=int, default=2000)
    p.add_argument("--pods", type=int, default=None)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per relay (default: one cycle through all series)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a check, not a figure")
    p.add_argument(
        "--relays",
        default=None,
        help=f"comma-separated subset of {','.join(RELAYS)} (high-cardinality also: "
        f"{HC_RW2}, {HC_1CORE}, and on request only {HC_RW2_V1}: RW 2.0 converted for a "
        "1.0-only upstream)",
    )
    p.add_argument("--json", type=results_path, help="also write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, snapshot)")
    p.add_argument(
        "--profile-proxy",
        type=Path,
        metavar="OUT",
        help="record karta-proxy with py-spy (raw collapsed stacks) during the "
        "rounds and print its hot spots; CPU figures of that run are inflated",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop starting new rounds after this long (default 900; high-cardinality 1800)",
    )
    p.add_argument(
        "--proxy-repo",
        type=Path,
        default=REPO,
        help="checkout whose `python -m proxy` is measured (default: this one), e.g. a "
        "clean clone of the last commit while the working tree is mid-edit",
    )
    hc = p.add_argument_group("high-cardinality mode")
    hc.add_argument("--series", type=int, default=None, help="distinct series per pass")
    hc.add_argument(
        "--sizes", default=None, help="series per request, comma-separated (default 2000,500)"
    )
    hc.add_argument(
        "--samples-per-round",
        type=int,
        default=None,
        help="samples per relay per round and size (default 200000)",
    )
    hc.add_argument("--senders", type=int, default=4, help="sender processes (connections)")
    hc.add_argument("--scaling-senders", type=int, default=8,
                    help="sender processes of the 2-core vs 1-core row: enough that the relay, "
                         "not the senders' round trips, sets the pace")
    hc.add_argument("--rate", type=float, default=20.0, help="requests/s of the paced run")
    hc.add_argument(
        "--paced-requests", type=int, default=None, help="requests per relay of the paced run"
    )
    hc.add_argument(
        "--taskset-rounds",
        type=int,
        default=None,
        help="rounds of the 1-core vs 2-core row (0: skip it)",
    )
    hc.add_argument(
        "--fact-interval",
        type=float,
        default=3600.0,
        help="karta-proxy's facts.interval_seconds (default 3600: its one fact write "
        "at start falls in the warm-up and counts in the peak RSS, and no proxy's "
        "periodic write lands in another relay's phase; 15 is the product's default)",
    )
    hc.add_argument(
        "--scrape-interval",
        type=float,
        default=0.0,
        help="scrape each karta-proxy's /metrics every this many seconds during its paced "
        "run, as a Prometheus scraping it would (0: no scrapes; the page holds the fact "
        "families, ~44 MB at 37.5k pods)",
    )
    hc.add_argument(
        "--paced-together",
        action="store_true",
        help="pace every synchronous relay at once, their requests taking turns, so each "
        "relay's latencies come from the same stretch of the machine's noise (default: one "
        "relay after another, the condition of the p99 target: one relay at 20/s with "
        "nothing else sent meanwhile)",
    )
    hc.add_argument(
        "--snapshot-change-interval",
        type=float,
        default=0.0,
        help="rewrite a copy of the snapshot every this many seconds during each relay's "
        "paced run, 1%% of the pods changed; karta-proxy reads its copy, polled every "
        "second, the others only share the box with the rewriting (0: the snapshot stays "
        "as loaded)",
    )
    hc.add_argument(
        "--warmup-passes",
        type=float,
        default=1.0,
        help="passes through the universe per relay before measuring (default 1)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    if args.max_seconds is None:
        args.max_seconds = 1800.0 if args.corpus == "high-cardinality" else 900.0
    if args.corpus == "high-cardinality":
        return _hc_args(p, args)
    args.requests = args.requests or (10 if quick else 150)
    args.rounds = args.rounds or (2 if quick else 5)
    args.pods = args.pods or (500 if quick else 5000)
    wanted = [r.strip() for r in (args.relays or ",".join(RELAYS)).split(",") if r.strip()]
    unknown = [r for r in wanted if r not in RELAYS]
    if unknown:
        p.error(f"unknown relays {unknown}; choose from {RELAYS}")
    if "direct" not in wanted:
        wanted.insert(0, "direct")
    args.relay_names = wanted
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows when piped to a file
    if args.corpus == "high-cardinality":
        return main_high_cardinality(args)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    procs: list[Process] = []
    try:
        t0 = time.monotonic()
        cluster = corpus_mod.build_cluster(args.pods)
        snapshot = corpus_mod.write_snapshot(cluster, work / "snapshot.yaml")
        stream = corpus_mod.SeriesStream(cluster)
        spr = args.series_per_request
        warmup = args.warmup if args.warmup is not None else math.ceil(stream.universe / spr)
        total = warmup + args.rounds * args.requests
        bodies = [corpus_mod.snappy.compress(stream.next_body(spr)) for _ in range(total)]
        raw_kib = len(stream.next_body(spr)) / 1024
        info = {
            "pods": len(cluster.pods),
            "series_per_request": spr,
            "universe": stream.universe,
            "attributable_fraction": stream.attributable / stream.universe,
            "compressed_kib": sum(map(len, bodies)) / len(bodies) / 1024,
            "raw_kib": raw_kib,
            "warmup": warmup,
            "snapshot_objects": len(cluster.objects),
        }
        print(
            f"corpus: {len(bodies)} requests of {spr} series built in "
            f"{time.monotonic() - t0:.1f}s; work dir {work}"
        )

        relays: list[Relay] = []
        skipped: dict[str, str] = {}
        for name in args.relay_names:
            why = skip_reason(name, args.proxy_repo)
            if why:
                skipped[name] = why
                continue
            up = _start_upstream(name.replace("+", "-"), work)
            procs.append(up)
            proc = None
            if name != "direct":
                proc = _start_relay(name, up, work, snapshot, proxy_repo=args.proxy_repo)
                procs.append(proc)
            relays.append(Relay(name, up, proc, asynchronous=name.startswith("vmagent")))
        for relay in list(relays):
            try:
                relay.upstream.wait_ready(30)
                if relay.proc is not None:
                    relay.proc.wait_ready(180 if relay.name == "karta-proxy" else 60)
            except RuntimeError as exc:
                skipped[relay.name] = f"did not start: {exc}"
                relays.remove(relay)
        print(
            "relays: "
            + ", ".join(
                f"{r.name} (pid {r.proc.pid if r.proc else r.upstream.pid})" for r in relays
            )
        )

        t0 = time.monotonic()
        cold = {}
        for relay in relays:
            phase = run_phase(relay, bodies[:warmup], spr, drain_timeout=120)
            cold[relay.name] = phase.cpu_per_million
        info["warmup_cpu_per_million"] = cold
        print(
            f"warm-up: {warmup} requests through each relay in {time.monotonic() - t0:.1f}s;"
            " CPU-s/M (cold caches): "
            + "  ".join(f"{k} {_fmt(v)}" for k, v in cold.items() if v is not None)
        )

        info["loadavg_before"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
        profiler = _start_profiler(args.profile_proxy, relays)
        rounds: list[dict[str, Phase]] = []
        for r in range(args.rounds):
            if time.monotonic() - started > args.max_seconds:
                print(f"stopping after {r} rounds: --max-seconds reached", file=sys.stderr)
                break
            chunk = bodies[warmup + r * args.requests : warmup + (r + 1) * args.requests]
            order = relays[r % len(relays) :] + relays[: r % len(relays)]
            phases = {}
            for relay in order:
                phases[relay.name] = run_phase(relay, chunk, spr, drain_timeout=60)
            rounds.append(phases)
            line = "  ".join(
                f"{p.relay} {_fmt(p.cpu_per_million)}"
                for p in phases.values()
                if p.cpu_per_million is not None
            )
            print(f"round {r + 1}/{args.rounds}: CPU-s/M {line}")
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                profiler.wait(60)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait()
            print_hot_spots(args.profile_proxy)
        summaries = summarize(rounds, relays)
        result = report(args, info, summaries, rounds, skipped)
        print(f"\ntotal {time.monotonic() - started:.0f}s")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2, default=str))
        failed = sum(s.errors for s in summaries.values())
        lost = [s.relay for s in summaries.values() if s.delivered_fraction < 1.0]
        if failed or lost:
            print(f"errors: {failed} failed requests; incomplete delivery: {lost}", file=sys.stderr)
            return 1
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()
        discard_work_dir(work, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
