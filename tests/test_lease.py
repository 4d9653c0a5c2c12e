"""LeaseElector against the HTTP API simulator, through kubernetes-asyncio, unpatched.

Short leases (1.5 s) keep the suite fast; the logic is the same at 15 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from proxy.config import KubeSettings
from proxy.kube.client import load_configuration
from proxy.lease import LeaseElector, micro_time
from tests.kubesim.resources import LEASE
from tests.kubesim.server import KubeSim

DURATION = 1.5
NS = "karta-system"
NAME = "karta-proxy-facts"


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim() as s:
        yield s


@pytest.fixture
async def api(sim: KubeSim) -> AsyncIterator[Callable[[], k8s.ApiClient]]:
    """A factory of ApiClients (one per simulated replica), all closed at the end."""
    cfg = await load_configuration(KubeSettings(kubeconfig=str(sim.write_kubeconfig())))
    made: list[k8s.ApiClient] = []

    def make() -> k8s.ApiClient:
        c = k8s.ApiClient(configuration=cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


class OwnClock:
    """The replicas' own monotonic clock, which a test can move ahead: waiting out a lease
    on it takes no real time, and a takeover that came early still shows."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


class Replicas:
    """Electors running as tasks, like three proxy processes."""

    def __init__(self, make: Callable[[], k8s.ApiClient], n: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.electors = [
            LeaseElector(make(), NS, NAME, f"replica-{i}", DURATION, monotonic=clock)
            for i in range(n)
        ]
        self.tasks = [asyncio.create_task(e.run()) for e in self.electors]

    def leaders(self) -> list[LeaseElector]:
        return [e for e in self.electors if e.is_leader]

    async def one_leader(self, timeout: float) -> LeaseElector:
        """Wait for exactly one leader; fail on two at any sample."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leaders = self.leaders()
            assert len(leaders) <= 1, [e.identity for e in leaders]
            if leaders:
                return leaders[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no leader within {timeout} s")

    async def close(self) -> None:
        for e in self.electors:
            await e.stop(release=False)
        await asyncio.gather(*self.tasks, return_exceptions=True)


def lease(sim: KubeSim) -> dict[str, Any]:
    return sim.get("coordination.k8s.io/v1", "Lease", NAME, NS)


def holder(sim: KubeSim) -> str:
    return str(lease(sim)["spec"].get("holderIdentity") or "")


@contextlib.asynccontextmanager
async def running(e: LeaseElector) -> AsyncIterator[LeaseElector]:
    """One elector's loop as a task for the block, stopped with a release at its end (also
    when the block fails, so no task outlives the test)."""
    task = asyncio.create_task(e.run())
    try:
        yield e
    finally:
        await e.stop()
        await task


async def leading(e: LeaseElector, timeout: float, leader: bool = True) -> None:
    """Wait until ``e`` holds the lease (``leader=False``: has lost it); fail past timeout."""
    await asyncio.wait_for(_until(lambda: e.is_leader == leader), timeout)


async def test_single_candidate_creates_and_renews_the_lease(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    async with running(LeaseElector(api(), NS, NAME, "only", DURATION)) as e:
        await leading(e, 3)
        first = lease(sim)
        assert first["spec"]["holderIdentity"] == "only"
        assert first["spec"]["leaseDurationSeconds"] == 2  # ceil(1.5): the API takes ints
        await asyncio.sleep(DURATION * 1.2)  # several renewals
        renewed = lease(sim)
        assert (int(renewed["metadata"]["resourceVersion"])
                > int(first["metadata"]["resourceVersion"]))
        assert renewed["spec"]["renewTime"].endswith("Z") and "." in renewed["spec"]["renewTime"]
        assert e.is_leader
    # released on a clean stop: holder emptied so a successor need not wait
    assert holder(sim) == ""


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="Linux' CLOCK_BOOTTIME")
async def test_a_leader_resumed_after_a_suspend_longer_than_its_lease_no_longer_leads(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suspended machine's ``CLOCK_MONOTONIC`` stops; ``CLOCK_BOOTTIME`` counts the
    sleep. On the first, a leader resumed after two leases still called itself leader (and
    its fact writer wrote beside the replica that took over) until its next renewal
    failed; on the second it knows at once, and leads again by a round of its own."""
    async with running(LeaseElector(api(), NS, NAME, "only", DURATION)) as e:
        await leading(e, 3)
        real = time.clock_gettime
        slept = 2 * DURATION
        monkeypatch.setattr(time, "clock_gettime", lambda clock: real(clock) + (
            slept if clock == time.CLOCK_BOOTTIME else 0.0))
        assert not e.is_leader
        await leading(e, 3)  # nobody else: its next round takes the lease again


async def test_a_release_at_stop_replaces_the_record_written_last_in_one_call(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    # a stop's release read the lease, then replaced it: two calls of up to a third of the
    # lease each, after the drain. The record this replica wrote last is the lease as long
    # as nobody wrote since (its resourceVersion says so): one call
    e = LeaseElector(api(), NS, NAME, "only", DURATION)
    async with running(e):
        await leading(e, 3)
        seen = len(sim.requests)
    calls = [m for m, path, _, _ in list(sim.requests)[seen:] if "/leases/" in path]
    assert holder(sim) == ""
    assert calls[-1:] == ["PUT"] and "GET" not in calls, calls


async def test_a_stop_cuts_the_lease_call_under_way_and_releases_in_the_time_given(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], caplog: pytest.LogCaptureFixture
) -> None:
    # every Lease call answered in 4.5 s (a 15 s lease): a stop waited for the round under
    # way (up to 2/3 of the lease), then for two release calls of a third each: 12.5 s of
    # a stop that promises 10 in all. The call under way is cancelled, the release gets
    # the time the stop has left, and a release that does not land says why
    duration = 6.0
    e = LeaseElector(api(), NS, NAME, "slow", duration)
    task = asyncio.create_task(e.run())
    try:
        await leading(e, 10)
        sim.delay_resource(LEASE, 3.0)
        await asyncio.sleep(duration / 3 + 0.5)  # the next round is under way, for 3 s
        assert e.is_leader
        began = time.monotonic()
        await asyncio.wait_for(e.stop(timeout=1.0), 5)
        took = time.monotonic() - began
    finally:
        sim.delay_resource(LEASE, None)
        if not task.done():
            await e.stop(release=False)
        await task
    # the round under way alone took 3 s: 2.5 s leaves a loaded box room, not the wait
    assert 0.9 < took < 2.5, took
    assert not e.is_leader
    # the time the stop left it (1 s less the cancel of the round under way, shown to a
    # tenth: 0.995 s read "0.995 s")
    said = re.compile(rf"lease {NS}/{NAME}: release failed: no answer within (1|0\.9) s; it "
                      r"expires within 6 s")
    assert any(said.fullmatch(m) for m in caplog.messages), caplog.messages


async def test_three_candidates_one_leader_and_takeover_when_the_leader_dies(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    clock = OwnClock()
    r = Replicas(api, 3, clock)
    try:
        leader = await r.one_leader(3)
        assert holder(sim) == leader.identity
        # stays stable across several renew periods, never two leaders
        for _ in range(30):
            assert r.leaders() == [leader]
            await asyncio.sleep(DURATION / 15)
        # the leader dies without releasing (a crash): the lease must expire first
        died = clock()
        await leader.stop(release=False)
        survivors = [e for e in r.electors if e is not leader]
        # once both have seen the dead leader's last renewal (their wait starts there),
        # most of the wait passes at once on their clocks
        final = lease(sim)["metadata"]
        deadline = time.monotonic() + DURATION
        while not all(e.observed_version == final["resourceVersion"] for e in survivors):
            assert time.monotonic() < deadline, "survivors never read the last renewal"
            await asyncio.sleep(0.02)
        clock.ahead += DURATION * 0.8
        new = await r.one_leader(DURATION * 3)
        took = clock() - died
        assert new in survivors
        # not before the lease ran out on the survivors' clocks, well within 2 durations
        assert took >= DURATION * 0.9, took
        assert took <= DURATION * 2 + 0.5, took
        assert lease(sim)["spec"]["holderIdentity"] == new.identity
        assert lease(sim)["spec"]["leaseTransitions"] == 1
    finally:
        await r.close()


async def test_clean_release_hands_over_at_once(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    r = Replicas(api, 2)
    try:
        leader = await r.one_leader(3)
        t0 = time.monotonic()
        await leader.stop(release=True)
        new = await r.one_leader(DURATION * 3)
        assert new is not leader
        # an empty holder is free: the successor takes it at its next round (~D/3)
        assert time.monotonic() - t0 < DURATION, time.monotonic() - t0
    finally:
        await r.close()


async def test_an_unexpired_lease_of_another_holder_is_respected(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    """A lease held by a replica we never saw counts from when we first see it (own
    clock), so a renewTime far in the past (clock skew) does not let us grab it early."""
    from datetime import timedelta

    old = datetime.now(UTC) - timedelta(hours=1)
    sim.create(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {
                "holderIdentity": "someone-else",
                "leaseDurationSeconds": 2,
                "renewTime": micro_time(old),
                "acquireTime": micro_time(old),
                "leaseTransitions": 4,
            },
        }
    )
    async with running(LeaseElector(api(), NS, NAME, "newcomer", DURATION)) as e:
        await asyncio.sleep(DURATION * 0.6)
        assert not e.is_leader and holder(sim) == "someone-else"
        await leading(e, DURATION * 2)
        assert lease(sim)["spec"]["leaseTransitions"] == 5


async def test_a_holder_with_a_longer_lease_is_waited_for_as_long_as_its_record_says(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    # a rolling change of facts.lease_duration_seconds: the old replica renews within its
    # own, longer, duration; a new one counting its own shorter duration took its lease
    # while it was healthy, and both wrote
    sim.create({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"holderIdentity": "old-replica", "leaseDurationSeconds": 4,
                 "renewTime": micro_time(datetime.now(UTC))},
    })
    async with running(LeaseElector(api(), NS, NAME, "new-replica", DURATION)) as e:
        await asyncio.sleep(DURATION * 1.6)  # past its own duration, within the record's
        assert not e.is_leader and holder(sim) == "old-replica"
        await leading(e, 4.0 + DURATION * 2)  # and taken once the record's has passed


async def test_leader_steps_down_when_it_cannot_renew_and_recovers(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    async with running(LeaseElector(api(), NS, NAME, "solo", DURATION)) as e:
        try:
            await leading(e, 3)
            sim.fail_status = 503  # API server up but failing
            t0 = time.monotonic()
            await leading(e, DURATION * 2, leader=False)
            # stepped down by the renew deadline (2/3 D), before anyone could take over (D)
            assert time.monotonic() - t0 <= DURATION, time.monotonic() - t0
            assert "503" in e.last_error or "Service" in e.last_error
            sim.fail_status = None
            await leading(e, DURATION * 2)
        finally:
            sim.fail_status = None  # before the stop: the release must reach the API


async def test_a_stolen_lease_ends_leadership_at_the_next_renewal(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    async with running(LeaseElector(api(), NS, NAME, "victim", DURATION)) as e:
        await leading(e, 3)
        stolen = lease(sim)
        stolen["spec"]["holderIdentity"] = "intruder"
        sim.update(stolen)
        await leading(e, DURATION, leader=False)
        assert holder(sim) == "intruder"
    assert holder(sim) == "intruder"  # release only touches a lease we hold


async def test_two_processes_configured_with_one_identity_do_not_both_lead(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], caplog: pytest.LogCaptureFixture,
) -> None:
    # facts.identity templated to one value for every replica: each read the lease as its
    # own and renewed it, both leading, every fact written twice
    clock = OwnClock()
    a = LeaseElector(api(), NS, NAME, "shared", DURATION, monotonic=clock)
    b = LeaseElector(api(), NS, NAME, "shared", DURATION, monotonic=clock)
    async with running(a):
        await leading(a, 3)
        async with running(b):
            for _ in range(int(DURATION * 2 / 0.05)):  # several renewals of each
                assert not (a.is_leader and b.is_leader)
                await asyncio.sleep(0.05)
            assert a.is_leader and not b.is_leader and b.twin_rounds >= 2
            assert "renewed by another process" in caplog.text
            assert "renewed by another process" in b.last_error
            await a.stop(release=False)  # the leader dies: the twin takes over, as any would
            clock.ahead += DURATION * 2
            await leading(b, DURATION * 2)
            assert not a.is_leader and holder(sim) == "shared"


async def test_a_crashed_run_under_the_same_identity_is_waited_out_quietly(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], caplog: pytest.LogCaptureFixture,
) -> None:
    # a replica with a configured identity that crashed (no release) and came back: its
    # old record is not its own write; it is waited out, with no error (nothing renews it)
    caplog.set_level(logging.INFO, "proxy.lease")
    sim.create({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"holderIdentity": "fixed", "leaseDurationSeconds": 2,
                 "renewTime": micro_time(datetime.now(UTC)), "leaseTransitions": 1},
    })
    async with running(LeaseElector(api(), NS, NAME, "fixed", DURATION)) as e:
        await asyncio.sleep(DURATION * 0.6)
        assert not e.is_leader
        await leading(e, 2.0 + DURATION * 2)
        assert "earlier run" in caplog.text and "another process" not in caplog.text
        assert lease(sim)["spec"]["leaseTransitions"] == 2
        await asyncio.sleep(DURATION)  # its own renewals are recognised as its own
        assert e.is_leader and e.last_error == ""


async def test_a_renewal_refused_with_a_conflict_is_not_mistaken_for_a_twin(
    sim: KubeSim, api: Callable[[], k8s.ApiClient],
) -> None:
    # a 409 leaves the record with the renewTime of the write before the refused one (and
    # a write that timed out may have landed): both count as this process' own
    e = LeaseElector(api(), NS, NAME, "solo", DURATION)
    assert await e.try_acquire_or_renew()
    real = e._api.replace_namespaced_lease

    async def touched_first(*args: Any, **kwargs: Any) -> Any:
        other = lease(sim)
        other["metadata"].setdefault("annotations", {})["touched"] = "yes"
        sim.update(other)  # a new resourceVersion: the write below gets a real 409
        return await real(*args, **kwargs)

    e._api.replace_namespaced_lease = touched_first  # type: ignore[method-assign]
    assert not await e.try_acquire_or_renew()
    e._api.replace_namespaced_lease = real  # type: ignore[method-assign]
    assert await e.try_acquire_or_renew()
    assert e.twin_rounds == 0 and e.last_error == ""


async def test_a_slow_lease_api_keeps_the_leader(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    # every Lease call answered in a fifth of the lease (the audit: 1.2 s at 6 s): a
    # round of GET + PUT, spaced by a third of the lease after its end, let leadership
    # lapse every round. One PUT a round, every third of the lease from its start, and a
    # lead counted from when the renewal was sent keep it (its deadline is 2/3 L after
    # the renewal's start; a renewal now answers within L/3 + L/5 of the previous one's)
    duration = 4.5
    async with running(LeaseElector(api(), NS, NAME, "slow", duration)) as e:
        await leading(e, 10)
        sim.delay_resource(LEASE, duration / 5)
        seen = len(sim.requests)
        lapses = 0
        for _ in range(int(duration * 2 / 0.02)):  # two lease durations, several rounds
            lapses += not e.is_leader
            await asyncio.sleep(0.02)
        sim.delay_resource(LEASE, None)
        calls = [m for m, path, _, _ in list(sim.requests)[seen:] if "/leases/" in path]
        assert lapses == 0 and e.acquisitions == 1, (lapses, e.acquisitions)
        # renewing costs one PUT a round, no read
        assert calls and set(calls) == {"PUT"}, calls


async def test_a_takeover_succeeds_when_writes_answer_slower_than_a_third_of_the_lease(
    sim: KubeSim, api: Callable[[], k8s.ApiClient]
) -> None:
    # every PUT answered after 0.43 L (2.5 s at 6 s): each call was given L/3, so every
    # takeover gave up client-side, though the API applied it, and nobody led
    duration = 3.0
    sim.create({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"holderIdentity": "gone", "leaseDurationSeconds": 3,
                 "renewTime": micro_time(datetime.now(UTC))},
    })
    sim.delay_resource(LEASE, duration * 0.43, methods=("PUT",))
    async with running(LeaseElector(api(), NS, NAME, "patient", duration)) as e:
        try:
            await leading(e, 30)
            assert holder(sim) == "patient"
            assert lease(sim)["spec"]["leaseTransitions"] == 1
        finally:
            sim.delay_resource(LEASE, None)


async def test_writes_that_timed_out_but_landed_do_not_make_its_own_lease_an_earlier_runs(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], caplog: pytest.LogCaptureFixture,
) -> None:
    # PUTs answered after their timeout but applied all the same: it remembered the
    # renewTimes of its last two writes only, so the record of an earlier timed-out write
    # that landed read as "held by an earlier run"; it waited its own lease out and took
    # it again as a new holder (a transition, a new acquireTime)
    caplog.set_level(logging.INFO, "proxy.lease")
    e = LeaseElector(api(), NS, NAME, "solo", DURATION)
    async with running(e):
        await leading(e, 3)
        acquired = lease(sim)["spec"]["acquireTime"]
        slow = DURATION * 2 / 3 + 0.2  # past a call's timeout (2/3 L; it was L/3)
        sim.delay_resource(LEASE, slow, methods=("PUT",))
        seen = len(sim.requests)

        def puts() -> int:
            return sum(1 for m, path, _, _ in list(sim.requests)[seen:]
                       if m == "PUT" and "/leases/" in path)

        try:
            await asyncio.wait_for(_until(lambda: puts() >= 5), 60)
        finally:
            sim.delay_resource(LEASE, None)
        await asyncio.sleep(slow + 0.3)  # the last delayed write has landed
        await leading(e, 30)
        assert "earlier run" not in caplog.text and e.twin_rounds == 0
        assert lease(sim)["spec"]["leaseTransitions"] == 0
        assert lease(sim)["spec"]["acquireTime"] == acquired


async def test_failing_rounds_log_one_short_line_throttled_and_are_counted(
    sim: KubeSim, api: Callable[[], k8s.ApiClient], caplog: pytest.LogCaptureFixture,
) -> None:
    # every failing round logged the client's whole ApiException (HTTP headers, body,
    # newlines: ~600 bytes) every third of the lease
    caplog.set_level(logging.INFO, "proxy.lease")
    reasons: list[str] = []
    e = LeaseElector(api(), NS, NAME, "quiet", DURATION)
    e.on_failure = reasons.append
    sim.fail_resource(LEASE, 503)
    seen = len(sim.requests)

    def rounds() -> int:
        return sum(1 for _, path, _, _ in list(sim.requests)[seen:] if "/leases/" in path)

    try:
        async with running(e):
            await asyncio.wait_for(_until(lambda: rounds() >= 6), 60)
            sim.fail_resource(LEASE, None)
    finally:
        sim.fail_resource(LEASE, None)
    warnings = [r for r in caplog.records
                if r.name == "proxy.lease" and r.levelno >= logging.WARNING]
    # the first at once; the rest of the 10 s in one summary (at the stop, here)
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    first = warnings[0]
    error = first.__dict__["error"]
    assert error.startswith("503 ") and "simulated failure" in error, error
    assert "\n" not in error and len(error) <= 300 and "HTTP response" not in error
    assert len(reasons) >= 6 and set(reasons) == {"status"}
    if len(warnings) == 2:
        assert warnings[1].__dict__["count"] == len(reasons) - 1


def test_micro_time_always_has_six_digits() -> None:
    from datetime import UTC, datetime

    assert micro_time(datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2025-01-02T03:04:05.000000Z"


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.02)
