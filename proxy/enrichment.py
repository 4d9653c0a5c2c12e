"""Enrichment: which labels name a series' pod (a :class:`SplicePlan` built from the
settings) and the per-pod table the splice reads, kept current by the index.

The per-series work is the splice's (``proxy.wire``): native when built, else the
pure-Python reference. Nothing here is per series: the table holds one entry per pod the
index knows (live pods, tombstones, known-but-unattributed pods), updated per pod event by
the index's listener, so memory grows with the cluster, never with the series count.

The same job done the plain way, through the generated protobuf classes, is the tests'
oracle: :mod:`proxy.enrichment_reference`.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from typing import Any, get_args

from proxy import contract
from proxy.config import ConflictPolicy, EnrichSettings, PodLabelRule, SenderKartaLabels
from proxy.index import PodIndex
from proxy.wire.native import Implementation, Splicer
from proxy.wire.plan import MetricRule, PodPair, SplicePlan, SpliceResult, Unless
from proxy.wire.primitives import Protocol

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
    max_labels_per_series: int = 0,
    cluster_check: tuple[str, str] | None = None,
) -> SplicePlan:
    """The splice plan of the ``enrich`` settings and ``upstream.max_labels_per_series``
    (``pod_label_rules`` None: the defaults; ``max_labels_per_series`` 0: no limit;
    ``cluster_check``: (``enrich.cluster_label``, the proxy's value of it), None: off)."""
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
        max_labels=max_labels_per_series,
        cluster=(None if cluster_check is None
                 else (cluster_check[0].encode(), cluster_check[1].encode())),
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
        max_labels_per_series: int = 0,
        cluster_check: tuple[str, str] | None = None,
    ) -> None:
        """``pod_label_rules`` None means the configured defaults; pass [] for none."""
        self._index = index
        self.plan = build_plan(pod_label_pairs, pod_label_rules, conflict_policy,
                               sender_karta_labels, max_labels_per_series, cluster_check)
        self._splicer = Splicer(self.plan, implementation)
        self.table = self._splicer.table
        self._unstamped = Splicer(self.plan, self._splicer.implementation)
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

    @property
    def splicer(self) -> Splicer:
        """The splice of the plan in force. A request cut into parts takes it once and
        splices every part with it: each part asking anew, a reload between two parts
        gave one request two plans (an audit stored 4 of 60 requests half one way)."""
        return self._splicer

    @property
    def unstamped_splicer(self) -> Splicer:
        """The plan in force over a pod table that stays empty: no series is stamped, the
        sender's ``karta_*`` labels are dropped as ever (a pass-through would let them in)
        and every series is counted. What a request is spliced with when none of its
        series may be stamped:

        - relayed before the index is ready (``server.forward_before_ready``). The index
          then holds some kinds and not yet others (pods are listed before their
          ReplicaSets), and its answer for a pod whose owner is not listed yet names a
          workload of the owner's kind: an audit saw every pod stamped ``ReplicaSet`` for
          the 6.9 s a start took, then ``Deployment``, two label sets for every series.
          Unstamped until ready, a series has one label set before and its own after;
        - stored under another cluster by its URL: an ``extra_label`` of the cluster label
          with another value than the proxy's (VictoriaMetrics sets it over the series'
          own), whatever the series say. The handler counts its series that name a pod
          ``other_cluster`` (:meth:`SpliceResult.stored_elsewhere`)."""
        return self._unstamped

    def prepare(self, plan: SplicePlan) -> Splicer:
        """A reload's new plan compiled for the splice in use (what can fail: the native
        plan takes its values as C sizes), over the same pod table; nothing in force
        changes until :meth:`replan` swaps it in. A reload calls this before it applies
        anything: compiled in ``replan``, a plan that did not compile failed the reload
        after the built-in switch was applied (500, half the new configuration in force)."""
        splicer = Splicer(plan, self._splicer.implementation)
        splicer.table = self.table
        return splicer

    def replan(self, plan: SplicePlan | Splicer) -> None:
        """A reload's new ``enrich`` settings: a new plan over the same pod table (a
        :class:`Splicer` from :meth:`prepare`, or a plan, prepared here). One attribute
        store swaps it, so a request in a worker thread splices with the plan it started
        with, and the next one with the new; given a ``Splicer``, nothing here fails."""
        splicer = plan if isinstance(plan, Splicer) else self.prepare(plan)
        # (compiled before anything is swapped: ``prepare`` compiled the same plan)
        unstamped = Splicer(splicer.plan, splicer.implementation)
        self._splicer, self.plan, self._unstamped = splicer, splicer.plan, unstamped

    # the tests' and benchmarks' way in (the handler splices with :attr:`splicer`, which
    # it passes the limits of its byte budget): the splice in force, no limit

    def enrich_v1(self, raw: bytes | memoryview) -> SpliceResult:
        return self._splicer.splice_v1(raw)

    def enrich_v2(self, raw: bytes | memoryview) -> SpliceResult:
        return self._splicer.splice_v2(raw)

    def enrich_snappy(self, protocol: Protocol, raw: bytes | memoryview, block: bytes,
                      base: int = 0) -> SpliceResult:
        """:meth:`enrich_v1` / :meth:`enrich_v2` with the body as a snappy block made from
        the sender's (``Splicer.splice_snappy``)."""
        return self._splicer.splice_snappy(protocol, raw, block, base)

    def _refresh(self, keys: Collection[tuple[bytes, bytes]]) -> None:
        """Index listener: the table's entries of these pods take the index's answer now
        (per pod event, never per series)."""
        answer = self._index.answer
        self.table.update([(ns, pod, answer(ns, pod)) for ns, pod in keys])
