"""The native splice built with AddressSanitizer and UndefinedBehaviorSanitizer, then run
under the fuzz driver and the native tests.

Why: the plain build's fuzz run (``test_native_fuzz.py``) catches a crash, a wrong answer
and a leak, but not a read a few bytes past a buffer, a use after free or undefined
behaviour (a signed overflow, an over-wide shift) that happens to do no harm on this
machine with this compiler. A request is sender-controlled bytes; here any of those
stops the run with the sanitizer's report instead.

How: ``proxy/`` and ``tests/`` are copied to a temporary tree and the extension is built
there with the sanitizers (the tree's own build stays as it is), so the subprocesses,
started in the copy, import the sanitized ``proxy.wire._splice``. The interpreter is not
sanitized: its sanitizer runtimes are preloaded, and ``PYTHONMALLOC=malloc`` makes every
Python object a ``malloc`` of its own, so ASan's red zones sit right behind each bytes
object's data (a read past a request's end is caught, not lost inside obmalloc's
arenas). Leaks are left to the plain build's RSS checks: LeakSanitizer cannot tell the
interpreter's objects still alive at exit from a leak.

``KARTA_SANITIZED_FUZZ_SECONDS`` sets the fuzz budget (default 30; the sanitized build runs
about half as fast as the plain one). Skipped where gcc or its sanitizer runtimes are
missing (Debian's gcc brings both).

The fuzz run and the native tests (in two pytest runs of about equal length) are started
together when the build is ready, two at a time: the test process only waits for them, so
on two cores they take about half the time they take one after the other (measured: 148 s
one after the other, about 70 s two at a time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from proxy.wire.native import native_available

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
#: what a report looks like, from either sanitizer
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: UndefinedBehaviorSanitizer")
#: the tests run again on the sanitized build: the native ones (the fuzz driver's own
#: test and the Python splice's alone add nothing here), and the request path around the
#: extension (the thread's scratch buffer it reads, requests in parts on other threads,
#: the worker threads, bodies cut or refused mid-way); the native RW 2.0 -> 1.0
#: conversion's differential tests. In two runs: the first follows the fuzz run, the
#: second runs beside both (two at a time: the fuzz run 31 s, then the first 37 s; the
#: second 67 s)
NATIVE_TESTS = (
    ("tests/test_connection_guard.py", "tests/test_admission.py",
     "tests/wire/test_native_differential.py"),
    ("tests/wire/test_native.py", "tests/wire/test_convert_native.py", "tests/test_handler.py",
     "tests/wire/test_native_threads.py", "tests/wire/test_snappy_edit.py",
     "tests/wire/test_halves.py", "tests/wire/test_splice.py", "tests/wire/test_convert.py",
     "tests/test_compression.py", "tests/test_part_threads.py"),
)


def _runtime(name: str) -> str | None:
    """The path of gcc's sanitizer runtime ``lib<name>.so``, or None when it has none
    (gcc then prints the bare name back)."""
    out = subprocess.run(["gcc", f"-print-file-name=lib{name}.so"], capture_output=True,
                         text=True, check=False).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


class Sanitized:
    """A copy of the tree with the sanitized extension, and how to run Python in it."""

    def __init__(self, root: Path, runtimes: list[str]) -> None:
        self.root = root
        self.env = dict(
            os.environ,
            LD_PRELOAD=" ".join(runtimes),
            ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:exitcode=86",
            UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87",
            PYTHONMALLOC="malloc",
            PYTHONFAULTHANDLER="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        #: the processes under way, ended by their PID if the module ends before them
        self.running: set[subprocess.Popen[str]] = set()

    def run(self, args: list[str], timeout: float, **env: str
            ) -> subprocess.CompletedProcess[str]:
        with subprocess.Popen([sys.executable, *args], cwd=self.root, env=self.env | env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            self.running.add(proc)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            finally:
                self.running.discard(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def end(self) -> None:
        for proc in list(self.running):
            proc.kill()


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-12000:]}")


def _clean(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, _report(proc)
    found = [r for r in REPORTS if r in proc.stderr]
    assert not found, f"sanitizer report ({found})\n{_report(proc)}"


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> Sanitized:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc: the sanitized build needs it")
    runtimes = [_runtime("asan"), _runtime("ubsan")]
    if None in runtimes:
        pytest.skip("gcc has no ASan/UBSan runtime here")
    root = tmp_path_factory.mktemp("sanitized")
    skip = shutil.ignore_patterns("*.so", "__pycache__", ".hypothesis", "*.egg-info")
    for part in ("proxy", "tests"):
        shutil.copytree(ROOT / part, root / part, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    env = dict(os.environ, CFLAGS=FLAGS, LDFLAGS="-fsanitize=address,undefined")
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
    assert built.returncode == 0, _report(built)
    tree = Sanitized(root, [r for r in runtimes if r is not None])
    probe = tree.run(["-c", "import proxy.wire._splice as s; print(s.__file__)"], timeout=60)
    _clean(probe)
    assert probe.stdout.strip().startswith(str(root)), probe.stdout  # the copy's build
    return tree


def test_the_sanitizers_report_a_read_past_a_buffer(sanitized: Sanitized) -> None:
    """The set-up catches what it is for: a read 8 bytes past a bytes object's data (a
    red zone right behind it, with PYTHONMALLOC=malloc) stops the process with a report."""
    proc = sanitized.run(["-c", "import ctypes; b = ctypes.create_string_buffer(64); "
                                "ctypes.string_at(ctypes.addressof(b), 72)"], timeout=60)
    assert proc.returncode == 86, _report(proc)
    assert "heap-buffer-overflow" in proc.stderr, _report(proc)


class Runs:
    """The fuzz run and the two runs of the native tests, two at a time in that order:
    the fuzz run and the second tests' run start at once, the first tests' run when the
    fuzz run ends."""

    def __init__(self, tree: Sanitized, pool: ThreadPoolExecutor) -> None:
        seconds = os.environ.get("KARTA_SANITIZED_FUZZ_SECONDS", "30")
        seed = os.environ.get("KARTA_FUZZ_SEED", "1")
        # every other valid input as a snappy edit too; no RSS checks (ASan holds freed
        # memory in quarantine, and the plain build's run checks leaks)
        fuzz = ["tests/wire/fuzz_native.py", "--seconds", seconds, "--seed", seed,
                "--edit-every", "2", "--leak-calls", "0", "--rss-limit-mb", "1e9",
                "--crash-file", str(tree.root / "last-input.bin")]
        # the differential properties at a quarter of their examples: the sanitized build
        # is slower, and the plain run covers the full count; each run in one process
        # (not pyproject's two workers: the two runs already take both cores)
        first, second = (["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *files]
                         for files in NATIVE_TESTS)
        later = pool.submit(tree.run, second, 1200, KARTA_DIFF_SCALE="0.25")
        self.fuzz = pool.submit(tree.run, fuzz, float(seconds) + 600)
        sooner = pool.submit(tree.run, first, 1200, KARTA_DIFF_SCALE="0.25")
        self.tests: list[Future[subprocess.CompletedProcess[str]]] = [sooner, later]


@pytest.fixture(scope="module")
def runs(sanitized: Sanitized) -> Iterator[Runs]:
    pool = ThreadPoolExecutor(2, thread_name_prefix="sanitized-run")
    try:
        yield Runs(sanitized, pool)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        sanitized.end()  # what a failed test left running
        pool.shutdown(wait=True)


def test_fuzz_run_on_the_sanitized_build(runs: Runs) -> None:
    proc = runs.fuzz.result()
    _clean(proc)
    assert "fuzz: OK" in proc.stdout, _report(proc)
    print(proc.stdout)


def test_native_tests_on_the_sanitized_build(runs: Runs) -> None:
    for run in runs.tests:
        proc = run.result()
        _clean(proc)
        print(proc.stdout[-2000:])
