"""proxy.cpus: the cores a process may use, its affinity and its cgroup's CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from proxy.cpus import cpu_quota, usable_cpus
from proxy.handler import worker_count

REPO = Path(__file__).resolve().parents[1]
AFFINITY = len(os.sched_getaffinity(0))


def _proc(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cgroup"
    p.write_text(text)
    return p


def _v2(root: Path, path: str, cpu_max: str) -> None:
    folder = root / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(cpu_max + "\n")


def test_v2_quota_of_the_container(tmp_path: Path) -> None:
    """A container with its own cgroup namespace: its cgroup is the mount's root."""
    root = tmp_path / "fs"
    _v2(root, "/", "150000 100000")
    proc = _proc(tmp_path, "0::/\n")
    assert cpu_quota(root, proc) == 1.5
    assert usable_cpus(root, proc) == min(AFFINITY, 2)  # rounded up to whole cores


def test_v2_the_smallest_quota_on_the_way_up_binds(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    _v2(root, "/", "max 100000")
    _v2(root, "/kubepods", "800000 100000")
    _v2(root, "/kubepods/pod1", "100000 100000")
    _v2(root, "/kubepods/pod1/ctr", "max 100000")
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cpu_quota(root, proc) == 1.0
    assert usable_cpus(root, proc) == 1


def test_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    folder = root / "cpu,cpuacct" / "kubepods" / "pod1"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("50000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = _proc(tmp_path, "4:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\n0::/\n")
    assert cpu_quota(root, proc) == 0.5
    assert usable_cpus(root, proc) == 1


@pytest.mark.parametrize("cgroup", ["", "0::/\n", "garbage\n", "3:cpu:/gone\n"])
def test_no_quota_readable_is_the_affinity(tmp_path: Path, cgroup: str) -> None:
    root = tmp_path / "fs"
    _v2(root, "/", "max 100000")
    proc = _proc(tmp_path, cgroup)
    assert cpu_quota(root, proc) is None
    assert usable_cpus(root, proc) == AFFINITY
    assert usable_cpus(root, tmp_path / "missing") == AFFINITY


def test_a_configured_count_wins() -> None:
    assert worker_count(3) == 3
    assert worker_count(0) == usable_cpus()


def test_a_real_cgroup_quota_sizes_the_pool() -> None:
    """A process in a cgroup (v1 here, v2 where mounted so) limited to half a CPU gets one
    worker thread, whatever cores it may run on: sized from the affinity alone it got
    every core of the node."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    parent = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
    folder = parent / f"karta-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"no cgroup of our own here: {e}")
    try:
        try:
            if v2:
                (folder / "cpu.max").write_text("50000 100000")
            else:
                (folder / "cpu.cfs_period_us").write_text("100000")
                (folder / "cpu.cfs_quota_us").write_text("50000")
        except OSError as e:
            pytest.skip(f"cannot set a CPU quota here: {e}")
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from proxy.handler import worker_count; print(worker_count(0))")
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$0" -c "$1" "$2"',
             sys.executable, code, str(REPO)],
            capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == "1", out.stderr
    finally:
        folder.rmdir()
