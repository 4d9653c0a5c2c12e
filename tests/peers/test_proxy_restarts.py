"""The proxy's own disruption under a real Prometheus 2.42 agent writing through it into a
real Prometheus 2.42 (or VictoriaMetrics): a rolling restart (SIGTERM, then a new process
on the same port), a crash (SIGKILL, the same), and reloads (SIGHUP, ``POST /-/reload``)
under load.

Counted exactly: the agent scrapes a probe whose every scrape serves a new value (the
scrape's number) for a few pods of the API simulator's cluster, so the receiver must hold
each value served, once per pod, in one series stamped with the pod's workload; the
agent's own counters say what it retried and dropped, its log what it was answered.
docs/operations.md, "Restarts: what a sender sees", gives the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.demo_exporter import DEMO_SNAPSHOT, load_objects
from tests.kubesim import KubeSim
from tests.kubesim.resources import POD as POD_TYPE
from tests.peers.conftest import (
    Peer,
    Peers,
    agent_metrics,
    free_port,
    query,
    vm_flush,
    wait_until,
)

pytestmark = pytest.mark.peers

#: the demo cluster's pods the probe names, each owned by a built-in kind the simulator
#: serves (a Deployment's ReplicaSet, a StatefulSet, a Job)
PODS = (("web", "frontend-6d8f7b9c5d-4xkqp"), ("web", "postgres-0"),
        ("batch", "nightly-etl-7q2wd"))
KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "Job", "Pod"}
METRIC = "restart_probe"
#: the agent's pace: a scrape every 200 ms, a batch sent at least every 100 ms
SCRAPE = "200ms"
#: how long the restarted process' index takes: its pod lists wait this long
NOT_READY_SECONDS = 1.5


class Probe:
    """A target whose n-th scrape serves the value n for every pod; ``close`` makes later
    scrapes fail (no sample), so what was served is final."""

    def __init__(self) -> None:
        self.served: list[int] = []
        self.closed = False
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.closed:
            return web.Response(status=503)
        n = len(self.served) + 1
        self.served.append(n)
        text = "".join(f'{METRIC}{{namespace="{ns}",pod="{pod}"}} {n}\n' for ns, pod in PODS)
        return web.Response(text=text, content_type="text/plain")

    async def __aenter__(self) -> Probe:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@dataclass
class Outcome:
    """What a run gave: the values served, those stored per series, the agent's counters
    and the answers its log names."""

    served: set[int]
    stored: dict[frozenset[tuple[str, str]], list[float]]
    agent: dict[str, float]
    answers: set[str] = field(default_factory=set)

    def missing(self) -> dict[tuple[str, str], list[int]]:
        by_pod: dict[tuple[str, str], set[int]] = {}
        for labels, values in self.stored.items():
            d = dict(labels)
            by_pod.setdefault((d["namespace"], d["pod"]), set()).update(int(v) for v in values)
        return {pod: sorted(self.served - by_pod.get(pod, set())) for pod in PODS
                if self.served - by_pod.get(pod, set())}


@dataclass
class Rig:
    """The API simulator, the receiving Prometheus, the proxy process on a fixed port and
    the agent writing through it."""

    sim: KubeSim
    probe: Probe
    receiver: Peer
    proxy: Peer
    agent: Peer
    config: Path

    async def scrapes(self, n: int, timeout: float = 20) -> None:
        """Wait for ``n`` more scrapes of the probe."""
        until = len(self.probe.served) + n

        async def done() -> bool:
            return len(self.probe.served) >= until

        await wait_until(done, timeout=timeout, what=f"{n} scrapes", interval=0.05)

    async def finish(self, timeout: float = 30) -> Outcome:
        """Close the probe, then wait until the receiver holds every value served (or
        the deadline): what it holds then, and the agent's account."""
        self.probe.closed = True
        await asyncio.sleep(0.5)  # a scrape under way when it closed is appended
        served = set(self.probe.served)
        outcome = Outcome(served, {}, {})

        async def complete() -> bool:
            outcome.stored = await stored(self.receiver)
            return not outcome.missing()

        # a timeout is said by the caller's assertions, with what is missing
        with contextlib.suppress(AssertionError):
            await wait_until(complete, timeout=timeout, what="every value stored")
        outcome.agent = await agent_metrics(self.agent, "prometheus_remote_storage_samples_")
        outcome.answers = agent_answers(self.agent.log_tail(10**7))
        return outcome


async def stored(receiver: Peer) -> dict[frozenset[tuple[str, str]], list[float]]:
    if receiver.name == "vm":
        await vm_flush(receiver)
    rows = await query(receiver.base_url, f"{METRIC}[10m]")
    # the stale markers the agent writes once the probe closes are no scrape's: VM
    # answers them (NaN), Prometheus does not
    return {frozenset(r["metric"].items()): [float(v) for _, v in r["values"] if v != "NaN"]
            for r in rows}




def agent_answers(log: str) -> set[str]:
    """What the agent's failed sends were answered, from its log: an HTTP status, or how
    the connection failed. Kinds, not counts: Prometheus logs a line again only after a
    minute."""
    out: set[str] = set()
    for line in log.splitlines():
        if "Failed to send batch" not in line and "non-recoverable" not in line:
            continue
        m = re.search(r"server returned HTTP status (\d+)", line)
        if m:
            out.add(m.group(1))
        elif "connection refused" in line:
            out.add("connection refused")
        elif "EOF" in line or "connection reset" in line:
            out.add("cut")
        else:
            out.add(line)
    return out


def write_config(path: Path, sender_karta_labels: str) -> None:
    """The proxy's config file; each value of ``enrich.sender_karta_labels`` is another
    splice plan (the probe's series carry no ``karta_*`` label: stamped alike by both)."""
    path.write_text(yaml.safe_dump({"enrich": {"sender_karta_labels": sender_karta_labels}}))


@pytest.fixture
async def rig(peers: Peers, tmp_path: Path, request: pytest.FixtureRequest
              ) -> AsyncIterator[Rig]:
    """``request.param``: the receiver, ``prometheus`` (the default) or ``vm``."""
    objects = [o for o in load_objects(DEMO_SNAPSHOT) if o["kind"] in KINDS]
    async with KubeSim() as sim, Probe() as probe:
        for obj in objects:
            sim.create(obj)
        receiver = await (peers.victoria_metrics() if getattr(request, "param", "") == "vm"
                          else peers.prometheus_receiver())
        port = free_port()
        config = tmp_path / "proxy.yaml"
        write_config(config, "drop")
        proxy = await peers.karta_proxy("proxy", port, [
            "--config", str(config), "--kubeconfig",
            str(sim.write_kubeconfig(tmp_path / "kubeconfig")),
            "--upstream-url", receiver.base_url + "/api/v1/write",
            "--no-facts", "--web.enable-lifecycle", "--log-format", "json",
        ])
        agent = await peers.prometheus_agent({
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "scrape_configs": [{"job_name": "probe", "honor_labels": True,
                                "static_configs": [{"targets": [probe.url]}]}],
            "remote_write": [{
                "url": proxy.base_url + "/api/v1/write",
                "queue_config": {"batch_send_deadline": "100ms", "max_samples_per_send": 20,
                                 "min_backoff": "50ms", "max_backoff": "500ms"},
            }],
        })
        r = Rig(sim, probe, receiver, proxy, agent, config)

        async def flowing() -> bool:
            return bool(await stored(receiver))

        await wait_until(flowing, timeout=30, what="the probe's first samples stored")
        yield r


def assert_whole(outcome: Outcome, once: bool = True) -> None:
    """Every value served stored per pod (once, unless not ``once``), one series per pod,
    stamped; nothing the agent dropped or gave up on."""
    assert not outcome.missing(), (outcome.missing(), outcome.agent, outcome.answers)
    pods = Counter((dict(s)["namespace"], dict(s)["pod"]) for s in outcome.stored)
    assert pods == Counter(PODS), sorted(sorted(dict(s).items()) for s in outcome.stored)
    for labels, values in outcome.stored.items():
        assert dict(labels).get("karta_workload"), sorted(labels)
        assert sorted(values) == values, values
        if once:
            assert len(set(values)) == len(values), values
    assert outcome.agent.get("failed_total", 0) == 0, outcome.agent
    assert outcome.agent.get("dropped_total", 0) == 0, outcome.agent


def report(case: str, outcome: Outcome, gap: float | None = None,
           exited: float | None = None) -> None:
    stored_n = sum(len(v) for v in outcome.stored.values())
    twice = stored_n - sum(len(set(v)) for v in outcome.stored.values())
    print(f"\n{case}: served {len(outcome.served)} scrapes x {len(PODS)} pods = "
          f"{len(outcome.served) * len(PODS)} samples, stored {stored_n} ({twice} twice); "
          f"agent "
          f"{ {k: int(v) for k, v in sorted(outcome.agent.items())} }; answers "
          f"{sorted(outcome.answers)}" + ("" if gap is None else f"; ready again {gap:.2f} s "
                                         f"after the signal (exit after {exited:.2f} s)"))


@pytest.mark.parametrize(
    ("sig", "rig"),
    [(signal.SIGTERM, "prometheus"), (signal.SIGKILL, "prometheus"), (signal.SIGKILL, "vm")],
    indirect=["rig"], ids=["sigterm", "sigkill", "sigkill-vm"])
async def test_a_restart_on_the_same_port_loses_nothing(rig: Rig, sig: signal.Signals) -> None:
    """A rolling restart (SIGTERM) or a crash (SIGKILL) while requests wait on the
    receiver (stopped for a moment), then a new process on the port whose index takes a
    while (the simulator's pod lists delayed): what the old process drained is answered,
    what it cut is sent again, the new one answers 503 until its index is ready; every
    sample ends up stored, stamped, once (twice where a crash lost the answer to a
    write VictoriaMetrics had stored)."""
    await rig.scrapes(5)
    proc, receiver = rig.proxy.proc, rig.receiver.proc
    assert proc is not None and receiver is not None
    receiver.send_signal(signal.SIGSTOP)
    try:
        await rig.scrapes(3)  # batches in flight, waiting on the receiver
        began = time.monotonic()
        proc.send_signal(sig)
        await asyncio.sleep(0.5)
    finally:
        receiver.send_signal(signal.SIGCONT)
    assert await asyncio.to_thread(proc.wait, 15) == (0 if sig == signal.SIGTERM else -sig)
    exited = time.monotonic() - began
    rig.sim.delay_resource(POD_TYPE, NOT_READY_SECONDS)
    rig.proxy.start()
    await rig.proxy.wait_ready()
    gap = time.monotonic() - began
    rig.sim.delay_resource(POD_TYPE, None)
    await rig.scrapes(5)
    outcome = await rig.finish()
    report(f"{sig.name} + restart, {rig.receiver.name}", outcome, gap, exited)
    # a crash loses the answers to the batches in flight, which their receiver stored:
    # the agent sends them again, and VictoriaMetrics (without -dedup.minScrapeInterval)
    # keeps a second copy of each sample, where Prometheus keeps one
    assert_whole(outcome, once=not (sig == signal.SIGKILL and rig.receiver.name == "vm"))
    assert outcome.agent.get("retried_total", 0) > 0, outcome.agent
    # the new process listened before its index was ready, and said so: 503, retried
    assert "503" in outcome.answers, outcome.answers
    if sig == signal.SIGTERM:
        # what the drain answered said Connection: close, so the agent's next batch went
        # to a new connection (refused until the new process listened), never into one
        # the old process was closing (EOF, unanswered)
        assert "cut" not in outcome.answers, outcome.answers


async def test_reloads_under_load_lose_nothing(rig: Rig) -> None:
    """SIGHUP and POST /-/reload, five of each, while the agent writes, each a new splice
    plan: no failed send, every sample stored once, stamped."""
    proc = rig.proxy.proc
    assert proc is not None
    codes: list[int] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            write_config(rig.config, "keep")
            os.kill(proc.pid, signal.SIGHUP)
            await rig.scrapes(1)
            write_config(rig.config, "drop")
            async with s.post(rig.proxy.base_url + "/-/reload") as r:
                codes.append(r.status)
            await rig.scrapes(1)
    outcome = await rig.finish()
    report("reloads", outcome)
    assert codes == [200] * 5
    reloaded = [line for line in rig.proxy.log_tail(10**7).splitlines()
                if '"configuration reloaded"' in line]
    assert len(reloaded) == 10 and all("enrich.sender_karta_labels" in r for r in reloaded)
    assert_whole(outcome)
    assert not outcome.answers, outcome.answers
    assert outcome.agent.get("retried_total", 0) == 0, outcome.agent
    assert proc.poll() is None
