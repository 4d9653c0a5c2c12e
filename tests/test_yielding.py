"""proxy.yielding: how background work on the event loop pauses for relayed requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from proxy import yielding
from proxy.yielding import MIN_SECONDS_PER_BYTE, Pacer, Slices, ThreadPacer
from tests.loop_turns import LoopTurns


async def _turns_during(coro: Awaitable[None]) -> int:
    """How many turns the event loop made while ``coro`` (awaited) ran."""
    async with LoopTurns() as loop:
        await coro
    return loop.turns


async def test_with_nothing_relayed_a_pause_is_turns_not_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a pause of real time made long, so that "not time" does not hang on how fast a
    # loaded machine makes six turns (under 1 ms was asked, and a preemption broke it)
    monkeypatch.setattr(yielding, "PAUSE_SECONDS", 30.0)
    pacer = Pacer(lambda: False, budget=10.0)
    started = time.monotonic()
    turns = await asyncio.wait_for(_turns_during(pacer.pause()), 10.0)
    assert time.monotonic() - started < 10.0
    assert turns >= yielding.ARRIVAL_TURNS - 1


async def test_while_a_request_is_relayed_a_pause_waits_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    relaying = True
    pacer = Pacer(lambda: relaying, budget=10.0)
    task = asyncio.create_task(pacer.pause())
    await asyncio.sleep(0.05)
    assert not task.done()
    relaying = False
    await asyncio.wait_for(task, 10.0)


async def test_a_pause_waits_at_most_so_long_and_the_work_at_most_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 0.02)
    pacer = Pacer(lambda: True, budget=0.1)
    started = time.monotonic()
    await asyncio.wait_for(pacer.pause(), 10.0)  # always busy: one pause, <= 20 ms
    # (the upper bounds tell a bounded wait from 30 s, with room for a loaded machine)
    assert 0.015 <= time.monotonic() - started < 5.0
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    started = time.monotonic()
    await asyncio.wait_for(pacer.pause(), 10.0)  # the rest of the budget, not 30 s
    await asyncio.wait_for(pacer.pause(), 10.0)  # past it: PAUSE_SECONDS
    assert time.monotonic() - started < 5.0


async def test_without_busy_a_pause_is_real_time() -> None:
    pacer = Pacer(None, budget=10.0)
    started = time.monotonic()
    await pacer.pause()
    assert time.monotonic() - started >= yielding.PAUSE_SECONDS * 0.9


# -- ThreadPacer: the same for work in a worker thread ---------------------------------------


def test_a_thread_pacer_pauses_once_per_stretch_not_per_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked = 0

    def busy() -> bool:
        nonlocal asked
        asked += 1
        return False

    pace = ThreadPacer(busy, budget=10.0)
    started = time.perf_counter()
    calls = 0
    # until 20 pauses, not for 50 ms: a loaded machine that takes the CPU away for most
    # of a fixed window leaves few stretches in it (10 were seen in 50 ms)
    while asked < 20 and time.perf_counter() - started < 30:
        pace()
        calls += 1
    elapsed = time.perf_counter() - started
    # a pause per THREAD_STRETCH_SECONDS of work (0.5 ms), never sooner; not per call
    assert asked == 20
    assert asked <= elapsed / yielding.THREAD_STRETCH_SECONDS + 1, (asked, elapsed)
    assert calls > 10 * asked


async def test_a_thread_pacer_gives_the_loop_its_turns_and_waits_for_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pure Python in a thread holds the GIL for the switch interval (5 ms) at a time;
    paced, it lets the loop take it every stretch, and stands still while a request is
    being relayed."""
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    relaying = False
    progress = 0
    #: pauses that found a request being relayed (and so wait for it)
    held = 0

    def busy() -> bool:
        nonlocal held
        held += relaying
        return relaying

    def work(seconds: float) -> None:
        nonlocal progress
        pace = ThreadPacer(busy, budget=10.0)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            progress += 1
            pace()

    loop = asyncio.get_running_loop()
    wakes = 0
    done = False

    async def ticker() -> None:  # sleeps 1 ms a time: then needs the GIL back
        nonlocal wakes
        while not done:
            await asyncio.sleep(0.001)
            wakes += 1

    def unpaced(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    async def wakes_during(job: Callable[[float], None]) -> int:
        nonlocal wakes, done
        wakes, done = 0, False
        task = loop.create_task(ticker())
        await asyncio.to_thread(job, 0.2)
        done = True
        await task
        return wakes

    # unpaced, each wake-up waited the switch interval: ~32 in 0.2 s; paced ~165. Both
    # measured here, side by side, a few times: how many a loaded machine allows in 0.2 s
    # is not the test's to know (64 were seen paced), only that pacing gives the loop
    # several times more
    seen = []
    for _ in range(5):
        seen.append((await wakes_during(unpaced), await wakes_during(work)))
        if seen[-1][1] >= 2 * seen[-1][0] + 5:
            break
    else:
        raise AssertionError(f"(unpaced, paced) wake-ups in 0.2 s: {seen}")
    relaying = True
    working = asyncio.create_task(asyncio.to_thread(work, 0.2))
    # the thread at its first pause, waiting: a fixed 0.05 s was no promise that a thread
    # of a loaded box had started and run its first stretch by then (waited for)
    deadline = time.monotonic() + 5.0
    while not held:
        assert time.monotonic() < deadline, "the paced thread never paused for the request"
        await asyncio.sleep(0.01)
    stood = progress
    await asyncio.sleep(0.1)
    assert progress - stood < 1000  # a pause's wait: no work while relaying
    relaying = False
    await asyncio.wait_for(working, 5.0)


def test_a_thread_pacer_waits_at_most_so_long_and_at_most_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 0.02)
    pace = ThreadPacer(lambda: True, budget=0.1)
    started = time.monotonic()
    pace.pause()  # always busy: one pause, <= 20 ms
    # (the upper bounds tell a bounded wait from 30 s, with room for a loaded machine)
    assert 0.015 <= time.monotonic() - started < 5.0
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    started = time.monotonic()
    pace.pause()  # the rest of the budget, not 30 s
    pace.pause()  # past it: no wait
    assert time.monotonic() - started < 5.0
    started = time.monotonic()
    ThreadPacer(None, budget=10.0).pause()  # nothing to ask: no wait (30 s the bound)
    assert time.monotonic() - started < 5.0


def test_a_run_shrinks_at_once_and_grows_at_most_twofold() -> None:
    s = Slices(0.004, most=4096)
    s.size = 1000
    s.adapt(1000, 0.04)  # 10x over budget
    assert s.size == 100
    s.adapt(100, 0.0001)  # far under budget: at most doubled
    assert s.size == 200
    s.adapt(200, 0.0)  # unmeasurably fast
    assert s.size == 400
    for _ in range(20):
        s.adapt(s.size, 0.0)
    assert s.size == 4096
    s.adapt(10, 10.0)
    assert s.size == 1  # never zero


def test_runs_cover_every_item_once_in_order_and_follow_the_cost() -> None:
    now = 0.0
    s = Slices(0.25, first=4, clock=lambda: now)
    done: list[int] = []
    sizes: list[int] = []

    def step(i: int, j: int) -> None:
        nonlocal now
        sizes.append(j - i)
        done.extend(range(i, j))
        now += (j - i) / 64  # 16 items fit the budget (binary fractions: exact)

    yields = sum(1 for _ in s.run(300, step))
    assert done == list(range(300))
    assert yields == len(sizes)
    assert sizes[:3] == [4, 8, 16]  # cheap: at most doubled, then what fits
    assert set(sizes[2:-1]) == {16}
    assert list(s.run(0, step)) == []


def test_weighed_runs_end_where_their_bytes_would_pass_the_budget() -> None:
    """Items weighed by their bytes: a run ends before the item that would take it past
    what the budget buys at the last run's cost per byte (one item at least), whatever
    the count-sized run would hold; cheap bytes never count below the floor."""
    now = 0.0
    s = Slices(0.004, most=4096, clock=lambda: now)
    s.size = 4096  # grown on cheap items
    sizes = [1_000, 1_000, 1_700_000, 1_700_000, 1_700_000, 1_000]
    runs: list[tuple[int, int]] = []

    def step(i: int, j: int) -> None:
        nonlocal now
        runs.append((i, j))
        now += sum(sizes[i:j]) * 100e-9  # 100 ns a byte: 170 ms a heavy item

    assert sum(1 for _ in s.run(len(sizes), step, lambda k: sizes[k])) == len(runs)
    # at the floor (2 ns a byte) 4 ms buys 2 MB: the first heavy one fits beside the
    # small ones, then the cost measured (100 ns a byte) buys 40 KB: one item a run
    assert runs == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert s.per_byte == pytest.approx(100e-9)
    for _ in s.run(2, lambda i, j: None, lambda k: 1_000_000):
        pass
    assert s.per_byte == MIN_SECONDS_PER_BYTE  # no time at all: the floor


def test_what_is_left_of_a_budget_goes_down_to_zero() -> None:
    pacer = ThreadPacer(lambda: True, budget=0.05)
    assert 0.0 < pacer.remaining() <= 0.05
    time.sleep(0.06)
    assert pacer.remaining() == 0.0
