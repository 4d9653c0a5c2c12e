"""The proxy's own metrics (proxy.metrics)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.loop_metrics import LoopCounter, LoopHistogram

# imported, it turns prometheus_client's *_created series off process-wide, as in the proxy
from proxy.metrics import ProxyMetrics

_BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def test_loop_counters_expose_what_prometheus_client_counters_do() -> None:
    """The request path's counters are plain numbers (proxy.loop_metrics): the same
    exposition, byte for byte, as the prometheus_client counters they replace, an
    unlabelled one present at 0 from the start and a labelled one's series in the order
    they were first counted."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    samples = LoopCounter("samples", "Float samples received.", registry=ours)
    unused = LoopCounter("unused", "Never counted.", registry=ours)
    requests = LoopCounter("requests", "Requests.", ["path", "code"], registry=ours)
    none_yet = LoopCounter("refused", "None yet.", ["reason"], registry=ours)
    their_samples = Counter("samples", "Float samples received.", registry=theirs)
    Counter("unused", "Never counted.", registry=theirs)
    their_requests = Counter("requests", "Requests.", ["path", "code"], registry=theirs)
    Counter("refused", "None yet.", ["reason"], registry=theirs)
    for path, code, n in (("/api/v1/write", "204", 1), ("/api/v1/push", "400", 2),
                          ("/api/v1/write", "204", 3), ("/api/v1/write", "503", 0)):
        requests.values[(path, code)] += n
        their_requests.labels(path, code).inc(n)
    samples.values[()] += 2000
    their_samples.inc(2000)
    assert generate_latest(ours) == generate_latest(theirs)
    assert ours.get_sample_value("requests_total",
                                 {"path": "/api/v1/write", "code": "204"}) == 4
    assert ours.get_sample_value("unused_total") == 0
    assert unused.values == {(): 0.0} and not none_yet.values


def test_loop_histograms_expose_what_prometheus_client_histograms_do() -> None:
    """Buckets cumulative, ``le`` as prometheus_client writes it, a value on a bound
    counted in that bound's bucket, ``_count`` and ``_sum``; unlabelled present from the
    start."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    by_protocol = LoopHistogram("duration_seconds", "Time.", ["protocol"], buckets=_BUCKETS,
                                registry=ours)
    round_trip = LoopHistogram("round_trip_seconds", "Round trip.", buckets=_BUCKETS,
                               registry=ours)
    LoopHistogram("idle_seconds", "Never observed.", buckets=_BUCKETS, registry=ours)
    their_by_protocol = Histogram("duration_seconds", "Time.", ["protocol"],
                                  buckets=_BUCKETS, registry=theirs)
    their_round_trip = Histogram("round_trip_seconds", "Round trip.", buckets=_BUCKETS,
                                 registry=theirs)
    Histogram("idle_seconds", "Never observed.", buckets=_BUCKETS, registry=theirs)
    for protocol, amount in (("v1", 0.0005), ("v2", 0.01), ("v1", 0.01), ("v1", 3.0),
                             ("unknown", 100.0), ("v2", 1.0)):
        by_protocol.series[(protocol,)].observe(amount)
        their_by_protocol.labels(protocol).observe(amount)
        round_trip.series[()].observe(amount)
        their_round_trip.observe(amount)
    assert generate_latest(ours) == generate_latest(theirs)


def test_loop_metrics_are_read_whole_from_another_thread() -> None:
    """A scrape from another thread while the loop counts: every read a number the
    counter had (a dict the loop adds to is copied before it is read)."""
    registry = CollectorRegistry()
    counter = LoopCounter("requests", "Requests.", ["code"], registry=registry)
    stop = threading.Event()

    def count() -> None:
        i = 0
        while not stop.is_set():
            counter.values[(str(i % 500),)] += 1
            i += 1

    writer = threading.Thread(target=count)
    writer.start()
    try:
        for _ in range(200):
            generate_latest(registry)
    finally:
        stop.set()
        writer.join()


def test_the_engines_jq_errors_are_a_counter_by_where_and_description() -> None:
    """Engine.stats was read nowhere: the jq runtime errors are on /metrics, every
    ``where`` of every description in force present from the start; and by description,
    since the count alone said that some description failed, not which (its log line,
    throttled, named it)."""
    from proxy.karta.engine import Engine

    metrics = ProxyMetrics()
    get = metrics.registry.get_sample_value
    status = {"where": "status", "description": "builtin-apps-deployment"}
    assert get("karta_proxy_jq_errors_total", status) is None  # no engine yet
    engine = Engine()
    metrics.watch_engine(engine)
    names = {d.name for d in engine.descriptions().values()}
    assert "builtin-apps-deployment" in names
    for name in names:
        for where in ("selector", "workload", "status"):
            labels = {"where": where, "description": name}
            assert get("karta_proxy_jq_errors_total", labels) == 0
    engine.jq_errors[("status", "builtin-apps-deployment")] += 2
    engine.jq_errors[("selector", "gone-since-a-reload")] += 1
    assert get("karta_proxy_jq_errors_total", status) == 2
    # a description no longer in force keeps what it counted
    assert get("karta_proxy_jq_errors_total",
               {"where": "selector", "description": "gone-since-a-reload"}) == 1


def _description_errors(metrics: ProxyMetrics) -> dict[str, float | None]:
    get = metrics.registry.get_sample_value
    return {reason: get("karta_proxy_description_errors", {"reason": reason})
            for reason in ("invalid", "held_last_valid", "not_in_force")}


def test_a_description_file_that_does_not_parse_is_counted_until_fixed(
        tmp_path: Path) -> None:
    """A file of karta.description_paths that does not parse (as the start reads it:
    ``add_descriptions`` with its errors) was a log line only: the gauge is 1 ``invalid``
    while it is, every reason present at 0 before and after."""
    from proxy.karta.description import load_description_file
    from proxy.karta.engine import Engine
    from tests.karta.test_engine import jobset_karta

    metrics = ProxyMetrics()
    engine = Engine()
    metrics.watch_engine(engine)
    assert _description_errors(metrics) == {
        "invalid": 0, "held_last_valid": 0, "not_in_force": 0}
    f = tmp_path / "jobset.yaml"
    f.write_text("kind: Karta\nspec: [not, a, map\n")
    descs, errors = load_description_file(f)
    engine.add_descriptions(descs, errors=errors)
    assert _description_errors(metrics) == {
        "invalid": 1, "held_last_valid": 0, "not_in_force": 0}
    f.write_text(yaml.safe_dump(jobset_karta(ownerless=False)))
    descs, errors = load_description_file(f)
    assert descs and not errors
    engine.add_descriptions(descs, errors=errors)
    assert _description_errors(metrics) == {
        "invalid": 0, "held_last_valid": 0, "not_in_force": 0}


def test_a_karta_object_edited_invalid_is_counted_as_held_until_mended() -> None:
    """A Karta object edited invalid keeps its last valid version in force (the engine's
    test_an_invalid_edit_of_a_description_object_keeps_its_last_valid_version): nothing
    moves until a restart, which then takes its kind's pods to description_error. The
    gauge says so now (``held_last_valid``); a process started with the object invalid
    (the restart) counts it ``invalid``; mended or deleted, 0."""
    from proxy.karta.engine import Engine
    from tests.karta.test_engine import jobset_karta, obj, pod

    metrics = ProxyMetrics()
    engine = Engine()
    metrics.watch_engine(engine)
    js = obj("jobset.x-k8s.io/v1alpha2", "JobSet", "js", spec={"replicatedJobs": []})
    job = obj("batch/v1", "Job", "js-workers-0", js, spec={"parallelism": 1})
    engine.upsert(jobset_karta(ownerless=False))
    engine.upsert_many([js, job, pod("w", job)])
    engine.upsert(jobset_karta(ownerless=True))
    assert _description_errors(metrics) == {
        "invalid": 0, "held_last_valid": 1, "not_in_force": 0}
    engine.upsert(jobset_karta(ownerless=False))  # mended
    assert _description_errors(metrics) == {
        "invalid": 0, "held_last_valid": 0, "not_in_force": 0}
    engine.upsert(jobset_karta(ownerless=True))
    engine.delete(jobset_karta(ownerless=True))
    assert _description_errors(metrics)["held_last_valid"] == 0
    # the restart: a process that never saw it valid
    restarted = ProxyMetrics()
    fresh = Engine()
    restarted.watch_engine(fresh)
    fresh.upsert_many([js, job, pod("w", job), jobset_karta(ownerless=True)])
    assert _description_errors(restarted) == {
        "invalid": 1, "held_last_valid": 0, "not_in_force": 0}
    att = fresh.pod("pod-w")
    assert att is not None and att.reason == "description_error"


def test_two_descriptions_of_one_kind_count_the_loser_not_in_force() -> None:
    """Two valid descriptions of one kind: the loser is ``not_in_force`` (a built-in a
    user description replaces is not counted); gone, 0."""
    import copy

    from proxy.karta.engine import Engine
    from tests.karta.test_engine import RAY_KARTA

    metrics = ProxyMetrics()
    engine = Engine()
    metrics.watch_engine(engine)
    zzz, aaa = copy.deepcopy(RAY_KARTA), copy.deepcopy(RAY_KARTA)
    zzz["metadata"] = {"name": "zzz-team", "uid": "z"}
    aaa["metadata"] = {"name": "aaa-platform", "uid": "a"}
    engine.upsert(zzz)
    assert _description_errors(metrics)["not_in_force"] == 0
    engine.upsert(aaa)
    assert _description_errors(metrics) == {
        "invalid": 0, "held_last_valid": 0, "not_in_force": 1}
    engine.delete(aaa)
    assert _description_errors(metrics)["not_in_force"] == 0


def test_the_jq_sandbox_restarts_and_quarantine_are_read_at_scrape_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reason at 0 without a sandbox (karta.jq_sandbox off), then the sandbox's
    own counts (real children: a time limit hit, then quarantined)."""
    from proxy.karta import jq_sandbox
    from proxy.karta.jq_sandbox import QUARANTINE_STRIKES, JqSandbox
    from proxy.karta.jqexpr import JqError, JqExpr

    # struck however loaded the box (tests/karta/test_jq_sandbox.py, LOADED_BOX_SHARE)
    monkeypatch.setattr(jq_sandbox, "STRIKE_CPU_SHARE", 0.05)

    metrics = ProxyMetrics()
    get = metrics.registry.get_sample_value
    restarts = "karta_proxy_jq_sandbox_restarts_total"
    for reason in ("timeout", "died", "start_failed"):
        assert get(restarts, {"reason": reason}) == 0
    assert get("karta_proxy_jq_quarantined_expressions") == 0
    assert get("karta_proxy_jq_sandbox_seconds_total") == 0
    box = JqSandbox(timeout_seconds=0.2)
    metrics.watch_jq_sandbox(box)
    looping = JqExpr("[limit(100000000; repeat(1))] | length")
    try:
        for _ in range(QUARANTINE_STRIKES):
            with pytest.raises(JqError):
                box.run(looping, "null")
    finally:
        box.close()
    assert get(restarts, {"reason": "timeout"}) == QUARANTINE_STRIKES
    assert get(restarts, {"reason": "died"}) == 0
    assert get("karta_proxy_jq_quarantined_expressions") == 1
    waited = get("karta_proxy_jq_sandbox_seconds_total")
    assert waited is not None and waited >= QUARANTINE_STRIKES * 0.2

def test_series_out_help_says_it_counts_only_what_the_upstream_accepted() -> None:
    """direction="out" is counted after the upstream's 2xx (proxy/handler.py; held by
    tests/test_handler.py): the HELP said "forwarded", which a refused request is too,
    while docs/operations.md said "forwarded and accepted upstream"."""
    (family,) = [m for m in ProxyMetrics().registry.collect()
                 if m.name == "karta_proxy_series"]
    assert "accepted upstream" in family.documentation
    assert "2xx" in family.documentation
