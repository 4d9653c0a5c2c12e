"""The record of what a request's parts got stays small whatever comes: bounded in entries
and bytes, forgotten after its time, holding ranges and digests only."""

from __future__ import annotations

from proxy.stored_parts import RANGE_BYTES, StoredAnswer, StoredParts

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
