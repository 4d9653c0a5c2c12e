"""The container's memory limit read from a fake cgroup tree (v2 and v1), and the start's
warning when the settings do not fit it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.memory_limit import BASE_BYTES, JQ_CHILD_BYTES, check_memory, memory_limit

MiB = 1 << 20


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "fs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text(proc)
    return root, proc_cgroup


def test_v2_the_smallest_limit_on_the_way_up(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/memory.max": str(1024 * MiB), "kubepods/pod1/memory.max": str(512 * MiB),
        "kubepods/pod1/ctr/memory.max": "max"})
    assert memory_limit(root, proc) == 512 * MiB


def test_v1_limit_and_v1_unlimited(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "5:memory:/ctr\n4:cpu,cpuacct:/ctr\n", {
        "memory/ctr/memory.limit_in_bytes": str(512 * MiB)})
    assert memory_limit(root, proc) == 512 * MiB
    (root / "memory/ctr/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_limit(root, proc) is None


def test_no_cgroup_readable_is_no_limit(tmp_path: Path) -> None:
    assert memory_limit(tmp_path / "none", tmp_path / "no-proc") is None


def test_a_budget_that_does_not_fit_the_limit_is_a_warning_naming_the_settings(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the audit's case: the default 512 MiB budget in a 512 MiB container was OOM-killed
    root, proc = _tree(tmp_path, "0::/\n", {"memory.max": str(512 * MiB)})
    with caplog.at_level(logging.WARNING, "karta.memory_limit"):
        assert check_memory(512 * MiB, True, root=root, proc_cgroup=proc) == 512 * MiB
    (line,) = caplog.records
    text = line.getMessage()
    assert "server.max_inflight_bytes (512 MiB)" in text
    assert "(the jq sandbox's child included)" in text
    assert f"= {(512 * MiB + BASE_BYTES + JQ_CHILD_BYTES) >> 20} MiB" in text
    assert 'docs/deploy.md, "Memory"' in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "karta.memory_limit"):
        # the shipped node-mode setting: 256 MiB in 512 MiB, the sandbox on: fits (its
        # child counted at its footprint, not its limit: the DaemonSet warned at every start)
        check_memory(256 * MiB, True, root=root, proc_cgroup=proc)
    assert not caplog.records
