"""One object for equal values (proxy.shared_values): shared while held, and a full
table starts again instead of growing."""

from __future__ import annotations

from proxy.shared_values import SharedValues


def test_equal_values_are_one_object_and_a_full_table_starts_again() -> None:
    shared: SharedValues[bytes] = SharedValues(2)
    a = shared(b"".join([b"ns-", b"a"]))
    assert shared(b"".join([b"ns-", b"a"])) is a
    shared(b"ns-b")
    assert len(shared) == 2
    c = shared(b"ns-c")  # full: it starts again with this one
    assert len(shared) == 1 and shared(b"".join([b"ns-", b"c"])) is c
    again = b"".join([b"ns-", b"a"])
    assert shared(again) is again  # forgotten: shared again from its next sight
    shared.most = 10  # grown with what it shares (the fact writer: its pods)
    for i in range(8):
        shared(str(i).encode())
    assert len(shared) == 10
