"""What the parts of a request sent in parts got, remembered for a few minutes.

A request the upstream refused for its size goes out in parts (``Upstream._in_parts``).
When the sender never hears the answer (the proxy's answer lost, or a part's own answer
lost: a timeout, a reset connection) it sends the same batch again, and the parts stored
the first time would be sent again: Prometheus then refuses a part whose series the later
parts had moved past ("out of order sample", a 400 the sender drops although every sample
is stored), and VictoriaMetrics without ``-dedup.minScrapeInterval`` keeps every sample
twice. So what each part got is kept here, keyed by a digest of the body that was cut, and
a resend of that body skips the parts already stored.

Only digests and part indices are held, never series: an entry is a few hundred bytes
whatever the request's size (at most 31 parts a request, ``MAX_SPLIT_DEPTH`` 4), and the
whole is bounded in entries and in bytes, the oldest entries going first; an entry is
forgotten ``ttl`` seconds after the request that made it last touched it (a sender's
retries of one batch come within seconds to a few minutes).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

#: how long what a request's parts got is remembered after its last attempt (seconds)
TTL_SECONDS = 300.0
#: the most requests remembered
MAX_ENTRIES = 4096
#: the most bytes the record may hold (estimated: ``ENTRY_BYTES`` + ``RANGE_BYTES`` per part)
MAX_BYTES = 1 << 20
#: what an entry holds without its parts (its digest key, the object, the dict slot)
ENTRY_BYTES = 400
#: what one remembered part holds (its range and answer as tuples, the dict or set slot)
RANGE_BYTES = 250

#: a part: ``series[lo:hi]`` of the cut body
Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """What a stored part was answered, enough to answer for it again: its 2xx status, if
    it went out converted to RW 1.0, and its RW 2.0 Written headers (-1: none said)."""

    status: int
    converted: bool
    written: tuple[int, int, int]


@dataclass(slots=True)
class Entry:
    """The parts of one cut body that got a 2xx: only a receiver's 2xx says a part is
    stored (no answer, a 5xx, a refusal say nothing of the kind, or that it is not)."""

    expires: float
    stored: dict[Range, StoredAnswer] = field(default_factory=dict)
    #: the attempts that looked this body up: more than one, and an earlier attempt of
    #: the same batch went out (what a refusal of a part not stored then may mean)
    attempts: int = 0

    @property
    def nbytes(self) -> int:
        return ENTRY_BYTES + RANGE_BYTES * len(self.stored)

    def covered(self, lo: int, hi: int) -> list[tuple[Range, StoredAnswer]] | None:
        """The stored parts that together are ``series[lo:hi]``, with their answers, or
        None when some of it is not stored. The stored parts of one body come from one cut
        tree, so they never overlap: inside ``lo:hi``, sorted, they must meet end to
        start."""
        inside = sorted(r for r in self.stored if lo <= r[0] and r[1] <= hi)
        at = lo
        for a, b in inside:
            if a != at:
                return None
            at = b
        if at != hi:
            return None
        return [(r, self.stored[r]) for r in inside]


class StoredParts:
    """The bounded record of what requests sent in parts got (see the module)."""

    def __init__(self, *, ttl: float = TTL_SECONDS, max_entries: int = MAX_ENTRIES,
                 max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        #: the sum of the entries' ``nbytes``
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: bytes) -> Entry:
        """The entry of ``key``, made if new, its life begun anew: a sender still retrying
        keeps it."""
        now = self._clock()
        self._expire(now)
        entry = self._entries.pop(key, None)
        if entry is None:
            entry = Entry(now + self.ttl)
            self.nbytes += entry.nbytes
        entry.expires = now + self.ttl
        entry.attempts += 1
        self._entries[key] = entry
        self._bound(key)
        return entry

    def stored(self, key: bytes, entry: Entry, part: Range, answer: StoredAnswer) -> None:
        """``part`` got ``answer``, a 2xx."""
        if part not in entry.stored:
            entry.stored[part] = answer
            self._grew(key, entry)

    def _grew(self, key: bytes, entry: Entry) -> None:
        """An entry holds a part more; counted only while it is still in the record (an
        entry dropped for room is the request's alone, and gone with it)."""
        if self._entries.get(key) is entry:
            self.nbytes += RANGE_BYTES
            self._bound(key)

    def _expire(self, now: float) -> None:
        # oldest first: every touch moves an entry to the end, and every life is ``ttl``
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(key)

    def _bound(self, keep: bytes) -> None:
        while (len(self._entries) > self.max_entries or self.nbytes > self.max_bytes) \
                and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            if oldest == keep:
                return
            self._drop(oldest)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
