"""The suite's watchdog (tests/watchdog.py), in pytest runs of its own: a test hung in an
async fixture's teardown ends the run at the limit with the hung task's stack; tests each
under the limit are left alone however long the run; a wrong setting is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.watchdog import ENV, EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]

HANGS = '''
import asyncio
import gc

import pytest


@pytest.fixture
async def stuck_in_teardown():
    gc.freeze()  # as a kube source's sync does: the loop no longer in gc.get_objects()
    yield
    await asyncio.Event().wait()  # never set


async def test_hangs_after_it_passed(stuck_in_teardown):
    pass
'''

SLOW = '''
import asyncio

import pytest


@pytest.mark.parametrize("n", range(3))
async def test_under_the_limit(n):
    await asyncio.sleep(0.8)
'''


def run(tmp_path: Path, source: str, limit: str, timeout: float = 60.0
        ) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    (tmp_path / "test_it.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env[ENV] = limit
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "tests.watchdog", f"--basetemp={tmp_path / 'base'}", "test_it.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - t0


def test_a_hung_async_teardown_ends_the_run_with_its_tasks_stack(tmp_path: Path) -> None:
    done, took = run(tmp_path, HANGS, "3")
    assert done.returncode == EXIT_CODE, done.stdout + done.stderr
    assert took < 30
    err = done.stderr
    assert "test_it.py::test_hangs_after_it_passed still running after 3 s" in err
    assert "== threads (faulthandler) ==" in err and "Thread 0x" in err
    # the hung task's await chain, down to the fixture's line and what it waits on
    assert "in stuck_in_teardown" in err and "await asyncio.Event().wait()" in err
    assert "waiting on: <Future pending" in err
    (report,) = (tmp_path / "base").glob("karta-test-hang-*.txt")
    assert "in stuck_in_teardown" in report.read_text()


def test_tests_each_under_the_limit_are_left_alone(tmp_path: Path) -> None:
    """2.4 s of tests under a 2 s limit: the limit is per test, armed for each."""
    done, _ = run(tmp_path, SLOW, "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout and "watchdog" not in done.stderr


def test_a_limit_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    done, _ = run(tmp_path, SLOW, "ten minutes")
    assert done.returncode == 4  # pytest's usage error
    assert f"{ENV}='ten minutes'" in done.stderr
