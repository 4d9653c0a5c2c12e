"""The record of what a request's parts got stays small whatever comes: bounded in entries
and bytes, forgotten after its time, holding ranges and digests only."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest

from proxy.stored_parts import (
    ENTRY_BYTES,
    MAX_BYTES,
    MAX_ENTRIES,
    RANGE_BYTES,
    StoredAnswer,
    StoredParts,
)

OK = StoredAnswer(204, False, (-1, -1, -1))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_covered_by_one_part_or_by_the_parts_it_was_cut_in() -> None:
    record = StoredParts()
    e = record.entry(b"k")
    record.stored(b"k", e, (0, 4), OK)
    record.stored(b"k", e, (4, 6), OK)
    record.stored(b"k", e, (6, 8), OK)
    assert e.covered(0, 4) == [((0, 4), OK)]
    assert [r for r, _ in e.covered(4, 8) or []] == [(4, 6), (6, 8)]
    assert [r for r, _ in e.covered(0, 8) or []] == [(0, 4), (4, 6), (6, 8)]
    assert e.covered(8, 16) is None
    record.stored(b"k", e, (12, 16), OK)
    assert e.covered(8, 16) is None  # 8:12 not stored


def test_an_entry_is_forgotten_after_its_time_from_its_last_use() -> None:
    clock = Clock()
    record = StoredParts(ttl=300, clock=clock)
    e = record.entry(b"a")
    record.stored(b"a", e, (0, 1), OK)
    clock.now = 200
    assert record.entry(b"a") is e  # a retry keeps it
    clock.now = 300
    record.entry(b"b")
    clock.now = 450
    assert len(record) == 2
    clock.now = 501
    record.entry(b"c")
    assert len(record) == 2 and record.entry(b"a").covered(0, 1) is None  # a is new again


def test_bounded_in_entries_and_bytes_oldest_first() -> None:
    record = StoredParts(max_entries=10, max_bytes=1 << 30)
    for i in range(1000):
        e = record.entry(i.to_bytes(4, "big"))
        record.stored(i.to_bytes(4, "big"), e, (0, 1), OK)
    assert len(record) == 10
    record = StoredParts(max_entries=1 << 20, max_bytes=20 * RANGE_BYTES)
    for i in range(1000):
        key = i.to_bytes(4, "big")
        e = record.entry(key)
        for j in range(31):  # the most parts a request has
            record.stored(key, e, (j, j + 1), OK)
        assert record.nbytes <= max(record.max_bytes, e.nbytes)
    assert len(record) == 1  # the newest, alone, even over the bound
    assert record.nbytes == sum(x.nbytes for x in record._entries.values())


def test_the_byte_count_follows_what_the_entries_hold() -> None:
    record = StoredParts()
    e = record.entry(b"k")
    record.stored(b"k", e, (0, 2), OK)
    record.stored(b"k", e, (0, 2), OK)  # a part answered twice is held once
    record.stored(b"k", e, (2, 4), OK)
    assert record.nbytes == e.nbytes == record.nbytes
    assert list(e.stored) == [(0, 2), (2, 4)]


def test_an_entry_answered_lately_is_kept_longer_and_dropped_last() -> None:
    # an attempt's parts can take its whole deadline: the entry made when it began must
    # not be the first to go while its parts are still being answered
    clock = Clock()
    record = StoredParts(ttl=300, max_entries=3, max_bytes=1 << 30, clock=clock)
    a = record.entry(b"a")
    clock.now = 10
    record.entry(b"b")
    record.entry(b"c")
    clock.now = 200
    record.stored(b"a", a, (0, 1), OK)  # answered: used now
    record.entry(b"d")  # room for three: b, the least recently used, goes
    assert set(record._entries) == {b"a", b"c", b"d"}
    clock.now = 320
    record.entry(b"e")  # c expired (10 + 300); a lives to 500
    assert set(record._entries) == {b"a", b"d", b"e"}
    clock.now = 480
    record.answered(b"a", a)  # a refusal is an answer too: the attempt goes on
    clock.now = 700
    record.entry(b"f")
    assert set(record._entries) == {b"a", b"f"} and record.entry(b"a") is a


def test_an_entry_dropped_for_room_is_taken_in_again_when_its_part_is_stored() -> None:
    evicted: list[int] = []
    record = StoredParts(max_entries=1, max_bytes=1 << 30, on_evict=lambda: evicted.append(1))
    a = record.entry(b"a")
    record.entry(b"b")  # a dropped for room, its attempt still going
    assert evicted == [1] and b"a" not in record._entries
    record.stored(b"a", a, (0, 1), OK)
    assert list(record._entries) == [b"a"] and evicted == [1, 1]
    assert record.nbytes == a.nbytes
    assert record.entry(b"a").covered(0, 1) == [((0, 1), OK)]


def test_only_entries_dropped_for_room_count_as_evicted() -> None:
    clock = Clock()
    evicted: list[int] = []
    record = StoredParts(ttl=300, max_entries=2, max_bytes=1 << 30, clock=clock,
                         on_evict=lambda: evicted.append(1))
    record.entry(b"a")
    record.entry(b"b")
    clock.now = 301
    record.entry(b"c")  # a and b expired: not evicted
    assert evicted == [] and len(record) == 1
    record.entry(b"d")
    record.entry(b"e")
    assert evicted == [1]


def test_steady_splitting_keeps_an_entry_for_minutes() -> None:
    # every request sent in two parts, 50 a second: the record held ~23 s of them at
    # 1 MiB, less than a sender's retry after a 504 (25 s) and its backoff
    clock = Clock()
    record = StoredParts(clock=clock)
    assert MAX_ENTRIES * ENTRY_BYTES == MAX_BYTES  # the byte bound is met first
    e = record.entry(b"interest")
    record.stored(b"interest", e, (0, 5), OK)
    i = 0
    while b"interest" in record._entries and clock.now < 400:
        clock.now += 1 / 50
        key = i.to_bytes(8, "big")
        i += 1
        x = record.entry(key)
        record.stored(key, x, (0, 5), OK)
        record.stored(key, x, (5, 10), OK)
    assert clock.now > 200


@pytest.mark.parametrize("nparts", [0, 1, 2, 5, 6, 11, 16, 22, 31])
def test_the_byte_estimate_is_over_what_entries_hold(nparts: int) -> None:
    # measured, not guessed: 1.01-1.56 times the estimate was held with the first figures.
    # The worst case: ranges and Written counts past the small ints Python shares, and
    # the dict sizes just past a resize (6, 11, 22)
    record = StoredParts(max_entries=1 << 20, max_bytes=1 << 40)
    entries = 300
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(entries):
            key = hashlib.blake2b(i.to_bytes(4, "big"), digest_size=32).digest()
            e = record.entry(key)
            for j in range(nparts):
                lo = 100_000 + j * 1_000
                record.stored(key, e, (lo, lo + 999), StoredAnswer(
                    204, False, (1_000_000 + i, 1_000_000 + j, 1_000_000 + i + j)))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert record.nbytes == entries * (ENTRY_BYTES + nparts * RANGE_BYTES)
    assert held <= record.nbytes, f"{held / entries:.0f} bytes an entry held"
