"""Enrichment: which labels name a series' pod (a :class:`SplicePlan` built from the
settings) and the per-pod table the splice reads, kept current by the index.

The per-series work is the splice's (``proxy.wire``): native when built, else the
pure-Python reference. Nothing here is per series: the table holds one entry per pod the
index knows (live pods, tombstones, known-but-unattributed pods), updated per pod event by
the index's listener, so memory grows with the cluster, never with the series count.

:func:`enrich_reference` (``enrich_v1_reference`` / ``enrich_v2_reference``) does the same
job the plain way, through the generated protobuf classes: an oracle independent of the
wire code.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Collection, Sequence
from functools import partial
from typing import Any, get_args

from proxy import contract
from proxy.compression import DecodeError
from proxy.config import ConflictPolicy, EnrichSettings, PodLabelRule, SenderKartaLabels
from proxy.index import PodIndex
from proxy.wire.native import Grow, Implementation, Splicer
from proxy.wire.plan import (
    REASON_NO_POD_LABEL,
    MetricRule,
    PodPair,
    SplicePlan,
    SpliceResult,
    Unless,
)
from proxy.wire.primitives import Counts, Protocol

#: ``enrich.conflict_policy`` values, as the settings schema declares them
POLICIES: tuple[str, ...] = get_args(ConflictPolicy)
#: ``enrich.sender_karta_labels``: what happens to ``karta_*`` labels a sender put on
SENDER_KARTA_LABELS: tuple[str, ...] = get_args(SenderKartaLabels)


def default_pod_label_rules() -> list[PodLabelRule]:
    """The configured default rules (DCGM), for callers that pass none."""
    return EnrichSettings().pod_label_rules


def _pairs(pairs: Sequence[Any]) -> tuple[PodPair, ...]:
    out: list[PodPair] = []
    for pair in pairs:
        if isinstance(pair, tuple | list):
            ns, pod, unless = pair[0], pair[1], {}
        else:
            ns, pod, unless = pair.namespace, pair.pod, pair.unless
        out.append(PodPair(
            ns.encode(), pod.encode(),
            tuple(Unless.compile(label, rx) for label, rx in unless.items()),
        ))
    return tuple(out)


def build_plan(
    pod_label_pairs: Sequence[tuple[str, str]],
    pod_label_rules: Sequence[PodLabelRule] | None = None,
    conflict_policy: str = "replace",
    sender_karta_labels: str = "drop",
) -> SplicePlan:
    """The splice plan of the ``enrich`` settings (``pod_label_rules`` None: the defaults)."""
    if conflict_policy not in POLICIES:
        raise ValueError(f"conflict_policy must be one of {POLICIES}, not {conflict_policy!r}")
    if sender_karta_labels not in SENDER_KARTA_LABELS:
        raise ValueError(f"sender_karta_labels must be one of {SENDER_KARTA_LABELS}, "
                         f"not {sender_karta_labels!r}")
    if not pod_label_pairs:
        raise ValueError("pod_label_pairs must name at least one (namespace, pod) pair")
    rules = default_pod_label_rules() if pod_label_rules is None else pod_label_rules
    return SplicePlan(
        pairs=_pairs(pod_label_pairs),
        # the reserved names first: a series named karta_* names no pod
        rules=(MetricRule(contract.METRIC_PREFIX.encode(), ()),
               *(MetricRule(r.metric_prefix.encode(), _pairs(r.pod_label_pairs))
                 for r in rules)),
        keep_sent=conflict_policy == "keep",
        stamped=frozenset(n.encode() for n in contract.STAMPED_LABELS),
        workload_label=contract.LABEL_WORKLOAD.encode(),
        drop_sent=sender_karta_labels == "drop",
    )


class Enricher:
    """Stamps the index's labels onto the series of RW 1.0 / 2.0 requests.

    Safe to call from worker threads: the native splice releases the GIL and reads the
    table under its read lock, while index listeners (on the event loop) update it.
    """

    def __init__(
        self,
        index: PodIndex,
        pod_label_pairs: Sequence[tuple[str, str]],
        *,
        conflict_policy: str = "replace",
        pod_label_rules: Sequence[PodLabelRule] | None = None,
        implementation: Implementation | None = None,
        sender_karta_labels: str = "drop",
    ) -> None:
        """``pod_label_rules`` None means the configured defaults; pass [] for none."""
        self._index = index
        self.plan = build_plan(pod_label_pairs, pod_label_rules, conflict_policy,
                               sender_karta_labels)
        self._splicer = Splicer(self.plan, implementation)
        self.table = self._splicer.table
        self.table.update(list(index.answers()))
        ref = weakref.ref(self)

        def on_pods(keys: Collection[tuple[bytes, bytes]]) -> None:
            enricher = ref()
            if enricher is not None:
                enricher._refresh(keys)

        index.subscribe_pods(on_pods)

    @property
    def implementation(self) -> Implementation:
        """Which splice runs: "native" or "python"."""
        return self._splicer.implementation

    def replan(self, plan: SplicePlan) -> None:
        """A reload's new ``enrich`` settings: a new plan over the same pod table. One
        attribute store swaps it, so a request in a worker thread splices with the plan
        it started with, and the next one with the new."""
        splicer = Splicer(plan, self._splicer.implementation)
        splicer.table = self.table
        self._splicer, self.plan = splicer, plan

    def enrich_v1(self, raw: bytes | memoryview, limit: int | None = None,
                  grow: Grow | None = None) -> SpliceResult:
        """``limit``, ``grow``: what the splice may hold beside ``raw``
        (``Splicer.splice_v1``)."""
        return self._splicer.splice_v1(raw, limit, grow)

    def enrich_v2(self, raw: bytes | memoryview, limit: int | None = None,
                  grow: Grow | None = None) -> SpliceResult:
        return self._splicer.splice_v2(raw, limit, grow)

    def enrich_snappy(self, protocol: Protocol, raw: bytes | memoryview, block: bytes,
                      base: int = 0, limit: int | None = None, grow: Grow | None = None
                      ) -> SpliceResult:
        """:meth:`enrich_v1` / :meth:`enrich_v2` with the body as a snappy block made from
        the sender's (``Splicer.splice_snappy``)."""
        return self._splicer.splice_snappy(protocol, raw, block, base, limit, grow)

    def _refresh(self, keys: Collection[tuple[bytes, bytes]]) -> None:
        """Index listener: the table's entries of these pods take the index's answer now
        (per pod event, never per series)."""
        answer = self._index.answer
        self.table.update([(ns, pod, answer(ns, pod)) for ns, pod in keys])


# -- the plain reference ------------------------------------------------------------------


def _reference_decision(
    labels: list[tuple[str, str]],
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str,
    pod_label_rules: Sequence[PodLabelRule] | None,
    sender_karta_labels: str,
) -> tuple[list[tuple[str, str]] | None, str, bool]:
    """(new labels or None for unchanged, reason, whether a sender's karta_* label was
    lost) — written for clarity, not speed."""
    names = [n for n, _ in labels]
    if "" in names or len(set(names)) != len(names):
        raise DecodeError("invalid_labels", 400, "an empty or repeated label name")
    present = dict(labels)
    in_order = names == sorted(names)
    if conflict_policy == "keep" and present.get(contract.LABEL_WORKLOAD):
        return (None if in_order else sorted(labels)), "", False

    def dropped(name: str) -> bool:
        return name in contract.STAMPED_LABELS or (
            sender_karta_labels == "drop" and name.startswith(contract.STAMPED_PREFIX))

    def unstamped(reason: str) -> tuple[list[tuple[str, str]] | None, str, bool]:
        # whatever else happens, the labels go out sorted
        kept = [(n, v) for n, v in labels if sender_karta_labels == "keep" or not dropped(n)]
        lost = len(kept) != len(labels)
        return (None if in_order and not lost else sorted(kept)), reason, lost

    rules = default_pod_label_rules() if pod_label_rules is None else pod_label_rules
    metric = present.get("__name__", "")
    pairs: list[tuple[str, str, dict[str, str]]] = [(ns, pod, {}) for ns, pod in pod_label_pairs]
    for rule in rules:
        if metric.startswith(rule.metric_prefix):
            pairs = [(p.namespace, p.pod, p.unless) for p in rule.pod_label_pairs]
            break
    if metric.startswith(contract.METRIC_PREFIX):
        pairs = []
    for ns_name, pod_name, unless in pairs:
        ns = present.get(ns_name, "")
        pod = present.get(pod_name, "")
        if ns and pod and not any(
            re.fullmatch(rx, present.get(label, "")) for label, rx in unless.items()
        ):
            break
    else:
        return unstamped(REASON_NO_POD_LABEL)
    stamped = index.lookup(ns.encode(), pod.encode())
    if stamped is None:
        return unstamped(index.reason(ns.encode(), pod.encode()))
    if not [v for _, v in stamped if v]:
        return unstamped("")
    kept = [(n, v) for n, v in labels if not dropped(n)]
    new = sorted([*kept, *stamped], key=lambda nv: nv[0].encode())
    lost = any(dropped(n) and (n, v) not in stamped for n, v in labels)
    return new, "", lost


def _parse_reference(msg: Any, raw: bytes) -> Any:
    try:
        msg.ParseFromString(raw)
    except Exception as exc:
        raise DecodeError("protobuf_invalid", 400, f"invalid protobuf: {exc}") from None
    return msg


def _count_reference(counts: Counts, ts: Any) -> None:
    counts.series += 1
    counts.samples += len(ts.samples)
    counts.exemplars += len(ts.exemplars)
    counts.histograms += len(ts.histograms)


class _RequestV1:
    """A parsed RW 1.0 request: a series' labels are its own name/value pairs."""

    def __init__(self, raw: bytes) -> None:
        from proxy.pb.prometheus import remote_pb2

        self.message = _parse_reference(remote_pb2.WriteRequest(), raw)

    def labels(self, ts: Any) -> list[tuple[str, str]]:
        return [(lb.name, lb.value) for lb in ts.labels]

    def relabel(self, ts: Any, new: list[tuple[str, str]]) -> None:
        del ts.labels[:]
        for n, v in new:
            ts.labels.add(name=n, value=v)


class _RequestV2:
    """A parsed RW 2.0 request: a series' labels are references into the request's
    symbol table, which new names and values are appended to (the empty string first)."""

    def __init__(self, raw: bytes) -> None:
        from proxy.pb.io.prometheus.write.v2 import types_pb2

        self.message = _parse_reference(types_pb2.Request(), raw)
        self._symbols = list(self.message.symbols)
        self._where = {s: i for i, s in reversed(list(enumerate(self._symbols)))}

    def labels(self, ts: Any) -> list[tuple[str, str]]:
        refs = list(ts.labels_refs)
        return [(self._symbols[refs[i]], self._symbols[refs[i + 1]])
                for i in range(0, len(refs), 2)]

    def relabel(self, ts: Any, new: list[tuple[str, str]]) -> None:
        if not self._symbols:
            self._add("")
        out = [self._ref(s) for n, v in new for s in (n, v)]
        del ts.labels_refs[:]
        ts.labels_refs.extend(out)

    def _ref(self, s: str) -> int:
        if s not in self._where:
            self._add(s)
        return self._where[s]

    def _add(self, s: str) -> None:
        self._where[s] = len(self._symbols)
        self._symbols.append(s)
        self.message.symbols.append(s)


def enrich_reference(
    protocol: Protocol,
    raw: bytes,
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str = "replace",
    pod_label_rules: Sequence[PodLabelRule] | None = None,
    sender_karta_labels: str = "drop",
) -> SpliceResult:
    """The same result as :meth:`Enricher.enrich_v1` / :meth:`Enricher.enrich_v2`,
    through full protobuf objects."""
    req = _RequestV1(raw) if protocol is Protocol.V1 else _RequestV2(raw)
    result = SpliceResult(raw, Counts())
    for ts in req.message.timeseries:
        _count_reference(result.counts, ts)
        new, reason, lost = _reference_decision(
            req.labels(ts), index, pod_label_pairs, conflict_policy, pod_label_rules,
            sender_karta_labels,
        )
        result.tally(reason)
        result.stripped += lost
        if new is not None:
            req.relabel(ts, new)
    result.body = req.message.SerializeToString()
    return result


#: the reference of one protocol, called as ``enrich_reference`` without ``protocol``
enrich_v1_reference = partial(enrich_reference, Protocol.V1)
enrich_v2_reference = partial(enrich_reference, Protocol.V2)
