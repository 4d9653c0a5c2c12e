"""A proxy to test against: assembled by ``proxy.runtime`` on a small snapshot (one
Deployment's pod, ``cart``), forwarding to a scripted loopback receiver
(``tests.scripted``), and the remote-write bodies sent to it.

Shared by the test modules that run a whole proxy (the handler, admission, the connection
guard, the CLI, TLS, reload, the runtime), so none of them imports another test module.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, cast

from proxy.config import Settings
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2
from proxy.runtime import Proxy
from tests.scripted import ScriptedUpstream

WriteRequest: Any = cast(Any, remote_pb2).WriteRequest
RequestV2: Any = cast(Any, v2).Request

CT_V1 = "application/x-protobuf"
CT_V2 = "application/x-protobuf;proto=io.prometheus.write.v2.Request"

#: the snapshot every such proxy starts on: the Deployment ``shop/cart``, its
#: ReplicaSet and their one pod
SNAPSHOT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: cart, namespace: shop, uid: d-cart}
spec: {replicas: 1, selector: {matchLabels: {app: cart}}}
---
apiVersion: apps/v1
kind: ReplicaSet
metadata:
  name: cart-7d9f8
  namespace: shop
  uid: rs-cart
  ownerReferences:
  - {apiVersion: apps/v1, kind: Deployment, name: cart, uid: d-cart, controller: true}
spec: {replicas: 1, selector: {matchLabels: {app: cart}}}
---
apiVersion: v1
kind: Pod
metadata:
  name: cart-7d9f8-abcde
  namespace: shop
  uid: p-cart
  labels: {app: cart}
  ownerReferences:
  - {apiVersion: apps/v1, kind: ReplicaSet, name: cart-7d9f8, uid: rs-cart, controller: true}
spec: {nodeName: n1, containers: [{name: cart, image: cart:1}]}
status: {phase: Running}
"""

#: what the snapshot's pod ``shop/cart-7d9f8-abcde`` is stamped with
CART = {
    "karta_component": "deployment",
    "karta_group": "apps",
    "karta_kind": "Deployment",
    "karta_namespace": "shop",
    "karta_workload": "cart",
}


def series_v1(*label_sets: dict[str, str], value: float = 1.0) -> bytes:
    req = WriteRequest()
    for labels in label_sets:
        ts = req.timeseries.add()
        for k, v in sorted(labels.items()):
            ts.labels.add(name=k, value=v)
        ts.samples.add(value=value, timestamp=1_700_000_000_000)
    return cast(bytes, req.SerializeToString())


def series_v2(*label_sets: dict[str, str]) -> bytes:
    req = RequestV2()
    symbols = [""]
    for labels in label_sets:
        ts = req.timeseries.add()
        for k, v in sorted(labels.items()):
            for s in (k, v):
                if s not in symbols:
                    symbols.append(s)
                ts.labels_refs.append(symbols.index(s))
        ts.samples.add(value=1.0, timestamp=1_700_000_000_000)
    req.symbols.extend(symbols)
    return cast(bytes, req.SerializeToString())


async def start_proxy(tmp_path: Path, upstream: ScriptedUpstream, *,
                      upstream_url: str = "",
                      upstream_settings: Mapping[str, Any] | None = None,
                      facts_settings: Mapping[str, Any] | None = None,
                      **server: Any) -> Proxy:
    """A proxy in front of ``upstream`` (at ``upstream_url`` when given), ``server``
    settings, ``upstream_settings`` (``upstream.*``: headers, credentials) and
    ``facts_settings`` (``facts.*``: the fact writer is off unless they turn it on) set."""
    snap = tmp_path / "snapshot.yaml"
    snap.write_text(SNAPSHOT)
    s = Settings()
    s.snapshot = str(snap)
    s.upstream.url = upstream_url or upstream.url
    s.upstream.timeout_seconds = 5.0
    for k, v in (upstream_settings or {}).items():
        setattr(s.upstream, k, v)
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    for k, v in (facts_settings or {}).items():
        setattr(s.facts, k, v)
    for k, v in server.items():
        setattr(s.server, k, v)
    p = Proxy(s)
    await p.start()
    return p


@contextlib.asynccontextmanager
async def proxy_running(tmp_path: Path, upstream: ScriptedUpstream, *,
                        upstream_url: str = "",
                        upstream_settings: Mapping[str, Any] | None = None,
                        facts_settings: Mapping[str, Any] | None = None,
                        **server: Any) -> AsyncIterator[Proxy]:
    """``start_proxy`` for one ``async with``: the proxy stops however the test ends."""
    p = await start_proxy(tmp_path, upstream, upstream_url=upstream_url,
                          upstream_settings=upstream_settings, facts_settings=facts_settings,
                          **server)
    try:
        yield p
    finally:
        await p.stop()


def metric(p: Proxy, name: str, **labels: str) -> float:
    return p.metrics.registry.get_sample_value(name, labels) or 0.0
