"""The stop of the real process (``python -m proxy``, SIGTERM), as a pod's is: how long it
takes with everything slow at once, and what the requests in flight get.

docs/operations.md, "Shutdown": exit 0 within ``STOP_SECONDS`` of the signal; requests in
flight finish (their bodies still arriving included) or, past the drain, are ended and
logged; the fact writer ends its own series, then hands its lease back, beside the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import snappy
import yaml

from proxy import contract
from proxy.sender import Series, decode_v1, send_series
from proxy.server import STOP_SECONDS
from tests.peers.conftest import free_port, wait_until
from tests.proxy_harness import CART, SNAPSHOT, series_v1
from tests.raw_http import HEAD, read_answer
from tests.scripted import Received, Reply, ScriptedUpstream
from tests.test_cli import REPO, wait_for_200

#: what a sender's series carries: the snapshot's pod
POD = {"namespace": "shop", "pod": "cart-7d9f8-abcde"}


@dataclass
class Running:
    """A proxy process and its base URL; ``stop`` signals it and collects its log."""

    proc: asyncio.subprocess.Process
    base: str

    async def stop(self, timeout: float = 60) -> tuple[float, list[dict[str, Any]]]:
        """SIGTERM, then until the exit: the seconds it took, and the JSON log lines."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        took = time.monotonic() - began
        return took, [json.loads(line) for line in err.decode().splitlines()
                      if line.startswith("{")]


@contextlib.asynccontextmanager
async def process(tmp_path: Path, upstream: str, config: dict[str, Any], *args: str
                  ) -> AsyncIterator[Running]:
    """``python -m proxy`` with ``config`` (YAML) and ``args``, ready; killed if the test
    leaves it running."""
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--config", str(cfg), "--upstream-url", upstream,
        "--listen-address", f"127.0.0.1:{port}", "--log-format", "json", *args, cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    running = Running(proc, f"http://127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession() as session:
            await wait_for_200(session, running.base + "/-/ready", proc, timeout=30)
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()


async def sample(base: str, name: str) -> float | None:
    """One sample of the process' own ``/metrics`` (no labels), None when absent."""
    async with aiohttp.ClientSession() as session, session.get(
            f"{base}/metrics", params={"name[]": name}) as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def test_a_stop_with_a_slow_upstream_and_a_slow_lease_api_ends_within_the_bound(
    tmp_path: Path,
) -> None:
    """The audit's case: facts written by the lease holder (a 15 s lease, the default),
    then the upstream answers in 60 s and every Lease call takes 4.5 s; 4 senders wait on
    the upstream; SIGTERM. The drain (9 s), the fact writer's markers (5 s) and the
    elector's stop (the Lease call under way, then a read and a replace) ran one after
    the other: 25.5-26.5 s, for 10 documented. Now within ``STOP_SECONDS``, exit 0, and
    what was not done in time is said: the markers' timeout with its reason, the requests
    ended, the lease's release."""
    from tests.kubesim import KubeSim
    from tests.kubesim.resources import LEASE

    slow = 0.0

    def rule(_: Received) -> Reply:
        return Reply(204, delay=slow)

    async with KubeSim() as sim, ScriptedUpstream(rule=rule) as up:
        for obj in yaml.safe_load_all(SNAPSHOT):
            sim.create(obj)
        config = {"facts": {"interval_seconds": 1, "leader_election": True,
                            "lease_namespace": "default", "lease_duration_seconds": 15}}
        kubeconfig = str(sim.write_kubeconfig(tmp_path / "kubeconfig"))
        async with process(tmp_path, up.url, config, "--kubeconfig", kubeconfig) as p:
            async def leading() -> bool:
                return await sample(p.base, "karta_proxy_fact_writer_leader") == 1

            await wait_until(leading, timeout=30, what="the fact lease")

            def own_series_written() -> bool:
                return any(s.labels["__name__"] == contract.FACT_BUILD_INFO
                           for r in list(up.received) for s in decode_v1(r.raw))

            async def written() -> bool:
                return own_series_written()

            await wait_until(written, timeout=30, what="a fact write with its own series")
            slow = 60.0
            sim.delay_resource(LEASE, 4.5)
            before = len(up.received)
            url = p.base + "/api/v1/write"
            senders = [asyncio.create_task(send_series(
                url, [Series({"__name__": f"m{i}", **POD}, [(1000, 1.0)])], timeout=60))
                for i in range(4)]

            async def all_upstream() -> bool:
                return sum(decode_v1(r.raw)[0].labels["__name__"].startswith("m")
                           for r in up.received[before:]) == 4

            await wait_until(all_upstream, timeout=15, what="the 4 requests upstream")
            await asyncio.sleep(1.0)  # a Lease call under way (one every 5 s, 4.5 s each)
            took, log = await p.stop()
            answers = await asyncio.gather(*senders, return_exceptions=True)
        sim.delay_resource(LEASE, None)
    msgs = [rec["msg"] for rec in log]
    assert p.proc.returncode == 0
    # the bound, and a second for a loaded machine's scheduling (a run takes ~9.1 s; the
    # old code took 26)
    assert took < STOP_SECONDS + 1, (took, msgs[-8:])
    assert all(isinstance(a, aiohttp.ClientError) for a in answers), answers
    assert "fact writer: could not end its own series at stop: no answer within 5 s" in msgs
    ended = [rec for rec in log if rec["msg"].endswith("still in flight ended at stop, "
                                                       "unanswered (their senders send "
                                                       "them again)")]
    assert [rec["count"] for rec in ended] == [4], msgs
    assert any(m.startswith("lease default/karta-proxy-facts: release failed: no answer "
                            "within ") for m in msgs), msgs


async def test_a_body_that_arrives_after_sigterm_is_answered_and_forwarded(
    tmp_path: Path,
) -> None:
    """A request whose headers and half its body came before SIGTERM, the rest after: the
    drain promises that requests in flight finish, but aiohttp drops every byte of a
    connection marked closing, which the stop marks every one: it was answered 503
    "request body too slow" (counted as the sender's fault) and nothing was stored. Now
    it gets its 204 and is forwarded. Other connections get what they got: a new one is
    refused, an idle keep-alive one is closed at once."""
    body = snappy.compress(series_v1(*({"__name__": "late_body", "s": str(i), **POD}
                                       for i in range(2000))))
    half = len(body) // 2
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    async with ScriptedUpstream() as up, \
            process(tmp_path, up.url, {"facts": {"enabled": False},
                                       # the drain is under test, not the body's rate: a
                                       # loaded box took the pause past 1.5 s (503, slow)
                                       "server": {"min_body_bytes_per_second": 1}},
                    "--snapshot", str(snap)) as p:
        port = int(p.base.rsplit(":", 1)[1])
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        idle_w.write(HEAD.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert (await read_answer(idle_r)).status == 204  # and kept open, idle
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(HEAD.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:half])
        await w.drain()

        async def in_flight() -> bool:
            return await sample(p.base, "karta_proxy_inflight_requests") == 1

        await wait_until(in_flight, timeout=10, what="the request in flight", interval=0.02)
        p.proc.send_signal(signal.SIGTERM)

        async def refused() -> bool:  # the listener closed: the stop is under way
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return True
            probe.close()
            return False

        await wait_until(refused, timeout=5, what="the listener closed", interval=0.02)
        async with asyncio.timeout(2):  # the idle connection: closed at once
            assert await idle_r.read(1) == b""
        await asyncio.sleep(0.2)
        w.write(body[half:])
        await w.drain()
        answer = await read_answer(r, timeout=10)
        w.close()
        idle_w.close()
        _, err = await asyncio.wait_for(p.proc.communicate(), 20)
    assert answer.status == 204, (answer, err.decode()[-2000:])
    assert p.proc.returncode == 0
    (got,) = [r for r in up.received if b"late_body" in r.raw][1:]  # after the first
    series = decode_v1(got.raw)
    assert len(series) == 2000 and all(CART.items() <= s.labels.items() for s in series)


def _many_pods(path: Path, deployments: int, pods_each: int) -> Path:
    """A JSON List snapshot of ``deployments`` Deployments in ``shop``, each with a
    ReplicaSet and ``pods_each`` pods."""
    items: list[dict[str, Any]] = []
    for d in range(deployments):
        name = f"web{d}"
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                 "uid": f"d{d}", "controller": True}
        rs = {**owner, "kind": "ReplicaSet", "name": f"{name}-1", "uid": f"rs{d}"}
        items.append({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": name, "namespace": "shop", "uid": f"d{d}"},
                      "spec": {"replicas": pods_each}})
        items.append({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                      "metadata": {"name": rs["name"], "namespace": "shop", "uid": rs["uid"],
                                   "ownerReferences": [owner]}})
        items.extend({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"{name}-1-{i}", "namespace": "shop",
                                   "uid": f"p{d}-{i}", "ownerReferences": [rs]},
                      "status": {"phase": "Running"}} for i in range(pods_each))
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


async def test_a_sigterm_during_the_first_loads_apply_exits_within_a_second(
        tmp_path: Path) -> None:
    """The first load's application to the engine held the event loop (~2.5 s for these
    20k pods, 5-8 s at 37.5k): a SIGTERM then waited for it, and for the start's end
    (``karta-proxy started``, then the stop). It now gives way between runs, and the
    start is cancelled at the next."""
    snap = _many_pods(tmp_path / "snap.json", 1000, 20)
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(yaml.safe_dump({"facts": {"enabled": False}}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--config", str(cfg), "--snapshot", str(snap),
        "--upstream-url", "http://127.0.0.1:9/api/v1/write",
        "--listen-address", f"127.0.0.1:{free_port()}", "--log-format", "json", cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        lines: list[dict[str, Any]] = []

        async def applying() -> None:
            while not lines or lines[-1].get("msg") != "snapshot read; applying it":
                line = await proc.stderr.readline()  # type: ignore[union-attr]
                assert line, f"exited before the apply: {lines}"
                if line.startswith(b"{"):
                    lines.append(json.loads(line))

        await asyncio.wait_for(applying(), 30)
        await asyncio.sleep(0.3)  # into the apply
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        took = time.monotonic() - began
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()
    messages = [json.loads(x).get("msg") for x in err.decode().splitlines()
                if x.startswith("{")]
    assert proc.returncode == 0, messages
    assert "karta-proxy started" not in messages, messages
    assert "stop requested before the index was loaded" in messages
    assert took < 1.0, f"{took:.2f} s from SIGTERM to exit"
