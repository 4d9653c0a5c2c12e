"""Per series: find the pod it names, look up its stamped labels, splice them in (cached).

The request path costs one cache probe per series in steady state. The cache is keyed by
a series' label bytes (RW 1.0: the raw bytes of its Label fields; RW 2.0: the resolved
label strings) and holds the finished labels to splice, or "unchanged". Entries that
depend on the pod index share one cell per pod holding the index's answer; the index's
change listener replaces it when that pod changes, which makes exactly that pod's entries
stale (a pod event elsewhere costs the request path nothing). Entries of series that name
no pod never expire.

:func:`enrich_v1_reference` / :func:`enrich_v2_reference` do the same job the plain way,
through the generated protobuf classes; tests hold the fast path to them.
"""

from __future__ import annotations

import bisect
import itertools
import re
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy import codec, contract
from proxy.codec import Counts
from proxy.compression import DecodeError
from proxy.config import EnrichSettings, PodLabelRule
from proxy.index import LabelPairs, PodIndex
from proxy.karta.results import ChangeSet

POLICIES = ("replace", "keep")
DEFAULT_CACHE_SIZE = EnrichSettings().cache_size
REASON_NO_POD_LABEL = "no_pod_label"

_STAMPED = frozenset(n.encode() for n in contract.STAMPED_LABELS)
_WORKLOAD = contract.LABEL_WORKLOAD.encode()
_NAME = b"__name__"
_KARTA = contract.STAMPED_PREFIX.encode()

#: (namespace label, pod label, ((label, compiled regex), ...) that disqualify the pair)
_Pair = tuple[bytes, bytes, tuple[tuple[bytes, "re.Pattern[str]"], ...]]


def default_pod_label_rules() -> list[PodLabelRule]:
    """The configured default rules (DCGM), for callers that pass none."""
    return EnrichSettings().pod_label_rules


def _compile_pairs(pairs: Sequence[Any]) -> tuple[_Pair, ...]:
    out: list[_Pair] = []
    for pair in pairs:
        if isinstance(pair, tuple | list):
            ns, pod, unless = pair[0], pair[1], {}
        else:
            ns, pod, unless = pair.namespace, pair.pod, pair.unless
        out.append((
            ns.encode(),
            pod.encode(),
            tuple((label.encode(), re.compile(rx)) for label, rx in unless.items()),
        ))
    return tuple(out)


class PodFinder:
    """Which (namespace, pod) a series names: per metric-name prefix rules, then the
    default pairs. Runs on cache misses only (the metric name is part of the label key)."""

    def __init__(
        self,
        pod_label_pairs: Sequence[tuple[str, str]],
        pod_label_rules: Sequence[PodLabelRule] | None = None,
    ) -> None:
        if not pod_label_pairs:
            raise ValueError("pod_label_pairs must name at least one (namespace, pod) pair")
        rules = default_pod_label_rules() if pod_label_rules is None else pod_label_rules
        self.default = _compile_pairs(pod_label_pairs)
        self.rules = tuple(
            (r.metric_prefix.encode(), _compile_pairs(r.pod_label_pairs)) for r in rules
        )
        #: every label name a decision reads
        self.names = frozenset(
            {_NAME, _WORKLOAD}
            | {x for _, ps in (("", self.default), *self.rules) for p in ps for x in p[:2]}
            | {lb for _, ps in (("", self.default), *self.rules) for p in ps for lb, _ in p[2]}
        )

    def pairs_for(self, metric: bytes) -> tuple[_Pair, ...]:
        for prefix, pairs in self.rules:
            if metric.startswith(prefix):
                return pairs
        return self.default

    def find(self, labels: Mapping[bytes, bytes]) -> tuple[bytes, bytes] | None:
        """The first usable pair's (namespace, pod) values, or None (``no_pod_label``)."""
        pairs = self.pairs_for(labels.get(_NAME, b"")) if self.rules else self.default
        for ns_name, pod_name, unless in pairs:
            ns = labels.get(ns_name)
            if ns:
                pod = labels.get(pod_name)
                if pod and not (unless and _disqualified(labels, unless)):
                    return ns, pod
        return None


def _disqualified(
    labels: Mapping[bytes, bytes], unless: tuple[tuple[bytes, re.Pattern[str]], ...]
) -> bool:
    for label, rx in unless:
        value = labels.get(label, b"")
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError(
                "invalid_utf8", 400, f"label value is not valid UTF-8: {value[:64]!r}"
            ) from None
        if rx.fullmatch(text):
            return True
    return False


@dataclass
class EnrichResult:
    #: the enriched request, uncompressed (the input object itself when nothing changed)
    body: bytes
    counts: Counts
    #: series that carry stamped labels on the way out
    attributed: int
    #: reason -> series passed through unchanged for it
    unattributed: dict[str, int] = field(default_factory=dict)


def _tally(counts: Counts, body: bytes, reasons: list[str]) -> EnrichResult:
    """``reasons``: one item per series, "" for attributed."""
    tally = Counter(reasons)
    attributed = tally.pop("", 0)
    return EnrichResult(body, counts, attributed, dict(tally))


def _tally_unattributed(counts: Counts, body: bytes, reasons: list[str]) -> EnrichResult:
    """``reasons``: one item per unattributed series only."""
    return EnrichResult(body, counts, counts.series - len(reasons), dict(Counter(reasons)))


#: interning tables (stamp blocks, pod keys) are cleared past this many items: they only
#: share memory between entries, nothing depends on them
_INTERN_LIMIT = 4 * 65536


class Enricher:
    """Stamps the index's labels onto the series of RW 1.0 / 2.0 requests."""

    def __init__(
        self,
        index: PodIndex,
        pod_label_pairs: Sequence[tuple[str, str]],
        *,
        conflict_policy: str = "replace",
        cache_size: int = DEFAULT_CACHE_SIZE,
        pod_label_rules: Sequence[PodLabelRule] | None = None,
    ) -> None:
        """``pod_label_rules`` None means the configured defaults; pass [] for none."""
        if conflict_policy not in POLICIES:
            raise ValueError(f"conflict_policy must be one of {POLICIES}, not {conflict_policy!r}")
        self._index = index
        self._finder = PodFinder(pod_label_pairs, pod_label_rules)
        self._keep = conflict_policy == "keep"
        self._cache_size = max(16, cache_size)
        #: label bytes -> codec.Entry
        self._cache: dict[bytes, tuple[Any, ...]] = {}
        #: resolved label strings -> codec.EntryV2
        self._cache_v2: dict[codec.LabelKey, tuple[Any, ...]] = {}
        #: (namespace, pod) -> [the index's answer (token), namespace, pod]: one per pod,
        #: shared by its entries; replacing item 0 makes all of them stale at once
        self._cells: dict[tuple[bytes, bytes], list[Any]] = {}
        #: pod uid -> (namespace, pod), to find the cell of a removed pod
        self._uid_keys: dict[str, tuple[bytes, bytes]] = {
            uid: (att.namespace.encode(), att.pod.encode()) for uid, att in index.pods.items()
        }
        self._seen_generation = index.generation
        #: LabelPairs -> encoded 1.0 Label fields, as (name, value, field) for the merge
        self._stamp_v1: dict[LabelPairs, tuple[tuple[bytes, bytes, bytes], ...]] = {}
        #: LabelPairs -> the same fields as one block of bytes
        self._blocks: dict[LabelPairs, bytes] = {}
        #: LabelPairs -> the stamped names and values, flat, sorted by name (RW 2.0)
        self._stamp_bytes: dict[LabelPairs, tuple[bytes, ...]] = {}
        #: RW 2.0 strings seen, one object each (see codec.splice_v2)
        self._symbols: dict[bytes, bytes] = {}
        self.misses = 0
        ref = weakref.ref(self)

        def on_change(changes: ChangeSet) -> None:
            enricher = ref()
            if enricher is not None:
                enricher._on_change(changes)

        index.subscribe(on_change)

    # -- public -------------------------------------------------------------------------

    def enrich_v1(self, raw: bytes) -> EnrichResult:
        self._before_request()
        body, counts, reasons = codec.splice_v1(raw, self._cache.get, self._miss_v1)
        return _tally_unattributed(counts, body, reasons)

    def enrich_v2(self, raw: bytes) -> EnrichResult:
        self._before_request()
        body, counts, reasons = codec.splice_v2(
            raw, self._cache_v2.get, self._miss_v2, self._symbols
        )
        return _tally_unattributed(counts, body, reasons)

    def cache_len(self) -> int:
        """Entries of the RW 1.0 and RW 2.0 caches (each bounded by cache_size)."""
        return len(self._cache) + len(self._cache_v2)

    # -- keeping entries current --------------------------------------------------------

    def _token(self, ns: bytes, pod: bytes) -> Any:
        """The index's answer for a pod: its stamped pairs (interned), else its reason."""
        pairs = self._index.lookup(ns, pod)
        return pairs if pairs is not None else self._index.reason(ns, pod)

    def _cell(self, found: tuple[bytes, bytes]) -> list[Any]:
        cell = self._cells.get(found)
        if cell is None:
            cell = [self._token(*found), *found]
            self._cells[found] = cell
        return cell

    def _on_change(self, changes: ChangeSet) -> None:
        """Index listener: refresh the cells of the pods a change set touches (per pod
        event, never per series); their entries go stale, every other entry stays."""
        cells = self._cells
        for uid, att in changes.pods.items():
            keys: tuple[tuple[bytes, bytes], ...]
            if att is not None:
                key = (att.namespace.encode(), att.pod.encode())
                old = self._uid_keys.get(uid)
                self._uid_keys[uid] = key
                keys = (key,) if old is None or old == key else (key, old)
            else:
                gone = self._uid_keys.pop(uid, None)
                keys = (gone,) if gone is not None else ()
            for k in keys:
                cell = cells.get(k)
                if cell is not None:
                    cell[0] = self._token(*k)
        self._seen_generation = self._index.generation

    def _before_request(self) -> None:
        if self._index.generation != self._seen_generation:
            # a change no listener call explained (tombstones expired): check every cell;
            # unchanged answers keep their identity, so their entries stay valid
            for (ns, pod), cell in self._cells.items():
                token = self._token(ns, pod)
                if token is not cell[0] and token != cell[0]:
                    cell[0] = token
            self._seen_generation = self._index.generation
        if len(self._symbols) > max(_INTERN_LIMIT, 4 * self._cache_size):
            self._symbols.clear()
        if len(self._cells) > _INTERN_LIMIT:
            for cell in self._cells.values():
                cell[0] = _DEAD  # entries holding a dropped cell must not live on
            self._cells.clear()
        if len(self._stamp_v1) > _INTERN_LIMIT:
            self._stamp_v1.clear()
            self._stamp_bytes.clear()
            self._blocks.clear()

    # -- decisions ----------------------------------------------------------------------

    def _miss_v1(self, key: bytes) -> tuple[Any, ...]:
        """Compute the cache entry of one label set (new, or stale after a pod change).

        Raises DecodeError when ``key`` is not a run of Label fields (see codec.CacheMiss).
        """
        ent = self._decide_v1(key)
        self.misses += 1
        cache = self._cache
        if len(cache) >= self._cache_size and key not in cache:
            _evict(cache)
        cache[key] = ent
        return ent

    def _decide_v1(self, key: bytes) -> tuple[Any, ...]:
        scan = codec.scan_labels_v1(key, self._finder.names)
        if scan is None:  # an unusual shape, or karta_ labels of the sender's own
            return self._decide_v1_general(key)
        got, at = scan
        found = self._finder.find(got)
        if found is None:
            return codec.make_entry(codec.ALWAYS, None, REASON_NO_POD_LABEL, len(key), None)
        return self._stamp_entry(key, found, at, None)

    def _stamp_entry(
        self,
        key: bytes,
        found: tuple[bytes, bytes],
        at: int,
        labels: list[codec.LabelField] | None,
    ) -> tuple[Any, ...]:
        """The entry of a series naming pod ``found``: the stamp block goes in at ``at``,
        or, with ``labels`` (the general path), labels are merged and sorted."""
        cell = self._cell(found)
        token = cell[0]
        if isinstance(token, str):  # no labels for this pod: the reason
            return codec.make_entry(cell, token, token, len(key), None)
        pairs: LabelPairs = token
        if labels is None:
            block = self._blocks.get(pairs)
            if block is None:
                block = b"".join(lf[2] for lf in self._stamp_fields(pairs))
                self._blocks[pairs] = block
            new = key[:at] + block + key[at:] if block else None
            return codec.make_entry(cell, token, "", len(key), new)
        merged = codec.merge_labels(labels, self._stamp_fields(pairs), _STAMPED)
        new = b"".join(lf[2] for lf in merged)
        if new == key:  # already exactly so: pass the bytes through untouched
            return codec.make_entry(cell, token, "", len(key), None)
        return codec.make_entry(cell, token, "", len(key), new)

    def _stamp_fields(self, pairs: LabelPairs) -> tuple[tuple[bytes, bytes, bytes], ...]:
        stamp = self._stamp_v1.get(pairs)
        if stamp is None:
            enc = sorted((n.encode(), v.encode()) for n, v in pairs)
            stamp = tuple((n, v, codec.encode_label_v1(n, v)) for n, v in enc)
            self._stamp_v1[pairs] = stamp
        return stamp

    def _decide_v1_general(self, key: bytes) -> tuple[Any, ...]:
        """Every layout: the labels parsed in full (UTF-8 checked), merged and sorted."""
        labels = codec.parse_labels_v1(key)
        by_name = {name: value for name, value, _ in labels}
        if self._keep and by_name.get(_WORKLOAD):
            return codec.make_entry(codec.ALWAYS, None, "", len(key), None)
        found = self._finder.find(by_name)
        if found is None:
            return codec.make_entry(codec.ALWAYS, None, REASON_NO_POD_LABEL, len(key), None)
        return self._stamp_entry(key, found, 0, labels)

    # -- RW 2.0: keyed by the resolved label strings ------------------------------------

    def _miss_v2(self, key: codec.LabelKey) -> tuple[Any, ...]:
        """The entry of one resolved label set (name, value, name, value, ...)."""
        ent = self._decide_v2(key)
        self.misses += 1
        cache = self._cache_v2
        if len(cache) >= self._cache_size and key not in cache:
            _evict(cache)
        cache[key] = ent
        return ent

    def _decide_v2(self, key: codec.LabelKey) -> tuple[Any, ...]:
        names = key[0::2]
        by_name = dict(zip(names, key[1::2], strict=True))
        if self._keep and by_name.get(_WORKLOAD):
            return (codec.ALWAYS, "", codec.UNCHANGED, None, None)
        found = self._finder.find(by_name)
        if found is None:
            return (codec.ALWAYS, REASON_NO_POD_LABEL, codec.UNCHANGED, None, None)
        cell = self._cell(found)
        token = cell[0]
        if isinstance(token, str):
            return (cell, token, codec.UNCHANGED, None, token)
        pairs: LabelPairs = token
        stamp = self._stamp_fields(pairs)
        if not stamp:
            return (cell, "", codec.UNCHANGED, None, token)
        plain = all(a < b for a, b in itertools.pairwise(names)) and not any(
            n.startswith(_KARTA) for n in names
        )
        if plain:  # the block goes in between the names around "karta_"
            at = bisect.bisect_right(names, _KARTA)
            return (cell, "", at, self._stamp_flat(pairs), token)
        labels = [(n, v, b"") for n, v in zip(names, key[1::2], strict=True)]
        merged = codec.merge_labels(labels, stamp, _STAMPED)
        if [x[:2] for x in merged] == [x[:2] for x in labels]:
            return (cell, "", codec.UNCHANGED, None, token)
        return (cell, "", codec.WHOLE, tuple((n, v) for n, v, _ in merged), token)

    def _stamp_flat(self, pairs: LabelPairs) -> tuple[bytes, ...]:
        stamp = self._stamp_bytes.get(pairs)
        if stamp is None:
            stamp = tuple(x for n, v, _ in self._stamp_fields(pairs) for x in (n, v))
            self._stamp_bytes[pairs] = stamp
        return stamp


#: a token no answer is: the cell of a dropped pod holds it, so its entries are stale
_DEAD = object()


def _evict(cache: dict[Any, Any]) -> None:
    """Drop the oldest quarter (insertion order): cheap, and hot series come back."""
    drop = list(itertools.islice(cache, len(cache) // 4 or 1))
    for k in drop:
        del cache[k]


# -- the plain reference ------------------------------------------------------------------


def _reference_decision(
    labels: list[tuple[str, str]],
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str,
    pod_label_rules: Sequence[PodLabelRule] | None,
) -> tuple[list[tuple[str, str]] | None, str]:
    """(new labels or None for unchanged, reason) — written for clarity, not speed."""
    present = dict(labels)
    if conflict_policy == "keep" and present.get(contract.LABEL_WORKLOAD):
        return None, ""
    rules = default_pod_label_rules() if pod_label_rules is None else pod_label_rules
    metric = present.get("__name__", "")
    pairs: list[tuple[str, str, dict[str, str]]] = [(ns, pod, {}) for ns, pod in pod_label_pairs]
    for rule in rules:
        if metric.startswith(rule.metric_prefix):
            pairs = [(p.namespace, p.pod, p.unless) for p in rule.pod_label_pairs]
            break
    for ns_name, pod_name, unless in pairs:
        ns = present.get(ns_name, "")
        pod = present.get(pod_name, "")
        if ns and pod and not any(
            re.fullmatch(rx, present.get(label, "")) for label, rx in unless.items()
        ):
            break
    else:
        return None, REASON_NO_POD_LABEL
    stamped = index.lookup(ns.encode(), pod.encode())
    if stamped is None:
        return None, index.reason(ns.encode(), pod.encode())
    kept = [(n, v) for n, v in labels if n not in contract.STAMPED_LABELS]
    new = sorted([*kept, *stamped], key=lambda nv: nv[0].encode())
    return new, ""


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


def enrich_v1_reference(
    raw: bytes,
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str = "replace",
    pod_label_rules: Sequence[PodLabelRule] | None = None,
) -> EnrichResult:
    """The same result as :meth:`Enricher.enrich_v1`, through full protobuf objects."""
    from proxy.pb.prometheus import remote_pb2

    req = _parse_reference(remote_pb2.WriteRequest(), raw)
    counts = Counts()
    reasons: list[str] = []
    for ts in req.timeseries:
        _count_reference(counts, ts)
        labels = [(lb.name, lb.value) for lb in ts.labels]
        new, reason = _reference_decision(
            labels, index, pod_label_pairs, conflict_policy, pod_label_rules
        )
        reasons.append(reason)
        if new is not None:
            del ts.labels[:]
            for n, v in new:
                ts.labels.add(name=n, value=v)
    return _tally(counts, req.SerializeToString(), reasons)


def enrich_v2_reference(
    raw: bytes,
    index: PodIndex,
    pod_label_pairs: Sequence[tuple[str, str]],
    conflict_policy: str = "replace",
    pod_label_rules: Sequence[PodLabelRule] | None = None,
) -> EnrichResult:
    """The same result as :meth:`Enricher.enrich_v2`, through full protobuf objects."""
    from proxy.pb.io.prometheus.write.v2 import types_pb2

    req = _parse_reference(types_pb2.Request(), raw)
    symbols = list(req.symbols)
    where = {s: i for i, s in reversed(list(enumerate(symbols)))}
    counts = Counts()
    reasons: list[str] = []
    for ts in req.timeseries:
        _count_reference(counts, ts)
        refs = list(ts.labels_refs)
        labels = [(symbols[refs[i]], symbols[refs[i + 1]]) for i in range(0, len(refs), 2)]
        new, reason = _reference_decision(
            labels, index, pod_label_pairs, conflict_policy, pod_label_rules
        )
        reasons.append(reason)
        if new is None:
            continue
        if not symbols:
            symbols.append("")
            req.symbols.append("")
            where[""] = 0
        out: list[int] = []
        for n, v in new:
            for s in (n, v):
                if s not in where:
                    where[s] = len(symbols)
                    symbols.append(s)
                    req.symbols.append(s)
                out.append(where[s])
        del ts.labels_refs[:]
        ts.labels_refs.extend(out)
    return _tally(counts, req.SerializeToString(), reasons)
