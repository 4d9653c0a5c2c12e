"""config/kubernetes: every object of both modes (and of config/rbac, which they compose)
is valid against the Kubernetes 1.31 schemas (PyPI ``kubernetes-validate``, strict: no
unknown fields); the objects agree with one another (selectors, ports, the Lease and its
Role, the ConfigMap mount); and every flag and config key they hand the proxy exists:
the container args go through ``proxy.cli``'s parser and the ConfigMap's YAML through
``load_settings`` and ``validate``, with the downward-API environment the pods get.

ServiceMonitor is a CRD (monitoring.coreos.com), for which kubernetes-validate has no
schema (it raises SchemaNotFoundError, checked below so a release that starts shipping
one is noticed): it is checked by hand instead, for the fields the Prometheus Operator
reads and for naming the Service and port that exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import contract, server
from proxy.cli import build_parser, settings_from_args
from proxy.config import Settings, load_settings, parse_host_port
from proxy.connection_guard import CANCEL_GRACE_SECONDS

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="PyPI kubernetes-validate (the [test] extra)")

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "config" / "kubernetes"
RBAC = REPO / "config" / "rbac"
K8S_VERSION = "1.31"
MODES = ("cluster", "node")
#: kinds of CRDs kubernetes-validate has no schema for, checked by hand below
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
#: the only kustomization keys used, so that rendering = concatenating the resources
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}
NAMESPACE = "karta-proxy"


@dataclass(frozen=True)
class Obj:
    """One rendered object and the file it came from (for messages)."""

    source: Path
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"].get("namespace", ""))


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def kustomization(mode: str) -> dict[str, Any]:
    return dict(yaml.safe_load((KUBE / mode / "kustomization.yaml").read_text()))


def render(mode: str) -> list[Obj]:
    """What ``kustomize build`` gives for a kustomization that only lists resources."""
    k = kustomization(mode)
    assert set(k) <= KUSTOMIZATION_KEYS, (
        f"{mode}: kustomization uses {set(k) - KUSTOMIZATION_KEYS}; render() here (and the "
        "checks built on it) know only resources")
    out: list[Obj] = []
    for res in k["resources"]:
        path = (KUBE / mode / res).resolve()
        assert path.is_file(), f"{mode}: resource {res} is not a file"
        out.extend(Obj(path, d) for d in load_docs(path))
    return out


def by_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o.kind == kind]


def one(objs: list[Obj], kind: str) -> Obj:
    found = by_kind(objs, kind)
    assert len(found) == 1, (kind, [o.name for o in found])
    return found[0]


def every_object() -> Iterator[Obj]:
    for mode in MODES:
        yield from render(mode)
    for path in sorted(RBAC.glob("*.yaml")):
        yield from (Obj(path, d) for d in load_docs(path))


# -- the files ---------------------------------------------------------------------------


def test_every_manifest_file_is_in_a_kustomization() -> None:
    used = {(KUBE / m / r).resolve() for m in MODES for r in kustomization(m)["resources"]}
    files = {p.resolve() for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files, "no manifests under config/kubernetes"
    assert files <= used, sorted(str(p) for p in files - used)


def test_modes_compose_the_rbac_variants() -> None:
    cluster = {Path(r).name for r in kustomization("cluster")["resources"]}
    node = {Path(r).name for r in kustomization("node")["resources"]}
    # both watch every namespace (node mode filters by node, not namespace)
    assert {"serviceaccount.yaml", "cluster-mode.yaml"} <= cluster & node
    # only cluster mode writes facts, so only it elects a writer
    assert "fact-lease.yaml" in cluster and "fact-lease.yaml" not in node
    # and only its fact writer reads the cluster's identity (kube-system's uid)
    assert "cluster-identity.yaml" in cluster and "cluster-identity.yaml" not in node
    for mode in MODES:
        for r in kustomization(mode)["resources"]:
            if r.startswith("../"):
                assert (KUBE / mode / r).resolve().parent == RBAC, r


@pytest.mark.parametrize("mode", MODES)
def test_kubectl_kustomize_renders_the_same(mode: str) -> None:
    """Where kubectl is installed, its kustomize agrees with render()."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: render() is checked against it where it is")
    done = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(KUBE / mode)],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr

    def key(d: dict[str, Any]) -> str:
        return yaml.safe_dump(d, sort_keys=True)

    got = sorted(key(d) for d in yaml.safe_load_all(done.stdout) if d)
    assert got == sorted(key(o.body) for o in render(mode))


# -- schemas -----------------------------------------------------------------------------


def test_every_object_is_valid_against_the_kubernetes_schemas() -> None:
    checked, crds = 0, 0
    for obj in every_object():
        if (obj.body["apiVersion"], obj.kind) in CRD_KINDS:
            crds += 1
            continue
        try:
            kubernetes_validate.validate(obj.body, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{obj.source.name}: {obj.kind}/{obj.name}: {e.message}"
                                 ) from None
        checked += 1
    assert checked >= 20 and crds == 1, (checked, crds)


def test_the_crd_has_no_schema_in_kubernetes_validate() -> None:
    sm = one(render("cluster"), "ServiceMonitor")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(sm.body, K8S_VERSION, strict=True)


def test_an_invalid_object_is_refused() -> None:
    """The validation above can fail: a misspelt field is an error in strict mode."""
    dep = dict(one(render("cluster"), "Deployment").body)
    dep["spec"] = {**dep["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_service_monitor_names_the_service_and_its_port() -> None:
    objs = render("cluster")
    sm, svc = one(objs, "ServiceMonitor"), one(objs, "Service")
    assert set(sm.body) == {"apiVersion", "kind", "metadata", "spec"}
    spec = sm.body["spec"]
    # no namespaceSelector: its own namespace, so a kustomization that moves both keeps
    # them together (matchNames: [karta-proxy] scraped nothing once moved)
    assert set(spec) <= {"selector", "endpoints", "jobLabel"}
    assert spec["selector"]["matchLabels"].items() <= svc.body["metadata"]["labels"].items()
    assert sm.namespace == svc.namespace
    ports = {p["name"] for p in svc.body["spec"]["ports"]}
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "params", "interval", "scrapeTimeout", "scheme",
                           "honorLabels", "metricRelabelings"}, ep
        # the page without the facts the drop below would take anyway (proxy.server)
        assert ep["params"] == {"facts": ["false"]}
        assert ep["port"] in ports and ep["path"] == "/metrics"


def test_service_monitor_drops_the_scraped_copy_of_the_facts() -> None:
    # the regex of docs/metrics.md: every fact series but build/contract info, which are
    # one per replica
    doc = (REPO / "docs" / "metrics.md").read_text()
    (ep,) = one(render("cluster"), "ServiceMonitor").body["spec"]["endpoints"]
    assert ep["honorLabels"] is True
    (drop,) = ep["metricRelabelings"]
    assert drop["action"] == "drop" and drop["sourceLabels"] == ["__name__"]
    assert f'`__name__=~"{drop["regex"]}"`' in doc
    rx = re.compile(drop["regex"])
    for name in contract.FACT_SERIES:
        kept = name in (contract.FACT_BUILD_INFO, contract.FACT_CONTRACT_INFO)
        assert bool(rx.fullmatch(name)) is not kept, name


# -- the objects agree with one another --------------------------------------------------


def workload(mode: str) -> Obj:
    return one(render(mode), "Deployment" if mode == "cluster" else "DaemonSet")


def container(mode: str) -> dict[str, Any]:
    (c,) = workload(mode).body["spec"]["template"]["spec"]["containers"]
    return dict(c)


def env_field_refs(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c.get("env", [])
            if "valueFrom" in e and "fieldRef" in e["valueFrom"]}


@pytest.mark.parametrize("mode", MODES)
def test_selectors_ports_and_accounts_line_up(mode: str) -> None:
    objs = render(mode)
    w = workload(mode)
    pod_labels = w.body["spec"]["template"]["metadata"]["labels"]
    assert w.body["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = one(objs, "Service")
    assert svc.body["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(mode)["ports"]}
    for p in svc.body["spec"]["ports"]:
        assert p["targetPort"] in ports, p
    accounts = {(o.namespace, o.name) for o in by_kind(objs, "ServiceAccount")}
    spec = w.body["spec"]["template"]["spec"]
    assert (w.namespace, spec["serviceAccountName"]) in accounts
    for binding in by_kind(objs, "ClusterRoleBinding") + by_kind(objs, "RoleBinding"):
        for s in binding.body["subjects"]:
            assert (s["namespace"], s["name"]) in accounts, binding.name
    # every namespaced object in the proxy's namespace, which the manifests create
    assert {o.name for o in by_kind(objs, "Namespace")} == {NAMESPACE}
    assert {o.namespace for o in objs if o.namespace} == {NAMESPACE}
    cm_names = {o.name for o in by_kind(objs, "ConfigMap")}
    assert {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v} <= cm_names


@pytest.mark.parametrize("mode", MODES)
def test_probes_and_resources(mode: str) -> None:
    c = container(mode)
    assert c["livenessProbe"]["httpGet"]["path"] == "/-/healthy"
    assert c["readinessProbe"]["httpGet"]["path"] == "/-/ready"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert env_field_refs(c)["POD_NAMESPACE"] == "metadata.namespace"
    spec = workload(mode).body["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    # the image's user (config/image/Containerfile), so a read-only root needs nothing else
    assert spec["securityContext"]["runAsUser"] == 10001


@pytest.mark.parametrize("mode", MODES)
def test_the_grace_period_outlasts_the_stop_with_margin(mode: str) -> None:
    """The kubelet sends SIGKILL ``terminationGracePeriodSeconds`` after SIGTERM: the stop
    the docs promise (``STOP_SECONDS``, its drain and the cancelled requests' grace
    within it) must end well before, or what it does last is cut (its stop with the fact
    writer's part after the drain took up to 34.5 s by the code, past the 30 s)."""
    spec = workload(mode).body["spec"]["template"]["spec"]
    # the preStop sleep counts against the grace period too
    pre_stop = container(mode)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 3, "senders routed to a pod whose listener is gone are refused"
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + 2 * server.STOP_SECONDS
    assert server.DRAIN_SECONDS + CANCEL_GRACE_SECONDS < server.STOP_SECONDS


def test_cluster_mode_objects() -> None:
    objs = render("cluster")
    dep = one(objs, "Deployment")
    hpa = one(objs, "HorizontalPodAutoscaler").body["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": dep.name}
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert hpa["minReplicas"] >= 2
    # the HPA owns the count: replicas in the Deployment scaled it back at every apply
    assert "replicas" not in dep.body["spec"]
    pdb = one(objs, "PodDisruptionBudget").body["spec"]
    pod_labels = dep.body["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["minAvailable"] < hpa["minReplicas"], "a PDB that blocks every drain"
    assert "NODE_NAME" not in env_field_refs(container("cluster"))


def test_node_mode_objects() -> None:
    objs = render("node")
    assert env_field_refs(container("node"))["NODE_NAME"] == "spec.nodeName"
    assert one(objs, "Service").body["spec"]["internalTrafficPolicy"] == "Local"
    assert not by_kind(objs, "Lease") and not by_kind(objs, "HorizontalPodAutoscaler")


# -- what the proxy is handed exists -----------------------------------------------------


def downward_env(mode: str) -> dict[str, str]:
    """The values the downward API gives the container's fieldRef variables."""
    w = workload(mode)
    values = {"metadata.namespace": w.namespace, "metadata.name": f"{w.name}-abc12",
              "spec.nodeName": "gpu-node-1"}
    return {name: values[path] for name, path in env_field_refs(container(mode)).items()}


def settings_of(mode: str, tmp_path: Path) -> Settings:
    """The container's args through the proxy's own parser, the ConfigMap's file where
    the pod mounts it (rewritten to tmp_path), the pod's environment."""
    objs = render(mode)
    c = container(mode)
    assert "command" not in c, "the image's entrypoint is karta-proxy"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    spec = workload(mode).body["spec"]["template"]["spec"]
    files: dict[str, str] = {}
    for v in spec["volumes"]:
        if "configMap" in v:
            (cm,) = [o for o in by_kind(objs, "ConfigMap") if o.name == v["configMap"]["name"]]
            for fname, text in cm.body["data"].items():
                files[f"{mounts[v['name']]}/{fname}"] = text
    args = []
    for a in c["args"]:
        for mounted, text in files.items():
            if mounted in a:
                local = tmp_path / Path(mounted).name
                local.write_text(text, encoding="utf-8")
                a = a.replace(mounted, str(local))
        args.append(a)
    parsed = build_parser().parse_args(args)  # an unknown flag: SystemExit(2)
    assert parsed.config, "the ConfigMap reaches the proxy through --config"
    load_settings(parsed.config)  # unknown keys and wrong types raise ConfigError
    return settings_from_args(parsed, env=downward_env(mode))


#: what a replica holds beside the bytes of requests in flight: the interpreter, the
#: index (~290 MB at 37.5k pods, docs/performance.md), a /metrics page being written
BASE_BYTES = 256 << 20
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * _UNITS.get(unit or "", 1)


@pytest.mark.parametrize("mode", MODES)
def test_the_memory_limit_holds_the_byte_budget_and_the_process(
        mode: str, tmp_path: Path) -> None:
    """The pod's memory limit is above ``server.max_inflight_bytes`` and what the process
    holds beside it: the node DaemonSet's limit was the default budget (512 MiB), and a
    burst of big requests was OOM-killed (exit -9) before the budget refused any."""
    limit = _bytes(container(mode)["resources"]["limits"]["memory"])
    budget = settings_of(mode, tmp_path).server.max_inflight_bytes
    assert limit >= budget + BASE_BYTES, (mode, limit >> 20, budget >> 20)


@pytest.mark.parametrize("mode", MODES)
def test_the_proxy_listens_on_both_families(mode: str, tmp_path: Path) -> None:
    """A pod IP is IPv6 in an IPv6-only cluster: the shipped 0.0.0.0:9091 refused it (the
    Service's traffic and the kubelet's probes), as it refuses every IPv6 client."""
    address = settings_of(mode, tmp_path).server.listen_address
    assert parse_host_port(address) == ("", 9091), address


def test_cluster_mode_settings(tmp_path: Path) -> None:
    s = settings_of("cluster", tmp_path)
    assert s.upstream.url.endswith("/api/v1/write")
    assert s.kube.node_name == "" and not s.snapshot
    assert s.facts.enabled and s.facts.leader_election
    port = container("cluster")["ports"][0]["containerPort"]
    assert s.server.listen_address.endswith(f":{port}")
    # the Lease the replicas compete for is the shipped one, and the Role grants it
    objs = render("cluster")
    lease = one(objs, "Lease")
    assert lease.name == s.facts.lease_name
    assert (s.facts.lease_namespace or downward_env("cluster")["POD_NAMESPACE"]) == \
        lease.namespace
    role = one(objs, "Role")
    assert role.namespace == lease.namespace
    named = [r for r in role.body["rules"] if r.get("resourceNames")]
    assert any(lease.name in r["resourceNames"] and {"get", "update"} <= set(r["verbs"])
               for r in named), role.body["rules"]


def test_node_mode_settings(tmp_path: Path) -> None:
    s = settings_of("node", tmp_path)
    assert s.kube.node_name == "gpu-node-1", "NODE_NAME stands in for --node-name"
    assert not s.facts.allow_in_node_mode and not s.facts.leader_election
    port = container("node")["ports"][0]["containerPort"]
    assert s.server.listen_address.endswith(f":{port}")


def test_a_wrong_key_in_the_configmap_is_caught(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key in the shipped YAML is refused."""
    from proxy.config import ConfigError

    (cm,) = by_kind(render("cluster"), "ConfigMap")
    bad = tmp_path / "bad.yaml"
    bad.write_text(cm.body["data"]["karta-proxy.yaml"].replace("leader_election",
                                                                 "leader_elections"))
    with pytest.raises(ConfigError, match="leader_elections"):
        load_settings(bad)


def test_docs_named_by_the_repository_files_exist() -> None:
    """The image's files pointed at docs/image.md, which never existed (the text is in
    docs/deploy.md)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=False).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    missing = set()
    for name in tracked:
        path = REPO / name
        if name.startswith("tests/") or path.suffix in (".png", ".svg") or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        missing |= {f"{name}: {ref}" for ref in re.findall(r"docs/[\w.-]+\.md", text)
                    if not (REPO / ref).is_file()}
    assert not missing, sorted(missing)
