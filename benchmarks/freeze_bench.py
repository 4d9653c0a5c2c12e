"""What the fact writer's collection before each write costs, at scale.

Each write (and standby walk, and snapshot reload) freezes what is alive at its end
(``proxy.memory.freeze_survivors``, so the fact cache stays out of full collections), and
first collects what is not frozen (``memory.collect_unfrozen``), so that a reference cycle
already garbage is not frozen for good. That collection walks only what came since the
last freeze. Measured here on an index of ``--pods`` pods (``facts_bench.build_index``)
whose fact cache a real build made: each round leaves what an interval leaves (small
survivors and tracebacks), then times the collection where the writer makes it (before
the build) against where it would otherwise go (after the build, before the freeze: it
then walks the new cache too).

    python benchmarks/freeze_bench.py [--pods 37500] [--workloads 1000] [--rounds 6]
                                      [--survivors 5000] [--tracebacks 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facts_bench import build_index

from proxy import memory
from proxy.config import FactSettings
from proxy.facts import FactWriter


async def _unused_send(body: bytes) -> None:  # the build only: nothing is sent
    raise AssertionError("freeze_bench sends nothing")


def interval_leftovers(survivors: int, tracebacks: int) -> list[Any]:
    """What an interval leaves beside the frozen heap: small live objects, and exceptions
    whose tracebacks form cycles once dropped (a broken watch stream's)."""
    for i in range(tracebacks):
        _fail(i)
    return [{"k": i, "v": [i]} for i in range(survivors)]


def _fail(i: int) -> None:
    """Leaves a cycle: the frame holds the exception, whose traceback holds the frame."""
    try:
        raise ValueError(i)
    except ValueError as e:
        err = e  # noqa: F841 - kept in the frame on purpose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=37_500)
    ap.add_argument("--workloads", type=int, default=1_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--survivors", type=int, default=5_000)
    ap.add_argument("--tracebacks", type=int, default=300)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    index = build_index(a.pods, a.workloads)
    writer = FactWriter(FactSettings(), index, _unused_send)
    memory.collect_and_freeze()  # as a source's first load leaves it
    before_build: list[float] = []
    after_build: list[float] = []
    for _ in range(a.rounds):
        leftovers = interval_leftovers(a.survivors, a.tracebacks)
        started = time.perf_counter()
        memory.collect_unfrozen()  # where the writer collects
        before_build.append(time.perf_counter() - started)
        for _body in writer.iter_requests(int(time.time() * 1000)):
            pass
        started = time.perf_counter()
        gc.collect()  # where it would otherwise: the new cache walked too
        after_build.append(time.perf_counter() - started)
        memory.freeze_survivors()
        del leftovers
    result = {
        "pods": a.pods, "rounds": a.rounds, "survivors": a.survivors,
        "tracebacks": a.tracebacks,
        "before_build_ms": statistics.median(before_build) * 1e3,
        "before_build_max_ms": max(before_build) * 1e3,
        "after_build_ms": statistics.median(after_build) * 1e3,
        "after_build_max_ms": max(after_build) * 1e3,
    }
    print(f"{a.pods:,} pods, {a.rounds} rounds, {a.survivors:,} survivors and "
          f"{a.tracebacks} tracebacks an interval")
    print(f"collection before the build (as the writer does): median "
          f"{result['before_build_ms']:.2f} ms, max {result['before_build_max_ms']:.2f}")
    print(f"collection after the build, before the freeze:    median "
          f"{result['after_build_ms']:.2f} ms, max {result['after_build_max_ms']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
