"""A leader whose fact writes all fail gives the lease up, so a replica whose upstream
works writes the facts (the audit: one leader's upstream answered 503 for 60 s, it kept
the lease, 30 writes failed and no fact was written for 60 s while two healthy standbys
waited). Real LeaseElectors against the API simulator; writers as in the runtime."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from proxy import contract
from proxy.config import FactSettings, KubeSettings
from proxy.facts import FactWriter
from proxy.facts.collectors import sample_value
from proxy.kube.client import load_configuration
from proxy.lease import LeaseElector
from tests.facts.helpers import small_index
from tests.kubesim.server import KubeSim
from tests.peers.conftest import wait_until

DURATION = 1.5
INTERVAL = 0.2


class Refused(Exception):
    """What ``Upstream.send_v1`` raises: an ``UpstreamFailure`` with the status a sender
    would get."""

    def __init__(self, status: int) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status


@pytest.fixture
async def cluster() -> AsyncIterator[Callable[[str], LeaseElector]]:
    """Electors (one ApiClient each) on one simulated API server; all stopped after."""
    async with KubeSim() as sim:
        cfg = await load_configuration(KubeSettings(kubeconfig=str(sim.write_kubeconfig())))
        made: list[tuple[LeaseElector, k8s.ApiClient]] = []

        def elector(identity: str) -> LeaseElector:
            api = k8s.ApiClient(configuration=cfg)
            e = LeaseElector(api, "karta", "facts", identity, DURATION)
            made.append((e, api))
            return e

        yield elector
        for e, api in made:
            await e.stop(release=False)
            await api.close()


class Replica:
    """One proxy's fact writer and elector, its upstream up or down."""

    def __init__(self, elector: LeaseElector, index: Any) -> None:
        self.elector = elector
        self.down = False
        self.sent = 0

        async def send(body: bytes) -> None:
            if self.down:
                raise Refused(503)
            self.sent += 1

        self.writer = FactWriter(FactSettings(interval_seconds=INTERVAL), index, send,
                                 elector=elector)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.writer.start()
        self.task = asyncio.create_task(self.elector.run())

    async def stop(self) -> None:
        await self.writer.stop()
        await self.elector.stop(release=False)
        if self.task is not None:
            await self.task

    @property
    def stepdowns(self) -> float:
        return sample_value(self.writer.metrics.stepdowns.labels(reason="writes_failing"))


def until(cond: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return cond()
    return check


async def test_a_leader_whose_writes_fail_hands_the_lease_to_a_healthy_standby(
    cluster: Callable[[str], LeaseElector], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    index = small_index()
    a, b = Replica(cluster("a"), index), Replica(cluster("b"), index)
    a.down = True
    try:
        await a.start()
        await wait_until(until(lambda: a.elector.is_leader), timeout=30, what="a leads",
                         interval=0.02)
        await b.start()
        await wait_until(until(lambda: b.elector.is_leader and b.sent > 0), timeout=60,
                         what="b takes over and writes", interval=0.05)
        assert a.stepdowns == 1 and not a.elector.is_leader
        assert a.writer.writes_failed >= 2
        assert "fact writer steps down" in caplog.text
        # b writes on: its renewals hold the lease through a's cooldown and after it
        await wait_until(until(lambda: not a.elector.cooling_down), timeout=30,
                         what="a's cooldown over", interval=0.05)
        sent = b.sent
        await wait_until(until(lambda: b.sent > sent + 3), timeout=30, what="b writes on")
        assert b.elector.is_leader and not a.elector.is_leader
    finally:
        await a.stop()
        await b.stop()


async def test_a_lone_leader_whose_writes_fail_takes_the_lease_again_after_its_cooldown(
    cluster: Callable[[str], LeaseElector],
) -> None:
    a = Replica(cluster("alone"), small_index())
    a.down = True
    try:
        await a.start()
        await wait_until(until(lambda: a.stepdowns >= 1), timeout=60, what="a steps down",
                         interval=0.02)
        assert a.elector.cooling_down and a.elector.acquisitions == 1
        a.down = False
        await wait_until(until(lambda: a.elector.acquisitions >= 2 and a.sent > 0),
                         timeout=60, what="a leads and writes again", interval=0.05)
        assert a.stepdowns == 1
    finally:
        await a.stop()


class _Elector:
    """The lease's seams the writer uses, with every step-down recorded."""

    def __init__(self) -> None:
        self.is_leader = True
        self.lease_duration = 1.0
        self.record_seen_ago = math.inf
        self.cooldowns: list[float] = []
        self.on_failure: Callable[[str], None] | None = None

    def step_down(self, cooldown: float) -> None:
        self.cooldowns.append(cooldown)
        self.is_leader = False


@pytest.mark.parametrize(("status", "steps_down"), [
    (503, True), (429, True), (0, True),  # the way out: later (0: no answer at all)
    (400, False), (413, False), (401, False),  # the upstream answered: refused
])
async def test_only_failures_on_the_way_out_count_toward_a_step_down(
    status: int, steps_down: bool,
) -> None:
    now = [0.0]

    async def send(body: bytes) -> None:
        if status:
            raise Refused(status)
        raise OSError("connection refused")

    elector = _Elector()
    w = FactWriter(FactSettings(interval_seconds=0.1), small_index(), send,
                   elector=elector, monotonic=lambda: now[0])  # type: ignore[arg-type]
    assert w.step_down_after == 1.0  # the lease (1 s) over two intervals (0.2 s)
    assert not await w.write_once()
    assert not elector.cooldowns  # one failed write is never enough
    now[0] += 0.6
    assert not await w.write_once()
    assert not elector.cooldowns  # two, but not for a lease's time
    now[0] += 0.6
    assert not await w.write_once()
    assert elector.cooldowns == ([2.0] if steps_down else []), status
    assert sample_value(w.metrics.stepdowns.labels(reason="writes_failing")) == steps_down
    assert contract.STEPDOWN_REASONS == ("writes_failing", "clock_offset")


async def test_a_success_starts_the_count_again() -> None:
    now = [0.0]
    fail = [True]

    async def send(body: bytes) -> None:
        if fail[0]:
            raise Refused(503)

    elector = _Elector()
    w = FactWriter(FactSettings(interval_seconds=0.1), small_index(), send,
                   elector=elector, monotonic=lambda: now[0])  # type: ignore[arg-type]
    for failing in (True, False, True, True):
        fail[0] = failing
        await w.write_once()
        now[0] += 0.7
    assert not elector.cooldowns  # 2.1 s of writes, but failing for 0.7 s only
    await w.write_once()
    assert elector.cooldowns == [2.0]

