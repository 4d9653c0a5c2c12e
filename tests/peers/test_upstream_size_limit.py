"""A request that fits the upstream's size limit as the sender sent it, but not stamped:
through the proxy every sample is still stored (sent in parts), against a real
VictoriaMetrics with a small ``-maxInsertRequestSize`` (which answers such a request 400
"too big unpacked request", not 413)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest

from proxy.sender import Series, build_v1, send_series
from proxy.upstream import WRITTEN_SAMPLES
from proxy.wire.primitives import Protocol
from tests.peers.conftest import InProcessProxy, Peers, query, vm_flush, wait_until

pytestmark = pytest.mark.peers

#: a pod of the demo snapshot: its series get stamped
POD = {"namespace": "web", "pod": "frontend-6d8f7b9c5d-4xkqp"}
SERIES = 200


def batch(via: str, now_ms: int) -> list[Series]:
    return [Series({"__name__": "split_probe", **POD, "container": f"c-{i:03d}",
                    "via": via}, [(now_ms, float(i))]) for i in range(SERIES)]


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
async def test_a_batch_over_the_limit_only_once_stamped_is_stored_whole(
    peers: Peers, make_proxy: Callable[..., Awaitable[InProcessProxy]], protocol: Protocol,
) -> None:
    """RW 2.0 goes to this 1.0-only receiver converted, and is cut so."""
    now_ms = int(time.time() * 1000)
    size = len(build_v1(batch("d", now_ms)))  # the decoded size VictoriaMetrics checks
    limit = size * 21 // 20  # 5% of room: the sender's batch fits, the stamped one does not
    vm = await peers.victoria_metrics(extra=[f"-maxInsertRequestSize={limit}"])
    status, _, text = await send_series(vm.base_url + "/api/v1/write", batch("d", now_ms))
    assert status == 204, text  # direct, the batch fits
    proxy = await make_proxy(vm.base_url + "/api/v1/write")
    status, headers, text = await send_series(proxy.write_url, batch("p", now_ms),
                                              protocol=protocol)
    assert status == 204, text
    if protocol is Protocol.V2:
        assert headers[WRITTEN_SAMPLES] == str(SERIES)
    m = proxy.proxy.metrics.registry
    # the stamped request was refused for its size, then stored in parts
    assert m.get_sample_value("karta_proxy_upstream_responses_total", {"code": "400"}) == 1
    assert m.get_sample_value("karta_proxy_upstream_split_requests_total",
                              {"result": "stored"}) == 1
    at = time.time()

    async def stored() -> bool:
        await vm_flush(vm)
        r = await query(vm.base_url, 'count(split_probe{via="p"})', at)
        return bool(r) and float(r[0]["value"][1]) == SERIES

    await wait_until(stored, timeout=20, what="every series sent through the proxy")
    stamped = await query(vm.base_url, 'split_probe{via="p", karta_workload!=""}', at)
    assert sorted(float(r["value"][1]) for r in stamped) == [float(i) for i in range(SERIES)]
