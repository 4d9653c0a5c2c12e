"""The simulator's RBAC (``KubeSim.enforce_rbac``) decides as kube-apiserver's does.

The request attributes follow ``RequestInfoFactory`` (verbs from method and query, the
Namespace path, field-selected names), the rules ``RuleAllows`` (wildcards,
``*/subresource``, resourceNames, non-resource URLs), the bindings ``VisitRulesFor``
(a RoleBinding holds in its namespace only), and a refusal is the Forbidden Status a real
server writes, byte for byte the fields a client reads.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from tests.kubesim import KubeSim
from tests.kubesim.rbac import Attributes, Authorizer, Rule, request_attributes

SA = {"kind": "ServiceAccount", "name": "karta-proxy", "namespace": "karta-proxy"}
USER = "system:serviceaccount:karta-proxy:karta-proxy"


def role(kind: str, name: str, *rules: dict[str, Any], ns: str = "") -> dict[str, Any]:
    md = {"name": name, **({"namespace": ns} if ns else {})}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": md,
            "rules": list(rules)}


def binding(kind: str, role_kind: str, name: str, *subjects: dict[str, Any],
            ns: str = "") -> dict[str, Any]:
    md = {"name": name, **({"namespace": ns} if ns else {})}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": md,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                        "name": name},
            "subjects": list(subjects or [SA])}


def read(group: str, *resources: str, verbs: tuple[str, ...] = ("get", "list", "watch"),
         names: tuple[str, ...] = ()) -> dict[str, Any]:
    rule: dict[str, Any] = {"apiGroups": [group], "resources": list(resources),
                            "verbs": list(verbs)}
    if names:
        rule["resourceNames"] = list(names)
    return rule


@pytest.mark.parametrize(("method", "path", "query", "want"), [
    ("GET", "/api/v1/pods", {}, ("list", "", "pods", "", "", "")),
    ("GET", "/api/v1/pods", {"watch": "1"}, ("watch", "", "pods", "", "", "")),
    ("GET", "/api/v1/pods", {"watch": "false"}, ("list", "", "pods", "", "", "")),
    ("GET", "/api/v1/namespaces/a/pods", {"watch": "true", "fieldSelector": "spec.nodeName=n1"},
     ("watch", "", "pods", "", "", "a")),
    ("GET", "/apis/apps/v1/namespaces/a/replicasets/web-1", {},
     ("get", "apps", "replicasets", "", "web-1", "a")),
    ("GET", "/apis/apps/v1/namespaces/a/replicasets",
     {"fieldSelector": "metadata.name=web-1"}, ("list", "apps", "replicasets", "", "web-1", "a")),
    ("GET", "/api/v1/namespaces/kube-system", {},
     ("get", "", "namespaces", "", "kube-system", "kube-system")),
    ("GET", "/api/v1/namespaces", {}, ("list", "", "namespaces", "", "", "")),
    ("POST", "/apis/coordination.k8s.io/v1/namespaces/karta-proxy/leases", {},
     ("create", "coordination.k8s.io", "leases", "", "", "karta-proxy")),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/karta-proxy/leases/l", {},
     ("update", "coordination.k8s.io", "leases", "", "l", "karta-proxy")),
    ("PATCH", "/api/v1/namespaces/a/pods/p/status", {}, ("patch", "", "pods", "status", "p", "a")),
    ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "pods", "", "", "a")),
    ("GET", "/apis/run.ai/v1alpha1/kartas", {}, ("list", "run.ai", "kartas", "", "", "")),
])
def test_request_attributes(method: str, path: str, query: dict[str, str],
                            want: tuple[str, ...]) -> None:
    a = request_attributes(method, path, query)
    assert a.resource_request
    assert (a.verb, a.api_group, a.resource, a.subresource, a.name, a.namespace) == want


@pytest.mark.parametrize("path", ["/api", "/api/v1", "/apis", "/apis/apps",
                                  "/apis/apps/v1", "/version", "/healthz"])
def test_discovery_is_a_non_resource_request_every_account_may_make(path: str) -> None:
    a = request_attributes("GET", path, {})
    assert not a.resource_request and a.verb == "get"
    assert Authorizer([]).allows(a)
    assert not Authorizer([], defaults=False).allows(a)


def test_rules_match_as_the_api_servers() -> None:
    get_rs = request_attributes("GET", "/apis/apps/v1/namespaces/a/replicasets/r", {})
    status = request_attributes("GET", "/apis/apps/v1/namespaces/a/deployments/d/status", {})
    assert Rule.of(read("apps", "*")).allows(get_rs)
    assert Rule.of(read("*", "replicasets")).allows(get_rs)
    assert Rule.of(read("apps", "replicasets", verbs=("*",))).allows(get_rs)
    assert not Rule.of(read("apps", "replicasets", verbs=("list", "watch"))).allows(get_rs)
    assert not Rule.of(read("", "replicasets")).allows(get_rs)  # the core group is ""
    assert not Rule.of(read("apps", "deployments")).allows(status)  # a subresource apart
    assert Rule.of(read("apps", "deployments/status")).allows(status)
    assert Rule.of(read("apps", "*/status")).allows(status)
    assert Rule.of(read("apps", "*")).allows(status)
    named = Rule.of(read("coordination.k8s.io", "leases", verbs=("get", "update", "create"),
                         names=("l",)))
    lease = "/apis/coordination.k8s.io/v1/namespaces/p/leases"
    assert named.allows(request_attributes("PUT", f"{lease}/l", {}))
    assert not named.allows(request_attributes("PUT", f"{lease}/other", {}))
    # a create names nothing the authorizer sees: a rule with names never allows it
    assert not named.allows(request_attributes("POST", lease, {}))
    assert not named.allows(request_attributes("GET", lease, {}))  # nor a list


def test_a_role_holds_in_its_namespace_only() -> None:
    auth = Authorizer([
        role("Role", "reader", read("", "pods"), ns="team-a"),
        binding("RoleBinding", "Role", "reader", ns="team-a"),
        role("ClusterRole", "lister", read("apps", "replicasets")),
        binding("RoleBinding", "ClusterRole", "lister", ns="team-b"),
        role("ClusterRole", "others", read("batch", "jobs")),
        binding("ClusterRoleBinding", "ClusterRole", "others",
                {"kind": "ServiceAccount", "name": "someone", "namespace": "karta-proxy"}),
        role("ClusterRole", "everyone", read("run.ai", "kartas")),
        binding("ClusterRoleBinding", "ClusterRole", "everyone",
                {"kind": "Group", "name": "system:serviceaccounts"}),
    ])
    ok = auth.allows

    def req(path: str, **q: str) -> Attributes:
        return request_attributes("GET", path, q)

    assert ok(req("/api/v1/namespaces/team-a/pods", watch="1"))
    assert not ok(req("/api/v1/namespaces/team-b/pods"))
    assert not ok(req("/api/v1/pods"))  # cluster-wide: no Role reaches there
    assert ok(req("/apis/apps/v1/namespaces/team-b/replicasets/r"))
    assert not ok(req("/apis/apps/v1/replicasets"))  # a ClusterRole bound in one namespace
    assert not ok(req("/apis/batch/v1/jobs"))  # bound to another account
    assert ok(req("/apis/run.ai/v1alpha1/kartas"))  # through a group of the account's


async def test_a_refusal_is_the_api_servers_forbidden_status(sim: KubeSim,
                                                             api: k8s.ApiClient) -> None:
    sim.enforce_rbac([role("Role", "reader", read("", "pods"), ns="team-a"),
                      binding("RoleBinding", "Role", "reader", ns="team-a")])
    core = k8s.CoreV1Api(api)
    await core.list_namespaced_pod("team-a")
    assert "pods" in {r.name for r in (await core.get_api_resources()).resources}
    with pytest.raises(ApiException) as cluster_wide:
        await core.list_pod_for_all_namespaces(watch=False)
    with pytest.raises(ApiException) as named:
        await core.read_namespace("kube-system")
    assert cluster_wide.value.status == named.value.status == 403
    assert json.loads(cluster_wide.value.body or b"") == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'pods is forbidden: User "{USER}" cannot list resource "pods" in API '
                   'group "" at the cluster scope',
        "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403}
    assert json.loads(named.value.body or b"")["message"] == (
        f'namespaces "kube-system" is forbidden: User "{USER}" cannot get resource '
        '"namespaces" in API group "" in the namespace "kube-system"')
    assert json.loads(named.value.body or b"")["details"] == {"name": "kube-system",
                                                       "kind": "namespaces"}
    assert [str(a) for a in sim.refused] == [
        "list pods (cluster)", "get namespaces 'kube-system' (namespace kube-system)"]
    sim.enforce_rbac(None)
    await core.list_pod_for_all_namespaces()
    assert len(sim.refused) == 2
