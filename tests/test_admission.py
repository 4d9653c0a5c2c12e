"""Admission against hostile or broken senders, over raw loopback sockets: stalled bodies
(chunked or with a declared length), ``Expect: 100-continue``, the byte budget, waiting
for a request slot (``proxy.admission``), senders gone mid-body. What a connection gets
before the handler sees a request (the header deadline, shedding on the headers, the
connection and header limits) is ``tests/test_connection_guard.py``'s. Every wait is
bounded; the deadlines are made short through the settings so each test takes a second
or two."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import sys
import termios
import time
from pathlib import Path

import pytest
import snappy

from proxy.admission import Outcome, Slots
from proxy.handler import WAITERS_PER_SLOT
from proxy.runtime import Proxy
from tests.proxy_harness import metric, proxy_running, series_v1, start_proxy
from tests.raw_http import (
    BODY,
    HEAD,
    connect,
    holding_the_slot,
    inflight,
    post,
    read_answer,
    request,
    slot_taken,
)
from tests.scripted import Reply, ScriptedUpstream


async def test_stalled_chunked_uploads_hold_only_what_they_sent(tmp_path: Path) -> None:
    # before: each chunked request reserved max_body_bytes, so 4 stalls took the whole
    # byte budget and every other sender got 503 while they stayed open
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, max_body_bytes=1 << 20, max_inflight_bytes=4 << 20,
                      body_read_timeout_seconds=1.0, min_body_bytes_per_second=1) as p,
    ):
        stalled = []
        for _ in range(4):
            r, w = await connect(p)
            w.write((HEAD + "Transfer-Encoding: chunked\r\n\r\n10\r\n").encode()
                    + b"x" * 16 + b"\r\n")
            stalled.append((r, w))
        await inflight(p, 4)
        assert metric(p, "karta_proxy_inflight_bytes") == 4 * 16
        ok = await post(p)
        assert ok.status == 204, ok
        t0 = time.monotonic()
        answers = [await read_answer(r) for r, _ in stalled]
        waited = time.monotonic() - t0
        for _, w in stalled:
            w.close()
        # a 503, not a 408: Prometheus drops a batch on any 4xx but 429, and keeps it on a
        # 5xx; a stalled upload is no fault of its data
        assert [a.status for a in answers] == [503] * 4
        assert all(a.closed and b"not received within 1 s" in a.body for a in answers)
        assert all(a.headers["retry-after"] == "1" for a in answers)
        assert waited < 2.5
        assert metric(p, "karta_proxy_requests_rejected_total", reason="body_timeout") == 4
        assert metric(p, "karta_proxy_inflight_bytes") == 0
        assert metric(p, "karta_proxy_inflight_requests") == 0
    assert len(up.received) == 1


async def test_declared_length_trickled_is_503_too_slow_and_frees_the_slots(
        tmp_path: Path) -> None:
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, max_concurrent_requests=4, admission_wait_seconds=0.0,
                      body_read_timeout_seconds=20.0, min_body_bytes_per_second=1000) as p,
    ):
        stalled = []
        for _ in range(4):
            r, w = await connect(p)
            w.write((HEAD + "Content-Length: 1000000\r\n\r\n").encode() + b"ab")
            stalled.append((r, w))
        await inflight(p, 4)  # every slot taken
        busy = await post(p)
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        # due: 1 s of grace + 3 bytes / 1000 bytes/s after the body's start
        answers = [await read_answer(r, timeout=15.0) for r, _ in stalled]
        for _, w in stalled:
            w.close()
        assert [a.status for a in answers] == [503] * 4
        assert all(b"too slow: 2 bytes" in a.body and a.headers["retry-after"] == "1"
                   for a in answers)
        assert metric(p, "karta_proxy_requests_rejected_total", reason="body_too_slow") == 4
        assert (await post(p)).status == 204


async def test_a_body_at_the_minimum_rate_is_taken(tmp_path: Path) -> None:
    # 12 bytes/s after the first second: the body's second half (byte 25 on) is due
    # at 1 + 25 / 12 s, and comes at 1.6 s
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, body_read_timeout_seconds=10.0,
                      min_body_bytes_per_second=12) as p,
    ):
        r, w = await connect(p)
        w.write((HEAD + f"Content-Length: {len(BODY)}\r\n\r\n").encode())
        half = len(BODY) // 2
        for part in (BODY[:half], BODY[half:]):
            await asyncio.sleep(0.8)
            w.write(part)
        a = await read_answer(r)
        w.close()
        assert a.status == 204, a
    assert len(up.received) == 1


async def test_no_100_continue_for_a_request_that_is_refused(tmp_path: Path) -> None:
    answer = asyncio.Event()  # the upstream holds the admitted request until then
    async with (
        ScriptedUpstream(Reply(204, gate=answer)) as up,
        proxy_running(tmp_path, up, max_body_bytes=10_000, max_concurrent_requests=1,
                      admission_wait_seconds=0.0) as p,
    ):
        expect = "Expect: 100-continue\r\n"
        r, w = await connect(p)  # over the limit: 413 at once, never 100
        w.write((HEAD + expect + "Content-Length: 20000\r\n\r\n").encode())
        big = await read_answer(r)
        w.close()
        assert big.status == 413 and big.interim == b"" and big.closed

        r, w = await connect(p)  # admitted: 100, then the body, then the answer
        w.write((HEAD + expect + f"Content-Length: {len(BODY)}\r\n\r\n").encode())
        async with asyncio.timeout(5):
            cont = await r.readuntil(b"\r\n\r\n")
        assert cont == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(BODY)
        # the one slot is held while the upstream answers: refused without a 100
        r2, w2 = await connect(p)
        await asyncio.sleep(0.2)
        w2.write((HEAD + expect + f"Content-Length: {len(BODY)}\r\n\r\n").encode())
        busy = await read_answer(r2)
        w2.close()
        assert busy.status == 503 and busy.interim == b"" and busy.closed
        answer.set()
        ok = await read_answer(r)
        w.close()
        assert ok.status == 204

        r, w = await connect(p)
        w.write((HEAD + "Expect: something-else\r\nContent-Length: 3\r\n\r\n").encode())
        odd = await read_answer(r)
        w.close()
        assert odd.status == 417
    assert len(up.received) == 1


async def test_an_overload_refusal_past_the_headers_keeps_a_skippable_connection(
        tmp_path: Path) -> None:
    # the byte budget refuses mid-body, in the handler: aiohttp reads the rest and the
    # connection serves the next request (no reconnect for a sender that retries at once)
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, max_inflight_bytes=600) as p,
    ):
        # another request holds 16 bytes of the budget (a request alone may exceed it)
        _, hw = await connect(p)
        hw.write((HEAD + "Transfer-Encoding: chunked\r\n\r\n10\r\n").encode()
                 + b"x" * 16 + b"\r\n")
        for _ in range(100):
            if metric(p, "karta_proxy_inflight_bytes") == 16:
                break
            await asyncio.sleep(0.01)
        r, w = await connect(p)
        w.write(request(b"x" * 1000))
        busy = await read_answer(r)
        assert busy.status == 503 and busy.headers["retry-after"] == "1", busy
        assert "connection" not in busy.headers
        hw.close()
        w.write(request())
        ok = await read_answer(r)
        w.close()
        assert ok.status == 204, ok
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 1
    assert len(up.received) == 1


async def test_a_request_alone_is_taken_even_when_larger_than_the_budget(
        tmp_path: Path) -> None:
    # max_inflight_bytes below max_body_bytes + max_decoded_bytes: a request that needs
    # more than the whole budget was refused with a 503 on every retry, its data never
    # stored; alone in flight it is taken (its size has limits of its own)
    body = snappy.compress(series_v1(*({"__name__": "m", "i": str(i), "pad": "p" * 200}
                                       for i in range(5000))))
    assert len(body) < 600_000 < len(snappy.uncompress(body))
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, max_inflight_bytes=600_000) as p,
    ):
        for _ in range(2):
            ok = await post(p, body)
            assert ok.status == 204, ok
        assert metric(p, "karta_proxy_inflight_bytes") == 0
    assert len(up.received) == 2


# -- waiting for a slot (server.admission_wait_seconds) ---------------------------------


def unread(p: Proxy) -> int:
    """Bytes in the kernel's receive queue of the one waiting request's socket: what the
    proxy has not read of it."""
    (waiter,) = p.handler.slots._waiters
    buf = bytearray(4)
    fcntl.ioctl(waiter.fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


async def waiting(p: Proxy, n: int = 1) -> None:
    deadline = time.monotonic() + 15
    while p.handler.slots.waiting != n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{p.handler.slots.waiting} waiting, expected {n}")
        await asyncio.sleep(0.01)


async def test_a_request_finding_the_slots_full_waits_with_its_body_unread_and_is_served(
        tmp_path: Path) -> None:
    async with slot_taken(tmp_path, wait=10.0, body_read_timeout_seconds=0.3) as t:
        p, up, holder = t.proxy, t.upstream, t.holder
        held = p.handler.budget.bytes
        body = snappy.compress(series_v1(*({"__name__": "up", "job": f"j{i}"}
                                           for i in range(2000))))
        r, w = await connect(p)
        started = time.monotonic()
        w.write((HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode())
        await waiting(p)
        w.write(body)
        await asyncio.sleep(0.2)
        # nothing of the body read (it is all in the kernel) nor budgeted
        assert unread(p) == len(body)
        assert p.handler.budget.bytes == held
        # the slot freed once the wait is longer than the body deadline (0.3 s)
        await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
        t.release.set()
        answer = await read_answer(r)
        waited = time.monotonic() - started
        w.close()
        assert (await holder).status == 204
        # served once the slot freed; the wait (longer than the body deadline) is not
        # counted against the body
        assert answer.status == 204 and waited > 0.3
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 0
    assert len(up.received) == 2


async def test_a_request_that_waits_past_the_bound_gets_503_and_keeps_its_connection(
        tmp_path: Path) -> None:
    async with slot_taken(tmp_path, wait=0.3) as t:
        p = t.proxy
        r, w = await connect(p)
        started = time.monotonic()
        w.write(request())
        busy = await read_answer(r)
        waited = time.monotonic() - started
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        assert 0.25 < waited < 5.0 and "connection" not in busy.headers  # 0.3 s, not for ever
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 1
        assert (await t.freed()).status == 204
        w.write(request())  # the same connection, its refused body skipped
        assert (await read_answer(r)).status == 204
        w.close()


async def test_waiters_beyond_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    async with slot_taken(tmp_path, wait=30.0) as t:
        p = t.proxy
        waiters = []
        for n in range(1, WAITERS_PER_SLOT + 1):
            waiters.append(asyncio.create_task(post(p)))
            await waiting(p, n)
        started = time.monotonic()
        extra = await post(p)  # one slot: every place in line taken
        assert extra.status == 503 and extra.headers["retry-after"] == "1"
        assert time.monotonic() - started < 5.0  # at once, not after the 30 s wait
        assert (await t.freed()).status == 204
        assert [(await w).status for w in waiters] == [204] * WAITERS_PER_SLOT
        assert p.handler.slots.waiting == 0 and p.handler.slots.requests == 0


async def test_a_waiter_whose_sender_leaves_gives_up_its_place(tmp_path: Path) -> None:
    async with slot_taken(tmp_path, wait=30.0) as t:
        p, up = t.proxy, t.upstream
        _, w = await connect(p)
        w.write(request())
        await waiting(p)
        w.close()
        await waiting(p, 0)  # noticed while the connection reads nothing
        late = asyncio.create_task(post(p))
        await waiting(p)
        assert (await t.freed()).status == 204
        assert (await late).status == 204  # waited, then served
    assert len(up.received) == 2  # the one that left was never forwarded


async def test_stopping_with_a_waiter_does_not_hang(tmp_path: Path) -> None:
    release = asyncio.Event()  # the holder's answer: once the stop has begun
    async with ScriptedUpstream(Reply(204, gate=release), Reply(204)) as up:
        p = await start_proxy(tmp_path, up, max_concurrent_requests=1,
                              admission_wait_seconds=20.0)
        stopped = False
        try:
            holder = await holding_the_slot(p)
            waiter = asyncio.create_task(post(p))
            await waiting(p)
            started = time.monotonic()
            stopping = asyncio.create_task(p.stop())
            await asyncio.sleep(0.1)
            release.set()
            await asyncio.wait_for(stopping, 5.0)
            stopped = True
            assert time.monotonic() - started < 3.0
            assert (await holder).status == 204
            assert (await asyncio.wait_for(waiter, 5.0)).status in (204, 503)
        finally:
            release.set()
            if not stopped:
                await p.stop()


async def test_slots_go_to_waiters_in_arrival_order_and_a_cancelled_one_passes_it_on(
        ) -> None:
    slots = Slots(1, 3, 5.0)
    assert slots.try_enter()
    order: list[str] = []

    async def wait(name: str) -> None:
        assert await slots.enter() is Outcome.ADMITTED
        order.append(name)

    tasks = {n: asyncio.create_task(wait(n)) for n in "abc"}
    await asyncio.sleep(0)
    assert slots.waiting == 3 and not slots.may_wait()
    assert not slots.try_enter()
    slots.leave()  # to a, whose task is cancelled before it runs: on to b
    tasks["a"].cancel()
    await asyncio.sleep(0.01)
    assert order == ["b"] and slots.requests == 1
    slots.leave()
    await asyncio.sleep(0.01)
    assert order == ["b", "c"]
    slots.leave()
    assert slots.requests == 0 and slots.waiting == 0
    assert await Slots(1, 1, 0.05).enter() is Outcome.ADMITTED
    full = Slots(1, 1, 0.05)
    full.try_enter()
    assert await full.enter() is Outcome.REFUSED and full.waiting == 0
    promised = Slots(1, 1, 5.0)
    promised.try_enter()
    promised.promise()  # the one place, promised on the headers: nobody else may wait
    assert not promised.may_wait() and await promised.enter() is Outcome.REFUSED
    waits = asyncio.create_task(promised.enter(promised=True))
    await asyncio.sleep(0)
    assert promised.waiting == 1 and promised.promised == 0
    promised.leave()
    assert await waits is Outcome.ADMITTED
    no_wait = Slots(1, 1, 0.0)
    no_wait.try_enter()
    assert not no_wait.may_wait() and await no_wait.enter() is Outcome.REFUSED


# -- what aiohttp would refuse or report on its own -------------------------------------


async def test_a_sender_gone_mid_body_is_counted_and_logged_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up) as p:
        for chunked in (False, True):
            _, w = await connect(p)
            if chunked:
                w.write((HEAD + "Transfer-Encoding: chunked\r\n\r\n10\r\n").encode() + b"x" * 8)
            else:
                w.write((HEAD + "Content-Length: 1000\r\n\r\n").encode() + b"ab")
            await w.drain()
            await asyncio.sleep(0.1)
            w.close()
        for _ in range(100):
            if metric(p, "karta_proxy_requests_rejected_total", reason="client_closed") == 2:
                break
            await asyncio.sleep(0.02)
        assert metric(p, "karta_proxy_requests_rejected_total", reason="client_closed") == 2
        assert metric(p, "karta_proxy_requests_total", path="/api/v1/write", protocol="v1",
                      code="499") == 2
        assert metric(p, "karta_proxy_inflight_requests") == 0
        assert (await post(p)).status == 204
    refused = [r for r in caplog.records if getattr(r, "kind", "") == "client_closed"]
    assert len(refused) == 2 and all(r.levelname == "INFO" for r in refused)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert len(up.received) == 1


async def test_an_unsupported_expectation_is_417_counted_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up) as p:
        r, w = await connect(p)
        w.write(request(extra="Expect: foo\r\n"))
        answer = await read_answer(r)
        w.close()
        assert answer.status == 417, answer
        assert metric(p, "karta_proxy_requests_rejected_total", reason="expectation") == 1
        assert metric(p, "karta_proxy_requests_total", path="/api/v1/write",
                      protocol="unknown", code="417") == 1
    assert [r.levelname for r in caplog.records if getattr(r, "kind", "") == "expectation"] \
        == ["WARNING"]
