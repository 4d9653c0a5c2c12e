"""Event-loop stalls over karta-proxy's life at scale, as its probes see them.

A real ``python -m proxy`` on the high-cardinality cluster (``memory_bench.py``'s 37.5k-pod
snapshot, copied: never changed in place) and a null upstream; from this process a
thread GETs ``/-/healthy`` every 20 ms and records each answer's latency, through:

1. the start and the first load (snapshot mode: the listener opens once it is loaded,
   so the probes are refused until then; ``--kube``: the API simulator
   (``tests/kubesim``) serves the snapshot's objects from a process of its own, and the
   listener is open during the initial list);
2. a change of the snapshot (a small second file rewritten: a reload; ``--kube``: the
   simulator's log compacted and every watch cut, so each one relists);
3. a SIGHUP with a changed description (the Deployment description's root component
   renamed: every Deployment's pod is attributed again);
4. fact writes (``facts.interval_seconds`` 5) for 11 s, then one ``/metrics`` scrape.

Printed per round: every probe slower than ``--stall-ms`` with its phase, the slowest
probe of each phase, the time to ready and ``VmHWM``. ``--sigterm-at S``: instead, a
SIGTERM ``S`` seconds after the log says the snapshot's apply began (``snapshot read;
applying it``; without that line, ``S`` seconds after exec), and the time to the exit.

    python3 benchmarks/stall_bench.py [--rounds 3] [--kube] [--pods 37500]
    python3 benchmarks/stall_bench.py --sigterm-at 1 [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from relay.procs import free_port  # noqa: E402

PROBE_SECONDS = 0.02
EXTRA_POD: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {
    "name": "extra-0", "namespace": "extra", "uid": "extra-uid-0"}, "spec": {}}


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``cmd`` from the repository root, its stderr to ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, stderr=f)


class Probe(threading.Thread):
    """GET ``/-/healthy`` every ``PROBE_SECONDS``: (seconds since ``t0``, latency, status
    or the error's name) each."""

    def __init__(self, port: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.port, self.t0 = port, t0
        self.answers: list[tuple[float, float, str]] = []
        self.done = False

    def run(self) -> None:
        while not self.done:
            began = time.monotonic()
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                c.request("GET", "/-/healthy")
                r = c.getresponse()
                r.read()
                c.close()
                status = str(r.status)
            except OSError as e:
                status = type(e).__name__
            took = time.monotonic() - began
            self.answers.append((began - self.t0, took, status))
            time.sleep(max(0.0, PROBE_SECONDS - took))


class Life:
    """One proxy process (and its simulator in ``--kube``) in a work folder."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        snap = work / "snap"
        snap.mkdir()
        shutil.copy(args.snapshot, snap / "cluster.json")
        self.extra = snap / "extra.json"
        self._write_extra({})
        (work / "desc").mkdir()
        self.description = (REPO / "proxy/karta/builtin/apps-deployment.yaml").read_text(
        ).replace("builtin-apps-deployment", "bench-apps-deployment")
        (work / "desc" / "deployment.yaml").write_text(self.description)
        (work / "config.yaml").write_text(
            "facts:\n  interval_seconds: 5\nsnapshot_reload_seconds: 1\n"
            f"karta:\n  description_paths: [{work / 'desc'}]\n")
        self.events: list[tuple[float, str]] = []
        self.sim: subprocess.Popen[bytes] | None = None
        up, self.port = free_port(), free_port()
        self.sink = subprocess.Popen(
            [sys.executable, str(HERE / "relay" / "null_upstream.py"), "--listen",
             f"127.0.0.1:{up}"], cwd=tempfile.gettempdir(), stderr=subprocess.DEVNULL)
        source = ["--snapshot", str(snap)]
        if args.kube:
            kubeconfig = work / "kubeconfig"
            self.sim = _spawn([sys.executable, __file__, "--serve-sim",
                               str(snap / "cluster.json"), str(kubeconfig)], work / "sim.log")
            self._wait(lambda: "sim ready" in (work / "sim.log").read_text(), 300, "sim")
            source = ["--kubeconfig", str(kubeconfig)]
        self.t0 = time.monotonic()
        self.proc = _spawn(
            [sys.executable, "-m", "proxy", "--config", str(work / "config.yaml"), *source,
             "--upstream-url", f"http://127.0.0.1:{up}/api/v1/write",
             "--listen-address", f"127.0.0.1:{self.port}", "--log-format", "json"],
            work / "proxy.log")
        self.probe = Probe(self.port, self.t0)
        self.probe.start()
        self.event("exec")

    def _write_extra(self, labels: dict[str, str]) -> None:
        pod = json.loads(json.dumps(EXTRA_POD))
        pod["metadata"]["labels"] = labels
        tmp = self.extra.with_suffix(".tmp")
        tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod]}))
        os.rename(tmp, self.extra)

    def event(self, name: str) -> None:
        self.events.append((time.monotonic() - self.t0, name))

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(f"no {what} within {timeout} s")
            time.sleep(0.02)

    def logged(self, message: str, n: int = 1, timeout: float = 300) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None:
                raise SystemExit(f"karta-proxy exited: see {self.work / 'proxy.log'}")
            return (self.work / "proxy.log").read_text().count(f'"msg": "{message}"') >= n
        self._wait(seen, timeout, repr(message))

    def vm_hwm(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def sigterm(self) -> float:
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        took = time.monotonic() - began
        self.event(f"exited {self.proc.returncode}")
        return took

    def close(self) -> None:
        self.probe.done = True
        for p in (self.proc, self.sink, self.sim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def phase(self, at: float) -> str:
        name = "exec"
        for t, n in self.events:
            if t <= at:
                name = n
        return name


def life(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    lf = Life(args, work)
    try:
        lf.logged("karta-proxy started")
        lf.event("ready")
        ready = lf.events[-1][0]
        time.sleep(3)
        lf.event("reload" if not args.kube else "relist")
        if args.kube:
            assert lf.sim is not None
            lf.sim.send_signal(signal.SIGUSR1)
            time.sleep(12)
        else:
            lf._write_extra({"x": "y"})
            lf.logged("snapshot reloaded")
            time.sleep(1)
        (work / "desc" / "deployment.yaml").write_text(
            lf.description.replace("name: deployment\n", "name: deploy2\n"))
        lf.event("SIGHUP")
        lf.proc.send_signal(signal.SIGHUP)
        lf.logged("configuration reloaded")
        lf.event("fact writes")
        time.sleep(11)
        lf.event("/metrics scrape")
        c = http.client.HTTPConnection("127.0.0.1", lf.port, timeout=120)
        c.request("GET", "/metrics")
        c.getresponse().read()
        lf.event("after")
        time.sleep(1)
        hwm = lf.vm_hwm()
        lf.sigterm()
    finally:
        lf.close()
    slowest: dict[str, float] = defaultdict(float)
    stalls = []
    for at, took, status in lf.probe.answers:
        ph = lf.phase(at)
        if status == "200":
            slowest[ph] = max(slowest[ph], took)
        if took * 1000 > args.stall_ms:
            stalls.append((round(at, 2), round(took * 1000), status, ph))
    return {"ready_s": ready, "vm_hwm_mib": hwm, "stalls": stalls,
            "slowest_ms": {k: round(v * 1000) for k, v in slowest.items()}}


def sigterm_during_load(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    lf = Life(args, work)
    try:
        if args.kube:
            time.sleep(args.sigterm_at)
        else:
            lf.logged("snapshot read; applying it", timeout=120)
            time.sleep(args.sigterm_at)
        took = lf.sigterm()
        log = (work / "proxy.log").read_text()
    finally:
        lf.close()
    return {"exit_s": round(took, 2), "rc": lf.proc.returncode,
            "started_first": '"msg": "karta-proxy started"' in log}


def serve_sim(snapshot: str, kubeconfig: str) -> None:
    """The simulator on a JSON List snapshot; SIGUSR1 compacts its log and cuts every
    watch (each relists after its 410)."""
    sys.path.insert(0, str(REPO))
    from tests.kubesim.__main__ import NODE, kinds_to_serve
    from tests.kubesim.resources import CORE_TYPES, NAMESPACE
    from tests.kubesim.server import KubeSim

    async def run() -> None:
        objs = json.loads(Path(snapshot).read_text())["items"]
        sim = KubeSim((*CORE_TYPES, NAMESPACE, NODE, *kinds_to_serve(objs)))
        await sim.start()
        for o in objs:
            sim.create(o)
        del objs
        sim.write_kubeconfig(Path(kubeconfig))
        print("sim ready", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def relist() -> None:
            sim.compact()
            sim.disconnect_watches()

        loop.add_signal_handler(signal.SIGUSR1, relist)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await sim.close()

    asyncio.run(run())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pods", type=int, default=37_500)
    p.add_argument("--work", default="/tmp/karta-memory-bench",
                   help="where memory_bench.py caches its snapshot")
    p.add_argument("--kube", action="store_true", help="Kubernetes mode, the simulator")
    p.add_argument("--stall-ms", type=float, default=100.0)
    p.add_argument("--sigterm-at", type=float, default=None)
    p.add_argument("--serve-sim", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_sim:
        serve_sim(*args.serve_sim)
        return 0
    args.snapshot = Path(args.work) / f"highcard-{args.pods}.json"
    if not args.snapshot.exists():
        print(f"no {args.snapshot}: run benchmarks/memory_bench.py --pods {args.pods} first")
        return 1
    results = []
    for i in range(args.rounds):
        work = Path(tempfile.mkdtemp(prefix="karta-stall-bench-"))
        try:
            out = (life(args, work) if args.sigterm_at is None
                   else sigterm_during_load(args, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"round {i + 1}: {json.dumps(out)}", flush=True)
        results.append(out)
    key = "exit_s" if args.sigterm_at is not None else "ready_s"
    print(f"median {key}: {statistics.median(r[key] for r in results):.2f}")
    if args.sigterm_at is None:
        print(f"median VmHWM: {statistics.median(r['vm_hwm_mib'] for r in results):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
