"""How many cores this process may use: the CPUs it may run on (``sched_getaffinity``:
``taskset``, a cpuset) and its cgroup's CPU quota, whichever is fewer.

A Kubernetes CPU limit is a quota (CFS bandwidth: ``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1), not a cpuset: a pod limited to 2 CPUs
on a 64-core node may run on all 64, and sized from the affinity alone the worker pool
had 64 threads, throttled by the quota instead of queueing, so its busy share (the
capacity signal ``karta_proxy_worker_busy_seconds_total`` / ``karta_proxy_worker_threads``)
could never approach 1. The quota is read as Go 1.25's ``GOMAXPROCS`` and the JVM's
active processor count read it: the smallest quota on the way from the process's cgroup
up to the root, rounded up to whole cores. Any file that cannot be read counts as no
quota: the count never falls below what the affinity gives for a reason of this module's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may use (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    quota = cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup and its parents, in cores (the smallest),
    or None for none (or none readable)."""
    quotas = cgroup_values(root, proc_cgroup, _v2_quota, "cpu", ("cpu", "cpu,cpuacct"),
                           _v1_quota)
    return min(quotas) if quotas else None


def cgroup_values(root: Path, proc_cgroup: Path, v2: Callable[[Path], float | None],
                  controller: str, v1_mounts: tuple[str, ...],
                  v1: Callable[[Path], float | None]) -> list[float]:
    """What ``v2`` reads in this process's cgroup v2 folder and its parents, and ``v1`` in
    those of the cgroup v1 hierarchy of ``controller`` (mounted as the controllers' names,
    or one of ``v1_mounts``); none when ``/proc/self/cgroup`` cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy:
            continue
        if hierarchy == "0" and controllers == "":  # cgroup v2 (unified)
            found += _along(root, path, v2)
        elif controller in controllers.split(","):  # cgroup v1, the controller's hierarchy
            for mount in (root / controllers, *(root / m for m in v1_mounts)):
                if mount.is_dir():
                    found += _along(mount, path, v1)
                    break
    return found


def _along(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas ``read`` finds in ``path``'s folder under ``mount`` and every parent up
    to ``mount`` (a limit on a parent binds its children). In a container with its own
    cgroup namespace ``path`` is ``/`` and the mount is its own cgroup: one folder."""
    found: list[float] = []
    here = mount / path.lstrip("/")
    while True:
        q = read(here)
        if q is not None:
            found.append(q)
        if here == mount or mount not in here.parents:
            return found
        here = here.parent


def _v2_quota(folder: Path) -> float | None:
    """``cpu.max``: ``max 100000`` (none) or ``<quota> <period>`` in microseconds."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None
