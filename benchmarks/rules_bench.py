"""The shipped recording and alerting rules at the scale users run them.

A Prometheus 2.42 (Debian's ``prometheus``) loads ``config/rules/karta-proxy.rules.yaml``
and ``karta-proxy.alerts.yaml`` as shipped (no group sets an interval: the global
``evaluation_interval``, 1m by default) and receives, through ``python -m proxy`` with its
fact writer on (so the ``karta_*`` labels and fact series are the proxy's own), the
high-cardinality corpus of ``relay_bench.py`` (``relay/highcard.py``: cAdvisor and DCGM
series of a cluster of long-named namespaces, apps and nodes) cut to ``--pods`` pods with
the per-pod shape of the full corpus (2,000,000 series for 37,500 pods: ~53 per pod). It
also scrapes the proxy's ``/metrics`` (the operational alerts' input), dropping the fact
families there as the shipped ServiceMonitor does.

Samples go in as a scraper would send them: one pass over every series per
``--scrape-interval``, ``--history-minutes`` of them with past timestamps as fast as the
proxy and Prometheus take them (the ``rate5m`` rules need five minutes), then one pass per
interval at the wall clock, spread over it as scrapes are, while the rules are read. Read
per group and per rule, over ``--evaluations`` evaluations: ``evaluationTime`` from
``/api/v1/rules`` (what ``prometheus_rule_group_last_duration_seconds`` exposes), its
health and last error, ``prometheus_rule_evaluation_failures_total``, and per recording
rule the output series (``count({__name__="<record>"})``) against the workloads, component
instances and pods the facts count. Each size runs in a fresh Prometheus; the figures of
two sizes show how cost and output scale with the pods.

    python benchmarks/rules_bench.py [--pods 5625 11250] [--history-minutes 10]
        [--evaluations 3] [--baseline-rules OLD.yaml] [--json OUT] [--keep]

``--baseline-rules``: the recording rules of another version, each record whose expression
differs run both ways against the same data as instant queries, taking turns: a
comparison the box's noise hits alike, and a check that both answer the same series and
values.

``--quick``: a check that the pieces run (100 pods, 1 minute of history, a 1 s
evaluation interval), no figure to keep. Prints figures; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay import corpus, highcard, load
from relay.procs import Process, free_port, http_get
from relay.workdir import discard_work_dir, results_path

REPO = Path(__file__).resolve().parents[1]
RULE_FILES = (
    REPO / "config" / "rules" / "karta-proxy.rules.yaml",
    REPO / "config" / "rules" / "karta-proxy.alerts.yaml",
)
#: how a deployment scrapes the proxy's /metrics (``shipped_scrape``)
SERVICE_MONITOR = REPO / "config" / "kubernetes" / "cluster" / "servicemonitor.yaml"
#: the full corpus's shape: series per pod
FULL_PODS = highcard.DEFAULT_PODS
FULL_SERIES = highcard.DEFAULT_SERIES
SERIES_PER_REQUEST = 2000


class _TimedUniverse(highcard.Universe):
    """The corpus with its clock moved: pass ``p`` at ``base_ms + p * interval_ms``."""

    base_ms: int = 0
    interval_ms: int = highcard.PASS_MS

    def timestamp(self, pos: int, series: int) -> int:  # type: ignore[override]
        return self.base_ms + pos * self.interval_ms // series


def _timed(u: highcard.Universe, base_ms: int, interval_ms: int) -> _TimedUniverse:
    t = _TimedUniverse(**{f.name: getattr(u, f.name) for f in fields(u)})
    t.base_ms, t.interval_ms = base_ms, interval_ms
    return t


# -- processes ----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def shipped_scrape() -> dict[str, Any]:
    """The shipped ServiceMonitor's scrape settings (its facts parameter, honor_labels, the
    drop of any fact copy) as a Prometheus scrape config's keys: read, not copied, so the
    benchmark scrapes as a deployment does."""
    endpoint = yaml.safe_load(SERVICE_MONITOR.read_text())["spec"]["endpoints"][0]
    return {
        "params": endpoint.get("params", {}),
        "honor_labels": endpoint.get("honorLabels", False),
        "metric_relabel_configs": [
            {"source_labels" if k == "sourceLabels" else k: v for k, v in r.items()}
            for r in endpoint.get("metricRelabelings", [])
        ],
    }


def start_prometheus(work: Path, rule_files: Sequence[Path], interval: str,
                     proxy_port: int, scrape_interval: str) -> Process:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus not installed (Debian package: prometheus)")
    port = free_port()
    cfg = work / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": interval},
        "rule_files": [str(f) for f in rule_files],
        "scrape_configs": [{
            "job_name": "karta-proxy",
            "static_configs": [{"targets": [f"127.0.0.1:{proxy_port}"]}],
            # as the shipped ServiceMonitor scrapes: the facts once, the written copy
            # (docs/recording-rules.md, "Facts from several replicas")
            **shipped_scrape(),
        }],
    }))
    data = work / "prometheus-data"
    data.mkdir()
    return Process("prometheus", [
        binary, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}", "--web.enable-remote-write-receiver",
        "--log.level=warn",
    ], port=port, ready_path="/-/ready", log_path=work / "prometheus.log")


def start_proxy(work: Path, snapshot: Path, upstream_port: int, port: int) -> Process:
    config = work / "karta-proxy.yaml"
    config.write_text("facts:\n  interval_seconds: 15\n")
    return Process("karta-proxy", [
        sys.executable, "-m", "proxy", "--listen-address", f"127.0.0.1:{port}",
        "--upstream-url", f"http://127.0.0.1:{upstream_port}/api/v1/write",
        "--snapshot", str(snapshot), "--config", str(config), "--log-level", "warning",
    ], port=port, ready_path="/-/ready", log_path=work / "karta-proxy.log", cwd=REPO,
        env=_env())


# -- sending ------------------------------------------------------------------------------------


def send_pass(u: _TimedUniverse, npass: int, port: int, senders: int = 3,
              spread: float = 0.0, stop: threading.Event | None = None) -> int:
    """Every series once, stamped pass ``npass``; returns the requests refused.
    ``spread``: seconds to spread the requests over (as scrapes spread over an interval),
    else as fast as they are taken; ``stop`` set: the rest of the pass is left unsent."""
    stop = stop or threading.Event()
    n = u.series
    segs = [highcard.Segment(npass * n + s, min(SERIES_PER_REQUEST, n - s), 1)
            for s in range(0, n, SERIES_PER_REQUEST)]
    bodies = highcard.build_bodies(u, segs, workers=2)["v1"]
    head = load.request_head("v1")
    failed = [0]
    nxt = iter(range(len(bodies)))
    lock = threading.Lock()
    t0 = time.monotonic()

    def work() -> None:
        client = load.Client()
        try:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None or stop.wait(
                        max(0.0, t0 + i * spread / len(bodies) - time.monotonic())):
                    return
                ok, why = client.send(port, bodies[i], head)
                if not ok:
                    with lock:
                        failed[0] += 1
                    if failed[0] == 1:
                        print(f"  write refused: {why}", file=sys.stderr)
        finally:
            client.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return failed[0]


# -- reading ------------------------------------------------------------------------------------


def api(port: int, path: str, **params: str) -> Any:
    q = f"?{urllib.parse.urlencode(params)}" if params else ""
    status, body = http_get(port, path + q, timeout=120)
    if status != 200:
        raise RuntimeError(f"GET {path}{q}: HTTP {status}: {body[:300]!r}")
    return json.loads(body)["data"]


def scalar(port: int, promql: str) -> float:
    res = api(port, "/api/v1/query", query=promql)["result"]
    return float(res[0]["value"][1]) if res else 0.0


def metric_values(port: int, name: str) -> dict[str, float]:
    """``name``'s samples on Prometheus' own /metrics, by their label text."""
    _, body = http_get(port, "/metrics", timeout=30)
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


@dataclass
class RuleFigures:
    group: str
    name: str
    kind: str  # recording | alerting
    seconds: list[float] = field(default_factory=list)
    series_out: int = 0
    health: str = ""
    last_error: str = ""


@dataclass
class GroupFigures:
    name: str
    interval: float
    seconds: list[float] = field(default_factory=list)
    failures: float = 0.0
    rules: list[RuleFigures] = field(default_factory=list)


def read_rules(port: int, evaluations: int, interval: float, deadline: float
               ) -> dict[str, GroupFigures]:
    """``evaluations`` distinct evaluations of every group (or as many as come by
    ``deadline``), per group and per rule."""
    groups: dict[str, GroupFigures] = {}
    seen: dict[str, set[str]] = {}
    while time.monotonic() < deadline:
        for g in api(port, "/api/v1/rules")["groups"]:
            gf = groups.setdefault(g["name"], GroupFigures(g["name"], g["interval"]))
            stamps = seen.setdefault(g["name"], set())
            last = g.get("lastEvaluation", "")
            if last.startswith("0001-") or last in stamps:
                continue
            stamps.add(last)
            gf.seconds.append(g["evaluationTime"])
            if not gf.rules:
                gf.rules = [RuleFigures(g["name"], r.get("name", ""), r["type"])
                            for r in g["rules"]]
            for rf, r in zip(gf.rules, g["rules"], strict=True):
                rf.seconds.append(r["evaluationTime"])
                rf.health, rf.last_error = r["health"], r.get("lastError", "")
        if groups and all(len(s) > evaluations for s in seen.values()):
            break  # the first one may have run on a part of the history
        time.sleep(min(5.0, interval / 2))
    for g in groups.values():
        # the first evaluation seen may predate the full history: keep the later ones
        if len(g.seconds) > evaluations:
            g.seconds = g.seconds[-evaluations:]
            for r in g.rules:
                r.seconds = r.seconds[-evaluations:]
    failures = metric_values(port, "prometheus_rule_evaluation_failures_total")
    for key, value in failures.items():
        for g in groups.values():
            if f';{g.name}"' in key:
                g.failures += value
    for g in groups.values():
        for r in g.rules:
            if r.kind == "recording":
                r.series_out = int(scalar(port, f'count({{__name__="{r.name}"}})'))
            else:
                r.series_out = int(scalar(port, f'count(ALERTS{{alertname="{r.name}"}})'))
    return groups


def records(path: Path) -> dict[str, str]:
    """record name -> expression, of one rule file."""
    doc = yaml.safe_load(path.read_text())
    return {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def _instant(port: int, expr: str, at: float) -> tuple[float, dict[str, float]]:
    """(seconds, {labels: value}) of one instant query at ``at``."""
    t = time.perf_counter()
    res = api(port, "/api/v1/query", query=expr, time=f"{at:.3f}")["result"]
    took = time.perf_counter() - t
    return took, {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in res}


@dataclass
class Compared:
    record: str
    baseline_seconds: float
    shipped_seconds: float
    series: int
    same: bool


def compare(port: int, baseline: Path, rounds: int) -> list[Compared]:
    """Each recording rule's shipped expression against the same record's in ``baseline``,
    as instant queries at one time, taking turns (the box's noise hits both alike): the
    median seconds of each and whether they answer the same series and values."""
    old, new = records(baseline), records(RULE_FILES[0])
    at = time.time() - 30
    out = []
    for name, expr in new.items():
        if name not in old or old[name] == expr:
            continue
        a: list[float] = []
        b: list[float] = []
        same = True
        series = 0
        for _ in range(rounds):
            ta, ra = _instant(port, old[name], at)
            tb, rb = _instant(port, expr, at)
            a.append(ta)
            b.append(tb)
            series = len(rb)
            same = same and ra.keys() == rb.keys() and all(
                math.isclose(ra[k], rb[k], rel_tol=1e-9, abs_tol=1e-12)
                or (math.isnan(ra[k]) and math.isnan(rb[k])) for k in ra)
        out.append(Compared(name, _median(a), _median(b), series, same))
    return out


# -- one size -----------------------------------------------------------------------------------


@dataclass
class SizeResult:
    pods: int
    series_sent: int
    head_series: float
    workloads: float
    instances: float
    pods_known: float
    fact_series: float
    send_seconds: float
    refused: int
    groups: dict[str, GroupFigures]
    compared: list[Compared] = field(default_factory=list)


def run_size(args: argparse.Namespace, pods: int, work: Path) -> SizeResult:
    series = max(1, round(FULL_SERIES * pods / FULL_PODS))
    t0 = time.monotonic()
    cluster = corpus.build_cluster(pods, long_names=True)
    snapshot = highcard.write_snapshot_json(cluster, work / "snapshot.json")
    universe = highcard.build_universe(cluster, series)
    del cluster
    print(f"{pods:,} pods: {universe.series:,} series per pass, "
          f"{universe.container_families} container families (built in "
          f"{time.monotonic() - t0:.0f}s)", flush=True)
    interval_s = args.scrape_interval
    history = max(1, round(args.history_minutes * 60 / interval_s))
    base_ms = int(time.time() * 1000) - history * int(interval_s * 1000)
    u = _timed(universe, base_ms, int(interval_s * 1000))
    proxy_port = free_port()
    procs: list[Process] = []
    try:
        prom = start_prometheus(work, RULE_FILES, args.evaluation_interval, proxy_port,
                                f"{interval_s:g}s")
        procs.append(prom)
        prom.wait_ready(60)
        proxy = start_proxy(work, snapshot, prom.port, proxy_port)
        procs.append(proxy)
        proxy.wait_ready(300)
        refused = 0
        t1 = time.monotonic()
        for p in range(history):
            refused += send_pass(u, p, proxy.port)
        send_seconds = time.monotonic() - t1
        print(f"  history: {history} passes, {history * u.series:,} samples in "
              f"{send_seconds:.0f}s ({history * u.series / send_seconds:,.0f}/s), "
              f"{refused} requests refused", flush=True)
        # live: one pass per interval at the wall clock while the rules are read
        stop = threading.Event()

        def live() -> None:
            p = history
            while not stop.is_set():
                due = (base_ms + p * interval_s * 1000) / 1000
                if stop.wait(max(0.0, due - time.time())):
                    return
                # behind (the history took longer than its span): catch up at full speed,
                # or the data the rules read would keep changing under them
                on_time = time.time() - due < interval_s
                send_pass(u, p, proxy.port, spread=interval_s * 0.8 if on_time else 0.0,
                          stop=stop)
                p += 1

        sender = threading.Thread(target=live, daemon=True)
        sender.start()
        ev = _seconds(args.evaluation_interval)
        # the next evaluation starts on the whole history; read the ones after it
        deadline = time.monotonic() + ev * (args.evaluations + 3) + 120
        groups = read_rules(prom.port, args.evaluations, ev, deadline)
        res = SizeResult(
            pods=pods,
            series_sent=u.series,
            head_series=scalar(prom.port, "prometheus_tsdb_head_series")
            or next(iter(metric_values(prom.port, "prometheus_tsdb_head_series").values()),
                    0.0),
            workloads=scalar(prom.port, "count(karta_workload_info)"),
            instances=scalar(prom.port, "count(karta_component_observed_pods)"),
            pods_known=scalar(prom.port, "count(karta_pod_info)"),
            fact_series=scalar(prom.port, 'count({__name__=~"karta_(pod|workload|component|'
                               'namespace|source|contract|build)_.+", instance=""})'),
            send_seconds=send_seconds,
            refused=refused,
            groups=groups,
        )
        if args.baseline_rules is not None:
            res.compared = compare(prom.port, args.baseline_rules, args.compare_rounds)
        stop.set()
        sender.join(120)
        return res
    finally:
        for proc in reversed(procs):
            proc.stop()


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    return float(duration)


# -- report -------------------------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def report(results: Sequence[SizeResult], top: int) -> None:
    print()
    for r in results:
        print(f"{r.pods:,} pods ({r.pods / FULL_PODS:.0%} of the full corpus): "
              f"{r.series_sent:,} series sent, {r.head_series:,.0f} head series, "
              f"{r.workloads:,.0f} workloads, {r.instances:,.0f} component instances, "
              f"{r.pods_known:,.0f} karta_pod_info, {r.fact_series:,.0f} fact series")
    names = sorted({g for r in results for g in r.groups},
                   key=lambda g: list(results[0].groups).index(g)
                   if g in results[0].groups else 99)
    print()
    head = "| group | interval | " + " | ".join(
        f"{r.pods:,} pods: eval (median) | % of interval | failures" for r in results) + " |"
    print(head)
    print("|" + "---|" * (2 + 3 * len(results)))
    for name in names:
        cells = []
        interval = 0.0
        for r in results:
            g = r.groups.get(name)
            if g is None:
                cells += ["-", "-", "-"]
                continue
            interval = g.interval
            med = _median(g.seconds)
            cells += [f"{med * 1000:.1f} ms", f"{med / g.interval:.2%}", f"{g.failures:g}"]
        print(f"| {name} | {interval:g}s | " + " | ".join(cells) + " |")
    print()
    print("| rule | " + " | ".join(f"{r.pods:,} pods: eval, series out" for r in results)
          + " | eval ratio | series ratio |")
    print("|" + "---|" * (3 + len(results)))
    rules: dict[str, list[RuleFigures | None]] = {}
    for i, r in enumerate(results):
        for g in r.groups.values():
            for rf in g.rules:
                rules.setdefault(rf.name, [None] * len(results))[i] = rf
    order = sorted(rules, key=lambda n: -_median((rules[n][-1] or RuleFigures("", "", "")).seconds
                                                 or [0.0]))
    for name in order[:top] if top else order:
        rows = rules[name]
        cells = []
        for row in rows:
            if row is None:
                cells.append("-")
                continue
            err = f" ERROR {row.last_error[:80]}" if row.health == "err" else ""
            cells.append(f"{_median(row.seconds) * 1000:.1f} ms, {row.series_out:,}{err}")
        a, b = rows[0], rows[-1]
        er = sr = "-"
        if a is not None and b is not None and len(rows) > 1:
            ma, mb = _median(a.seconds), _median(b.seconds)
            er = f"{mb / ma:.2f}" if ma > 0 else "-"
            sr = f"{b.series_out / a.series_out:.2f}" if a.series_out else "-"
        print(f"| `{name}` | " + " | ".join(cells) + f" | {er} | {sr} |")
    for r in results:
        if not r.compared:
            continue
        print(f"\n{r.pods:,} pods, as instant queries taking turns: baseline -> shipped")
        print("| rule | baseline | shipped | series | same answer |")
        print("|---|---|---|---|---|")
        for c in r.compared:
            print(f"| `{c.record}` | {c.baseline_seconds * 1000:.1f} ms | "
                  f"{c.shipped_seconds * 1000:.1f} ms | {c.series:,} | "
                  f"{'yes' if c.same else 'NO'} |")
        print(f"| total | {sum(c.baseline_seconds for c in r.compared) * 1000:.0f} ms | "
              f"{sum(c.shipped_seconds for c in r.compared) * 1000:.0f} ms | | |")
    errors = [(r.pods, rf) for r in results for g in r.groups.values() for rf in g.rules
              if rf.health == "err"]
    for pods, rf in errors:
        print(f"error at {pods:,} pods: {rf.name}: {rf.last_error}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, nargs="+", default=[5625, 11250],
                   help="cluster sizes (pods), one Prometheus each")
    p.add_argument("--history-minutes", type=float, default=10.0)
    p.add_argument("--scrape-interval", type=float, default=30.0, help="seconds")
    p.add_argument("--evaluation-interval", default="1m",
                   help="Prometheus' global evaluation_interval (the rule files set none)")
    p.add_argument("--evaluations", type=int, default=3)
    p.add_argument("--baseline-rules", type=Path, default=None,
                   help="a recording rule file to compare with the shipped one: each record "
                        "whose expression differs is run as an instant query both ways, "
                        "taking turns (e.g. `git show v1.9.0:config/rules/karta-proxy.rules."
                        "yaml > /tmp/old.yaml`)")
    p.add_argument("--compare-rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=0, help="rules shown (0: all)")
    p.add_argument("--json", type=results_path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--quick", action="store_true",
                   help="a check: 100 pods, 1 minute of history, 1s evaluations")
    args = p.parse_args(argv)
    if args.quick:
        args.pods, args.history_minutes, args.scrape_interval = [100], 1.0, 15.0
        args.evaluation_interval, args.evaluations = "1s", 1
        args.compare_rounds = 1
    results = []
    for pods in args.pods:
        work = Path(tempfile.mkdtemp(prefix=f"karta-rules-bench-{pods}-"))
        try:
            results.append(run_size(args, pods, work))
            report(results[-1:], args.top)
        finally:
            discard_work_dir(work, keep=args.keep)
    if len(results) > 1:
        report(results, args.top)
    if args.json is not None:
        args.json.write_text(json.dumps([
            {**{k: v for k, v in vars(r).items() if k not in ("groups", "compared")},
             "compared": [vars(c) for c in r.compared],
             "groups": {n: {"interval": g.interval, "seconds": g.seconds,
                            "failures": g.failures,
                            "rules": [vars(rf) for rf in g.rules]}
                        for n, g in r.groups.items()}}
            for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
