"""The fact writer: the fact series into the remote-write stream, by one replica.

Every ``interval_seconds`` the writer encodes the facts (:mod:`proxy.facts.model`,
:mod:`proxy.facts.encoder`) as RW 1.0 ``WriteRequest`` bodies, so they land in the same
TSDB and tenant as the enriched series. Series that were written last time and are gone
now (a deleted workload or pod, a desired-replica path that stopped answering) get a
stale marker in the next write, so they end at once instead of lingering for
Prometheus' 5-minute lookback. With several replicas, a
:class:`proxy.lease.LeaseElector` lets only the leader write: the facts carry no
per-replica label, so a leader change continues the same series.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import proxy
from proxy import contract, memory
from proxy.config import FactSettings
from proxy.facts.collectors import FactWriterMetrics, sample_value
from proxy.facts.encoder import (
    METADATA,
    Group,
    Series,
    encode_facts,
    interleaver,
    label_field,
    rehead,
    sample_field,
    series_bytes,
    swapped,
    timestamp_field,
    union,
)
from proxy.facts.model import (
    Fact,
    Labels,
    coverage_key,
    coverage_of,
    label_set,
    pod_facts,
    process_facts,
    workload_facts,
)
from proxy.index import PodIndex
from proxy.karta.results import (
    PHASE_SINCE_OBJECT,
    PHASE_SINCE_OBSERVED,
    PodAttribution,
    WorkloadFacts,
)
from proxy.log import Throttled, failure_line
from proxy.shared_values import SharedValues
from proxy.upstream import TRANSIENT_4XX, own_write_refused
from proxy.upstream_clock import UpstreamClock
from proxy.wire.halves import layout
from proxy.wire.primitives import STALE_NAN, Protocol, labels_of, series_text
from proxy.yielding import Busy, Pacer

if TYPE_CHECKING:
    from proxy.lease import LeaseElector

log = logging.getLogger(__name__)

#: series per request: most receivers prefer requests of a few thousand series, and some
#: limit a request's size (Prometheus 2.42 does not: it took a 40 MiB decoded write, 204,
#: measured); 100k pods make ~30 requests per write
MAX_SERIES_PER_REQUEST = 5000
#: a write's building yields to the event loop (an empty body in ``iter_requests``) after
#: the group (a pod's or workload's series) that takes the series made past a multiple of
#: this, and every this many groups checked for stale markers: a cold write at 37.5k pods
#: is ~1 s of the loop's time, and built in stretches of one request (5,000 series,
#: ~20 ms) and one stale-marker scan of the written set (then per series: 290k, ~180 ms)
#: it made the p99 latency of the requests relayed meanwhile ~150 ms (relay_bench.py
#: --fact-interval 5)
PAUSE_EVERY_SERIES = 1000
#: how long the lines of a write that fails or is refused, the same way write after write,
#: are one line at once and one summary (``proxy.log.Throttled``): a write comes every
#: ``facts.interval_seconds`` (15 s), longer than ``THROTTLE_SECONDS``, so a 10 s throttle
#: held none back and every write said it all again (an upstream refusing every fact
#: series with a 400 made 49 lines a minute, one down 4 of the writer's own)
FACT_LINE_SECONDS = 300.0
#: and after any group once building has held the loop this long: a series encoded afresh
#: costs ~20 us, so the stretches of a cold write (at start, or after a reload) were
#: 20-25 ms of the loop's time each at 1,000 series. A request that arrives during a
#: stretch waits for its end before the write yields to it (``busy``), so the stretch is
#: short; between requests a pause costs a few turns of the loop, not real time
#: (:mod:`proxy.yielding`)
PAUSE_AFTER_SECONDS = 0.0005
#: a write waits for the requests being relayed at its pauses
#: (:class:`proxy.yielding.Pacer`) for at most this share of the interval in all, so that
#: a saturated proxy still writes every fact each interval
DEFER_SHARE = 0.25

#: during a write, the freed heap is handed back (``malloc_trim``) every this many
#: requests: the bodies sent (2 MB each, and their compressed copies) and the encoding
#: garbage of a cold write otherwise pile up as RSS (the heap keeps up to
#: ``proxy.memory.TRIM_THRESHOLD`` free at its top for the request path). At 37.5k pods
#: (63 requests a write) the process' peak over its start and first write was 284.7 MiB
#: every 8 requests, 271.5 every 4, 268.8 every 3, 269.2 every 2: the start's peak,
#: which set the relay benchmark's (305.4 MB with the jq child, 296.8 every 4). A trim
#: costs ~1 ms off the event loop (0.7 median, 3.9 max), ~16 a write
TRIM_EVERY_REQUESTS = 4

#: how long a standby replica remembers a fact series it no longer sees at most:
#: Prometheus' default lookback, after which a series without samples is gone from queries
#: anyway. It keeps that long only while it has no recent sign of the holder (a Lease API
#: outage, a holder never seen): else :attr:`FactWriter.takeover_window` before the
#: holder's last sign of life is all a takeover owes markers for
STANDBY_MEMORY = 300.0
#: the write intervals in :attr:`FactWriter.takeover_window`: the leader's write before its
#: last one (it may have died during that one), that write's own length, and the interval
#: within which this replica's walk saw a series vanish after it last saw it
TAKEOVER_INTERVALS = 3.0

#: the series a writer ends when it stops (:meth:`FactWriter.end_own_series`): the ones
#: that say which process wrote the facts. A successor of another version writes other
#: label values and never knows these (after an upgrade two versions showed for the
#: 5-minute lookback); the cluster's facts go on under the next writer, unended
OWN_SERIES = (contract.FACT_BUILD_INFO, contract.FACT_CONTRACT_INFO)
#: how long a stop waits for those markers to be sent at most: the stop runs them beside
#: the drain of the requests in flight and gives them less when less of its deadline is
#: left (``proxy.runtime.Proxy.stop``); unsent, they end with the lookback
END_TIMEOUT_SECONDS = 5.0


#: A leader whose fact writes all fail on the way out (no connection, a timeout, a 5xx, a
#: 429 or another "later" 4xx; not a 400 or other 4xx refusing series or a request, which
#: the upstream answered) gives the lease up (:meth:`FactWriter._egress_failed`) once
#: at least STEP_DOWN_WRITES writes in a row failed over at least the longer of
#: STEP_DOWN_LEASES lease durations and STEP_DOWN_INTERVALS write intervals (from the
#: first failed write's start): a handover costs a gap of up to a third of the lease
#: plus an interval and the new leader's first-write markers, so a blip shorter than a
#: lease (an upstream restarting) is ridden out; one failed write is never enough. The
#: replica then does not campaign for STEP_DOWN_COOLDOWN_LEASES lease durations, long
#: enough for a standby (which tries every third of the lease) to take the lease and renew
#: it; alone, it takes the lease again after that (docs/metrics.md)
STEP_DOWN_WRITES = 2
STEP_DOWN_LEASES = 1.0
STEP_DOWN_INTERVALS = 2.0
STEP_DOWN_COOLDOWN_LEASES = 2.0

#: a write sends at most this many requests beyond its own to find, by halves, the series
#: a 400 refuses (``FactWriter._deliver``): one series in a request of 5,000 takes 26
#: (13 levels, two halves each). Past it a refused part is dropped whole for the write
MAX_EXTRA_REQUESTS = 64
#: series refused on their own remembered (each then costs a request of its own a write)
MAX_REFUSED_REMEMBERED = 32

#: a workload's transition-time series under one ``source`` and the other: the first write
#: after a start or a takeover ends the other source's series of every workload it writes
#: (``FactWriter._end_other_source``). The previous writer may have dated the phase
#: otherwise (it saw a rollout end: ``observed``; this one reads the object: ``object``),
#: and its series lingered for the 5-minute lookback beside this one's: two rows of time
#: in phase for one workload. A marker for a series that never existed is harmless.
_SOURCE_FIELDS = {
    label_field(contract.FACT_LABEL_SOURCE, PHASE_SINCE_OBJECT):
        label_field(contract.FACT_LABEL_SOURCE, PHASE_SINCE_OBSERVED),
    label_field(contract.FACT_LABEL_SOURCE, PHASE_SINCE_OBSERVED):
        label_field(contract.FACT_LABEL_SOURCE, PHASE_SINCE_OBJECT),
}
_TRANSITION_NAME = label_field("__name__", contract.FACT_WORKLOAD_PHASE_TRANSITION)

_Obj = TypeVar("_Obj", PodAttribution, WorkloadFacts)

#: What the written set is keyed by: a pod's uid (or its namespace and name if it has
#: none), a workload's (group, kind, namespace, name), or one of the two keys below. Every
#: fact series carries the labels of its key, so a series can only ever be made under
#: one key: what a key had last time and lacks now is exactly what is gone.
Key = str | tuple[str, ...]
COVERAGE_KEY: Key = ("coverage",)
PROCESS_KEY: Key = ("process",)
#: (key, how many series in a row under it) of a request's series, in order
#: (``FactWriter.body_runs``). A bare tuple, not a NamedTuple: one is made per group of a
#: write (100k pods: ~102k), and a NamedTuple's ~0.5 us more each was ~15% of a warm
#: write's 0.26-0.37 s (``facts_bench.py``)
Run = tuple[Key, int]


def pod_key(att: PodAttribution) -> Key:
    """Its series' uid label, or (namespace, pod) when it has none (an empty label is
    no label)."""
    return att.uid or (att.namespace, att.pod)


def workload_key(wf: WorkloadFacts) -> Key:
    """The identity every series of the workload carries
    (:func:`proxy.facts.model.workload_identity`): two objects of one identity (deleted and
    made again) continue the same series."""
    r = wf.ref
    return (r.group, r.kind, r.namespace, r.name)


class _Refusal(NamedTuple):
    """A 4xx to a fact request: its status and what the send raised (for the log)."""

    status: int
    error: Exception


class _Delivery:
    """What one write's requests came to beyond success (``FactWriter._deliver``)."""

    def __init__(self) -> None:
        #: requests sent to find refused series (halves)
        self.extra = 0
        #: series refused on their own (a 400 bisected down to them), left out
        self.refused = 0
        #: of them, stale markers, and the keys of those
        self.refused_stale = 0
        #: of those, markers not counted in ``karta_proxy_fact_stale_markers_total`` (the
        #: other ``source``'s series, a takeover's inherited ones: ``FactWriter._uncounted``)
        self.refused_other = 0
        self.stale_keys: set[Key] = set()
        #: series dropped with a part refused whole (another 4xx, or MAX_EXTRA_REQUESTS)
        self.dropped = 0
        #: requests accepted (a write of which none landed failed, whatever refused it)
        self.accepted = 0
        #: the lease passed to another replica during the write: it stopped there, and
        #: a refusal met then is the new leader's newer samples, not a refused series
        self.lost = False


class _Cached(NamedTuple, Generic[_Obj]):
    """A pod's or workload's key and encoded series, valid while the index holds this
    very object (index records are replaced, never changed, when what they say changes).
    The key is kept, not derived each write: a workload's is a new tuple each time."""

    obj: _Obj
    key: Key
    group: Group


class _Samples(dict[float, bytes]):
    """A write's sample field per value (one timestamp for the whole write), made on first
    use: most fact values are 0 or 1."""

    def __init__(self, ts_bytes: bytes) -> None:
        super().__init__()
        self._ts = ts_bytes

    def __missing__(self, value: float) -> bytes:
        field = self[value] = sample_field(value, self._ts)
        return field


class WriterState(enum.Enum):
    """Whether this replica writes the fact series; :meth:`FactWriter.step` moves between
    the two.

    * ``STANDBY``: another replica writes (or none has yet): each interval only remembers
      which series exist (:meth:`FactWriter.track_standby`), so a takeover can end what
      the old leader left behind. A writer starts here.
    * ``LEADER``: this replica writes, and owes stale markers for what it wrote.
    """

    STANDBY = "standby"
    LEADER = "leader"


def _answered(exc: Exception) -> str:
    """The key of a write's failure for its throttled line: the upstream's answer (a
    status, ``connect_error``, ...), else the exception's type: a new one is said at once."""
    answer = getattr(exc, "answer", None)
    return str(getattr(answer, "upstream", "")) or type(exc).__name__


class FactWriter:
    """Writes the fact series into the remote-write stream every ``interval_seconds``.

    ``send`` gets uncompressed RW 1.0 ``WriteRequest`` bodies (``Upstream.send_v1``
    compresses and posts them), at most ``MAX_SERIES_PER_REQUEST`` series each; what it
    raises for a refusal carries the ``status`` a sender would get (a 400: its halves sent
    again down to the series refused, which alone are left out and then go in requests of
    their own, :meth:`_deliver`; another 4xx: that request refused for good; either way the
    others of the write still sent; else the write stops there).
    Only the lease holder writes when an ``elector`` is given. Stale markers follow what
    was last *successfully* sent: after a failed send the next write still ends the series
    that went away. ``busy`` says whether requests are being relayed now: a write (and a
    standby's walk) waits for them at its pauses (:mod:`proxy.yielding`, ``DEFER_SHARE``).
    """

    def __init__(
        self,
        settings: FactSettings,
        index: PodIndex,
        send: Callable[[bytes], Awaitable[None]],
        *,
        elector: LeaseElector | None = None,
        clock: Callable[[], float] = time.time,
        build_version: str = proxy.__version__,
        max_series_per_request: int = MAX_SERIES_PER_REQUEST,
        busy: Busy | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        upstream_clock: UpstreamClock | None = None,
        cluster_uid: Callable[[], str] = str,
    ) -> None:
        self._settings = settings
        #: the cluster's uid as known now, on karta_contract_info ("" unknown, and in
        #: snapshot mode: proxy.kube.cluster_identity); read at each write, so the series
        #: without it ends (a stale marker) at the first write that knows it
        self._cluster_uid = cluster_uid
        #: the upstream's clock (the Date of its answers): writes are held while this
        #: host's is more than ``facts.max_clock_offset_seconds`` off it (:meth:`_clock_off`)
        self._upstream_clock = upstream_clock
        #: whether the last write was held so (its start and end are logged, not each one)
        self._held_for_clock = False
        #: the timestamp (ms) of the last write's samples: the next write's are later
        #: (:meth:`_stamp`)
        self._last_stamp_ms = -1
        self._mono = monotonic
        self._index = index
        self._send = send
        self._elector = elector
        self._busy = busy
        self._clock = clock
        self._build_version = build_version
        self._max_series = max(1, max_series_per_request)
        self._external: Labels = label_set(settings.external_labels.items())
        self._pod_cache: dict[str, _Cached[PodAttribution]] = {}
        #: the pieces of pods' series that are not the pod's own (its family's name, the
        #: stamp, the external labels), one object for every pod that has them
        #: (``encoder._pod_pieces``); at most as many as pods + 1024 (set each write)
        self._pod_runs: SharedValues[bytes] = SharedValues(1024)
        self._workload_cache: dict[str, _Cached[WorkloadFacts]] = {}
        #: length of a sample field; the cached series headers embed it (constant in
        #: practice: millisecond timestamps are 6-byte varints from 2004 to 2109)
        self._sample_len = -1
        #: the series of the last successful write, by key (:data:`Key`): the cache's own
        #: groups, so it costs its table only (~48k keys at 37.5k pods), and it keeps a
        #: gone series' bytes (its stale marker) after the cache has let go of the pod or
        #: workload. Per series it was a 290k-key dict, 10 MiB, twice during a write.
        #: Replaced, never changed in place: a scan of it may be paused half-way.
        self._written: dict[Key, Group] = {}
        #: what the last build produced (committed to _written once the send succeeds)
        self._pending: dict[Key, Group] = {}
        #: while another replica writes: the groups seen under each key, each with the last
        #: time it was seen (own monotonic clock: on the wall clock, a step back of an hour
        #: kept every group seen for that hour, and a takeover then counted them all as
        #: series gone; a step forward forgot them), kept for ``takeover_window`` before
        #: the holder's last sign of life (at most STANDBY_MEMORY seconds), so a takeover
        #: ends what the old leader left behind
        self._standby: dict[Key, dict[Group, float]] = {}
        #: when (own monotonic clock) the last standby walk saw that the lease holder was
        #: last alive: its last change of the lease record; None when it saw none
        self._holder_seen: float | None = None
        #: the label fields of the series a takeover owes markers for that the previous
        #: leader probably ended already (seen standing by more than an interval before
        #: its last sign of life): sent, not counted (``_uncounted``). Until a write lands
        self._inherited_ended: set[bytes] = set()
        #: series an upstream refused on their own (a 400 bisected down to them), by key:
        #: their label bytes (:func:`proxy.wire.primitives.labels_of`). Later writes send
        #: each in a request of its own, so it spoils no other and needs no new bisection;
        #: one accepted again is forgotten. At most ``MAX_REFUSED_REMEMBERED`` in all
        self._refused: dict[Key, set[bytes]] = {}
        #: the keys of the series of the body ``iter_requests`` yielded last, in order
        self.body_runs: list[Run] = []
        #: the sample field of a stale marker in the write being made
        self._stale_sample = b""
        def lines(first: str, repeated: str) -> Throttled:
            return Throttled(log, first, repeated, peer_field=None,
                             interval=FACT_LINE_SECONDS, clock=monotonic)

        self._refusal_lines = lines(
            "fact series refused by the upstream, left out of this write",
            "fact series refused by the upstream (repeated)")
        #: a write's own lines, each as ``_refusal_lines`` (by the upstream's answer)
        self._failed_lines = lines("fact write failed", "fact writes failed")
        self._dropped_lines = lines(
            "fact write: series refused for good with their request, the others still "
            "sent", "fact writes: series refused for good with their request (repeated)")
        self._refused_lines = lines(
            "fact write: series refused for good, the others written",
            "fact writes: series refused for good, the others written (repeated)")
        #: the next write ends each workload's transition series of the other ``source``
        #: (set on every takeover, a start's first write included; cleared once a write
        #: landed): see ``_SOURCE_FIELDS``
        self._end_other_source = False
        self._task: asyncio.Task[None] | None = None
        #: the leader/standby state: changed only by step()
        self.state = WriterState.STANDBY
        #: standby walks finished (the runtime campaigns for the lease after one that
        #: followed the index's load: a takeover then knows what to end)
        self.standby_walks = 0
        #: for /metrics (FactWriterCollector)
        self.metrics = FactWriterMetrics()
        self.metrics.leader.set_function(lambda: 1.0 if self.is_writer else 0.0)
        self.metrics.clock_offset.set_function(self.clock_offset)
        if elector is not None:
            failures = self.metrics.lease_failures
            elector.on_failure = lambda reason: failures.labels(reason=reason).inc()
        #: the writes failed on the way out in a row as leader, and when (own clock) the
        #: first of them started (:meth:`_egress_failed`)
        self._failing_writes = 0
        self._failing_since = 0.0
        #: what the last build made (series also on /metrics; markers counted on commit)
        self.last_series = 0
        self.last_stale_markers = 0
        #: the label fields of the last build's markers not counted as stale markers,
        #: which count this writer's series that went away: those for the other
        #: ``source``'s transition series (``_SOURCE_FIELDS``: the first write after a
        #: start or a takeover, one per workload, for series that mostly never existed; a
        #: takeover added one per workload to them), and a takeover's for series the
        #: previous leader probably ended (``_inherited_ended``: thousands per takeover
        #: under pod churn, an audit saw 11,578 sent again and counted)
        self._uncounted: set[bytes] = set()
        #: how many markers of the last build were not counted (``_uncounted``)
        self.last_uncounted_markers = 0

    # -- building ------------------------------------------------------------------------

    def _encode(self, facts: Iterable[Fact]) -> Group:
        return encode_facts(facts, self._external, self._sample_len, self._pod_runs)

    def _set_sample_len(self, ts_bytes: bytes) -> None:
        """The cached series headers count their sample field: re-made should a sample's
        length change with the timestamp's (``ts_bytes``, the write's)."""
        n = len(sample_field(0.0, ts_bytes))
        if n == self._sample_len:
            return
        self._sample_len = n
        self._pod_cache.clear()
        self._workload_cache.clear()
        self._written = {k: rehead(g, n) for k, g in self._written.items()}
        self._standby = {k: {rehead(g, n): t for g, t in seen.items()}
                         for k, seen in self._standby.items()}

    def _cached(self, items: Iterable[tuple[str, _Obj]], cache: dict[str, _Cached[_Obj]],
                facts: Callable[[_Obj], list[Fact]], key: Callable[[_Obj], Key],
                fresh: dict[str, _Cached[_Obj]]) -> Iterator[tuple[Key, Group]]:
        """(key, group) of each object in ``items``, encoded again only where the index's
        object is not the cached one; ``fresh`` becomes the cache of what is now."""
        for uid, obj in items:
            hit = cache.get(uid)
            if hit is None or hit.obj is not obj:
                hit = _Cached(obj, key(obj), self._encode(facts(obj)))
            fresh[uid] = hit
            yield hit.key, hit.group

    def _current(self) -> Iterator[tuple[Key, Group]]:
        """(key, group) of every fact series now, one at a time (a write's requests are
        made as they are sent); the index as it was when the first one is asked for.

        The index's tables are copied (a dict copy: no tuple per entry) and the coverage is
        counted as the pods go by: at 37.5k pods, listing the items and counting the
        coverage up front held the event loop for 20-33 ms before the first pause.
        """
        pods_now = dict(self._index.pods)
        workloads_now = self._index.fact_workloads()
        process = process_facts(self._index, self._build_version, self._cluster_uid())
        tally: Counter[tuple[str, str | None]] = Counter()

        def counted() -> Iterator[tuple[str, PodAttribution]]:
            for item in pods_now.items():
                tally[coverage_key(item[1])] += 1
                yield item

        pods: dict[str, _Cached[PodAttribution]] = {}
        self._pod_runs.most = len(pods_now) + 1024
        yield from self._cached(counted(), self._pod_cache, pod_facts, pod_key, pods)
        self._pod_cache = pods
        workloads: dict[str, _Cached[WorkloadFacts]] = {}
        yield from self._cached(workloads_now.items(), self._workload_cache, workload_facts,
                                workload_key, workloads)
        self._workload_cache = workloads
        yield COVERAGE_KEY, self._encode(coverage_of(tally))
        yield PROCESS_KEY, self._encode(process)

    def iter_requests(self, now_ms: int) -> Iterator[bytes]:
        """Uncompressed RW 1.0 WriteRequests holding every fact at ``now_ms``, plus stale
        markers for the series of the last successful write that are gone now. An empty
        body is a pause, not a request: a point where the caller lets other work run
        (``PAUSE_EVERY_SERIES``, ``PAUSE_AFTER_SECONDS``).

        One request at a time, so a write holds one body, not all of them (~60 MB for
        290k fact series at 37.5k pods). ``_pending`` grows as the requests are made: a
        write that stops half-way owes markers for what it had sent (``commit_partial``).
        The statistics are set once the last request is made.
        """
        started = time.perf_counter()
        ts_bytes = timestamp_field(now_ms)
        samples = _Samples(ts_bytes)
        self._set_sample_len(ts_bytes)
        current: dict[Key, Group] = {}
        self._pending = current
        parts: list[bytes] = []
        runs: list[Run] = []
        count = 0
        limit = self._max_series
        made = 0
        gone: list[tuple[Series, Key]] = []
        refused = self._refused
        stale = self._stale_sample = sample_field(STALE_NAN, ts_bytes)
        end_other = self._end_other_source
        not_counted = self._uncounted = set()
        inherited = self._inherited_ended
        uncounted = 0

        def chunks() -> Iterator[tuple[tuple[bytes, ...], int, Key, bool] | None]:
            """(the wire pieces of n series, n, their key, alone): every fact now, a group
            at a time, then a stale marker for each series of the last write that is gone
            (known once the facts are through); None: a pause. A group is never split
            across requests unless it alone holds more series than a request, or holds a
            series refused before (``alone``: sent in a request of its own)."""
            nonlocal made, uncounted
            for key, group in self._current():
                had = current.get(key)
                # two groups of one key: first wins (the index gives one workload per
                # identity, PodIndex.fact_workloads, so only a safety net)
                whole = current[key] = group if had is None else union(had, group)
                skip = 0 if had is None else len(had.shape)
                n = len(whole.values) - skip
                suspects = refused.get(key) if refused else None
                if not skip and n <= limit and suspects is None:
                    if n:  # (the coverage of no pods has no series)
                        yield interleaver(whole.shape)(
                            whole.pieces + tuple(map(samples.__getitem__, whole.values))
                        ), n, key, False
                else:  # what the key had not made yet, a series at a time
                    for one, value in islice(zip(whole.series(), whole.values, strict=True),
                                             skip, None):
                        alone = suspects is not None and b"".join(one[1:]) in suspects
                        yield (*one, samples[value]), 1, key, alone
                if end_other and not skip and len(key) == 4:  # a workload's
                    for one in whole.series():
                        if _TRANSITION_NAME not in one:
                            continue
                        for this, other in _SOURCE_FIELDS.items():
                            ended = swapped(one, this, other, self._sample_len)
                            if ended is not None:
                                not_counted.add(b"".join(ended[1:]))
                                yield (*ended, stale), 1, key, False
                                break
                made += n
                if (made // PAUSE_EVERY_SERIES != (made - n) // PAUSE_EVERY_SERIES
                        or time.perf_counter() - started > PAUSE_AFTER_SECONDS):
                    yield None
            # a rebinding of _written during a pause (commit, forget) leaves this one whole
            for checked, (key, was) in enumerate(self._written.items(), 1):
                now = current.get(key)
                if now is None:
                    gone.extend((one, key) for one in was.series())
                elif now is not was:
                    kept = set(now.series())
                    gone.extend((one, key) for one in was.series() if one not in kept)
                if checked % PAUSE_EVERY_SERIES == 0:
                    yield None
            if gone:
                gone.sort(key=lambda item: series_bytes(item[0]))
                for one, key in gone:
                    suspects = refused.get(key) if refused else None
                    labels = b"".join(one[1:]) if suspects or inherited else b""
                    if inherited and labels in inherited:  # probably ended: not counted
                        not_counted.add(labels)
                        uncounted += 1
                    alone = suspects is not None and labels in suspects
                    yield (*one, stale), 1, key, alone

        for item in chunks():
            if item is None:
                yield b""
                started = time.perf_counter()
                continue
            pieces, n, key, alone = item
            if alone:  # refused before: a request of its own, so it spoils no other
                self.body_runs = [(key, 1)]
                yield b"".join(pieces)
                started = time.perf_counter()
                continue
            if count + n > limit:
                body, parts, count = b"".join(parts), [], 0
                self.body_runs, runs = runs, []
                yield body
                started = time.perf_counter()
            parts.extend(pieces)
            count += n
            if runs and runs[-1][0] is key:
                runs[-1] = (key, runs[-1][1] + n)
            else:
                runs.append((key, n))
        parts.append(METADATA)
        body = b"".join(parts)
        del parts
        self.body_runs = runs
        self.last_series = made
        self.metrics.series.set(made)
        self.last_stale_markers = len(gone) - uncounted
        self.last_uncounted_markers = uncounted
        yield body

    @staticmethod
    def _finish(bodies: Iterator[bytes]) -> None:
        """Make the rest of a write's requests without sending them, so what a failed
        write owes (``_pending``) and reports (``last_series``, ...) is the whole write's,
        as when every body was built before the first send."""
        for _ in bodies:
            pass

    @staticmethod
    async def _finish_pausing(bodies: Iterator[bytes], pacer: Pacer) -> None:
        """:meth:`_finish` with the event loop let in at every pause and request: an
        upstream that refuses fact writes would otherwise stop the loop for the rest of
        every write (~0.6-0.9 s at 37.5k pods, measured)."""
        for body in bodies:
            if body:
                await asyncio.sleep(0)
            else:
                await pacer.pause()

    def _pacer(self) -> Pacer:
        """The pauses of one write or standby walk."""
        return Pacer(self._busy, DEFER_SHARE * self._settings.interval_seconds)

    def build_requests(self, now_ms: int) -> list[bytes]:
        """All of :meth:`iter_requests` at once (its pauses left out)."""
        return [body for body in self.iter_requests(now_ms) if body]

    def build_request(self, now_ms: int) -> bytes:
        """All of :meth:`build_requests` in one body (protobuf messages concatenate)."""
        return b"".join(self.build_requests(now_ms))

    def track_standby(self, now: float) -> None:
        """Remember which fact series exist while another replica writes them.

        The series a leader wrote are the ones this replica sees too (the same cluster,
        the same index). On takeover, those gone by then get stale markers in the first
        write: otherwise what vanished between the old leader's last write and the new
        one's first would linger for the 5-minute lookback. Costs a walk of the groups
        per interval (no encoding of samples); a group not seen since ``takeover_window``
        before the holder's last sign of life is dropped (the holder, writing after it
        vanished, ended it), and one not seen for STANDBY_MEMORY seconds in any case (a
        TSDB has forgotten its series by itself by then).
        All at once: the writer's own loop takes it in stretches (:meth:`_standby_steps`).
        ``now`` is the wall clock (the samples' length); the sightings are timed on the
        monotonic clock.
        """
        for _ in self._standby_steps(now):
            pass

    def _standby_steps(self, now: float) -> Iterator[None]:
        """:meth:`track_standby`, yielding where the event loop may run: a standby's first
        walk encodes every pod and workload (a cold build, ~1.5 s at 100k pods) and a
        later one is ~0.12 s, which in one stretch held a standby replica's loop, its
        relayed requests and health checks, that long."""
        self._set_sample_len(timestamp_field(int(now * 1000)))
        now = self._mono()  # the sightings' times: ages, not dates
        standby = self._standby
        started = time.perf_counter()
        for key, group in self._current():
            seen = standby.get(key)
            if seen is None:
                standby[key] = {group: now}
            else:
                seen[group] = now
            if time.perf_counter() - started > PAUSE_AFTER_SECONDS:
                yield
                started = time.perf_counter()
        self._holder_seen = self._holder_alive(now)
        horizon = self._owed_since(now)
        if any(t < horizon for seen in standby.values() for t in seen.values()):
            kept = ((k, {g: t for g, t in seen.items() if t >= horizon})
                    for k, seen in standby.items())
            self._standby = {k: seen for k, seen in kept if seen}

    @property
    def takeover_window(self) -> float:
        """How long before the lease holder's last sign of life this replica saw (its last
        change of the lease record: a renewal, or the release at a stop or a step-down) a
        series may have vanished and still be unended by it: the series seen standing by
        since then are owed a marker on takeover, the older ones not (the holder, still
        writing after they vanished, ended them). The sum of:

        * the lease duration: how late the standby may have seen that change (a round
          every third of the lease, a read that may take the renew deadline, two thirds);
        * ``step_down_after`` (the longer of a lease and two intervals): how long the
          holder's writes may have failed on the way out before it gave the lease up, its
          markers unsent meanwhile;
        * TAKEOVER_INTERVALS intervals: its write before its last one (it may have died
          during that), the length of that write, and the interval within which this
          replica's walk saw a series vanish after it last saw it.

        15 + max(15, 2 * interval) + 3 * interval with the 15 s lease (90 s at the default
        15 s interval), against the STANDBY_MEMORY (300 s) a takeover owed for before. Not
        covered: a holder whose writes were refused for good (a 4xx: no step-down) for
        longer, or that took the lease and died before its first write (its predecessor's
        last write is then older): their series end with the lookback."""
        elector = self._elector
        lease = (elector.lease_duration if elector is not None
                 else float(self._settings.lease_duration_seconds))
        step_down = max(STEP_DOWN_LEASES * lease, STEP_DOWN_INTERVALS * self._interval)
        return lease + step_down + TAKEOVER_INTERVALS * self._interval

    def _holder_alive(self, now: float) -> float | None:
        """When (own monotonic clock, ``now`` being the present) the elector last saw the lease
        record change; None when it never saw one (or there is no election)."""
        if self._elector is None:
            return None
        ago = self._elector.record_seen_ago
        return now - ago if math.isfinite(ago) else None

    def _owed_since(self, now: float) -> float:
        """The oldest sighting (standing by) a takeover at ``now`` owes a marker for."""
        since = now - STANDBY_MEMORY
        if self._holder_seen is not None:
            since = max(since, self._holder_seen - self.takeover_window)
        return since

    def _inherited(self, now: float) -> list[tuple[Key, Group]]:
        """On takeover at ``now``: the groups seen standing by that are owed markers
        (seen since ``_owed_since``), and, in ``_inherited_ended``, the label fields of
        their series that the previous leader probably ended: seen last more than an
        interval before its last sign of life (it was writing every interval then), and
        not in a group seen later or written by this replica. Those are sent for safety
        (a marker sent twice is harmless; one never sent leaves the series for the
        lookback) but not counted as series going away."""
        since = self._owed_since(now)
        alive = self._holder_seen if self._holder_seen is not None else now
        counted_since = alive - self._interval
        owed: list[tuple[Key, Group]] = []
        ended: set[bytes] = set()
        for key, seen in self._standby.items():
            early: list[Group] = []
            late: set[Series] = set()
            for group, t in seen.items():
                if t < since:
                    continue
                owed.append((key, group))
                if t < counted_since:
                    early.append(group)
                else:
                    late.update(group.series())
            if early:
                own = self._written.get(key)
                if own is not None:
                    late.update(own.series())
                ended.update(b"".join(one[1:]) for group in early
                             for one in group.series() if one not in late)
        self._inherited_ended = ended
        return owed

    @staticmethod
    def _owed(written: dict[Key, Group], more: Iterable[tuple[Key, Group]]) -> dict[Key, Group]:
        """A new written set: every series of ``written`` and of ``more``, by key (what
        stale markers are owed for)."""
        out = dict(written)
        for key, group in more:
            had = out.get(key)
            out[key] = group if had is None or had is group else union(had, group)
        return out

    def commit(self) -> None:
        """Record the last built requests as delivered (their series are now 'written')."""
        self._written = self._pending
        self._end_other_source = False
        self._inherited_ended = set()  # ended, none of them owed any more
        self._prune_refused()
        self.metrics.stale_markers.inc(self.last_stale_markers)

    def _prune_refused(self) -> None:
        """Forget refused series of keys no longer written (a pod or workload gone)."""
        if self._refused:
            self._refused = {k: v for k, v in self._refused.items() if k in self._written}

    def commit_partial(self) -> None:
        """Some requests of a write failed: keep owing the stale markers of the series
        gone before, and owe them for every series of this write too (a marker for a
        series that never landed is harmless; a missing one leaves a ghost)."""
        self._written = self._owed(self._written, self._pending.items())

    def commit_refused(self, tally: _Delivery) -> None:
        """A write landed but for series refused on their own: what was sent is written;
        a refused stale marker stays owed (its key's old series with it: a second marker
        is harmless), and a refused series of now is owed one as any other."""
        self._written = self._owed(
            self._pending,
            ((k, g) for k, g in self._written.items() if k in tally.stale_keys))
        self._end_other_source = False
        self._prune_refused()
        self.metrics.stale_markers.inc(
            self.last_stale_markers - (tally.refused_stale - tally.refused_other))

    def forget(self) -> None:
        """Stop owning the written series (leadership lost: the next leader continues them)."""
        self._written = {}
        self._pending = {}
        self._refused = {}
        self._inherited_ended = set()

    # -- the counters, as tests and benchmarks read them -------------------------------

    @property
    def writes_ok(self) -> int:
        return int(sample_value(self.metrics.writes_ok))

    @property
    def writes_failed(self) -> int:
        return int(sample_value(self.metrics.writes_failed))

    @property
    def stale_markers_total(self) -> int:
        return int(sample_value(self.metrics.stale_markers))

    # -- the loop ------------------------------------------------------------------------

    @property
    def is_writer(self) -> bool:
        """This replica should write now: it holds the lease, or no election is set up."""
        return self._elector is None or self._elector.is_leader

    def step(self) -> WriterState:
        """Move to the state the election asks for; every transition happens here.

        STANDBY -> LEADER (takes over): owe stale markers for what the previous writer
        may have left unended, as far as this replica saw those series while standing by
        (``takeover_window``, :meth:`_inherited`).
        LEADER -> STANDBY (stands by): stop owning the written series; the next leader
        continues them.
        """
        target = WriterState.LEADER if self.is_writer else WriterState.STANDBY
        if target is self.state:
            return target
        self._failing_writes = 0
        if target is WriterState.LEADER:
            self._end_other_source = True
            now = self._mono()
            owed = self._inherited(now)
            log.info("fact writer takes over: owes stale markers for what it saw standing by "
                     "since %.0f s ago (%d of %d groups)", now - self._owed_since(now),
                     len(owed), sum(map(len, self._standby.values())))
            self._written = self._owed(self._written, owed)
            self._standby = {}
            self._holder_seen = None
        else:
            log.info("fact writer stands by")
            # what it wrote counts as seen standing by: leading again, it ends what went
            # meanwhile (a lease lost for a renewal or two, nobody else writing)
            now = self._mono()
            for k, g in self._written.items():
                self._standby.setdefault(k, {})[g] = now
            self.forget()
        self.state = target
        return target

    async def write_once(self) -> bool:
        """One interval: build and send the facts if this replica leads, else remember
        which series exist (standby); True when a write was sent."""
        # the interval's garbage, before the walk's end freezes whatever is alive
        memory.collect_unfrozen()
        if self.step() is WriterState.STANDBY:
            await self._stand_by(self._clock())
            return False
        now = self._clock()
        if self._beyond_limit(now) and await self._asked_upstream_time():
            now = self._clock()
        if self._clock_off(now):
            return False
        return await self._write(now)

    def clock_offset(self) -> float:
        """This host's wall clock less the upstream's, in seconds (NaN before an answer of
        the upstream with a ``Date`` came): ``karta_proxy_upstream_clock_offset_seconds``."""
        clock = self._upstream_clock
        offset = clock.offset(self._clock()) if clock is not None else None
        return math.nan if offset is None else offset

    def _beyond_limit(self, now: float) -> float | None:
        """This host's clock less the upstream's at ``now`` when it is more than
        ``facts.max_clock_offset_seconds`` (None within it, with no limit, or before an
        answer with a ``Date`` came)."""
        limit = self._settings.max_clock_offset_seconds
        clock = self._upstream_clock
        offset = clock.offset(now) if limit and clock is not None else None
        return offset if offset is not None and abs(offset) > limit else None

    async def _asked_upstream_time(self) -> bool:
        """Ask the upstream's time again with an empty write (no series, so no sample
        stamped with this host's clock): its answer's ``Date`` is the reading a hold is
        judged by. That reading ages: the upstream's clock may have been stepped right
        since, or this host's monotonic clock may have missed time its wall clock counted
        (a suspended VM resumed). Held writes send nothing, so no Date came, and a hold
        judged on the old reading lasted for ever. True when the upstream answered."""
        try:
            await self._send(b"")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the hold is then judged by the last reading
            log.debug("fact writer: asking the upstream's time failed: %s", exc)
            return False
        return True

    def _clock_off(self, now: float) -> bool:
        """Hold this write: this host's clock is more than ``facts.max_clock_offset_seconds``
        off the upstream's. Samples stamped an hour ahead made a Prometheus refuse every
        sender's current samples as ``out of bounds`` for an hour (upstream_clock's
        docstring); behind, every fact is refused as out of order or too old. Counted as a
        failed write, so a leader whose clock stays off gives the lease up to a replica
        whose clock may be right (:meth:`_egress_failed`); the start and the end of a hold
        are logged, not each write."""
        limit = self._settings.max_clock_offset_seconds
        offset = self._beyond_limit(now)
        if offset is None:
            if self._held_for_clock:
                self._held_for_clock = False
                log.info("fact writes resume: this host's clock is %.1f s off the "
                         "upstream's, within facts.max_clock_offset_seconds (%g)",
                         self.clock_offset(), limit)
            return False
        if not self._held_for_clock:
            self._held_for_clock = True
            log.error("fact writes held: this host's clock is %.1f s %s the upstream's "
                      "(the Date of its answers), more than facts.max_clock_offset_seconds "
                      "(%g); samples stamped so would be refused, or (ahead) make the TSDB "
                      "refuse every writer's current samples. Fix the host's time "
                      "synchronisation (NTP); the writes resume when the clocks agree",
                      abs(offset), "ahead of" if offset > 0 else "behind", limit,
                      extra={"offset_seconds": round(offset, 1), "limit_seconds": limit})
        self.metrics.writes_failed.inc()
        self._egress_failed(self._mono(), reason="clock_offset")
        return True

    def _stamp(self, now: float) -> int:
        """The timestamp (ms) of a write made at ``now``: later than the last write's, so
        that a step of this host's clock back (an NTP correction) does not make every fact
        an out-of-order sample until the clock is back where it was (an audit: a step of
        30 s back, 1,157 requests refused and 2,220 series counted refused in 6 s, the
        bisection taking each write to ~95 requests). Until then each write is 1 ms after
        the last."""
        stamp = max(int(now * 1000), self._last_stamp_ms + 1)
        self._last_stamp_ms = stamp
        return stamp

    async def _stand_by(self, now: float) -> None:
        """:meth:`track_standby` with the pauses of a write (a standby replica relays
        requests too)."""
        pacer = self._pacer()
        for _ in self._standby_steps(now):
            await pacer.pause()
        self.standby_walks += 1
        memory.freeze_survivors()  # the cache and the groups seen, as after a write
        await memory.trim_off_loop()  # the cache this walk replaced

    # -- delivery: a 400 bisected down to the series it refuses -----------------------

    async def _deliver(self, body: bytes, runs: list[Run],
                       tally: _Delivery) -> None:
        """Send ``body``; on a 400, send its halves, and theirs, down to the series the
        upstream refuses (Prometheus rolls back a whole request for one out-of-order
        sample: one series a sender forged under a fact's labels, ahead in time, stopped
        every fact request that held it). A refused series is left out of this write,
        counted, logged and remembered (``_refused``); ``tally.extra`` bounds the
        requests the halves take (``MAX_EXTRA_REQUESTS`` a write), past which a refused
        part is dropped whole (``tally.dropped``), as is a request refused with any other
        4xx (the request, not a series: a tenant's limit, auth). Anything else (a 5xx,
        no answer) raises: the upstream, not the request."""
        refusal = await self._send_or_refused(body)
        if refusal is not None:
            if not self.is_writer:  # the new leader's samples are newer: out of order
                tally.lost = True
                return
            await self._refused_body(body, runs, refusal.status, refusal.error, tally)
            return
        tally.accepted += 1
        if self._refused and len(runs) == 1 and runs[0][1] == 1:
            self._accepted_again(body, runs[0][0])

    async def _send_or_refused(self, body: bytes) -> _Refusal | None:
        """Send ``body``: None once sent, the refusal for a 4xx (the request's fault, which
        the caller bisects or drops); anything else raises (the upstream's fault: the write
        stops there)."""
        try:
            await self._send(body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            status = getattr(exc, "status", 0)
            if not 400 <= status < 500 or status in TRANSIENT_4XX:
                raise  # the upstream's (a 429: "later"), not the request's
            return _Refusal(status, exc)
        return None

    async def _refused_body(self, body: bytes, runs: list[Run], status: int,
                            exc: Exception, tally: _Delivery) -> None:
        """``body`` was refused with ``status``: bisect it (a 400) or drop it whole.

        Cut at series boundaries by :func:`proxy.wire.halves.layout`, as the upstream's
        413 split is, but halved by series count rather than by bytes
        (:meth:`Layout.middle`): a 400 is about a series, not a size, and by count one
        series of n is found in ceil(log2 n) levels (``MAX_EXTRA_REQUESTS``). The metadata
        goes with the last half, as it always has."""
        lay = layout(body, Protocol.V1)
        count = len(lay.series)
        keys: list[Key | None] = [key for key, n in runs for _ in range(n)]
        if len(keys) != count:  # not the writer's own layout: no key to remember
            keys = [None] * count

        async def refused(lo: int, hi: int, status: int, exc: Exception) -> None:
            if status == 400 and hi - lo == 1:
                start, end = lay.series[lo]
                self._refused_series(body[start:end], keys[lo], exc, tally)
                return
            if status != 400 or tally.extra + 2 > MAX_EXTRA_REQUESTS:
                if not tally.dropped:  # the first of this write
                    answer = getattr(exc, "answer", None)
                    hint = own_write_refused(status, answer.body if answer else b"")
                    self._dropped_lines.event(_answered(exc), {
                        "series": hi - lo, "error": str(exc)[:300], "hint": hint})
                tally.dropped += hi - lo
                return
            mid = (lo + hi) // 2
            for a, b in ((lo, mid), (mid, hi)):
                if not self.is_writer:  # the lease passed meanwhile: stop bisecting
                    tally.lost = True
                    return
                tally.extra += 1
                sub = await self._send_or_refused(lay.part(a, b, other_last=True))
                if sub is not None:
                    await refused(a, b, sub.status, sub.error)
                else:
                    tally.accepted += 1

        if count:  # (metadata alone: no fact lost)
            await refused(0, count, status, exc)

    def _refused_series(self, field: bytes, key: Key | None, exc: Exception,
                        tally: _Delivery) -> None:
        """One series the upstream refused on its own: counted, logged, remembered."""
        tally.refused += 1
        labels = labels_of(field)
        if field.endswith(self._stale_sample):
            tally.refused_stale += 1
            tally.refused_other += labels in self._uncounted
            if key is not None:
                tally.stale_keys.add(key)
        self.metrics.series_refused.inc()
        if key is not None:
            known = self._refused.get(key)
            if known is None and sum(map(len, self._refused.values())) < MAX_REFUSED_REMEMBERED:
                known = self._refused[key] = set()
            if known is not None and (labels in known
                                      or sum(map(len, self._refused.values()))
                                      < MAX_REFUSED_REMEMBERED):
                known.add(labels)
        text = series_text(labels)
        # a line per family and interval, naming the series (a summary the rest)
        self._refusal_lines.event(text.split("{", 1)[0],
                                  {"series": text, "error": str(exc)[:300]})

    def _accepted_again(self, body: bytes, key: Key) -> None:
        """A body of one series was accepted: if it was refused before, forget it."""
        known = self._refused.get(key)
        if known is None:
            return
        lay = layout(body, Protocol.V1)
        if len(lay.series) == 1:
            start, end = lay.series[0]
            known.discard(labels_of(body[start:end]))
            if not known:
                del self._refused[key]

    async def _write(self, now: float) -> bool:
        """Send one write's requests; what is owed afterwards follows what was sent."""
        started = self._mono()
        bodies = self.iter_requests(self._stamp(now))
        pacer = self._pacer()
        tally = _Delivery()
        sent = 0
        while True:
            try:
                body = next(bodies)
            except StopIteration:
                break
            except Exception:  # a bug in building (the loop logs it): owe what was sent
                self.commit_partial()
                raise
            if not body:  # a pause in the building
                await pacer.pause()
                continue
            try:
                await pacer.pause()  # a request that came meanwhile goes first
                if not self.is_writer:
                    # The lease passed to another replica during this write (a slow
                    # upstream, a long write): a request sent now would reach the upstream
                    # beside the new leader's (two writers), and its refusal as out of
                    # order, the new leader's samples being newer, read as series refused.
                    tally.lost = True
                else:
                    # a 4xx refuses this request (or, a 400, some of its series:
                    # bisected) for good: the others still go, or one would stop every
                    # later one of every write, pods, workloads, stale markers alike
                    await self._deliver(body, self.body_runs, tally)
            except asyncio.CancelledError:
                self._finish(bodies)
                self.commit_partial()
                raise
            except Exception as exc:
                # the next write retries; stale markers are kept
                await self._finish_pausing(bodies, pacer)
                self.commit_partial()
                self.metrics.writes_failed.inc()
                self._failed_lines.event(_answered(exc), {"error": str(exc)[:300]})
                self._egress_failed(started)
                return False
            del body
            if tally.lost:
                self._finish(bodies)
                break
            sent += 1
            if sent % TRIM_EVERY_REQUESTS == 0:
                await memory.trim_off_loop()
        if tally.lost:  # not a failure, and nothing refused: the next leader goes on
            self.commit_partial()
            log.info("fact write stopped: the lease passed to another replica")
            return False
        self.metrics.series_refused.inc(tally.dropped)
        self._failing_writes = 0  # answered: the way out works, whatever it refused
        if tally.dropped or not tally.accepted:
            self.commit_partial()
            self.metrics.writes_failed.inc()
            self._refused_lines.event("refused", {
                "refused_alone": tally.refused, "refused_with_request": tally.dropped,
                "requests_to_find_them": tally.extra})
            return False
        self.metrics.writes_ok.inc()
        self.metrics.last_write.set(now)
        if tally.refused:
            self.commit_refused(tally)
        else:
            self.commit()
        memory.freeze_survivors()  # the cache and the written set, out of full collections
        await memory.trim_off_loop()  # the written set this write replaced
        return True

    @property
    def _interval(self) -> float:
        """``facts.interval_seconds``, at least 50 ms (a write loop that never waits)."""
        return max(0.05, float(self._settings.interval_seconds))

    @property
    def step_down_after(self) -> float:
        """How long every write must have failed before a leader gives the lease up."""
        lease = self._elector.lease_duration if self._elector is not None else 0.0
        return max(STEP_DOWN_LEASES * lease,
                   STEP_DOWN_INTERVALS * self._interval)

    def _egress_failed(self, started: float, reason: str = "writes_failing") -> None:
        """A write that started at ``started`` (own clock) failed on the way out. A leader
        whose writes have all failed so for long enough gives the lease up: another
        replica's way out may work (one leader whose upstream answered 503 for 60 s kept
        the lease, and no fact was written for 60 s while two healthy standbys waited).
        When every replica's way out fails, the lease moves from one to the next at that
        pace: harmless, as nobody can write."""
        if self._failing_writes == 0:
            self._failing_since = started
        self._failing_writes += 1
        elector = self._elector
        if elector is None or not elector.is_leader:
            return
        failing = self._mono() - self._failing_since
        if self._failing_writes < STEP_DOWN_WRITES or failing < self.step_down_after:
            return
        cooldown = STEP_DOWN_COOLDOWN_LEASES * elector.lease_duration
        log.warning("fact writer steps down: its last %d fact writes failed (%s), over "
                    "%.1f s; the lease is given up for another replica to write, and this "
                    "one does not campaign for %.0f s", self._failing_writes, reason,
                    failing, cooldown,
                    extra={"reason": reason, "failed_writes": self._failing_writes,
                           "seconds": round(failing, 1), "cooldown_seconds": cooldown})
        self.metrics.stepdowns.labels(reason=reason).inc()
        self._failing_writes = 0
        elector.step_down(cooldown)

    async def _run(self) -> None:
        interval = self._interval
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.write_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in building must not end the facts for good
                log.exception("fact write crashed")
            next_at += interval
            now = loop.time()
            if next_at < now:  # fell behind (a slow send): skip, do not burst
                next_at = now + interval - (now - next_at) % interval
            await asyncio.sleep(next_at - now)

    async def start(self) -> None:
        if self._task is None and self._settings.enabled:
            self._task = asyncio.create_task(self._run(), name="fact-writer")

    async def stop(self, timeout: float = END_TIMEOUT_SECONDS) -> None:
        """Stop writing; a writer that was writing ends its own series (``OWN_SERIES``),
        waiting ``timeout`` seconds at most for them to be sent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.end_own_series(timeout)
        for lines in (self._refusal_lines, self._failed_lines, self._dropped_lines,
                      self._refused_lines):
            lines.close()

    def own_series_markers(self, now_ms: int) -> tuple[bytes, int]:
        """A request of stale markers for the ``OWN_SERIES`` this writer last wrote, and
        how many (b"", 0 when it wrote none)."""
        written = self._written.get(PROCESS_KEY)
        if written is None:
            return b"", 0
        ts_bytes = timestamp_field(now_ms)
        self._set_sample_len(ts_bytes)
        own = set(self._encode(f for f in process_facts(self._index, self._build_version,
                                                        self._cluster_uid())
                               if f.name in OWN_SERIES).series())
        ending = sorted((one for one in written.series() if one in own), key=series_bytes)
        stale = sample_field(STALE_NAN, ts_bytes)
        return b"".join(piece for one in ending for piece in (*one, stale)), len(ending)

    async def end_own_series(self, timeout: float = END_TIMEOUT_SECONDS) -> bool:
        """At a stop, while this replica still writes: stale markers for the series that
        say which process wrote (:data:`OWN_SERIES`), so they end with it instead of
        lingering for the lookback beside the next writer's. A successor of the same
        version starts them again at its first write. True when they were sent within
        ``timeout`` seconds."""
        if self.state is not WriterState.LEADER or not self.is_writer:
            return False
        now_ms = self._stamp(self._clock())
        body, markers = self.own_series_markers(now_ms)
        self._stale_sample = sample_field(STALE_NAN, timestamp_field(now_ms))
        if not markers:
            return False
        tally = _Delivery()
        try:  # one refused (a sender's series under its labels) spoils not the other
            await asyncio.wait_for(self._deliver(body, [(PROCESS_KEY, markers)], tally),
                                   max(0.0, timeout))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # they then end with the lookback, as after a crash
            # (a timeout's own text is empty: the line ended in ": ")
            log.warning("fact writer: could not end its own series at stop: %s",
                        failure_line(exc, timeout))
            return False
        self.metrics.series_refused.inc(tally.dropped)
        if tally.refused + tally.dropped >= markers:
            log.warning("fact writer: could not end its own series at stop: refused")
            return False
        self.metrics.stale_markers.inc(markers - tally.refused - tally.dropped)
        # ended: no longer owed (replaced, never changed in place: see _written)
        self._written = {k: g for k, g in self._written.items() if k != PROCESS_KEY}
        return True
