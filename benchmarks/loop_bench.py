"""Python calls on the event loop thread per remote-write request: karta-proxy against
the pass-through relay, in one run.

karta-proxy's workers decompress, splice and make the output block in about what the
pass-through's whole request costs; what it spends beyond the pass-through is its event
loop thread (docs/performance.md, "Fourteenth pass"). CPU figures of that thread move
30-70% with this machine's noise from one stretch to the next, so this benchmark counts
what does not move: the Python-level calls the main thread makes per request, each relay
run under ``relay/profiled.py`` (``cProfile`` in thread CPU time, counting only between
the warm-up and the end of the measured requests). Also printed: the profiled CPU per
request (inflated by the profiler's own cost per call; compare the relays, not with
other benchmarks), and the functions and packages whose call counts differ most.

Both relays get the same requests (``relay/corpus.py``: the ~5k-pod corpus as 2,000-series
RW 1.0 requests, snappy) from ``--senders`` connections, saturating, and forward them to a
null upstream; karta-proxy runs on its defaults with fact writes off (they are not per
request).

    python benchmarks/loop_bench.py [--requests 400] [--warmup 100] [--senders 4]
                                    [--series-per-request 2000] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import corpus as corpus_mod
from relay import load
from relay.procs import Process
from relay.workdir import discard_work_dir, results_path
from relay_bench import HERE, _start_relay, _start_upstream

RELAYS = ("pass-through", "karta-proxy")
#: where a function comes from, for the per-package lines: its file's path after these
_SITE = re.compile(r".*/(?:site-packages|python3\.\d+)/")


@dataclass
class LoopCount:
    """One relay's event loop thread over the measured requests."""

    relay: str
    requests: int
    errors: int
    #: calls per request, by function (``file:line(name)``)
    calls: dict[str, float]
    #: profiled CPU of the thread per request, ms (the profiler's cost included)
    cpu_ms: float

    @property
    def calls_per_request(self) -> float:
        return sum(self.calls.values())


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":  # a C function: its name says what it is
        return name
    return f"{_SITE.sub('', path).replace(os.sep, '/')}:{line}({name})"


def package(where: str) -> str:
    """The package a :func:`_where` key belongs to: ``proxy``, ``aiohttp``, ``asyncio``,
    ``prometheus_client``, ...; ``builtins`` for C functions."""
    if ":" not in where:
        return "builtins"
    path = where.split(":", 1)[0]
    if "/proxy/" in f"/{path}":
        return "proxy"
    if path.startswith("/"):  # neither installed nor the standard library: its folder
        return Path(path).parent.name
    head = path.split("/", 1)[0]
    return head.removesuffix(".py")


def read_stats(path: Path, requests: int) -> tuple[dict[str, float], float]:
    """Calls per request by function, and profiled CPU per request (ms), from a
    ``cProfile`` dump of ``requests`` requests."""
    stats = pstats.Stats(str(path))
    raw: Mapping[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    calls: Counter[str] = Counter()
    for key, (_, ncalls, *_rest) in raw.items():
        calls[_where(key)] += ncalls / requests
    total: float = stats.total_tt  # type: ignore[attr-defined]
    return dict(calls), total / requests * 1e3


def count_relay(name: str, work: Path, snapshot: Path, pool: load.SenderPool,
                warmup: range, measured: range) -> LoopCount:
    """Start ``name`` under the profiler, warm it up, count its loop over ``measured``."""
    out = work / f"{name}.prof"
    upstream = _start_upstream(name, work)
    procs: list[Process] = [upstream]
    try:
        upstream.wait_ready(30)
        relay = _start_relay(name, upstream, work, snapshot, proxy_args=("--no-facts",),
                             wrap=(str(HERE / "relay" / "profiled.py"), str(out)))
        procs.append(relay)
        relay.wait_ready(120)
        res = pool.run(relay.port, "v1", warmup)
        os.kill(relay.pid, signal.SIGUSR1)
        res = pool.run(relay.port, "v1", measured)
        os.kill(relay.pid, signal.SIGUSR2)
        done = out.with_name(out.name + ".done")
        deadline = time.monotonic() + 60
        while not done.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no profile written: {relay.log_tail()}")
            time.sleep(0.05)
        calls, cpu_ms = read_stats(out, len(measured))
        return LoopCount(name, len(measured), res.errors, calls, cpu_ms)
    finally:
        for p in reversed(procs):
            p.stop()


def report(counts: dict[str, LoopCount], top: int) -> dict[str, Any]:
    pt, kp = counts["pass-through"], counts["karta-proxy"]
    print(f"{'relay':<14}{'calls/request':>15}{'profiled CPU ms/request':>26}{'errors':>8}")
    for c in (pt, kp):
        print(f"{c.relay:<14}{c.calls_per_request:>15,.0f}{c.cpu_ms:>26.2f}{c.errors:>8}")
    ratio = kp.calls_per_request / pt.calls_per_request if pt.calls_per_request else float("nan")
    print(f"karta-proxy / pass-through: {ratio:.2f}x the calls on the event loop thread "
          "(the pass-through's count includes its codec calls, done on that thread)")

    def by_package(c: LoopCount) -> dict[str, float]:
        out: dict[str, float] = {}
        for where, n in c.calls.items():
            out[package(where)] = out.get(package(where), 0.0) + n
        return out

    pk, pp = by_package(kp), by_package(pt)
    print("\nby package, calls per request (karta-proxy / pass-through):")
    for pkg in sorted(set(pk) | set(pp), key=lambda k: pp.get(k, 0.0) - pk.get(k, 0.0))[:top]:
        a, b = pk.get(pkg, 0.0), pp.get(pkg, 0.0)
        print(f"  {pkg:<22}{a:>8.1f}{b:>8.1f}{a - b:>+9.1f}")
    diff = {w: kp.calls.get(w, 0.0) - pt.calls.get(w, 0.0) for w in set(kp.calls) | set(pt.calls)}
    print(f"\nthe {top} functions karta-proxy's loop calls most more often, per request:")
    for where, d in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {d:>+8.1f}  {where}")
    return {
        "relays": {c.relay: {"calls_per_request": c.calls_per_request, "cpu_ms": c.cpu_ms,
                             "errors": c.errors, "requests": c.requests,
                             "by_package": by_package(c)} for c in (pt, kp)},
        "calls_ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400, help="measured requests per relay")
    p.add_argument("--warmup", type=int, default=100, help="requests per relay before counting")
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--series-per-request", type=int, default=2000)
    p.add_argument("--pods", type=int, default=5000)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", type=results_path)
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, profiles)")
    p.add_argument("--quick", action="store_true", help="small sizes: a check, not a figure")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.pods, args.series_per_request = 20, 5, 200, 200
    work = Path(tempfile.mkdtemp(prefix="loop-bench-"))
    pool: load.SenderPool | None = None
    try:
        cluster = corpus_mod.build_cluster(args.pods)
        snapshot = corpus_mod.write_snapshot(cluster, work / "snapshot.yaml")
        corpus = corpus_mod.build_corpus(cluster, args.warmup + args.requests,
                                         args.series_per_request)
        pool = load.SenderPool({"v1": corpus.bodies}, args.senders)
        warmup, measured = range(args.warmup), range(args.warmup, args.warmup + args.requests)
        print(f"corpus: {args.pods:,} pods, {args.requests} measured requests of "
              f"{args.series_per_request:,} series (after {args.warmup} warm-up requests) per "
              f"relay, {args.senders} sender connections; work dir {work}")
        counts = {name: count_relay(name, work, snapshot, pool, warmup, measured)
                  for name in RELAYS}
        result = report(counts, args.top)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        failed = sum(c.errors for c in counts.values())
        if failed:
            print(f"{failed} requests failed", file=sys.stderr)
            return 1
        return 0
    finally:
        if pool is not None:
            pool.close()
        discard_work_dir(work, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
