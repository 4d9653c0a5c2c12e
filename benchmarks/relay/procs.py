"""Processes under measurement: start on free loopback ports, wait until they answer,
read their CPU time and peak memory from ``/proc``, stop them by PID.

CPU time is the sum of user + system time over the process and every live descendant,
plus the time of descendants it already reaped, so a relay that forks workers is charged
for all of them. Peak memory is ``VmHWM`` (peak resident set) summed over the process and
its live descendants; ``reset_peak_rss`` sets it back to the current RSS (``clear_refs``
value 5, Linux >= 4.0) so a phase can have a peak of its own.

That sum counts a page each process maps once per process: the interpreter's libraries,
mapped by karta-proxy and by its jq sandbox's child, count twice. Where the box lets the
benchmark make a memory cgroup, each started process also runs in one of its own
(:class:`MemoryCgroup`), and its peak charge is read beside: each page once, what a
container of that relay is billed (cAdvisor's ``container_memory_max_usage_bytes``), the
figure its memory limit is held against.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    out = []
    stack = [pid]
    while stack:
        p = stack.pop()
        if _stat(p) is None:
            continue
        out.append(p)
        stack.extend(_children(p))
    return out


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes(pid: int) -> int:
    """Sum of ``VmHWM`` over ``pid`` and its live descendants."""
    return sum(_status_kib(p, "VmHWM") for p in tree(pid)) * 1024


def rss_bytes(pid: int) -> int:
    """Sum of ``VmRSS`` over ``pid`` and its live descendants."""
    return sum(_status_kib(p, "VmRSS") for p in tree(pid)) * 1024


def reset_peak_rss(pid: int) -> bool:
    """Reset ``VmHWM`` of the tree to its current RSS; False where the kernel refused."""
    ok = True
    for p in tree(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            ok = False
    return ok


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of ``pid`` and all its descendants (live or reaped)."""
    total = 0
    stack = [pid]
    first = True
    while stack:
        p = stack.pop()
        fields = _stat(p)
        if fields is None:
            continue
        # after the name: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
        total += int(fields[11]) + int(fields[12])
        if first:
            total += int(fields[13]) + int(fields[14])
            first = False
        stack.extend(_children(p))
    return total / _TICKS


class MemoryCgroup:
    """A memory cgroup of one started process and its descendants (cgroup v1's memory
    controller, or v2's where it is enabled), made below the benchmark's own.

    Its peak counts anonymous memory and the page cache the processes bring in first
    (a file read that is cached already, the libraries, the snapshot the benchmark
    wrote, is charged to whoever read it first, not here)."""

    def __init__(self, path: Path, peak_file: str) -> None:
        self.path = path
        self._peak_file = peak_file

    @classmethod
    def make(cls, name: str) -> MemoryCgroup | None:
        """A new cgroup ``name`` below this process's, None where the box has no memory
        controller the benchmark may write (no root, a read-only ``/sys/fs/cgroup``)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, where = line.split(":", 2)
            if controllers == "memory":
                root, peak = Path("/sys/fs/cgroup/memory"), "memory.max_usage_in_bytes"
            elif controllers == "":
                root, peak = Path("/sys/fs/cgroup"), "memory.peak"
                if not (root / where.lstrip("/") / "memory.peak").exists():
                    continue  # v2 without its memory controller here
            else:
                continue
            path = root / where.lstrip("/") / name
            try:
                path.mkdir()
            except OSError:
                return None
            if not (path / peak).exists():
                with contextlib.suppress(OSError):
                    path.rmdir()
                return None
            return cls(path, peak)
        return None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` entering the cgroup before it starts: ``exec`` keeps the PID, and
        nothing it allocates is charged elsewhere first."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                *argv]

    def peak_bytes(self) -> int:
        try:
            return int((self.path / self._peak_file).read_text())
        except (OSError, ValueError):
            return 0

    def reset_peak(self) -> bool:
        """Set the peak back to the current charge (v1; v2 from Linux 6.12)."""
        try:
            (self.path / self._peak_file).write_text("0\n" if self._peak_file.startswith(
                "memory.max_") else "reset\n")
        except OSError:
            return False
        return True

    def remove(self) -> None:
        """Once its processes ended (their charges move to the parent)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a process still exiting


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Process:
    """One started program; ``stop`` ends it (and only it) by its PID."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port: int,
        ready_path: str,
        log_path: Path,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.argv = list(argv)
        self.cgroup = MemoryCgroup.make(f"karta-bench-{os.getpid()}-{port}")
        self._ready_path = ready_path
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            self.cgroup.wrap(self.argv) if self.cgroup is not None else self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float) -> None:
        """Poll the ready path until it answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}: {self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = http_get(self.port, self._ready_path, timeout=1.0)
                if status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s: {self.log_tail()}")

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def peak_charged_bytes(self) -> int | None:
        """The peak charge of its memory cgroup; None without one."""
        return self.cgroup.peak_bytes() if self.cgroup is not None else None

    def reset_peak_charged(self) -> None:
        if self.cgroup is not None:
            self.cgroup.reset_peak()

    def log_tail(self, chars: int = 1500) -> str:
        self._log.flush()
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self._log.close()
        if self.cgroup is not None:
            self.cgroup.remove()


@dataclass(frozen=True)
class ThreadUse:
    """What threads of one role spent: CPU (and of it, in the kernel: socket copies,
    wake-ups), context switches, and time runnable but waiting for a core
    (``schedstat``'s second field; 0 where the kernel keeps none)."""

    threads: int
    cpu_seconds: float
    system_seconds: float
    voluntary_switches: int
    involuntary_switches: int
    run_wait_seconds: float

    def __sub__(self, other: ThreadUse) -> ThreadUse:
        return ThreadUse(
            max(self.threads, other.threads),
            self.cpu_seconds - other.cpu_seconds,
            self.system_seconds - other.system_seconds,
            self.voluntary_switches - other.voluntary_switches,
            self.involuntary_switches - other.involuntary_switches,
            self.run_wait_seconds - other.run_wait_seconds,
        )

    def __add__(self, other: ThreadUse) -> ThreadUse:
        return ThreadUse(
            self.threads + other.threads,
            self.cpu_seconds + other.cpu_seconds,
            self.system_seconds + other.system_seconds,
            self.voluntary_switches + other.voluntary_switches,
            self.involuntary_switches + other.involuntary_switches,
            self.run_wait_seconds + other.run_wait_seconds,
        )


NO_USE = ThreadUse(0, 0.0, 0.0, 0, 0, 0.0)

#: the role of the thread whose id is the process's: the event loop, in a Python relay
MAIN_THREAD = "main"


def thread_role(name: str) -> str:
    """A thread's role from its OS name: the pool's prefix (``karta-splice_1`` ->
    ``karta-splice``)."""
    head, sep, tail = name.rpartition("_")
    return head if sep and tail.isdigit() else name


def thread_use(pid: int) -> dict[str, ThreadUse]:
    """Per role (:func:`thread_role` of each thread's OS name; :data:`MAIN_THREAD` for the
    main thread), what the live threads of ``pid`` have spent so far. A thread that has
    ended takes its figures with it: take this where the pools' threads live on."""
    out: dict[str, ThreadUse] = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            stat = Path(f"{base}/stat").read_text()
            status = Path(f"{base}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        switches = {k: int(v) for k, _, v in (line.partition(":\t") for line in
                                              status.splitlines())
                    if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
        try:
            wait_ns = int(Path(f"{base}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            wait_ns = 0
        use = ThreadUse(1, (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[12]) / _TICKS,
                        switches.get("voluntary_ctxt_switches", 0),
                        switches.get("nonvoluntary_ctxt_switches", 0), wait_ns / 1e9)
        role = MAIN_THREAD if tid == pid else thread_role(name)
        out[role] = out.get(role, NO_USE) + use
    return out


def thread_use_between(before: dict[str, ThreadUse],
                       after: dict[str, ThreadUse]) -> dict[str, ThreadUse]:
    """What each role spent between two :func:`thread_use` readings; a role that appeared
    meanwhile (a pool starts its threads on demand) counts from zero."""
    return {role: use - before.get(role, NO_USE) for role, use in after.items()}
