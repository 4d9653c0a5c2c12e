"""The high-cardinality corpus of the relay benchmark: a large cluster (default 37,500
pods) and a universe of distinct series (default 2,000,000) that a sender goes through
once per pass, each series exactly once per pass, as a remote-write client relaying one
scrape interval of such a cluster does.

The cluster comes from ``corpus.build_cluster`` (Deployments through ReplicaSets,
StatefulSets, Jobs, CronJobs through Jobs, DaemonSets, bare pods, GPU pods, ~4% of the
pods missing from the snapshot) and is written as a JSON snapshot List for
``karta-proxy --snapshot``. The series are what the kubelet's cAdvisor and the DCGM
exporter expose for it, scraped with the kube-prometheus relabeling:

- per app container: up to 52 ``container_*`` series (CPU, memory, spec, fs and blkio per
  device, tasks by state, memory failures by type and scope, ...); how many of these
  families are used is chosen so the universe reaches ``--series`` for ``--pods``;
- per pod: the pod cgroup's totals; the pause sandbox's network series (``eth0``);
- per node: node cgroups (``/``, ``/kubepods.slice``, system services), no pod;
- per GPU: 16 DCGM fields; a GPU held by a pod names it as
  ``exported_namespace``/``exported_pod`` (``honor_labels: false``), an idle one only
  names the exporter's pod (the proxy's default DCGM rule leaves those unattributed).

The universe is held compactly: every *group* (a container, a pod cgroup, a sandbox, a
node cgroup, a GPU) keeps its label entries encoded once; a series is a (group, metric
template) pair, 4 bytes in a shuffled array. A request body is assembled from those
pieces with its samples (one per series; the timestamp advances with the position in the
stream, 15 s per pass; counters grow and gauges move by pass), so the labels of 2M
series never sit in memory as 2M objects. Bodies are built (in worker processes) and
snappy-compressed before any timing; RW 1.0 ``WriteRequest`` and RW 2.0
``io.prometheus.write.v2.Request`` bodies of the same series and samples are built from
the same stream, so body ``i`` holds the same samples in both encodings.

The protobuf encoding is written by hand, like ``corpus.py``'s: the benchmark shares no
code with the proxy it measures.
"""

from __future__ import annotations

import array
import json
import math
import multiprocessing
import os
import random
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import snappy

from . import corpus

BASE_TIMESTAMP_MS = corpus.BASE_TIMESTAMP_MS
#: one pass through the universe spans one scrape interval of the sender's clock
PASS_MS = 15_000
DEFAULT_PODS = 37_500
DEFAULT_SERIES = 2_000_000

_DOUBLE = struct.Struct("<d")
_VARINT = [corpus.varint(i) for i in range(1 << 16)]


def _uvarint(n: int) -> bytes:
    return _VARINT[n] if n < 65536 else corpus.varint(n)


class _Symbols(dict[bytes, int]):
    """A request's symbol table: a string's ref, added on first use."""

    def __missing__(self, key: bytes) -> int:
        ref = self[key] = len(self)
        return ref


# -- metric templates ------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    kind: str  # container | pod | sandbox | node | gpu
    name: str
    extra: tuple[tuple[str, str], ...] = ()
    #: per-pass increment of a counter; 0 for a gauge
    step: float = 0.0


def _c(name: str, step: float = 0.0, **extra: str) -> Template:
    return Template("container", name, tuple(extra.items()), step)


_DEV = "/dev/nvme0n1"
#: app container families, the ones every cAdvisor dashboard uses first; the first K are
#: used, K chosen to reach the requested series count
CONTAINER_TEMPLATES: tuple[Template, ...] = (
    _c("container_cpu_usage_seconds_total", 5.2, cpu="total"),
    _c("container_memory_working_set_bytes"),
    _c("container_cpu_cfs_throttled_periods_total", 6.0),
    _c("container_cpu_cfs_periods_total", 150.0),
    _c("container_memory_rss"),
    _c("container_memory_cache"),
    _c("container_memory_usage_bytes"),
    _c("container_spec_memory_limit_bytes"),
    _c("container_fs_reads_bytes_total", 5120.0, device=_DEV),
    _c("container_fs_writes_bytes_total", 40960.0, device=_DEV),
    _c("container_cpu_user_seconds_total", 3.9),
    _c("container_cpu_system_seconds_total", 1.3),
    _c("container_last_seen", 15.0),
    _c("container_cpu_cfs_throttled_seconds_total", 0.2),
    _c("container_memory_max_usage_bytes"),
    _c("container_memory_mapped_file"),
    _c("container_memory_swap"),
    _c("container_memory_failcnt", 1.0),
    _c("container_spec_memory_reservation_limit_bytes"),
    _c("container_spec_memory_swap_limit_bytes"),
    _c("container_spec_cpu_period"),
    _c("container_spec_cpu_quota"),
    _c("container_spec_cpu_shares"),
    _c("container_fs_reads_total", 12.0, device=_DEV),
    _c("container_fs_writes_total", 30.0, device=_DEV),
    _c("container_start_time_seconds"),
    _c("container_threads"),
    _c("container_threads_max"),
    _c("container_processes"),
    _c("container_sockets"),
    _c("container_file_descriptors"),
    _c("container_oom_events_total", 0.001),
    _c("container_cpu_load_average_10s"),
    _c("container_memory_failures_total", 900.0, failure_type="pgfault", scope="container"),
    _c("container_memory_failures_total", 950.0, failure_type="pgfault", scope="hierarchy"),
    _c("container_memory_failures_total", 0.5, failure_type="pgmajfault", scope="container"),
    _c("container_memory_failures_total", 0.6, failure_type="pgmajfault", scope="hierarchy"),
    _c("container_tasks_state", state="sleeping"),
    _c("container_tasks_state", state="running"),
    _c("container_tasks_state", state="stopped"),
    _c("container_tasks_state", state="uninterruptible"),
    _c("container_tasks_state", state="iowait"),
    _c("container_blkio_device_usage_total", 4096.0, device=_DEV, major="259", minor="0",
       operation="Read"),
    _c("container_blkio_device_usage_total", 40960.0, device=_DEV, major="259", minor="0",
       operation="Write"),
    _c("container_blkio_device_usage_total", 512.0, device=_DEV, major="259", minor="0",
       operation="Sync"),
    _c("container_blkio_device_usage_total", 44544.0, device=_DEV, major="259", minor="0",
       operation="Async"),
    _c("container_ulimits_soft", ulimit="max_open_files"),
    _c("container_fs_usage_bytes", device=_DEV),
    _c("container_fs_limit_bytes", device=_DEV),
    _c("container_fs_io_time_seconds_total", 0.05, device=_DEV),
    _c("container_fs_sector_reads_total", 10.0, device=_DEV),
    _c("container_fs_sector_writes_total", 80.0, device=_DEV),
)  # fmt: skip
POD_TEMPLATES: tuple[Template, ...] = tuple(
    Template("pod", name, tuple(extra.items()), step)
    for name, extra, step in (
        ("container_cpu_usage_seconds_total", {"cpu": "total"}, 6.0),
        ("container_cpu_cfs_periods_total", {}, 150.0),
        ("container_cpu_cfs_throttled_periods_total", {}, 6.0),
        ("container_memory_working_set_bytes", {}, 0.0),
        ("container_memory_rss", {}, 0.0),
        ("container_memory_usage_bytes", {}, 0.0),
        ("container_spec_cpu_shares", {}, 0.0),
        ("container_last_seen", {}, 15.0),
    )
)
SANDBOX_TEMPLATES: tuple[Template, ...] = (
    *(
        Template("sandbox", name, (("interface", "eth0"),), step)
        for name, step in (
            ("container_network_receive_bytes_total", 1.3e6),
            ("container_network_transmit_bytes_total", 1.1e6),
            ("container_network_receive_packets_total", 4500.0),
            ("container_network_transmit_packets_total", 3700.0),
            ("container_network_receive_errors_total", 0.01),
            ("container_network_transmit_errors_total", 0.01),
            ("container_network_receive_packets_dropped_total", 0.2),
            ("container_network_transmit_packets_dropped_total", 0.1),
        )
    ),
    Template("sandbox", "container_memory_working_set_bytes"),
)
NODE_TEMPLATES: tuple[Template, ...] = (
    Template("node", "container_cpu_usage_seconds_total", (("cpu", "total"),), 22.0),
    Template("node", "container_memory_working_set_bytes"),
)
GPU_TEMPLATES: tuple[Template, ...] = tuple(
    Template("gpu", name, (), step)
    for name, step in (
        ("DCGM_FI_DEV_GPU_UTIL", 0.0),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", 0.0),
        ("DCGM_FI_DEV_FB_USED", 0.0),
        ("DCGM_FI_DEV_FB_FREE", 0.0),
        ("DCGM_FI_DEV_POWER_USAGE", 0.0),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 5.1e3),
        ("DCGM_FI_DEV_GPU_TEMP", 0.0),
        ("DCGM_FI_DEV_MEMORY_TEMP", 0.0),
        ("DCGM_FI_DEV_SM_CLOCK", 0.0),
        ("DCGM_FI_DEV_MEM_CLOCK", 0.0),
        ("DCGM_FI_DEV_XID_ERRORS", 0.0),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 0.0),
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.0),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0),
        ("DCGM_FI_PROF_DRAM_ACTIVE", 0.0),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", 0.0),
    )
)
_NODE_CGROUPS = (
    "/",
    "/kubepods.slice",
    "/kubepods.slice/kubepods-besteffort.slice",
    "/kubepods.slice/kubepods-burstable.slice",
    "/system.slice",
    "/system.slice/kubelet.service",
    "/system.slice/containerd.service",
    "/system.slice/systemd-journald.service",
)
_QOS = ("burstable", "burstable", "burstable", "besteffort", "guaranteed")


# -- groups -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    kind: str
    variant: int  # index into Universe.variants (the sorted label names)
    blob: bytes  # the label entries, sorted by name, encoded once
    offsets: array.array[int]  # entry boundaries in blob (len = labels + 1)
    values: tuple[bytes, ...]  # the label values, in the same order (for RW 2.0)
    attributable: bool


def _entry(name: bytes, value: bytes) -> bytes:
    pair = b"\x0a" + _uvarint(len(name)) + name + b"\x12" + _uvarint(len(value)) + value
    return b"\x0a" + _uvarint(len(pair)) + pair


#: a plan assembles one series' labels from its group's entries (ranges) and the
#: template's constant entries (``__name__`` and the extras), in label-name order
_Piece = bytes | tuple[int, int]


@dataclass
class Universe:
    """Every distinct series of one pass, in stream order, and how to encode them."""

    pods: int
    templates: list[Template]
    variants: list[tuple[str, ...]] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)
    #: series in stream order: group * len(templates) + template
    order: array.array[int] = field(default_factory=lambda: array.array("I"))
    #: attributable series in order[:i] (prefix sums, len = series + 1)
    attributable_prefix: array.array[int] = field(default_factory=lambda: array.array("I"))
    container_families: int = 0
    _plans_v1: dict[int, tuple[_Piece, ...]] = field(default_factory=dict)
    _plans_v2: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    _plan_lists: tuple[list[Any], list[Any]] | None = None

    @property
    def series(self) -> int:
        return len(self.order)

    @property
    def attributable(self) -> int:
        return self.attributable_prefix[-1]

    def attributable_between(self, start: int, stop: int) -> int:
        """Attributable series among stream positions [start, stop) (any passes)."""
        n = self.series
        whole, a = divmod(start, n)
        whole2, b = divmod(stop, n)
        pre = self.attributable_prefix
        return (whole2 - whole) * pre[-1] + pre[b] - pre[a]

    # -- plans ----------------------------------------------------------------------------

    def _plan(self, variant: int, t: int) -> tuple[tuple[_Piece, ...], tuple[Any, ...]]:
        key = variant * len(self.templates) + t
        p1 = self._plans_v1.get(key)
        if p1 is not None:
            return p1, self._plans_v2[key]
        tpl = self.templates[t]
        base = self.variants[variant]
        consts = sorted([("__name__", tpl.name), *tpl.extra], key=lambda kv: kv[0].encode())
        # RW 1.0: group entries i..j between the constant entries, by name
        pieces1: list[_Piece] = []
        # RW 2.0: the names in order, and where each value is in group values + constants
        names: list[bytes] = []
        where: list[int] = []
        i = 0
        for c, (name, value) in enumerate(consts):
            j = i
            while j < len(base) and base[j].encode() < name.encode():
                j += 1
            if j > i:
                pieces1.append((i, j))
                names += [n.encode() for n in base[i:j]]
                where += range(i, j)
            pieces1.append(_entry(name.encode(), value.encode()))
            names.append(name.encode())
            where.append(len(base) + c)
            i = j
        if i < len(base):
            pieces1.append((i, len(base)))
            names += [n.encode() for n in base[i:]]
            where += range(i, len(base))
        self._plans_v1[key] = p1 = tuple(pieces1)
        self._plans_v2[key] = p2 = (
            tuple(names),
            tuple(where),
            tuple(v.encode() for _, v in consts),
        )
        return p1, p2

    def labels(self, pos: int) -> dict[str, str]:
        """The labels of the series at stream position ``pos`` (tests, statistics)."""
        g, t = divmod(self.order[pos % self.series], len(self.templates))
        group = self.groups[g]
        _, (names, where, consts) = self._plan(group.variant, t)
        ext = group.values + consts
        return {n.decode(): ext[w].decode() for n, w in zip(names, where, strict=True)}

    def label_bytes(self, pos: int) -> int:
        g, t = divmod(self.order[pos % self.series], len(self.templates))
        group = self.groups[g]
        p1, _ = self._plan(group.variant, t)
        off = group.offsets
        return sum(len(p) if isinstance(p, bytes) else off[p[1]] - off[p[0]] for p in p1)

    # -- samples --------------------------------------------------------------------------

    def _value(self, code: int, t: int, npass: int) -> float:
        step = self.templates[t].step
        if step:
            return 1.0 + (code * 2654435761 & 0xFFFFFF) / 167.77 + npass * step
        base = 1.0 + (code * 40503 & 0xFFFFFFF) * 3.7
        return base * (1.0 + (((code + npass) % 7) - 3) * 1e-3)

    @staticmethod
    def timestamp(pos: int, series: int) -> int:
        return BASE_TIMESTAMP_MS + pos * PASS_MS // series

    # -- bodies ---------------------------------------------------------------------------

    def _plans(self) -> tuple[list[Any], list[Any]]:
        """Every (variant, template) plan, indexed by variant * templates + template."""
        if self._plan_lists is None:
            T = len(self.templates)
            kinds: dict[int, set[str]] = {}
            for g in self.groups:
                kinds.setdefault(g.variant, set()).add(g.kind)
            p1: list[Any] = [None] * (len(self.variants) * T)
            p2: list[Any] = [None] * (len(self.variants) * T)
            for v, ks in kinds.items():
                for t, tpl in enumerate(self.templates):
                    if tpl.kind in ks:
                        p1[v * T + t], p2[v * T + t] = self._plan(v, t)
            self._plan_lists = (p1, p2)
        return self._plan_lists

    def body_v1(self, pos: int, n: int) -> bytes:
        """Uncompressed RW 1.0 ``WriteRequest`` of stream positions [pos, pos + n)."""
        N = self.series
        T = len(self.templates)
        tsb = b"\x10" + corpus.varint(self.timestamp(pos, N))
        plans, _ = self._plans()
        order, groups, value, pack, V = self.order, self.groups, self._value, _DOUBLE.pack, _VARINT
        parts: list[bytes] = []
        append = parts.append
        for q in range(pos, pos + n):
            npass, k = divmod(q, N)
            code = order[k]
            g, t = divmod(code, T)
            group = groups[g]
            blob, off = group.blob, group.offsets
            lab = b"".join(
                [
                    p if p.__class__ is bytes else blob[off[p[0]] : off[p[1]]]
                    for p in plans[group.variant * T + t]
                ]
            )
            append(b"\x0a" + V[len(lab) + 18] + lab + b"\x12\x10\x09")
            append(pack(value(code, t, npass)))
            append(tsb)
        return b"".join(parts)

    def body_v2(self, pos: int, n: int) -> bytes:
        """Uncompressed RW 2.0 ``Request`` of the same positions: symbols in order of
        first use (element 0 is ``""``), one packed ``labels_refs`` and one sample per
        series, as Prometheus writes them."""
        N = self.series
        T = len(self.templates)
        tsb = b"\x10" + corpus.varint(self.timestamp(pos, N))
        _, plans = self._plans()
        order, groups, value, pack, V = self.order, self.groups, self._value, _DOUBLE.pack, _VARINT
        table = _Symbols({b"": 0})
        # per (variant, template): the name refs' bytes, where the values come from
        known: dict[int, tuple[list[bytes], tuple[int, ...], tuple[bytes, ...], int]] = {}
        series: list[bytes] = []
        append = series.append
        for q in range(pos, pos + n):
            npass, k = divmod(q, N)
            code = order[k]
            g, t = divmod(code, T)
            group = groups[g]
            key = group.variant * T + t
            if len(table) > 65000:  # refs past the 2-byte varint table
                names, where, consts = plans[key]
                ext = group.values + consts
                flat = [x for n_, w in zip(names, where, strict=True) for x in (n_, ext[w])]
                refs = b"".join([corpus.varint(table[x]) for x in flat])
            else:
                plan2 = known.get(key)
                if plan2 is None:
                    names, where, consts = plans[key]
                    plan2 = known[key] = (
                        [V[table[x]] for x in names],
                        where,
                        consts,
                        2 * len(names),
                    )
                name_refs, where, consts, width = plan2
                ext = group.values + consts if consts else group.values
                parts = [b""] * width
                parts[0::2] = name_refs
                parts[1::2] = [V[table[ext[w]]] for w in where]
                refs = b"".join(parts)
            ts = b"".join(
                (b"\x0a", V[len(refs)], refs, b"\x12\x10\x09", pack(value(code, t, npass)), tsb)
            )
            append(b"\x2a" + _uvarint(len(ts)) + ts)
        symbols = b"".join([b"\x22" + _uvarint(len(s)) + s for s in table])
        return symbols + b"".join(series)


# -- building ---------------------------------------------------------------------------------


def _cadvisor(node: str, ip: str) -> list[tuple[str, str]]:
    return [
        ("endpoint", "https-metrics"),
        ("instance", f"{ip}:10250"),
        ("job", "kubelet"),
        ("metrics_path", "/metrics/cadvisor"),
        ("node", node),
        ("service", "kubelet"),
    ]


class _Builder:
    def __init__(self, universe: Universe, known: set[tuple[str, str]]) -> None:
        self.u = universe
        self.known = known
        self._variants: dict[tuple[str, ...], int] = {}
        self._strings: dict[str, bytes] = {}
        self._entries: dict[tuple[str, str], bytes] = {}

    def _b(self, s: str) -> bytes:
        b = self._strings.get(s)
        if b is None:
            b = self._strings[s] = s.encode()
        return b

    def add(self, kind: str, labels: list[tuple[str, str]], attributable: bool) -> None:
        labels.sort(key=lambda kv: kv[0].encode())
        names = tuple(n for n, _ in labels)
        variant = self._variants.get(names)
        if variant is None:
            variant = self._variants[names] = len(self.u.variants)
            self.u.variants.append(names)
        entries = []
        for kv in labels:
            e = self._entries.get(kv)
            if e is None:
                e = _entry(self._b(kv[0]), self._b(kv[1]))
                if len(self._entries) < 500_000:
                    self._entries[kv] = e
            entries.append(e)
        offsets = [0]
        for e in entries:
            offsets.append(offsets[-1] + len(e))
        values = tuple(self._b(v) for _, v in labels)
        self.u.groups.append(
            _Group(
                kind, variant, b"".join(entries), array.array("H", offsets), values, attributable
            )
        )


def build_universe(cluster: corpus.Cluster, series: int, seed: int = 17) -> Universe:
    """The cluster's series, shuffled and cut to exactly ``series`` distinct ones."""
    rng = random.Random(seed)
    names = corpus._Names(rng)
    known = {(p.namespace, p.name) for p in cluster.pods if p.in_snapshot}
    kinds: dict[str, tuple[Template, ...]] = {
        "container": CONTAINER_TEMPLATES,
        "pod": POD_TEMPLATES,
        "sandbox": SANDBOX_TEMPLATES,
        "node": NODE_TEMPLATES,
        "gpu": GPU_TEMPLATES,
    }
    templates = [t for ts in kinds.values() for t in ts]
    u = Universe(len(cluster.pods), templates)
    b = _Builder(u, known)
    for pod in cluster.pods:
        base = _cadvisor(pod.node, pod.node_ip)
        ok = (pod.namespace, pod.name) in known
        qos = _QOS[int(pod.uid[:2], 16) % len(_QOS)]
        uid = pod.uid.replace("-", "_")
        if qos == "guaranteed":
            slice_ = f"/kubepods.slice/kubepods-pod{uid}.slice"
        else:
            slice_ = f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
        for cname, image in pod.containers:
            cid = names.hexs(64)
            b.add(
                "container",
                [
                    *base,
                    ("container", cname),
                    ("id", f"{slice_}/cri-containerd-{cid}.scope"),
                    ("image", image),
                    ("name", cid),
                    ("namespace", pod.namespace),
                    ("pod", pod.name),
                ],
                ok,
            )
        b.add("pod", [*base, ("id", slice_), ("namespace", pod.namespace), ("pod", pod.name)], ok)
        sid = names.hexs(64)
        b.add(
            "sandbox",
            [
                *base,
                ("container", "POD"),
                ("id", f"{slice_}/cri-containerd-{sid}.scope"),
                ("image", "registry.k8s.io/pause:3.9"),
                ("name", sid),
                ("namespace", pod.namespace),
                ("pod", pod.name),
            ],
            ok,
        )
    for node, ip, _ in cluster.nodes:
        for cg in _NODE_CGROUPS:
            b.add("node", [*_cadvisor(node, ip), ("id", cg)], False)
    gpu_pods: dict[str, list[corpus.Pod]] = {}
    for pod in cluster.pods:
        if pod.gpus:
            gpu_pods.setdefault(pod.node, []).append(pod)
    for node, ip, gpus in cluster.nodes:
        if not gpus:
            continue
        model = corpus._GPU_MODELS[sum(node.encode()) % 2]
        owners = [p for p in gpu_pods.get(node, []) for _ in range(p.gpus)]
        for g in range(gpus):
            labels = [
                ("DCGM_FI_DRIVER_VERSION", "535.129.03"),
                ("Hostname", node),
                ("UUID", f"GPU-{names.uid()}"),
                ("container", "nvidia-dcgm-exporter"),
                ("device", f"nvidia{g}"),
                ("endpoint", "gpu-metrics"),
                ("gpu", str(g)),
                ("instance", f"{ip}:9400"),
                ("job", "nvidia-dcgm-exporter"),
                ("modelName", model),
                ("namespace", "gpu-operator"),
                ("pci_bus_id", f"00000000:{0x07 + 0x10 * g:02X}:00.0"),
                ("pod", cluster.dcgm_exporters[node]),
                ("service", "nvidia-dcgm-exporter"),
            ]
            ok = False
            if g < len(owners):
                p = owners[g]
                labels += [
                    ("exported_container", p.containers[0][0]),
                    ("exported_namespace", p.namespace),
                    ("exported_pod", p.name),
                ]
                ok = (p.namespace, p.name) in known
            b.add("gpu", labels, ok)

    # how many container families reach the target
    count = {k: 0 for k in kinds}
    for grp in u.groups:
        count[grp.kind] += 1
    fixed = sum(count[k] * len(ts) for k, ts in kinds.items() if k != "container")
    containers = max(1, count["container"])
    k = min(len(CONTAINER_TEMPLATES), max(1, math.ceil((series - fixed) / containers)))
    most = fixed + containers * len(CONTAINER_TEMPLATES)
    if series > most:
        raise ValueError(
            f"{len(cluster.pods)} pods give at most {most:,} series; ask for fewer series "
            "or more pods"
        )
    u.container_families = k
    T = len(templates)
    first = {kind: templates.index(ts[0]) for kind, ts in kinds.items()}
    width = {kind: (k if kind == "container" else len(ts)) for kind, ts in kinds.items()}
    codes: list[int] = []
    for gi, grp in enumerate(u.groups):
        t0 = gi * T + first[grp.kind]
        codes.extend(range(t0, t0 + width[grp.kind]))
    random.Random(seed + 1).shuffle(codes)
    del codes[series:]
    u.order = array.array("I", codes)
    del codes
    pre = array.array("I", [0])
    run = 0
    groups = u.groups
    for code in u.order:
        run += groups[code // T].attributable
        pre.append(run)
    u.attributable_prefix = pre
    return u


def write_snapshot_json(cluster: corpus.Cluster, path: Path) -> Path:
    """The cluster as one ``kubectl get -A -o json``-style List (fast to load)."""
    meta = {"resourceVersion": ""}
    doc = {"apiVersion": "v1", "kind": "List", "metadata": meta, "items": cluster.objects}
    with path.open("w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return path


# -- bodies, in worker processes ----------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """``count`` requests of ``size`` series from stream position ``start`` on."""

    start: int
    size: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.size * self.count


_WORK: Universe | None = None  # the universe a forked worker builds from


def _build_chunk(job: tuple[str, int, int, int]) -> list[bytes]:
    protocol, start, size, count = job
    u = _WORK
    assert u is not None
    build = u.body_v2 if protocol == "v2" else u.body_v1
    return [snappy.compress(build(start + i * size, size)) for i in range(count)]


def build_bodies(
    u: Universe,
    segments: Sequence[Segment],
    protocols: Iterable[str] = ("v1",),
    workers: int | None = None,
    chunk: int = 25,
) -> dict[str, list[bytes]]:
    """Compressed bodies of every segment, in order, per protocol (``v1``, ``v2``)."""
    global _WORK
    jobs = []
    for protocol in protocols:
        for seg in segments:
            for i in range(0, seg.count, chunk):
                n = min(chunk, seg.count - i)
                jobs.append((protocol, seg.start + i * seg.size, seg.size, n))
    out: dict[str, list[bytes]] = {p: [] for p in protocols}
    workers = workers or min(4, len(os.sched_getaffinity(0)))
    _WORK = u
    try:
        if workers <= 1 or len(jobs) <= 2:
            results: Iterable[list[bytes]] = map(_build_chunk, jobs)
            for job, bodies in zip(jobs, results, strict=True):
                out[job[0]].extend(bodies)
        else:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(workers) as pool:
                for job, bodies in zip(jobs, pool.imap(_build_chunk, jobs), strict=True):
                    out[job[0]].extend(bodies)
    finally:
        _WORK = None
    return out


def describe(u: Universe, sample: int = 20_000) -> dict[str, float]:
    """Average label bytes and label count per series, over an even sample of the pass."""
    step = max(1, u.series // sample)
    positions = range(0, u.series, step)
    nbytes = sum(u.label_bytes(p) for p in positions)
    nlabels = sum(len(u.labels(p)) for p in positions)
    return {
        "label_bytes_per_series": nbytes / len(positions),
        "labels_per_series": nlabels / len(positions),
    }


def build(pods: int, series: int, seed: int = 7) -> tuple[corpus.Cluster, Universe, float]:
    """The cluster and its universe; the seconds it took."""
    t0 = time.monotonic()
    cluster = corpus.build_cluster(pods, seed=seed, long_names=True)
    u = build_universe(cluster, series)
    return cluster, u, time.monotonic() - t0
