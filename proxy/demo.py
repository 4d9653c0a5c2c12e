"""``karta-proxy demo``: the whole data path on one machine, in a few seconds.

It starts the real proxy (``proxy.runtime.Proxy``) on 127.0.0.1 with the bundled snapshot
as its index, an in-process remote-write receiver as its upstream, and replays the
bundled batch of cAdvisor, kubelet-resource and DCGM series through it: the first scrape
as RW 1.0 with snappy, the second as RW 2.0 with zstd, as two kinds of agents would send
them. What the receiver got is decoded with the generated protobuf modules, shown next to
what was sent, and summed per workload: the per-workload figures users otherwise compute
with ``kube_pod_owner`` joins.

No cluster, no TSDB, no network beyond loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web

from proxy import contract
from proxy.aux_server import AuxServer
from proxy.compression import DecodeError, decompress
from proxy.sender import Series, decode, send_series, series_from_exposition
from proxy.wire.primitives import Protocol, protocol_from_content_type

DEMO_DATA = Path(__file__).resolve().parent / "demo_data"
BUNDLED_SNAPSHOT = DEMO_DATA / "snapshot.yaml"
BUNDLED_SERIES = DEMO_DATA / "series.prom"
#: timestamp for samples of the bundled batch that carry none (all of them carry one)
DEFAULT_TIMESTAMP_MS = 1_730_019_600_000
MAX_DECODED = 64 * 1024 * 1024
#: the demo gives up after this long (it takes well under a second)
DEADLINE_SECONDS = 30.0
UNATTRIBUTED = "(unattributed)"
#: what the demo ends with, for a user to paste into a Prometheus the walkthrough feeds; the
#: README's walkthrough shows the same lines (tests/test_readme.py holds them equal)
NEXT_QUERIES = (
    "avg by (karta_namespace, karta_kind, karta_workload) (DCGM_FI_DEV_GPU_UTIL)",
    "sum by (karta_namespace, karta_workload, karta_component) "
    '(rate(container_cpu_usage_seconds_total{container!~"|POD",image!=""}[5m]))',
    "karta_workload:DCGM_FI_DEV_POWER_USAGE:sum",
)


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's flags, for the CLI's ``demo`` subcommand parser."""
    parser.add_argument(
        "--snapshot", metavar="PATH", help="use this snapshot instead of the bundled one"
    )
    parser.add_argument(
        "--series", metavar="FILE", help="replay this exposition text instead of the bundled batch"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="log level of the proxy during the demo (default warning)",
    )
    return parser


# -- the receiver ------------------------------------------------------------------------------


@dataclass
class Received:
    protocol: Protocol
    encoding: str
    headers: dict[str, str]
    series: list[Series]


@dataclass
class Receiver(AuxServer):
    """A remote-write receiver on 127.0.0.1 that keeps what it is sent, decoded."""

    requests: list[Received] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    url: str = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=MAX_DECODED)
        app.router.add_post("/api/v1/write", self._write)
        port = await self.serve(app, "127.0.0.1", 0, auto_decompress=False)
        self.url = f"http://127.0.0.1:{port}/api/v1/write"
        return self.url

    def series(self) -> list[Series]:
        return [s for r in self.requests for s in r.series]

    async def _write(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            protocol = protocol_from_content_type(request.headers.get("Content-Type", ""))
            encoding = request.headers.get("Content-Encoding", "")
            raw = decompress(body, encoding, max_decoded=MAX_DECODED)
            series = decode(raw, protocol)
        except DecodeError as e:
            self.errors.append(e.message)
            return web.Response(status=e.status, text=e.message)
        except ValueError as e:  # protobuf DecodeError is a ValueError too
            self.errors.append(str(e))
            return web.Response(status=400, text=f"cannot decode: {e}")
        self.requests.append(Received(protocol, encoding, dict(request.headers), series))
        headers = {}
        if protocol is Protocol.V2:
            headers = {
                "X-Prometheus-Remote-Write-Samples-Written": str(
                    sum(len(s.samples) for s in series)
                ),
                "X-Prometheus-Remote-Write-Histograms-Written": "0",
                "X-Prometheus-Remote-Write-Exemplars-Written": str(
                    sum(len(s.exemplars) for s in series)
                ),
            }
        return web.Response(status=204, headers=headers)


# -- the run -----------------------------------------------------------------------------------


@dataclass
class DemoResult:
    sent: list[Series]
    received: list[Series]
    statuses: list[int]
    summary: list[dict[str, Any]]
    errors: list[str]

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and all(200 <= s < 300 for s in self.statuses)
            and sum(len(s.samples) for s in self.received) == sum(len(s.samples) for s in self.sent)
        )


def split_scrapes(series: Sequence[Series]) -> list[list[Series]]:
    """The recorded batch holds several scrapes; one request per scrape, as an agent sends."""
    times = sorted({t for s in series for t, _ in s.samples})
    by_time: dict[int, list[Series]] = {t: [] for t in times}
    for s in series:
        for t, v in s.samples:
            by_time[t].append(
                Series(dict(s.labels), [(t, v)], metric_type=s.metric_type, help=s.help)
            )
    # group samples within one scrape interval (targets are scraped a moment apart)
    groups: list[list[Series]] = []
    start: int | None = None
    for t in times:
        if start is None or t - start > 5_000:
            groups.append([])
            start = t
        groups[-1].extend(by_time[t])
    return groups


class SeriesFileError(ValueError):
    """A ``--series`` file that is not exposition text; the message names the file and,
    where one line alone fails, the line (the parser's own error names neither)."""


def read_series_file(path: str | Path) -> list[Series]:
    """The series of an exposition file, or a ``SeriesFileError`` that says where."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SeriesFileError(f"{path}: not UTF-8 text") from None
    try:
        return series_from_exposition(text, DEFAULT_TIMESTAMP_MS)
    except ValueError as e:
        where = f"{path}:{line}" if (line := _first_bad_line(text)) else str(path)
        raise SeriesFileError(f"{where}: not Prometheus text exposition: {e}") from None


def _first_bad_line(text: str) -> int | None:
    """The parser reads the whole text at once: each line again, alone, finds the culprit
    (only on the error path, so a good file is parsed once)."""
    for number, line in enumerate(text.splitlines(), 1):
        try:
            series_from_exposition(line + "\n", DEFAULT_TIMESTAMP_MS)
        except ValueError:
            return number
    return None


async def run(
    *,
    snapshot: str | Path = BUNDLED_SNAPSHOT,
    series_file: str | Path = BUNDLED_SERIES,
    out: IO[str] | None = None,
) -> DemoResult:
    """Start proxy + receiver, replay, print, stop. Returns what happened."""
    from proxy.config import Settings
    from proxy.runtime import Proxy

    out = out or sys.stdout
    sent = read_series_file(series_file)
    receiver = Receiver()
    await receiver.start()
    settings = Settings()
    settings.snapshot = str(snapshot)
    settings.server.listen_address = "127.0.0.1:0"
    settings.upstream.url = receiver.url
    settings.facts.enabled = False
    proxy = Proxy(settings)
    statuses: list[int] = []
    errors: list[str] = []
    try:
        await proxy.start()
        url = f"http://127.0.0.1:{proxy.port}/api/v1/write"
        _print_header(out, snapshot, series_file, proxy, sent)
        plans = [(Protocol.V1, "snappy"), (Protocol.V2, "zstd")]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for i, batch in enumerate(split_scrapes(sent)):
                protocol, encoding = plans[i % len(plans)]
                status, _, text = await send_series(
                    url, batch, protocol=protocol, encoding=encoding, session=session
                )
                statuses.append(status)
                n = sum(len(s.samples) for s in batch)
                print(
                    f"  request {i + 1}: {len(batch)} series, {n} samples as RW "
                    f"{'1.0' if protocol is Protocol.V1 else '2.0'} + {encoding} "
                    f"-> {status}{' ' + text.strip() if status >= 300 else ''}",
                    file=out,
                )
                if status >= 300:
                    errors.append(f"proxy answered {status}: {text.strip()}")
    finally:
        await proxy.stop()
        await receiver.stop()
    errors.extend(f"receiver: {e}" for e in receiver.errors)
    received = receiver.series()
    _print_before_after(out, sent, merge_requests(received))
    summary = summarize(received)
    _print_summary(out, summary)
    got = sum(len(s.samples) for s in received)
    want = sum(len(s.samples) for s in sent)
    print(
        f"\nsamples sent {want}, received {got}"
        + (" (none lost, none added)" if got == want else " (MISMATCH)"),
        file=out,
    )
    _print_next(out)
    return DemoResult(sent, received, statuses, summary, errors)


def _print_next(out: IO[str]) -> None:
    """The way on from here: the demo's receiver is gone when it exits, so the next step is
    a real Prometheus, and the queries to paste into it."""
    print(
        "\nNext: the same series in a real Prometheus, no cluster needed. With the virtualenv\n"
        "active (. .venv/bin/activate), run the four commands of README.md's walkthrough\n"
        '("Without a cluster"): a Prometheus with --web.enable-remote-write-receiver,\n'
        "karta-proxy --snapshot proxy/demo_data/snapshot.yaml, python3 -m proxy.demo_exporter,\n"
        "and a Prometheus agent (config/walkthrough/agent.yml). Then query\n"
        "http://127.0.0.1:9090:\n",
        file=out,
    )
    for q in NEXT_QUERIES:
        print(f"  {q}", file=out)
    print(
        "\nA rate() at \"now\" reads low for the first minutes (remote-write lag plus\n"
        "extrapolation; docs/demo.md). With a cluster: karta-proxy --upstream-url\n"
        "http://YOUR-TSDB/api/v1/write, and your agents' remote_write pointed at it.",
        file=out,
    )


def _print_header(
    out: IO[str], snapshot: str | Path, series_file: str | Path, proxy: Any, sent: Sequence[Series]
) -> None:
    idx = proxy.index
    print("karta-proxy demo", file=out)
    print(f"  snapshot: {snapshot}", file=out)
    print(f"  index: {len(idx)} pods with labels, {len(idx.workloads)} workloads", file=out)
    print(f"  proxy: http://127.0.0.1:{proxy.port}  ->  receiver (in-process)", file=out)
    print(
        f"  replaying {series_file}: {len(sent)} series, "
        f"{sum(len(s.samples) for s in sent)} samples",
        file=out,
    )


#: (description, metric, labels that pick the series) shown before/after
SHOWCASE: list[tuple[str, str, dict[str, str]]] = [
    (
        "DCGM, scraped with honor_labels: false (exported_pod names the GPU's pod)",
        "DCGM_FI_DEV_GPU_UTIL",
        {"exported_pod": "pretrain-workers-1-0-m2n4r"},
    ),
    (
        "cAdvisor container of a Deployment's pod",
        "container_memory_working_set_bytes",
        {"pod": "frontend-6d8f7b9c5d-4xkqp", "container": "frontend"},
    ),
    (
        "kubelet /metrics/resource, a RayJob's worker (through its RayCluster)",
        "pod_cpu_usage_seconds_total",
        {"pod": "llm-finetune-raycluster-k7x2p-gpu-group-worker-2xk9d"},
    ),
    (
        "a pod of an undescribed operator (MPIJob): passes through unchanged",
        "pod_memory_working_set_bytes",
        {"pod": "allreduce-bench-worker-0"},
    ),
]


def _find(series: Sequence[Series], name: str, match: dict[str, str]) -> Series | None:
    for s in series:
        if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
            return s
    return None


def _fmt(s: Series, highlight: bool) -> str:
    parts = []
    for k, v in s.sorted_labels():
        if k == "__name__":
            continue
        if k in ("id", "name") and len(v) > 24:
            v = v[:21] + "..."
        mark = "+" if highlight and k.startswith(contract.STAMPED_PREFIX) else ""
        parts.append(f'{mark}{k}="{v}"')
    return f"{s.name}{{{', '.join(parts)}}}"


def _print_before_after(out: IO[str], sent: Sequence[Series], received: Sequence[Series]) -> None:
    print("\nSeries before and after (+ marks a stamped label):", file=out)
    for title, name, match in SHOWCASE:
        before = _find(sent, name, match)
        after = _find(received, name, match)
        if before is None:
            continue
        print(f"\n  {title}", file=out)
        print(f"    sent:     {_fmt(before, False)}", file=out)
        print(f"    received: {_fmt(after, True) if after else '(not received)'}", file=out)


def summarize(received: Sequence[Series]) -> list[dict[str, Any]]:
    """Per-workload figures from what the receiver got, keyed by the stamped labels.

    Series arriving over several requests are joined by label set first. CPU cores: rate of
    cAdvisor ``container_cpu_usage_seconds_total`` over the batch, app containers only (not
    the ``POD`` sandbox, not the pod cgroup, not the kubelet's copy), so nothing counts
    twice. Memory: the same containers' ``container_memory_working_set_bytes``, latest.
    GPU util: mean of ``DCGM_FI_DEV_GPU_UTIL`` over the workload's GPUs, latest.
    """
    rows: dict[tuple[str, str, str], dict[str, Any]] = defaultdict(
        lambda: {"series": 0, "cpu": None, "mem": 0.0, "gpu": []}
    )
    for s in merge_requests(received):
        lb = s.labels
        wl = lb.get(contract.LABEL_WORKLOAD)
        if wl is None and not _names_pod(lb):
            continue
        key = (
            (lb.get(contract.LABEL_NAMESPACE, ""), lb.get(contract.LABEL_KIND, ""), wl)
            if wl is not None
            else ("", "", UNATTRIBUTED)
        )
        row = rows[key]
        row["series"] += 1
        # cAdvisor's app-container series: an image, and a container that is not the sandbox
        app_container = lb.get("container", "") not in ("", "POD") and bool(lb.get("image"))
        if s.name == "container_cpu_usage_seconds_total" and app_container:
            row["cpu"] = (row["cpu"] or 0.0) + _rate(s.samples)
        elif s.name == "container_memory_working_set_bytes" and app_container and s.samples:
            row["mem"] += s.samples[-1][1]
        elif s.name == "DCGM_FI_DEV_GPU_UTIL" and s.samples:
            row["gpu"].append(s.samples[-1][1])
    out = []
    order = sorted(rows.items(), key=lambda kv: (kv[0][2] == UNATTRIBUTED, kv[0]))
    for (ns, kind, wl), row in order:
        out.append(
            {
                "namespace": ns,
                "kind": kind,
                "workload": wl,
                "series": row["series"],
                "cpu_cores": row["cpu"],
                "memory_bytes": row["mem"],
                "gpus": len(row["gpu"]),
                "gpu_util": sum(row["gpu"]) / len(row["gpu"]) if row["gpu"] else None,
            }
        )
    return out


def _names_pod(labels: dict[str, str]) -> bool:
    return bool(labels.get("exported_pod") or labels.get("pod") or labels.get("pod_name"))


def _rate(samples: list[tuple[int, float]]) -> float:
    if len(samples) < 2:
        return 0.0
    (t0, v0), (t1, v1) = samples[0], samples[-1]
    return (v1 - v0) / ((t1 - t0) / 1000) if t1 > t0 and v1 >= v0 else 0.0


def merge_requests(received: Sequence[Series]) -> list[Series]:
    """Series received over several requests joined by label set, samples in time order."""
    by_key: dict[tuple[tuple[str, str], ...], Series] = {}
    for s in received:
        key = tuple(sorted(s.labels.items()))
        m = by_key.get(key)
        if m is None:
            by_key[key] = Series(dict(s.labels), list(s.samples), metric_type=s.metric_type)
        else:
            m.samples.extend(s.samples)
    for m in by_key.values():
        m.samples.sort()
    return list(by_key.values())


def _print_summary(out: IO[str], summary: Sequence[dict[str, Any]]) -> None:
    print(
        "\nPer workload, from what the receiver got (sum by karta_namespace, karta_kind, "
        "karta_workload):\n",
        file=out,
    )
    head = (
        f"  {'namespace':<15}{'kind':<12}{'workload':<16}{'series':>7}{'GPUs':>6}"
        f"{'GPU util':>10}{'CPU cores':>11}{'memory':>11}"
    )
    print(head, file=out)
    print("  " + "-" * (len(head) - 2), file=out)
    for r in summary:
        gpu = f"{r['gpu_util']:.1f}%" if r["gpu_util"] is not None else "-"
        cpu = f"{r['cpu_cores']:.2f}" if r["cpu_cores"] is not None else "-"
        mem = _bytes(r["memory_bytes"]) if r["memory_bytes"] else "-"
        print(
            f"  {r['namespace']:<15}{r['kind']:<12}{r['workload']:<16}{r['series']:>7}"
            f"{r['gpus'] or '-':>6}{gpu:>10}{cpu:>11}{mem:>11}",
            file=out,
        )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def run_demo(args: argparse.Namespace | None = None, **options: Any) -> int:
    """Entry point of ``karta-proxy demo``: 0 when every sample arrived, enriched."""
    opts = {**(vars(args) if args is not None else {}), **options}
    level = str(opts.get("log_level") or "warning")
    if not logging.getLogger().handlers:  # leave a host's logging (pytest, an embedder) alone
        from proxy.log import setup_logging

        setup_logging(level, "text")
    snapshot = opts.get("snapshot") or BUNDLED_SNAPSHOT
    series_file = opts.get("series") or BUNDLED_SERIES
    out = opts.get("out") or sys.stdout
    from proxy.object_files import SnapshotError
    from proxy.runtime import StartError

    try:
        result = asyncio.run(
            asyncio.wait_for(
                run(snapshot=snapshot, series_file=series_file, out=out), DEADLINE_SECONDS
            )
        )
    except (StartError, SnapshotError, SeriesFileError) as e:
        print(f"karta-proxy demo: error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TimeoutError) as e:
        print(f"karta-proxy demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for problem in result.errors:
        print(f"karta-proxy demo: error: {problem}", file=sys.stderr)
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_demo_arguments(argparse.ArgumentParser(prog="karta-proxy demo"))
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
    logging.shutdown()
