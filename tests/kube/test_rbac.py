"""The shipped RBAC grants what the source reads, read-only, and nothing it does not read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from proxy.kube.client import KubeClient
from proxy.kube.cluster_identity import ClusterIdentity
from tests.kube.conftest import SourceFactory, deployment, eventually, owner, pod
from tests.kubesim import KubeSim
from tests.kubesim.resources import REPLICA_SET

RBAC = Path(__file__).resolve().parents[2] / "config" / "rbac"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((RBAC / name).read_text()) if d]


def _reads(sim: KubeSim) -> set[tuple[str, str]]:
    """(group, plural) of every list/watch the source sent."""
    out = set()
    for method, path, _, _ in sim.requests:
        parts = path.split("/")[1:]
        if method != "GET" or len(parts) < 3:
            continue
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        group = "" if parts[0] == "api" else parts[1]
        if rest and rest[0] == "namespaces" and len(rest) >= 3:
            rest = rest[2:]
        if rest:
            out.add((group, rest[0]))
    return out


def _granted(role: dict[str, Any], verbs: set[str]) -> set[tuple[str, str]]:
    return {(g, r) for rule in role["rules"] if verbs <= set(rule["verbs"])
            for g in rule["apiGroups"] for r in rule["resources"]}


async def test_cluster_role_covers_exactly_the_reads(sim: KubeSim,
                                                     make_source: SourceFactory) -> None:
    deployment(sim, "web", replicas=1)
    await make_source()
    reader = next(d for d in _docs("cluster-mode.yaml")
                  if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "karta-proxy-reader")
    granted = _granted(reader, {"get", "list", "watch"})
    assert _reads(sim) == granted
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in reader["rules"])


async def test_node_mode_reads_what_its_kustomization_grants(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """Node mode (config/kubernetes/node/) ships the cluster-mode ClusterRole: its pods
    watch is filtered by node, but RBAC has no field selectors, and the owners are
    watched cluster-wide and fetched by name (get) when the watch has not delivered them:
    the same reads, every one granted."""
    kustomization = yaml.safe_load((RBAC.parent / "kubernetes" / "node" /
                                    "kustomization.yaml").read_text())
    assert "../../rbac/cluster-mode.yaml" in kustomization["resources"]
    dep, _, _ = deployment(sim, "web", replicas=1, node="n1")
    await make_source(node_name="n1")
    sim.hold_watches(REPLICA_SET)  # a ReplicaSet the watch has not delivered: fetched
    rs2 = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                      "metadata": {"name": "web-2", "namespace": "default",
                                   "ownerReferences": owner(dep)}})
    sim.create(pod("web-2-0", owner_obj=rs2, node="n1"))
    await eventually(lambda: any(p.endswith("/replicasets/web-2") for _, p, _, _ in sim.requests))
    reader = next(d for d in _docs("cluster-mode.yaml") if d["kind"] == "ClusterRole")
    assert _reads(sim) == _granted(reader, {"get", "list", "watch"})
    sim.flush_watches()


async def test_namespaced_role_covers_the_namespaced_reads(
        sim: KubeSim, make_source: SourceFactory) -> None:
    deployment(sim, "web", ns="team-a", replicas=1)
    await make_source(namespaces=["team-a"])
    docs = _docs("namespaced-mode.yaml")
    role = next(d for d in docs if d["kind"] == "Role")
    cluster = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["metadata"]["namespace"] == "team-a"
    granted = _granted(role, {"get", "list", "watch"}) | _granted(cluster,
                                                                  {"get", "list", "watch"})
    assert _reads(sim) == granted
    namespaced_paths = {p for m, p, _, _ in sim.requests
                        if m == "GET" and ("/pods" in p or "/replicasets" in p)}
    assert all("/namespaces/team-a/" in p for p in namespaced_paths)


def test_lease_role_sits_beside_the_service_account() -> None:
    """The Lease is written in the proxy's own namespace (facts.lease_namespace empty ->
    default_namespace(): the service account's): the Role granting it must be there."""
    from proxy.config import FactSettings

    account = next(d for d in _docs("serviceaccount.yaml") if d["kind"] == "ServiceAccount")
    home = account["metadata"]["namespace"]
    assert FactSettings().lease_namespace == ""  # empty = the proxy's own namespace
    lease_roles = [(name, d) for name in ("cluster-mode.yaml", "namespaced-mode.yaml",
                                          "fact-lease.yaml")
                   for d in _docs(name) if d["kind"] == "Role"
                   and any("leases" in r["resources"] for r in d["rules"])]
    assert [name for name, _ in lease_roles] == ["fact-lease.yaml"]  # one place, both modes
    docs = _docs("fact-lease.yaml")
    role = lease_roles[0][1]
    assert role["metadata"]["namespace"] == home
    names = {n for r in role["rules"] for n in r.get("resourceNames", ())}
    assert names == {FactSettings().lease_name}
    binding = next(d for d in docs if d["kind"] == "RoleBinding"
                   and d["roleRef"]["name"] == role["metadata"]["name"])
    assert binding["metadata"]["namespace"] == home
    assert {(s["name"], s["namespace"]) for s in binding["subjects"]} == {
        (account["metadata"]["name"], home)}


async def test_the_identity_role_grants_the_one_get_the_identity_sends(
        sim: KubeSim, client: KubeClient) -> None:
    """The fact writer's read of the cluster's identity: one get of the kube-system
    Namespace by name, which config/rbac/cluster-identity.yaml grants and nothing more
    (no list: the names and labels of every namespace are none of its business)."""
    sim.requests.clear()
    assert await ClusterIdentity(client).read()
    sent = {(m, p) for m, p, _, _ in sim.requests}
    role = next(d for d in _docs("cluster-identity.yaml") if d["kind"] == "ClusterRole")
    (rule,) = role["rules"]
    assert rule == {"apiGroups": [""], "resources": ["namespaces"],
                    "resourceNames": ["kube-system"], "verbs": ["get"]}
    assert sent == {("GET", f"/api/v1/{rule['resources'][0]}/{rule['resourceNames'][0]}")}
    binding = next(d for d in _docs("cluster-identity.yaml")
                   if d["kind"] == "ClusterRoleBinding")
    account = next(d for d in _docs("serviceaccount.yaml") if d["kind"] == "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
