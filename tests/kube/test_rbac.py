"""The shipped RBAC grants what the proxy asks the API server, and nothing it does not ask.

The end-to-end test runs the whole proxy (source, owner GETs, cluster identity, the fact
writer's Lease election) against the simulator enforcing exactly the shipped roles, as
kube-apiserver's RBAC authorizer does (tests/kubesim/rbac.py): no request refused, every
pod attributed, and every verb the roles grant used.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import contract
from proxy.config import Settings
from proxy.kube.client import KubeClient
from proxy.kube.cluster_identity import ClusterIdentity
from proxy.runtime import Proxy
from tests.karta.descriptions import JOBSET_KARTA, RAYJOB_KARTA
from tests.kube.conftest import SourceFactory, deployment, eventually, owner, pod
from tests.kube.test_source import rayjob
from tests.kubesim import KubeSim
from tests.kubesim.rbac import Attributes, request_attributes
from tests.kubesim.resources import (
    CRON_JOB,
    DAEMON_SET,
    DEPLOYMENT,
    JOB,
    JOB_SET,
    KARTA,
    LEADER_WORKER_SET,
    POD,
    RAY_CLUSTER,
    RAY_JOB,
    REPLICA_SET,
    RESOURCE_INTERFACE,
    STATEFUL_SET,
)
from tests.scripted import ScriptedUpstream
from tests.test_e2e_kube import kube_settings, start_proxy

RBAC = Path(__file__).resolve().parents[2] / "config" / "rbac"
KUBE = RBAC.parent / "kubernetes"

Obj = dict[str, Any]

#: the kinds on the test's owner chains whose watches it holds back, so that the owners
#: are fetched by GET
OWNER_TYPES = (DEPLOYMENT, REPLICA_SET, STATEFUL_SET, DAEMON_SET, JOB, CRON_JOB, RAY_CLUSTER)


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((RBAC / name).read_text()) if d]


def kustomized_rbac(mode: str) -> list[Obj]:
    """The RBAC objects a mode's kustomization applies (config/kubernetes/MODE/)."""
    k = yaml.safe_load((KUBE / mode / "kustomization.yaml").read_text())
    return [d for r in k["resources"] if r.startswith("../../rbac/")
            for d in _docs(Path(r).name)]


def grants(objects: list[Obj]) -> set[tuple[str, str, str]]:
    """(verb, group, resource) of every resource rule among ``objects``' roles."""
    return {(v, g, r) for d in objects if d["kind"] in ("Role", "ClusterRole")
            for rule in d["rules"] for v in rule["verbs"] for g in rule["apiGroups"]
            for r in rule["resources"]}


def asked(sim: KubeSim) -> list[Attributes]:
    """What the authorizer saw of every resource request the simulator got."""
    return [a for m, p, q, _ in sim.requests
            if (a := request_attributes(m, p, q)).resource_request]


def reads(sim: KubeSim) -> set[tuple[str, str]]:
    """(group, resource) of every resource request the simulator got."""
    return {(a.api_group, a.resource) for a in asked(sim)}


def read_grants(objects: list[Obj]) -> set[tuple[str, str]]:
    """(group, resource) of every rule granting list and watch among ``objects``."""
    return {(g, r) for v, g, r in grants(objects) if v == "list"} & {
        (g, r) for v, g, r in grants(objects) if v == "watch"}


async def test_cluster_role_covers_exactly_the_reads(sim: KubeSim,
                                                     make_source: SourceFactory) -> None:
    rules = _docs("serviceaccount.yaml") + _docs("cluster-mode.yaml")
    sim.enforce_rbac(rules)
    deployment(sim, "web", replicas=1)
    source = await make_source()
    assert source.index.ready and not source.unserved_kinds
    assert sim.refused == []
    assert reads(sim) == read_grants(rules)
    reader = next(d for d in rules if d["kind"] == "ClusterRole")
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in reader["rules"])


async def test_node_mode_reads_what_its_kustomization_grants(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """Node mode (config/kubernetes/node/) ships the cluster-mode ClusterRole: its pods
    watch is filtered by node, but RBAC has no field selectors, and the owners are
    watched cluster-wide and fetched by name (get) when the watch has not delivered them,
    a pod too (a LeaderWorkerSet's leader pod, on another node, owns the StatefulSet of
    its workers on this one): the same reads, every one granted."""
    rules = kustomized_rbac("node")
    sim.enforce_rbac(rules)
    dep, _, _ = deployment(sim, "web", replicas=1, node="n1")
    await make_source(node_name="n1")
    leader = sim.create(pod("lead-0", owner_obj=dep, node="n2"))
    workers = sim.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                          "metadata": {"name": "lead-0", "namespace": "default",
                                       "ownerReferences": owner(leader)}})
    sim.create(pod("lead-0-1", owner_obj=workers, node="n1"))
    sim.hold_watches(REPLICA_SET)  # a ReplicaSet the watch has not delivered: fetched
    rs2 = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                      "metadata": {"name": "web-2", "namespace": "default",
                                   "ownerReferences": owner(dep)}})
    sim.create(pod("web-2-0", owner_obj=rs2, node="n1"))
    fetched = {"get replicasets.apps 'web-2' (namespace default)",
               "get pods 'lead-0' (namespace default)"}
    await eventually(lambda: fetched <= {str(a) for a in asked(sim) if a.verb == "get"})
    assert sim.refused == []
    assert reads(sim) == read_grants(rules)
    sim.flush_watches()


async def test_namespaced_role_covers_the_namespaced_reads(
        sim: KubeSim, make_source: SourceFactory) -> None:
    rules = _docs("serviceaccount.yaml") + _docs("namespaced-mode.yaml")
    role = next(d for d in rules if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "team-a"
    sim.enforce_rbac(rules)
    deployment(sim, "web", ns="team-a", replicas=1)
    deployment(sim, "other", ns="team-b", replicas=1)
    source = await make_source(namespaces=["team-a"])
    assert source.index.ready and not source.unserved_kinds
    assert sim.refused == []
    assert reads(sim) == read_grants(rules)
    # cluster-wide: the cluster-scoped descriptions alone
    assert {(a.verb, a.resource) for a in asked(sim) if not a.namespace} == {
        ("list", "kartas"), ("watch", "kartas"), ("list", "resourceinterfaces"),
        ("watch", "resourceinterfaces")}


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


# -- the whole proxy under the shipped roles ---------------------------------------------


def controlled(sim: KubeSim, api_version: str, kind: str, name: str, ns: str, *,
               owner_obj: Obj | None = None, pods: int = 0, node: str = "n1",
               **fields: Any) -> Obj:
    """An object of ``kind`` (owned by ``owner_obj``, if given) and ``pods`` pods of its own,
    ``NAME-0``, ``NAME-1``, ..."""
    md: Obj = {"name": name, "namespace": ns}
    if owner_obj is not None:
        md["ownerReferences"] = owner(owner_obj)
    obj = sim.create({"apiVersion": api_version, "kind": kind, "metadata": md, **fields})
    for i in range(pods):
        sim.create(pod(f"{name}-{i}", ns, owner_obj=obj, node=node))
    return obj


def fetched_owners(sim: KubeSim, ns: str) -> dict[tuple[str, str], tuple[str, str]]:
    """With the watches of ``OWNER_TYPES`` held back, a new Deployment (its ReplicaSet),
    StatefulSet, DaemonSet and CronJob (its Job), a pod each, in ``ns``: each owner is
    fetched by one GET (get on its kind), an owner fetched so having its own owner
    fetched in turn. Returns the pods' (namespace, pod) -> (kind, workload) wanted."""
    for rtype in OWNER_TYPES:
        sim.hold_watches(rtype)
    api = controlled(sim, "apps/v1", "Deployment", "api", ns)
    controlled(sim, "apps/v1", "ReplicaSet", "api-1", ns, owner_obj=api, pods=1)
    controlled(sim, "apps/v1", "StatefulSet", "cache", ns, pods=1)
    controlled(sim, "apps/v1", "DaemonSet", "agent2", ns, pods=1)
    hourly = controlled(sim, "batch/v1", "CronJob", "hourly", ns)
    controlled(sim, "batch/v1", "Job", "hourly-1", ns, owner_obj=hourly, pods=1)
    return {(ns, "api-1-0"): ("Deployment", "api"), (ns, "cache-0"): ("StatefulSet", "cache"),
            (ns, "agent2-0"): ("DaemonSet", "agent2"), (ns, "hourly-1-0"): ("CronJob", "hourly")}


async def fetched_leader_pod(sim: KubeSim, leaders: Obj) -> None:
    """A LeaderWorkerSet's next group: its leader pod (of the StatefulSet ``leaders``),
    held back by the pods watch, owns its workers' StatefulSet, which comes first: the
    pod is fetched by GET (get on pods)."""
    sim.hold_watches(POD)
    md = leaders["metadata"]
    leader = sim.create(pod(f"{md['name']}-1", md["namespace"], owner_obj=leaders))
    controlled(sim, "apps/v1", "StatefulSet", leader["metadata"]["name"], md["namespace"],
               owner_obj=leader)
    await eventually(lambda: any(a.verb == "get" and a.resource == "pods"
                                 for a in asked(sim)))
    sim.flush_watches()


def attributed(proxy: Proxy, want: dict[tuple[str, str], tuple[str, str]]) -> dict[
        tuple[str, str], tuple[str, str] | None]:
    """(namespace, pod) -> (karta_kind, karta_workload) as stamped, for the pods wanted."""
    out: dict[tuple[str, str], tuple[str, str] | None] = {}
    for ns, name in want:
        pairs = proxy.index.lookup(ns.encode(), name.encode())
        got = dict(pairs) if pairs is not None else {}
        out[(ns, name)] = ((got["karta_kind"], got["karta_workload"])
                           if "karta_workload" in got else None)
    return out


@pytest.fixture
async def cluster(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeSim]:
    """A simulator serving the described kinds' CRDs, for a test to enforce roles on. The
    proxy's own namespace is the ServiceAccount's (the downward API's POD_NAMESPACE),
    where fact-lease.yaml grants the Lease."""
    monkeypatch.setenv("POD_NAMESPACE", "karta-proxy")
    sim = KubeSim(bookmark_interval=0.2, max_watch_seconds=5.0)
    sim.register(RAY_JOB, RAY_CLUSTER, JOB_SET, LEADER_WORKER_SET, KARTA, RESOURCE_INTERFACE)
    await sim.start()
    yield sim
    await sim.close()


async def run_electing(sim: KubeSim, proxy_settings: Callable[[Settings], None],
                       scenario: Callable[[Proxy], Awaitable[None]]) -> None:
    """The whole proxy on ``sim``, the fact writer electing itself through the Lease (a
    renewal every half second), ``scenario`` run once it leads and has read the
    cluster's identity, no kind forbidden at its end; stopped (handing the Lease back)."""
    upstream = ScriptedUpstream()
    await upstream.start()
    s = kube_settings(sim, upstream.url)
    s.facts.leader_election = True
    s.facts.lease_duration_seconds = 1.5
    proxy_settings(s)
    proxy = await start_proxy(s)
    try:
        registry = proxy.metrics.registry
        await eventually(lambda: registry.get_sample_value(
            contract.OP_FACT_WRITER_LEADER) == 1)
        await eventually(lambda: proxy.cluster_identity is not None
                         and proxy.cluster_identity.uid == sim.kube_system_uid)
        await scenario(proxy)
        await asyncio.sleep(0.6)  # a renewal of the Lease
        forbidden = [s for f in registry.collect() if f.name == contract.OP_WATCH_FORBIDDEN
                     for s in f.samples if s.value]
        assert forbidden == []
    finally:
        await proxy.stop()
        await upstream.stop()


async def test_the_proxy_runs_under_exactly_the_shipped_cluster_rbac(cluster: KubeSim) -> None:
    """Cluster mode as shipped (config/kubernetes/cluster/ and the example's rules for
    the described kinds: Ray, JobSet, LWS), the fact writer electing itself through the
    Lease and reading the cluster's identity; Deployments, StatefulSets, DaemonSets, Jobs,
    a CronJob, and described RayJob, JobSet and a LeaderWorkerSet (whose leader pod owns
    its workers' StatefulSet), with owners the watches hold back fetched by GET (of each
    owner kind, a RayCluster, a leader pod): no request refused, every pod attributed,
    and every (verb, group, resource) the shipped roles grant asked at least once (none
    granted for nothing)."""
    sim = cluster
    sim.enforce_rbac([*kustomized_rbac("cluster"), *_docs("described-kinds-example.yaml")])
    sim.create(RAYJOB_KARTA)
    sim.create(JOBSET_KARTA)
    want: dict[tuple[str, str], tuple[str, str]] = {}
    _, _, pods = deployment(sim, "web", "shop", replicas=2)
    want.update({("shop", p["metadata"]["name"]): ("Deployment", "web") for p in pods})
    controlled(sim, "apps/v1", "StatefulSet", "db", "shop", pods=2)
    controlled(sim, "apps/v1", "DaemonSet", "agent", "shop", pods=1)
    controlled(sim, "batch/v1", "Job", "once", "shop", pods=1)
    nightly = controlled(sim, "batch/v1", "CronJob", "nightly", "shop")
    controlled(sim, "batch/v1", "Job", "nightly-1", "shop", owner_obj=nightly, pods=1)
    want.update({("shop", "db-0"): ("StatefulSet", "db"), ("shop", "db-1"): ("StatefulSet", "db"),
                 ("shop", "agent-0"): ("DaemonSet", "agent"), ("shop", "once-0"): ("Job", "once"),
                 ("shop", "nightly-1-0"): ("CronJob", "nightly")})
    want.update({("ml", n): ("RayJob", "train") for n in rayjob(sim, "train", "ml")})
    pretrain = controlled(sim, "jobset.x-k8s.io/v1alpha2", "JobSet", "pretrain", "ml",
                          spec={"template": {}})
    controlled(sim, "batch/v1", "Job", "pretrain-w-0", "ml", owner_obj=pretrain, pods=2)
    want.update({("ml", f"pretrain-w-0-{i}"): ("JobSet", "pretrain") for i in range(2)})
    lws = controlled(sim, "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "serve", "ml")
    leaders = controlled(sim, "apps/v1", "StatefulSet", "serve", "ml", owner_obj=lws, pods=1)
    controlled(sim, "apps/v1", "StatefulSet", "serve-0", "ml",
               owner_obj=sim.get("v1", "Pod", "serve-0", "ml"), pods=2)
    want.update({("ml", n): ("StatefulSet", "serve")
                 for n in ("serve-0", "serve-0-0", "serve-0-1")})

    async def scenario(proxy: Proxy) -> None:
        assert attributed(proxy, want) == want
        want.update(fetched_owners(sim, "shop"))
        controlled(sim, "ray.io/v1", "RayCluster", "train-rc2", "ml",
                   owner_obj=sim.get("ray.io/v1", "RayJob", "train", "ml"), pods=1)
        want[("ml", "train-rc2-0")] = ("RayJob", "train")
        await eventually(lambda: attributed(proxy, want) == want)
        sim.flush_watches()
        await fetched_leader_pod(sim, leaders)

    await run_electing(sim, lambda s: None, scenario)
    assert [str(a) for a in sim.refused] == []
    used = {(a.verb, a.api_group, a.resource) for a in asked(sim)}
    shipped = grants(kustomized_rbac("cluster"))
    assert shipped - used == set(), "granted, never asked"
    # and the described kinds were read under the example's rules
    assert {(g, r) for _, g, r in used} - {(g, r) for _, g, r in shipped} == {
        ("ray.io", "rayjobs"), ("ray.io", "rayclusters"), ("jobset.x-k8s.io", "jobsets"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets")}


def per_namespace(objects: list[Obj], namespaces: list[str]) -> list[Obj]:
    """namespaced-mode.yaml as its header says to apply it: its Role and RoleBinding
    copied into each watched namespace."""
    out: list[Obj] = []
    for d in objects:
        if d["kind"] in ("Role", "RoleBinding"):
            out += [{**d, "metadata": {**d["metadata"], "namespace": ns}} for ns in namespaces]
        else:
            out.append(d)
    return out


async def test_the_namespaced_mode_reads_nothing_cluster_wide_but_the_descriptions(
        cluster: KubeSim) -> None:
    """Namespaced mode (``kube.namespaces``) under namespaced-mode.yaml applied to two
    namespaces, the fact writer's fact-lease.yaml and cluster-identity.yaml: no request
    refused, every pod of the two namespaces attributed (owners fetched by GET too),
    none of a third; at the cluster scope only the cluster-scoped descriptions are
    listed and watched, and beyond the watched namespaces only the Lease (the proxy's
    own) and the one kube-system Namespace are touched; every verb granted is asked."""
    sim = cluster
    watched = ["team-a", "team-b"]
    rules = [*_docs("serviceaccount.yaml"), *per_namespace(_docs("namespaced-mode.yaml"),
                                                           watched),
             *_docs("fact-lease.yaml"), *_docs("cluster-identity.yaml")]
    sim.enforce_rbac(rules)
    want: dict[tuple[str, str], tuple[str, str]] = {}
    for ns in watched:
        _, _, pods = deployment(sim, "web", ns, replicas=1)
        want[(ns, pods[0]["metadata"]["name"])] = ("Deployment", "web")
    controlled(sim, "apps/v1", "StatefulSet", "cache", "team-b", pods=1)
    want[("team-b", "cache-0")] = ("StatefulSet", "cache")
    deployment(sim, "web", "team-c", replicas=1)

    async def scenario(proxy: Proxy) -> None:
        want.update(fetched_owners(sim, "team-a"))
        await eventually(lambda: attributed(proxy, want) == want)
        sim.flush_watches()
        await fetched_leader_pod(sim, sim.get("apps/v1", "StatefulSet", "cache", "team-b"))
        assert proxy.index.lookup(b"team-c", b"web-1-0") is None

    def namespaced(s: Settings) -> None:
        s.kube.namespaces = watched

    await run_electing(sim, namespaced, scenario)
    assert [str(a) for a in sim.refused] == []
    cluster_wide = {(a.verb, a.resource) for a in asked(sim) if not a.namespace}
    assert cluster_wide == {("list", "kartas"), ("watch", "kartas"),
                            ("list", "resourceinterfaces"), ("watch", "resourceinterfaces")}
    elsewhere = {str(a) for a in asked(sim) if a.namespace not in ("", *watched)}
    assert elsewhere == {
        "get namespaces 'kube-system' (namespace kube-system)",
        "create leases.coordination.k8s.io (namespace karta-proxy)",
        "get leases.coordination.k8s.io 'karta-proxy-facts' (namespace karta-proxy)",
        "update leases.coordination.k8s.io 'karta-proxy-facts' (namespace karta-proxy)"}
    assert grants(rules) - {(a.verb, a.api_group, a.resource) for a in asked(sim)} == set()
