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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import corpus as corpus_mod
from relay.procs import Process, free_port, http_get

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


def _start_upstream(name: str, work: Path) -> Process:
    port = free_port()
    return Process(
        f"{name} upstream",
        [sys.executable, str(HERE / "relay" / "null_upstream.py"), "--listen", f"127.0.0.1:{port}"],
        port=port,
        ready_path="/-/ready",
        log_path=work / f"{name}-upstream.log",
    )


def _start_relay(name: str, upstream: Process, work: Path, snapshot: Path) -> Process:
    port = free_port()
    url = f"http://127.0.0.1:{upstream.port}{WRITE_PATH}"
    log = work / f"{name}.log"
    if name == "pass-through":
        argv = [
            sys.executable,
            str(HERE / "relay" / "passthrough.py"),
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream-url",
            url,
        ]
        return Process(name, argv, port=port, ready_path="/-/ready", log_path=log)
    if name == "karta-proxy":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        argv = [
            sys.executable,
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
        ]
        return Process(
            name, argv, port=port, ready_path="/-/ready", log_path=log, cwd=REPO, env=env
        )
    vmagent = shutil.which("vmagent")
    assert vmagent is not None
    data = work / f"{name}-data"
    argv = [
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


def skip_reason(name: str) -> str:
    if name.startswith("vmagent") and shutil.which("vmagent") is None:
        return "vmagent binary not found"
    if name == "karta-proxy" and not (REPO / "proxy" / "cli.py").exists():
        return "proxy/cli.py not present yet"
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
    if sender.errors:
        print(
            f"  ! {relay.name}: {sender.errors} failed requests, last: {sender.last_error}",
            file=sys.stderr,
        )
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


def ratio(rounds: list[dict[str, Phase]], a: str, b: str) -> float:
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
    mach = machine()
    print(
        f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory']}; Python "
        f"{mach['python']}; vmagent {mach['vmagent'] or '-'}; load average before rounds "
        f"{info.get('loadavg_before', '-')}, at end {mach['loadavg_at_end']}"
    )
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


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        "--relays", default=",".join(RELAYS), help=f"comma-separated subset of {','.join(RELAYS)}"
    )
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, snapshot)")
    p.add_argument(
        "--profile-proxy",
        type=Path,
        metavar="OUT",
        help="record karta-proxy with py-spy (raw collapsed stacks) during the "
        "rounds and print its hot spots; CPU figures of that run are inflated",
    )
    p.add_argument(
        "--max-seconds", type=float, default=900.0, help="stop starting new rounds after this long"
    )
    args = p.parse_args(argv)
    quick = args.quick
    args.requests = args.requests or (10 if quick else 150)
    args.rounds = args.rounds or (2 if quick else 5)
    args.pods = args.pods or (500 if quick else 5000)
    wanted = [r.strip() for r in args.relays.split(",") if r.strip()]
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
            why = skip_reason(name)
            if why:
                skipped[name] = why
                continue
            up = _start_upstream(name.replace("+", "-"), work)
            procs.append(up)
            proc = None
            if name != "direct":
                proc = _start_relay(name, up, work, snapshot)
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
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
