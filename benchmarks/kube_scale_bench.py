"""Kubernetes mode at the memory target's scale: ``python -m proxy --kubeconfig`` against
the API simulator serving the 37.5k-pod cluster of ``memory_bench.py``, each in a process
of its own, beside the same cluster in snapshot mode.

The cluster is ``relay.corpus.build_cluster(37500, seed=7, long_names=True)`` (Deployments
through ReplicaSets, StatefulSets, Jobs and CronJobs, DaemonSets, bare pods), plus
``--rayjobs`` RayJobs (a RayCluster each, a head and two workers) with the Karta object
describing them: a few Karta-described custom resources. Written once as a JSON List
under ``--work``; the simulator loads it, snapshot mode reads it.

Measured, each of ``--runs`` starts per mode (median shown, the spread after it):

- ``ready``: wall time from the process start to ``/-/ready`` answering 200, and its CPU;
  the answer times of ``GET /-/healthy`` every 20 ms until then (the event loop's stalls
  during the first load, as a client of the process sees them);
- ``VmHWM at ready``: peak RSS over the start and the first lists (or the snapshot load);
- ``VmHWM / VmRSS settled``: once its first fact write has landed at the upstream (a
  sink in this process) and a second has passed;
- the list page: the page size the watchers ask for (read from the simulator's request
  log) and the bytes of one page of pods as the simulator serves it.

Then, on the last Kubernetes-mode proxy:

- a relist forced by a 410 (the simulator's event log compacted, every watch cut): the
  time until every watcher watches again (each does once its list is through the
  engine), the proxy's CPU-s, the VmHWM it reaches and the RSS it keeps, and the answer
  time of ``GET /-/healthy`` every 20 ms meanwhile (the event loop's lag, as the process
  shows it);
- churn: ``--churn-rate`` pod events a second (creations and deletions of pods of existing
  ReplicaSets, half each) for ``--churn-seconds``, made in the simulator's process. Every
  50 ms a remote-write request naming each created pod not yet seen stamped goes through
  the proxy; the lag of a pod is from its creation in the simulator to the first relayed
  request in which the sink sees its series carry ``karta_workload`` (50 ms resolution).
  Also the proxy's CPU over the churn and ``/-/healthy`` answer times.

    python3 benchmarks/kube_scale_bench.py [--pods 37500] [--runs 3]
            [--churn-rate 200 --churn-seconds 60] [--realistic-pods]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import snappy
from aiohttp import ClientSession, ClientTimeout, web

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from relay.procs import cpu_seconds  # noqa: E402

from proxy.wire.primitives import read_field  # noqa: E402  (the repo's, not an installed one)

MIB = 1024 * 1024
PROBE_METRIC = "bench_probe_up"


# -- the cluster ------------------------------------------------------------------------------


def _rayjobs(n: int) -> list[dict[str, Any]]:
    """``n`` RayJobs, each with its RayCluster, a head and two workers, and the Karta
    object that describes RayJobs (the tests' own)."""
    from tests.karta.descriptions import RAYJOB_KARTA

    out: list[dict[str, Any]] = [json.loads(json.dumps(RAYJOB_KARTA))]
    out[0]["metadata"].setdefault("uid", "karta-rayjob-bench")

    def ref(obj: dict[str, Any]) -> list[dict[str, Any]]:
        md = obj["metadata"]
        return [{"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": md["name"],
                 "uid": md["uid"], "controller": True}]

    for i in range(n):
        ns, name = f"ml-{i % 4}", f"train-{i}"
        job = {"apiVersion": "ray.io/v1", "kind": "RayJob",
               "metadata": {"name": name, "namespace": ns, "uid": f"rayjob-{i}"},
               "spec": {"rayClusterSpec": {
                   "headGroupSpec": {"template": {}},
                   "workerGroupSpecs": [{"groupName": "gpu", "template": {}}]}},
               "status": {"jobStatus": "RUNNING"}}
        rc = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
              "metadata": {"name": f"{name}-rc", "namespace": ns, "uid": f"raycluster-{i}",
                           "ownerReferences": ref(job)}}
        out += [job, rc]
        for j, (pod, labels) in enumerate((
                (f"{name}-head", {"ray.io/node-type": "head"}),
                (f"{name}-gpu-0", {"ray.io/node-type": "worker", "ray.io/group": "gpu"}),
                (f"{name}-gpu-1", {"ray.io/node-type": "worker", "ray.io/group": "gpu"}))):
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": pod, "namespace": ns, "uid": f"raypod-{i}-{j}",
                                     "labels": labels, "ownerReferences": ref(rc)},
                        "spec": {"nodeName": "gpu-node", "containers": [
                            {"name": "ray", "image": "rayproject/ray:2.9"}]},
                        "status": {"phase": "Running"}})
    return out


def cluster_file(args: argparse.Namespace) -> Path:
    """The cluster as a JSON List, built once and cached under ``--work``."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    real = "-realistic" if args.realistic_pods else ""
    path = work / f"kube-scale-{args.pods}-{args.rayjobs}{real}.json"
    if path.exists():
        return path
    from relay import corpus

    objects = corpus.build_cluster(args.pods, seed=7, long_names=True).objects
    objects += _rayjobs(args.rayjobs)
    if args.realistic_pods:
        from watch_bench import _realistic

        objects = [_realistic(o) if o["kind"] == "Pod" else o for o in objects]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
                   "items": objects}, f, separators=(",", ":"))
    tmp.rename(path)
    return path


# -- child: the simulator ----------------------------------------------------------------------


async def serve_commands(sim: Any, kubeconfig: str) -> AsyncIterator[list[str]]:
    """Start the simulator, write its kubeconfig, say ``ready``, then yield each command
    line from stdin (split into words) until an empty one."""
    await sim.start()
    sim.write_kubeconfig(kubeconfig)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while cmd := (await reader.readline()).decode().split():
        yield cmd


async def run_sim(args: argparse.Namespace) -> None:
    """Serve the cluster file; then commands on stdin: ``pagesize``, ``relist``,
    ``churn RATE SECONDS`` (a line ``c NAMESPACE NAME EPOCH_SECONDS`` per pod created),
    an empty line ends it."""
    from tests.kubesim import CORE_TYPES, CRD_TYPES, KubeSim

    sim = KubeSim((*CORE_TYPES, *CRD_TYPES), port=args.port, bookmark_interval=5.0)
    items = json.loads(Path(args.cluster).read_bytes())["items"]
    replica_sets: list[dict[str, Any]] = []
    for obj in items:
        made = sim.create(obj)
        if obj["kind"] == "ReplicaSet":
            replica_sets.append(made)
    del items
    seq = 0
    async for cmd in serve_commands(sim, args.kubeconfig):
        if cmd[0] == "pagesize":
            limits = sorted({q.get("limit", "") for _, path, q, _ in sim.requests
                             if path.endswith("/pods") and "watch" not in q})
            print("pagesize " + ",".join(limits), flush=True)
        elif cmd[0] == "relist":
            # what an API server restart or an etcd compaction does to a watcher that
            # was away: its resourceVersion is gone (410), and it lists everything again.
            # A write first: a watch from the compacted revision itself is still served
            bump = sim.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": f"bench-bump-{seq}",
                                            "namespace": "default"}})
            sim.delete(bump)
            seq += 1
            sim.compact()
            cut = set(_feeds(sim))
            t0 = time.monotonic()
            print(f"relist {sim.disconnect_watches()}", flush=True)
            # a watcher watches again once its list is through the engine: as many new
            # watches as were cut is the relist done (the proxy's CPU alone misses it:
            # between two pages of ~5 KB pods it may wait on this process more than it
            # works)
            while (len([f for f in _feeds(sim) if f not in cut]) < len(cut)
                   and time.monotonic() - t0 < 300):
                await asyncio.sleep(0.01)
            print(f"relisted {time.monotonic() - t0:.3f}", flush=True)
        elif cmd[0] == "churn":
            rate, seconds = float(cmd[1]), float(cmd[2])
            seq = await _churn(sim, replica_sets, rate, seconds, seq)
            print(f"churned {seq}", flush=True)
    await sim.close()


def _feeds(sim: Any) -> list[Any]:
    """The simulator's open watch streams."""
    return [f for rs in sim.store.resources.values() if rs is not None for f in rs.feeds]


async def _churn(sim: Any, replica_sets: list[dict[str, Any]], rate: float, seconds: float,
                 seq: int) -> int:
    """``rate`` pod events a second: creations of pods of existing ReplicaSets and, past
    200 live, deletions of the oldest, in ticks of 20 ms."""
    live: list[dict[str, Any]] = []
    tick = 0.02
    per_tick = max(1, round(rate * tick / 2))
    next_t = time.monotonic()
    end = next_t + seconds
    while time.monotonic() < end:
        lines = []
        for _ in range(per_tick):
            rs = replica_sets[seq % len(replica_sets)]
            md = rs["metadata"]
            name = f"{md['name']}-churn{seq}"
            live.append(sim.create({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": md["namespace"],
                             "labels": dict(md.get("labels") or {}),
                             "ownerReferences": [{
                                 "apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": md["name"], "uid": md["uid"], "controller": True}]},
                "spec": {"nodeName": "churn-node", "containers": [
                    {"name": "main", "image": "registry.example.com/app:1"}]},
                "status": {"phase": "Running"}}))
            lines.append(f"c {md['namespace']} {name} {time.time():.6f}")
            seq += 1
            if len(live) > 200:
                sim.delete(live.pop(0), cascade=False)
        print("\n".join(lines), flush=True)
        next_t += tick
        await asyncio.sleep(max(0.0, next_t - time.monotonic()))
    for pod in live:
        sim.delete(pod, cascade=False)
    return seq


# -- the upstream sink: which probed pods came stamped ----------------------------------------


def _fields(buf: bytes) -> Iterator[tuple[int, bytes]]:
    """The length-delimited fields of a protobuf message (others skipped)."""
    i = 0
    while i < len(buf):
        number, wire, start, i = read_field(buf, i, len(buf))
        if wire == 2:
            yield number, buf[start:i]


@dataclass
class Sink:
    """The upstream: counts requests; for the probe's series, when each pod was first
    seen with ``karta_workload``."""

    requests: int = 0
    stamped: dict[tuple[str, str], float] = field(default_factory=dict)

    async def write(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests += 1
        raw = snappy.uncompress(body)
        if PROBE_METRIC.encode() in raw:
            now = time.time()
            for num, ts in _fields(raw):
                if num != 1:
                    continue
                labels = {}
                for n, lab in _fields(ts):
                    if n == 1:
                        kv = dict(_fields(lab))
                        labels[kv.get(1, b"").decode()] = kv.get(2, b"").decode()
                if "karta_workload" in labels:
                    self.stamped.setdefault((labels["namespace"], labels["pod"]), now)
        return web.Response(status=204)


def probe_body(pods: list[tuple[str, str]], ts_ms: int) -> bytes:
    """A RW 1.0 request with one series per pod, snappy compressed."""
    from relay.corpus import encode_series

    return snappy.compress(b"".join(
        encode_series({"__name__": PROBE_METRIC, "namespace": ns, "pod": pod}, 1.0, ts_ms)
        for ns, pod in pods))


# -- the proxy ------------------------------------------------------------------------------------


def _status(pid: int, name: str) -> float:
    """A ``/proc/PID/status`` figure in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(name)


def _get(port: int, path: str, timeout: float = 2.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


class LoopProbe:
    """``GET /-/healthy`` every 20 ms in a thread; the answer times."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            with contextlib.suppress(OSError, http.client.HTTPException):
                _get(self.port, "/-/healthy", timeout=30.0)
                self.times.append(time.perf_counter() - t)
            self._stop.wait(0.02)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(10)
        return self.times


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


@dataclass
class Proxy:
    popen: subprocess.Popen[bytes]
    port: int
    started: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu(self) -> float:
        """CPU seconds of the proxy and its children (its jq sandbox, where it has one)."""
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_proxy(mode: list[str], upstream: int, work: Path, name: str,
                extra: str = "") -> Proxy:
    from tests.kubesim import free_port

    port = free_port()
    config = work / "config.yaml"
    # one fact write at the start, none during the churn (the facts' own cost is
    # memory_bench.py's and relay_bench.py's to measure)
    config.write_text("facts:\n  interval_seconds: 3600\n" + extra)
    log = (work / f"{name}.log").open("wb")
    started = time.monotonic()
    popen = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--config", str(config), *mode,
         "--upstream-url", f"http://127.0.0.1:{upstream}/api/v1/write",
         "--listen-address", f"127.0.0.1:{port}", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    log.close()
    return Proxy(popen, port, started)


async def wait_ready(proxy: Proxy, timeout: float = 300.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.popen.poll() is not None:
            raise RuntimeError(f"karta-proxy exited with {proxy.popen.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if await asyncio.to_thread(_get, proxy.port, "/-/ready", 1.0) == 200:
                return time.monotonic() - proxy.started
        await asyncio.sleep(0.05)
    raise RuntimeError(f"karta-proxy not ready in {timeout:.0f} s")


async def settled(proxy: Proxy, sink: Sink, timeout: float = 120.0) -> None:
    """Until the first fact write has landed (no new request for 2 s), then 2 s more."""
    last, still = -1, 0
    deadline = time.monotonic() + timeout
    while still < 4 and time.monotonic() < deadline:
        still = still + 1 if sink.requests == last and last > 0 else 0
        last = sink.requests
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)


async def measure_start(mode: list[str], sink: Sink, up: int, work: Path,
                        name: str) -> tuple[dict[str, float], Proxy]:
    sink.requests = 0
    proxy = start_proxy(mode, up, work, name)
    probe = LoopProbe(proxy.port)  # answers from the listener's start on
    ready = await wait_ready(proxy)
    times = probe.stop()
    out = {"ready_s": ready, "ready_cpu_s": proxy.cpu(),
           "hwm_ready": _status(proxy.pid, "VmHWM"), "rss_ready": _status(proxy.pid, "VmRSS"),
           "start_healthy_n": len(times), "start_healthy_p99_ms": pct(times, 99) * 1e3,
           "start_healthy_max_ms": max(times, default=float("nan")) * 1e3}
    await settled(proxy, sink)
    out.update(hwm_settled=_status(proxy.pid, "VmHWM"),
               rss_settled=_status(proxy.pid, "VmRSS"), settled_cpu_s=proxy.cpu())
    return out, proxy


async def busy_until_quiet(proxy: Proxy, quiet: float = 1.5, limit: float = 120.0) -> float:
    """Seconds until the proxy's CPU time last advanced by more than 20 ms in 100 ms,
    once it has been that quiet for ``quiet`` seconds."""
    t0 = time.monotonic()
    last_busy = t0
    c = proxy.cpu()
    while time.monotonic() - last_busy < quiet and time.monotonic() - t0 < limit:
        await asyncio.sleep(0.1)
        c2 = proxy.cpu()
        if c2 - c > 0.02:
            last_busy = time.monotonic()
        c = c2
    return last_busy - t0


class SimChild:
    """The API simulator in a process of its own: ``script --sim --port P --kubeconfig K
    *extra`` (which prints ``ready`` once it serves, then takes commands on stdin), its
    output lines read in a thread."""

    def __init__(self, work: Path, script: Path, extra: list[str]) -> None:
        from tests.kubesim import free_port

        self.kubeconfig = work / "kubesim.kubeconfig"
        self.port = free_port()
        self.popen = subprocess.Popen(
            [sys.executable, str(script), "--sim", "--port", str(self.port), "--kubeconfig",
             str(self.kubeconfig), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
            stderr=(work / "kubesim.log").open("wb"))  # a stopped proxy's cut watches
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")

    def send(self, cmd: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(cmd + "\n")
        self.popen.stdin.flush()

    async def expect(self, prefix: str, timeout: float = 600.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = await asyncio.to_thread(self.lines.get, True, 1.0)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
            if not line and self.popen.poll() is not None:
                break
        raise RuntimeError(f"simulator: no {prefix!r}")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.send("")
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


async def relist(sim: SimChild, proxy: Proxy) -> dict[str, float]:
    probe = LoopProbe(proxy.port)
    await asyncio.sleep(1.0)
    idle = len(probe.times)
    with contextlib.suppress(OSError):
        Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss0, c0 = _status(proxy.pid, "VmRSS"), proxy.cpu()
    sim.send("relist")
    await sim.expect("relist ")
    done = float((await sim.expect("relisted", 320)).split()[1])
    await busy_until_quiet(proxy)
    times = probe.stop()[idle:]
    return {"relist_s": done, "relist_cpu_s": proxy.cpu() - c0, "relist_rss_before": rss0,
            "relist_hwm": _status(proxy.pid, "VmHWM"), "relist_rss_after": _status(proxy.pid,
                                                                                  "VmRSS"),
            "relist_healthy_p50_ms": pct(times, 50) * 1e3,
            "relist_healthy_p99_ms": pct(times, 99) * 1e3,
            "relist_healthy_max_ms": max(times, default=0.0) * 1e3}


async def churn(sim: SimChild, proxy: Proxy, sink: Sink, rate: float,
                seconds: float) -> dict[str, float]:
    created: dict[tuple[str, str], float] = {}
    sink.stamped.clear()
    probe = LoopProbe(proxy.port)
    c0, t0 = proxy.cpu(), time.monotonic()
    sim.send(f"churn {rate:g} {seconds:g}")
    sent = 0
    done = False
    async with ClientSession(timeout=ClientTimeout(total=10)) as http:
        url = f"http://127.0.0.1:{proxy.port}/api/v1/write"
        headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                   "X-Prometheus-Remote-Write-Version": "0.1.0"}
        stop_at = time.monotonic() + seconds + 60  # bounded whatever the simulator does
        cpu_end = 0.0
        while time.monotonic() < stop_at:
            while True:
                try:
                    line = sim.lines.get_nowait()
                except queue.Empty:
                    break
                if line.startswith("c "):
                    _, ns, name, t = line.split()
                    created[(ns, name)] = float(t)
                elif line.startswith("churned"):
                    done = True
                    cpu_end = proxy.cpu() - c0
            pending = [k for k in created if k not in sink.stamped]
            now = time.time()
            # given up on after 10 s (deleted before it was ever stamped, or lost)
            pending = [k for k in pending if now - created[k] < 10.0]
            if done and not pending:
                break
            if pending:
                async with http.post(url, data=probe_body(pending, int(now * 1000)),
                                     headers=headers) as resp:
                    await resp.read()
                sent += 1
            await asyncio.sleep(0.05)
    times = probe.stop()
    lags = [sink.stamped[k] - t for k, t in created.items() if k in sink.stamped]
    return {"churn_created": len(created), "churn_stamped": len(lags),
            "churn_events": 2 * len(created), "churn_wall_s": time.monotonic() - t0,
            "churn_cpu_s": cpu_end, "churn_probe_requests": sent,
            "churn_lag_p50_ms": pct(lags, 50) * 1e3, "churn_lag_p99_ms": pct(lags, 99) * 1e3,
            "churn_lag_max_ms": max(lags, default=float("nan")) * 1e3,
            "churn_healthy_p50_ms": pct(times, 50) * 1e3,
            "churn_healthy_p99_ms": pct(times, 99) * 1e3,
            "churn_healthy_max_ms": max(times, default=0.0) * 1e3,
            "churn_rss_after": _status(proxy.pid, "VmRSS"),
            "churn_hwm": _status(proxy.pid, "VmHWM")}


def page_bytes(port: int, limit: int) -> int:
    """The bytes of one page of pods as the simulator serves a list."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", f"/api/v1/pods?limit={limit}",
                     headers={"Authorization": "Bearer kubesim-token"})
        return len(conn.getresponse().read())
    finally:
        conn.close()


def _summary(runs: list[dict[str, float]], key: str, fmt: str = "{:.1f}") -> str:
    vals = [r[key] for r in runs]
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.kubesim import free_port

    cluster = cluster_file(args)
    work = Path(tempfile.mkdtemp(prefix="karta-kube-scale-"))
    print(f"cluster {cluster} ({cluster.stat().st_size / MIB:.1f} MiB); work {work}",
          flush=True)
    sink = Sink()
    app = web.Application(client_max_size=64 * MIB)
    app.router.add_post("/api/v1/write", sink.write)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    up = free_port()
    await web.TCPSite(runner, "127.0.0.1", up).start()
    result: dict[str, Any] = {"pods": args.pods}
    sim: SimChild | None = None
    proxy: Proxy | None = None
    try:
        snap: list[dict[str, float]] = []
        for i in range(args.runs):
            r, proxy = await measure_start(["--snapshot", str(cluster)], sink, up, work,
                                           f"snapshot-{i}")
            await asyncio.to_thread(proxy.stop)  # the sink answers its last write
            proxy = None
            snap.append(r)
            print(f"snapshot run {i + 1}: {json.dumps(r)}", flush=True)
        t = time.monotonic()
        sim = SimChild(work, Path(__file__), ["--cluster", str(cluster)])
        await sim.expect("ready")
        result["sim_populate_s"] = time.monotonic() - t
        kube: list[dict[str, float]] = []
        for i in range(args.runs):
            r, proxy = await measure_start(["--kubeconfig", str(sim.kubeconfig)], sink, up,
                                           work, f"kube-{i}")
            kube.append(r)
            print(f"kube run {i + 1}: {json.dumps(r)}", flush=True)
            if i < args.runs - 1:
                await asyncio.to_thread(proxy.stop)
                proxy = None
        assert proxy is not None
        sim.send("pagesize")
        limits = (await sim.expect("pagesize")).split()[1:]
        size = int(limits[0].split(",")[-1]) if limits and limits[0] else 0
        result["page_size"] = size
        result["page_bytes"] = page_bytes(sim.port, size) if size else 0
        result["list_bytes"] = page_bytes(sim.port, 0)
        rel = [await relist(sim, proxy) for _ in range(args.runs)]
        for r in rel:
            print(f"relist: {json.dumps(r)}", flush=True)
        ch = await churn(sim, proxy, sink, args.churn_rate, args.churn_seconds)
        print(f"churn: {json.dumps(ch)}", flush=True)
        result.update(snapshot=snap, kube=kube, relist=rel, churn=ch)
    finally:
        if proxy is not None:
            await asyncio.to_thread(proxy.stop)
        if sim is not None:
            sim.stop()
        await runner.cleanup()
    report(result, args)
    return result


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    snap, kube, rel, ch = r["snapshot"], r["kube"], r["relist"], r["churn"]
    print(f"\n{args.pods} pods (+{args.rayjobs} RayJobs), median of {args.runs} "
          f"(min-max); simulator populated in {r['sim_populate_s']:.1f} s")
    rows: list[tuple[str, str, Callable[[list[dict[str, float]]], str]]] = [
        ("start -> ready (s)", "ready_s", lambda rs: _summary(rs, "ready_s")),
        ("CPU-s at ready", "ready_cpu_s", lambda rs: _summary(rs, "ready_cpu_s")),
        ("/-/healthy during the start: p99 (ms)", "start_healthy_p99_ms",
         lambda rs: _summary(rs, "start_healthy_p99_ms", "{:.0f}")),
        ("/-/healthy during the start: max (ms)", "start_healthy_max_ms",
         lambda rs: _summary(rs, "start_healthy_max_ms", "{:.0f}")),
        ("VmHWM at ready (MiB)", "hwm_ready", lambda rs: _summary(rs, "hwm_ready", "{:.0f}")),
        ("VmRSS at ready (MiB)", "rss_ready", lambda rs: _summary(rs, "rss_ready", "{:.0f}")),
        ("VmHWM after the first fact write (MiB)", "hwm_settled",
         lambda rs: _summary(rs, "hwm_settled", "{:.0f}")),
        ("VmRSS settled (MiB)", "rss_settled",
         lambda rs: _summary(rs, "rss_settled", "{:.0f}")),
    ]
    print(f"{'':<40} {'snapshot':>20} {'kubernetes':>20}")
    for label, _, f in rows:
        print(f"{label:<40} {f(snap):>20} {f(kube):>20}")
    print(f"list page: limit={r['page_size']}, {r['page_bytes'] / MIB:.2f} MiB a page of pods "
          f"as served (the whole pod list unpaged: {r['list_bytes'] / MIB:.1f} MiB)")
    print(f"relist after 410 ({len(rel)}x): every watch back in {_summary(rel, 'relist_s')} s, "
          f"{_summary(rel, 'relist_cpu_s')} CPU-s, VmHWM {_summary(rel, 'relist_hwm', '{:.0f}')}"
          f" MiB (RSS {_summary(rel, 'relist_rss_before', '{:.0f}')} -> "
          f"{_summary(rel, 'relist_rss_after', '{:.0f}')}), /-/healthy p50 "
          f"{_summary(rel, 'relist_healthy_p50_ms')} p99 "
          f"{_summary(rel, 'relist_healthy_p99_ms')} max "
          f"{_summary(rel, 'relist_healthy_max_ms', '{:.0f}')} ms")
    print(f"churn {args.churn_rate:g} pod events/s for {args.churn_seconds:g} s: "
          f"{ch['churn_stamped']} of {ch['churn_created']} pods seen stamped; lag "
          f"p50 {ch['churn_lag_p50_ms']:.0f} p99 {ch['churn_lag_p99_ms']:.0f} max "
          f"{ch['churn_lag_max_ms']:.0f} ms (50 ms resolution); proxy "
          f"{ch['churn_cpu_s']:.1f} CPU-s ({100 * ch['churn_cpu_s'] / args.churn_seconds:.0f}%"
          f" of a core, {ch['churn_probe_requests']} probe requests included); /-/healthy "
          f"p50 {ch['churn_healthy_p50_ms']:.1f} p99 {ch['churn_healthy_p99_ms']:.1f} max "
          f"{ch['churn_healthy_max_ms']:.0f} ms; RSS after {ch['churn_rss_after']:.0f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=37_500)
    ap.add_argument("--rayjobs", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--churn-rate", type=float, default=200.0, help="pod events a second")
    ap.add_argument("--churn-seconds", type=float, default=60.0)
    ap.add_argument("--realistic-pods", action="store_true",
                    help="pods of ~5 KB as a real cluster lists them (watch_bench.py's)")
    ap.add_argument("--work", default="/tmp/karta-kube-scale", help="where the cluster is cached")
    ap.add_argument("--json", action="store_true", help="print every figure as JSON at the end")
    ap.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sim:
        asyncio.run(run_sim(args))
        return 0
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
