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

Each program is compiled once per child lifetime (cached by its source, the caches
bounded: :func:`_keep`). The programs of a request run on one parse of the input: libjq
parses a text at each run of a program (the binding has no way to hand it a parsed
value), ~40 ms for a 1.5 MB object, so a request of N programs cost N parses (a
3,000-node Workflow's three paths: 143 ms, 62 ms now; six: 271 ms, 62 ms). They are
compiled together, once per tuple of sources, into one program that runs each on the
input slurped (its values as ``input_text`` gives them) and emits one value each, its
outputs or the error that ended them, and answered as each value comes
(:func:`_answers`, :func:`combined`, :func:`outcomes`; the proxy's in-process runner,
``karta.jq_sandbox: false``, runs its expressions through the same two functions, so
they live here, in a script that imports no part of the proxy). Where that form could
answer otherwise than the program run alone, the program runs alone, as before: a
request with a program that does not compile alone, or that names ``halt``, ``input`` or
``$__loc__``; an error value too deep for ``json.dumps`` (the binding's wording of an
error that is not a string); and from an input that does not parse, an output Python
cannot take or a missing value on, the rest of the request.
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

#: status bytes of an answer
OK, JQ_ERROR, FAILED = b"o", b"e", b"x"
#: the hello the child writes once its limits are set and jq is imported
HELLO = b"karta-jq-child 2"
#: the longest answer sent: outputs beyond this are refused (the parent holds several
#: copies of an answer while it decodes it: a 60 MiB answer took its peak from 19 to 261 MB;
#: outputs are ids, numbers, condition lists, bytes to KiB)
MAX_ANSWER_BYTES = 4 << 20
#: programs kept compiled in each cache (alone, together); past this the least recently
#: used is dropped (descriptions edited often)
MAX_PROGRAMS = 4096
#: and their sources' bytes at most, in each cache: a compiled program takes ~65 times its
#: source (six paths of ~60 bytes run together: ~24 KB), so 4,096 of those were ~94 MB
#: within the child's memory limit (256 MiB by default, 64 at least) beside the input it
#: parses; this keeps each cache near 16 MB
MAX_SOURCE_BYTES = 256 << 10

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
    together: dict[tuple[bytes, ...], Any] = {}
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
        for status, payload in _answers(jq.compile, programs, together, sources, text,
                                        cpu_seconds):
            _answer(fd_out, status, payload)


def _answers(compile_: Any, programs: dict[bytes, Any], together: dict[tuple[bytes, ...], Any],
             sources: list[bytes], text: str, cpu_seconds: int) -> Iterator[tuple[bytes, bytes]]:
    """Each program's answer on ``text``, in order, each yielded as soon as it is ready
    (the parent's deadline is one per request: the answer missing names the program that
    ran past it), the CPU backstop moved before each program's work.

    libjq parses its input again at each ``input_text``: ~40 ms for a 1.5 MB object, so
    a request of N programs paid N parses. The programs run as one (:func:`combined`,
    :func:`outcomes`) on one parse; each one that form cannot answer exactly is run
    alone, as before: the answers are those of the programs run one by one."""
    program = combined(compile_, programs, together, sources) if len(sources) > 1 else None
    got = outcomes(program, len(sources), text, lambda: _arm_cpu_backstop(cpu_seconds))
    for source, outcome in zip(sources, got, strict=True):
        if outcome is None:
            yield _evaluate(compile_, programs, source, text)
        elif outcome[0]:
            yield _encoded(outcome[1])
        else:
            yield JQ_ERROR, outcome[1].encode("utf-8", "surrogatepass")


def _no_arm() -> None:
    """No CPU backstop: the proxy's own process (its in-process runner) sets no limit."""


def outcomes(program: Any, count: int, text: str,
             arm: Callable[[], None] = _no_arm) -> Iterator[tuple[bool, Any] | None]:
    """The ``count`` programs of ``program`` (:func:`combined`; None: none combined) on
    ``text``, in order, each as soon as its value comes: ``(True, outputs)`` (Python
    values, as ``input_text`` converts them, not encoded: the in-process runner takes
    them as they are), ``(False, message)`` (the error as the binding words it alone),
    or None for a program to run alone (by the caller, right after). ``arm`` is called
    before each program's work (the child's CPU backstop; nothing in the proxy).

    Run alone: a program whose error value is too deep for ``json.dumps`` (the binding's
    wording of an error that is not a string: its ``_jq_error_to_py_string``, converted
    here alike; not run again otherwise: twice its CPU, past the parent's deadline where
    alone it answered), and from anything unexpected on (an input that does not parse,
    an output Python cannot take, fewer values than programs) the rest."""
    done = 0
    if program is not None:
        try:
            # slurp: every value of the text in one array, each program run on each value
            # as ``input_text`` runs it; an empty text is an empty array, no outputs
            values = iter(program.input_text(text, slurp=True))
        except (ValueError, TypeError):  # not encodable (a lone surrogate), told by each
            values = iter(())           # alone; a binding without ``slurp``: all alone
        for _ in range(count):
            arm()
            try:
                ok, value = next(values)
            except (StopIteration, ValueError, TypeError, RecursionError):
                break  # the input's parse error, an output not convertible: alone
            done += 1
            if ok or isinstance(value, str):
                yield ok, value
                continue
            try:
                message = json.dumps(value)
            except (ValueError, TypeError, RecursionError):  # too deep: alone
                yield None
                continue
            yield False, message
    for _ in range(count - done):
        arm()
        yield None


#: what a program may name that the combined form would run differently: ``halt`` and
#: ``halt_error`` end the whole combined program, ``input`` and ``inputs`` read past the
#: value (``input_line_number`` with them; the names, not a field: ``.inputs``), and
#: ``$__loc__`` gives its line in the combined text. The words are looked for anywhere
#: (in a string too): a program run alone for nothing answers all the same
_ALONE_ONLY = re.compile(
    rb"(?<![.\w$])(?:halt|halt_error|input|inputs|input_line_number)\b|__loc__")


def combined(compile_: Any, programs: dict[bytes, Any], together: dict[tuple[bytes, ...], Any],
             sources: list[bytes]) -> Any:
    """One program running ``sources`` in order on one input, each emitting one value:
    ``[true, outputs]`` or ``[false, error]`` (its outputs on every value of a slurped
    input, as ``input_text`` gives them, or the error ending them); None when they are
    to run one by one: a program that does not compile alone (its error is its own
    answer; and only a complete program cannot reach across the wrapper), that names
    what :data:`_ALONE_ONLY` lists, or a combined text that does not compile (``import``
    and ``include`` are top-level only; a comment continued by a backslash would swallow
    the wrapper's closing line: the brackets left open fail the compile). Each program
    on lines of its own: one ending in a ``#`` comment leaves the wrapper's next line.
    The ``try`` body is one collected array, so libjq 1.6's ``try`` and 1.7's (which
    differ on errors raised after the body's outputs) catch the same (the binding 1.13
    bundles libjq 1.8.2). Kept compiled by the tuple of sources, None too (:func:`_keep`)."""
    key = tuple(sources)
    if key in together:
        program = together[key] = together.pop(key)  # the most recently used now
        return program
    program = None
    if not any(_ALONE_ONLY.search(s) for s in sources):
        text = ",\n".join(f"(try [true, [.[] | (\n{s.decode('utf-8', 'surrogatepass')}\n)]]"
                           " catch [false, .])" for s in sources)
        try:
            for source in sources:
                _compiled(compile_, programs, source)
            program = compile_(text)
        except ValueError:
            program = None
    _keep(together, key, program)
    return program


def _source_bytes(key: bytes | tuple[bytes, ...]) -> int:
    return len(key) if isinstance(key, bytes) else sum(map(len, key))


def _keep(cache: dict[Any, Any], key: bytes | tuple[bytes, ...], value: Any) -> None:
    """``key`` -> ``value`` in a cache of at most MAX_PROGRAMS and MAX_SOURCE_BYTES of
    sources, the least recently used dropped (the one just kept stays, whatever its
    size). Summed at each keep: a compile costs more than the sum."""
    cache[key] = value
    held = sum(map(_source_bytes, cache))
    while len(cache) > 1 and (len(cache) > MAX_PROGRAMS or held > MAX_SOURCE_BYTES):
        oldest = next(iter(cache))
        held -= _source_bytes(oldest)
        del cache[oldest]


def _compiled(compile_: Any, programs: dict[bytes, Any], source: bytes) -> Any:
    """The program, compiled once per child lifetime; ValueError when it does not
    compile (not kept: asked again, it is compiled again)."""
    program = programs.pop(source, None)
    if program is None:
        program = compile_(source.decode("utf-8", "surrogatepass"))
        _keep(programs, source, program)
    else:
        programs[source] = program  # the most recently used now
    return program


def _evaluate(compile_: Any, programs: dict[bytes, Any], source: bytes,
              text: str) -> tuple[bytes, bytes]:
    """One program on one input, alone: the answer's status and payload."""
    try:
        program = _compiled(compile_, programs, source)
    except ValueError as exc:
        return FAILED, f"does not compile: {exc}".encode()
    try:
        out = list(program.input_text(text).all())
    except ValueError as exc:
        return JQ_ERROR, str(exc).encode("utf-8", "surrogatepass")
    except (TypeError, RecursionError) as exc:
        return FAILED, f"{type(exc).__name__}: {exc}".encode()
    return _encoded(out)


def _encoded(out: list[Any]) -> tuple[bytes, bytes]:
    """A program's outputs as its answer: JSON, within MAX_ANSWER_BYTES."""
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
