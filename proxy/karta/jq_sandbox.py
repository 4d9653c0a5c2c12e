"""The jq sandbox: descriptions' expressions evaluated in a child process, bounded in time
and memory.

libjq can be neither interrupted nor bounded in memory in-process, and it aborts the
process when an allocation fails. The load-time refusals (``proxy.karta.description``)
take away the known loops, not every way an expression can cost without bound
(docs/karta.md): a pipeline doubling a string, a backtracking regular expression on a
pod's annotation. :class:`JqSandbox` is a :class:`~proxy.karta.jqexpr.JqRunner` that
hands each evaluation (the program's source, the input's JSON text) to one persistent
child (``jq_child.py`` run as an isolated script) over pipes, and waits for the answer until a
deadline:

- past the deadline, the child is killed (SIGKILL) and reaped, and the evaluation is a
  :class:`JqError` ("exceeded the 1 s limit");
- a child that dies during an evaluation (libjq's abort at the memory limit, the CPU
  backstop, anything) is reaped, and the evaluation is a :class:`JqError` naming its
  exit status or signal;
- either way the next evaluation starts a fresh child (a child found dead between
  evaluations is replaced without an error);
- an expression that did either three times within an hour is quarantined for an hour:
  its evaluations are a :class:`JqError` at once, the child untouched, so a hostile
  description costs the event loop about three timeouts an hour, not one per object
  event. An edited description (another source text) starts with a clean record, and so
  does a quarantined expression when its hour is over;
- a timeout counts against the expression only when the child spent the time on it: a
  child that used less than half the time in CPU (stopped, throttled, paging) is
  restarted without a strike.

An error that is not the expression's doing (a child held up, or killed by SIGKILL: the
kernel's OOM killer, an operator; a child that cannot start; an expression not reached
in its object's time limit) carries ``retry_after`` 0, a quarantine's the seconds left of
it (:class:`~proxy.karta.jqexpr.JqError`): the engine evaluates such an object again
then, not at its next event only.

The time limit is one per input (:meth:`JqSandbox.run_many`: a workload object's
expressions share it), so one object event holds the loop about one limit at most (plus
the kill and restart), and an input over a sixteenth of the memory limit is refused
before it is sent.

The outputs are those of the in-process evaluation: the child runs the same binding and
sends them as JSON (Python's encoding and decoding keep ints, floats, key order), and a
jq runtime error is the same :class:`JqError` with the same message. The caller's
thread blocks for the evaluation, as it did in-process (~100 us an evaluation on a pod
against ~42 us in-process: docs/performance.md). Two threads call it (the event loop,
and the one preparing heavy objects' facts: ``proxy.kube.heavy_objects``): a lock keeps
one call (one object's evaluation) at a time, and guards the child and the strikes.
:meth:`JqSandbox.run_many` evaluates several expressions on one input in one round trip
(a workload object's status, id and scale paths: ``jqexpr.Evaluated``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, cast

from proxy.karta.jq_child import FAILED, HELLO, JQ_ERROR, MAX_ANSWER_BYTES, OK
from proxy.karta.jqexpr import JqError, JqExpr, jq_runtime_error, note_wait

log = logging.getLogger(__name__)

#: the ``reason`` values of the restart counter, every one present from the start
RESTART_REASONS: Final = ("timeout", "died", "start_failed")
#: evaluations of one expression that hit the time limit or took the child down before it
#: is quarantined
QUARANTINE_STRIKES: Final = 3
#: how long a strike is remembered, and how long a quarantine lasts, seconds
QUARANTINE_SECONDS: Final = 3600.0
#: a timeout strikes the expression only when the child used at least this share of the
#: time it was given in CPU (less: the machine or the child was held up)
STRIKE_CPU_SHARE: Final = 0.5
#: the largest input sent is the memory limit divided by this (16 MiB at 256 MiB): the
#: child holds its text and parsed value (once a request, or once per expression when
#: they run alone) within its memory limit
INPUT_SHARE_OF_MEMORY: Final = 16
#: how long a starting child may take to say hello (an interpreter and libjq loading)
START_SECONDS: Final = 10.0
#: after a failed start, evaluations fail at once for this long before the next try (a
#: start per object event would hold the loop for every pod)
START_RETRY_SECONDS: Final = 5.0
#: at most one warning about restarts per this many seconds (the others counted in it)
WARN_EVERY_SECONDS: Final = 10.0
#: the CPU backstop's margin over the time limit, seconds (the child's RLIMIT_CPU)
CPU_BACKSTOP_MARGIN: Final = 2
#: how much of an expression a log line or an error shows
_SHOWN: Final = 200

_HEADER_LEN = 4


def _clip(source: str) -> str:
    return source if len(source) <= _SHOWN else source[:_SHOWN] + "..."


def _seconds(s: float) -> str:
    return f"{s:g} s"


def _duration(s: float) -> str:
    return f"{s / 3600:g} h" if s >= 3600 else _seconds(s)


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time process ``pid`` used so far (``/proc/<pid>/schedstat``'s first field,
    ns; else ``/proc/<pid>/stat``'s utime and stime, clock ticks), None if unreadable."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _child_command() -> list[str]:
    """The child's command: this interpreter isolated (``-I``: no environment variable,
    no user site, no script folder on the path) and without ``site`` (``-S``), running
    ``jq_child.py`` as a script, so it imports the standard library and libjq's binding
    only (its folder given as an argument), not the proxy's package: 5.7 MB of private
    memory where ``-m proxy.karta.jq_child`` took 9.3 MB (``importlib.metadata`` and
    ``site`` loaded for nothing)."""
    import jq

    from proxy.karta import jq_child

    return [sys.executable, "-I", "-S", jq_child.__file__,
            str(Path(jq.__file__).resolve().parent)]


def _child_env() -> dict[str, str]:
    """The proxy's environment without ``LD_PRELOAD``: a library preloaded into the proxy
    (an allocator, a sanitizer's runtime) has no business in the child, and one that
    reserves address space at start (AddressSanitizer's shadow memory) cannot start under
    the child's ``RLIMIT_AS`` (exit 86, ``Failed to mmap``: every evaluation a jq error in
    the sanitized test run)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _status_text(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGABRT:
            return (f"killed by {name}; libjq aborts when an allocation fails, as at the "
                    "memory limit, karta.jq_memory_limit_bytes")
        if -returncode == signal.SIGXCPU:
            return f"killed by {name}, the CPU backstop"
        return f"killed by {name}"
    if returncode == 3:
        return "exit status 3, out of memory: karta.jq_memory_limit_bytes"
    return f"exit status {returncode}"


class _Stopped(Exception):
    """The transaction ended without an answer: ``reason`` is ``timeout`` or ``died``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NoChild(Exception):
    """No child runs and none can start now: the message says why."""


class _Child:
    """One running child and its pipes (the parent's ends non-blocking)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.w = proc.stdin.fileno()
        self.r = proc.stdout.fileno()
        self.err = proc.stderr.fileno()
        for fd in (self.w, self.r, self.err):
            os.set_blocking(fd, False)
        self.poll_r = select.poll()
        self.poll_r.register(self.r, select.POLLIN)
        self.poll_w = select.poll()
        self.poll_w.register(self.w, select.POLLOUT)
        #: bytes read past the last frame returned (the next answers of a batch)
        self._buf = bytearray()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait(self, poller: select.poll, deadline: float) -> None:
        """Until the pipe is ready or the deadline passed (``_Stopped("timeout")``)."""
        left = deadline - time.monotonic()
        ready = left > 0 and poller.poll(math.ceil(left * 1000))
        if not ready and time.monotonic() >= deadline:
            raise _Stopped("timeout")

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.w, view):]
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise _Stopped("died") from None
            if view:
                self._wait(self.poll_w, deadline)

    def receive(self, deadline: float) -> bytes:
        """One frame's payload. The child answers a batch frame after frame: what a read
        takes beyond this frame is kept for the next (``_buf``)."""
        buf = self._buf
        want = _HEADER_LEN
        header = True
        while True:
            if len(buf) >= want:
                if header:
                    size = int.from_bytes(buf[:_HEADER_LEN], "big")
                    if size > MAX_ANSWER_BYTES + 1:
                        raise _Stopped("died")  # out of step
                    want, header = _HEADER_LEN + size, False
                    continue
                payload = bytes(buf[_HEADER_LEN:want])
                del buf[:want]
                return payload
            try:
                chunk = os.read(self.r, max(1 << 16, want - len(buf)))
            except BlockingIOError:
                self._wait(self.poll_r, deadline)
                continue
            if not chunk:
                raise _Stopped("died")
            buf += chunk

    def stderr_tail(self) -> str:
        """The last line the child wrote on stderr (libjq's or Python's last words)."""
        data = b""
        with contextlib.suppress(OSError):
            while len(data) < 1 << 16:
                chunk = os.read(self.err, 1 << 16)
                if not chunk:
                    break
                data += chunk
        lines = data.decode("utf-8", "replace").strip().splitlines()
        return lines[-1][:300] if lines else ""

    def kill(self) -> None:
        """SIGKILL and reap (no zombie: the proxy may be PID 1 in its image)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in the kernel: reaped by a later poll
            _unreaped.append(self.proc)
        self.close_pipes()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


#: children SIGKILLed that did not end within 5 s: reaped when they do
_unreaped: list[subprocess.Popen[bytes]] = []


def _reap_late() -> None:
    _unreaped[:] = [p for p in _unreaped if p.poll() is None]


def request_frame(sources: Sequence[str], body: bytes) -> bytes:
    """The child's request (``jq_child``'s protocol): the programs' sources, then the
    input's JSON text, as one frame."""
    srcs = [source.encode("utf-8", "surrogatepass") for source in sources]
    parts = [len(srcs).to_bytes(_HEADER_LEN, "big"),
             *(p for src in srcs for p in (len(src).to_bytes(_HEADER_LEN, "big"), src)),
             body]
    size = sum(map(len, parts))
    return b"".join((size.to_bytes(_HEADER_LEN, "big"), *parts))


def _outcome(source: str, answer: bytes) -> list[Any] | JqError:
    """An answer of the child: the outputs, or the evaluation's :class:`JqError`."""
    status, payload = answer[:1], answer[1:]
    if status == OK:
        try:
            out: list[Any] = json.loads(payload)
        except RecursionError:
            return JqError(f"{source!r}: its outputs are nested too deeply to be decoded")
        return out
    message = payload.decode("utf-8", "surrogatepass")
    if status == JQ_ERROR:
        return jq_runtime_error(source, message)
    if status == FAILED:
        return JqError(f"{source!r}: {message}")
    return JqError(f"{source!r}: the jq sandbox child answered out of protocol")


class JqSandbox:
    """Evaluates expressions in a child process with a time and a memory limit
    (a :class:`~proxy.karta.jqexpr.JqRunner`)."""

    def __init__(self, *, timeout_seconds: float = 1.0,
                 memory_limit_bytes: int = 256 << 20,
                 command: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``command``: what starts a child (tests give one that cannot start);
        ``clock``: what strikes and quarantines are dated by (tests move it)."""
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        self.timeout_seconds = timeout_seconds
        self.memory_limit_bytes = memory_limit_bytes
        self._command = command
        #: one call (one object's evaluation) at a time: the child is one; held for the
        #: whole round trip (up to the time limit)
        self._lock = threading.Lock()
        #: the strikes and quarantines alone (taken under ``_lock`` or without it, never
        #: the other way round): the gauge, read by a /metrics scrape on the event loop,
        #: must not wait for an evaluation in the heavy objects' thread (~160-250 ms a
        #: heavy object, up to the time limit), which is what that thread spares the loop
        self._marks = threading.Lock()
        self._child: _Child | None = None
        #: restarts by reason (``RESTART_REASONS``)
        self.restarts: dict[str, int] = dict.fromkeys(RESTART_REASONS, 0)
        self._clock = clock
        #: seconds the callers waited for the sandbox (run, run_many)
        self.seconds_total = 0.0
        #: expression source -> when its evaluations hit the time limit or took the child
        #: down, within the last QUARANTINE_SECONDS
        self._strikes: dict[str, list[float]] = {}
        #: expression source -> when its quarantine ends
        self._quarantined: dict[str, float] = {}
        self._no_start_until = 0.0
        self._start_error = ""
        self._warned_at = -math.inf
        self._unwarned = 0
        #: set by :meth:`close`: no child is started after it
        self._closed = False

    # -- settings, state -------------------------------------------------------------------

    def configure(self, *, timeout_seconds: float, memory_limit_bytes: int) -> None:
        """New limits (a reload): the child in place, started with the old ones (its
        memory limit, its CPU backstop), is ended; the next evaluation starts one with
        these."""
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        with self._lock:
            if (timeout_seconds, memory_limit_bytes) == (self.timeout_seconds,
                                                         self.memory_limit_bytes):
                return
            self.timeout_seconds = timeout_seconds
            self.memory_limit_bytes = memory_limit_bytes
            self._end_child()

    def quarantined(self) -> int:
        """Expressions quarantined now (the gauge); never waits for an evaluation."""
        with self._marks:
            self._expire()
            return len(self._quarantined)

    def is_quarantined(self, source: str) -> bool:
        with self._marks:
            self._expire()
            return source in self._quarantined

    def _expire(self) -> None:
        """Quarantines over and strikes older than QUARANTINE_SECONDS forgotten: the
        expression starts with a fresh record. Under ``_marks``."""
        now = self._clock()
        for source in [s for s, until in self._quarantined.items() if until <= now]:
            del self._quarantined[source]
            self._strikes.pop(source, None)
        since = now - QUARANTINE_SECONDS
        for source in list(self._strikes):
            kept = [t for t in self._strikes[source] if t > since]
            if kept:
                self._strikes[source] = kept
            else:
                del self._strikes[source]

    @property
    def child_pid(self) -> int | None:
        """The running child's pid, None when there is none."""
        child = self._child
        return child.pid if child is not None else None

    def close(self) -> None:
        """End the child (kill and reap), for good: a later evaluation starts none and
        fails (retry_after 0). The heavy objects' thread may enter after the stop closed
        the sandbox (its evaluation under way ends with the source's stop, unawaited):
        a child started then outlived the proxy's pipes, unreaped."""
        with self._lock:
            self._closed = True
            self._end_child()
            _reap_late()

    def reap_idle(self) -> bool:
        """Reap the idle child if it has died (killed from outside, the OOM killer):
        counted (``died``) and logged once, here, not left a zombie until the next
        evaluation, which starts a fresh one; True if it had. Never waits: while an
        evaluation runs, the evaluation sees the death itself. Call periodically (the
        runtime's housekeeping does, every :data:`proxy.runtime.JQ_HOUSEKEEPING_SECONDS`)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            _reap_late()
            child = self._child
            if child is None or child.proc.poll() is None:  # poll: waitpid(WNOHANG)
                return False
            self._forget_dead(child)
            return True
        finally:
            self._lock.release()

    def _forget_dead(self, child: _Child) -> None:
        """A child found dead between evaluations (reaped by the caller's poll)."""
        self._child = None
        self.restarts["died"] += 1
        self._warn(f"the jq sandbox child (pid {child.pid}) had died "
                   f"({_status_text(child.proc.returncode)}) while idle; the next "
                   "evaluation starts another", child.stderr_tail())
        child.close_pipes()

    def _end_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None

    # -- evaluation ------------------------------------------------------------------------

    def run(self, expr: JqExpr, text: str) -> list[Any]:
        [out] = self.run_many((expr,), text)
        if isinstance(out, JqError):
            raise out
        return out

    def run_many(self, exprs: Sequence[JqExpr], text: str) -> list[list[Any] | JqError]:
        """Under the lock for the whole call: the engine's thread evaluates a heavy
        object's facts (``proxy.kube.heavy_objects``) while the event loop evaluates
        others, and the child, the strikes and the quarantines are one state. One call is
        one object, so the loop waits at most for one object's evaluation, as it did
        when it made that evaluation itself."""
        asked = time.monotonic()
        with self._lock:
            started = time.monotonic()
            note_wait(started - asked)  # no weight of the object's (Engine.heavy)
            try:
                return self._run_many(exprs, text)
            finally:
                self.seconds_total += time.monotonic() - started

    def _run_many(self, exprs: Sequence[JqExpr], text: str) -> list[list[Any] | JqError]:
        """Each expression's outputs on one input, or its :class:`JqError`, in one round
        trip, within one time limit for them all (the deadline set at the send): the
        child answers each as it is done, so the one running when the deadline passes is
        the one struck (if the child spent the time on it), and the ones after it are
        not evaluated (a :class:`JqError` each, no strike). After a child that died,
        the ones after are sent to a fresh child, within what is left of the limit."""
        results: list[list[Any] | JqError | None] = [None] * len(exprs)
        todo = []
        with self._marks:
            self._expire()
            untils = [self._quarantined.get(expr.source) for expr in exprs]
        now = self._clock()
        for i, (expr, until) in enumerate(zip(exprs, untils, strict=True)):
            if until is not None:
                results[i] = JqError(
                    f"{expr.source!r}: quarantined for {_duration(QUARANTINE_SECONDS)} after "
                    f"{QUARANTINE_STRIKES} evaluations that exceeded the time limit "
                    "(karta.jq_timeout_seconds) or took the jq sandbox child down; not "
                    "evaluated until then (or until the expression's text changes)",
                    retry_after=max(0.0, until - now))
            else:
                todo.append(i)
        body = text.encode("utf-8", "surrogatepass")
        limit = self.memory_limit_bytes // INPUT_SHARE_OF_MEMORY
        if todo and len(body) > limit:
            for i in todo:
                results[i] = JqError(
                    f"{exprs[i].source!r}: not evaluated: the object's JSON text is "
                    f"{len(body)} bytes, over the {limit} bytes the jq sandbox takes "
                    f"(karta.jq_memory_limit_bytes / {INPUT_SHARE_OF_MEMORY})")
            todo = []
        deadline: float | None = None
        stopped: str | None = None
        while todo:
            request = request_frame([exprs[i].source for i in todo], body)
            try:
                child = self._ready_child()
            except _NoChild as e:  # every one of them fails alike
                for i in todo:
                    err = results[i] = JqError(f"{exprs[i].source!r}: {e}",
                                               retry_after=0.0)
                    err.__cause__ = e.__cause__
                todo = []
                break
            timeout = self.timeout_seconds
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now >= deadline:
                break  # after a child that died: the limit is spent
            given = deadline - now
            cpu_start = _cpu_seconds(child.pid)
            done = 0
            source = exprs[todo[0]].source  # a send cut off strikes the first
            try:
                child.send(request, deadline)
                for i in todo:
                    source = exprs[i].source
                    results[i] = _outcome(source, child.receive(deadline))
                    done += 1
            except _Stopped as stop:
                stopped = stop.reason
                cpu = None
                if stop.reason == "timeout" and cpu_start is not None:
                    cpu_end = _cpu_seconds(child.pid)
                    cpu = None if cpu_end is None else cpu_end - cpu_start
                results[todo[done]] = self._stopped(source, child, stop.reason,
                                                    timeout, given, cpu)
                done += 1
            todo = todo[done:]
            if stopped == "timeout":
                break
        for i in todo:
            results[i] = JqError(
                f"{exprs[i].source!r}: not evaluated: the object's time limit "
                "(karta.jq_timeout_seconds) was spent by the expressions before it",
                retry_after=0.0)
        assert all(r is not None for r in results)
        return cast("list[list[Any] | JqError]", results)

    def _ready_child(self) -> _Child:
        """The running child, or a new one; :class:`_NoChild` when none can start."""
        if self._closed:
            raise _NoChild("the jq sandbox is closed (the proxy is stopping)")
        child = self._child
        if child is not None:
            if child.proc.poll() is None:
                return child
            self._forget_dead(child)  # replaced below, no error
        now = time.monotonic()
        if now < self._no_start_until:
            raise _NoChild(f"the jq sandbox child cannot start ({self._start_error}); "
                           f"next try in {self._no_start_until - now:.1f} s")
        try:
            self._child = self._start()
        except Exception as e:
            self.restarts["start_failed"] += 1
            self._start_error = str(e)
            self._no_start_until = time.monotonic() + START_RETRY_SECONDS
            log.error("the jq sandbox child cannot start; jq evaluations fail until it "
                      "does (next try in %s)", _seconds(START_RETRY_SECONDS),
                      extra={"error": self._start_error})
            raise _NoChild(f"the jq sandbox child cannot start ({self._start_error})") from e
        return self._child

    def _start(self) -> _Child:
        _reap_late()
        cpu = math.ceil(self.timeout_seconds) + CPU_BACKSTOP_MARGIN
        command = self._command or _child_command()
        try:
            proc = subprocess.Popen(
                [*command, str(self.memory_limit_bytes), str(cpu)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                bufsize=0, close_fds=True, cwd="/", env=_child_env(),
                # its own session: a terminal's Ctrl-C reaches the proxy, which ends it
                start_new_session=True)
        except OSError as e:
            raise RuntimeError(f"cannot run {command[0]}: {e}") from e
        child = _Child(proc)
        try:
            hello = child.receive(time.monotonic() + START_SECONDS)
        except _Stopped as stop:
            tail = child.stderr_tail() if stop.reason == "died" else ""
            child.kill()
            if stop.reason == "timeout":
                raise RuntimeError(f"no hello within {_seconds(START_SECONDS)}") from None
            raise RuntimeError(f"it ended at start ({_status_text(proc.returncode)})"
                               + (f": {tail}" if tail else "")) from None
        if hello != HELLO:
            child.kill()
            raise RuntimeError(f"unexpected hello {hello[:40]!r}")
        return child

    def _stopped(self, source: str, child: _Child, reason: str, timeout: float,
                 given: float, cpu: float | None) -> JqError:
        """The child that did not answer is ended; the error for the evaluation.
        ``given``: the seconds the child had for the request; ``cpu``: the CPU seconds it
        used in them (a timeout), None when unknown (then the expression is struck)."""
        tail = child.stderr_tail() if reason == "died" else ""
        child.kill()
        self._child = None
        self.restarts[reason] += 1
        stalled = cpu is not None and cpu < STRIKE_CPU_SHARE * given
        if reason == "timeout":
            what = (f"jq evaluation exceeded the {_seconds(timeout)} limit "
                    "(karta.jq_timeout_seconds); the child was restarted")
            if stalled:
                assert cpu is not None
                what += (f"; the child used only {cpu:.3f} s of CPU in the {given:.3f} s: the "
                         "machine or the child was held up; not counted against the "
                         "expression")
        else:
            what = (f"the jq sandbox child died during the evaluation "
                    f"({_status_text(child.proc.returncode)}); it was restarted")
        self._warn(f"{what}: {_clip(source)!r}", tail)
        if not stalled:
            self._strike(source)
        # not the expression's doing, as far as can be told: a child held up, or killed by
        # SIGKILL, which is no limit of the child's own (the kernel's OOM killer, someone)
        transient = stalled or (reason == "died" and child.proc.returncode == -signal.SIGKILL)
        return JqError(f"{source!r}: {what}", retry_after=0.0 if transient else None)

    def _strike(self, source: str) -> None:
        with self._marks:
            self._expire()
            now = self._clock()
            strikes = self._strikes.setdefault(source, [])
            strikes.append(now)
            count = len(strikes)
            quarantine = count >= QUARANTINE_STRIKES and source not in self._quarantined
            if quarantine:
                self._quarantined[source] = now + QUARANTINE_SECONDS
        if quarantine:
            log.error("jq expression quarantined: %d evaluations within %s exceeded the "
                      "time limit or took the jq sandbox child down; its evaluations are "
                      "jq errors for %s (or until its text changes)", count,
                      _duration(QUARANTINE_SECONDS), _duration(QUARANTINE_SECONDS),
                      extra={"expression": _clip(source)})

    def _warn(self, message: str, stderr_tail: str) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_SECONDS:
            self._unwarned += 1
            return
        extra: dict[str, Any] = {"restarts": dict(self.restarts)}
        if self._unwarned:
            extra["not_logged_since_last"] = self._unwarned
        if stderr_tail:
            extra["child_stderr"] = stderr_tail
        log.warning(message, extra=extra)
        self._warned_at, self._unwarned = now, 0
