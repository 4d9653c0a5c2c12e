"""The enrichment done the plain way, through the generated protobuf classes: the oracle
:class:`proxy.enrichment.Enricher` is held equal to.

:func:`enrich_reference` (``enrich_v1_reference`` / ``enrich_v2_reference``) parses the
whole request into protobuf objects, decides each series' labels from the settings in
plain Python (``re``, dicts, ``sorted``) and serializes the request again: nothing of the
wire code (``proxy.wire``'s splices, native or pure Python) is shared, so an agreement
between the two means something. Written for clarity, never for speed.

No production module imports it (``tests/test_layout.py`` checks). It stays in the
package, not under ``tests/``, because the differential and property tests
(``tests/test_enrichment*.py``) and ``benchmarks/splice_bench.py`` (the plain-protobuf
baseline) import it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from typing import Any

from proxy import contract
from proxy.compression import DecodeError
from proxy.config import PodLabelRule
from proxy.enrichment import default_pod_label_rules
from proxy.index import PodIndex
from proxy.wire.plan import REASON_NO_POD_LABEL, REASON_OTHER_CLUSTER, SpliceResult
from proxy.wire.primitives import Counts, Protocol


def _reference_decision(
    labels: list[tuple[str, str]],
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str,
    pod_label_rules: Sequence[PodLabelRule] | None,
    sender_karta_labels: str,
    cluster_check: tuple[str, str] | None = None,
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

    if cluster_check is not None:
        label, ours = cluster_check
        if present.get(label, "") not in ("", ours):
            return unstamped(REASON_OTHER_CLUSTER)
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
    cluster_check: tuple[str, str] | None = None,
) -> SpliceResult:
    """The same result as :meth:`Enricher.enrich_v1` / :meth:`Enricher.enrich_v2`,
    through full protobuf objects (``cluster_check``: ``Enricher``'s)."""
    req = _RequestV1(raw) if protocol is Protocol.V1 else _RequestV2(raw)
    result = SpliceResult(raw, Counts())
    for ts in req.message.timeseries:
        _count_reference(result.counts, ts)
        labels = req.labels(ts)
        new, reason, lost = _reference_decision(
            labels, index, pod_label_pairs, conflict_policy, pod_label_rules,
            sender_karta_labels, cluster_check,
        )
        if reason == REASON_OTHER_CLUSTER and result.other_cluster is None \
                and cluster_check is not None:
            result.other_cluster = dict(labels)[cluster_check[0]].encode()
        result.tally(reason)
        result.stripped += lost
        if new is not None:
            req.relabel(ts, new)
    result.body = req.message.SerializeToString()
    return result


#: the reference of one protocol, called as ``enrich_reference`` without ``protocol``
enrich_v1_reference = partial(enrich_reference, Protocol.V1)
enrich_v2_reference = partial(enrich_reference, Protocol.V2)
