"""Node mode end to end: two ``python -m proxy --node-name`` processes (nodes ``n1`` and
``n2``) watching the Kubernetes API simulator, writing into a real Prometheus 2.42.

What a node's replica stamps, read back from the TSDB: a pod created unscheduled and
then bound to its node (first sample after the binding), a pod bound to the other node
(never in this replica's index), a sample of the other node's pod sent here (a misrouted
sender: unstamped, counted ``pod_unknown``), a StatefulSet pod deleted and made again on
the other node (the old node's late sample keeps the tombstone's stamp), and an owner
the ReplicaSet watch has not delivered (one GET, by the one replica whose pod needs it).

Binding: kube-apiserver sets ``spec.nodeName`` through the ``pods/binding`` subresource
only (an update may not change it); the simulator's ``update`` stands in for it, and what
the node's filtered watch sees of either is the same: the pod enters its field selector,
an ``ADDED`` (``tests/kubesim/test_simulator.py`` holds the simulator to that).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sender import Series, send_series
from tests.kube.conftest import deployment
from tests.kube.conftest import owner as owner_refs
from tests.kube.conftest import pod as pod_object
from tests.kubesim import KubeSim
from tests.kubesim.resources import REPLICA_SET
from tests.peers.conftest import Peer, Peers, free_port, query, wait_until
from tests.peers.conftest import peers as peers  # the shared fixture, reused

pytestmark = pytest.mark.peers

NS = "shop"
CLUSTER = "c1"
Obj = dict[str, Any]


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(bookmark_interval=0.5, max_watch_seconds=30.0) as s:
        yield s


async def node_proxy(peers: Peers, sim: KubeSim, tmp: Path, node: str, tsdb: Peer) -> Peer:
    cfg = tmp / f"{node}.yaml"
    cfg.write_text(json.dumps({"facts": {"external_labels": {"cluster": CLUSTER}}}))
    return await peers.karta_proxy(f"proxy-{node}", free_port(), [
        "--config", str(cfg), "--kubeconfig", str(sim.write_kubeconfig()),
        "--node-name", node, "--upstream-url", tsdb.base_url + "/api/v1/write"])


async def send(proxy: Peer, metric: str, pod: str) -> None:
    series = Series({"__name__": metric, "namespace": NS, "pod": pod, "cluster": CLUSTER},
                    [(int(time.time() * 1000), 1.0)])
    status, _, _ = await send_series(proxy.base_url + "/api/v1/write", [series], timeout=10)
    assert status == 204


async def attribution(proxy: Peer, pod: str) -> tuple[int, Obj]:
    async with aiohttp.ClientSession() as s, s.get(
            proxy.base_url + "/api/v1/attribution", params={"namespace": NS, "pod": pod},
            timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.json()


async def stored(tsdb: Peer, metric: str) -> dict[str, str]:
    """The ``karta_*`` labels ``metric``'s one series was stored with."""
    (row,) = await query(tsdb.base_url, metric)
    return {k: v for k, v in row["metric"].items() if k.startswith("karta_")}


async def counter(proxy: Peer, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(proxy.base_url + "/metrics") as r:
        text = await r.text()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"{name}{{{want}}}"))


async def test_two_node_replicas_stamp_their_own_nodes_pods(
        peers: Peers, sim: KubeSim, tmp_path: Path) -> None:
    dep, rs, _ = deployment(sim, "web", NS, replicas=1, node="n1")
    sts = sim.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                      "metadata": {"name": "db", "namespace": NS},
                      "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "db"}}}})
    sim.create(pod_object("db-0", NS, owner_obj=sts, node="n1", labels={"app": "db"}))
    tsdb = await peers.prometheus_receiver()
    n1 = await node_proxy(peers, sim, tmp_path, "n1", tsdb)
    n2 = await node_proxy(peers, sim, tmp_path, "n2", tsdb)
    web = {"karta_kind": "Deployment", "karta_workload": "web"}

    # unscheduled: neither replica knows it; bound to n1: n1 does, from its binding on
    # (before any container of it runs, so its first sample finds it)
    pending = sim.create(pod_object("web-1-x", NS, owner_obj=rs, node="",
                                    labels={"app": "web"}))
    other = sim.create(pod_object("web-1-y", NS, owner_obj=rs, node="",
                                  labels={"app": "web"}))
    assert (await attribution(n1, "web-1-x"))[0] == 404
    pending["spec"]["nodeName"] = "n1"
    sim.update(pending)
    other["spec"]["nodeName"] = "n2"
    sim.update(other)

    async def bound() -> bool:
        return (await attribution(n1, "web-1-x"))[0] == 200 \
            and (await attribution(n2, "web-1-y"))[0] == 200

    await wait_until(bound, timeout=10, what="the bound pods in their nodes' replicas",
                     interval=0.01)
    status, body = await attribution(n1, "web-1-y")
    assert status == 404 and body["error"] == f"no pod {NS}/web-1-y in the index", body
    await send(n1, "node_first_sample", "web-1-x")
    assert (await stored(tsdb, "node_first_sample")).items() >= web.items()

    # a sender writing the other node's pod here (misrouted): stored unstamped, told only
    # by the pod_unknown count (the same reason as any pod this replica does not know)
    unknown = await counter(n1, "karta_proxy_series_unattributed_total", reason="pod_unknown")
    await send(n1, "node_misrouted", "web-1-y")
    assert await stored(tsdb, "node_misrouted") == {}
    assert await counter(n1, "karta_proxy_series_unattributed_total",
                         reason="pod_unknown") == unknown + 1

    # a StatefulSet pod made again on n2 under its name: n1 keeps the tombstone, so the
    # old pod's late sample is stamped (its workload); n2 stamps the new pod
    sim.delete(sim.get("v1", "Pod", "db-0", NS))
    sim.create(pod_object("db-0", NS, owner_obj=sts, node="n2", labels={"app": "db"}))

    async def moved() -> bool:
        gone, body = await attribution(n1, "db-0")
        return gone == 404 and "tombstone" in body and (await attribution(n2, "db-0"))[0] == 200

    await wait_until(moved, timeout=10, what="db-0 gone from n1, known to n2", interval=0.01)
    await send(n1, "node_late_sample", "db-0")
    await send(n2, "node_moved_sample", "db-0")
    db = {"karta_kind": "StatefulSet", "karta_workload": "db"}
    assert (await stored(tsdb, "node_late_sample")).items() >= db.items()
    assert (await stored(tsdb, "node_moved_sample")).items() >= db.items()

    # an owner the ReplicaSet watch has not delivered: the replica whose pod needs it
    # fetches it, once; the pod is stamped with its Deployment, never the ReplicaSet
    sim.hold_watches(REPLICA_SET)
    rs2 = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                      "metadata": {"name": "web-2", "namespace": NS,
                                   "ownerReferences": owner_refs(dep), "labels": {"app": "web"}},
                      "spec": {"replicas": 1}})
    sim.create(pod_object("web-2-0", NS, owner_obj=rs2, node="n1", labels={"app": "web"}))

    async def placed() -> bool:
        return (await attribution(n1, "web-2-0"))[0] == 200

    await wait_until(placed, timeout=10, what="web-2-0 placed", interval=0.01)
    assert (await attribution(n1, "web-2-0"))[1]["data"]["workload"]["kind"] == "Deployment"
    gets = [path for method, path, _, _ in sim.requests
            if method == "GET" and path == f"/apis/apps/v1/namespaces/{NS}/replicasets/web-2"]
    assert len(gets) == 1, gets
    sim.flush_watches()
