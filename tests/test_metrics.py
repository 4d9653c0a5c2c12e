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
