"""A stopped proxy process (SIGSTOP / SIGCONT: a cgroup freezer, a debugger) whose
upstream answered during the stop: the sender gets that answer, not a 504 for a batch
the receiver stored (``proxy.deadline``; docs/operations.md, "A paused replica").

A real Prometheus 2.42 receives; it is stopped first so that the proxy's request waits
there, then the proxy is stopped and the receiver resumed: it stores the sample and
answers into the stopped proxy's socket. The proxy stays stopped past both its
deadlines (the request's, ``upstream.timeout_seconds``, and the post's, a second more)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from proxy.demo_exporter import DEMO_SNAPSHOT
from proxy.sender import Series, send_series
from proxy.upstream import CLIENT_TIMEOUT_MARGIN
from tests.peers.conftest import Peers, free_port, query

pytestmark = pytest.mark.peers

#: the proxy's upstream.timeout_seconds here
TIMEOUT = 1.0
#: how long the proxy stays stopped: past both deadlines
STOPPED = TIMEOUT + CLIENT_TIMEOUT_MARGIN + 1.0


async def test_an_answer_that_came_while_the_proxy_was_stopped_reaches_the_sender(
        peers: Peers) -> None:
    tsdb = await peers.prometheus_receiver()
    port = free_port()
    proxy = await peers.karta_proxy("paused", port, [
        "--snapshot", str(DEMO_SNAPSHOT), "--no-facts",
        "--upstream-url", tsdb.base_url + "/api/v1/write",
        "--upstream-timeout", f"{TIMEOUT:g}",
    ])
    assert tsdb.proc is not None and proxy.proc is not None
    probe = Series({"__name__": "paused_probe", "job": "paused"},
                   [(int(time.time() * 1000), 1.0)])
    tsdb.proc.send_signal(signal.SIGSTOP)
    try:
        sent = asyncio.create_task(send_series(
            f"http://127.0.0.1:{port}/api/v1/write", [probe], timeout=30))
        await asyncio.sleep(0.5)  # relayed: waiting at the stopped receiver
        proxy.proc.send_signal(signal.SIGSTOP)
    finally:
        tsdb.proc.send_signal(signal.SIGCONT)  # it stores and answers the stopped proxy
    try:
        await asyncio.sleep(STOPPED)
    finally:
        proxy.proc.send_signal(signal.SIGCONT)
    status, _, text = await sent
    assert 200 <= status < 300, (status, text)
    stored = await query(tsdb.base_url, "count_over_time(paused_probe[5m])")
    assert [r["value"][1] for r in stored] == ["1"], stored
