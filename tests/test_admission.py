"""Admission against hostile or broken senders, over raw loopback sockets: stalled bodies
(chunked or with a declared length), slow headers, ``Expect: 100-continue``, refusals that
never read the body. Every wait is bounded; the deadlines are made short through the
settings so each test takes a second or two."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
import time
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import snappy

from proxy.admission import Outcome, Slots
from proxy.connection_guard import DRAIN_MAX_BYTES, LINGER_SECONDS
from proxy.handler import WAITERS_PER_SLOT
from proxy.runtime import Proxy
from tests.proxy_harness import CT_V1, proxy_running, series_v1, start_proxy
from tests.scripted import Reply, ScriptedUpstream

HEAD = ("POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {CT_V1}\r\nContent-Encoding: snappy\r\n")
BODY = snappy.compress(series_v1({"__name__": "up", "job": "a"}))


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    #: bytes seen before the final status line (a ``100 Continue``)
    interim: bytes
    #: the proxy closed the connection after the answer
    closed: bool


async def read_answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> Answer:
    async with asyncio.timeout(timeout):
        interim = b""
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 1"):
                interim += head
                continue
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        closed = False
        if headers.get("connection", "").lower() == "close":
            try:
                async with asyncio.timeout(2.0):
                    closed = await reader.read(1) == b""
            except (TimeoutError, ConnectionError):
                closed = False
    return Answer(status, headers, body, interim, closed)


async def connect(p: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def post(p: Proxy, body: bytes = BODY) -> Answer:
    r, w = await connect(p)
    try:
        w.write((HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        return await read_answer(r)
    finally:
        w.close()


def metric(p: Proxy, name: str, **labels: str) -> float:
    return p.metrics.registry.get_sample_value(name, labels) or 0.0


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
        await asyncio.sleep(0.3)
        assert metric(p, "karta_proxy_inflight_requests") == 4
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
        await asyncio.sleep(0.2)
        busy = await post(p)
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        # due: 1 s of grace + 3 bytes / 1000 bytes/s after the body's start
        answers = [await read_answer(r, timeout=4.0) for r, _ in stalled]
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


async def test_slow_headers_get_408_and_the_connection_closed(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, header_read_timeout_seconds=0.5) as p,
    ):
        r1, w1 = await connect(p)  # half a request, then nothing
        w1.write(b"POST /api/v1/write HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ")
        r2, w2 = await connect(p)  # connected, never a byte
        t0 = time.monotonic()
        a1, a2 = await read_answer(r1), await read_answer(r2)
        waited = time.monotonic() - t0
        w1.close()
        w2.close()
        assert (a1.status, a2.status) == (408, 408)
        assert a1.closed and a2.closed
        assert 0.4 < waited < 2.0
        assert metric(p, "karta_proxy_requests_rejected_total", reason="header_timeout") == 2


async def test_idle_keep_alive_and_slow_bodies_are_not_header_timeouts(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, header_read_timeout_seconds=0.4,
                      min_body_bytes_per_second=1) as p,
    ):
        r, w = await connect(p)
        one = (HEAD + f"Content-Length: {len(BODY)}\r\n\r\n").encode()
        w.write(one + BODY)
        assert (await read_answer(r)).status == 204
        await asyncio.sleep(0.7)  # idle between requests: keepalive_timeout's, not ours
        w.write(one + BODY[:3])
        await asyncio.sleep(0.7)  # a body slower than the header deadline
        w.write(BODY[3:])
        a = await read_answer(r)
        w.close()
        assert a.status == 204, a
        assert metric(p, "karta_proxy_requests_rejected_total", reason="header_timeout") == 0
    assert len(up.received) == 2


async def test_no_100_continue_for_a_request_that_is_refused(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=1.0)) as up,
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
        ok = await read_answer(r)
        w.close()
        assert ok.status == 204

        r, w = await connect(p)
        w.write((HEAD + "Expect: something-else\r\nContent-Length: 3\r\n\r\n").encode())
        odd = await read_answer(r)
        w.close()
        assert odd.status == 417
    assert len(up.received) == 1


async def test_a_refusal_closes_the_connection_instead_of_reading_a_big_body(
        tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=1.0)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=0.0) as p,
    ):
        holder = asyncio.create_task(post(p))
        await asyncio.sleep(0.3)
        r, w = await connect(p)
        # headers and a sliver of a body too big to skip: refused on the headers alone
        w.write((HEAD + f"Content-Length: {DRAIN_MAX_BYTES + 1}\r\n\r\n").encode()
                + b"x" * 100)
        t0 = time.monotonic()
        busy = await read_answer(r)
        w.close()
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        assert busy.headers["connection"].lower() == "close" and busy.closed
        # answered at once and closed after LINGER_SECONDS, never waiting for the body
        assert time.monotonic() - t0 < LINGER_SECONDS + 0.8
        assert (await holder).status == 204


async def test_overload_is_shed_on_the_headers_and_counted(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=1.0)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=0.0) as p,
    ):
        holder = asyncio.create_task(post(p))
        await asyncio.sleep(0.3)
        answers = await asyncio.gather(*(post(p) for _ in range(5)))
        assert all(a.status == 503 and a.headers["retry-after"] == "1"
                   and "connection" not in a.headers
                   and a.body == b"overloaded: too many requests in flight\n"
                   for a in answers), answers
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 5
        assert metric(p, "karta_proxy_requests_total", path="/api/v1/write",
                      protocol="v1", code="503") == 5
        # a tenant's path is counted under its route, as a handled request is
        r, w = await connect(p)
        w.write(request().replace(b"/api/v1/write", b"/insert/42/prometheus", 1))
        assert (await read_answer(r)).status == 503
        w.close()
        assert metric(p, "karta_proxy_requests_total", path="/insert/{tenant}/prometheus",
                      protocol="v1", code="503") == 1
        assert (await holder).status == 204
        assert (await post(p)).status == 204  # the slot is free again: handled as usual
    assert len(up.received) == 2


def request(body: bytes = BODY, extra: str = "") -> bytes:
    return (HEAD + extra + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def holding_the_slot(p: Proxy) -> asyncio.Task[Answer]:
    """A request that holds the one slot for the upstream's first (1 s) answer."""
    holder = asyncio.create_task(post(p))
    for _ in range(50):
        await asyncio.sleep(0.02)
        if metric(p, "karta_proxy_inflight_requests") == 1:
            return holder
    raise AssertionError("the holder never got the slot")


async def test_a_refused_connection_stays_open_and_serves_the_next_request(
        tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=1.0), Reply(204)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=0.0) as p,
    ):
        holder = await holding_the_slot(p)
        held = metric(p, "karta_proxy_inflight_bytes")  # the holder's own
        r, w = await connect(p)
        for _ in range(3):  # refused, and the body skipped, on the same connection
            w.write(request())
            busy = await read_answer(r)
            assert busy.status == 503 and busy.headers["retry-after"] == "1", busy
            assert "connection" not in busy.headers
        assert metric(p, "karta_proxy_inflight_bytes") == held
        assert (await holder).status == 204
        w.write(request())  # the slot is free: the same connection is served as usual
        ok = await read_answer(r)
        w.close()
        assert ok.status == 204, ok
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 3
    assert [rec.raw for rec in up.received][1:] == [snappy.uncompress(BODY)]


async def test_pipelined_refusals_skip_their_bodies_without_desyncing(tmp_path: Path) -> None:
    # a refused body that holds a whole request: skipped as body bytes, never parsed
    inner = request(BODY)
    async with (
        ScriptedUpstream(Reply(204, delay=1.0), Reply(204)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=0.0) as p,
    ):
        holder = await holding_the_slot(p)
        r, w = await connect(p)
        w.write(request(inner) + request() + request(b""))
        busy = [await read_answer(r) for _ in range(3)]
        assert [a.status for a in busy] == [503] * 3, busy
        # a body that arrives in pieces, with the next request behind its last piece
        w.write(request(inner)[:200])
        assert (await read_answer(r)).status == 503
        w.write(request(inner)[200:-7])
        await asyncio.sleep(0.1)
        w.write(request(inner)[-7:] + request()[:50])
        assert (await holder).status == 204
        w.write(request()[50:])  # finishes the request whose head came with the body's end
        ok = await read_answer(r)
        w.close()
        assert ok.status == 204, ok
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 4
    assert len(up.received) == 2 and up.received[1].raw == snappy.uncompress(BODY)


async def test_a_refused_body_that_stalls_is_closed(tmp_path: Path) -> None:
    async with (
        ScriptedUpstream(Reply(204, delay=2.0)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=0.0,
                      header_read_timeout_seconds=0.5) as p,
    ):
        holder = await holding_the_slot(p)
        held = metric(p, "karta_proxy_inflight_bytes")
        r, w = await connect(p)
        w.write(request(b"x" * 1000)[:-900])  # the headers and 100 of 1000 bytes
        t0 = time.monotonic()
        busy = await read_answer(r)
        assert busy.status == 503 and "connection" not in busy.headers
        async with asyncio.timeout(3):
            end = await r.read(1)  # closed once the rest is overdue
        waited = time.monotonic() - t0
        w.close()
        assert end == b"" and 0.4 < waited < 1.5, (end, waited)
        assert metric(p, "karta_proxy_inflight_bytes") == held
        assert (await holder).status == 204


async def test_refusals_that_cannot_be_skipped_close_the_connection(tmp_path: Path) -> None:
    # chunked (no length to skip), Expect (the sender may never send the body), the
    # sender's own Connection: close, HTTP/1.0 (closes by default)
    heads = [
        HEAD + "Transfer-Encoding: chunked\r\n\r\n10\r\n" + "x" * 16 + "\r\n",
        HEAD + f"Expect: 100-continue\r\nContent-Length: {len(BODY)}\r\n\r\n",
        HEAD + f"Connection: close\r\nContent-Length: {len(BODY)}\r\n\r\n",
        HEAD.replace("HTTP/1.1", "HTTP/1.0") + f"Content-Length: {len(BODY)}\r\n\r\n",
    ]
    async with slot_taken(tmp_path, delay=1.0, wait=0.0) as t:
        p, holder = t.proxy, t.holder
        for head in heads:
            r, w = await connect(p)
            w.write(head.encode())
            busy = await read_answer(r)
            w.close()
            assert busy.status == 503 and busy.interim == b"", (head, busy)
            assert busy.headers["connection"].lower() == "close" and busy.closed, head
        assert (await holder).status == 204


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
    for _ in range(100):
        if p.handler.slots.waiting == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{p.handler.slots.waiting} waiting, expected {n}")


@dataclass
class SlotTaken:
    """A proxy with one slot, held by ``holder`` for the upstream's ``delay``."""

    proxy: Proxy
    upstream: ScriptedUpstream
    holder: asyncio.Task[Answer]


@contextlib.asynccontextmanager
async def slot_taken(tmp_path: Path, *, delay: float, wait: float, **server: Any
                     ) -> AsyncIterator[SlotTaken]:
    async with (
        ScriptedUpstream(Reply(204, delay=delay)) as up,
        proxy_running(tmp_path, up, max_concurrent_requests=1, admission_wait_seconds=wait,
                      **server) as p,
    ):
        yield SlotTaken(p, up, await holding_the_slot(p))


async def test_a_request_finding_the_slots_full_waits_with_its_body_unread_and_is_served(
        tmp_path: Path) -> None:
    async with slot_taken(tmp_path, delay=0.6, wait=3.0, body_read_timeout_seconds=0.3) as t:
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
    async with slot_taken(tmp_path, delay=1.5, wait=0.3) as t:
        p, holder = t.proxy, t.holder
        r, w = await connect(p)
        started = time.monotonic()
        w.write(request())
        busy = await read_answer(r)
        waited = time.monotonic() - started
        assert busy.status == 503 and busy.headers["retry-after"] == "1"
        assert 0.25 < waited < 1.2 and "connection" not in busy.headers
        assert metric(p, "karta_proxy_requests_rejected_total", reason="overload") == 1
        assert (await holder).status == 204
        w.write(request())  # the same connection, its refused body skipped
        assert (await read_answer(r)).status == 204
        w.close()


async def test_waiters_beyond_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    async with slot_taken(tmp_path, delay=0.8, wait=5.0) as t:
        p, holder = t.proxy, t.holder
        waiters = []
        for n in range(1, WAITERS_PER_SLOT + 1):
            waiters.append(asyncio.create_task(post(p)))
            await waiting(p, n)
        started = time.monotonic()
        extra = await post(p)  # one slot: every place in line taken
        assert extra.status == 503 and extra.headers["retry-after"] == "1"
        assert time.monotonic() - started < 0.3
        assert (await holder).status == 204
        assert [(await w).status for w in waiters] == [204] * WAITERS_PER_SLOT
        assert p.handler.slots.waiting == 0 and p.handler.slots.requests == 0


async def test_a_waiter_whose_sender_leaves_gives_up_its_place(tmp_path: Path) -> None:
    async with slot_taken(tmp_path, delay=1.0, wait=5.0) as t:
        p, up, holder = t.proxy, t.upstream, t.holder
        _, w = await connect(p)
        w.write(request())
        await waiting(p)
        w.close()
        await waiting(p, 0)  # noticed while the connection reads nothing
        assert (await post(p)).status == 204  # waited, then served
        assert (await holder).status == 204
    assert len(up.received) == 2  # the one that left was never forwarded


async def test_stopping_with_a_waiter_does_not_hang(tmp_path: Path) -> None:
    async with ScriptedUpstream(Reply(204, delay=0.5)) as up:
        p = await start_proxy(tmp_path, up, max_concurrent_requests=1,
                              admission_wait_seconds=20.0)
        stopped = False
        try:
            holder = await holding_the_slot(p)
            waiter = asyncio.create_task(post(p))
            await waiting(p)
            started = time.monotonic()
            await asyncio.wait_for(p.stop(), 5.0)
            stopped = True
            assert time.monotonic() - started < 3.0
            assert (await holder).status == 204
            assert (await asyncio.wait_for(waiter, 5.0)).status in (204, 503)
        finally:
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


@pytest.mark.parametrize("head", [
    b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
    b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /api/v1/write HTTP/1.1\r\nHo\x00st: x\r\nContent-Length: 0\r\n\r\n",
])
async def test_a_malformed_request_is_400_counted_and_logged_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, head: bytes) -> None:
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up) as p:
        r, w = await connect(p)
        w.write(head)
        answer = await read_answer(r)
        assert answer.status == 400, answer
        async with asyncio.timeout(5):
            assert await r.read() == b""  # and the connection closed
        w.close()
        assert metric(p, "karta_proxy_requests_rejected_total", reason="bad_http") == 1
        assert (await post(p)).status == 204
    refused = [r for r in caplog.records if getattr(r, "kind", "") == "bad_http"]
    assert len(refused) == 1 and refused[0].levelname == "WARNING"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


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


async def test_header_timeouts_by_the_hundred_are_all_counted_and_logged_in_two_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # idle connections (a slowloris, a fleet's stale pool) time out together: 3,000 made
    # 3,000 warning lines; now the first at once and the rest of the interval in a summary
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, header_read_timeout_seconds=0.3) as p,
    ):
        conns = [await connect(p) for _ in range(40)]
        answers = [await read_answer(r) for r, _ in conns]
        for _, w in conns:
            w.close()
        assert {a.status for a in answers} == {408}
        assert metric(p, "karta_proxy_requests_rejected_total", reason="header_timeout") == 40
    # the stop writes the summary that waits for the end of its interval
    first = [r for r in caplog.records if r.getMessage() == "request refused"
             and getattr(r, "kind", "") == "header_timeout"]
    summary = [r for r in caplog.records if r.getMessage() == "requests refused"]
    assert len(first) == 1 and len(summary) == 1, caplog.text
    assert summary[0].__dict__["count"] == 39 and summary[0].__dict__["peers"] == "127.0.0.1"
    assert summary[0].__dict__["kind"] == "header_timeout"


# -- connections and header bytes ----------------------------------------------------------


async def until(check: Any, what: str) -> None:
    """Wait (a bounded number of loop turns) until ``check()`` holds: the proxy counts a
    connection when its accept has run, after the client's connect returned."""
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def closed_unanswered(r: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(5):
            return await r.read() == b""
    except ConnectionError:  # closed with unread bytes in the proxy's buffer: a reset
        return True
    except TimeoutError:
        return False


async def test_connections_past_the_limit_are_closed_at_once_counted_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # nothing limited them: 400 connections holding unfinished headers held 750 MiB
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up, max_connections=3) as p:
        conns = [await connect(p) for _ in range(3)]
        await until(lambda: metric(p, "karta_proxy_open_connections") == 3, "3 open")
        extra = [await connect(p) for _ in range(2)]
        for r, w in extra:
            assert await closed_unanswered(r)
            w.close()
        assert metric(p, "karta_proxy_connections_refused_total", reason="max_connections") == 2
        for r, w in conns:  # the first three are served as ever
            w.write(request())
            assert (await read_answer(r)).status == 204
        conns[0][1].close()
        await until(lambda: metric(p, "karta_proxy_open_connections") == 2, "one closed")
        assert (await post(p)).status == 204  # its place is free again
        for _, w in conns[1:]:
            w.close()
    lines = [r for r in caplog.records if r.getMessage().startswith("connection")]
    assert [r.getMessage() for r in lines] == ["connection refused", "connections refused"]
    assert lines[0].__dict__["reason"] == "max_connections" and lines[1].__dict__["count"] == 1


@pytest.mark.parametrize("head", [
    # the total past max_header_bytes (4096) in lines aiohttp takes one by one
    HEAD + "".join(f"X-Pad-{i}: {'a' * 1000}\r\n" for i in range(5)),
    # a line past aiohttp's per-line limit (8190), then the count past 64
    HEAD + f"X-Pad: {'a' * 9000}\r\n",
    HEAD + "".join(f"X-{i}: a\r\n" for i in range(70)) + "Content-Length: 0\r\n\r\n",
], ids=["total", "line", "count"])
async def test_headers_past_the_limit_get_431_counted_and_the_connection_closed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, head: str) -> None:
    async with (
        ScriptedUpstream() as up,
        proxy_running(tmp_path, up, max_header_bytes=4096 if "X-Pad-" in head else 16384) as p,
    ):
        r, w = await connect(p)
        w.write(head.encode())  # never ended, but for the count's case
        answer = await read_answer(r)
        w.close()
        assert answer.status == 431 and answer.closed, answer
        assert metric(p, "karta_proxy_requests_rejected_total", reason="header_too_large") == 1
        assert metric(p, "karta_proxy_requests_rejected_total", reason="bad_http") == 0
        assert (await post(p)).status == 204
    assert [r.levelname for r in caplog.records
            if getattr(r, "kind", "") == "header_too_large"] == ["WARNING"]


async def test_headers_past_the_limit_in_one_read_get_431(tmp_path: Path) -> None:
    """20 KiB of headers in one write (a body behind them) were taken: the count ran only
    over reads that left the headers unfinished, and this one finished them."""
    pad = "".join(f"X-Pad-{i}: {'a' * 1000}\r\n" for i in range(20))
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up) as p:
        assert p.settings.server.max_header_bytes == 16384
        r, w = await connect(p)
        w.write(request(extra=pad))
        answer = await read_answer(r)
        w.close()
        assert answer.status == 431 and answer.closed, answer
        assert metric(p, "karta_proxy_requests_rejected_total", reason="header_too_large") == 1
        assert up.received == []
        assert (await post(p)).status == 204


@pytest.mark.parametrize(("over", "status"), [(0, 204), (1, 431)])
async def test_headers_whose_blank_line_spans_two_reads_are_measured(
        tmp_path: Path, over: int, status: int) -> None:
    """The first read ends in CR LF CR, the next begins with the LF that ends the headers
    and goes on with the body: headers of the limit's size are taken, one byte more is a
    431 (the first read alone stayed within the limit)."""
    limit = 4096
    prefix = (HEAD + f"Content-Length: {len(BODY)}\r\nX-Pad: ").encode()
    suffix = b"\r\n\r"
    first = prefix + b"a" * (limit - 1 + over - len(prefix) - len(suffix)) + suffix
    assert len(first) + 1 == limit + over
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up, max_header_bytes=limit) as p:
        r, w = await connect(p)
        w.write(first)
        await w.drain()
        await asyncio.sleep(0.2)  # two reads
        w.write(b"\n" + BODY)
        answer = await read_answer(r)
        w.close()
        assert answer.status == status, answer


async def test_headers_up_to_the_limit_are_taken(tmp_path: Path) -> None:
    pad = "".join(f"X-Pad-{i}: {'a' * 1000}\r\n" for i in range(3))
    async with ScriptedUpstream() as up, proxy_running(tmp_path, up, max_header_bytes=4096) as p:
        r, w = await connect(p)
        w.write(request(extra=pad))
        assert (await read_answer(r)).status == 204
        w.close()


async def test_unfinished_headers_hold_at_most_the_limit_per_connection(tmp_path: Path) -> None:
    """What connections that never end their headers hold, measured: each sent 128 KiB of
    them (16 lines of 8 KiB, within aiohttp's own limits), which aiohttp kept until the
    header deadline; the ones within ``max_connections`` are answered 431 and dropped as
    soon as they pass ``max_header_bytes``, the others are never read."""
    n, sent = 16, 128 * 1024
    line = f"X-Pad: {'a' * 8000}\r\n".encode()
    tracemalloc.start()
    try:
        async with (
            ScriptedUpstream() as up,
            proxy_running(tmp_path, up, max_connections=n // 2) as p,
        ):
            conns = [await connect(p) for _ in range(n)]
            before = tracemalloc.take_snapshot()
            for _, w in conns:
                w.write(HEAD.encode() + line * (sent // len(line)))
            # a 431 and a close, or a close; what is unanswered after 2 s (well within the
            # header deadline) is measured as held
            await asyncio.wait([asyncio.create_task(closed_unanswered(r)) for r, _ in conns],
                               timeout=2)
            held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(
                before, "filename") if "aiohttp" in s.traceback[0].filename
                or "connection_guard" in s.traceback[0].filename)
            for _, w in conns:
                w.close()
            # before the limits: n x 128 KiB (2 MiB) and more; now none of it stays
            assert held < n * 16 * 1024, held
            assert metric(p, "karta_proxy_connections_refused_total",
                          reason="max_connections") == n // 2
            assert metric(p, "karta_proxy_requests_rejected_total",
                          reason="header_too_large") == n // 2
    finally:
        tracemalloc.stop()
