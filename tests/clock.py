"""A clock a test moves by hand.

The index, the engine, discovery and the demo exporter take a ``Callable[[], float]``
clock; a test that hands them this one and sets ``now`` checks expiry, refresh intervals
and timestamps without sleeping.
"""

from __future__ import annotations


class ManualClock:
    """Reads ``now``, which only the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
