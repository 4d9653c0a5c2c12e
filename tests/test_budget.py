"""The byte budget (proxy.budget) on its own: what fits, what a request holds, and how a
splice's room grows. The handler's use of it (503s, what a request holds until its
answer) is tested through requests in tests/test_handler.py and tests/test_admission.py."""

from __future__ import annotations

import threading

from prometheus_client import Counter

from proxy.budget import Held, LoadBudget, Room


def _grown() -> Counter:
    return Counter("splices_grown", "splices that took more", registry=None)


def _count(counter: Counter) -> float:
    """A counter's value, as a scrape reads it."""
    return next(s.value for m in counter.collect() for s in m.samples
                if s.name.endswith("_total"))


def test_what_fits_is_the_budget_or_a_request_alone() -> None:
    budget = LoadBudget(100)
    other, mine = Held(budget), Held(budget)
    assert other.take(60)
    assert budget.fits(40, 0) and not budget.fits(41, 0)
    assert not mine.take(41)
    assert budget.bytes == 60 and mine.bytes == 0  # a refusal takes nothing
    other.give_back(60)
    # alone in flight, a request may hold past the budget: refused there, its data
    # would never be stored
    assert mine.take(150) and mine.take(50)
    assert budget.bytes == 200
    assert not other.take(1)  # and every other request is refused meanwhile


def test_a_request_settles_on_what_it_holds_then_releases_it() -> None:
    budget = LoadBudget(100)
    held, other = Held(budget), Held(budget)
    assert held.take(80)
    held.settle(10)  # spliced: its outgoing body only
    assert budget.bytes == held.bytes == 10
    assert other.take(80)
    held.settle(50)  # more is taken even past the budget: the work is done
    assert budget.bytes == 130 and held.bytes == 50
    assert not Held(budget).take(1)
    budget.release(held.bytes)
    budget.release(other.bytes)
    assert budget.bytes == 0


def test_a_room_grows_a_quarter_past_the_splices_estimate() -> None:
    budget = LoadBudget(1000)
    held = Held(budget)
    assert held.take(100)
    grown = _grown()
    room = Room(held, 100, 400, grown)
    assert room(200) == 250  # 200 and a quarter
    assert held.bytes == 250 and budget.bytes == 250
    assert room(380) == 400  # never past its most
    assert room.limit == 400 and held.bytes == 400
    assert _count(grown) == 2
    assert room(400) == 400  # asked again at its most: nothing more taken
    assert held.bytes == 400 and _count(grown) == 2
    assert room.refused == ""


def test_a_room_is_refused_past_its_most_or_without_room_now() -> None:
    budget = LoadBudget(300)
    held, other = Held(budget), Held(budget)
    assert held.take(100) and other.take(150)
    room = Room(held, 100, 1000, _grown())
    assert room(1001) == 0 and room.refused == "too_large"
    room = Room(held, 100, 1000, _grown())
    assert room(200) == 0 and room.refused == "overload"  # 250 more do not fit beside 150
    assert held.bytes == 100 and budget.bytes == 250  # a refusal takes nothing
    assert room.limit == 100


def test_worker_threads_take_and_give_back_exactly() -> None:
    """Splices grow from worker threads: the lock keeps the count exact."""
    budget = LoadBudget(1 << 20)
    start = threading.Barrier(8)

    def work() -> None:
        held = Held(budget)
        start.wait()
        for _ in range(2000):
            assert held.take(3)
            held.give_back(2)
        held.settle(0)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.bytes == 0
