"""A synthetic but realistic cluster and the remote-write traffic its kubelets and DCGM
exporters would produce, for the relay benchmark.

The cluster (Deployments through ReplicaSets, StatefulSets, Jobs, CronJobs through Jobs,
DaemonSets, bare pods) is written as a snapshot file karta-proxy can load. The series are
what a Prometheus with the usual kube-prometheus scrape config sends: cAdvisor
``container_*`` series (app containers, the pause sandbox, the pod cgroup total, node
cgroups with no pod) and DCGM series whose GPU pod arrives as ``exported_pod`` /
``exported_namespace`` because of ``honor_labels: false``. A few percent of pods are
missing from the snapshot, like pods the index has not seen yet, so not every series is
attributable.

Requests are RW 1.0 ``WriteRequest`` bodies, snappy block compressed, built before any
timing starts. The label part of every series is encoded once; each request only appends
fresh sample bytes (timestamp and value advance per request, as from a real sender), so
building hundreds of 2,000-series requests takes a second or two.

The protobuf encoding is written out here by hand on purpose: the benchmark must not
share code with the proxy it measures.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import snappy
import yaml

from relay.null_upstream import encode_varint

_DOUBLE = struct.Struct("<d")

#: milliseconds; 2023-11-14, so that every timestamp varint is exactly 6 bytes long
BASE_TIMESTAMP_MS = 1_700_000_000_000


# -- protobuf, by hand ---------------------------------------------------------------------


#: the sink's varint encoder (it reads what the corpus writes)
varint = encode_varint


def _field_bytes(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + varint(len(payload)) + payload


_PAIR_CACHE: dict[tuple[str, str], bytes] = {}


def _label_entry(name: str, value: str) -> bytes:
    pair = _field_bytes(0x0A, name.encode()) + _field_bytes(0x12, value.encode())
    return _field_bytes(0x0A, pair)


def encode_labels(labels: dict[str, str]) -> bytes:
    """TimeSeries field 1 entries, names sorted by bytes as Prometheus sends them."""
    cache = _PAIR_CACHE
    parts = []
    for name in sorted(labels, key=str.encode):
        key = (name, labels[name])
        entry = cache.get(key)
        if entry is None:
            entry = _label_entry(name, key[1])
            if len(cache) < 200_000:
                cache[key] = entry
        parts.append(entry)
    return b"".join(parts)


def encode_series(labels: dict[str, str], value: float, timestamp_ms: int) -> bytes:
    """One ``WriteRequest.timeseries`` entry with one sample (used by tests as a reference)."""
    sample = b"\x09" + _DOUBLE.pack(value) + b"\x10" + varint(timestamp_ms)
    ts = encode_labels(labels) + _field_bytes(0x12, sample)
    return _field_bytes(0x0A, ts)


# -- the cluster ---------------------------------------------------------------------------

_ALNUM = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet Kubernetes uses for name suffixes


@dataclass
class Pod:
    namespace: str
    name: str
    uid: str
    node: str
    node_ip: str
    containers: list[tuple[str, str]]  # (name, image)
    gpus: int
    #: False: the pod exists on the node but not in the snapshot (not attributable)
    in_snapshot: bool = True


@dataclass
class Cluster:
    pods: list[Pod] = field(default_factory=list)
    #: snapshot objects other than pods: workloads and intermediate owners
    objects: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[tuple[str, str, int]] = field(default_factory=list)  # (name, ip, gpus)
    #: node -> name of the DCGM exporter pod on it
    dcgm_exporters: dict[str, str] = field(default_factory=dict)


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def suffix(self, n: int) -> str:
        return "".join(self._rng.choice(_ALNUM) for _ in range(n))

    def hexs(self, n: int) -> str:
        return f"{self._rng.getrandbits(4 * n):0{n}x}"

    def uid(self) -> str:
        h = self.hexs(32)
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_APP_WORDS = (
    "api",
    "web",
    "auth",
    "billing",
    "search",
    "cart",
    "checkout",
    "ingest",
    "router",
    "render",
    "notify",
    "ledger",
    "orders",
    "catalog",
    "profile",
    "gateway",
    "worker",
    "indexer",
    "feature",
    "recommend",
)
_IMAGES = (
    "registry.example.com/{app}:1.{n}.{m}",
    "ghcr.io/example/{app}:v2.{n}.{m}",
    "docker.io/library/{app}:{n}.{m}",
)
_SIDECARS = (
    ("istio-proxy", "docker.io/istio/proxyv2:1.20.3"),
    ("log-shipper", "fluent/fluent-bit:2.2.2"),
)
DCGM_EXPORTER = "nvidia-dcgm-exporter"
_DAEMONSETS = (
    ("gpu-operator", DCGM_EXPORTER, True),
    ("kube-system", "kube-proxy", False),
    ("kube-system", "calico-node", False),
    ("monitoring", "node-exporter", False),
    ("logging", "fluent-bit", False),
)
_GPU_MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")


_ORG_UNITS = ("commerce", "platform", "data", "ml", "growth", "payments", "identity", "media")
_ENVS = ("prod", "staging", "canary")
_APP_ROLES = ("service", "worker", "api", "consumer", "server", "scheduler")


def _long_namespaces(n: int) -> list[str]:
    """``unit-word-env`` names as a large organisation's clusters have them."""
    out = []
    for i in range(n):
        unit = _ORG_UNITS[i % len(_ORG_UNITS)]
        word = _APP_WORDS[(i // len(_ORG_UNITS)) % len(_APP_WORDS)]
        k = i // (len(_ORG_UNITS) * len(_APP_WORDS))
        env = _ENVS[k % len(_ENVS)]
        suffix = f"-{k // len(_ENVS)}" if k >= len(_ENVS) else ""
        out.append(f"{unit}-{word}-{env}{suffix}")
    return out


def build_cluster(
    pods: int = 5000, seed: int = 7, unknown_fraction: float = 0.04, long_names: bool = False
) -> Cluster:
    """About ``pods`` pods in a mix of workload kinds; ~8% of them hold GPUs.

    ``long_names`` (the high-cardinality corpus): namespaces like ``payments-cart-prod``,
    apps like ``cart-worker-123`` and nodes like ``ip-10-0-3-17.ec2.internal`` instead of
    ``team-07``, ``cart-123`` and ``node-017``.
    """
    rng = random.Random(seed)
    names = _Names(rng)
    cluster = Cluster()
    n_nodes = max(4, pods // 45)
    gpu_nodes = max(1, n_nodes // 4)
    for i in range(n_nodes):
        gpus = 8 if i < gpu_nodes else 0
        ip = f"10.0.{i // 250}.{i % 250 + 2}"
        node = f"ip-{ip.replace('.', '-')}.ec2.internal" if long_names else f"node-{i:03d}"
        cluster.nodes.append((node, ip, gpus))
    cpu_nodes = cluster.nodes[gpu_nodes:] or cluster.nodes
    gpu_free = {n: g for n, _, g in cluster.nodes[:gpu_nodes]}
    n_namespaces = max(2, pods // 125)
    if long_names:
        namespaces = _long_namespaces(n_namespaces)
    else:
        namespaces = [f"team-{i:02d}" for i in range(n_namespaces)]

    def place(gpus: int) -> tuple[str, str, int]:
        if gpus:
            fit = [n for n, free in gpu_free.items() if free >= gpus]
            if fit:
                node = rng.choice(fit)
                gpu_free[node] -= gpus
                ip = next(ip for nn, ip, _ in cluster.nodes if nn == node)
                return node, ip, gpus
        node, ip, _ = rng.choice(cpu_nodes)
        return node, ip, 0

    def containers(app: str) -> list[tuple[str, str]]:
        image = rng.choice(_IMAGES).format(app=app, n=rng.randint(0, 30), m=rng.randint(0, 9))
        out = [(app, image)]
        if rng.random() < 0.3:
            out.append(rng.choice(_SIDECARS))
        return out

    def owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def add_pod(
        ns: str,
        name: str,
        app: str,
        owner: dict[str, Any] | None,
        labels: dict[str, str],
        gpus: int = 0,
    ) -> None:
        node, ip, gpus = place(gpus)
        pod = Pod(ns, name, names.uid(), node, ip, containers(app), gpus)
        pod.in_snapshot = rng.random() >= unknown_fraction
        cluster.pods.append(pod)
        if pod.in_snapshot:
            cluster.objects.append(_pod_object(pod, labels, owner))

    # node agents first: a DaemonSet pod on every node (the DCGM exporter on GPU nodes)
    for ds_ns, ds_name, only_gpu in _DAEMONSETS:
        on = [n for n in cluster.nodes if n[2]] if only_gpu else cluster.nodes
        ds = _workload("apps/v1", "DaemonSet", ds_name, ds_ns, names.uid(), len(on))
        cluster.objects.append(ds)
        for node, ip, _ in on:
            pod = Pod(
                ds_ns,
                f"{ds_name}-{names.suffix(5)}",
                names.uid(),
                node,
                ip,
                [(ds_name, f"registry.example.com/{ds_name}:1.0.0")],
                0,
            )
            cluster.pods.append(pod)
            cluster.objects.append(_pod_object(pod, {"app": ds_name}, ds))
            if ds_name == DCGM_EXPORTER:
                cluster.dcgm_exporters[node] = pod.name
    serial = 0
    while len(cluster.pods) < pods:
        serial += 1
        ns = rng.choice(namespaces)
        if long_names:
            app = f"{rng.choice(_APP_WORDS)}-{rng.choice(_APP_ROLES)}-{serial}"
        else:
            app = f"{rng.choice(_APP_WORDS)}-{serial}"
        roll = rng.random()
        if roll < 0.50:  # Deployment -> ReplicaSet -> pods
            replicas = rng.choice((1, 2, 2, 3, 3, 4, 6, 10))
            dep = _workload("apps/v1", "Deployment", app, ns, names.uid(), replicas)
            rs_hash = names.suffix(rng.choice((9, 10)))
            rs = _workload("apps/v1", "ReplicaSet", f"{app}-{rs_hash}", ns, names.uid(), replicas)
            rs["metadata"]["ownerReferences"] = [owner_ref(dep)]
            rs["metadata"]["labels"]["pod-template-hash"] = rs_hash
            cluster.objects += [dep, rs]
            for _ in range(replicas):
                add_pod(
                    ns,
                    f"{app}-{rs_hash}-{names.suffix(5)}",
                    app,
                    rs,
                    {"app": app, "pod-template-hash": rs_hash},
                )
        elif roll < 0.68:  # StatefulSet, some of them GPU training / inference
            replicas = rng.choice((1, 3, 3, 5))
            gpus = rng.choice((1, 2, 4, 8)) if rng.random() < 0.25 else 0
            sts = _workload("apps/v1", "StatefulSet", app, ns, names.uid(), replicas)
            cluster.objects.append(sts)
            for k in range(replicas):
                add_pod(
                    ns,
                    f"{app}-{k}",
                    app,
                    sts,
                    {
                        "app": app,
                        "apps.kubernetes.io/pod-index": str(k),
                        "statefulset.kubernetes.io/pod-name": f"{app}-{k}",
                    },
                    gpus,
                )
        elif roll < 0.80:  # Job (a third of them created by a CronJob)
            parallel = rng.choice((1, 1, 2, 4))
            gpus = rng.choice((1, 4, 8)) if rng.random() < 0.4 else 0
            owner = None
            job_name = app
            if rng.random() < 0.33:
                cron = _workload("batch/v1", "CronJob", app, ns, names.uid(), 0)
                cron["spec"] = {"schedule": "*/30 * * * *", "jobTemplate": {"spec": {}}}
                cluster.objects.append(cron)
                owner = cron
                job_name = f"{app}-{rng.randint(28_000_000, 29_000_000)}"
            job = _workload("batch/v1", "Job", job_name, ns, names.uid(), parallel)
            if owner is not None:
                job["metadata"]["ownerReferences"] = [owner_ref(owner)]
            cluster.objects.append(job)
            job_uid = job["metadata"]["uid"]
            for _ in range(parallel):
                add_pod(
                    ns,
                    f"{job_name}-{names.suffix(5)}",
                    app,
                    job,
                    {
                        "batch.kubernetes.io/controller-uid": job_uid,
                        "batch.kubernetes.io/job-name": job_name,
                        "controller-uid": job_uid,
                        "job-name": job_name,
                    },
                    gpus,
                )
        elif roll < 0.97:  # more Deployments, single replica
            dep = _workload("apps/v1", "Deployment", app, ns, names.uid(), 1)
            rs_hash = names.suffix(10)
            rs = _workload("apps/v1", "ReplicaSet", f"{app}-{rs_hash}", ns, names.uid(), 1)
            rs["metadata"]["ownerReferences"] = [owner_ref(dep)]
            cluster.objects += [dep, rs]
            add_pod(
                ns,
                f"{app}-{rs_hash}-{names.suffix(5)}",
                app,
                rs,
                {"app": app, "pod-template-hash": rs_hash},
            )
        else:  # a bare pod
            add_pod(ns, f"{app}-debug", app, None, {"app": app})
    return cluster


def _workload(api: str, kind: str, name: str, ns: str, uid: str, replicas: int) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": api,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid,
            "generation": 1,
            "labels": {"app": name},
        },
    }
    selector = {"matchLabels": {"app": name}}
    if kind in ("Deployment", "ReplicaSet", "StatefulSet"):
        obj["spec"] = {
            "replicas": replicas,
            "selector": selector,
            "template": {"metadata": {"labels": {"app": name}}},
        }
        obj["status"] = {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
            "updatedReplicas": replicas,
        }
        if kind == "Deployment":
            obj["status"]["conditions"] = [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ]
    elif kind == "DaemonSet":
        obj["spec"] = {"selector": selector}
        obj["status"] = {
            "observedGeneration": 1,
            "desiredNumberScheduled": replicas,
            "currentNumberScheduled": replicas,
            "numberReady": replicas,
            "numberAvailable": replicas,
            "updatedNumberScheduled": replicas,
        }
    elif kind == "Job":
        obj["spec"] = {"parallelism": replicas, "completions": replicas, "backoffLimit": 6}
        obj["status"] = {"active": replicas, "startTime": "2023-11-14T22:00:00Z"}
    return obj


def _pod_object(pod: Pod, labels: dict[str, str], owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": pod.name,
        "namespace": pod.namespace,
        "uid": pod.uid,
        "labels": labels,
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    containers: list[dict[str, Any]] = [{"name": n, "image": i} for n, i in pod.containers]
    if pod.gpus:
        containers[0]["resources"] = {"limits": {"nvidia.com/gpu": str(pod.gpus)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": pod.node, "containers": containers},
        "status": {
            "phase": "Running",
            "hostIP": pod.node_ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def write_snapshot(cluster: Cluster, path: Path) -> Path:
    """The cluster as one ``kubectl get -A -o yaml``-style List."""
    items = list(cluster.objects)
    doc = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}, "items": items}
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    with path.open("w") as f:
        yaml.dump(doc, f, Dumper=dumper, sort_keys=False)
    return path


# -- the series ----------------------------------------------------------------------------

_Metric = tuple[str, dict[str, str], float]
_APP_CONTAINER_METRICS: tuple[_Metric, ...] = (
    ("container_cpu_usage_seconds_total", {"cpu": "total"}, 0.35),
    ("container_cpu_user_seconds_total", {}, 0.25),
    ("container_cpu_system_seconds_total", {}, 0.1),
    ("container_cpu_cfs_periods_total", {}, 15.0),
    ("container_cpu_cfs_throttled_periods_total", {}, 0.4),
    ("container_memory_working_set_bytes", {}, 0.0),
    ("container_memory_rss", {}, 0.0),
    ("container_memory_cache", {}, 0.0),
    ("container_memory_usage_bytes", {}, 0.0),
    ("container_spec_memory_limit_bytes", {}, 0.0),
    ("container_fs_reads_bytes_total", {"device": "/dev/nvme0n1"}, 512.0),
    ("container_fs_writes_bytes_total", {"device": "/dev/nvme0n1"}, 4096.0),
    ("container_last_seen", {}, 15.0),
)
_POD_CGROUP_METRICS: tuple[_Metric, ...] = (
    ("container_cpu_usage_seconds_total", {"cpu": "total"}, 0.4),
    ("container_memory_working_set_bytes", {}, 0.0),
    ("container_memory_rss", {}, 0.0),
    ("container_memory_usage_bytes", {}, 0.0),
    ("container_spec_cpu_shares", {}, 0.0),
    ("container_last_seen", {}, 15.0),
)
_SANDBOX_METRICS: tuple[_Metric, ...] = (
    ("container_network_receive_bytes_total", {"interface": "eth0"}, 90_000.0),
    ("container_network_transmit_bytes_total", {"interface": "eth0"}, 70_000.0),
    ("container_network_receive_packets_total", {"interface": "eth0"}, 300.0),
    ("container_network_transmit_packets_total", {"interface": "eth0"}, 250.0),
    ("container_memory_working_set_bytes", {}, 0.0),
)
_NODE_CGROUPS = (
    "/",
    "/kubepods.slice",
    "/system.slice",
    "/system.slice/kubelet.service",
    "/system.slice/containerd.service",
)
_DCGM_METRICS = (
    ("DCGM_FI_DEV_GPU_UTIL", 0.0),
    ("DCGM_FI_DEV_FB_USED", 0.0),
    ("DCGM_FI_DEV_FB_FREE", 0.0),
    ("DCGM_FI_DEV_POWER_USAGE", 0.0),
    ("DCGM_FI_DEV_GPU_TEMP", 0.0),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.0),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0),
    ("DCGM_FI_PROF_DRAM_ACTIVE", 0.0),
)


def _cadvisor_base(node: str, ip: str) -> dict[str, str]:
    return {
        "endpoint": "https-metrics",
        "instance": f"{ip}:10250",
        "job": "kubelet",
        "metrics_path": "/metrics/cadvisor",
        "node": node,
        "service": "kubelet",
    }


def series_labels(cluster: Cluster, seed: int = 11) -> Iterator[tuple[dict[str, str], float]]:
    """Every series the cluster produces: (labels, per-request increment of its value)."""
    rng = random.Random(seed)
    names = _Names(rng)
    for pod in cluster.pods:
        base = _cadvisor_base(pod.node, pod.node_ip)
        slice_ = (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            + pod.uid.replace("-", "_")
            + ".slice"
        )
        for cname, image in pod.containers:
            cid = names.hexs(64)
            ids = {
                "container": cname,
                "id": f"{slice_}/cri-containerd-{cid}.scope",
                "image": image,
                "name": cid,
                "namespace": pod.namespace,
                "pod": pod.name,
            }
            for metric, extra, step in _APP_CONTAINER_METRICS:
                yield {"__name__": metric, **base, **ids, **extra}, step
        for metric, extra, step in _POD_CGROUP_METRICS:
            yield (
                {
                    "__name__": metric,
                    **base,
                    "id": slice_,
                    "namespace": pod.namespace,
                    "pod": pod.name,
                    **extra,
                },
                step,
            )
        sid = names.hexs(64)
        sandbox = {
            "container": "POD",
            "id": f"{slice_}/cri-containerd-{sid}.scope",
            "image": "registry.k8s.io/pause:3.9",
            "name": sid,
            "namespace": pod.namespace,
            "pod": pod.name,
        }
        for metric, extra, step in _SANDBOX_METRICS:
            yield {"__name__": metric, **base, **sandbox, **extra}, step
    for node, ip, _ in cluster.nodes:
        base = _cadvisor_base(node, ip)
        for cg in _NODE_CGROUPS:
            yield (
                {"__name__": "container_cpu_usage_seconds_total", **base, "cpu": "total", "id": cg},
                1.5,
            )
            yield {"__name__": "container_memory_working_set_bytes", **base, "id": cg}, 0.0
    # DCGM: one exporter pod per GPU node; GPUs with a pod name it as exported_*
    gpu_pods: dict[str, list[Pod]] = {}
    for pod in cluster.pods:
        if pod.gpus:
            gpu_pods.setdefault(pod.node, []).append(pod)
    for node, ip, gpus in cluster.nodes:
        if not gpus:
            continue
        model = _GPU_MODELS[int(hashlib.sha1(node.encode()).hexdigest(), 16) % 2]
        exporter = cluster.dcgm_exporters[node]
        owners = [p for p in gpu_pods.get(node, []) for _ in range(p.gpus)]
        for g in range(gpus):
            labels = {
                "DCGM_FI_DRIVER_VERSION": "535.129.03",
                "Hostname": node,
                "UUID": f"GPU-{names.uid()}",
                "container": "nvidia-dcgm-exporter",
                "device": f"nvidia{g}",
                "endpoint": "gpu-metrics",
                "gpu": str(g),
                "instance": f"{ip}:9400",
                "job": "nvidia-dcgm-exporter",
                "modelName": model,
                "namespace": "gpu-operator",
                "pci_bus_id": f"00000000:{0x07 + 0x10 * g:02X}:00.0",
                "pod": exporter,
                "service": "nvidia-dcgm-exporter",
            }
            if g < len(owners):
                p = owners[g]
                labels.update(
                    exported_container=p.containers[0][0],
                    exported_namespace=p.namespace,
                    exported_pod=p.name,
                )
            for metric, step in _DCGM_METRICS:
                yield {"__name__": metric, **labels}, step


def attributable(known: set[tuple[str, str]], labels: dict[str, str]) -> bool:
    """Whether the proxy should stamp a series: the first default pod label pair present
    decides, as in the proxy's configuration (the exported pair only for the prefixes whose
    default rule reads it: the global default does not trust it)."""
    pairs = [("namespace", "pod")]
    if labels.get("__name__", "").startswith(("DCGM_", "kube_")):
        pairs.insert(0, ("exported_namespace", "exported_pod"))
    for ns_label, pod_label in pairs:
        if pod_label in labels and ns_label in labels:
            return (labels[ns_label], labels[pod_label]) in known
    return False


@dataclass
class Corpus:
    """Pre-built, pre-compressed request bodies and what they hold."""

    bodies: list[bytes]
    series_per_request: int
    universe: int  # distinct series the bodies cycle through
    attributable: int  # of those, how many name a pod of the snapshot
    raw_bytes: int  # uncompressed bytes over all bodies


class SeriesStream:
    """Cycles through the cluster's series (shuffled, as a sender's shards mix them) and
    cuts them into request bodies, each with a fresh timestamp and fresh values."""

    def __init__(self, cluster: Cluster, seed: int = 13,
                 external_labels: dict[str, str] | None = None) -> None:
        """``external_labels``: added to every series, as an agent's ``external_labels``
        are (a sender's label of the same name is replaced, as Prometheus does)."""
        rows = [({**labels, **(external_labels or {})}, step)
                for labels, step in series_labels(cluster)]
        random.Random(seed).shuffle(rows)
        known = {(p.namespace, p.name) for p in cluster.pods if p.in_snapshot}
        self.attributable = sum(1 for labels, _ in rows if attributable(known, labels))
        self._prefixes: list[bytes] = []
        self._steps: list[float] = []
        self._values: list[float] = []
        rng = random.Random(seed + 1)
        for labels, step in rows:
            lab = encode_labels(labels)
            # TimeSeries = labels + samples entry (tag 0x12, length 16, sample of 16 bytes:
            # 0x09 + double + 0x10 + 6-byte timestamp varint)
            self._prefixes.append(b"\x0a" + varint(len(lab) + 18) + lab + b"\x12\x10\x09")
            self._steps.append(step)
            self._values.append(rng.uniform(1.0, 1e9) if step == 0 else rng.uniform(0, 1e5))
        self.universe = len(rows)
        self._pos = 0
        self._request = 0

    def next_body(self, n: int) -> bytes:
        ts = BASE_TIMESTAMP_MS + self._request * 250
        tsb = b"\x10" + varint(ts)
        assert len(tsb) == 7
        pack = _DOUBLE.pack
        parts = []
        prefixes, steps, values = self._prefixes, self._steps, self._values
        u = self.universe
        for _ in range(n):
            i = self._pos
            v = values[i] + steps[i] if steps[i] else values[i] * (1.0 + ((i ^ ts) % 7 - 3) * 1e-3)
            values[i] = v
            parts.append(prefixes[i] + pack(v) + tsb)
            self._pos = (i + 1) % u
        self._request += 1
        return b"".join(parts)


def build_corpus(cluster: Cluster, requests: int, series_per_request: int) -> Corpus:
    stream = SeriesStream(cluster)
    bodies = []
    raw = 0
    for _ in range(requests):
        body = stream.next_body(series_per_request)
        raw += len(body)
        bodies.append(snappy.compress(body))
    return Corpus(bodies, series_per_request, stream.universe, stream.attributable, raw)
