"""Fact series: what the index knows, published as series into the remote-write stream.

Facts only (attribution, identity, phase, desired and observed pods, freshness, versions):
never a measurement, an aggregate or a threshold; the aggregates ship as recording rules
(``config/rules/``). Every name comes from :mod:`proxy.contract` and is documented in
``docs/metrics.md``.

Two outlets share one producer (:func:`iter_facts`):

* :class:`FactWriter` encodes the facts as an RW 1.0 ``WriteRequest`` at a fixed interval,
  so they land in the same TSDB and tenant as the enriched series. Series that were
  written last time and are gone now (a deleted workload or pod, a desired-replica path
  that stopped answering) get a stale marker in the next write, so they end at once
  instead of lingering for Prometheus' 5-minute lookback. With several replicas, a
  :class:`proxy.lease.LeaseElector` lets only the leader write: the facts carry no
  per-replica label, so a leader change continues the same series.
* :class:`FactsCollector` serves the same facts on ``/metrics`` (a scrape has its own
  staleness handling, so no markers there).

The writer's encoder is a few lines of protobuf wire format on purpose: per write it only
appends the sample to label bytes cached per pod / workload object (the index replaces an
object when it changes, so identity tells what to re-encode). Building protobuf message
objects for 100k pods every 15 s would cost far more than the facts are worth.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

import proxy
from proxy import contract
from proxy.config import FactSettings
from proxy.index import PodIndex, stamped_pairs
from proxy.karta.model import GENERIC_PHASES, UNDEFINED
from proxy.karta.results import PodAttribution, WorkloadFacts
from proxy.wire.native import DEFAULT as SPLICE
from proxy.wire.primitives import encode_uvarint as _varint
from proxy.wire.primitives import len_field

if TYPE_CHECKING:
    from proxy.lease import LeaseElector

log = logging.getLogger(__name__)

#: Prometheus' stale marker: a NaN with this exact bit pattern ends a series.
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]

Labels = tuple[tuple[str, str], ...]


class Fact(NamedTuple):
    """One fact series: name, its labels (sorted, no ``__name__``, no empty values), value."""

    name: str
    labels: Labels
    value: float


#: help text per fact series (also the remote-write metadata and the /metrics HELP)
HELP: dict[str, str] = {
    contract.FACT_POD_INFO: "Attribution of a pod to its Karta workload, component, "
    "instance and replica (1 while the pod is known).",
    contract.FACT_POD_UNATTRIBUTED_INFO: "A known pod that no Karta description "
    "attributes, with the reason (1 while the pod is known).",
    contract.FACT_WORKLOAD_INFO: "A workload: its identity, the Karta description that "
    "describes it and whether that description is built in.",
    contract.FACT_WORKLOAD_PHASE: "Generic phase of a workload as a state set: 1 for the "
    "current phase, 0 for every other generic phase.",
    contract.FACT_WORKLOAD_PHASE_TRANSITION: "Unix time the workload's current phase "
    "began: from the object's conditions (source=object) or as this proxy saw it change "
    "(source=observed); time() minus this is the time in the current phase.",
    contract.FACT_WORKLOAD_STATUS: "Every generic status of a workload: 1 when its "
    "status mappings match, 0 otherwise.",
    contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO: "Why a workload's phase is Undefined "
    "(present only while it is).",
    contract.FACT_COMPONENT_DESIRED_REPLICAS: "Desired replicas of a component instance, "
    "from the description's scaleDefinition.replicasPath.",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN: "Lower bound of a component instance's "
    "desired replicas (scaleDefinition.minReplicasPath).",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX: "Upper bound of a component instance's "
    "desired replicas (scaleDefinition.maxReplicasPath).",
    contract.FACT_COMPONENT_OBSERVED_PODS: "Pods the index knows in a component instance.",
    contract.FACT_NAMESPACE_PODS: "Pods the index knows in a namespace, attributed or "
    "not; unattributed ones by reason.",
    contract.FACT_SOURCE_LAST_CURRENT: "Unix time a watched resource was last known "
    "current (list, event or bookmark).",
    contract.FACT_CONTRACT_INFO: "Version of the metric and label contract (docs/metrics.md).",
    contract.FACT_BUILD_INFO: "Version of karta-proxy.",
}


# -- the producer ----------------------------------------------------------------------------


def _sorted(pairs: Iterable[tuple[str, str]]) -> Labels:
    return tuple(sorted((k, v) for k, v in pairs if v))


_REASON_CODE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def reason_code(text: str) -> str:
    """The snake_case code of a reason (``"jq_error: <detail>"`` -> ``jq_error``).

    Details (jq messages, object values) would make a label value that changes with the
    object: one new series per message. The detail belongs in logs; the label keeps the
    bounded code.
    """
    code = text.split(":", 1)[0].strip()
    return code if _REASON_CODE.match(code) else "other"


def pod_facts(att: PodAttribution) -> list[Fact]:
    """The facts of one pod: its attribution, or why it has none."""
    base = (
        (contract.FACT_LABEL_NAMESPACE, att.namespace),
        (contract.FACT_LABEL_POD, att.pod),
        (contract.FACT_LABEL_UID, att.uid),
    )
    stamped = stamped_pairs(att)
    if stamped:
        return [Fact(contract.FACT_POD_INFO, _sorted((*base, *stamped)), 1.0)]
    reason = reason_code(att.reason) if att.reason else "unattributed"
    return [
        Fact(
            contract.FACT_POD_UNATTRIBUTED_INFO,
            _sorted((*base, (contract.FACT_LABEL_REASON, reason))),
            1.0,
        )
    ]


def coverage_facts(pods: Iterable[PodAttribution]) -> list[Fact]:
    """Attribution coverage: pods per namespace, attributed or unattributed by reason.

    So a dashboard or an alert reads coverage from a few series per namespace instead of
    counting the per-pod facts (one series per pod, and left out of /metrics by default).
    The same split as :func:`pod_facts`, counted in one pass: raw reasons first (a small
    set), then their codes. A namespace with pods always has its ``attributed`` series,
    0 when none is, so a share that falls to nothing is a 0, not a gap; a reason is
    present only while some pod has it (its series ends with a stale marker).
    """
    raw: Counter[tuple[str, str | None]] = Counter(
        (a.namespace, None if a.workload is not None else a.reason) for a in pods
    )
    attributed: Counter[str] = Counter()
    unattributed: Counter[tuple[str, str]] = Counter()
    for (namespace, reason), n in raw.items():
        if reason is None:
            attributed[namespace] += n
        else:
            attributed[namespace] += 0
            unattributed[namespace, reason_code(reason) if reason else "unattributed"] += n
    ns_label, state = contract.LABEL_NAMESPACE, contract.FACT_LABEL_STATE
    out = [
        Fact(
            contract.FACT_NAMESPACE_PODS,
            _sorted(((ns_label, namespace), (state, contract.STATE_ATTRIBUTED))),
            float(n),
        )
        for namespace, n in sorted(attributed.items())
    ]
    out.extend(
        Fact(
            contract.FACT_NAMESPACE_PODS,
            _sorted(
                (
                    (ns_label, namespace),
                    (state, contract.STATE_UNATTRIBUTED),
                    (contract.FACT_LABEL_REASON, code),
                )
            ),
            float(n),
        )
        for (namespace, code), n in sorted(unattributed.items())
    )
    return out


def workload_identity(wf: WorkloadFacts) -> Labels:
    """The stamped labels that name a workload, as every enriched series carries them."""
    r = wf.ref
    return _sorted(
        (
            (contract.LABEL_GROUP, r.group),
            (contract.LABEL_KIND, r.kind),
            (contract.LABEL_NAMESPACE, r.namespace),
            (contract.LABEL_WORKLOAD, r.name),
        )
    )


def workload_facts(wf: WorkloadFacts) -> list[Fact]:
    """Info, phase state set, transition time, statuses and replica facts of a workload."""
    ident = workload_identity(wf)
    out = [
        Fact(
            contract.FACT_WORKLOAD_INFO,
            _sorted(
                (
                    *ident,
                    (contract.FACT_LABEL_WORKLOAD_UID, wf.ref.uid),
                    (contract.FACT_LABEL_DESCRIPTION, wf.description),
                    (contract.FACT_LABEL_BUILTIN, "true" if wf.builtin else "false"),
                )
            ),
            1.0,
        )
    ]
    statuses = set(wf.statuses)
    for phase in GENERIC_PHASES:
        out.append(
            Fact(
                contract.FACT_WORKLOAD_PHASE,
                _sorted((*ident, (contract.FACT_LABEL_PHASE, phase))),
                1.0 if phase == wf.phase else 0.0,
            )
        )
    for status in GENERIC_PHASES:
        out.append(
            Fact(
                contract.FACT_WORKLOAD_STATUS,
                _sorted((*ident, (contract.FACT_LABEL_STATUS, status))),
                1.0 if status in statuses else 0.0,
            )
        )
    out.append(Fact(
        contract.FACT_WORKLOAD_PHASE_TRANSITION,
        _sorted((*ident, (contract.FACT_LABEL_SOURCE, wf.phase_since_source))),
        float(wf.phase_since),
    ))
    if wf.phase == UNDEFINED and wf.phase_reason:
        out.append(
            Fact(
                contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO,
                _sorted((*ident, (contract.FACT_LABEL_REASON, reason_code(wf.phase_reason)))),
                1.0,
            )
        )
    for rf in wf.replicas:
        labels = _sorted(
            (
                *ident,
                (contract.LABEL_COMPONENT, rf.component),
                (contract.LABEL_INSTANCE, rf.instance),
            )
        )
        for name, value in (
            (contract.FACT_COMPONENT_DESIRED_REPLICAS, rf.desired),
            (contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN, rf.min_desired),
            (contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX, rf.max_desired),
            (contract.FACT_COMPONENT_OBSERVED_PODS, float(rf.observed)),
        ):
            if value is not None and not math.isnan(value):
                out.append(Fact(name, labels, float(value)))
    return out


def process_facts(index: PodIndex, build_version: str = proxy.__version__) -> list[Fact]:
    """Facts about the proxy itself: freshness per watched resource, contract and build.

    ``karta_build_info`` is the process's one build-info series (on /metrics as well):
    the contract names it, so the operational twin it once had was dropped instead."""
    out = [
        Fact(
            contract.FACT_SOURCE_LAST_CURRENT,
            ((contract.FACT_LABEL_RESOURCE, resource),),
            float(when),
        )
        for resource, when in sorted(index.freshness.items())
        if resource
    ]
    out.append(
        Fact(
            contract.FACT_CONTRACT_INFO,
            ((contract.FACT_LABEL_VERSION, contract.CONTRACT_VERSION),),
            1.0,
        )
    )
    out.append(Fact(contract.FACT_BUILD_INFO, ((contract.FACT_LABEL_SPLICE, SPLICE),
                                              (contract.FACT_LABEL_VERSION, build_version)),
                    1.0))
    return out


def iter_facts(
    index: PodIndex, build_version: str = proxy.__version__, *, pods: bool = True
) -> Iterator[Fact]:
    """Every fact series of the index, in no particular order (``pods=False``: without the
    per-pod ones; the per-namespace coverage, a few series, is always there)."""
    pod_list = list(index.pods.values())
    yield from coverage_facts(pod_list)
    if pods:
        for att in pod_list:
            yield from pod_facts(att)
    del pod_list
    for wf in list(index.workloads.values()):
        yield from workload_facts(wf)
    yield from process_facts(index, build_version)


# -- RW 1.0 wire encoding ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 12)
def _label_field(name: str, value: str) -> bytes:
    """TimeSeries.labels (field 1) holding Label{name=1, value=2}. Cached: most pairs
    (identity labels, phases, external labels) repeat across thousands of series, one
    workload's ~20 series in a row. Small: pods' names and uids never repeat, and 64k
    entries held ~17 MB for them."""
    label = len_field(1, name.encode()) + len_field(2, value.encode())
    return len_field(1, label)


def encode_labels(name: str, labels: Labels, external: Labels = ()) -> bytes:
    """TimeSeries.labels fields: ``__name__`` + labels + external labels, sorted by name.

    A series' own label wins over an external label of the same name (Prometheus'
    external-label rule), so a misconfigured external label cannot duplicate a name.
    """
    merged = dict(external)
    merged.update(labels)
    merged["__name__"] = name
    return b"".join(_label_field(k, merged[k]) for k in sorted(merged) if merged[k])


def _sample_field(value: float, ts_bytes: bytes) -> bytes:
    """TimeSeries.samples (field 2) holding one Sample{value=1 double, timestamp=2}."""
    sample = b"\x09" + struct.pack("<d", value) + ts_bytes
    return b"\x12" + _varint(len(sample)) + sample


def _metadata(name: str) -> bytes:
    """WriteRequest.metadata (field 3): MetricMetadata{type=GAUGE, family, help}."""
    body = (
        b"\x08\x02"  # type = GAUGE
        + len_field(2, name.encode())
        + len_field(4, HELP.get(name, "").encode())
    )
    return len_field(3, body)


_METADATA = b"".join(_metadata(n) for n in contract.FACT_SERIES)


def _split_header(prefix: bytes) -> bytes:
    """The label bytes of a cached series prefix (``0x0a <varint length> <labels>``)."""
    i = 1
    while prefix[i] & 0x80:
        i += 1
    return prefix[i + 1 :]


# -- the writer --------------------------------------------------------------------------------

#: series per request: Prometheus refuses bodies over 32 MiB decoded and most receivers
#: prefer requests of a few thousand series; 100k pods make ~30 requests per write
MAX_SERIES_PER_REQUEST = 5000

#: how long a standby replica remembers a fact series it no longer sees: Prometheus'
#: default lookback, after which a series without samples is gone from queries anyway
STANDBY_MEMORY = 300.0

class Encoded(NamedTuple):
    """The fact series of one pod or workload, as the writer caches them between writes.

    A prefix is ``0x0a <length> <label fields>``, the TimeSeries header and labels, ready
    to be followed by the sample of a write; ``values[i]`` is the value of ``prefixes[i]``.
    Two tuples, not a (prefix, value) pair per series: 290k series at 37.5k pods, the
    pairs and lists were ~13 MB of the cache.
    """

    prefixes: tuple[bytes, ...]
    values: tuple[float, ...]


class FactWriter:
    """Writes the fact series into the remote-write stream every ``interval_seconds``.

    ``send`` gets uncompressed RW 1.0 ``WriteRequest`` bodies (``Upstream.send_v1``
    compresses and posts them), at most ``MAX_SERIES_PER_REQUEST`` series each.
    Only the lease holder writes when an ``elector`` is given. Stale markers follow what
    was last *successfully* sent: after a failed send the next write still ends the series
    that went away.
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
    ) -> None:
        self._settings = settings
        self._index = index
        self._send = send
        self._elector = elector
        self._clock = clock
        self._build_version = build_version
        self._max_series = max(1, max_series_per_request)
        self._external: Labels = _sorted(settings.external_labels.items())
        self._pod_cache: dict[str, tuple[PodAttribution, Encoded]] = {}
        self._workload_cache: dict[str, tuple[WorkloadFacts, Encoded]] = {}
        #: length of a sample field; the cached prefixes embed it (constant in practice:
        #: millisecond timestamps are 6-byte varints from 2004 to 2109)
        self._sample_len = -1
        #: prefixes of every series in the last successful write
        self._written: set[bytes] = set()
        #: what the last build produced (committed to _written once the send succeeds)
        self._pending: set[bytes] = set()
        #: while another replica writes: series prefix -> last time it existed here, kept
        #: for STANDBY_MEMORY seconds, so a takeover ends what the old leader left behind
        self._standby: dict[bytes, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._was_leader = False
        # counters for /metrics (FactWriterCollector)
        self.writes_ok = 0
        self.writes_failed = 0
        self.last_series = 0
        self.last_stale_markers = 0
        self.stale_markers_total = 0
        self.last_write_timestamp = 0.0
        self.last_build_seconds = 0.0

    # -- building ------------------------------------------------------------------------

    def _encode(self, facts: Iterable[Fact]) -> Encoded:
        prefixes: list[bytes] = []
        values: list[float] = []
        for f in facts:
            key = encode_labels(f.name, f.labels, self._external)
            prefixes.append(b"\x0a" + _varint(len(key) + self._sample_len) + key)
            values.append(f.value)
        return Encoded(tuple(prefixes), tuple(values))

    def _set_sample_len(self, n: int) -> None:
        if n == self._sample_len:
            return
        self._sample_len = n
        self._pod_cache.clear()
        self._workload_cache.clear()

        def rehead(p: bytes) -> bytes:
            key = _split_header(p)
            return b"\x0a" + _varint(len(key) + n) + key

        self._written = {rehead(p) for p in self._written}
        self._standby = {rehead(p): t for p, t in self._standby.items()}

    def _current(self) -> Iterator[tuple[bytes, float]]:
        """(prefix, value) of every fact series now, one at a time (a write's requests are
        made as they are sent); the index as it was when the first one is asked for."""
        pod_items = list(self._index.pods.items())
        workload_items = list(self._index.workloads.items())
        process = process_facts(self._index, self._build_version)
        coverage = coverage_facts(att for _, att in pod_items)
        pods: dict[str, tuple[PodAttribution, Encoded]] = {}
        for uid, att in pod_items:
            hit = self._pod_cache.get(uid)
            if hit is None or hit[0] is not att:
                hit = (att, self._encode(pod_facts(att)))
            pods[uid] = hit
            yield from zip(*hit[1], strict=True)
        del pod_items
        self._pod_cache = pods
        workloads: dict[str, tuple[WorkloadFacts, Encoded]] = {}
        for uid, wf in workload_items:
            whit = self._workload_cache.get(uid)
            if whit is None or whit[0] is not wf:
                whit = (wf, self._encode(workload_facts(wf)))
            workloads[uid] = whit
            yield from zip(*whit[1], strict=True)
        self._workload_cache = workloads
        yield from zip(*self._encode(coverage), strict=True)
        yield from zip(*self._encode(process), strict=True)

    def iter_requests(self, now_ms: int) -> Iterator[bytes]:
        """Uncompressed RW 1.0 WriteRequests holding every fact at ``now_ms``, plus stale
        markers for the series of the last successful write that are gone now.

        One request at a time, so a write holds one body, not all of them (~60 MB for
        290k fact series at 37.5k pods). ``_pending`` grows as the requests are made: a
        write that stops half-way owes markers for what it had sent (``commit_partial``).
        The statistics are set once the last request is made; ``last_build_seconds``
        counts the building only, not the time the caller spends between requests.
        """
        started = time.perf_counter()
        building = 0.0
        ts_bytes = b"\x10" + _varint(now_ms)
        samples: dict[float, bytes] = {}
        self._set_sample_len(len(_sample_field(0.0, ts_bytes)))
        seen: set[bytes] = set()
        self._pending = seen
        parts: list[bytes] = []
        count = 0
        limit = self._max_series
        for prefix, value in self._current():
            if prefix in seen:  # e.g. a workload re-created under the same name: first wins
                continue
            seen.add(prefix)
            sample = samples.get(value)
            if sample is None:
                sample = samples[value] = _sample_field(value, ts_bytes)
            parts.append(prefix)
            parts.append(sample)
            count += 1
            if count == limit:
                body, parts, count = b"".join(parts), [], 0
                building += time.perf_counter() - started
                yield body
                started = time.perf_counter()
        gone = self._written - seen
        if gone:
            stale = _sample_field(STALE_NAN, ts_bytes)
            for prefix in sorted(gone):
                parts.append(prefix)
                parts.append(stale)
                count += 1
                if count == limit:
                    body, parts, count = b"".join(parts), [], 0
                    building += time.perf_counter() - started
                    yield body
                    started = time.perf_counter()
        parts.append(_METADATA)
        body = b"".join(parts)
        del parts
        self.last_series = len(seen)
        self.last_stale_markers = len(gone)
        self.last_build_seconds = building + time.perf_counter() - started
        yield body

    @staticmethod
    def _finish(bodies: Iterator[bytes]) -> None:
        """Make the rest of a write's requests without sending them, so what a failed
        write owes (``_pending``) and reports (``last_series``, ...) is the whole write's,
        as when every body was built before the first send."""
        for _ in bodies:
            pass

    def build_requests(self, now_ms: int) -> list[bytes]:
        """All of :meth:`iter_requests` at once."""
        return list(self.iter_requests(now_ms))

    def build_request(self, now_ms: int) -> bytes:
        """All of :meth:`build_requests` in one body (protobuf messages concatenate)."""
        return b"".join(self.build_requests(now_ms))

    def track_standby(self, now: float) -> None:
        """Remember which fact series exist while another replica writes them.

        The series a leader wrote are the ones this replica sees too (the same cluster,
        the same index). On takeover, those gone by then get stale markers in the first
        write: otherwise what vanished between the old leader's last write and the new
        one's first would linger for the 5-minute lookback. Costs a key walk per interval
        (no encoding of samples); entries older than STANDBY_MEMORY are dropped, since a
        TSDB has forgotten them by itself by then.
        """
        self._set_sample_len(len(_sample_field(0.0, b"\x10" + _varint(int(now * 1000)))))
        standby = self._standby
        for prefix, _ in self._current():
            standby[prefix] = now
        horizon = now - STANDBY_MEMORY
        if any(t < horizon for t in standby.values()):
            self._standby = {k: t for k, t in standby.items() if t >= horizon}

    def commit(self) -> None:
        """Record the last built requests as delivered (their series are now 'written')."""
        self._written = self._pending
        self.stale_markers_total += self.last_stale_markers

    def commit_partial(self) -> None:
        """Some requests of a write failed: keep owing the stale markers of the series
        gone before, and owe them for every series of this write too (a marker for a
        series that never landed is harmless; a missing one leaves a ghost)."""
        self._written = self._written | self._pending

    def forget(self) -> None:
        """Stop owning the written series (leadership lost: the next leader continues them)."""
        self._written = set()
        self._pending = set()

    # -- the loop ------------------------------------------------------------------------

    @property
    def is_writer(self) -> bool:
        return self._elector is None or self._elector.is_leader

    async def write_once(self) -> bool:
        """Build and send one request if this replica writes; True when one was sent."""
        leader = self.is_writer
        if leader != self._was_leader:
            log.info("fact writer %s", "takes over" if leader else "stands by")
            self._was_leader = leader
            if leader:  # owe stale markers for what the previous writer wrote recently
                self._written = self._written | set(self._standby)
                self._standby = {}
            else:
                self.forget()
        if not leader:
            self.track_standby(self._clock())
            return False
        now = self._clock()
        bodies = self.iter_requests(int(now * 1000))
        while True:
            try:
                body = next(bodies)
            except StopIteration:
                break
            except Exception:  # a bug in building (the loop logs it): owe what was sent
                self.commit_partial()
                raise
            try:
                await self._send(body)
                await asyncio.sleep(0)  # let requests in flight interleave with a big write
            except asyncio.CancelledError:
                self._finish(bodies)
                self.commit_partial()
                raise
            except Exception as exc:  # the next write retries; stale markers are kept
                self._finish(bodies)
                self.commit_partial()
                self.writes_failed += 1
                log.warning("fact write failed: %s", exc)
                return False
            del body
        self.writes_ok += 1
        self.last_write_timestamp = now
        self.commit()
        return True

    async def _run(self) -> None:
        interval = max(0.05, float(self._settings.interval_seconds))
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

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- /metrics --------------------------------------------------------------------------------


class FactsCollector(Collector):
    """The fact series on ``/metrics`` (every replica, leader or not; no stale markers).

    No external labels here: the scraping Prometheus adds its own target labels. Scrape
    with ``honor_labels: true`` so the facts' ``namespace``/``pod`` labels are not renamed
    to ``exported_*`` by the target's.
    """

    def __init__(
        self,
        index: PodIndex,
        build_version: str = proxy.__version__,
        *,
        pod_facts: bool = True,
    ) -> None:
        self._index = index
        self._build_version = build_version
        self._pod_facts = pod_facts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {
            name: Metric(name, HELP[name], "gauge") for name in contract.FACT_SERIES
        }
        for f in iter_facts(self._index, self._build_version, pods=self._pod_facts):
            families[f.name].add_sample(f.name, dict(f.labels), f.value)
        for m in families.values():
            if m.samples:
                yield m


def _family(counter_name: str) -> str:
    return counter_name.removesuffix("_total")


class FactWriterCollector(Collector):
    """Operational metrics of the fact writer: is this replica the writer, how it fares."""

    def __init__(self, writer: FactWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self._writer
        leader = Metric(contract.OP_FACT_WRITER_LEADER, "1 when this replica writes the "
                        "fact series (lease holder, or no election configured).", "gauge")
        leader.add_sample(contract.OP_FACT_WRITER_LEADER, {}, 1.0 if w.is_writer else 0.0)
        yield leader
        writes = Metric(_family(contract.OP_FACT_WRITES), "Fact series writes by result.",
                        "counter")
        writes.add_sample(contract.OP_FACT_WRITES, {"result": "success"}, float(w.writes_ok))
        writes.add_sample(contract.OP_FACT_WRITES, {"result": "failure"}, float(w.writes_failed))
        yield writes
        stale = Metric(_family(contract.OP_FACT_STALE_MARKERS), "Stale markers written for "
                       "fact series that went away.", "counter")
        stale.add_sample(contract.OP_FACT_STALE_MARKERS, {}, float(w.stale_markers_total))
        yield stale
        series = Metric(contract.OP_FACT_SERIES, "Fact series in the last write.", "gauge")
        series.add_sample(contract.OP_FACT_SERIES, {}, float(w.last_series))
        yield series
        last = Metric(contract.OP_FACT_LAST_WRITE, "Unix time of the last successful "
                      "fact write.", "gauge")
        last.add_sample(contract.OP_FACT_LAST_WRITE, {}, w.last_write_timestamp)
        yield last
