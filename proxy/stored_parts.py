"""What the parts of a request sent in parts got, remembered for a few minutes.

A request the upstream refused for its size goes out in parts (``Upstream._in_parts``).
When the sender never hears the answer (the proxy's answer lost, or a part's own answer
lost: a timeout, a reset connection) it sends the same batch again, and the parts stored
the first time would be sent again: Prometheus then refuses a part whose series the later
parts had moved past ("out of order sample", a 400 the sender drops although every sample
is stored), and VictoriaMetrics without ``-dedup.minScrapeInterval`` keeps every sample
twice. So the parts that got a 2xx are kept here, keyed by a digest of the body that was
cut and of where it went (``upstream._parts_key``: the URL and the headers that choose a
tenant), and a resend of that body to the same place skips them.

Only a 2xx puts a part here. A part whose answer never came may be stored or not, one
answered 5xx was not (Prometheus rolls a failed append back), one refused was not: none
of them may ever be answered 2xx for, or the sender drops a batch it was told is stored
with samples missing. Such a part is sent again, and what the receiver says then is the
answer.

Only digests and part ranges are held, never series: an entry is at most
``ENTRY_BYTES + RANGE_BYTES`` per part (31 parts at most, ``MAX_SPLIT_DEPTH`` 4), an upper
bound of what it holds (tests/test_stored_parts.py measures it), and the whole is bounded
in entries and in estimated bytes, the least recently used going first; an entry is
forgotten ``ttl`` seconds after it was last used (an attempt of its body began, or one of
its parts was answered): a sender's retries of one batch come within seconds to a few
minutes, and one part of a split can take up to the request's whole deadline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

#: how long what a request's parts got is remembered after its last use (seconds)
TTL_SECONDS = 300.0
#: the most bytes the record may hold (estimated: ``ENTRY_BYTES`` + ``RANGE_BYTES`` per
#: part). Under a steady split of every request 1 MiB held ~1,160 two-part entries: at 50
#: split requests a second an entry lasted ~23 s, less than a sender's retry after a 504
#: and its backoff. 16 MiB hold ~11,900, about 4 minutes at 50 a second
MAX_BYTES = 16 << 20
#: what an entry holds without its parts, over the most measured (its 32-byte key, the
#: object, its empty dict, the ordered dict's slot and node: ~300 bytes on CPython 3.11)
ENTRY_BYTES = 512
#: what one remembered part holds, over the most measured (its range and answer, their
#: ints and tuples, its dict slot as the dict grows: ~370 bytes on CPython 3.11)
RANGE_BYTES = 448
#: the most requests remembered: as many entries as the byte bound holds without parts,
#: so that bound is the one met first once entries hold parts
MAX_ENTRIES = MAX_BYTES // ENTRY_BYTES

#: a part: ``series[lo:hi]`` of the cut body
Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class StoredAnswer:
    """What a stored part was answered, enough to answer for it again: its 2xx status, if
    it went out converted to RW 1.0, and its RW 2.0 Written headers (-1: none said)."""

    status: int
    converted: bool
    written: tuple[int, int, int]
    #: it went without its native histograms (the upstream refused them): a resend that
    #: skips it claims none of the request's histograms written
    without_histograms: bool = False


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
    """The bounded record of what requests sent in parts got (see the module).

    ``on_evict``: called for each entry dropped for room before its time (the record too
    small for the rate of requests sent in parts: their resends are sent whole again)."""

    def __init__(self, *, ttl: float = TTL_SECONDS, max_entries: int = MAX_ENTRIES,
                 max_bytes: int = MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[], None] | None = None) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._on_evict = on_evict
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
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry(now + self.ttl)
            self.nbytes += entry.nbytes
        entry.attempts += 1
        self._used(key, entry, now)
        return entry

    def answered(self, key: bytes, entry: Entry) -> None:
        """A part of ``entry`` was answered: the attempt is still going, and its entry is
        used now (an attempt's parts can take its whole deadline; the entry made when it
        began was the least recently used by then, first to go under a steady split).
        One dropped meanwhile is taken in again, unless a newer one has its key."""
        now = self._clock()
        self._expire(now)
        held = self._entries.get(key)
        if held is None:
            self._entries[key] = entry
            self.nbytes += entry.nbytes
        elif held is not entry:
            return
        self._used(key, entry, now)

    def stored(self, key: bytes, entry: Entry, part: Range, answer: StoredAnswer) -> None:
        """``part`` got ``answer``, a 2xx; the entry used now (:meth:`answered`)."""
        if part not in entry.stored:
            entry.stored[part] = answer
            if self._entries.get(key) is entry:
                self.nbytes += RANGE_BYTES
        self.answered(key, entry)

    def _used(self, key: bytes, entry: Entry, now: float) -> None:
        entry.expires = now + self.ttl
        self._entries.move_to_end(key)
        self._bound(key)

    def _expire(self, now: float) -> None:
        # oldest first: every use moves an entry to the end, and every life is ``ttl``
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
            if self._on_evict is not None:
                self._on_evict()

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
