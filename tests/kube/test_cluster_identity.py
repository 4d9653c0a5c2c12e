"""The cluster's identity (proxy.kube.cluster_identity): the kube-system Namespace's uid,
read from the simulator as from a real API server, and what a refusal, an error, a slow
or odd answer leave behind: no uid (or the one last read), one warning, a retry."""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.kube.client import KubeClient
from proxy.kube.cluster_identity import PATH, ClusterIdentity, uid_of
from tests.kube.conftest import eventually
from tests.kubesim import KubeSim
from tests.kubesim.resources import NAMESPACE

KUBE_SYSTEM = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "proxy.kube.cluster_identity" and r.levelno >= logging.WARNING]


async def test_the_uid_is_the_kube_system_namespaces(sim: KubeSim, client: KubeClient) -> None:
    identity = ClusterIdentity(client)
    assert identity.uid == ""
    assert await identity.read()
    assert identity.uid == sim.kube_system_uid
    gets = [(m, p) for m, p, _, _ in sim.requests if "namespaces" in p]
    assert gets == [("GET", PATH)]  # one object, by name: what the RBAC rule grants


async def test_rbac_refused_warns_once_naming_the_permission_and_retries(
        sim: KubeSim, client: KubeClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "proxy.kube.cluster_identity")
    sim.fail_resource(NAMESPACE, 403)
    identity = ClusterIdentity(client, retry_seconds=0.05)
    identity.start()
    try:
        assert not await identity.wait_first(5.0)
        await eventually(lambda: identity.failures >= 3)
        assert identity.uid == ""
        (line,) = _warnings(caplog)  # once for the streak, not once per try
        assert "forbidden (403)" in line and "get on namespaces" in line
        assert "kube-system" in line and "without karta_cluster_uid" in line
        sim.fail_resource(NAMESPACE, None)  # the ClusterRole applied
        await eventually(lambda: identity.uid == sim.kube_system_uid)
        assert identity.failures == 0
        assert any("cluster identity read after" in r.getMessage() for r in caplog.records)
    finally:
        await identity.stop()


async def test_a_failure_after_a_read_keeps_the_uid(
        sim: KubeSim, client: KubeClient, caplog: pytest.LogCaptureFixture) -> None:
    identity = ClusterIdentity(client)
    assert await identity.read()
    sim.fail_resource(NAMESPACE, 503)
    assert not await identity.read()
    assert identity.uid == sim.kube_system_uid
    (line,) = _warnings(caplog)
    assert "503" in line and f"the uid last read ({sim.kube_system_uid}) is kept" in line


@pytest.mark.parametrize("how", ["missing", "slow", "down"])
async def test_no_namespace_a_slow_or_gone_server_is_no_uid_and_no_raise(
        sim: KubeSim, client: KubeClient, caplog: pytest.LogCaptureFixture, how: str) -> None:
    if how == "missing":
        sim.delete(KUBE_SYSTEM)
    elif how == "slow":
        sim.delay_resource(NAMESPACE, 3.0)
    else:
        await sim.stop()
    identity = ClusterIdentity(client, timeout=0.3)
    started = asyncio.get_running_loop().time()
    assert not await identity.read()
    assert asyncio.get_running_loop().time() - started < 2.5
    assert identity.uid == ""
    (line,) = _warnings(caplog)
    assert {"missing": "404", "slow": "no answer within 0.3 s",
            "down": "Error"}[how] in line


async def test_another_cluster_behind_the_same_connection_is_a_new_uid(
        sim: KubeSim, client: KubeClient, caplog: pytest.LogCaptureFixture) -> None:
    """The kubeconfig reloaded in place may point at another cluster: the periodic read
    takes its uid, and says so."""
    identity = ClusterIdentity(client)
    assert await identity.read()
    before = identity.uid
    sim.delete(KUBE_SYSTEM)
    sim.create({**KUBE_SYSTEM, "metadata": {"name": "kube-system", "uid": "other-cluster"}})
    assert await identity.read()
    assert identity.uid == "other-cluster"
    (line,) = _warnings(caplog)
    assert f"was {before}, is other-cluster" in line


@pytest.mark.parametrize("doc", [
    None, [], {"metadata": None}, {"metadata": {}}, {"metadata": {"uid": 7}},
    {"metadata": {"uid": ""}}, {"metadata": {"uid": "a\nb"}}, {"metadata": {"uid": "u" * 129}},
])
def test_an_answer_without_a_usable_uid_is_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        uid_of(doc)


def test_a_uid_is_taken_as_it_is() -> None:
    assert uid_of({"metadata": {"uid": "3f1c9a4e-4a47-4a8b-9f5e-2d0c6b1e7a10"}}) == (
        "3f1c9a4e-4a47-4a8b-9f5e-2d0c6b1e7a10")


async def test_a_cancel_in_the_turn_of_the_first_read_ends_wait_first(
        client: KubeClient) -> None:
    """``wait_first`` cancelled in the very turn the first read ends: cancelled, not
    returned (Python 3.11's ``asyncio.wait_for`` swallowed such a cancel)."""
    identity = ClusterIdentity(client)
    waiting = asyncio.create_task(identity.wait_first(30.0))
    await asyncio.sleep(0.05)
    identity.first_read.set()
    waiting.cancel()
    await asyncio.wait({waiting}, timeout=2)
    assert waiting.cancelled()


class _HeldAnswer:
    """A client whose answer comes when the test says: the turn of the cancel is the
    point, which the simulator cannot be made to hit."""

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[object] | None = None

    async def request_json(self, path: str, *, timeout: float | None = None) -> object:
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        return await self.answer


async def test_a_stop_in_the_turn_of_the_answer_ends_the_loop() -> None:
    """``stop`` in the very turn a read is answered: the loop ends (it read on, every
    ``refresh_seconds``, with ``stop`` waiting for it for good)."""
    held = _HeldAnswer("uid-1")
    identity = ClusterIdentity(held, refresh_seconds=3600.0)
    identity.start()
    await asyncio.wait_for(held.asked.wait(), 5)
    assert held.answer is not None

    async def answer_and_stop() -> None:
        assert held.answer is not None
        held.answer.set_result({"metadata": {"uid": held.uid}})
        await identity.stop()

    stopping = asyncio.create_task(answer_and_stop())
    done, _ = await asyncio.wait({stopping}, timeout=2)
    try:
        assert done, "stop() still waiting for the read loop after 2 s"
    finally:
        for t in asyncio.all_tasks():
            if t.get_name() == "cluster identity":
                t.cancel()
        stopping.cancel()
