"""The demo cluster's metrics: a snapshot's Pods and Nodes as the kubelet and DCGM figures
their containers and GPUs would show, and the exposition text of each page.

The demo exporter (:mod:`proxy.demo_exporter`) serves these pages and records the
demo's batch from them; tests read the expected figures (``ClusterModel``) to check
PromQL sums per workload. The text is a cluster's: the same metric names, label sets
and families, including the cAdvisor sandbox (``container="POD"``) and pod-cgroup
series, the kubelet's explicit timestamps, and DCGM's pod labels.

CPU counters advance at a fixed rate per container (0.6 x its CPU request, 0.05 cores
without one) from the model's ``t0``, each GPU's energy counter at its power draw;
memory and the GPU gauges are constant. GPUs of a node go to its GPU pods in
(namespace, name) order; the rest are idle.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from proxy.exposition import family_header, sample_line


def _added(values: Iterable[float]) -> float:
    """Left to right, as ``sum`` added floats before Python 3.12: 3.12's ``sum`` compensates
    its rounding, so the same demo cluster wrote values a last digit apart (``73970.4``,
    ``73970.40000000001``) on 3.11 and on 3.12+; the bundled series are one text on all."""
    return functools.reduce(operator.add, values, 0)

GPU_RESOURCE = "nvidia.com/gpu"
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"
DRIVER_VERSION = "535.129.03"
#: per-container CPU usage relative to its request
CPU_USAGE_OF_REQUEST = 0.6
CPU_USAGE_NO_REQUEST = 0.05
MEMORY_USAGE_OF_REQUEST = 0.55
MEMORY_NO_REQUEST = 48 * 1024 * 1024
SANDBOX_CPU = 0.0005
SANDBOX_MEMORY = 512 * 1024
GPU_FB_TOTAL_MIB = 81920
#: an A100 SXM4's draw idle and its board limit (TDP), W; a busy GPU draws in between
GPU_IDLE_POWER_W = 56.0
GPU_MAX_POWER_W = 400.0

_QUANTITY = re.compile(r"^([0-9.]+(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 1024.0,
    "Mi": 1024.0**2,
    "Gi": 1024.0**3,
    "Ti": 1024.0**4,
}


def quantity(text: Any) -> float:
    """A Kubernetes resource quantity ("500m", "64Gi", 2) as a number."""
    if isinstance(text, int | float):
        return float(text)
    m = _QUANTITY.match(str(text).strip())
    if m is None or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def _digest(*parts: str) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class ContainerModel:
    namespace: str
    pod: str
    pod_uid: str
    node: str
    name: str
    image: str
    qos: str
    cpu_cores: float
    memory_bytes: float
    gpus: int

    @property
    def container_id(self) -> str:
        return _digest(self.pod_uid, self.name)

    @property
    def pod_cgroup(self) -> str:
        uid = self.pod_uid.replace("-", "_")
        if self.qos == "guaranteed":
            return f"/kubepods.slice/kubepods-pod{uid}.slice"
        return f"/kubepods.slice/kubepods-{self.qos}.slice/kubepods-{self.qos}-pod{uid}.slice"


@dataclass(frozen=True)
class PodModel:
    namespace: str
    name: str
    uid: str
    node: str
    qos: str
    containers: tuple[ContainerModel, ...]

    @property
    def sandbox_id(self) -> str:
        return _digest(self.uid, "sandbox")

    @property
    def cgroup(self) -> str:
        return self.containers[0].pod_cgroup if self.containers else ""

    @property
    def cpu_cores(self) -> float:
        """The pod cgroup's rate: its containers plus the sandbox."""
        return _added(c.cpu_cores for c in self.containers) + SANDBOX_CPU

    @property
    def memory_bytes(self) -> float:
        return _added(c.memory_bytes for c in self.containers) + SANDBOX_MEMORY


class GpuHolder(NamedTuple):
    """The container a GPU is given to (DCGM's pod labels)."""

    namespace: str
    pod: str
    container: str


class NodeGpus(NamedTuple):
    """A node's GPUs as its Node object tells them."""

    gpus: int
    model_name: str


@dataclass(frozen=True)
class GpuModel:
    node: str
    index: int
    uuid: str
    model_name: str
    pci_bus_id: str
    #: the container holding it; None for an idle GPU
    holder: GpuHolder | None
    util: float
    fb_used_mib: float
    gr_engine_active: float
    power_w: float
    #: DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION at the model's t0: mJ since the node booted
    energy_at_t0_mj: float


@dataclass
class ClusterModel:
    """What the fixture exporter serves, derived from Pod and Node objects."""

    pods: list[PodModel] = field(default_factory=list)
    gpus: list[GpuModel] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    #: unix seconds the counters count from
    t0: float = 1_730_000_000.0

    @classmethod
    def from_objects(
        cls, objects: Iterable[Mapping[str, Any]], *, t0: float | None = None
    ) -> ClusterModel:
        objs = list(objects)
        node_gpus: dict[str, NodeGpus] = {}
        for o in objs:
            if o.get("kind") != "Node":
                continue
            meta = o.get("metadata") or {}
            cap = (o.get("status") or {}).get("capacity") or {}
            product = (meta.get("labels") or {}).get(
                "nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"
            )
            node_gpus[meta["name"]] = NodeGpus(
                int(quantity(cap.get(GPU_RESOURCE, 0))),
                _model_name(product),
            )
        model = cls(t0=t0 if t0 is not None else time.time())
        pods = sorted(
            (o for o in objs if o.get("kind") == "Pod"),
            key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"]),
        )
        for p in pods:
            model.pods.append(_pod_model(p))
        model.nodes = sorted({p.node for p in model.pods} | set(node_gpus))
        model._assign_gpus(node_gpus)
        return model

    def _assign_gpus(self, node_gpus: Mapping[str, NodeGpus]) -> None:
        """GPUs of a node go to its GPU pods in (namespace, name) order; the rest are idle."""
        for node in self.nodes:
            count, model_name = node_gpus.get(node, NodeGpus(0, "NVIDIA A100-SXM4-80GB"))
            holders: list[GpuHolder] = []
            for pod in self.pods:
                if pod.node != node:
                    continue
                for c in pod.containers:
                    holders.extend([GpuHolder(pod.namespace, pod.name, c.name)] * c.gpus)
            count = max(count, len(holders))
            for i in range(count):
                holder = holders[i] if i < len(holders) else None
                h = int(_digest(node, str(i))[:8], 16)
                util = float(35 + h % 60) if holder else 0.0
                power = round(
                    GPU_IDLE_POWER_W + (GPU_MAX_POWER_W - GPU_IDLE_POWER_W) * 0.85 * util / 100, 3
                )
                uptime_s = 3600.0 * (24 + h % 700)  # booted one to thirty days before t0
                self.gpus.append(
                    GpuModel(
                        node=node,
                        index=i,
                        uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpu/{node}/{i}')}",
                        model_name=model_name,
                        pci_bus_id=f"00000000:{0x07 + 0x10 * i:02X}:00.0",
                        holder=holder,
                        util=util,
                        fb_used_mib=float(round(GPU_FB_TOTAL_MIB * util / 110)) if holder else 0.0,
                        gr_engine_active=round(util / 100 * 0.93, 4),
                        power_w=power,
                        energy_at_t0_mj=float(round(power * 1000 * uptime_s)),
                    )
                )

    # -- expectations for tests --------------------------------------------------------

    def pod(self, namespace: str, name: str) -> PodModel:
        for p in self.pods:
            if p.namespace == namespace and p.name == name:
                return p
        raise KeyError((namespace, name))

    def pod_cpu_counter(self, pod: PodModel, at: float) -> float:
        """The pod cgroup's counter: its containers' and the sandbox's, summed."""
        total = _added(self.cpu_counter(c.cpu_cores, c.container_id, at) for c in pod.containers)
        return round(total + self.cpu_counter(SANDBOX_CPU, pod.sandbox_id, at), 6)

    def cpu_counter(self, rate: float, key: str, at: float) -> float:
        """A counter that has run at ``rate`` since ``t0`` (plus a per-series offset)."""
        start = 1000.0 + int(_digest(key)[:6], 16) % 5000
        return round(start + rate * max(0.0, at - self.t0), 6)

    def energy_counter(self, gpu: GpuModel, at: float) -> float:
        """DCGM's energy counter, whole mJ since boot: it has run at the GPU's power since t0."""
        return float(round(gpu.energy_at_t0_mj + gpu.power_w * 1000 * max(0.0, at - self.t0)))

    # -- exposition text ---------------------------------------------------------------

    def cadvisor_text(self, at: float, *, node: str | None = None, extra: str = "") -> str:
        """``/metrics/cadvisor`` at unix time ``at`` (cAdvisor stamps samples itself)."""
        ts = _ms(at)
        cpu: list[str] = []
        mem: list[str] = []
        for pod in self._pods(node):
            base = {"namespace": pod.namespace, "pod": pod.name}
            for c in pod.containers:
                labels = {
                    "container": c.name,
                    "id": f"{c.pod_cgroup}/cri-containerd-{c.container_id}.scope",
                    "image": c.image,
                    "name": c.container_id,
                    **base,
                }
                cpu.append(
                    _line(
                        "container_cpu_usage_seconds_total",
                        {**labels, "cpu": "total"},
                        self.cpu_counter(c.cpu_cores, c.container_id, at),
                        ts,
                        extra,
                    )
                )
                mem.append(
                    _line("container_memory_working_set_bytes", labels, c.memory_bytes, ts, extra)
                )
            sandbox = {
                "container": "POD",
                "id": f"{pod.cgroup}/cri-containerd-{pod.sandbox_id}.scope",
                "image": PAUSE_IMAGE,
                "name": pod.sandbox_id,
                **base,
            }
            cpu.append(
                _line(
                    "container_cpu_usage_seconds_total",
                    {**sandbox, "cpu": "total"},
                    self.cpu_counter(SANDBOX_CPU, pod.sandbox_id, at),
                    ts,
                    extra,
                )
            )
            mem.append(
                _line("container_memory_working_set_bytes", sandbox, SANDBOX_MEMORY, ts, extra)
            )
            cgroup = {"container": "", "id": pod.cgroup, "image": "", "name": "", **base}
            cpu.append(
                _line(
                    "container_cpu_usage_seconds_total",
                    {**cgroup, "cpu": "total"},
                    self.pod_cpu_counter(pod, at),
                    ts,
                    extra,
                )
            )
            mem.append(
                _line("container_memory_working_set_bytes", cgroup, pod.memory_bytes, ts, extra)
            )
        return _family(
            "container_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed in seconds.",
            cpu,
        ) + _family(
            "container_memory_working_set_bytes",
            "gauge",
            "Current working set of the container in bytes",
            mem,
        )

    def resource_text(self, at: float, *, node: str | None = None, extra: str = "") -> str:
        """kubelet ``/metrics/resource``: every sample carries its own timestamp."""
        ts = _ms(at)
        pods = self._pods(node)
        lines: dict[str, list[str]] = {f.name: [] for f in _RESOURCE_FAMILIES}
        for pod in pods:
            self._resource_pod_lines(pod, at, ts, extra, lines)
        for n in [node] if node else self.nodes:
            # one target per node in a cluster; serving every node at once, name the node
            nlabels = {} if node else {"node": n}
            self._resource_node_lines(n, nlabels, pods, at, ts, extra, lines)
        lines["scrape_error"].append(_line("scrape_error", {}, 0, ts, extra))
        return "".join(_family(f.name, f.kind, f.help, lines[f.name]) for f in _RESOURCE_FAMILIES)

    def _resource_pod_lines(
        self, pod: PodModel, at: float, ts: int, extra: str, lines: dict[str, list[str]],
    ) -> None:
        base = {"namespace": pod.namespace, "pod": pod.name}
        for c in pod.containers:
            labels = {"container": c.name, **base}
            lines["container_cpu_usage_seconds_total"].append(_line(
                "container_cpu_usage_seconds_total", labels,
                self.cpu_counter(c.cpu_cores, c.container_id, at), ts, extra,
            ))
            lines["container_memory_working_set_bytes"].append(
                _line("container_memory_working_set_bytes", labels, c.memory_bytes, ts, extra)
            )
            lines["container_start_time_seconds"].append(
                _line("container_start_time_seconds", labels, round(self.t0 - 3600), ts, extra)
            )
        lines["pod_cpu_usage_seconds_total"].append(
            _line("pod_cpu_usage_seconds_total", base, self.pod_cpu_counter(pod, at), ts, extra)
        )
        lines["pod_memory_working_set_bytes"].append(
            _line("pod_memory_working_set_bytes", base, pod.memory_bytes, ts, extra)
        )

    def _resource_node_lines(
        self, n: str, nlabels: Mapping[str, str], pods: Sequence[PodModel], at: float,
        ts: int, extra: str, lines: dict[str, list[str]],
    ) -> None:
        on_node = [p for p in pods if p.node == n]
        lines["node_cpu_usage_seconds_total"].append(_line(
            "node_cpu_usage_seconds_total", nlabels,
            _added(self.pod_cpu_counter(p, at) for p in on_node) + self.cpu_counter(0.4, n, at),
            ts, extra,
        ))
        lines["node_memory_working_set_bytes"].append(_line(
            "node_memory_working_set_bytes", nlabels,
            _added(p.memory_bytes for p in on_node) + 2 * 1024**3, ts, extra,
        ))

    def dcgm_text(
        self,
        at: float | None = None,
        *,
        node: str | None = None,
        extra: str = "",
        target: Callable[[str], Mapping[str, str]] | None = None,
        now: float | None = None,
    ) -> str:
        """dcgm-exporter's ``/metrics`` (no timestamps unless ``at`` is given).

        ``target(node)`` gives the scrape target's labels; pod labels the exporter sets that
        collide with them are renamed ``exported_*``, as Prometheus does with
        ``honor_labels: false``. The energy counter reads ``now`` (default: ``at``, else the
        wall clock), so a live exporter without timestamps still advances it.
        """
        ts = _ms(at) if at is not None else None
        counted_at = now if now is not None else at if at is not None else time.time()
        util: list[str] = []
        fb: list[str] = []
        gr: list[str] = []
        power: list[str] = []
        energy: list[str] = []
        for g in self.gpus:
            if node is not None and g.node != node:
                continue
            labels: dict[str, str] = {
                "gpu": str(g.index),
                "UUID": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "device": f"nvidia{g.index}",
                "modelName": g.model_name,
                "Hostname": g.node,
                "DCGM_FI_DRIVER_VERSION": DRIVER_VERSION,
            }
            if g.holder is not None:
                h = g.holder
                labels.update(container=h.container, namespace=h.namespace, pod=h.pod)
            if target is not None:
                tl = target(g.node)
                for k in list(labels):
                    if k in tl:
                        labels[f"exported_{k}"] = labels.pop(k)
                labels.update(tl)
            util.append(_line("DCGM_FI_DEV_GPU_UTIL", labels, g.util, ts, extra))
            fb.append(_line("DCGM_FI_DEV_FB_USED", labels, g.fb_used_mib, ts, extra))
            gr.append(_line("DCGM_FI_PROF_GR_ENGINE_ACTIVE", labels, g.gr_engine_active, ts, extra))
            power.append(_line("DCGM_FI_DEV_POWER_USAGE", labels, g.power_w, ts, extra))
            energy.append(_line("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", labels,
                                self.energy_counter(g, counted_at), ts, extra))
        return (
            _family("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", util)
            + _family("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", fb)
            + _family(
                "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                "gauge",
                "Ratio of time the graphics engine is active.",
                gr,
            )
            # HELP texts and types as in dcgm-exporter's etc/default-counters.csv
            + _family("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", power)
            + _family(
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                "counter",
                "Total energy consumption since boot (in mJ).",
                energy,
            )
        )

    def _pods(self, node: str | None) -> list[PodModel]:
        return [p for p in self.pods if node is None or p.node == node]


def _model_name(product: str) -> str:
    # the node label "NVIDIA-A100-SXM4-80GB" is the device name with the first space dashed
    return product.replace("-", " ", 1) if product.startswith("NVIDIA-") else product


def _pod_model(obj: Mapping[str, Any]) -> PodModel:
    meta = obj["metadata"]
    spec = obj.get("spec") or {}
    node = spec.get("nodeName") or "unscheduled"
    containers = spec.get("containers") or []
    qos = _qos(containers)
    models = []
    for c in containers:
        res = c.get("resources") or {}
        req = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        cpu = quantity(req["cpu"]) * CPU_USAGE_OF_REQUEST if "cpu" in req else CPU_USAGE_NO_REQUEST
        mem = (
            round(quantity(req["memory"]) * MEMORY_USAGE_OF_REQUEST)
            if "memory" in req
            else MEMORY_NO_REQUEST
        )
        models.append(
            ContainerModel(
                namespace=meta.get("namespace", "default"),
                pod=meta["name"],
                pod_uid=meta.get("uid") or str(uuid.uuid5(uuid.NAMESPACE_URL, meta["name"])),
                node=node,
                name=c["name"],
                image=c.get("image", ""),
                qos=qos,
                cpu_cores=round(cpu, 6),
                memory_bytes=float(mem),
                gpus=int(quantity(req.get(GPU_RESOURCE, 0))),
            )
        )
    return PodModel(
        namespace=meta.get("namespace", "default"),
        name=meta["name"],
        uid=meta.get("uid", ""),
        node=node,
        qos=qos,
        containers=tuple(models),
    )


def _qos(containers: Sequence[Mapping[str, Any]]) -> str:
    requests_any = False
    guaranteed = bool(containers)
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        requests_any = requests_any or bool(req) or bool(lim)
        for r in ("cpu", "memory"):
            if r not in lim or (r in req and quantity(req[r]) != quantity(lim[r])):
                guaranteed = False
    if guaranteed:
        return "guaranteed"
    return "burstable" if requests_any else "besteffort"


def _ms(at: float) -> int:
    return round(at * 1000)


def _number(value: float) -> str:
    """The exporter's number format: whole values without a fraction (``1``, where the
    proxy's own pages, as prometheus_client, write ``1.0``), others as Python's repr."""
    if value != value:
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


@dataclass(frozen=True)
class _FamilySpec:
    """A metric family's exposition header, so a page lists its families once, in order."""

    name: str
    kind: str
    help: str


#: kubelet /metrics/resource, in the order the kubelet serves them
_RESOURCE_FAMILIES = (
    _FamilySpec("container_cpu_usage_seconds_total", "counter",
                "[STABLE] Cumulative cpu time consumed by the container in core-seconds"),
    _FamilySpec("container_memory_working_set_bytes", "gauge",
                "[STABLE] Current working set of the container in bytes"),
    _FamilySpec("container_start_time_seconds", "gauge",
                "[STABLE] Start time of the container since unix epoch in seconds"),
    _FamilySpec("node_cpu_usage_seconds_total", "counter",
                "[STABLE] Cumulative cpu time consumed by the node in core-seconds"),
    _FamilySpec("node_memory_working_set_bytes", "gauge",
                "[STABLE] Current working set of the node in bytes"),
    _FamilySpec("pod_cpu_usage_seconds_total", "counter",
                "[STABLE] Cumulative cpu time consumed by the pod in core-seconds"),
    _FamilySpec("pod_memory_working_set_bytes", "gauge",
                "[STABLE] Current working set of the pod in bytes"),
    _FamilySpec("scrape_error", "gauge",
                "[ALPHA] 1 if there was an error while getting container metrics, 0 otherwise"),
)


def _line(
    name: str, labels: Mapping[str, str], value: float, ts: int | None, extra: str = ""
) -> str:
    """A sample line in the exporters' number format; ``extra``: the scrape target's
    labels, rendered, after the sample's own."""
    return sample_line(name, labels.items(), value, timestamp=ts, number=_number, extra=extra)


def _family(name: str, kind: str, help_text: str, lines: list[str]) -> str:
    """A family's HELP and TYPE and its lines; nothing for a family without samples."""
    return family_header(name, help_text, kind) + "".join(lines) if lines else ""
