"""A TSDB's limit of labels per series, against real VictoriaMetrics: the stamp must not
be what pushes a series past it (``upstream.max_labels_per_series``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest

from proxy.sender import Series, send_series
from proxy.wire.primitives import Protocol
from tests.peers.conftest import InProcessProxy, Peers, series_set, vm_flush, wait_until

pytestmark = pytest.mark.peers

#: a pod of the demo snapshot: its series get stamped
POD = {"namespace": "web", "pod": "frontend-6d8f7b9c5d-4xkqp"}
LIMIT = 20


def batch(name: str, now_ms: int) -> list[Series]:
    """Three series of LIMIT - 2 labels that differ only in ``zone``, which sorts after
    every karta_* label (VictoriaMetrics at its limit drops the labels that sort last), and
    one of 5 labels, which the stamp keeps within the limit."""
    wide = {f"a{j:02d}": "v" for j in range(LIMIT - 6)}
    out = [Series({"__name__": name, **POD, **wide, "zone": f"z{z}"}, [(now_ms, float(z))])
           for z in range(3)]
    out.append(Series({"__name__": name, **POD, "zone": "narrow"}, [(now_ms, 9.0)]))
    assert [len(s.labels) for s in out] == [LIMIT - 2] * 3 + [4]
    return out


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_series_the_stamp_would_push_past_the_tsdb_limit_are_stored_distinct(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], protocol: Protocol,
) -> None:
    """Before: stamped past VictoriaMetrics' -maxLabelsPerTimeseries, the three wide
    series lost their last labels (``zone``) and merged into one, behind a 204 (the
    audit's t9: 3 sent, 1 stored). Now they go unstamped and are stored as sent, counted
    ``label_limit``; the narrow one is stamped."""
    vm = await peers.victoria_metrics(extra=[f"-maxLabelsPerTimeseries={LIMIT}"])
    proxy = await make_proxy(vm.base_url + "/api/v1/write", max_labels_per_series=LIMIT)
    now_ms = int(time.time() * 1000)
    name = f"label_limit_probe_{protocol.name.lower()}"
    status, _, text = await send_series(proxy.write_url, batch(name, now_ms),
                                        protocol=protocol)
    assert status == 204, text
    start, end = now_ms / 1000 - 60, now_ms / 1000 + 60
    got: set[frozenset[tuple[str, str]]] = set()

    async def stored() -> bool:
        nonlocal got
        await vm_flush(vm)
        got = await series_set(vm.base_url, name, start, end)
        return len(got) >= 4

    await wait_until(stored, timeout=20, what="the four series")
    assert len(got) == 4, got
    by_zone = {dict(s)["zone"]: dict(s) for s in got}
    assert sorted(by_zone) == ["narrow", "z0", "z1", "z2"]
    for z in ("z0", "z1", "z2"):
        assert by_zone[z] == {"__name__": name, **POD, **{f"a{j:02d}": "v"
                                                          for j in range(LIMIT - 6)},
                              "zone": z}
    assert by_zone["narrow"].get("karta_workload")
    m = proxy.proxy.metrics.registry
    assert m.get_sample_value("karta_proxy_series_unattributed_total",
                              {"reason": "label_limit"}) == 3
