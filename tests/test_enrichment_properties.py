"""Property tests: the wire-level Enricher against the plain reference, on random requests.

Random RW 1.0 / 2.0 requests with histograms, exemplars, metadata, stale markers, labels
that already carry karta_ names, unicode and control characters (bytes that look like
protobuf tags inside label values), pods the index knows, knows as unattributed, or not
at all. Each request goes through the same Enricher twice: no state may carry from one
request to the next, so both answers must be the same.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config import EnrichSettings
from proxy.enrichment import Enricher
from proxy.enrichment_reference import enrich_v1_reference, enrich_v2_reference
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2, types_pb2
from tests.upstream_proto import upstream_v2
from tests.wire_fixtures import STALE_NAN, TS, Symbols, index_with_pods

PAIRS = EnrichSettings().pod_label_pairs
INDEX = index_with_pods()
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_chars = st.characters(codec="utf-8", categories=("L", "M", "N", "P", "S", "Z", "Cc"))
# control characters that are also protobuf tags and lengths, inside label values
text = st.text(alphabet=_chars | st.sampled_from("\x12\x10\x07\x0a\x09"), max_size=12)
names = st.sampled_from(
    ["__name__", "namespace", "pod", "exported_namespace", "exported_pod", "pod_namespace",
     "pod_name", "container", "karta_workload", "karta_replica", "karta_component",
     "karta_zzz", "karta_", "job", "a", "zz", "\x12\x10"]
) | text.filter(bool)
values = st.sampled_from(["ml", "web", "train-head", "shop-abc", "lonely", "ghost", "",
                          "DCGM_FI_DEV_FB_USED", "nvidia-dcgm-exporter"]) | text
PODS = [("ml", "train-head"), ("web", "shop-abc"), ("ml", "lonely"), ("ml", "ghost")]


@st.composite
def label_sets(draw: Any) -> dict[str, str]:
    """Random labels; most sets name a pod through one of the configured pairs, and some
    also carry stamped names of their own (forged or from an earlier proxy)."""
    labels: dict[str, str] = draw(st.dictionaries(names, values, max_size=6))
    if draw(st.integers(0, 3)):
        ns_name, pod_name = draw(st.sampled_from(PAIRS))
        ns, pod = draw(st.sampled_from(PODS))
        labels[ns_name] = ns
        labels[pod_name] = pod
    if draw(st.integers(0, 3)) == 0:  # DCGM: its own pod-label rule (exporter or GPU pod)
        labels["__name__"] = "DCGM_FI_DEV_FB_USED"
        labels["container"] = draw(st.sampled_from(["", "main", "nvidia-dcgm-exporter"]))
    for name in draw(st.lists(st.sampled_from(
        ["karta_workload", "karta_replica", "karta_kind", "karta_zzz", "karta_a"]), max_size=2
    )):
        labels[name] = draw(values)
    if all(n.startswith("karta_") or not v for n, v in labels.items()):
        # a series with no labels, or none of a value left once the sender's karta_* are
        # dropped, is refused 400 (tests/wire/test_splice.py): these properties are about
        # valid ones (empty values next to karta_* stay, beside a label with a value)
        labels["job"] = draw(values.filter(bool))
    return labels

floats = st.sampled_from([0.0, 1.5, STALE_NAN, float("inf"), -2.0]) | st.floats()
timestamps = st.sampled_from([TS, TS + 15_000, 0]) | st.integers(-(2**62), 2**62)


@st.composite
def series_v1(draw: Any) -> types_pb2.TimeSeries:
    ts = types_pb2.TimeSeries()
    labels = draw(label_sets())
    order = sorted(labels)
    if draw(st.integers(0, 9)) == 0:
        order = list(reversed(order))  # an unsorted sender
    for k in order:
        ts.labels.add(name=k, value=labels[k])
    for v, t in draw(st.lists(st.tuples(floats, timestamps), max_size=3)):
        ts.samples.add(value=v, timestamp=t)
    for _ in range(draw(st.integers(0, 2))):
        ex = ts.exemplars.add(value=draw(floats), timestamp=draw(timestamps))
        ex.labels.add(name="trace_id", value=draw(text))
    for _ in range(draw(st.integers(0, 1))):
        h = ts.histograms.add(count_int=draw(st.integers(0, 2**40)), sum=draw(floats),
                              schema=draw(st.integers(-4, 8)), timestamp=draw(timestamps))
        h.positive_spans.add(offset=draw(st.integers(-5, 5)), length=2)
        h.positive_deltas.extend(draw(st.lists(st.integers(-100, 100), min_size=2, max_size=2)))
    return ts


@st.composite
def requests_v1(draw: Any) -> bytes:
    req = remote_pb2.WriteRequest()
    req.timeseries.extend(draw(st.lists(series_v1(), max_size=8)))
    for _ in range(draw(st.integers(0, 2))):
        req.metadata.add(type=draw(st.integers(0, 7)), metric_family_name=draw(text),
                         help=draw(text), unit=draw(text))
    out: bytes = req.SerializeToString()
    return out


def _series_fields(raw: bytes) -> list[bytes]:
    req = remote_pb2.WriteRequest.FromString(raw)
    return [ts.SerializeToString() for ts in req.timeseries]


SENDER = st.sampled_from(["drop", "drop", "keep"])


@SETTINGS
@given(raw=requests_v1(), policy=st.sampled_from(["replace", "keep"]), sender=SENDER)
def test_v1_fast_path_matches_reference(raw: bytes, policy: str, sender: str) -> None:
    ref = enrich_v1_reference(raw, INDEX, PAIRS, policy, sender_karta_labels=sender)
    enricher = Enricher(INDEX, PAIRS, conflict_policy=policy, sender_karta_labels=sender)
    for _ in range(2):  # the same answer twice: no state carries between requests
        fast = enricher.enrich_v1(raw)
        parsed = remote_pb2.WriteRequest.FromString(fast.body)
        assert parsed.SerializeToString() == ref.body
        assert (fast.counts, fast.attributed, fast.unattributed, fast.stripped) == (
            ref.counts, ref.attributed, ref.unattributed, ref.stripped)
        before = remote_pb2.WriteRequest.FromString(raw)
        for old, new in zip(before.timeseries, parsed.timeseries, strict=True):
            if list(old.labels) == list(new.labels):
                continue
            names = [lb.name.encode() for lb in new.labels]
            if [lb.name for lb in old.labels] == sorted(
                {lb.name for lb in old.labels}, key=str.encode
            ):
                assert names == sorted(set(names)), "labels sorted and unique"
            # data fields untouched
            assert [s.SerializeToString() for s in old.samples] == [
                s.SerializeToString() for s in new.samples]
            assert [e.SerializeToString() for e in old.exemplars] == [
                e.SerializeToString() for e in new.exemplars]
            assert [h.SerializeToString() for h in old.histograms] == [
                h.SerializeToString() for h in new.histograms]
        in_order = all(
            [lb.name.encode() for lb in ts.labels] == sorted(lb.name.encode() for lb in ts.labels)
            for ts in before.timeseries)
        if (fast.attributed == 0 and fast.stripped == 0 and in_order) or ref.body == raw:
            # nothing to stamp, drop or sort: the input comes back as it was
            assert fast.body == raw


@SETTINGS
@given(raw=requests_v1())
def test_v1_untouched_series_are_byte_exact(raw: bytes) -> None:
    enricher = Enricher(INDEX, PAIRS)
    res = enricher.enrich_v1(raw)
    ref = enrich_v1_reference(raw, INDEX, PAIRS)
    ref_series = remote_pb2.WriteRequest.FromString(ref.body).timeseries
    old_series = _series_fields(raw)
    new_series = _series_fields(res.body)
    for old, new, r in zip(old_series, new_series, ref_series, strict=True):
        if old == r.SerializeToString():
            assert new == old
    if res.body == raw:
        assert res.attributed == 0 or all(
            o == r.SerializeToString() for o, r in zip(old_series, ref_series, strict=True))


# -- RW 2.0 ---------------------------------------------------------------------------------


@st.composite
def requests_v2(draw: Any) -> bytes:
    req = v2.Request()
    preset = st.lists(st.sampled_from(["ml", "karta_kind", "train", "x"]), unique=True,
                      max_size=3)
    table = Symbols(["", *draw(preset)])
    ref = table.ref
    for labels in draw(st.lists(label_sets(), max_size=6)):
        ts = req.timeseries.add()
        for k in sorted(labels, key=str.encode):
            ts.labels_refs.extend([ref(k), ref(labels[k])])
        for v, t in draw(st.lists(st.tuples(floats, timestamps), max_size=2)):
            ts.samples.add(value=v, timestamp=t, start_timestamp=draw(timestamps))
        if draw(st.booleans()):
            h = ts.histograms.add(count_float=draw(floats), schema=1, timestamp=TS,
                                  start_timestamp=draw(timestamps))
            h.positive_counts.extend([1.0, 2.0])
        if draw(st.booleans()):
            ex = ts.exemplars.add(value=draw(floats), timestamp=TS)
            ex.labels_refs.extend([ref("trace_id"), ref(draw(text))])
        if draw(st.booleans()):
            ts.metadata.type = draw(st.integers(0, 7))
            ts.metadata.help_ref = ref(draw(text))
    req.symbols.extend(table.strings)
    out: bytes = req.SerializeToString()
    return out


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return upstream_v2(tmp_path_factory.mktemp("upstream-v2"))


def _resolved(req: Any) -> list[list[tuple[str, str]]]:
    out = []
    for ts in req.timeseries:
        r = list(ts.labels_refs)
        out.append([(req.symbols[r[i]], req.symbols[r[i + 1]]) for i in range(0, len(r), 2)])
    return out


@SETTINGS
@given(raw=requests_v2(), policy=st.sampled_from(["replace", "keep"]), sender=SENDER)
def test_v2_matches_reference_and_reads_with_upstream(
    raw: bytes, policy: str, sender: str, upstream: dict[str, Any]
) -> None:
    enricher = Enricher(INDEX, PAIRS, conflict_policy=policy, sender_karta_labels=sender)
    fast = enricher.enrich_v2(raw)
    warm = enricher.enrich_v2(raw)  # a second request gives the same answer
    assert (warm.body, warm.counts, warm.attributed, warm.unattributed) == (
        fast.body, fast.counts, fast.attributed, fast.unattributed)
    ref = enrich_v2_reference(raw, INDEX, PAIRS, policy, sender_karta_labels=sender)
    before = v2.Request.FromString(raw)
    mine = v2.Request.FromString(fast.body)
    theirs = upstream["io.prometheus.write.v2.Request"].FromString(fast.body)
    reference = v2.Request.FromString(ref.body)
    assert _resolved(theirs) == _resolved(mine) == _resolved(reference)
    assert (fast.counts, fast.attributed, fast.unattributed, fast.stripped) == (
        ref.counts, ref.attributed, ref.unattributed, ref.stripped)
    if sender == "drop" and policy == "replace":  # no sender's karta_* label gets through
        stamps = {tuple(INDEX.lookup(ns.encode(), pod.encode()) or ()) for ns, pod in PODS}
        for labels in _resolved(mine):
            sent = tuple(sorted((n, v) for n, v in labels if n.startswith("karta_")))
            assert not sent or sent in stamps, labels
    # symbol table: "" first, old symbols unchanged in place, no new duplicate
    assert theirs.symbols[0] == ""
    assert list(theirs.symbols[: len(before.symbols)]) == list(before.symbols)
    added = list(theirs.symbols[len(before.symbols):])
    assert len(set(added)) == len(added) and not set(added) & set(before.symbols)
    for old, new in zip(before.timeseries, mine.timeseries, strict=True):
        a, b = v2.TimeSeries(), v2.TimeSeries()
        a.CopyFrom(old)
        b.CopyFrom(new)
        a.ClearField("labels_refs")
        b.ClearField("labels_refs")
        assert a.SerializeToString() == b.SerializeToString()
    for old_labels, labels in zip(_resolved(before), _resolved(mine), strict=True):
        if labels != old_labels:  # enriched: sorted and unique (the input was)
            names = [n.encode() for n, _ in labels]
            assert names == sorted(set(names))
    if fast.attributed == 0 and fast.stripped == 0:
        assert fast.body == raw
