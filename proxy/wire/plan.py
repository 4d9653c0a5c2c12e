"""What a splice is told and what it answers: which labels name a series' pod
(:class:`SplicePlan`), the per-pod answers it stamps (:class:`PodStamp`, kept in a pod
table), and the outcome of one request (:class:`SpliceResult`).

The decision here (:func:`decide`) is the reference the native splice
(``proxy/wire/_splice.c``) mirrors label for label; both splices read a plan and a pod
table and nothing else, so the two can be held equal by differential tests.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise

from proxy.compression import DecodeError
from proxy.shown import shown
from proxy.wire.primitives import Counts, encode_label_v1

#: every reason a splice itself gives (the pod table's entries carry the engine's)
REASON_NO_POD_LABEL = "no_pod_label"
REASON_POD_UNKNOWN = "pod_unknown"
#: the stamp would push the series past the TSDB's label limit (``SplicePlan.max_labels``)
REASON_LABEL_LIMIT = "label_limit"
#: the series names another cluster than the proxy's (``SplicePlan.cluster``): stamped
#: with this cluster's pods it would charge them to that cluster's workloads of the name
REASON_OTHER_CLUSTER = "other_cluster"
#: the reasons above, each exposed at 0 from the start: an alert's ``increase()`` over a
#: series made by its first increment misses that burst (KartaProxyOtherClusterSeries
#: slept through a first sender of another cluster)
SPLICE_REASONS = (REASON_NO_POD_LABEL, REASON_POD_UNKNOWN, REASON_LABEL_LIMIT,
                  REASON_OTHER_CLUSTER)
NAME_LABEL = b"__name__"
#: labels of this prefix belong to the proxy: a sender's are dropped (``drop_sent``)
KARTA_PREFIX = b"karta_"
#: label names a plan may read (the native splice's fixed table holds 1024)
MAX_LABEL_NAMES = 1000

#: characters that stand for themselves in a regex
_LITERAL = re.compile(r"[A-Za-z0-9_\-/:=@ ]*")


@dataclass(frozen=True, slots=True)
class Unless:
    """A pair is skipped when this label's value (missing reads "") fully matches."""

    label: bytes
    #: the pattern as a set of literals, when it is only an alternation of them (the
    #: DCGM default is): the native splice matches those without the regex engine
    literals: frozenset[bytes] | None
    #: the value pattern, compiled (its text: ``regex.pattern``)
    regex: re.Pattern[str]

    @classmethod
    def compile(cls, label: str, pattern: str) -> Unless:
        regex = re.compile(pattern)
        alts = pattern.split("|")
        literals = (
            frozenset(a.encode() for a in alts)
            if all(_LITERAL.fullmatch(a) for a in alts)
            else None
        )
        return cls(label.encode(), literals, regex)

    def matches(self, value: bytes) -> bool:
        if self.literals is not None:
            return value in self.literals
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:  # pragma: no cover - label values are checked first
            raise DecodeError(
                "invalid_utf8", 400, f"label value is not valid UTF-8: {value[:64]!r}"
            ) from None
        return self.regex.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class PodPair:
    """A (namespace label, pod label) pair naming the pod a series belongs to."""

    namespace: bytes
    pod: bytes
    unless: tuple[Unless, ...] = ()


@dataclass(frozen=True, slots=True)
class MetricRule:
    """Pairs used instead of the defaults for metrics whose name starts with ``prefix``."""

    prefix: bytes
    pairs: tuple[PodPair, ...]


@dataclass(frozen=True, slots=True)
class SplicePlan:
    """Everything a splice needs besides the request and the pod table."""

    pairs: tuple[PodPair, ...]
    rules: tuple[MetricRule, ...] = ()
    #: conflict policy ``keep``: a series carrying a non-empty ``karta_workload`` of its
    #: own passes through unchanged (and counts as attributed)
    keep_sent: bool = False
    #: the label names the proxy stamps: a sender's labels of these names are replaced
    stamped: frozenset[bytes] = frozenset()
    #: the label whose presence ``keep_sent`` looks at
    workload_label: bytes = b"karta_workload"
    #: ``sender_karta_labels: drop``: every label of the sender whose name starts with
    #: ``karta_`` is removed from every series, stamped or not (False: only the stamped
    #: names, and only from a series that is stamped). A series ``keep_sent`` lets pass
    #: keeps its labels either way: that policy trusts the sender's attribution.
    drop_sent: bool = True
    #: ``upstream.max_labels_per_series`` (0: no limit): a series the stamp would push past
    #: it is forwarded unstamped (``label_limit``), since a TSDB at its limit drops the
    #: labels that sort last (VictoriaMetrics, silently: series merge) or refuses the whole
    #: request (Mimir). One the sender sent past it goes unstamped too.
    max_labels: int = 0
    #: ``enrich.cluster_label`` and this proxy's value of it (``facts.external_labels``):
    #: a series carrying that label with another non-empty value is not stamped
    #: (``other_cluster``), since the pod index is this cluster's only; None: no check
    cluster: tuple[bytes, bytes] | None = None

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("a splice plan needs at least one (namespace, pod) pair")
        if self.max_labels < 0:
            raise ValueError("max_labels must be 0 (no limit) or more")
        if self.cluster is not None:
            label, value = self.cluster
            if not label or not value:
                raise ValueError("the cluster check needs a label name and a value")
            if label.startswith(KARTA_PREFIX) or label == NAME_LABEL:
                # a sender's karta_* labels are dropped before anything reads them
                raise ValueError(f"the cluster label may not be {label!r}")
        names = self.names | self.stamped
        if len(names) > MAX_LABEL_NAMES:
            raise ValueError(
                f"the pod label pairs and rules read {len(names)} distinct label names "
                f"(with the stamped ones); at most {MAX_LABEL_NAMES}"
            )
        if any(not n for n in names):
            raise ValueError("a label name of the pod label pairs or rules is empty")

    def dropped(self, name: bytes) -> bool:
        """Is a sender's label of this name removed (from a stamped series; from any
        series under ``drop_sent``)?"""
        return name in self.stamped or (self.drop_sent and name.startswith(KARTA_PREFIX))

    def pairs_for(self, metric: bytes) -> tuple[PodPair, ...]:
        for rule in self.rules:
            if metric.startswith(rule.prefix):
                return rule.pairs
        return self.pairs

    def other_cluster(self, labels: Mapping[bytes, bytes]) -> bytes | None:
        """The series' value of the cluster label when it names another cluster, else None
        (no check, no label, an empty value: a series that claims no cluster)."""
        if self.cluster is None:
            return None
        seen = labels.get(self.cluster[0])
        return seen if seen and seen != self.cluster[1] else None

    def find(self, labels: Mapping[bytes, bytes]) -> tuple[bytes, bytes] | None:
        """The first usable pair's (namespace, pod) values, or None (``no_pod_label``)."""
        for pair in self.pairs_for(labels.get(NAME_LABEL, b"")):
            ns = labels.get(pair.namespace)
            pod = labels.get(pair.pod)
            if ns and pod and not any(u.matches(labels.get(u.label, b"")) for u in pair.unless):
                return ns, pod
        return None

    @property
    def names(self) -> frozenset[bytes]:
        """Every label name a decision reads."""
        pairs = [*self.pairs, *(p for r in self.rules for p in r.pairs)]
        return frozenset(
            {NAME_LABEL, self.workload_label}
            | {n for p in pairs for n in (p.namespace, p.pod)}
            | {u.label for p in pairs for u in p.unless}
            | ({self.cluster[0]} if self.cluster is not None else set())
        )


@dataclass(frozen=True, slots=True)
class PodStamp:
    """The labels stamped onto a pod's series, sorted by name, and their RW 1.0 fields."""

    labels: tuple[tuple[bytes, bytes], ...]
    fields: tuple[bytes, ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> PodStamp:
        labels = tuple(sorted((n.encode(), v.encode()) for n, v in pairs if v))
        return cls(labels, tuple(encode_label_v1(n, v) for n, v in labels))


#: what a pod table answers for a (namespace, pod): a stamp, or why there is none
PodAnswer = PodStamp | str


@dataclass(frozen=True, slots=True)
class LabelLimited:
    """A series the stamp would have pushed past the label limit (``label_limit``): what
    the proxy's log line names, the first of a request's."""

    #: its ``__name__`` (b"" when it has none)
    metric: bytes
    #: how many labels it would have had with the stamp
    labels: int
    #: the limit (``SplicePlan.max_labels``)
    limit: int


@dataclass(frozen=True, slots=True)
class Decision:
    """One series' decision: ``reason`` "" with a ``stamp`` to stamp, "" without one
    attributed as it is (``keep``), else unattributed for ``reason`` (``limited`` set for
    ``label_limit``, ``cluster_seen`` for ``other_cluster``)."""

    reason: str
    stamp: PodStamp | None = None
    limited: LabelLimited | None = None
    #: the other cluster's value the series carries (``other_cluster``)
    cluster_seen: bytes | None = None


def decide(
    plan: SplicePlan,
    labels: Sequence[tuple[bytes, bytes]],
    lookup: Callable[[bytes, bytes], PodAnswer | None],
) -> Decision:
    """The decision of one series. Names are unique (:func:`check_names`)."""
    by_name = dict(labels)
    if plan.keep_sent and by_name.get(plan.workload_label):
        return Decision("")
    seen = plan.other_cluster(by_name)
    if seen is not None:
        return Decision(REASON_OTHER_CLUSTER, cluster_seen=seen)
    found = plan.find(by_name)
    if found is None:
        return Decision(REASON_NO_POD_LABEL)
    answer = lookup(*found)
    if answer is None:
        return Decision(REASON_POD_UNKNOWN)
    if isinstance(answer, str):
        return Decision(answer)
    limit = plan.max_labels
    if limit and limit < len(labels) + len(answer.labels):
        # (the first test is all a series within the limit with its stamp costs): the
        # stamp replaces the labels the plan drops, so those are not counted. A series
        # sent past the limit already goes unstamped too: the stamp would only push more
        # of its own labels past what the TSDB keeps (VictoriaMetrics drops the last)
        total = sum(not plan.dropped(n) for n, _ in labels) + len(answer.labels)
        if total > limit:
            return Decision(REASON_LABEL_LIMIT, None,
                            LabelLimited(by_name.get(NAME_LABEL, b""), total, limit))
    return Decision("", answer)


def names_sorted(names: Sequence[bytes]) -> bool:
    """Strictly increasing (byte order of UTF-8 is code-point order, Prometheus')."""
    return all(a < b for a, b in pairwise(names))


#: the refusal of a series that would leave with no labels with a value (``check_kept``;
#: the native splice's ``NO_LABELS_LEFT`` says the same)
NO_LABELS_LEFT = ("a series whose only labels with a value are karta_* would be forwarded "
                  "with no labels with a value (sender_karta_labels: drop removes them, and "
                  "a TSDB reads a label with an empty value as absent), and the TSDB "
                  "refuses an empty label set")


def series_named(index: int, labels: Sequence[tuple[bytes, bytes]]) -> str:
    """Which series a refusal is about, so that an operator finds it among thousands: its
    index in the request (0-based; in RW 1.0 the series' place among the request's series
    fields) and its ``__name__`` (the first one, :func:`shown`)."""
    name = next((v for n, v in labels if n == NAME_LABEL), None)
    named = "no __name__" if name is None else f'__name__ "{shown(name)}"'
    return f" (series {index} of the request, {named})"


#: the end of a refusal that names its series (:func:`series_named`; a shown string holds no
#: ``"``, so this is only ever the suffix)
_NAMED = re.compile(r' \(series (\d+) of the request, (__name__ "[^"]*"|no __name__)\)$')


def renumbered(err: DecodeError, before: int) -> DecodeError:
    """A refusal of a part of a request (which counts its series from 0) naming its series
    by its index in the whole: ``before`` series precede the part."""
    m = _NAMED.search(err.message)
    if m is None or not before:
        return err
    index = int(m.group(1)) + before
    return DecodeError(err.kind, err.status, err.message[:m.start()]
                       + f" (series {index} of the request, {m.group(2)})")


@contextmanager
def naming_series(index: int, labels: Sequence[tuple[bytes, bytes]]) -> Iterator[None]:
    """A refusal of the series' labels raised inside names the series
    (:func:`series_named`)."""
    try:
        yield
    except DecodeError as err:
        raise DecodeError(err.kind, err.status,
                          err.message + series_named(index, labels)) from None


def check_names(names: Sequence[bytes]) -> None:
    """400 ``invalid_labels`` for no label at all, or an empty or a repeated label name, in
    any series: the remote-write specifications forbid them, a TSDB refuses a repeated
    name (Prometheus 2.42 with a 500, which senders retry forever, the innocent series of
    the batch with it; it stores an empty name), and the stamp of a series with two values
    for one name would be a guess. The repeated name a refusal shows is
    the least in byte order (the native splice finds it in its sorted copy)."""
    if not names:
        raise DecodeError("invalid_labels", 400, "a series with no labels")
    if b"" in names:
        raise DecodeError("invalid_labels", 400, "a label with an empty name")
    if len(set(names)) != len(names):
        dup = min(n for n, count in Counter(names).items() if count > 1)
        raise DecodeError("invalid_labels", 400,
                          f'label name "{shown(dup)}" repeated in one series')


def check_kept(values: Iterable[bytes]) -> None:
    """400 ``invalid_labels`` for a series that the drop of the sender's ``karta_*``
    labels left with no label of a non-empty value (``values``: those of the labels it
    keeps): forwarded, Prometheus reads a label with an empty value as absent, so it sees
    an empty label set and answers 500 ("empty labelset"), the proxy 502, and the sender
    retries the whole batch forever. Called only where labels were dropped, so a series
    that keeps its labels pays nothing; stops at the first value, ``__name__``'s as a
    rule."""
    if not any(values):
        raise DecodeError("invalid_labels", 400, NO_LABELS_LEFT)


class OverLimit(Exception):
    """A splice stopped before it held more than its limit beside its input (a request of
    series smaller than their stamps grows many times its size): ``need`` is the estimate
    for the whole request, which the caller may reserve before splicing it again."""

    def __init__(self, need: int) -> None:
        super().__init__(f"the splice needs about {need} bytes beside its input")
        self.need = need


@dataclass(slots=True)
class SpliceResult:
    """One request's outcome."""

    #: the enriched request, uncompressed (the input object itself when nothing changed);
    #: a snappy block when ``encoded``
    body: bytes
    counts: Counts
    #: series that carry stamped labels on the way out
    attributed: int = 0
    #: reason -> series passed through unchanged for it
    unattributed: dict[str, int] = field(default_factory=dict)
    #: series that lost a ``karta_*`` label of the sender (one whose name and value the
    #: series does not carry on the way out: dropped, or replaced by the stamp)
    stripped: int = 0
    #: ``body`` is a snappy block (``Splicer.splice_snappy``)
    encoded: bool = False
    #: the first series the stamp would have pushed past the label limit (``label_limit``)
    label_limited: LabelLimited | None = None
    #: the symbols of an RW 2.0 request whose symbol index went over its probe budget (a
    #: hash flood: symbols made to collide) and was rebuilt with the keyed hash; 0: none.
    #: The request is spliced all the same (native splice only; docs/wire.md)
    index_flooded: int = 0
    #: the cluster label's value of the first series that named another cluster
    #: (``other_cluster``): what the proxy's log line names
    other_cluster: bytes | None = None

    def tally(self, reason: str) -> None:
        if reason:
            self.unattributed[reason] = self.unattributed.get(reason, 0) + 1
        else:
            self.attributed += 1

    def decided(self, decision: Decision) -> None:
        """Count a series' decision (and keep the request's first ``label_limit`` one)."""
        self.tally(decision.reason)
        if decision.limited is not None and self.label_limited is None:
            self.label_limited = decision.limited
        if decision.cluster_seen is not None and self.other_cluster is None:
            self.other_cluster = decision.cluster_seen

    def stored_elsewhere(self, cluster: bytes) -> None:
        """The outcome of a request the TSDB stores under another ``cluster`` than the
        proxy's (its URL's ``extra_label``), spliced over no pods
        (``Enricher.unstamped_splicer``): its series that name a pod are not stamped for
        that reason, not for the ``pod_unknown`` the empty table gave them, so they are
        counted ``other_cluster``; one without a pod label stays ``no_pod_label``, one
        ``keep`` let pass stays attributed. ``other_cluster`` names the URL's value when a
        series was counted so."""
        unknown = self.unattributed.pop(REASON_POD_UNKNOWN, 0)
        if unknown:
            self.unattributed[REASON_OTHER_CLUSTER] = (
                self.unattributed.get(REASON_OTHER_CLUSTER, 0) + unknown)
        self.other_cluster = cluster if self.unattributed.get(REASON_OTHER_CLUSTER) else None

    def add(self, other: SpliceResult) -> None:
        """Count ``other``'s series, samples and outcomes into this one's, as
        :meth:`Counts.add` does its counts: a request spliced in parts answers for the
        sum of its parts. The body and ``encoded`` are left as they are (the parts'
        bodies are joined apart)."""
        self.counts.add(other.counts)
        self.attributed += other.attributed
        self.stripped += other.stripped
        if self.label_limited is None:
            self.label_limited = other.label_limited
        if self.other_cluster is None:
            self.other_cluster = other.other_cluster
        self.index_flooded = max(self.index_flooded, other.index_flooded)
        for reason, n in other.unattributed.items():
            self.unattributed[reason] = self.unattributed.get(reason, 0) + n

