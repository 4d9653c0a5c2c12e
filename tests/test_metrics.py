"""The proxy's own metrics (proxy.metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from proxy.metrics import Children


def test_children_are_the_metrics_own_looked_up_once() -> None:
    registry = CollectorRegistry()
    counter = Counter("requests", "Requests.", ["path", "code"], registry=registry)
    children = Children(counter)
    first = children("/api/v1/write", "204")
    assert first is counter.labels("/api/v1/write", "204")
    assert children("/api/v1/write", "204") is first
    first.inc()
    children("/api/v1/write", "204").inc(2)
    children("/api/v1/write", "400").inc()
    assert registry.get_sample_value("requests_total",
                                     {"path": "/api/v1/write", "code": "204"}) == 3
    assert registry.get_sample_value("requests_total",
                                     {"path": "/api/v1/write", "code": "400"}) == 1


def test_the_engines_jq_errors_are_a_counter_by_where() -> None:
    """Engine.stats was read nowhere: the jq runtime errors are on /metrics, every
    ``where`` present from the start."""
    from proxy.karta.engine import Engine
    from proxy.karta.results import STAT_SELECTOR_ERROR, STAT_STATUS_JQ_ERROR
    from proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics()
    get = metrics.registry.get_sample_value
    assert get("karta_proxy_jq_errors_total", {"where": "status"}) is None  # no engine yet
    engine = Engine(builtins=False)
    metrics.watch_engine(engine)
    for where in ("selector", "workload", "status"):
        assert get("karta_proxy_jq_errors_total", {"where": where}) == 0
    engine.stats[STAT_STATUS_JQ_ERROR] += 2
    engine.stats[STAT_SELECTOR_ERROR] += 1
    assert get("karta_proxy_jq_errors_total", {"where": "status"}) == 2
    assert get("karta_proxy_jq_errors_total", {"where": "selector"}) == 1


def test_series_out_help_says_it_counts_only_what_the_upstream_accepted() -> None:
    """direction="out" is counted after the upstream's 2xx (proxy/handler.py; held by
    tests/test_handler.py): the HELP said "forwarded", which a refused request is too,
    while docs/operations.md said "forwarded and accepted upstream"."""
    from proxy.metrics import ProxyMetrics

    (family,) = [m for m in ProxyMetrics().registry.collect()
                 if m.name == "karta_proxy_series"]
    assert "accepted upstream" in family.documentation
    assert "2xx" in family.documentation
