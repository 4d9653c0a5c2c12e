"""KubeSource when kinds fail: readiness, reporting, recovery, clean stops.

Against the simulator: a kind whose list answers 500 (a broken conversion webhook) or
406 (metadata-only lists refused), or whose group's discovery answers 503, used to keep
``index.ready`` False for good, so every remote write was refused with 503 though the
pods were indexed. 403 / 404 were already skipped for readiness (test_source.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import KubeSettings
from proxy.index import PodIndex
from proxy.karta.engine import Engine
from proxy.karta.model import GroupKind
from proxy.kube.source import KubeSource
from tests.karta.descriptions import RAYJOB_KARTA
from tests.kube.conftest import deployment, eventually, labels, metric, pod
from tests.kube.test_source import rayjob
from tests.kubesim import KubeSim
from tests.kubesim.resources import POD, RAY_CLUSTER, RAY_JOB, ResourceType

RAY_JOB_GK = GroupKind("ray.io", "RayJob")
RAY_CLUSTER_GK = GroupKind("ray.io", "RayCluster")

MakeSource = Callable[..., KubeSource]


@pytest.fixture
async def new_source(sim: KubeSim) -> AsyncIterator[MakeSource]:
    """A source over the simulator, not started, with a short sync deadline; stopped at
    the end whatever happened to it."""
    made: list[KubeSource] = []

    def make(sync_deadline: float = 0.5, backoff_max: float = 0.3) -> KubeSource:
        kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()),
                            resync_backoff_max_seconds=backoff_max)
        source = KubeSource(kube, Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                            watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5,
                            sync_deadline=sync_deadline)
        made.append(source)
        return source

    yield make
    for s in made:
        await s.stop()


def _failing(source: KubeSource, gk: GroupKind) -> float:
    return metric(source, "karta_proxy_watch_failing", {"resource": str(gk)})


@pytest.mark.parametrize(("rtype", "status", "accept"), [
    (RAY_JOB, 500, ""),  # a described kind, full lists: a broken conversion webhook
    (RAY_CLUSTER, 406, "PartialObjectMetadata"),  # an owner kind, metadata-only lists
])
async def test_a_kind_whose_list_keeps_failing_stops_holding_readiness_back(
        sim: KubeSim, new_source: MakeSource, caplog: pytest.LogCaptureFixture,
        rtype: ResourceType, status: int, accept: str) -> None:
    """Past the sync deadline (0.5 s here) the failing kind is reported (a warning naming
    it and its error, ``karta_proxy_watch_failing`` 1, the index stale) and the source is
    ready without it; it is retried meanwhile and its objects arrive once it recovers.
    Its pods are attributed as for a kind RBAC forbids: the walk stops at the owner not
    seen (a described one is the workload by its reference). Before: never ready."""
    sim.create(RAYJOB_KARTA)
    names = rayjob(sim)
    deployment(sim, "web", "shop", replicas=2)
    sim.fail_resource(rtype, status, accept=accept)
    caplog.set_level(logging.INFO, logger="proxy.kube.source")
    source = new_source()
    t0 = time.monotonic()
    await asyncio.wait_for(source.start(), 5)  # never returned before
    took = time.monotonic() - t0
    assert source.index.ready and took < 3.0, took
    gk = GroupKind(rtype.group, rtype.kind)
    assert gk in source.failing_kinds and str(status) in source.failing_kinds[gk]
    assert _failing(source, gk) == 1
    assert source.index.stale
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "still failing" in r.getMessage()]
    assert len(warned) == 1 and str(gk) in warned[0] and str(status) in warned[0], warned
    assert (labels(source, "shop", "web-1-0") or {}).get("karta_workload") == "web"
    # as with 403: a RayJob not seen is the workload by its reference; a RayCluster
    # not seen (nothing describes it) ends the walk below the RayJob
    if rtype is RAY_JOB:
        assert (labels(source, "ml", names[0]) or {}).get("karta_workload") == "train"
    else:
        assert labels(source, "ml", names[0]) is None
        assert source.index.reason(b"ml", names[0].encode()) == "owner_missing"
    # retried in the background: it recovers, its objects arrive, the report ends
    sim.fail_resource(rtype, None)
    await eventually(lambda: gk not in source.failing_kinds, timeout=5)
    assert _failing(source, gk) == 0
    await eventually(lambda: not source.index.stale, timeout=10)
    job_uid = sim.get("ray.io/v1", "RayJob", "train", "ml")["metadata"]["uid"]
    await eventually(lambda: job_uid in source.index.workloads, timeout=10)
    assert sum("is listed now" in r.getMessage() for r in caplog.records) == 1


async def test_a_group_whose_discovery_keeps_failing_stops_holding_readiness_back(
        sim: KubeSim, new_source: MakeSource) -> None:
    """Discovery of ray.io/v1 answers 503: after the deadline both its kinds are
    reported failing and the source is ready; the follower retries discovery and starts
    their watches once it answers. Before: the sync retried discovery forever."""
    sim.create(RAYJOB_KARTA)
    names = rayjob(sim)
    deployment(sim, "web", "shop", replicas=2)
    sim.fail_discovery("ray.io/v1", 503)
    source = new_source()
    await asyncio.wait_for(source.start(), 5)
    assert source.index.ready
    assert {RAY_JOB_GK, RAY_CLUSTER_GK} <= set(source.failing_kinds)
    assert "503" in source.failing_kinds[RAY_JOB_GK]
    assert _failing(source, RAY_JOB_GK) == 1 and source.index.stale
    assert (labels(source, "shop", "web-1-0") or {}).get("karta_workload") == "web"
    sim.fail_discovery("ray.io/v1", None)
    await eventually(lambda: not source.failing_kinds and RAY_JOB_GK in source.watchers,
                     timeout=5)
    assert _failing(source, RAY_JOB_GK) == 0
    await eventually(lambda: not source.index.stale
                     and (labels(source, "ml", names[1]) or {}).get("karta_kind") == "RayJob",
                     timeout=10)


async def test_a_group_whose_discovery_keeps_failing_is_warned_once(
        sim: KubeSim, new_source: MakeSource, caplog: pytest.LogCaptureFixture) -> None:
    """Discovery of a described kind's group failing round after round (503): one
    warning for the episode, the follower's later rounds at debug, one info line when it
    works again. Every round with a failure warned (every ~10 s, forever, with the
    defaults: 32 warnings in the audit's 4 minutes)."""
    sim.create(RAYJOB_KARTA)
    rayjob(sim)
    sim.fail_discovery("ray.io/v1", 503)
    caplog.set_level(logging.DEBUG, logger="proxy.kube.source")
    source = new_source()
    await asyncio.wait_for(source.start(), 5)
    await asyncio.sleep(1.5)  # several follower rounds (backoff capped at 0.3 s)

    def lines(level: int, text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == level and text in r.getMessage()]

    assert len(lines(logging.DEBUG, "discovery of")) >= 2  # the rounds went on
    warned = lines(logging.WARNING, "discovery of")
    assert len(warned) == 1 and "RayJob.ray.io" in warned[0], warned
    sim.fail_discovery("ray.io/v1", None)
    await eventually(lambda: RAY_JOB_GK in source.watchers, timeout=5)
    assert len(lines(logging.WARNING, "discovery of")) == 1
    back = lines(logging.INFO, "works again")
    assert sorted(m.split()[3] for m in back) == ["RayCluster.ray.io", "RayJob.ray.io"], back


async def test_failing_pods_still_hold_readiness_back(sim: KubeSim,
                                                      new_source: MakeSource) -> None:
    """The deadline excuses no pod watch: without pods there is nothing to enrich with."""
    deployment(sim, "web", "shop", replicas=1)
    sim.fail_resource(POD, 500)
    source = new_source(sync_deadline=0.2)
    start = asyncio.create_task(source.start())
    await asyncio.sleep(1.5)
    assert not start.done() and not source.index.ready
    assert GroupKind("", "Pod") not in source.failing_kinds
    sim.fail_resource(POD, None)
    await asyncio.wait_for(start, 5)
    assert source.index.ready and not source.failing_kinds


async def test_stop_stops_every_watcher_though_one_fails_to_stop(
        sim: KubeSim, new_source: MakeSource, caplog: pytest.LogCaptureFixture) -> None:
    """One watcher raising as it stops (its task had died with an exception) is logged;
    the others and the client are still stopped. ``stop`` used to raise at the first
    and leave the rest watching, the client open."""
    deployment(sim, "web", "shop", replicas=1)
    source = new_source()
    await asyncio.wait_for(source.start(), 5)
    watchers = [w for _, ws in source.watchers.values() for w in ws]
    pods = next(w for w in watchers if w.resource.kind == "Pod")

    async def broken_stop() -> None:
        raise RuntimeError("the watcher's task had died")

    real_stop = pods.stop
    pods.stop = broken_stop  # type: ignore[method-assign]
    await source.stop()
    others = [w for w in watchers if w is not pods]
    assert others and all(getattr(w, "_task", None) is None for w in others)
    assert source._client is None and not source.watchers
    assert any("stopping watch pods failed" in r.getMessage() for r in caplog.records)
    await real_stop()  # the test's own cleanup


async def test_waiting_for_a_failing_list_holds_one_waiter_per_watcher(
        sim: KubeSim, new_source: MakeSource) -> None:
    """While the pods' list keeps failing, the sync waits on each watcher's ``synced``
    with one task for the whole wait, cancelled when it ends: it made a new one every
    second and never cancelled them (39 -> 59 tasks in 20 s)."""
    sim.fail_resource(POD, 500)
    source = new_source(sync_deadline=0.1)
    start = asyncio.create_task(source.start())
    await eventually(lambda: any(gk.kind == "Pod" for gk in source.watchers), timeout=10)
    pods = next(w for gk, (_, ws) in source.watchers.items() if gk.kind == "Pod"
                for w in ws)
    waiters: list[int] = []
    for _ in range(5):  # a round is a second
        await asyncio.sleep(0.6)
        waiters.append(len(pods.synced._waiters))
    assert max(waiters) == 1, waiters  # 1, 2, 2, 3, 4 before
    sim.fail_resource(POD, None)
    await asyncio.wait_for(start, 5)
    await asyncio.sleep(0)
    waiting = [t for t in asyncio.all_tasks()
               if "Event.wait" in repr(t.get_coro()) and not t.done()]
    assert len(waiting) <= 1, waiting  # the follower's wait for a change of kinds


async def test_after_an_outage_the_watchers_come_back_together(
        sim: KubeSim, new_source: MakeSource) -> None:
    """Once one watcher reaches the API server again, the others cut their backoff
    short: each used to come back at the end of its own (up to the 30 s cap, so up to
    30 s apart), and a pod created during the outage came back long before its new
    ReplicaSet, stamped with the ReplicaSet as its workload meanwhile. With a 3 s cap
    here, the last came back up to 3 s after the first."""
    _, rs, _ = deployment(sim, "web", "shop", replicas=1)
    source = new_source(backoff_max=3.0)
    await asyncio.wait_for(source.start(), 5)
    n = sum(len(ws) for _, ws in source.watchers.values())
    await sim.stop()
    await eventually(lambda: len(source._unhealthy) == n, timeout=5)
    await asyncio.sleep(2.0)  # the backoffs grow toward their cap
    sim.delete(rs)  # a rollout meanwhile
    deployment(sim, "web", "shop", replicas=1, rev="2")
    sim.compact()
    await sim.start()
    await eventually(lambda: len(source._unhealthy) < n, timeout=10)
    took = await eventually(lambda: not source._unhealthy, timeout=5)
    assert took < 1.0, took
    await eventually(lambda: (labels(source, "shop", "web-2-0") or {}).get("karta_kind")
                     == "Deployment", timeout=2)


class AcceptThenClose:
    """A TCP forwarder in front of the simulator playing an L4 load balancer: it forwards,
    or (``forwarding`` False) accepts each connection, reads the request's first bytes
    and closes it with no answer (no healthy backend; a TLS 1.3 API server refusing a
    client certificate looks the same: "Server disconnected")."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.forwarding = True
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if not self.forwarding:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r.read(1), 5)
            w.close()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.close()
            return
        self._open.update((w, uw))

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            except Exception:
                pass
            finally:
                b.close()
                self._open.discard(b)

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def cut(self) -> None:
        """Close every forwarded connection (the open watches break)."""
        for w in list(self._open):
            w.close()
        self._open.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_connections_closed_with_no_answer_are_an_outage(
        sim: KubeSim, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A load balancer that accepts and closes: every list and watch got "Server
    disconnected" before any answer, which the watcher took for a broken stream to
    resume quietly. Over 90 s (the audit, g_accept_then_close.py): 89 restarts, the
    index never stale, no warning, freshness 91 s old; and on recovery each watcher came
    back on its own backoff (5-16 s) instead of together. Now: unreachable, stale, one
    warning, and the others woken by the first one back."""
    _, rs, _ = deployment(sim, "web", "shop", replicas=1)
    lb = AcceptThenClose(sim.port)
    url = await lb.start()
    kc = sim.write_kubeconfig(tmp_path / "kubeconfig")
    kc.write_text(kc.read_text().replace(sim.url, url))
    source = KubeSource(KubeSettings(kubeconfig=str(kc), resync_backoff_max_seconds=3.0),
                        Engine(), PodIndex(), metrics_registry=CollectorRegistry(),
                        watch_timeout=2, watch_idle_timeout=1.5, recheck_interval=0.5)
    try:
        await asyncio.wait_for(source.start(), 5)
        n = sum(len(ws) for _, ws in source.watchers.values())
        with caplog.at_level(logging.WARNING, logger="proxy.kube.source"):
            lb.forwarding = False
            lb.cut()
            sim.create(pod("web-during", "shop", owner_obj=rs, labels={"app": "web"}))
            await eventually(lambda: source.index.stale, timeout=5)
            # 10 s: a clean-clone CI run beside four 37.5k-pod starts on the 2 cores did
            # not see every watcher fail within 5 s (0.5 s when the box is not starved)
            await eventually(lambda: len(source._unhealthy) == n, timeout=10)
        warned = [r.getMessage() for r in caplog.records
                  if "API server unreachable:" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "Server disconnected" in warned[0], warned
        why = {"resource": "pods", "reason": "unreachable"}
        assert metric(source, "karta_proxy_watch_restarts_total", why) >= 1
        await asyncio.sleep(2.0)  # the backoffs grow toward their cap
        lb.forwarding = True
        await eventually(lambda: len(source._unhealthy) < n, timeout=10)
        took = await eventually(lambda: not source._unhealthy, timeout=5)
        assert took < 1.0, took
        await eventually(lambda: labels(source, "shop", "web-during"), timeout=2)
        assert not source.index.stale
    finally:
        await source.stop()
        await lb.close()
