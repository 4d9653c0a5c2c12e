"""The byte budget: what the requests in flight hold at once (``server.max_inflight_bytes``).

One budget for the process, shared by every request: a request's body as it arrives,
then room to decode and splice it, are taken from it first (:class:`Held`); a splice
takes more as it grows, from a worker thread (:class:`Room`); forwarding takes more for a
request it sends again in parts (``proxy.upstream.Charge``). What does not fit is refused,
never made to wait (the handler answers 503 with ``Retry-After``), and what a request
holds is given back when it is answered.

It knows no request, protocol nor HTTP answer: the handler decides what a refusal says.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter


class LoadBudget:
    """Bytes held at once; a request is refused, never made to wait. Locked: a splice in a
    worker thread takes more as it grows (``Room``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.lock = threading.Lock()

    def fits(self, n: int, own: int) -> bool:
        """Do ``n`` more bytes fit for a request that holds ``own`` already (under
        ``lock``)?

        A request that holds everything held (alone in flight) always may: its size is
        bounded anyway (``max_body_bytes`` + ``max_decoded_bytes``, and what its splice may
        hold: ``Room``), and with a budget below that a request too big for it alone would
        be refused on every retry, its data never stored. So the bound is the larger of the
        budget and one request."""
        return self.bytes + n <= self.max_bytes or self.bytes <= own

    def release(self, n: int) -> None:
        with self.lock:
            self.bytes -= n


class Held:
    """Bytes one request holds in the budget, released when it is answered; forwarding
    takes more from it for what it allocates (``proxy.upstream.Charge``: a request the
    upstream refused as too large, decoded again and sent in parts)."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: LoadBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def take(self, n: int) -> bool:
        with self.budget.lock:  # its own count too: a splice's Room takes from a worker
            if not self.budget.fits(n, self.bytes):
                return False
            self.budget.bytes += n
            self.bytes += n
            return True

    def give_back(self, n: int) -> None:
        with self.budget.lock:
            self.budget.bytes -= n
            self.bytes -= n

    def settle(self, holds: int) -> None:
        """The request now holds ``holds`` bytes: less frees the difference at once; more
        is taken even past the budget (the work is done: refusing it would only make the
        sender send it again), and the next requests are refused instead."""
        with self.budget.lock:
            self.budget.bytes += holds - self.bytes
            self.bytes = holds


class Room:
    """What one splice may hold beside its decoded body, taken from its request's byte
    budget as the splice grows (``Splicer.splice_v1``'s ``grow``, called from a worker
    thread). Real series hold up to ~1.5x their decoded size there (spans, the stamps
    copied and added, RW 2.0's per-series places); series many times smaller than their
    stamps hold many times it, which the splice must not allocate unreserved."""

    __slots__ = ("grown", "held", "limit", "most", "refused")

    def __init__(self, held: Held, limit: int, most: int, grown: Counter) -> None:
        self.held = held
        #: what it has (part of its request's reservation), and at most may have
        self.limit = limit
        self.most = most
        #: splices that took more (a metric's child)
        self.grown = grown
        #: why it was refused more: "too_large" (past ``most``), "overload" (no room now)
        self.refused = ""

    def __call__(self, need: int) -> int:
        """The new limit for a splice whose estimate for the whole is ``need``: a quarter
        over it (another ask, not a redo, when it still falls short); 0 when refused."""
        if need > self.most:
            self.refused = "too_large"
            return 0
        more = min(self.most, need + need // 4)
        if not self.held.take(more - self.limit):
            self.refused = "overload"
            return 0
        if self.limit < more:
            self.grown.inc()
        self.limit = more
        return more
