"""Where karta-proxy's memory goes at start, phase by phase (#8's peak RSS target).

The phases are the ones ``proxy.runtime.Proxy.start`` goes through with ``--snapshot``,
run in this process on the parts the runtime builds (engine with the built-in
descriptions, index, native splice's pod table, fact writer), in the runtime's order:

1. ``import``: the proxy's modules and the empty parts;
2. ``snapshot parse``: ``read_snapshot`` (JSON List read one item at a time, pods slimmed);
3. ``engine``: ``apply_content``, every object through the Karta engine;
4. ``index fill``: ``PodIndex.apply`` of the engine's change set;
5. ``pod table fill``: the ``Enricher`` filling the native splice's per-pod table;
6. ``source settled``: what ``SnapshotSource`` keeps once ``start`` returns (stubs of
   the objects, and the freed heap handed back: ``proxy.memory.trim``);
7. ``first fact write``: ``FactWriter.iter_requests``, each body dropped once made (as
   ``write_once`` sends them);
8. ``metrics scrape``: one ``/metrics`` page as the server writes it
   (``proxy.exposition.chunks`` over the runtime's registry: the proxy's metrics, the
   facts, the writer's metrics), each chunk dropped once made;
9. ``malloc_trim``: ``proxy.memory.trim`` once more (what handing back the heap the
   fact write and the scrape freed would buy).

Per phase: RSS after it, the phase's own peak RSS (``VmHWM`` reset with ``clear_refs``
before it), and with ``--tracemalloc`` the Python heap after it, its peak, and the top
allocation sites of what the phase left alive. tracemalloc slows the run ~3x and adds
its own bookkeeping to RSS, so RSS figures come from a run without it.

``--process`` measures the real thing instead: ``python -m proxy --snapshot`` with its
defaults against a null upstream (``relay/null_upstream.py``), ``VmHWM`` from ``/proc``
once it is ready and its first fact write has landed, after one ``/metrics`` scrape, and
(``--writes N``, with ``facts.interval_seconds`` set to ``--interval``) after N more
writes and another scrape.

The default snapshot is the high-cardinality benchmark's cluster (``relay/highcard.py``:
``corpus.build_cluster(37500, long_names=True)`` written as a JSON List), built once and
cached under ``--work``.

    python3 benchmarks/memory_bench.py [--pods 37500] [--tracemalloc] [--snapshot PATH]
    python3 benchmarks/memory_bench.py --process [--writes 10 --interval 6]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MB = 1024 * 1024


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class Phase:
    name: str
    rss: int
    peak: int
    seconds: float
    traced: int = 0
    traced_peak: int = 0
    top: str = ""


class Meter:
    """Measures one phase at a time: RSS, the phase's own peak, optionally tracemalloc."""

    def __init__(self, trace: bool, top: int) -> None:
        self.trace = trace
        self.top = top
        self.phases: list[Phase] = []
        self._snap: tracemalloc.Snapshot | None = None
        if trace:
            tracemalloc.start(1)
            self._snap = tracemalloc.take_snapshot()

    def begin(self) -> float:
        _reset_peak()
        if self.trace:
            tracemalloc.reset_peak()
        return time.perf_counter()

    def end(self, name: str, started: float) -> None:
        seconds = time.perf_counter() - started
        gc.collect()
        ph = Phase(name, _status("VmRSS"), _status("VmHWM"), seconds)
        if self.trace:
            ph.traced, ph.traced_peak = tracemalloc.get_traced_memory()
            snap = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__),)
            )
            if self._snap is not None:
                diff = snap.compare_to(self._snap, "lineno")[: self.top]
                ph.top = "\n".join(
                    f"      {d.size_diff / MB:+8.1f} MB {d.count_diff:+9d} blocks  "
                    f"{d.traceback[0].filename.split('/work/main/')[-1]}:{d.traceback[0].lineno}"
                    for d in diff
                    if abs(d.size_diff) >= 512 * 1024
                )
            self._snap = snap
        self.phases.append(ph)
        print(self.line(ph), flush=True)
        if ph.top:
            print(ph.top, flush=True)

    def line(self, ph: Phase) -> str:
        out = f"{ph.name:<20} rss {ph.rss / MB:7.1f} MB  peak {ph.peak / MB:7.1f} MB  "
        out += f"{ph.seconds:6.2f} s"
        if self.trace:
            out += f"  heap {ph.traced / MB:7.1f} MB  heap peak {ph.traced_peak / MB:7.1f} MB"
        return out


def _snapshot(args: argparse.Namespace) -> Path:
    if args.snapshot:
        return Path(args.snapshot)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"highcard-{args.pods}.json"
    if not path.exists():
        from relay import corpus, highcard

        cluster = corpus.build_cluster(args.pods, seed=7, long_names=True)
        highcard.write_snapshot_json(cluster, path)
        del cluster
    return path


def run(args: argparse.Namespace) -> list[Phase]:
    snapshot = _snapshot(args)
    print(f"snapshot {snapshot} ({snapshot.stat().st_size / MB:.1f} MB)", flush=True)
    gc.collect()
    start_rss = _status("VmRSS")
    m = Meter(args.tracemalloc, args.top)
    t = m.begin()
    from proxy import exposition, memory
    from proxy.config import FactSettings, Settings
    from proxy.enrichment import Enricher
    from proxy.facts import FactsCollector, FactWriter, FactWriterCollector
    from proxy.index import PodIndex
    from proxy.karta.engine import Engine
    from proxy.metrics import ProxyMetrics
    from proxy.snapshot import SnapshotSource, apply_content, read_snapshot

    settings = Settings()
    index = PodIndex(tombstone_seconds=settings.karta.tombstone_seconds)
    engine = Engine(builtins=settings.karta.builtins,
                    max_owner_hops=settings.karta.max_owner_hops)
    m.end("import", t)

    t = m.begin()
    content = read_snapshot(snapshot, packed=True)  # as SnapshotSource reads it
    m.end("snapshot parse", t)

    t = m.begin()
    report = apply_content(content, engine)
    m.end("engine", t)

    t = m.begin()
    index.apply(report.changes)
    index.ready = True  # loaded, as SnapshotSource.start marks it (the facts need it)
    m.end("index fill", t)

    t = m.begin()
    enricher = Enricher(index, list(settings.enrich.pod_label_pairs),
                        conflict_policy=settings.enrich.conflict_policy,
                        pod_label_rules=settings.enrich.pod_label_rules)
    m.end("pod table fill", t)

    t = m.begin()
    # what SnapshotSource.start keeps: its change set goes with the report, the content
    # stays only as the source keeps it (SnapshotSource.retain)
    source = SnapshotSource(str(snapshot), engine, index)
    source._content, source.report = content.compact(), report
    del content, report
    memory.trim()  # as SnapshotSource.start does once the objects' texts are freed
    m.end("source settled", t)

    t = m.begin()
    writer = FactWriter(FactSettings(), index, _no_send)
    size = 0
    for body in writer.iter_requests(int(time.time() * 1000)):  # as write_once sends them
        size += len(body)
        del body
    series = writer.last_series
    writer.commit()
    m.end("first fact write", t)
    print(f"{'':<20} {series:,} fact series, {size / MB:.1f} MB of bodies", flush=True)

    t = m.begin()
    registry = ProxyMetrics().registry  # as Proxy._make_facts registers them
    registry.register(FactsCollector(index, pod_facts=settings.facts.metrics_pod_facts))
    registry.register(FactWriterCollector(writer))
    size = 0
    for chunk in exposition.chunks(registry):  # as the /metrics view writes them
        size += len(chunk)
        del chunk
    m.end("metrics scrape", t)
    print(f"{'':<20} {size / MB:.1f} MB of text", flush=True)

    t = m.begin()
    trimmed = memory.trim()
    m.end("malloc_trim" if trimmed else "malloc_trim (none)", t)

    peak = max(p.peak for p in m.phases)
    print(f"\nprocess at start {start_rss / MB:.1f} MB; peak over the phases "
          f"{peak / MB:.1f} MB; settled {m.phases[-1].rss / MB:.1f} MB "
          f"({len(index):,} pods in the index)", flush=True)
    # keep the parts alive until here, as a running proxy does
    del enricher, writer, engine, source
    return m.phases


async def _no_send(body: bytes) -> None:
    return None


def run_process(args: argparse.Namespace) -> dict[str, float]:
    """VmHWM / VmRSS (MiB) of ``python -m proxy --snapshot`` at the points named above."""
    import json
    import tempfile

    from relay.procs import Process, free_port, http_get

    snapshot = _snapshot(args)
    work = Path(tempfile.mkdtemp(prefix="karta-memory-process-"))
    up, port = free_port(), free_port()
    sink = Process("sink", [sys.executable, str(HERE / "relay" / "null_upstream.py"),
                            "--listen", f"127.0.0.1:{up}"],
                   port=up, ready_path="/-/ready", log_path=work / "sink.log")
    config = work / "config.yaml"
    config.write_text(f"facts:\n  interval_seconds: {args.interval if args.writes else 3600}\n")
    proxy = Process("karta-proxy", [
        sys.executable, "-m", "proxy", "--config", str(config), "--snapshot", str(snapshot),
        "--upstream-url", f"http://127.0.0.1:{up}/api/v1/write",
        "--listen-address", f"127.0.0.1:{port}", "--log-level", "warning",
    ], port=port, ready_path="/-/ready", log_path=work / "proxy.log", cwd=HERE.parent)
    status = Path(f"/proc/{proxy.pid}/status")

    def mib(field: str) -> float:
        line = next(x for x in status.read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    out: dict[str, float] = {}
    try:
        sink.wait_ready(30)
        proxy.wait_ready(300)
        last, still, deadline = -1, 0, time.monotonic() + 300
        while still < 3 and time.monotonic() < deadline:  # the first write has landed
            requests = json.loads(http_get(up, "/stats")[1])["requests"]
            still = still + 1 if requests == last and requests > 0 else 0
            last = requests
            time.sleep(1)
        out["first write: VmHWM"], out["first write: VmRSS"] = mib("VmHWM"), mib("VmRSS")
        http_get(port, "/metrics", timeout=300)
        out["+ scrape: VmHWM"], out["+ scrape: VmRSS"] = mib("VmHWM"), mib("VmRSS")
        if args.writes:
            time.sleep(args.writes * args.interval)
            http_get(port, "/metrics", timeout=300)
            key = f"+ {args.writes} writes every {args.interval:g} s + scrape"
            out[key + ": VmHWM"], out[key + ": VmRSS"] = mib("VmHWM"), mib("VmRSS")
    finally:
        proxy.stop()
        sink.stop()
    for name, value in out.items():
        print(f"{name:<48} {value:7.1f} MiB ({value * MB / 1e6:6.1f} MB)", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=37_500)
    p.add_argument("--snapshot", help="a snapshot path instead of the benchmark's cluster")
    p.add_argument("--work", default="/tmp/karta-memory-bench", help="where the snapshot is cached")
    p.add_argument("--tracemalloc", action="store_true",
                   help="Python heap per phase and its top sites")
    p.add_argument("--top", type=int, default=8, help="allocation sites shown per phase")
    p.add_argument("--process", action="store_true",
                   help="measure a started `python -m proxy --snapshot` instead of the phases")
    p.add_argument("--writes", type=int, default=0,
                   help="--process: wait this many more fact writes, then scrape again")
    p.add_argument("--interval", type=float, default=6.0,
                   help="--process: facts.interval_seconds with --writes")
    args = p.parse_args()
    if args.process:
        run_process(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
