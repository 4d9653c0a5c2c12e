"""The upstream's clock, as its answers' ``Date`` headers tell it, against this host's.

The fact writer stamps its samples with this host's wall clock, and a TSDB judges every
writer's samples by the newest it holds. An audit ran a real Prometheus 2.42 behind a
proxy whose clock was 2 h ahead for two seconds (a wrong hardware clock at boot, then
an NTP step): four fact writes put samples 2 h in the future into its head block, after
which it refused **every sender's** current samples, direct writes included, as
``out of bounds`` (older than its newest sample less 1 h) for about an hour. Mimir
refuses samples more than 10 min ahead. So the writer checks, before it stamps, how far
this host's clock is from the upstream's (:meth:`UpstreamClock.offset`) and holds its
writes while that is more than ``facts.max_clock_offset_seconds``.

Read from the answers to the proxy's own requests only (the upstream check and the fact
writes: one every interval), never a sender's: the relay's hot path does no more per
request. A reading is the ``Date`` (whole seconds, RFC 9110: when the answer was made)
and this host's monotonic clock when it came, so a step of this host's wall clock after
it shows at once: the upstream's time now is the reading plus the monotonic time since.
"""

from __future__ import annotations

import datetime
import email.utils
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClockReading:
    """One ``Date`` header: the upstream's time it says (Unix seconds, the middle of its
    whole second) and this host's monotonic clock when the answer came."""

    upstream: float
    monotonic: float


def parse_date(value: str | None) -> float | None:
    """An HTTP ``Date`` header as Unix seconds, None when absent or unreadable (any of the
    three forms RFC 9110 says a recipient takes)."""
    if not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:  # the asctime form, or a "-0000" zone: GMT by definition
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


class UpstreamClock:
    """The last ``Date`` the upstream answered the proxy's own requests with."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._mono = monotonic
        self.reading: ClockReading | None = None

    def note(self, date: str | None) -> None:
        """An answer came with this ``Date`` header (None: without one)."""
        seconds = parse_date(date)
        if seconds is not None:
            # the header truncates to the second: the middle of it is at most 0.5 s off
            self.reading = ClockReading(seconds + 0.5, self._mono())

    def offset(self, wall_now: float) -> float | None:
        """This host's wall clock ``wall_now`` less the upstream's time now, in seconds
        (positive: this host is ahead); None before an answer with a ``Date`` came."""
        reading = self.reading
        if reading is None:
            return None
        return wall_now - (reading.upstream + (self._mono() - reading.monotonic))
