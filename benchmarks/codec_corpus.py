"""A realistic remote-write corpus: cAdvisor container_* and DCGM series over ~5k pods.

Shared by the codec benchmark and anything else that wants requests shaped like a real
Prometheus agent's: 2,000 series per request, one sample each, labels as kube-prometheus
scrape configs produce them (cAdvisor with container/id/image/name, DCGM scraped with
``honor_labels: false`` so the GPU's pod is ``exported_pod``). Most series name a pod the
index knows; node-level series and pods outside the index pass through unattributed.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass

from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, WorkloadRef

SERIES_PER_REQUEST = 2000

_CADVISOR = (
    "container_cpu_usage_seconds_total",
    "container_memory_working_set_bytes",
    "container_memory_rss",
    "container_network_receive_bytes_total",
    "container_fs_usage_bytes",
    "container_cpu_cfs_throttled_periods_total",
)
_DCGM = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def encode_labels(labels: dict[str, str]) -> bytes:
    """RW 1.0 label fields of a TimeSeries, sorted by name."""
    return b"".join(
        _field(1, _field(1, k.encode()) + _field(2, v.encode())) for k, v in sorted(labels.items())
    )


def encode_sample(value: float, ts_ms: int) -> bytes:
    body = b""
    if value != 0.0:
        body += b"\x09" + struct.pack("<d", value)
    body += b"\x10" + _varint(ts_ms)
    return _field(2, body)


@dataclass
class Pod:
    namespace: str
    name: str
    uid: str
    node: str
    workload: WorkloadRef
    component: str
    gpu: bool


def _hex(seed: str, n: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:n]


def make_pods(n: int = 5000, seed: int = 7) -> list[Pod]:
    rnd = random.Random(seed)
    pods: list[Pod] = []
    kinds = (
        ("apps", "Deployment"),
        ("apps", "StatefulSet"),
        ("batch", "Job"),
        ("ray.io", "RayJob"),
    )
    while len(pods) < n:
        ns = f"team-{rnd.randrange(120):03d}"
        group, kind = rnd.choice(kinds)
        wname = f"svc-{rnd.randrange(10**6):06d}"
        wl = WorkloadRef(ns, group, kind, wname, _hex(ns + wname, 32))
        replicas = rnd.randint(1, 12)
        gpu = kind == "RayJob" or rnd.random() < 0.1
        for r in range(replicas):
            suffix = f"{_hex(wname + str(r), 10)[:9]}-{_hex(str(r) + wname, 5)}"
            pname = f"{wname}-{r}" if kind == "StatefulSet" else f"{wname}-{suffix}"
            comp = "worker" if kind == "RayJob" and r else ("head" if kind == "RayJob" else "")
            uid = f"{_hex(pname, 8)}-{_hex(pname + 'a', 4)}-{_hex(pname + 'b', 4)}-" \
                  f"{_hex(pname + 'c', 4)}-{_hex(pname + 'd', 12)}"
            node = f"node-{rnd.randrange(300):03d}"
            pods.append(Pod(ns, pname, uid, node, wl, comp, gpu))
    return pods[:n]


def fill_index(index: PodIndex, pods: list[Pod], known_fraction: float = 0.92) -> None:
    """Put most pods into the index; the rest stay unknown (``pod_unknown``)."""
    cut = int(len(pods) * known_fraction)
    changes = ChangeSet(
        pods={
            p.uid: PodAttribution(
                namespace=p.namespace,
                pod=p.name,
                uid=p.uid,
                workload=p.workload,
                component=p.component,
                instance=p.workload.name,
                replica=p.name.rsplit("-", 1)[-1] if p.workload.kind == "StatefulSet" else "",
                description="bench",
            )
            for p in pods[:cut]
        }
    )
    index.apply(changes)


def label_sets(pods: list[Pod], seed: int = 11) -> list[dict[str, str]]:
    """Every series' labels once: per pod cAdvisor (app, sandbox, pod total), DCGM on GPUs,
    plus node-level series without a pod."""
    rnd = random.Random(seed)
    out: list[dict[str, str]] = []
    for p in pods:
        cid = _hex(p.uid + "app", 64)
        qos = rnd.choice(("burstable", "besteffort"))
        uid = p.uid.replace("-", "_")
        cgroup = f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
        common = {
            "endpoint": "https-metrics",
            "instance": f"10.0.{int(p.node[-3:]) // 250}.{int(p.node[-3:]) % 250}:10250",
            "job": "kubelet",
            "metrics_path": "/metrics/cadvisor",
            "namespace": p.namespace,
            "node": p.node,
            "pod": p.name,
            "service": "kubelet",
        }
        for metric in _CADVISOR:
            out.append(
                {
                    **common,
                    "__name__": metric,
                    "container": "app",
                    "id": f"{cgroup}/cri-containerd-{cid}.scope",
                    "image": f"registry.example.com/{p.namespace}/{p.workload.name}:"
                    f"v1.{rnd.randrange(40)}",
                    "name": cid,
                }
            )
        out.append({**common, "__name__": "container_memory_working_set_bytes", "id": cgroup})
        if p.gpu:
            gpu_uuid = f"GPU-{_hex(p.uid + 'gpu', 8)}-{_hex(p.uid, 4)}-{_hex(p.name, 4)}-" \
                       f"{_hex(p.uid + 'x', 4)}-{_hex(p.uid + 'y', 12)}"
            for metric in _DCGM:
                out.append(
                    {
                        "__name__": metric,
                        "DCGM_FI_DRIVER_VERSION": "535.104.05",
                        "Hostname": p.node,
                        "UUID": gpu_uuid,
                        "container": "nvidia-dcgm-exporter",
                        "device": "nvidia0",
                        "endpoint": "gpu-metrics",
                        "exported_container": "main",
                        "exported_namespace": p.namespace,
                        "exported_pod": p.name,
                        "gpu": "0",
                        "instance": f"10.1.{int(p.node[-3:]) // 250}.{int(p.node[-3:]) % 250}:9400",
                        "job": "nvidia-dcgm-exporter",
                        "modelName": "NVIDIA A100-SXM4-80GB",
                        "namespace": "gpu-operator",
                        "pci_bus_id": "00000000:07:00.0",
                        "pod": f"nvidia-dcgm-exporter-{_hex(p.node, 5)}",
                        "service": "nvidia-dcgm-exporter",
                    }
                )
    for n in range(300):
        out.append({"__name__": "node_load1", "instance": f"node-{n:03d}:9100", "job": "node"})
    rnd.shuffle(out)
    return out


def build_requests(
    labels: list[dict[str, str]], rounds: int, *, seed: int = 3, start_ms: int = 1_767_000_000_000
) -> list[list[bytes]]:
    """``rounds`` scrapes of every series, each cut into 2,000-series RW 1.0 requests
    (uncompressed). Label bytes repeat across rounds, sample values and timestamps move,
    some samples are stale markers, as in a real agent's stream."""
    rnd = random.Random(seed)
    encoded = [encode_labels(ls) for ls in labels]
    stale = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]
    out: list[list[bytes]] = []
    for r in range(rounds):
        ts = start_ms + r * 15_000
        reqs: list[bytes] = []
        for i in range(0, len(encoded), SERIES_PER_REQUEST):
            parts = []
            for lb in encoded[i : i + SERIES_PER_REQUEST]:
                x = rnd.random()
                value = stale if x < 0.002 else (0.0 if x < 0.1 else x * 1e6)
                body = lb + encode_sample(value, ts + rnd.randrange(1000))
                parts.append(_field(1, body))
            reqs.append(b"".join(parts))
        out.append(reqs)
    return out
