"""The test suite's watchdog: a test hung past its limit ends the run, with the evidence.

A clean-clone CI run hung once in a fixture teardown (a kube source's ``stop`` waiting
for a task that had swallowed its cancel) and sat idle until the CI's own 90 min limit
killed it, with nothing to show where. A test (setup, call and teardown together) still
running ``KARTA_TEST_TIMEOUT`` seconds (600 by default; 0 turns the watchdog off) after it
started makes the watchdog write every thread's stack (faulthandler) and every pending
asyncio task's await chain, on every event loop not closed, to stderr and to
``karta-test-hang-<pid>.txt`` under the pytest basetemp (``--basetemp``) or the temp
directory, then end the process with ``EXIT_CODE`` (under pytest-xdist, the worker: the
controller reports the test as crashed and the run fails).

pytest-timeout shows the threads only: a hung asyncio teardown is the main thread idle
in ``select`` there, and which task waits for what is the whole question. One thread for
the session, armed and disarmed per test under a lock (no thread per test). The task
stacks are read from the watchdog thread while the loop's thread may run: best effort,
which is enough for a loop that has hung.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import inspect
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

ENV = "KARTA_TEST_TIMEOUT"
DEFAULT_SECONDS = 600.0
#: as timeout(1)'s: the run timed out (pytest's own codes are 0-5)
EXIT_CODE = 124

_KEY = pytest.StashKey["Watchdog"]()


class Watchdog:
    """One daemon thread waiting for the armed test's deadline."""

    def __init__(self, limit: float, report_dir: Path, config: pytest.Config) -> None:
        self.limit = limit
        self.report_dir = report_dir
        self._config = config
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._nodeid = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="test watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self, nodeid: str) -> None:
        with self._cond:
            self._deadline = time.monotonic() + self.limit
            self._nodeid = nodeid
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            # not notified: the thread wakes at the old deadline, finds none and waits on

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                nodeid = self._nodeid
                break
            else:
                return
        self._fire(nodeid)

    def _fire(self, nodeid: str) -> None:
        name = f"karta-test-hang-{os.getpid()}.txt"
        text: str | None = None
        for folder in (self.report_dir, Path(tempfile.gettempdir())):
            path = folder / name
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with path.open("w") as out:
                    write_report(out, self._head(nodeid, path))
                text = path.read_text()
                break
            except OSError:
                continue
        # pytest captures fd 2 around each test: the original stderr back first
        capman = self._config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            try:
                capman.suspend_global_capture(in_=True)
            except Exception as e:  # best effort: the file has it anyway
                sys.stderr.write(f"(pytest's capture not suspended: {e!r})\n")
        if text is None:  # no file could be written: stderr alone
            write_report(sys.stderr, self._head(nodeid, None))
        else:
            sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def _head(self, nodeid: str, path: Path | None) -> str:
        where = f", also in {path}" if path is not None else ""
        return (f"karta test watchdog: {nodeid} still running after {self.limit:g} s "
                f"(setup + call + teardown; {ENV} sets the limit, 0 turns it off); "
                f"every thread's and every asyncio task's stack follow{where}; ending the "
                f"run (exit {EXIT_CODE})\n")


def write_report(out: Any, head: str) -> None:
    """``head``, then every thread's stack, then every pending task's, to ``out`` (a real
    file: faulthandler writes to its descriptor)."""
    out.write(head)
    out.write("\n== threads (faulthandler) ==\n")
    out.flush()
    faulthandler.dump_traceback(out, all_threads=True)
    out.write("\n== asyncio tasks ==\n")
    out.write(task_stacks())
    out.flush()


def task_stacks() -> str:
    """Every pending task of every event loop not closed, each with its await chain
    (outermost coroutine first) and the future it waits on at the bottom."""
    loops = _open_loops()
    if not loops:
        return "(no event loop open)\n"
    parts: list[str] = []
    for loop in loops:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        except RuntimeError as e:  # the set changed size under us too often
            parts.append(f"loop {loop!r}: tasks not read ({e})\n")
            continue
        state = "running" if loop.is_running() else "not running"
        parts.append(f"-- loop {type(loop).__name__} at {id(loop):#x} ({state}): "
                     f"{len(tasks)} pending task(s)\n")
        for task in tasks:
            parts.append(_one_task(task))
    return "".join(parts)


def _open_loops() -> list[asyncio.AbstractEventLoop]:
    """The loops running (the ``self`` of a loop's run frame, in any thread's stack), then
    any other not closed the collector sees. The gc alone missed the hung loop: the proxy
    freezes its heap (``gc.freeze``, at a source's sync), and frozen objects are not in
    ``gc.get_objects()``."""
    found: dict[int, asyncio.AbstractEventLoop] = {}
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_name in ("run_forever", "_run_once"):
                loop = f.f_locals.get("self")
                if isinstance(loop, asyncio.AbstractEventLoop):
                    found.setdefault(id(loop), loop)
            f = f.f_back
    for o in gc.get_objects():
        if isinstance(o, asyncio.AbstractEventLoop):
            found.setdefault(id(o), o)
    return [loop for loop in found.values() if not loop.is_closed()]


def _one_task(task: asyncio.Task[Any]) -> str:
    frames: list[tuple[FrameType, int]] = []
    awaited: object = task.get_coro()
    seen: set[int] = set()
    while awaited is not None and id(awaited) not in seen:
        awaited = _through_asend(awaited)
        if not any(hasattr(awaited, a) for a in ("cr_await", "gi_yieldfrom", "ag_await")):
            break  # a future (or another awaitable): the bottom of the chain
        seen.add(id(awaited))
        frame = (getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
                 or getattr(awaited, "ag_frame", None))
        if frame is not None:
            frames.append((frame, frame.f_lineno))
        awaited = (getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
                   or getattr(awaited, "ag_await", None))
    lines = [f"Task {task.get_name()!r} ({_qualname(task.get_coro())}), await chain "
             f"(outermost first):\n"]
    lines.extend(traceback.StackSummary.extract(iter(frames)).format())
    # the future it waits on (the chain ends in the future's iterator, which says nothing)
    waiting = getattr(task, "_fut_waiter", None) or awaited
    if waiting is not None:
        lines.append(f"  waiting on: {repr(waiting)[:300]}\n")
    return "".join(lines)


def _through_asend(awaited: object) -> object:
    """An async generator's ``__anext__()`` / ``athrow()`` awaitable (an async fixture's
    teardown is awaited so) exposes neither its generator nor a frame: the generator is
    found among what it refers to."""
    if type(awaited).__name__ not in ("async_generator_asend", "async_generator_athrow"):
        return awaited
    for ref in gc.get_referents(awaited):
        if inspect.isasyncgen(ref):
            return ref
    return awaited


def _qualname(coro: object) -> str:
    return str(getattr(coro, "__qualname__", type(coro).__name__))


def _limit() -> float:
    raw = os.environ.get(ENV, "")
    if not raw.strip():
        return DEFAULT_SECONDS
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(f"{ENV}={raw!r}: seconds (a number; 0 turns the watchdog "
                                f"off) expected") from None


def pytest_configure(config: pytest.Config) -> None:
    limit = _limit()
    if limit <= 0:
        return
    base = config.option.basetemp
    report_dir = Path(base) if base else Path(tempfile.gettempdir())
    dog = Watchdog(limit, report_dir, config)
    dog.start()
    config.stash[_KEY] = dog


def pytest_unconfigure(config: pytest.Config) -> None:
    dog = config.stash.get(_KEY, None)
    if dog is not None:
        dog.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, object, object]:
    dog = item.config.stash.get(_KEY, None)
    if dog is not None:
        dog.arm(item.nodeid)
    try:
        return (yield)
    finally:
        if dog is not None:
            dog.disarm()
