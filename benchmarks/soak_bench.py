"""Soak (#9): karta-proxy at 2x its nominal load for ``--duration`` seconds (default 10
minutes), then back at nominal. Not a test: a run to read.

The proxy, the corpus and the senders are ``overload_bench.py``'s (one proxy of
``--proxy-repo`` with ``--slots`` request slots, a null upstream, raw asyncio senders
retrying a 503 after ``--retry-delay``). Three phases:

1. nominal (``--slots`` connections) for ``--baseline-seconds``: samples/s and accepted p50;
2. ``--level`` x nominal for ``--duration``: every ``--sample-every`` seconds a line of
   RSS, samples/s, 503s/s and errors over that window;
3. nominal again for ``--baseline-seconds``, after the overload's connections are gone.

It checks what the issue asks: RSS flat under the overload (the median of the last
minute's samples against the first minute's, and the least-squares slope in MiB/min past
the first minute), no answer other than 2xx or 503 + ``Retry-After`` (no reset, no
timeout, no other status), and full recovery (phase 3's samples/s at least 90% of phase
1's, and its p50 at most 1.25x). Exit code 1 when a check fails.

    python benchmarks/soak_bench.py [--duration 600] [--level 2] [--slots 64]
        [--proxy-repo PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overload_bench import Bench, Load, PhaseResult, add_common, run_phase, running
from relay.procs import rss_bytes
from relay_bench import median, percentile

#: recovery: phase 3 against phase 1
MIN_RECOVERED_THROUGHPUT = 0.90
MAX_RECOVERED_P50 = 1.25


@dataclass
class Sample:
    t: float  # seconds since the overload started
    rss_mib: float
    samples_per_s: float
    refused_per_s: float
    errors: int
    accepted_p50_ms: float


def slope_mib_per_min(points: list[Sample]) -> float:
    """Least-squares slope of RSS over time."""
    if len(points) < 2:
        return 0.0
    xs = [p.t / 60 for p in points]
    ys = [p.rss_mib for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def overload(bench: Bench, args: argparse.Namespace) -> tuple[list[Sample], str]:
    p = bench.proxies[0]
    load = Load(p.proxy.port, bench.requests, round(args.slots * args.level), args.retry_delay)
    load.start()
    t0 = time.monotonic()
    samples: list[Sample] = []
    last_error = ""
    try:
        load.measure()
        while (now := time.monotonic()) - t0 < args.duration:
            window_start = now
            await asyncio.sleep(min(args.sample_every, args.duration - (now - t0)))
            tally = load.measure()
            wall = time.monotonic() - window_start
            s = Sample(
                t=time.monotonic() - t0, rss_mib=rss_bytes(p.proxy.pid) / 2**20,
                samples_per_s=tally.accepted * bench.series_per_request / wall,
                refused_per_s=tally.refused / wall,
                errors=tally.errors + tally.refused_bare,
                accepted_p50_ms=percentile(tally.latencies, 50) * 1e3,
            )
            last_error = tally.last_error or last_error
            samples.append(s)
            print(f"  t={s.t:6.0f}s RSS {s.rss_mib:6.0f} MiB  {s.samples_per_s:8.0f} samples/s "
                  f" {s.refused_per_s:6.0f} 503/s  p50 {s.accepted_p50_ms:6.0f} ms  "
                  f"errors {s.errors}", flush=True)
    finally:
        await load.stop()
    return samples, last_error


async def soak(bench: Bench, args: argparse.Namespace
               ) -> tuple[PhaseResult, list[Sample], str, PhaseResult]:
    p = bench.proxies[0]

    async def nominal() -> PhaseResult:
        return await run_phase(p.proxy, bench.requests, bench.series_per_request, 1.0,
                               args.slots, args.baseline_seconds, args.warmup, args.retry_delay)

    before = await nominal()
    print(f"nominal before: {before.samples_per_s:.0f} samples/s, p50 "
          f"{before.accepted_p50_ms:.0f} ms, RSS {before.rss_end_mib:.0f} MiB", flush=True)
    print(f"{args.level:g}x for {args.duration:g} s:", flush=True)
    samples, last_error = await overload(bench, args)
    await asyncio.sleep(2.0)
    after = await nominal()
    print(f"nominal after: {after.samples_per_s:.0f} samples/s, p50 "
          f"{after.accepted_p50_ms:.0f} ms, RSS {after.rss_end_mib:.0f} MiB", flush=True)
    return before, samples, last_error, after


def verdict(before: PhaseResult, samples: list[Sample], last_error: str,
            after: PhaseResult) -> list[str]:
    """The failed checks (empty: all passed), after printing the summary."""
    first = [s.rss_mib for s in samples if s.t <= 60] or [samples[0].rss_mib]
    last = [s.rss_mib for s in samples if s.t >= samples[-1].t - 60]
    steady = [s for s in samples if s.t > 60] or samples
    slope = slope_mib_per_min(steady)
    errors = sum(s.errors for s in samples) + before.errors + after.errors
    errors += before.refused_bare + after.refused_bare
    tput = after.samples_per_s / before.samples_per_s if before.samples_per_s else 0.0
    p50 = after.accepted_p50_ms / before.accepted_p50_ms if before.accepted_p50_ms else 0.0
    print(f"\nRSS: first minute median {median(first):.0f} MiB, last minute median "
          f"{median(last):.0f} MiB, max {max(s.rss_mib for s in samples):.0f} MiB; slope "
          f"past the first minute {slope:+.2f} MiB/min ({len(steady)} samples)")
    print(f"under overload: {median([s.samples_per_s for s in samples]):.0f} samples/s "
          f"(median of windows; nominal {before.samples_per_s:.0f}), "
          f"{median([s.refused_per_s for s in samples]):.0f} 503/s")
    print(f"errors other than 503 + Retry-After: {errors}"
          + (f" (last: {last_error or before.last_error or after.last_error})" if errors else ""))
    print(f"recovery: samples/s {tput:.2f}x of before, p50 {p50:.2f}x of before")
    failed = []
    if errors:
        failed.append("errors")
    if tput < MIN_RECOVERED_THROUGHPUT or p50 > MAX_RECOVERED_P50:
        failed.append("recovery")
    # flat: the last minute within 10% (or 32 MiB) of the first
    if median(last) > max(median(first) * 1.10, median(first) + 32):
        failed.append("rss")
    print("checks: " + ("all passed" if not failed else "FAILED: " + ", ".join(failed)))
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(p)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of overload")
    p.add_argument("--level", type=float, default=2.0, help="connections / --slots")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds per RSS line")
    p.add_argument("--baseline-seconds", type=float, default=20.0,
                   help="measured seconds at nominal before and after")
    p.add_argument("--warmup", type=float, default=3.0)
    args = p.parse_args(argv)
    args.baseline_repo = None
    print(f"karta-proxy of {args.proxy_repo}: {args.slots} slots; {args.level:g}x for "
          f"{args.duration:g} s; 503 retried after {args.retry_delay:g} s", flush=True)
    # a deferring sink stalls at 1 GiB (null_upstream.DEFER_LIMIT)
    with running(args, "karta-soak-", defer=False) as bench:
        before, samples, last_error, after = asyncio.run(soak(bench, args))
        failed = verdict(before, samples, last_error, after)
        if args.json:
            args.json.write_text(json.dumps({
                "before": asdict(before), "after": asdict(after),
                "samples": [asdict(s) for s in samples], "failed": failed}, indent=1))
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
