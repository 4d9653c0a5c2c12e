"""Heavy described objects updated often: what a sender of remote writes sees while the
proxy follows them.

An Argo-Workflow-like custom resource with its own ``Karta`` description (phase from
``.status.phase``, instance ids and a replica count over ``.status.nodes``), ``--nodes``
nodes each (3,000: ~1.7 MB of JSON, what a large running Workflow is), ``--objects`` of
them, each with three pods, served by the API simulator in a process of its own. The real
``python -m proxy --kubeconfig`` (its defaults: the jq sandbox on) follows them and relays
to a sink in this process.

Measured, first idle for ``--idle-seconds``, then while the simulator updates every object
once a second for ``--seconds`` (a new status, as a Workflow controller writes it):

- a sender's 200-series remote-write request every 50 ms (its pods among the Workflows'):
  answer time p50 / p99 / max, and any answer that is not a 2xx;
- ``GET /-/healthy`` every 20 ms: the event loop's stalls as a client sees them;
- the Workflow events the proxy handled (``karta_proxy_watch_events_total``) against the
  updates made, at the end of the updates and once it is quiet: whether it kept up;
- the proxy's CPU-s and RSS over the updates, and
  ``karta_proxy_deferred_object_updates_total`` where the proxy has it.

``--edits N`` adds a phase after those figures (none by default): once quiet, the
Workflows' Karta object is edited N times (a status mapping added, then taken out again),
each edit followed by the proxy's quiet, so that every Workflow is re-evaluated under the
new description; the writes and ``GET /-/healthy`` answered from the first edit to the
last quiet are the phase's figures (the event loop held ~150-250 ms a Workflow where that
re-evaluation is made on it).

    python benchmarks/heavy_object_bench.py [--objects 10] [--nodes 3000] [--seconds 20]
                                            [--edits 0] [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kube_scale_bench import (  # noqa: E402
    LoopProbe,
    Proxy,
    SimChild,
    Sink,
    _status,
    busy_until_quiet,
    pct,
    probe_body,
    serve_commands,
    start_proxy,
    wait_ready,
)
from relay.procs import cpu_seconds  # noqa: E402
from relay.workdir import results_path  # noqa: E402

GROUP, VERSION, KIND, PLURAL = "argoproj.io", "v1alpha1", "Workflow", "workflows"
NAMESPACE = "argo"
#: the Karta object describing the Workflows: every path reads ``.status.nodes``
DESCRIPTION: dict[str, Any] = {
    "apiVersion": "run.ai/v1alpha1", "kind": "Karta", "metadata": {"name": "argo-workflow"},
    "spec": {"structureDefinition": {"rootComponent": {
        "name": "workflow",
        "kind": {"group": GROUP, "version": VERSION, "kind": KIND},
        "specDefinition": {"podTemplateSpecPath": ".spec.podSpecPatch"},
        "instanceIdPath":
            '[.status.nodes[]? | select(.type == "Pod") | .templateName] | unique | .[]',
        "podSelector": {"componentInstanceSelector": {
            "idPath": '.metadata.labels["workflows.argoproj.io/template"]'}},
        "scaleDefinition": {"replicasPath":
            '[.status.nodes[]? | select(.type == "Pod" and .phase == "Running")] | length'},
        "statusDefinition": {
            "phaseDefinition": {"path": ".status.phase"},
            "statusMappings": {
                "running": [{"byPhase": "Running"}],
                "completed": [{"byPhase": "Succeeded"}],
                "failed": [{"byPhase": "Failed"}, {"byPhase": "Error"}],
                "initializing": [{"byPhase": "Pending"}],
            }},
    }}}}
#: a sender's request: one series a pod, every 50 ms
SEND_EVERY = 0.05
SERIES = 200


def _node(i: int, wf: str, running: int) -> dict[str, Any]:
    nid = f"{wf}-{1000000000 + i * 7919}"
    return {
        "id": nid, "name": f"{wf}.main.step-{i // 50}[{i % 50}].task",
        "displayName": f"task({i % 50})", "type": "Pod" if i % 5 else "Steps",
        "templateName": f"tmpl-{i % 12}", "templateScope": "local/" + wf,
        "phase": "Running" if i >= running else "Succeeded",
        "boundaryID": f"{wf}-{1000000000 + (i // 50) * 7919}",
        "startedAt": "2026-12-06T05:00:00Z",
        "finishedAt": None if i >= running else "2026-12-06T05:01:00Z",
        "progress": "1/1", "resourcesDuration": {"cpu": 12 + i % 7, "memory": 40 + i % 9},
        "hostNodeName": f"gpu-node-{i % 300}",
        "outputs": {"exitCode": "0", "artifacts": [{"name": "main-logs", "s3": {
            "key": f"artifacts/{wf}/{nid}/main.log"}}]},
        "children": [f"{wf}-{1000000000 + (i + 1) * 7919}"],
    }


def workflow(name: str, nodes: int, version: int) -> dict[str, Any]:
    """A Workflow whose ``status.nodes`` holds ``nodes`` entries (~500 B each);
    ``version`` moves how many have finished."""
    running = min(nodes, version * 3)
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"workflows.argoproj.io/phase": "Running"}},
        "spec": {"entrypoint": "main", "templates": [
            {"name": f"tmpl-{t}", "container": {"image": "registry.example/x:1",
                                                 "command": ["run"],
                                                 "args": [f"--shard={t}"] * 20}}
            for t in range(12)]},
        "status": {"phase": "Running", "startedAt": "2026-12-06T05:00:00Z",
                   "progress": f"{running}/{nodes}",
                   "nodes": {n["id"]: n for n in (_node(i, name, running)
                                                  for i in range(nodes))}},
    }


def pods_of(objects: int) -> list[tuple[str, str]]:
    return [(NAMESPACE, f"wf-{i}-p{p}") for i in range(objects) for p in range(3)]


# -- the simulator's process ---------------------------------------------------------------


async def run_sim(args: argparse.Namespace) -> None:
    """Serve the Workflows; then ``update SECONDS`` (each object once a second; prints
    ``updated N``, the updates made), an empty line ends it."""
    from tests.kubesim import KubeSim
    from tests.kubesim.resources import KARTA, ResourceType

    sim = KubeSim(port=args.port, bookmark_interval=5.0, max_log=300)
    sim.register(ResourceType(GROUP, VERSION, KIND, PLURAL), KARTA)
    karta = sim.create(DESCRIPTION)
    made = [sim.create(workflow(f"wf-{i}", args.nodes, 0)) for i in range(args.objects)]
    for wf in made:
        for p in range(3):
            name = wf["metadata"]["name"]
            sim.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": f"{name}-p{p}", "namespace": NAMESPACE,
                "labels": {"workflows.argoproj.io/template": f"tmpl-{p}"},
                "ownerReferences": [{"apiVersion": wf["apiVersion"], "kind": KIND,
                                     "name": name, "uid": wf["metadata"]["uid"],
                                     "controller": True}]},
                "spec": {"containers": []}, "status": {"phase": "Running"}})
    version = 0
    async for cmd in serve_commands(sim, args.kubeconfig):
        if cmd[0] == "describe":  # the description edited: every Workflow re-evaluated
            edited = json.loads(json.dumps(DESCRIPTION))
            running = edited["spec"]["structureDefinition"]["rootComponent"][
                "statusDefinition"]["statusMappings"]["running"]
            if karta["spec"] == DESCRIPTION["spec"]:
                running.append({"byPhase": "Active"})
            edited["metadata"]["resourceVersion"] = karta["metadata"]["resourceVersion"]
            karta = sim.update(edited)
            print("described", flush=True)
        elif cmd[0] == "update":
            end = time.monotonic() + float(cmd[1])
            updates = 0
            while time.monotonic() < end:
                version += 1
                t0 = time.monotonic()
                for wf in made:
                    new = workflow(wf["metadata"]["name"], args.nodes, version)
                    new["metadata"] = {k: v for k, v in wf["metadata"].items()
                                       if k != "resourceVersion"}
                    sim.update(new)
                    updates += 1
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
            print(f"updated {updates}", flush=True)
    await sim.close()


# -- this process ----------------------------------------------------------------------------


class Sender(threading.Thread):
    """A remote-write request every ``SEND_EVERY`` seconds on one keep-alive connection:
    (monotonic time sent, seconds to the answer, status) of each."""

    def __init__(self, port: int, body: bytes) -> None:
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.answers: list[tuple[float, float, int]] = []
        self._done = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._done.is_set():
            t = time.perf_counter()
            sent = time.monotonic()
            try:
                conn.request("POST", "/api/v1/write", body=self.body, headers={
                    "Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                    "X-Prometheus-Remote-Write-Version": "0.1.0"})
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                conn.close()
                status = 0
            self.answers.append((sent, time.perf_counter() - t, status))
            self._done.wait(max(0.0, SEND_EVERY - (time.perf_counter() - t)))

    def stop(self) -> None:
        self._done.set()
        self.join(35)


def _metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics?facts=false")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _sum(text: str, name: str, *needles: str) -> float:
    """The sum of a family's samples whose line holds every one of ``needles``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(n in line for n in needles))


def workflow_events(port: int) -> float:
    return _sum(_metrics(port), "karta_proxy_watch_events_total", PLURAL, '"MODIFIED"')


def children_cpu(proxy: Proxy) -> float:
    """CPU-s of the proxy's children (its jq sandbox's, a restarted one's included),
    which its own figures leave out until it waits for them."""
    return cpu_seconds(proxy.pid) - proxy.cpu()


def _ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": pct(values, 50) * 1e3, "p99_ms": pct(values, 99) * 1e3,
            "max_ms": max(values, default=float("nan")) * 1e3}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from aiohttp import web

    from tests.kubesim import free_port

    sink = Sink()
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/api/v1/write", sink.write)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    up = free_port()
    await web.TCPSite(runner, "127.0.0.1", up).start()
    work = Path(tempfile.mkdtemp(prefix="heavy-object-bench-"))
    sim = SimChild(work, Path(__file__), ["--objects", str(args.objects),
                                         "--nodes", str(args.nodes)])
    proxy: Proxy | None = None
    try:
        await sim.expect("ready")
        proxy = start_proxy(["--kubeconfig", str(sim.kubeconfig)], up, work, "proxy")
        ready = await wait_ready(proxy)
        await busy_until_quiet(proxy)
        body = probe_body([*pods_of(args.objects),
                           *((NAMESPACE, f"other-{k}") for k in range(SERIES))][:SERIES],
                          int(time.time() * 1000))
        sender = Sender(proxy.port, body)
        sender.start()
        probe = LoopProbe(proxy.port)
        await asyncio.sleep(args.idle_seconds)
        events0 = await asyncio.to_thread(workflow_events, proxy.port)
        rss0, cpu0 = _status(proxy.pid, "VmRSS"), proxy.cpu()
        jq0 = children_cpu(proxy)
        t_update = time.monotonic()
        sim.send(f"update {args.seconds}")
        updates = int((await sim.expect("updated", args.seconds + 120)).split()[1])
        t_end = time.monotonic()
        events_end = await asyncio.to_thread(workflow_events, proxy.port) - events0
        cpu_updates = proxy.cpu() - cpu0
        jq_updates = children_cpu(proxy) - jq0
        behind = await busy_until_quiet(proxy)
        text = await asyncio.to_thread(_metrics, proxy.port)
        events_quiet = _sum(text, "karta_proxy_watch_events_total", PLURAL,
                            '"MODIFIED"') - events0
        deferred = {o: _sum(text, "karta_proxy_deferred_object_updates_total",
                            f'outcome="{o}"') for o in ("applied", "superseded")}
        edits = await edit_phase(args, sim, proxy, sender, probe, deferred)
        # off the loop: the sink answering the sender's last write runs on this loop, and a
        # join here would hold that write until the proxy's upstream timeout (a 504)
        await asyncio.to_thread(sender.stop)
        healthy = probe.stop()
        answers = sender.answers
        result: dict[str, Any] = {
            "objects": args.objects, "nodes": args.nodes, "seconds": args.seconds,
            "ready_s": ready, "updates": updates,
            "events_at_end": events_end, "events_once_quiet": events_quiet,
            "busy_after_s": behind, "cpu_s_updates": cpu_updates,
            "jq_cpu_s_updates": jq_updates,
            "rss_mib_before": rss0, "rss_mib_after": _status(proxy.pid, "VmRSS"),
            "deferred": deferred if "karta_proxy_deferred_object_updates_total" in text
            else None,
            "writes_idle": _ms([s for t, s, _ in answers if t < t_update]),
            "writes_updating": _ms([s for t, s, _ in answers if t_update <= t <= t_end]),
            "writes_not_2xx": sum(1 for *_, status in answers if not 200 <= status < 300),
            "statuses": dict(Counter(str(status) for *_, status in answers)),
            "healthy": _ms(healthy),
        }
        if edits is not None:
            result["edits"] = edits
        object_bytes = len(json.dumps(workflow("wf-0", args.nodes, 1),
                                      separators=(",", ":")))
        result["object_bytes"] = object_bytes
        return result
    finally:
        if proxy is not None:
            await asyncio.to_thread(proxy.stop)
        sim.stop()
        await runner.cleanup()


async def quiet_with_child(proxy: Proxy, quiet: float = 1.5, limit: float = 60.0) -> None:
    """Until neither the proxy nor its jq sandbox's child used 20 ms of CPU in 100 ms for
    ``quiet`` seconds (at most ``limit``): the heavy objects' thread waits on the child
    with no CPU of the proxy's own, which ``busy_until_quiet`` alone reads."""
    t0 = last_busy = time.monotonic()
    c = cpu_seconds(proxy.pid)
    while time.monotonic() - last_busy < quiet and time.monotonic() - t0 < limit:
        await asyncio.sleep(0.1)
        c2 = cpu_seconds(proxy.pid)
        if c2 - c > 0.02:
            last_busy = time.monotonic()
        c = c2


async def edit_phase(args: argparse.Namespace, sim: SimChild, proxy: Proxy, sender: Sender,
                     probe: LoopProbe, deferred: dict[str, float]) -> dict[str, Any] | None:
    """``--edits``: the description edited that many times, each followed by the
    proxy's quiet; the writes and ``/-/healthy`` answered meanwhile, the deferred
    outcomes' increase."""
    if not args.edits:
        return None
    await quiet_with_child(proxy)  # the updates' evaluations waiting in the thread done
    writes0, healthy0 = len(sender.answers), len(probe.times)
    t0 = time.monotonic()
    for _ in range(args.edits):
        sim.send("describe")
        await sim.expect("described", 30)
        await quiet_with_child(proxy)
    seconds = time.monotonic() - t0
    text = await asyncio.to_thread(_metrics, proxy.port)
    return {
        "edits": args.edits, "seconds": seconds,
        "writes": _ms([s for _, s, _ in sender.answers[writes0:]]),
        "healthy": _ms(probe.times[healthy0:]),
        "deferred": {o: _sum(text, "karta_proxy_deferred_object_updates_total",
                             f'outcome="{o}"') - deferred[o] for o in deferred},
    }


def report(r: dict[str, Any]) -> None:
    print(f"{r['objects']} Workflows of {r['nodes']} nodes ({r['object_bytes'] / 1e6:.2f} MB "
          f"of JSON each), updated once a second for {r['seconds']:g} s; ready in "
          f"{r['ready_s']:.1f} s")
    for name, key in (("writes, idle", "writes_idle"), ("writes, updating", "writes_updating"),
                      ("/-/healthy, whole run", "healthy")):
        m = r[key]
        print(f"  {name:24} n {m['n']:5}  p50 {m['p50_ms']:7.1f} ms  p99 {m['p99_ms']:7.1f} ms"
              f"  max {m['max_ms']:7.1f} ms")
    print(f"  writes not answered 2xx: {r['writes_not_2xx']} (statuses {r['statuses']})")
    print(f"  Workflow updates made {r['updates']}; events handled by the end "
          f"{r['events_at_end']:.0f}, once quiet {r['events_once_quiet']:.0f} "
          f"(busy {r['busy_after_s']:.1f} s after the updates)")
    print(f"  proxy CPU over the updates {r['cpu_s_updates']:.1f} s "
          f"({r['cpu_s_updates'] / r['seconds']:.2f} of a core), its jq sandbox's "
          f"{r['jq_cpu_s_updates']:.1f} s; RSS "
          f"{r['rss_mib_before']:.0f} -> {r['rss_mib_after']:.0f} MiB")
    if r["deferred"] is not None:
        print(f"  updates evaluated off the event loop: {r['deferred']['applied']:.0f} applied, "
              f"{r['deferred']['superseded']:.0f} superseded by a newer version")
    e = r.get("edits")
    if e is not None:
        print(f"  {e['edits']} description edits, each re-evaluating every Workflow "
              f"({e['seconds']:.1f} s to the last quiet):")
        for name, key in (("writes", "writes"), ("/-/healthy", "healthy")):
            m = e[key]
            print(f"    {name:22} n {m['n']:5}  p50 {m['p50_ms']:7.1f} ms  p99 "
                  f"{m['p99_ms']:7.1f} ms  max {m['max_ms']:7.1f} ms")
        if r["deferred"] is not None:
            print(f"    evaluated off the event loop: {e['deferred']['applied']:.0f} applied, "
                  f"{e['deferred']['superseded']:.0f} superseded")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    p.add_argument("--objects", type=int, default=10)
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--idle-seconds", type=float, default=8.0)
    p.add_argument("--edits", type=int, default=0,
                   help="then edit the description this many times (a phase of its own)")
    p.add_argument("--json", type=results_path)
    p.add_argument("--quick", action="store_true", help="small sizes: a check, not a figure")
    args = p.parse_args()
    if args.sim:
        asyncio.run(run_sim(args))
        return 0
    if args.quick:
        args.objects, args.nodes, args.seconds, args.idle_seconds = 2, 200, 2.0, 1.0
    result = asyncio.run(run(args))
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
