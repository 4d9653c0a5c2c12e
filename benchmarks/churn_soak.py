"""Leak audit under churn: does every per-object structure shrink back?

The proxy's memory must follow the live pods and workloads, never time. This drives, in
cycles, the churn a cluster makes for months through the project's Kubernetes API
simulator (``tests/kubesim``, in this process) into ``karta-proxy`` in its own process
(``soak_proxy.py``: the product's command line with a measurement hook), relaying
remote-write requests that name the churned pods (to a rotating set of tenants, over
fresh connections) and writing facts on a short interval into a null upstream
(``relay/null_upstream.py``):

- CronJob-like: a Job of a CronJob and its pod created, run, completed and deleted
  (every ``--job-every`` seconds);
- Deployment rolls: a new ReplicaSet (and pods) each time, the old one deleted;
- namespaces created with a Deployment in them and deleted with everything in them;
- RayJobs (a CRD described by a ``Karta`` object): RayJob, RayCluster and pods, the
  previous one deleted; the ``Karta`` itself created at a cycle's start and deleted at
  its end (a description that comes and goes).

Between cycles the churn stops, and once it settled past the tombstone time (shortened to
``--tombstone-seconds``) the cycle is measured: the proxy's own ``VmRSS`` and
``RssAnon``, glibc's heap (``mallinfo2``: in use, free), the same after ``malloc_trim``;
in a child forked from the proxy (so that the proxy itself is not changed by it) what
its frozen heap holds that is garbage (``gc.freeze`` leaves it to the product for good),
``len()`` of every container reachable from the proxy's long-lived objects (a walk of
their attributes, so a structure nobody listed is measured too) and the count of live
objects per ``proxy.*`` class; the children per family on ``/metrics``, the fact
writer's series; this process' RSS (the simulator's, the churn's, the senders'). A
structure that grows cycle after cycle while the live objects stay the same is a leak;
the table shows every one that changed between cycle 1 and the last, then the ones that
grew (exit code 1 when any did). ``--in-process`` runs the proxy in this process as
``proxy.runtime`` assembles it (RSS is then the three's together).

    python benchmarks/churn_soak.py [--cycles 6] [--cycle-seconds 30]
        [--tombstone-seconds 2] [--tracemalloc [--tracemalloc-from 2]] [--arena-max N]
        [--in-process] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from proxy import runtime  # noqa: E402
from proxy.config import Settings  # noqa: E402
from proxy.runtime import Proxy  # noqa: E402
from proxy.sender import Series, send_series  # noqa: E402
from tests.karta.descriptions import RAYJOB_KARTA  # noqa: E402
from tests.kube.conftest import owner, pod  # noqa: E402
from tests.kubesim import KubeSim, free_port  # noqa: E402
from tests.kubesim.resources import KARTA, RAY_CLUSTER, RAY_JOB, RESOURCE_INTERFACE  # noqa: E402

Obj = dict[str, Any]

#: the walk's bounds: containers larger than this are measured, not entered
ENTER_AT_MOST = 64
MAX_DEPTH = 8
#: the proxy's parts, walked first so that each structure is named by its owner
ROOTS = ("index", "engine", "enricher", "source", "facts", "handler", "upstream", "metrics",
         "jq_sandbox", "cluster_identity")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _ours(obj: object) -> bool:
    return str(getattr(type(obj), "__module__", "")).startswith("proxy")


def _native(obj: object) -> bool:
    return "_splice" in str(getattr(type(obj), "__module__", ""))


def _attributes(obj: object) -> Iterator[tuple[str, object]]:
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from d.items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                yield name, getattr(obj, name)


def _sized(obj: object) -> int | None:
    if isinstance(obj, (str, bytes, bytearray, memoryview, tuple)):
        return None
    if isinstance(obj, (dict, set, frozenset, list, collections.deque)):
        return len(obj)
    if _ours(obj) or _native(obj):
        try:
            return len(obj)  # type: ignore[arg-type]
        except TypeError:
            return None
    return None


def structures(root: object) -> dict[str, int]:
    """``len()`` of every container reachable from ``root`` through attributes of the
    project's objects (and the values of small containers of them), by attribute path."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def visit(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(obj))
        n = _sized(obj)
        if n is not None:
            out[path] = out.get(path, 0) + n
            memory = getattr(obj, "memory", None)
            if callable(memory) and _native(obj):
                out[path + ".memory()"] = int(memory())
        if isinstance(obj, dict):
            if len(obj) <= ENTER_AT_MOST:
                for _k, v in list(obj.items()):
                    if _ours(v) or isinstance(v, (dict, set, list, tuple, collections.deque)):
                        visit(v, f"{path}[*]", depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            if len(obj) <= ENTER_AT_MOST:
                for v in list(obj):
                    if _ours(v) or isinstance(v, (dict, set, list, collections.deque)):
                        visit(v, f"{path}[{type(v).__name__}]", depth + 1)
            return
        if not _ours(obj):
            return
        for name, value in list(_attributes(obj)):
            if callable(value) and not _ours(value) and not isinstance(value, (dict, list)):
                # a bound method holds its object: follow that object
                value = getattr(value, "__self__", None)
                if value is None:
                    continue
            visit(value, f"{path}.{name}", depth + 1)

    for name in ROOTS:  # named by the attribute that owns them, before any other path
        if getattr(root, name, None) is not None:
            visit(getattr(root, name), f"proxy.{name}", 1)
    visit(root, "proxy", 0)
    for modname, module in sorted(sys.modules.items()):  # module-level caches and registries
        if modname.startswith("proxy") and module is not None:
            for name, value in list(vars(module).items()):
                if not name.startswith("__") and (
                        _ours(value) or isinstance(value, (dict, set, list, collections.deque))):
                    visit(value, f"{modname}.{name}", 1)
    return out


def live_objects() -> dict[str, int]:
    """Live instances per ``proxy.*`` class."""
    c: collections.Counter[str] = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        if str(getattr(t, "__module__", "")).startswith("proxy"):
            c[f"{t.__module__}.{t.__qualname__}"] += 1
    return dict(c)


def metric_children(text: str) -> dict[str, int]:
    return {fam.name: len(fam.samples) for fam in text_string_to_metric_families(text)}


# -- the churn ------------------------------------------------------------------------------


class Churn:
    """The churn's objects in the simulator; ``live_pods`` is what the senders name."""

    def __init__(self, sim: KubeSim, args: argparse.Namespace) -> None:
        self.sim = sim
        self.args = args
        self.seq = 0
        self.live_pods: dict[tuple[str, str], float] = {}  # -> deletion time (0: live)
        self.cron = sim.create({
            "apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "tick", "namespace": "cron"},
            "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {}}}})
        self.dep = sim.create({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "roll"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}}})
        self.rs: Obj | None = None
        self.rs_pods: list[Obj] = []
        self.namespaces: list[tuple[Obj, list[Obj]]] = []
        self.ray: tuple[Obj, list[Obj]] | None = None

    def _pod(self, name: str, ns: str, owner_obj: Obj, labels: dict[str, str]) -> Obj:
        p = self.sim.create(pod(name, ns, owner_obj=owner_obj, labels=labels))
        self.live_pods[(ns, name)] = 0.0
        return p

    def _gone(self, p: Obj) -> None:
        md = p["metadata"]
        self.live_pods[(md["namespace"], md["name"])] = time.monotonic()

    async def job(self) -> None:
        """One CronJob run: Job + pod, running, then complete, then deleted."""
        self.seq += 1
        job = self.sim.create({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"tick-{self.seq}", "namespace": "cron",
                         "ownerReferences": owner(self.cron)},
            "spec": {"parallelism": 1, "completions": 1}, "status": {"active": 1}})
        p = self._pod(f"tick-{self.seq}-x", "cron", job, {"job-name": f"tick-{self.seq}"})
        await asyncio.sleep(self.args.job_every / 2)
        p["status"] = {"phase": "Succeeded"}
        self.sim.update(p)
        job = self.sim.get("batch/v1", "Job", job["metadata"]["name"], "cron")
        job["status"] = {"succeeded": 1, "conditions": [
            {"type": "Complete", "status": "True"}]}
        self.sim.update(job)
        await asyncio.sleep(self.args.job_every / 2)
        self.sim.delete(job)
        self._gone(p)

    def roll(self) -> None:
        """A Deployment rollout: a new ReplicaSet and pods, the old ReplicaSet deleted."""
        self.seq += 1
        rs = self.sim.create({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": f"web-{self.seq}", "namespace": "roll",
                         "ownerReferences": owner(self.dep), "labels": {"app": "web"}},
            "spec": {"replicas": 2}})
        pods = [self._pod(f"web-{self.seq}-{i}", "roll", rs, {"app": "web"}) for i in range(2)]
        if self.rs is not None:
            self.sim.delete(self.rs)
            for p in self.rs_pods:
                self._gone(p)
        self.rs, self.rs_pods = rs, pods

    def namespace(self) -> None:
        """A namespace with a Deployment in it; the oldest of three deleted with its
        objects."""
        self.seq += 1
        name = f"team-{self.seq}"
        ns = self.sim.create({"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": name}})
        dep = self.sim.create({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "api", "namespace": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "api"}}}})
        rs = self.sim.create({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "api-1", "namespace": name, "ownerReferences": owner(dep),
                         "labels": {"app": "api"}}, "spec": {"replicas": 1}})
        p = self._pod("api-1-0", name, rs, {"app": "api"})
        self.namespaces.append((ns, [dep, p]))
        if len(self.namespaces) > 3:
            old_ns, (old_dep, old_pod) = self.namespaces.pop(0)
            self.sim.delete(old_dep)
            self._gone(old_pod)
            self.sim.delete(old_ns)

    def rayjob(self) -> None:
        """A RayJob (a described CRD), its RayCluster and pods; the previous one deleted."""
        self.seq += 1
        name = f"train-{self.seq}"
        job = self.sim.create({
            "apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": "ml"},
            "spec": {"rayClusterSpec": {"headGroupSpec": {"template": {}}, "workerGroupSpecs": [
                {"groupName": "gpu", "template": {}}]}},
            "status": {"jobStatus": "RUNNING"}})
        cluster = self.sim.create({
            "apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": f"{name}-rc", "namespace": "ml", "ownerReferences": owner(job)}})
        pods = [self._pod(f"{name}-head", "ml", cluster, {"ray.io/node-type": "head"}),
                self._pod(f"{name}-gpu-0", "ml", cluster,
                          {"ray.io/node-type": "worker", "ray.io/group": "gpu"})]
        if self.ray is not None:
            old_job, old_pods = self.ray
            self.sim.delete(old_job)
            for p in old_pods:
                self._gone(p)
        self.ray = (job, pods)

    async def run(self, seconds: float) -> None:
        """One cycle of churn; the RayJob description lives through the cycle only (the
        description churns: created at its start, deleted with its RayJobs at its end)."""
        karta = self.sim.create(RAYJOB_KARTA)
        try:
            await self._run(seconds)
        finally:
            if self.ray is not None:
                self.sim.delete(self.ray[0])
                for p in self.ray[1]:
                    self._gone(p)
                self.ray = None
            self.sim.delete(karta)

    async def _run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        next_roll = next_ns = time.monotonic()
        while time.monotonic() < end:
            await self.job()
            self.rayjob()
            now = time.monotonic()
            if now >= next_roll:
                self.roll()
                next_roll = now + self.args.roll_every
            if now >= next_ns:
                self.namespace()
                next_ns = now + self.args.namespace_every

    def named(self, keep: float) -> list[tuple[str, str]]:
        """The pods a sender names: live ones and those gone less than ``keep`` s ago
        (their last scrapes); older ones are forgotten here."""
        now = time.monotonic()
        for k, gone in list(self.live_pods.items()):
            if gone and now - gone > keep:
                del self.live_pods[k]
        return list(self.live_pods)


async def senders(port: int, churn: Churn, stop: asyncio.Event, cycle: int,
                  args: argparse.Namespace) -> int:
    """Remote-write requests naming the churned pods: each cycle its own tenants (as
    tenants come and go) and each request its own connection (as senders do)."""
    sent = 0
    last = 0
    while not stop.is_set():
        ts = max(int(time.time() * 1000), last + 1)
        last = ts
        series = [Series({"__name__": "churn_probe", "namespace": ns, "pod": name},
                         [(ts, 1.0)]) for ns, name in churn.named(args.tombstone_seconds)]
        tenant = 1000 * cycle + sent % args.tenants
        async with aiohttp.ClientSession() as session:
            status, _, _ = await send_series(
                f"http://127.0.0.1:{port}/insert/{tenant}/prometheus/api/v1/write",
                series, session=session, timeout=10)
        if status != 204:
            raise SystemExit(f"write answered {status}")
        sent += 1
        await asyncio.sleep(args.send_every)
    return sent


class InProcess:
    """The proxy in this process, beside the simulator and the senders: its structures
    read directly, but its RSS is the three's together."""

    def __init__(self, settings: Settings) -> None:
        # tombstones and ghosts are dropped by a housekeeping pass every 30 s: run it
        # every second so that a cycle settles in seconds (what it drops is the same)
        runtime.EXPIRE_INTERVAL_SECONDS = 1.0
        self.proxy = Proxy(settings)
        self.base: tracemalloc.Snapshot | None = None

    @property
    def port(self) -> int:
        return self.proxy.port

    async def start(self) -> None:
        await asyncio.wait_for(self.proxy.start(), 30)

    async def stop(self) -> None:
        await self.proxy.stop()

    async def measure(self, session: aiohttp.ClientSession, cycle: int,
                      args: argparse.Namespace) -> dict[str, Any]:
        async with session.get(f"http://127.0.0.1:{self.port}/metrics") as r:
            text = await r.text()
        # from here no await: a fact write meanwhile would freeze the heap again, and the
        # objects counted below (``gc.get_objects``) would be missing
        gc.collect()
        frozen = gc.get_freeze_count()
        gc.unfreeze()  # the proxy freezes what its sync and writes made: count that too
        frozen_garbage = gc.collect()
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        proxy = self.proxy
        m: dict[str, Any] = {
            "rss_mib": round(rss_mib(), 1),
            "frozen": frozen, "frozen_garbage": frozen_garbage,
            "tasks": len(asyncio.all_tasks()),
            "pods": len(proxy.index.pods),
            "structures": structures(proxy),
            "objects": live_objects(),
            "metrics": metric_children(text),
            "fact_series": len(getattr(proxy.facts, "_written", ()) or ())
            if proxy.facts else 0,
        }
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            if cycle == args.tracemalloc_from:
                self.base = snap
            elif self.base is not None:
                m["tracemalloc"] = grown(snap, self.base)
        return m


def grown(snap: tracemalloc.Snapshot, base: tracemalloc.Snapshot,
          top: int = 20) -> list[str]:
    """The allocation sites that grew most since ``base``, each with its traceback."""
    return ["\n".join(map(str, [t, *t.traceback.format()[-8:]]))
            for t in snap.compare_to(base, "traceback")[:top]]


def status_of(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            out[key] = round(int(rest.split()[0]) / 1024, 2)
    return out


class OwnProcess:
    """``karta-proxy`` in its own process (``soak_proxy.py``: the product's command line
    with a measurement hook), so that its RSS is its own: the simulator and the senders
    stay in this one."""

    def __init__(self, settings: Settings, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="churn-soak-"))
        config = {
            "server": {"listen_address": f"127.0.0.1:{self.port}"},
            "upstream": {"url": settings.upstream.url},
            "kube": {"kubeconfig": settings.kube.kubeconfig,
                     "resync_backoff_max_seconds": settings.kube.resync_backoff_max_seconds},
            "facts": {"interval_seconds": settings.facts.interval_seconds},
            "karta": {"tombstone_seconds": settings.karta.tombstone_seconds},
            "log_level": "WARNING",
        }
        (self.dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        self.request = self.dir / "request.json"
        env = dict(os.environ, SOAK_REQUEST=str(self.request), SOAK_EXPIRE_SECONDS="1")
        if args.arena_max:
            env["MALLOC_ARENA_MAX"] = str(args.arena_max)
        if args.tracemalloc:
            env["SOAK_TRACEMALLOC"] = "8"
        self.log = (self.dir / "proxy.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "soak_proxy.py"), "--config",
             str(self.dir / "config.yaml")],
            cwd="/tmp", env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.seq = 0
        self.dumps: dict[int, Path] = {}

    async def start(self) -> None:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise SystemExit(f"karta-proxy exited {self.process.returncode}: "
                                     f"{self.dir / 'proxy.log'}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{self.port}/-/ready") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise SystemExit("karta-proxy not ready in 30 s")

    async def stop(self) -> None:
        self.process.terminate()
        try:
            await asyncio.to_thread(self.process.wait, 20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    async def measure(self, session: aiohttp.ClientSession, cycle: int,
                      args: argparse.Namespace) -> dict[str, Any]:
        async with session.get(f"http://127.0.0.1:{self.port}/metrics") as r:
            text = await r.text()
        self.seq += 1
        answer = self.dir / f"answer-{self.seq}.json"
        request: dict[str, Any] = {"seq": self.seq, "answer": str(answer), "audit": True}
        if args.tracemalloc and cycle in (args.tracemalloc_from, args.cycles):
            self.dumps[cycle] = self.dir / f"tracemalloc-{cycle}.bin"
            request["tracemalloc_dump"] = str(self.dumps[cycle])
        self.request.write_text(json.dumps(request))
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while not answer.exists():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"no measurement from karta-proxy: {self.dir}")
            await asyncio.sleep(0.1)
        m: dict[str, Any] = json.loads(answer.read_text())
        m["rss_mib"] = m["trimmed"]["VmRSS"]
        m["metrics"] = metric_children(text)
        m["driver"] = status_of(os.getpid())  # the simulator, the churn and the senders
        if cycle == args.cycles and len(self.dumps) == 2:
            base, last = (tracemalloc.Snapshot.load(str(p)) for p in self.dumps.values())
            m["tracemalloc"] = grown(last, base)
        return m


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sink_port = free_port()
    sink = subprocess.Popen([sys.executable, str(HERE / "relay" / "null_upstream.py"),
                             "--listen", f"127.0.0.1:{sink_port}"], cwd="/tmp")
    sim = KubeSim(bookmark_interval=0.5, max_watch_seconds=30.0, max_log=args.sim_log)
    sim.register(RAY_JOB, RAY_CLUSTER, KARTA, RESOURCE_INTERFACE)
    for ns in ("cron", "roll", "ml"):
        sim.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    await sim.start()
    s = Settings()
    s.kube.kubeconfig = str(sim.write_kubeconfig(Path("/tmp") / f"churn-soak-{sink_port}.yaml"))
    s.kube.resync_backoff_max_seconds = 0.5
    s.upstream.url = f"http://127.0.0.1:{sink_port}/insert/{{tenant}}/prometheus/api/v1/write"
    s.server.listen_address = "127.0.0.1:0"
    s.facts.interval_seconds = args.fact_interval
    s.karta.tombstone_seconds = args.tombstone_seconds
    proxy: InProcess | OwnProcess = (InProcess(s) if args.in_process
                                     else OwnProcess(s, args))
    cycles: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        await asyncio.sleep(0.5)  # the sink's listen
        await proxy.start()
        churn = Churn(sim, args)
        async with aiohttp.ClientSession() as session:
            for c in range(1, args.cycles + 1):
                if time.monotonic() - started > args.max_minutes * 60:
                    print(f"stopped after {c - 1} cycles: --max-minutes {args.max_minutes}")
                    break
                stop = asyncio.Event()
                sending = asyncio.create_task(senders(proxy.port, churn, stop, c, args))
                t0 = time.monotonic()
                await churn.run(args.cycle_seconds)
                await asyncio.sleep(args.tombstone_seconds + 1)  # the last pods' scrapes
                stop.set()
                sent = await sending
                # settle: tombstones expire, facts written (stale markers sent) twice
                await asyncio.sleep(args.tombstone_seconds + 3 * args.fact_interval + 2)
                m = await proxy.measure(session, c, args)
                m.update(cycle=c, seconds=round(time.monotonic() - t0, 1), requests=sent,
                         churned=churn.seq, load=round(os.getloadavg()[0], 2))
                cycles.append(m)
                line = (f"cycle {c}: rss {m['rss_mib']} MiB, pods {m['pods']}, "
                        f"tasks {m['tasks']}, facts {m['fact_series']}, requests {sent}, "
                        f"objects churned {churn.seq}, frozen garbage "
                        f"{m.get('frozen_garbage')}, load {m['load']}")
                if "raw" in m:
                    line += (f", raw {m['raw']['VmRSS']} anon {m['raw']['RssAnon']} heap "
                             f"free {m['heap_raw']['free']} MiB, driver "
                             f"{m['driver']['VmRSS']} MiB")
                print(line, flush=True)
    finally:
        await proxy.stop()
        await sim.close()
        sink.terminate()
        sink.wait()
    return {"cycles": cycles, "in_process": args.in_process, "arena_max": args.arena_max}


def report(result: dict[str, Any]) -> bool:
    """Print what changed between cycle 1 and the last; True when something grew."""
    cycles = result["cycles"]
    first, last = cycles[0], cycles[-1]
    grew = False
    for section in ("structures", "objects", "metrics"):
        a, b = first[section], last[section]
        keys = sorted(set(a) | set(b))
        changed = [(k, a.get(k, 0), b.get(k, 0)) for k in keys if a.get(k, 0) != b.get(k, 0)]
        print(f"\n{section}: {len(keys)} measured, {len(changed)} changed (cycle 1 -> "
              f"{len(cycles)})")
        for k, x, y in changed:
            series = [c[section].get(k, 0) for c in cycles]
            growing = y > x and all(v2 >= v1 for v1, v2 in itertools.pairwise(series))
            grew |= growing
            print(f"  {'GROWS ' if growing else '      '}{k}: {' '.join(map(str, series))}")
    for line in last.get("tracemalloc", []):
        print(line)
    def row(name: str, values: list[Any]) -> None:
        print(f"{name}: {' '.join(str(v) for v in values)}")

    print()
    if result["in_process"]:
        row("rss MiB (this process: proxy, simulator, senders; gc + trim)",
            [c["rss_mib"] for c in cycles])
    else:
        row("proxy VmRSS MiB", [c["raw"]["VmRSS"] for c in cycles])
        row("proxy RssAnon MiB", [c["raw"]["RssAnon"] for c in cycles])
        row("proxy heap in use MiB", [c["heap_raw"]["in_use"] for c in cycles])
        row("proxy heap free MiB", [c["heap_raw"]["free"] for c in cycles])
        row("proxy VmRSS after malloc_trim MiB", [c["trimmed"]["VmRSS"] for c in cycles])
        row("proxy RssAnon after malloc_trim MiB", [c["trimmed"]["RssAnon"] for c in cycles])
        row("driver VmRSS MiB (simulator, churn, senders)",
            [c["driver"]["VmRSS"] for c in cycles])
    row("frozen objects", [c.get("frozen") for c in cycles])
    row("frozen garbage (never collected by the proxy)",
        [c.get("frozen_garbage") for c in cycles])
    for kind, n in last.get("frozen_garbage_kinds", {}).items():
        print(f"  {kind}: {n}")
    row("load average", [c["load"] for c in cycles])
    print(f"fact series: {' '.join(str(c['fact_series']) for c in cycles)}")
    print(f"live pods: {' '.join(str(c['pods']) for c in cycles)}")
    print(f"tasks: {' '.join(str(c['tasks']) for c in cycles)}")
    return grew


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--cycle-seconds", type=float, default=30.0)
    ap.add_argument("--tombstone-seconds", type=float, default=2.0)
    ap.add_argument("--fact-interval", type=float, default=0.5)
    ap.add_argument("--job-every", type=float, default=0.3)
    ap.add_argument("--roll-every", type=float, default=1.0)
    ap.add_argument("--namespace-every", type=float, default=2.0)
    ap.add_argument("--send-every", type=float, default=0.1)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--sim-log", type=int, default=1_000,
                    help="the simulator's event log (small: it is full after cycle 1, so "
                         "that the simulator, in this process, stops growing)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="also print the allocation sites of the proxy that grew from "
                         "--tracemalloc-from to the last cycle")
    ap.add_argument("--tracemalloc-from", type=int, default=2)
    ap.add_argument("--in-process", action="store_true",
                    help="the proxy in this process (as proxy.runtime assembles it) beside "
                         "the simulator: RSS is theirs together; by default karta-proxy "
                         "runs in its own process (soak_proxy.py) and its own RSS is read")
    ap.add_argument("--arena-max", type=int, default=0,
                    help="MALLOC_ARENA_MAX for the proxy's process (0: the proxy's own, 2)")
    ap.add_argument("--max-minutes", type=float, default=40.0,
                    help="no cycle starts after this long")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.tracemalloc and args.in_process:
        tracemalloc.start(8)
    result = asyncio.run(run(args))
    grew = report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    sys.exit(1 if grew else 0)


if __name__ == "__main__":
    main()
