"""Overload shedding (#9 item 8): useful throughput of karta-proxy at nominal load and at
2x and 4x more connections than it has request slots, all sending as fast as they are
answered.

One karta-proxy (``python -m proxy`` of ``--proxy-repo``, on the relay benchmark's
cluster snapshot, with ``server.max_concurrent_requests: --slots``) relays to a null
upstream (``relay/null_upstream.py --defer``: it answers 204 at once). The senders are
raw asyncio connections in this process, one request at a time each, sending the relay
benchmark's pre-built, snappy-compressed RW 1.0 bodies (``relay/corpus.py``). A refused
request (503) is sent again after ``--retry-delay`` seconds (fast-retrying senders are
the hard case: a sender that waits ``Retry-After`` makes shedding nearly free), on the
same connection, or on a new one when the answer said ``Connection: close``.

Per phase (one load level for ``--seconds`` after ``--warmup`` seconds): useful samples/s
(series of 2xx answers / wall time), p50 / p99 latency of the accepted requests, 503s/s,
any other answer or connection error (must be 0: only 503 + ``Retry-After`` is a correct
refusal), new connections/s, the proxy's CPU per accepted million samples, its RSS at the
end and its peak (``VmHWM``, reset per phase). The levels run in rotating order, ``--rounds``
times; printed are medians over rounds and per-round ratios to nominal, medianed.

    python benchmarks/overload_bench.py [--slots 64] [--levels 1,2,4] [--seconds 20]
        [--rounds 3] [--proxy-repo PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import corpus as corpus_mod
from relay.procs import Process, cpu_seconds, http_get, peak_rss_bytes, reset_peak_rss, rss_bytes
from relay.workdir import discard_work_dir, results_path
from relay_bench import REPO, WRITE_PATH, _start_relay, _start_upstream, median, percentile

HEADERS = (
    "Content-Type: application/x-protobuf\r\nContent-Encoding: snappy\r\n"
    "X-Prometheus-Remote-Write-Version: 0.1.0\r\nUser-Agent: karta-overload-bench/1\r\n"
)


def request_bytes(body: bytes) -> bytes:
    """One keep-alive POST of ``body``, headers and body in one buffer."""
    head = (f"POST {WRITE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n{HEADERS}"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


@dataclass
class Tally:
    """What the senders saw over one measured window."""

    accepted: int = 0
    refused: int = 0
    #: 503s without a Retry-After
    refused_bare: int = 0
    #: any other status, a reset or a broken answer
    errors: int = 0
    connects: int = 0
    last_error: str = ""
    latencies: list[float] = field(default_factory=list)


class Load:
    """``connections`` senders looping over the bodies until ``stop``; the tally is
    switched by ``measure`` so warm-up answers are not counted."""

    def __init__(self, port: int, requests: Sequence[bytes], connections: int,
                 retry_delay: float) -> None:
        self.port = port
        self._requests = requests
        self._next: Iterator[int] = itertools.cycle(range(len(requests)))
        self.connections = connections
        self.retry_delay = retry_delay
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._sender()) for _ in range(self.connections)]

    def measure(self) -> Tally:
        """Start a new tally; return the previous one."""
        old, self.tally = self.tally, Tally()
        return old

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 30)
        for t in self._tasks:
            t.cancel()

    async def _sender(self) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while not self._stop.is_set():
            if conn is None:
                try:
                    conn = await asyncio.open_connection("127.0.0.1", self.port)
                except OSError as e:
                    self._error(f"connect: {e!r}")
                    await asyncio.sleep(self.retry_delay)
                    continue
                self.tally.connects += 1
            reader, writer = conn
            t0 = time.monotonic()
            try:
                writer.write(self._requests[next(self._next)])
                status, retry_after, close = await asyncio.wait_for(_answer(reader), 60)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as e:
                self._error(repr(e))
                writer.close()
                conn = None
                await asyncio.sleep(self.retry_delay)
                continue
            tally = self.tally
            if status // 100 == 2:
                tally.accepted += 1
                tally.latencies.append(time.monotonic() - t0)
            elif status == 503:
                tally.refused += 1
                if not retry_after:
                    tally.refused_bare += 1
            else:
                self._error(f"HTTP {status}")
            if close:
                writer.close()
                conn = None
            if status // 100 != 2:
                await asyncio.sleep(self.retry_delay)
        if conn is not None:
            conn[1].close()

    def _error(self, why: str) -> None:
        self.tally.errors += 1
        self.tally.last_error = why


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bool, bool]:
    """(status, has Retry-After, the server closes) of one response, its body read."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    retry_after = close = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "retry-after":
            retry_after = bool(value.strip())
        elif name == "connection":
            close = value.strip().lower() == "close"
    if length:
        await reader.readexactly(length)
    return status, retry_after, close


@dataclass
class PhaseResult:
    level: float
    connections: int
    seconds: float
    samples_per_s: float
    accepted_p50_ms: float
    accepted_p99_ms: float
    refused_per_s: float
    refused_bare: int
    errors: int
    last_error: str
    connects_per_s: float
    cpu_per_million: float
    rss_end_mib: float
    rss_peak_mib: float


async def run_phase(proxy: Process, requests: Sequence[bytes], series: int, level: float,
                    slots: int, seconds: float, warmup: float, retry_delay: float
                    ) -> PhaseResult:
    connections = max(1, round(slots * level))
    load = Load(proxy.port, requests, connections, retry_delay)
    load.start()
    await asyncio.sleep(warmup)
    reset_peak_rss(proxy.pid)
    cpu0 = cpu_seconds(proxy.pid)
    load.measure()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    tally = load.measure()
    wall = time.monotonic() - t0
    cpu = cpu_seconds(proxy.pid) - cpu0
    rss_end, rss_peak = rss_bytes(proxy.pid), peak_rss_bytes(proxy.pid)
    await load.stop()
    samples = tally.accepted * series
    return PhaseResult(
        level=level, connections=connections, seconds=wall,
        samples_per_s=samples / wall,
        accepted_p50_ms=percentile(tally.latencies, 50) * 1e3,
        accepted_p99_ms=percentile(tally.latencies, 99) * 1e3,
        refused_per_s=tally.refused / wall, refused_bare=tally.refused_bare,
        errors=tally.errors, last_error=tally.last_error,
        connects_per_s=tally.connects / wall,
        cpu_per_million=cpu / samples * 1e6 if samples else math.nan,
        rss_end_mib=rss_end / 2**20, rss_peak_mib=rss_peak / 2**20,
    )


@dataclass
class Proxied:
    """One proxy under test (``name``: this checkout or the baseline) and its upstream."""

    name: str
    proxy: Process
    upstream: Process

    def stop(self) -> None:
        self.proxy.stop()
        self.upstream.stop()


@dataclass
class Bench:
    """The proxies under test, and the request buffers to send."""

    proxies: list[Proxied]
    requests: list[bytes]
    series_per_request: int
    work: Path

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()


@contextlib.contextmanager
def running(args: argparse.Namespace, prefix: str, *, defer: bool = True) -> Iterator[Bench]:
    """``start`` in a fresh work directory; on the way out the proxies stop before the
    directory (their logs) goes, whatever ended the run."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    bench = None
    try:
        bench = start(args, work, defer=defer)
        yield bench
    finally:
        if bench is not None:
            bench.stop()
        discard_work_dir(work, keep=args.keep)


def start(args: argparse.Namespace, work: Path, *, defer: bool = True) -> Bench:
    """Build the corpus, start a null upstream and a proxy (``--slots`` slots) for
    ``--proxy-repo`` and, with ``--baseline-repo``, for that checkout too.

    ``defer``: the sink counts only when asked (``GET /stats``, after every phase), so it
    costs the box nothing during a phase; it drains by itself at 1 GiB pending, a
    multi-second stall of the upstream, so a long run (the soak) has it count as it goes
    instead."""
    cluster = corpus_mod.build_cluster(args.pods)
    snapshot = corpus_mod.write_snapshot(cluster, work / "snapshot.yaml")
    corpus = corpus_mod.build_corpus(cluster, args.bodies, args.series_per_request)
    repos = [("this", args.proxy_repo, args.this_slots or args.slots, args.admission_wait)]
    if args.baseline_repo is not None:
        repos.append(("baseline", args.baseline_repo, args.slots, args.baseline_admission_wait))
    bench = Bench([], [request_bytes(b) for b in corpus.bodies], args.series_per_request, work)
    try:
        for name, repo, slots, wait in repos:
            config = work / f"overload-{name}.yaml"
            # no admission_wait_seconds line unless asked: a checkout older than the
            # setting refuses a config that names it
            config.write_text(f"server:\n  max_concurrent_requests: {slots}\n" + (
                f"  admission_wait_seconds: {wait}\n" if wait is not None else ""))
            upstream = _start_upstream(name, work, defer=defer)
            upstream.wait_ready(30)
            proxy = _start_relay("karta-proxy", upstream, work, snapshot, proxy_repo=repo,
                                 log_name=f"karta-proxy-{name}",
                                 proxy_args=["--config", str(config), "--no-facts"])
            bench.proxies.append(Proxied(name, proxy, upstream))
            proxy.wait_ready(180)
    except BaseException:
        bench.stop()
        raise
    return bench


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared with ``soak_bench.py``."""
    p.add_argument("--slots", type=int, default=64,
                   help="server.max_concurrent_requests of the proxy (nominal connections)")
    p.add_argument("--this-slots", type=int, default=0,
                   help="max_concurrent_requests of --proxy-repo's proxy only (default "
                        "--slots; the levels stay multiples of --slots)")
    p.add_argument("--admission-wait", type=float, default=None,
                   help="server.admission_wait_seconds of --proxy-repo's proxy (default: "
                        "not set, the checkout's default)")
    p.add_argument("--baseline-admission-wait", type=float, default=None,
                   help="the same for --baseline-repo's proxy")
    p.add_argument("--retry-delay", type=float, default=0.05,
                   help="seconds a sender waits after a 503 before sending again")
    p.add_argument("--pods", type=int, default=5000)
    p.add_argument("--bodies", type=int, default=200, help="distinct request bodies")
    p.add_argument("--series-per-request", type=int, default=2000)
    p.add_argument("--proxy-repo", type=Path, default=REPO,
                   help="the checkout whose python -m proxy is measured")
    p.add_argument("--baseline-repo", type=Path, default=None,
                   help="also measure this checkout's proxy, alternating, and compare")
    p.add_argument("--json", type=results_path, help="also write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, snapshot)")


def report(rounds: list[dict[float, PhaseResult]], levels: list[float], name: str) -> None:
    def med(level: float, attr: str) -> float:
        return median([getattr(r[level], attr) for r in rounds])

    def ratio(level: float, attr: str) -> float:
        return median([getattr(r[level], attr) / getattr(r[levels[0]], attr) for r in rounds
                       if getattr(r[levels[0]], attr)])

    print(f"\n{name}: medians over {len(rounds)} round(s); ratio = per round against "
          f"{levels[0]:g}x, medianed")
    cols = ("level", "conns", "samples/s", "ratio", "p50 ms", "ratio", "p99 ms", "503/s",
            "errors", "conn/s", "CPU-s/M", "RSS MiB", "peak MiB")
    print(("{:>7} " * len(cols)).format(*cols))
    for lv in levels:
        errors = sum(r[lv].errors + r[lv].refused_bare for r in rounds)
        print(("{:>7} " * len(cols)).format(
            f"{lv:g}x", rounds[0][lv].connections, f"{med(lv, 'samples_per_s'):.0f}",
            f"{ratio(lv, 'samples_per_s'):.2f}", f"{med(lv, 'accepted_p50_ms'):.0f}",
            f"{ratio(lv, 'accepted_p50_ms'):.2f}", f"{med(lv, 'accepted_p99_ms'):.0f}",
            f"{med(lv, 'refused_per_s'):.0f}", errors, f"{med(lv, 'connects_per_s'):.1f}",
            f"{med(lv, 'cpu_per_million'):.2f}", f"{med(lv, 'rss_end_mib'):.0f}",
            f"{med(lv, 'rss_peak_mib'):.0f}"))
    for r in rounds:
        for lv in levels:
            if r[lv].errors:
                print(f"  ! {name} {lv:g}x: {r[lv].errors} errors, last: {r[lv].last_error}",
                      file=sys.stderr)


def compare(this: list[dict[float, PhaseResult]], base: list[dict[float, PhaseResult]],
            levels: list[float]) -> None:
    """this / baseline per round (same round, same level), medianed."""
    print("\nthis / baseline (per round, medianed)")
    attrs = ("samples_per_s", "accepted_p50_ms", "accepted_p99_ms", "cpu_per_million",
             "rss_peak_mib")
    print(("{:>16} " * (len(attrs) + 1)).format("level", *attrs))
    for lv in levels:
        row = [median([getattr(a[lv], x) / getattr(b[lv], x) for a, b in zip(this, base,
                                                                              strict=True)
                       if getattr(b[lv], x)]) for x in attrs]
        print(("{:>16} " * (len(attrs) + 1)).format(f"{lv:g}x", *(f"{v:.2f}" for v in row)))


Rounds = dict[str, list[dict[float, PhaseResult]]]


async def main_async(args: argparse.Namespace, bench: Bench) -> Rounds:
    """Every round: every proxy (in turn, first one first on odd rounds) at every level
    (rotating)."""
    levels = args.levels
    out: Rounds = {p.name: [] for p in bench.proxies}
    for i in range(args.rounds):
        order = levels[i % len(levels):] + levels[: i % len(levels)]
        proxies = bench.proxies if i % 2 == 0 else bench.proxies[::-1]
        for p in proxies:
            result: dict[float, PhaseResult] = {}
            for lv in order:
                result[lv] = await run_phase(p.proxy, bench.requests, bench.series_per_request,
                                             lv, args.slots, args.seconds, args.warmup,
                                             args.retry_delay)
                r = result[lv]
                print(f"  round {i + 1} {p.name} {lv:g}x: {r.samples_per_s:.0f} samples/s, "
                      f"p50 {r.accepted_p50_ms:.0f} ms, {r.refused_per_s:.0f} 503/s, "
                      f"{r.errors} errors, RSS {r.rss_end_mib:.0f} MiB", flush=True)
                # let refused connections and lingering bodies go; the sink counts what
                # it kept, outside the measurement
                await asyncio.to_thread(http_get, p.upstream.port, "/stats", 300.0)
                await asyncio.sleep(1.0)
            out[p.name].append(result)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(p)
    p.add_argument("--levels", default="1,2,4",
                   help="connections as multiples of --slots, the first is the baseline")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds per phase")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    args.levels = [float(x) for x in args.levels.split(",")]
    print(f"karta-proxy of {args.proxy_repo}: {args.slots} slots; levels "
          f"{args.levels} x {args.slots} connections; {args.series_per_request} series "
          f"per request; 503 retried after {args.retry_delay:g} s", flush=True)
    with running(args, "karta-overload-") as bench:
        rounds = asyncio.run(main_async(args, bench))
        for name, rs in rounds.items():
            report(rs, args.levels, name)
        if "baseline" in rounds:
            compare(rounds["this"], rounds["baseline"], args.levels)
        if args.json:
            args.json.write_text(json.dumps(
                {name: [{str(k): asdict(v) for k, v in r.items()} for r in rs]
                 for name, rs in rounds.items()}, indent=1))
        bad = sum(r[lv].errors + r[lv].refused_bare
                  for rs in rounds.values() for r in rs for lv in args.levels)
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
