"""The jq sandbox's child: evaluates jq programs for the proxy, bounded in memory and CPU.

Run as ``python -I -S .../jq_child.py JQ_FOLDER MEMORY_BYTES CPU_SECONDS`` by
:mod:`proxy.karta.jq_sandbox`, which owns it: a script, isolated, without ``site``, so it
imports ``jq`` (from ``JQ_FOLDER``) and the standard library only, not the proxy's
package: its memory limit leaves room for libjq, and its own footprint stays ~6 MB of
private memory.

At start it sets its own limits (the parent has threads, so no ``preexec_fn``):
``RLIMIT_AS`` to ``MEMORY_BYTES`` (libjq aborts the process when an allocation fails: the
child dies, the proxy does not) and a CPU backstop, ``RLIMIT_CPU``, moved before each
evaluation to the CPU time used so far plus ``CPU_SECONDS``: the parent's deadline is the
real limit (it kills the child past it), the backstop ends a child whose parent is gone
while it loops. Then it says hello and answers requests until its input ends.

Frames, both ways: a 4-byte big-endian length, then that many bytes.

- request: 4-byte big-endian count of programs, then for each a 4-byte big-endian
  length of its source and the source (UTF-8), then the input's JSON text (UTF-8): the
  programs run on one input in one round trip (a workload's status, id and scale paths);
- answers, one frame per program, in order, each sent as soon as it is ready (so the
  parent, whose deadline is one per request, knows which one ran past it): one status
  byte, then the payload: ``o`` and the outputs as one JSON array (keys in the order jq
  gave them), ``e`` and jq's error message (a runtime error, as the in-process
  evaluation raises it), ``x`` and a message for anything else (the outputs not
  encodable as JSON, over the size an answer may have).

Each program is compiled once per child lifetime (cached by its source).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import time
from typing import Any

#: status bytes of an answer
OK, JQ_ERROR, FAILED = b"o", b"e", b"x"
#: the hello the child writes once its limits are set and jq is imported
HELLO = b"karta-jq-child 2"
#: the longest answer sent: outputs beyond this are refused (the parent holds several
#: copies of an answer while it decodes it: a 60 MiB answer took its peak from 19 to 261 MB;
#: outputs are ids, numbers, condition lists, bytes to KiB)
MAX_ANSWER_BYTES = 4 << 20
#: programs kept compiled; past this the oldest is dropped (descriptions edited often)
MAX_PROGRAMS = 4096

_LEN = struct.Struct(">I")


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes of ``fd``, or None at its end."""
    parts: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _answer(fd: int, status: bytes, payload: bytes) -> None:
    _write_all(fd, _LEN.pack(len(payload) + 1) + status + payload)


def _set_limits(memory_bytes: int) -> None:
    """The address-space limit, and no core file: libjq's abort at the limit (or the CPU
    backstop's SIGXCPU) would write up to the whole limit to the working folder."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        memory_bytes = min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _prefer_for_oom() -> None:
    """The kernel's OOM killer picks this process first (``oom_score_adj`` 1000, which
    an unprivileged process may set for itself), so a container at its memory limit
    loses the child, not the proxy; best effort."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _arm_cpu_backstop(cpu_seconds: int) -> None:
    """The CPU soft limit, ``cpu_seconds`` past what this process used so far (SIGXCPU
    ends it there); the hard limit is left as it is (an unprivileged process could not
    raise it again)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(time.process_time()) + cpu_seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def serve(fd_in: int, fd_out: int, cpu_seconds: int) -> None:
    import jq

    programs: dict[bytes, Any] = {}
    _write_all(fd_out, _LEN.pack(len(HELLO)) + HELLO)
    while True:
        head = _read_exact(fd_in, 4)
        if head is None:
            return
        frame = _read_exact(fd_in, _LEN.unpack(head)[0])
        if frame is None:
            return
        (count,) = _LEN.unpack_from(frame)
        at = 4
        sources: list[bytes] = []
        for _ in range(count):
            (n,) = _LEN.unpack_from(frame, at)
            sources.append(frame[at + 4:at + 4 + n])
            at += 4 + n
        text = frame[at:].decode("utf-8", "surrogatepass")
        for source in sources:
            _arm_cpu_backstop(cpu_seconds)
            status, payload = _evaluate(jq.compile, programs, source, text)
            _answer(fd_out, status, payload)


def _evaluate(compile_: Any, programs: dict[bytes, Any], source: bytes,
              text: str) -> tuple[bytes, bytes]:
    """One program on one input: the answer's status and payload."""
    program = programs.get(source)
    if program is None:
        try:
            program = compile_(source.decode("utf-8", "surrogatepass"))
        except ValueError as exc:
            return FAILED, f"does not compile: {exc}".encode()
        if len(programs) >= MAX_PROGRAMS:
            del programs[next(iter(programs))]
        programs[source] = program
    try:
        out = list(program.input_text(text).all())
    except ValueError as exc:
        return JQ_ERROR, str(exc).encode("utf-8", "surrogatepass")
    except (TypeError, RecursionError) as exc:
        return FAILED, f"{type(exc).__name__}: {exc}".encode()
    try:
        payload = json.dumps(out, ensure_ascii=False, separators=(",", ":")
                             ).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError, RecursionError) as exc:
        return FAILED, f"outputs not encodable as JSON: {exc}".encode()
    if len(payload) > MAX_ANSWER_BYTES:
        return FAILED, (f"outputs of {len(payload)} bytes of JSON, over the "
                        f"{MAX_ANSWER_BYTES} bytes an answer may have").encode()
    return OK, payload


def main(argv: list[str]) -> int:
    """``argv``: folders to import from (libjq's binding: the child runs isolated,
    without ``site``), then the memory limit in bytes and the CPU backstop in seconds."""
    *paths, memory, cpu = argv
    sys.path[:0] = paths
    memory_bytes, cpu_seconds = int(memory), int(cpu)
    _prefer_for_oom()
    _set_limits(memory_bytes)
    _arm_cpu_backstop(cpu_seconds)
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    try:
        serve(fd_in, fd_out, cpu_seconds)
    except MemoryError:
        # Python's own allocation failed (libjq's aborts): the state is not trusted
        os._exit(3)
    except BrokenPipeError:  # the parent went away
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
