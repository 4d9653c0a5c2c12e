"""The container's memory limit (its cgroup's), read at start to warn when the settings
do not fit it.

Under a cgroup memory limit an allocation never fails: past the limit the kernel
OOM-kills the process, with no line logged. An audit ran the default
``server.max_inflight_bytes`` (512 MiB) in a 512 MiB container and a burst of big requests
had it killed within 7 s; at 256 MiB it held (peak 417 MiB). So the start compares what the
settings may hold, the budget plus a base (:data:`BASE_BYTES`: the interpreter, the index,
buffers) plus the jq sandbox child's footprint when the sandbox is on, with the limit, read as
``proxy.cpus`` reads the CPU quota: ``memory.max`` (cgroup v2) or
``memory.limit_in_bytes`` (v1), the smallest on the way from the process's cgroup up.
"""

from __future__ import annotations

import logging
from pathlib import Path

from proxy.cpus import CGROUP_ROOT, PROC_CGROUP, cgroup_values

log = logging.getLogger("karta.memory_limit")

#: what a proxy holds beside the requests' budget: the interpreter and its libraries, the
#: index and engine of a small cluster, the threads' buffers (docs/deploy.md, "Memory")
BASE_BYTES = 150 << 20
#: the jq sandbox child's resident memory (~13 MB measured, ~6 MB of it its own): its
#: ``karta.jq_memory_limit_bytes`` is reached only by an expression building a huge value,
#: which is then killed, so counting the limit made the shipped 512 MiB DaemonSet warn at
#: every start; docs/deploy.md gives the worst case
JQ_CHILD_BYTES = 20 << 20
#: cgroup v1 writes "no limit" as a huge number (LONG_MAX rounded down to a page)
_NO_LIMIT = 1 << 62


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The memory limit of this process's cgroup and its parents in bytes (the smallest),
    or None for none (or none readable)."""
    limits = cgroup_values(root, proc_cgroup, _v2_limit, "memory", ("memory",), _v1_limit)
    return int(min(limits)) if limits else None


def _v2_limit(folder: Path) -> float | None:
    """``memory.max``: ``max`` (none) or bytes."""
    try:
        text = (folder / "memory.max").read_text().strip()
        return None if text == "max" else float(int(text))
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        limit = int((folder / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if limit >= _NO_LIMIT else float(limit)


def check_memory(max_inflight_bytes: int, jq_sandbox: bool, *,
                 root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """At start: a warning naming the settings when the budget, the base and the jq
    sandbox child's footprint do not fit the cgroup's memory limit. Returns the limit
    (None: none)."""
    limit = memory_limit(root, proc_cgroup)
    if limit is None:
        return None
    rest = BASE_BYTES + (JQ_CHILD_BYTES if jq_sandbox else 0)
    needed = max_inflight_bytes + rest
    if needed > limit:
        log.warning(
            "the container's memory limit (%d MiB, its cgroup's) is below what the settings "
            "may hold: server.max_inflight_bytes (%d MiB) + %d MiB for the rest%s = %d MiB. "
            "A burst of big requests may then have the proxy OOM-killed, with no line "
            "logged; lower server.max_inflight_bytes (to about half the limit) or raise the "
            "limit (docs/deploy.md, \"Memory\")", limit >> 20, max_inflight_bytes >> 20,
            rest >> 20, " (the jq sandbox's child included)" if jq_sandbox else "",
            needed >> 20, extra={"limit": limit, "needed": needed, "kind": "memory_limit"})
    return limit
