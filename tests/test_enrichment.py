"""Enricher: which pod a series names, what it gets, what passes through untouched.

Every test runs on both splices (native and the pure-Python reference)."""

from __future__ import annotations

from typing import Any

import pytest

import proxy.wire.native
from proxy import contract
from proxy.config import EnrichSettings, settings_from_dict
from proxy.enrichment import Enricher
from proxy.enrichment_reference import enrich_v1_reference, enrich_v2_reference
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, WorkloadRef
from tests.wire_fixtures import (
    STALE_NAN,
    TS,
    WL_TRAIN,
    index_with_pods,
    is_stale,
    labels_of,
    labels_v2,
    parse_v1,
    parse_v2,
    request_v1,
    request_v2,
    series_v1,
)

PAIRS = EnrichSettings().pod_label_pairs


@pytest.fixture(autouse=True, params=["native", "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and not proxy.wire.native.native_available():
        pytest.skip("native splice not built")
    monkeypatch.setattr(proxy.wire.native, "DEFAULT", request.param)
    return str(request.param)

TRAIN_LABELS = [
    ("karta_component", "head"),
    ("karta_group", "ray.io"),
    ("karta_instance", "train"),
    ("karta_kind", "RayJob"),
    ("karta_namespace", "ml"),
    ("karta_workload", "train"),
]


def enricher(idx: PodIndex | None = None, **kw: Any) -> Enricher:
    return Enricher(idx if idx is not None else index_with_pods(), PAIRS, **kw)


def stamped(labels: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(n, v) for n, v in labels if n.startswith("karta_")]


def test_plain_pod_labels_get_the_workload() -> None:
    raw = request_v1(series_v1({"__name__": "container_cpu", "namespace": "ml",
                                "pod": "train-head", "container": "ray"}))
    res = enricher().enrich_v1(raw)
    (ts,) = parse_v1(res.body).timeseries
    assert stamped(labels_of(ts)) == TRAIN_LABELS
    names = [n for n, _ in labels_of(ts)]
    assert names == sorted(names)
    assert res.attributed == 1 and res.unattributed == {}
    assert (res.counts.series, res.counts.samples) == (1, 1)


def test_dcgm_exported_pod_wins_over_the_exporters_pod() -> None:
    raw = request_v1(series_v1({
        "__name__": "DCGM_FI_DEV_GPU_UTIL", "exported_namespace": "ml",
        "exported_pod": "train-head", "namespace": "web", "pod": "shop-abc", "gpu": "0"}))
    (ts,) = parse_v1(enricher().enrich_v1(raw).body).timeseries
    assert dict(labels_of(ts))["karta_workload"] == "train"
    assert dict(labels_of(ts))["pod"] == "shop-abc"  # the exporter's labels are untouched


def test_first_pair_with_both_labels_non_empty_wins() -> None:
    raw = request_v1(
        series_v1({"exported_namespace": "ml", "exported_pod": "", "namespace": "web",
                   "pod": "shop-abc"}),
        series_v1({"exported_pod": "train-head", "namespace": "web", "pod": "shop-abc"}),
        series_v1({"pod_namespace": "ml", "pod_name": "train-head", "x": "y"}),
    )
    out = parse_v1(enricher().enrich_v1(raw).body).timeseries
    assert [dict(labels_of(ts))["karta_workload"] for ts in out] == ["shop", "shop", "train"]


def test_unattributed_pass_through_byte_exact_and_counted_by_reason() -> None:
    raw = request_v1(
        series_v1({"__name__": "node_load1", "instance": "n1"}),
        series_v1({"namespace": "ml", "pod": "lonely"}),
        series_v1({"namespace": "ml", "pod": "ghost"}),
        series_v1({"namespace": "ml", "pod": "ghost", "c": "2"}),
        metadata=True,
    )
    res = enricher().enrich_v1(raw)
    assert res.body is raw
    assert res.attributed == 0
    assert res.unattributed == {"no_pod_label": 1, "no_described_owner": 1, "pod_unknown": 2}


def test_stale_markers_get_the_same_labels() -> None:
    raw = request_v1(series_v1({"namespace": "ml", "pod": "train-head"},
                               [(3.0, TS), (STALE_NAN, TS + 15000)]))
    (ts,) = parse_v1(enricher().enrich_v1(raw).body).timeseries
    assert stamped(labels_of(ts)) == TRAIN_LABELS
    assert is_stale(ts.samples[1].value)


def test_data_fields_pass_through_byte_exact() -> None:
    original = series_v1({"namespace": "ml", "pod": "train-head"}, [(1.0, TS), (0.0, TS + 1)],
                         exemplars=2, histograms=2)
    raw = request_v1(original, metadata=True)
    res = enricher().enrich_v1(raw)
    req = parse_v1(res.body)
    (ts,) = req.timeseries
    assert ts.samples == original.samples
    assert ts.exemplars == original.exemplars
    assert ts.histograms == original.histograms
    # the bytes after the label fields are the original ones
    data = original.SerializeToString()[len(_labels_bytes(original)):]
    tail = raw[raw.index(data):]  # samples, exemplars, histograms, then the metadata field
    assert res.body.endswith(tail)
    assert len(req.metadata) == 1
    assert (res.counts.samples, res.counts.exemplars, res.counts.histograms) == (2, 2, 2)


def _labels_bytes(ts: Any) -> bytes:
    only = type(ts)()
    only.labels.extend(ts.labels)
    out: bytes = only.SerializeToString()
    return out


def test_replace_policy_replaces_sent_karta_labels_never_duplicates() -> None:
    raw = request_v1(series_v1({"namespace": "ml", "pod": "train-head",
                                "karta_workload": "forged", "karta_replica": "7",
                                "karta_zzz": "mine"}))
    (ts,) = parse_v1(enricher().enrich_v1(raw).body).timeseries
    labels = labels_of(ts)
    names = [n for n, _ in labels]
    assert names == sorted(set(names))
    assert dict(labels)["karta_workload"] == "train"
    assert "karta_replica" not in dict(labels)  # a stamped name the pod does not have
    assert "karta_zzz" not in dict(labels)  # every karta_* of the sender goes by default


def test_sender_karta_labels_keep_keeps_names_outside_the_contract() -> None:
    raw = request_v1(series_v1({"namespace": "ml", "pod": "train-head",
                                "karta_workload": "forged", "karta_zzz": "mine"}),
                     series_v1({"a": "b", "karta_workload": "forged"}))
    res = enricher(sender_karta_labels="keep").enrich_v1(raw)
    first, second = parse_v1(res.body).timeseries
    assert dict(labels_of(first))["karta_zzz"] == "mine"
    assert dict(labels_of(first))["karta_workload"] == "train"
    assert labels_of(second) == [("a", "b"), ("karta_workload", "forged")]
    assert res.stripped == 1
    with pytest.raises(ValueError):
        enricher(sender_karta_labels="trust")


@pytest.mark.parametrize("labels", [
    {"a": "b", "karta_workload": "someone-else"},                    # no pod label
    {"namespace": "ml", "pod": "ghost", "karta_workload": "x"},      # unknown pod
    {"namespace": "ml", "pod": "lonely", "karta_kind": "Fake"},      # known, unattributed
])
@pytest.mark.parametrize("version", [1, 2])
def test_spoofed_attribution_is_dropped_from_unstamped_series(labels: dict[str, str],
                                                              version: int) -> None:
    """Issue 9 item 5: a sender cannot charge its usage to another workload."""
    e = enricher()
    if version == 1:
        res = e.enrich_v1(request_v1(series_v1(labels)))
        got = labels_of(parse_v1(res.body).timeseries[0])
    else:
        res = e.enrich_v2(request_v2(labels))
        req = parse_v2(res.body)
        got = labels_v2(req, req.timeseries[0])
    assert got == sorted((n, v) for n, v in labels.items() if not n.startswith("karta_"))
    assert (res.attributed, res.stripped) == (0, 1)


@pytest.mark.parametrize("name", [*contract.FACT_SERIES, "karta_proxy_samples_total"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_series_named_like_the_proxys_own_is_never_stamped(name: str, version: int) -> None:
    # a sender's forged fact naming a real pod must not get that workload's identity
    # (an alert on karta_workload_phase{phase="Failed", karta_workload=...} would fire)
    labels = {"__name__": name, "phase": "Failed", "exported_namespace": "ml",
              "exported_pod": "train-head", "karta_workload": "train"}
    idx = index_with_pods()
    e = enricher(idx)
    if version == 1:
        raw = request_v1(series_v1(labels))
        res = e.enrich_v1(raw)
        got = labels_of(parse_v1(res.body).timeseries[0])
        ref = enrich_v1_reference(raw, idx, PAIRS, "replace")
        assert parse_v1(ref.body) == parse_v1(res.body)
    else:
        raw = request_v2(labels)
        res = e.enrich_v2(raw)
        req = parse_v2(res.body)
        got = labels_v2(req, req.timeseries[0])
        ref = enrich_v2_reference(raw, idx, PAIRS, "replace")
        refreq = parse_v2(ref.body)
        assert labels_v2(refreq, refreq.timeseries[0]) == got
    assert got == sorted((n, v) for n, v in labels.items() if not n.startswith("karta_"))
    assert (res.attributed, res.unattributed, res.stripped) == (0, {"no_pod_label": 1}, 1)
    assert (ref.attributed, ref.unattributed, ref.stripped) == (0, {"no_pod_label": 1}, 1)


def test_keep_policy_leaves_series_with_karta_workload_alone() -> None:
    raw = request_v1(
        series_v1({"namespace": "ml", "pod": "train-head", "karta_workload": "other"}),
        series_v1({"namespace": "ml", "pod": "train-head"}),
    )
    res = enricher(conflict_policy="keep").enrich_v1(raw)
    first, second = parse_v1(res.body).timeseries
    assert stamped(labels_of(first)) == [("karta_workload", "other")]
    assert stamped(labels_of(second)) == TRAIN_LABELS
    assert res.attributed == 2


def test_bad_policy_refused() -> None:
    with pytest.raises(ValueError):
        enricher(conflict_policy="merge")


def test_already_enriched_series_pass_through_unchanged() -> None:
    raw = request_v1(series_v1({"namespace": "ml", "pod": "train-head"}))
    e = enricher()
    once = e.enrich_v1(raw).body
    twice = e.enrich_v1(once)
    assert twice.body is once
    assert twice.attributed == 1


def test_index_changes_reach_the_pod_table() -> None:
    idx = PodIndex()
    e = enricher(idx)
    raw = request_v1(series_v1({"namespace": "ml", "pod": "late"}))
    assert e.enrich_v1(raw).unattributed == {"pod_unknown": 1}
    idx.apply(ChangeSet(pods={"u9": PodAttribution("ml", "late", "u9", WL_TRAIN, "w", "i")}))
    res = e.enrich_v1(raw)
    assert res.attributed == 1
    assert dict(labels_of(parse_v1(res.body).timeseries[0]))["karta_component"] == "w"
    idx.apply(ChangeSet(pods={"u9": PodAttribution("ml", "late", "u9", WL_TRAIN, "v", "i")}))
    res = e.enrich_v1(raw)
    assert dict(labels_of(parse_v1(res.body).timeseries[0]))["karta_component"] == "v"


def test_the_table_grows_with_pods_not_series(implementation: str) -> None:
    e = enricher()
    pods = len(e.table)
    for i in range(20):
        e.enrich_v1(request_v1(*(series_v1({"namespace": "ml", "pod": "train-head",
                                             "n": f"{i}-{j}"}) for j in range(10))))
    assert len(e.table) == pods
    assert e.implementation == implementation
    assert e.table.implementation == implementation


def test_v2_enrich_appends_symbols_and_keeps_refs() -> None:
    raw = request_v2(
        {"__name__": "container_cpu", "namespace": "ml", "pod": "train-head"},
        {"__name__": "node_load1", "instance": "n1"},
        histograms=1, exemplars=1, metadata=True,
    )
    before = parse_v2(raw)
    res = enricher().enrich_v2(raw)
    after = parse_v2(res.body)
    assert list(after.symbols[: len(before.symbols)]) == list(before.symbols)
    assert len(set(after.symbols)) == len(after.symbols)  # nothing added twice
    first, _ = after.timeseries
    assert stamped(labels_v2(after, first)) == TRAIN_LABELS
    # compared as bytes: a sample's NaN (a staleness marker) is unequal to itself in
    # protobuf 5.26's message comparison, equal in later releases'
    assert after.timeseries[1].SerializeToString() == before.timeseries[1].SerializeToString()
    sent = before.timeseries[0]
    for field in ("samples", "histograms", "exemplars"):
        assert [m.SerializeToString() for m in getattr(first, field)] == \
            [m.SerializeToString() for m in getattr(sent, field)], field
    assert first.metadata.SerializeToString() == sent.metadata.SerializeToString()
    assert res.attributed == 1 and res.unattributed == {"no_pod_label": 1}
    assert (res.counts.samples, res.counts.histograms, res.counts.exemplars) == (4, 2, 2)


def test_v2_reuses_existing_symbols() -> None:
    # "train" and "ml" are already in the table
    raw = request_v2({"namespace": "ml", "pod": "train-head", "job": "train"})
    res = enricher().enrich_v2(raw)
    after = parse_v2(res.body)
    added = list(after.symbols[len(parse_v2(raw).symbols):])
    assert "train" not in added and "ml" not in added
    assert sorted(added) == sorted({"karta_component", "head", "karta_group", "ray.io",
                                     "karta_instance", "karta_kind", "RayJob",
                                     "karta_namespace", "karta_workload"})


def test_v2_untouched_is_byte_exact() -> None:
    raw = request_v2({"namespace": "ml", "pod": "ghost"}, {"a": "b"})
    res = enricher().enrich_v2(raw)
    assert res.body is raw
    assert res.unattributed == {"pod_unknown": 1, "no_pod_label": 1}


@pytest.mark.parametrize("policy", ["replace", "keep"])
def test_reference_agrees_on_fixtures(policy: str) -> None:
    idx = index_with_pods()
    raw1 = request_v1(
        series_v1({"namespace": "ml", "pod": "train-head", "karta_workload": "x"}),
        # a kube_ series: the exported pair names its pod (kube-state-metrics' rule)
        series_v1({"__name__": "kube_pod_info", "exported_namespace": "web",
                   "exported_pod": "shop-abc"}, exemplars=1),
        series_v1({"namespace": "ml", "pod": "lonely"}),
        metadata=True,
    )
    fast = Enricher(idx, PAIRS, conflict_policy=policy).enrich_v1(raw1)
    ref = enrich_v1_reference(raw1, idx, PAIRS, policy)
    assert parse_v1(fast.body) == parse_v1(ref.body)
    assert (fast.counts, fast.attributed, fast.unattributed, fast.stripped) == (
        ref.counts, ref.attributed, ref.unattributed, ref.stripped)
    raw2 = request_v2({"namespace": "ml", "pod": "train-head", "karta_workload": "x"},
                      {"__name__": "kube_pod_info", "exported_namespace": "web",
                       "exported_pod": "shop-abc"})
    fast2 = Enricher(idx, PAIRS, conflict_policy=policy).enrich_v2(raw2)
    ref2 = enrich_v2_reference(raw2, idx, PAIRS, policy)
    a, b = parse_v2(fast2.body), parse_v2(ref2.body)
    assert [labels_v2(a, t) for t in a.timeseries] == [labels_v2(b, t) for t in b.timeseries]
    assert (fast2.counts, fast2.attributed, fast2.stripped) == (
        ref2.counts, ref2.attributed, ref2.stripped)


def test_stamped_labels_come_from_the_contract() -> None:
    assert {n for n, _ in TRAIN_LABELS} <= set(contract.STAMPED_LABELS)


# -- DCGM: the GPU's pod, never the exporter's ----------------------------------------------

EXPORTER = "nvidia-dcgm-exporter-7xk2p"
_DCGM_TARGET = {  # what the scrape config adds (a prometheus-operator ServiceMonitor)
    "endpoint": "gpu-metrics",
    "instance": "10.1.0.7:9400",
    "job": "nvidia-dcgm-exporter",
    "service": "nvidia-dcgm-exporter",
}
_DCGM_GPU = {
    "DCGM_FI_DRIVER_VERSION": "535.104.05",
    "Hostname": "gpu-node-1",
    "UUID": "GPU-4c2b9f1e-8a1d-2f6e-9b0c-3d5e7f9a1b2c",
    "device": "nvidia0",
    "gpu": "0",
    "modelName": "NVIDIA A100-SXM4-80GB",
    "pci_bus_id": "00000000:07:00.0",
}


def _index_with_exporter() -> PodIndex:
    idx = index_with_pods()
    ds = WorkloadRef("gpu-operator", "apps", "DaemonSet", "nvidia-dcgm-exporter", "w9")
    idx.apply(ChangeSet(pods={"u9": PodAttribution(
        "gpu-operator", EXPORTER, "u9", ds, "", "nvidia-dcgm-exporter")}))
    return idx


def _dcgm(metric: str, honor_labels: bool, gpu_pod: tuple[str, str, str] | None,
          target_container: bool = True) -> dict[str, str]:
    """A DCGM series as a Prometheus agent sends it. ``gpu_pod``: (namespace, pod,
    container) of the pod holding the GPU, None for an idle GPU."""
    out = {"__name__": metric, **_DCGM_TARGET, **_DCGM_GPU,
           "namespace": "gpu-operator", "pod": EXPORTER}
    if target_container:
        out["container"] = "nvidia-dcgm-exporter"
    if gpu_pod is not None:
        ns, pod, container = gpu_pod
        if honor_labels:  # the exporter's labels win over the target's
            out.update(namespace=ns, pod=pod, container=container)
        else:  # renamed exported_* by the server
            out.update(exported_namespace=ns, exported_pod=pod, exported_container=container)
    return out


TRAIN_GPU = ("ml", "train-head", "ray-worker")


@pytest.mark.parametrize("honor_labels", [False, True])
@pytest.mark.parametrize("target_container", [True, False])
def test_dcgm_gpu_of_a_pod_is_the_pods_idle_gpu_is_nobodys(
    honor_labels: bool, target_container: bool
) -> None:
    busy = _dcgm("DCGM_FI_DEV_FB_USED", honor_labels, TRAIN_GPU, target_container)
    idle = _dcgm("DCGM_FI_DEV_FB_USED", honor_labels, None, target_container)
    # the exporter's own cAdvisor series: the plain pair is right for it
    own = {"__name__": "container_memory_working_set_bytes", "namespace": "gpu-operator",
           "pod": EXPORTER, "container": "nvidia-dcgm-exporter", "job": "kubelet"}
    raw = request_v1(series_v1(busy), series_v1(idle), series_v1(own))
    idx = _index_with_exporter()
    res = Enricher(idx, PAIRS).enrich_v1(raw)
    out = [dict(labels_of(ts)) for ts in parse_v1(res.body).timeseries]
    assert out[0]["karta_workload"] == "train"
    assert {k: v for k, v in out[0].items() if not k.startswith("karta_")} == busy
    assert out[1] == idle  # untouched: not charged to the dcgm-exporter
    assert out[2]["karta_workload"] == "nvidia-dcgm-exporter"
    assert res.attributed == 2 and res.unattributed == {"no_pod_label": 1}
    ref = enrich_v1_reference(raw, idx, PAIRS)
    assert parse_v1(ref.body) == parse_v1(res.body)
    # RW 2.0 decides the same way
    raw2 = request_v2(busy, idle, own)
    res2 = Enricher(idx, PAIRS).enrich_v2(raw2)
    req2 = parse_v2(res2.body)
    assert [dict(labels_v2(req2, ts)).get("karta_workload") for ts in req2.timeseries] == [
        "train", None, "nvidia-dcgm-exporter"]
    assert res2.unattributed == {"no_pod_label": 1}


def test_without_rules_an_idle_gpu_falls_back_to_the_exporters_pod() -> None:
    """What the rule is for: the plain pair alone names the exporter."""
    idle = _dcgm("DCGM_FI_DEV_FB_USED", False, None)
    res = Enricher(_index_with_exporter(), PAIRS, pod_label_rules=[]).enrich_v1(
        request_v1(series_v1(idle)))
    assert dict(labels_of(parse_v1(res.body).timeseries[0]))["karta_workload"] == (
        "nvidia-dcgm-exporter")


def test_rules_come_from_the_settings() -> None:
    s = settings_from_dict({"enrich": {"pod_label_rules": [{
        "metric_prefix": "gpu_", "pod_label_pairs": [
            {"namespace": "namespace", "pod": "pod", "unless": {"job": "exp.*"}}]}]}})
    rules = s.enrich.pod_label_rules
    e = Enricher(index_with_pods(), PAIRS, pod_label_rules=rules)
    raw = request_v1(
        series_v1({"__name__": "gpu_x", "namespace": "ml", "pod": "train-head", "job": "j"}),
        series_v1({"__name__": "gpu_x", "namespace": "ml", "pod": "train-head",
                   "job": "exporter"}),
        series_v1({"__name__": "DCGM_X", "namespace": "ml", "pod": "train-head",
                   "job": "exporter"}),  # no DCGM rule in these settings: plain pair
    )
    res = e.enrich_v1(raw)
    assert res.attributed == 2 and res.unattributed == {"no_pod_label": 1}
    assert parse_v1(res.body) == parse_v1(enrich_v1_reference(raw, index_with_pods(), PAIRS,
                                                              pod_label_rules=rules).body)


def test_v2_same_label_sets_with_other_symbol_tables() -> None:
    idx = index_with_pods()
    e = enricher(idx)
    first = {"__name__": "container_cpu", "namespace": "ml", "pod": "train-head"}
    other = {"__name__": "node_load1", "instance": "n1"}
    a = e.enrich_v2(request_v2(first, other))
    # the same label sets, other refs: strings in another order, an extra symbol first
    raw_b = request_v2(other, first, symbols=["", "zzz", "n1", "instance"])
    b = e.enrich_v2(raw_b)
    req_a, req_b = parse_v2(a.body), parse_v2(b.body)
    assert labels_v2(req_b, req_b.timeseries[1]) == labels_v2(req_a, req_a.timeseries[0])
    assert (b.attributed, b.unattributed) == (1, {"no_pod_label": 1})
    ref = enrich_v2_reference(raw_b, idx, PAIRS)
    assert [labels_v2(req_b, t) for t in req_b.timeseries] == [
        labels_v2(parse_v2(ref.body), t) for t in parse_v2(ref.body).timeseries]
    # an index change reaches RW 2.0 too
    idx.apply(ChangeSet(pods={"u1": PodAttribution("ml", "train-head", "u1", WL_TRAIN,
                                                   "tail", "train")}))
    c = e.enrich_v2(raw_b)
    req_c = parse_v2(c.body)
    assert dict(labels_v2(req_c, req_c.timeseries[1]))["karta_component"] == "tail"


# -- the pod table follows the index per pod --------------------------------------------------


def test_tombstones_and_expiry_reach_the_table() -> None:
    now = [1000.0]
    idx = PodIndex(tombstone_seconds=60, clock=lambda: now[0])
    idx.apply(ChangeSet(pods={"u1": PodAttribution("ml", "a", "u1", WL_TRAIN, "x", "i"),
                              "u2": PodAttribution("ml", "b", "u2", None, reason="why")}))
    e = enricher(idx)  # created after the index was filled: removals still find their pod
    raw = request_v1(series_v1({"namespace": "ml", "pod": "a"}),
                     series_v1({"namespace": "ml", "pod": "b"}))
    assert e.enrich_v1(raw).unattributed == {"why": 1}
    idx.apply(ChangeSet(pods={"u1": None, "u2": None}))  # both deleted
    res = e.enrich_v1(raw)
    assert res.attributed == 1  # a's tombstone keeps its labels for a while
    assert res.unattributed == {"pod_unknown": 1}  # b was never attributed: now unknown
    now[0] += 61
    assert idx.expire() == 1  # no change set: the index tells its pod listeners
    res = e.enrich_v1(raw)
    assert res.attributed == 0 and res.unattributed == {"pod_unknown": 2}
    assert e.enrich_v2(request_v2({"namespace": "ml", "pod": "a"})).unattributed == {
        "pod_unknown": 1}


def test_a_pod_event_changes_only_that_pods_series() -> None:
    idx = index_with_pods()
    e = enricher(idx)
    raw = request_v1(series_v1({"namespace": "ml", "pod": "train-head", "c": "1"}),
                     series_v1({"namespace": "web", "pod": "shop-abc", "c": "1"}))
    e.enrich_v1(raw)
    idx.apply(ChangeSet(pods={"u2": PodAttribution("web", "shop-abc", "u2", WL_TRAIN, "new",
                                                   "shop")}))
    res = e.enrich_v1(raw)
    out = [dict(labels_of(ts)) for ts in parse_v1(res.body).timeseries]
    assert out[1]["karta_component"] == "new" and out[0]["karta_component"] == "head"


# -- exported_* labels: whom they are trusted from --------------------------------------

#: kube-state-metrics' own pod, the target Prometheus scrapes its series from
_KSM_TARGET = {"namespace": "monitoring", "pod": "kube-state-metrics-5d8f7-x2x9q",
               "container": "kube-state-metrics", "job": "kube-state-metrics"}


def test_an_applications_exported_pair_does_not_name_another_pod() -> None:
    """The forgery the default used to allow: a scraped application (web/shop-abc) exposes
    its own ``namespace``/``pod`` naming a pod of ml; under ``honor_labels: false``
    Prometheus renames them ``exported_*``, keeps the target's pair, and the series must
    stay the application's, in both protocols and both splices."""
    forged = {"__name__": "audit_gpu_seconds_total", "exported_namespace": "ml",
              "exported_pod": "train-head", "namespace": "web", "pod": "shop-abc",
              "job": "app"}
    res = enricher().enrich_v1(request_v1(series_v1(forged)))
    (ts,) = parse_v1(res.body).timeseries
    assert dict(labels_of(ts))["karta_workload"] == "shop"
    assert dict(labels_of(ts))["karta_namespace"] == "web"
    res2 = enricher().enrich_v2(request_v2(forged))
    req2 = parse_v2(res2.body)
    assert dict(labels_v2(req2, req2.timeseries[0]))["karta_workload"] == "shop"
    # with only the exported pair (a target without pod labels) it names no pod at all
    alone = {k: v for k, v in forged.items() if k not in ("namespace", "pod")}
    res3 = enricher().enrich_v1(request_v1(series_v1(alone)))
    assert res3.unattributed == {"no_pod_label": 1} and res3.attributed == 0


def _ksm(metric: str, honor_labels: bool, **object_labels: str) -> dict[str, str]:
    """A kube-state-metrics series as a Prometheus agent sends it: the object's
    ``namespace``/``pod``/``container`` win under ``honor_labels: true`` and are renamed
    ``exported_*`` under false, where the target's (KSM's own) stay."""
    out = {"__name__": metric, **_KSM_TARGET}
    if honor_labels:
        out.update(object_labels)
    else:
        out.update({f"exported_{k}" if k in _KSM_TARGET else k: v
                    for k, v in object_labels.items()})
    return out


@pytest.mark.parametrize("honor_labels", [False, True])
def test_kube_state_metrics_series_name_the_objects_pod(honor_labels: bool) -> None:
    info = _ksm("kube_pod_info", honor_labels, namespace="ml", pod="train-head",
                node="n1", uid="u1")
    requests = _ksm("kube_pod_container_resource_requests", honor_labels, namespace="web",
                    pod="shop-abc", container="app", resource="cpu", unit="core")
    raw = request_v1(series_v1(info), series_v1(requests))
    res = enricher().enrich_v1(raw)
    out = [dict(labels_of(ts)) for ts in parse_v1(res.body).timeseries]
    assert [(o["karta_namespace"], o["karta_workload"]) for o in out] == [
        ("ml", "train"), ("web", "shop")]
    ref = enrich_v1_reference(raw, index_with_pods(), PAIRS)
    assert parse_v1(res.body) == parse_v1(ref.body)
    raw2 = request_v2(info, requests)
    req2 = parse_v2(enricher().enrich_v2(raw2).body)
    assert [dict(labels_v2(req2, t))["karta_workload"] for t in req2.timeseries] == [
        "train", "shop"]


def test_unless_narrows_the_exported_pair_to_kube_state_metrics_own_target() -> None:
    """The narrowing docs/wire.md shows: the exported pair of a ``kube_`` series is read
    only when the target's ``container`` is kube-state-metrics' (Python ``re``, anchored at
    both ends, so the lookahead must reach the end itself). Another application emitting a
    ``kube_`` name keeps its own pod."""
    s = settings_from_dict({"enrich": {"pod_label_rules": [{
        "metric_prefix": "kube_", "pod_label_pairs": [
            {"namespace": "exported_namespace", "pod": "exported_pod",
             "unless": {"container": "(?!kube-state-metrics$).*"}},
            ["namespace", "pod"]]}]}})
    rules = s.enrich.pod_label_rules
    ksm = _ksm("kube_pod_info", False, namespace="ml", pod="train-head")
    other = {"__name__": "kube_pod_info", "exported_namespace": "ml",
             "exported_pod": "train-head", "namespace": "web", "pod": "shop-abc",
             "container": "app"}
    near = {**other, "container": "kube-state-metrics-fork"}  # not a prefix match
    raw = request_v1(series_v1(ksm), series_v1(other), series_v1(near))
    idx = index_with_pods()
    res = Enricher(idx, PAIRS, pod_label_rules=rules).enrich_v1(raw)
    assert [dict(labels_of(t))["karta_workload"] for t in parse_v1(res.body).timeseries] == [
        "train", "shop", "shop"]
    ref = enrich_v1_reference(raw, idx, PAIRS, pod_label_rules=rules)
    assert parse_v1(res.body) == parse_v1(ref.body)
    req2 = parse_v2(Enricher(idx, PAIRS, pod_label_rules=rules).enrich_v2(
        request_v2(ksm, other, near)).body)
    assert [dict(labels_v2(req2, t))["karta_workload"] for t in req2.timeseries] == [
        "train", "shop", "shop"]
