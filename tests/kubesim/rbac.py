"""RBAC as kube-apiserver applies it, for a simulator that enforces a set of roles.

A test that loads the project's shipped manifests (``config/rbac/``) into ``KubeSim``
(``enforce_rbac``) runs the proxy under exactly what an operator applies: every request
is authorized the way the API server's RBAC authorizer does it, and refused with the
Forbidden Status a real server writes. The proxy's own reads checked against the role
files by path alone told neither verbs apart (a ``get`` of one owner, a ``list``, a
``watch``) nor scopes (a Role in one namespace grants nothing cluster-wide), nor saw the
Lease's writes.

Modelled on ``k8s.io/apiserver`` and ``k8s.io/kubernetes/plugin/pkg/auth/authorizer/rbac``:

- ``request_attributes``: ``RequestInfoFactory.NewRequestInfo``: the verb from the method
  (GET of a collection is ``list``, or ``watch`` with ``?watch=true``; DELETE of one is
  ``deletecollection``), the group, resource, subresource, name and namespace from the
  path (``/api/v1/namespaces/NAME`` is the Namespace NAME, in namespace NAME); a
  ``metadata.name=`` field selector names the object of a list or watch. Paths outside
  ``/api/v1/...`` and ``/apis/GROUP/VERSION/...`` (discovery, ``/version``) are
  non-resource requests.
- ``Rule.allows``: ``RuleAllows``: ``*`` in verbs, apiGroups, resources (and
  ``*/subresource``); ``resourceNames`` empty for any name, else the request's name in it
  (a create, which has none, never matches a rule with names); ``nonResourceURLs`` exact
  or a ``prefix*``.
- ``Authorizer``: ``VisitRulesFor``: the rules of every ClusterRoleBinding naming the
  user, anywhere; those of every RoleBinding naming it in the request's namespace only
  (its Role there, or a ClusterRole's rules confined to that namespace); a subject is a
  ``ServiceAccount`` (``system:serviceaccount:NS:NAME``), a ``User`` or a ``Group`` of the
  user's (``system:serviceaccounts``, ``system:serviceaccounts:NS``,
  ``system:authenticated``). The grants every cluster's bootstrap policy gives every
  authenticated user (``DEFAULT_RULES``: discovery, ``/version``, the self reviews) are
  added unless told not to.
- ``forbidden``: ``responsewriters.Forbidden``: 403, reason ``Forbidden``, the message
  ``<resource.group> "<name>" is forbidden: User "<user>" cannot <verb> resource
  "<resource>" in API group "<group>" in the namespace "<ns>"`` (``at the cluster scope``
  without a namespace; ``cannot get path "/x"`` for a non-resource request) and details
  ``{name, group, kind: <resource>}``.

Not modelled: aggregated ClusterRoles (``aggregationRule``), escalation checks on RBAC
writes, impersonation, and the other authorizers (Node, webhook).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from tests.kubesim.store import ApiError

#: the proxy's identity in the shipped manifests (config/rbac/serviceaccount.yaml)
SERVICE_ACCOUNT_NAMESPACE = "karta-proxy"
SERVICE_ACCOUNT_NAME = "karta-proxy"

_METHOD_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update",
                 "PATCH": "patch", "DELETE": "delete"}


def service_account_user(namespace: str, name: str) -> str:
    """The user name a service account's token authenticates as."""
    return f"system:serviceaccount:{namespace}:{name}"


def _parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool, as the API server reads query flags."""
    return text in ("1", "t", "T", "TRUE", "true", "True")


@dataclass(frozen=True, slots=True)
class Attributes:
    """What the authorizer decides on (``authorizer.Attributes``)."""

    verb: str
    path: str
    resource_request: bool
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""

    @property
    def scope(self) -> str:
        """``namespace NS`` or ``cluster``: where the request reads or writes."""
        return f"namespace {self.namespace}" if self.namespace else "cluster"

    def __str__(self) -> str:
        if not self.resource_request:
            return f"{self.verb} {self.path}"
        what = self.resource + (f"/{self.subresource}" if self.subresource else "")
        group = f".{self.api_group}" if self.api_group else ""
        named = f" {self.name!r}" if self.name else ""
        return f"{self.verb} {what}{group}{named} ({self.scope})"


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """The attributes kube-apiserver's ``RequestInfoFactory`` gives a request."""
    verb = _METHOD_VERBS.get(method.upper(), method.lower())
    parts = [unquote(p) for p in path.strip("/").split("/") if p]
    nonresource = Attributes(verb=method.lower(), path=path, resource_request=False)
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return nonresource
    rest = parts[1:]
    group = ""
    if parts[0] == "apis":
        if len(rest) < 3:
            return nonresource
        group, rest = rest[0], rest[1:]
    version, rest = rest[0], rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2:  # a resource within the namespace, not the Namespace itself
            rest = rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if _parse_bool(query.get("watch", "")) else "list"
        for term in query.get("fieldSelector", "").split(","):
            key, sep, value = term.partition("=")
            if sep and key.strip() == "metadata.name" and not value.startswith("="):
                name = value.strip()
    elif not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb=verb, path=path, resource_request=True, api_group=group,
                      api_version=version, resource=resource, subresource=subresource,
                      name=name, namespace=namespace)


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``PolicyRule``."""

    verbs: frozenset[str]
    api_groups: frozenset[str] = frozenset()
    resources: frozenset[str] = frozenset()
    resource_names: frozenset[str] = frozenset()
    non_resource_urls: tuple[str, ...] = ()

    @classmethod
    def of(cls, rule: Mapping[str, Any]) -> Rule:
        return cls(verbs=frozenset(rule.get("verbs") or ()),
                   api_groups=frozenset(rule.get("apiGroups") or ()),
                   resources=frozenset(rule.get("resources") or ()),
                   resource_names=frozenset(rule.get("resourceNames") or ()),
                   non_resource_urls=tuple(rule.get("nonResourceURLs") or ()))

    def allows(self, a: Attributes) -> bool:
        if not ("*" in self.verbs or a.verb in self.verbs):
            return False
        if not a.resource_request:
            return any(u == "*" or u == a.path
                       or (u.endswith("*") and a.path.startswith(u.rstrip("*")))
                       for u in self.non_resource_urls)
        combined = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        return (("*" in self.api_groups or a.api_group in self.api_groups)
                and any(r == "*" or r == combined
                        or (bool(a.subresource) and r == f"*/{a.subresource}")
                        for r in self.resources)
                and (not self.resource_names or a.name in self.resource_names))


#: what a cluster's bootstrap policy grants every authenticated user: system:discovery,
#: system:public-info-viewer and system:basic-user (ClusterRoleBindings to the group
#: system:authenticated)
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(verbs=frozenset({"get"}), non_resource_urls=(
        "/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi",
        "/openapi/*", "/readyz", "/version", "/version/")),
    Rule(verbs=frozenset({"create"}), api_groups=frozenset({"authorization.k8s.io"}),
         resources=frozenset({"selfsubjectaccessreviews", "selfsubjectrulesreviews"})),
    Rule(verbs=frozenset({"create"}), api_groups=frozenset({"authentication.k8s.io"}),
         resources=frozenset({"selfsubjectreviews"})),
)


class Authorizer:
    """The RBAC decision for one user over a set of Role, ClusterRole, RoleBinding and
    ClusterRoleBinding objects (other kinds among them are ignored)."""

    def __init__(self, objects: Iterable[Mapping[str, Any]], *,
                 user: str = service_account_user(SERVICE_ACCOUNT_NAMESPACE,
                                                  SERVICE_ACCOUNT_NAME),
                 groups: Iterable[str] | None = None, defaults: bool = True) -> None:
        self.user = user
        if groups is None:
            groups = ["system:authenticated"]
            sa = user.split(":")
            if len(sa) == 4 and sa[:2] == ["system", "serviceaccount"]:
                groups += ["system:serviceaccounts", f"system:serviceaccounts:{sa[2]}"]
        self.groups = frozenset(groups)
        cluster_roles: dict[str, list[Rule]] = {}
        roles: dict[tuple[str, str], list[Rule]] = {}
        bindings: list[Mapping[str, Any]] = []
        for obj in objects:
            kind, md = obj.get("kind"), obj.get("metadata") or {}
            rules = [Rule.of(r) for r in obj.get("rules") or ()]
            if kind == "ClusterRole":
                cluster_roles[md["name"]] = rules
            elif kind == "Role":
                roles[(md.get("namespace", "default"), md["name"])] = rules
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                bindings.append(obj)
        #: rules that hold anywhere
        self.cluster_rules: list[Rule] = list(DEFAULT_RULES) if defaults else []
        #: namespace -> rules that hold in it alone
        self.namespace_rules: dict[str, list[Rule]] = {}
        for b in bindings:
            if not any(self._names_user(s) for s in b.get("subjects") or ()):
                continue
            ref = b["roleRef"]
            if b["kind"] == "ClusterRoleBinding":
                if ref["kind"] == "ClusterRole":
                    self.cluster_rules += cluster_roles.get(ref["name"], [])
                continue
            ns = b["metadata"].get("namespace", "default")
            found = (cluster_roles.get(ref["name"], []) if ref["kind"] == "ClusterRole"
                     else roles.get((ns, ref["name"]), []))
            # a Role's non-resource rules mean nothing: only resource rules can hold there
            self.namespace_rules.setdefault(ns, []).extend(
                r for r in found if not r.non_resource_urls)

    def _names_user(self, subject: Mapping[str, Any]) -> bool:
        kind, name = subject.get("kind"), subject.get("name", "")
        if kind == "ServiceAccount":
            return service_account_user(subject.get("namespace", ""), name) == self.user
        if kind == "User":
            return bool(name == self.user)
        if kind == "Group":
            return name in self.groups
        return False

    def allows(self, a: Attributes) -> bool:
        if any(r.allows(a) for r in self.cluster_rules):
            return True
        return bool(a.resource_request and a.namespace) and any(
            r.allows(a) for r in self.namespace_rules.get(a.namespace, ()))

    def forbidden(self, a: Attributes) -> ApiError:
        return forbidden(a, self.user)


def forbidden(a: Attributes, user: str) -> ApiError:
    """The 403 kube-apiserver answers a request its authorizer refused."""
    if not a.resource_request:
        return ApiError(403, "Forbidden", f'forbidden: User "{user}" cannot {a.verb} '
                        f'path "{a.path}"', details={})
    resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    where = (f'in the namespace "{a.namespace}"' if a.namespace
             else "at the cluster scope")
    why = (f'User "{user}" cannot {a.verb} resource "{resource}" in API group '
           f'"{a.api_group}" {where}')
    qualified = f"{a.resource}.{a.api_group}" if a.api_group else a.resource
    head = f'{qualified} "{a.name}"' if a.name else qualified
    details: dict[str, Any] = {}
    if a.name:
        details["name"] = a.name
    if a.api_group:
        details["group"] = a.api_group
    details["kind"] = a.resource
    return ApiError(403, "Forbidden", f"{head} is forbidden: {why}", details=details)
