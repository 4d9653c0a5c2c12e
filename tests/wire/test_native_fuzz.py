"""A bounded fuzz run of the native splice, in a subprocess (``fuzz_native.py``): a crash
kills that process, never the test run, and is reported with the input that caused it.

``KARTA_FUZZ_SECONDS`` sets the fuzz loop's budget (default 60; the fixed-input leak
check runs after it, a few seconds more); ``KARTA_FUZZ_SEED`` the seed (default 1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import cramjam
import pytest

from proxy.wire.native import native_available
from tests.wire.fuzz_native import CONVERTING, CrashFile

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

DRIVER = Path(__file__).with_name("fuzz_native.py")
ROOT = DRIVER.parents[2]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")  # a crash prints the Python stack
    return subprocess.run([sys.executable, str(DRIVER), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _crash_report(crash_file: Path, seed: str) -> str:
    got = CrashFile.read(crash_file) if crash_file.exists() else None
    if got is None:
        return "no input recorded"
    block = "" if got.block is None else (
        f"\nits output as a snappy block made from this one ({len(got.block)} bytes):\n"
        f"{got.block.hex()}")
    if got.version == CONVERTING:
        return (f"input being converted to RW 1.0, {len(got.raw)} bytes:\n{got.raw.hex()}\n"
                f"replay: python {DRIVER.relative_to(ROOT)} --seed {seed} --replay {crash_file}")
    return (f"input being spliced: RW {got.version}.0, setup #{got.setup}, "
            f"{len(got.raw)} bytes:\n{got.raw.hex()}{block}\n"
            f"replay: python {DRIVER.relative_to(ROOT)} --seed {seed} --replay {crash_file}")


def test_fuzz_native(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KARTA_FUZZ_SECONDS", "60"))
    seed = os.environ.get("KARTA_FUZZ_SEED", "1")
    crash_file = tmp_path / "last-input.bin"
    proc = _run(["--seconds", str(seconds), "--seed", seed, "--crash-file", str(crash_file)],
                timeout=seconds + 300)
    out = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the native splice CRASHED ({name}) during the fuzz run (seed {seed})\n"
                    f"{_crash_report(crash_file, seed)}\n{out}")
    assert proc.returncode == 0, f"fuzz run failed (exit {proc.returncode}, seed {seed})\n{out}"
    assert "fuzz: OK" in proc.stdout, out
    print(proc.stdout)


#: one series: namespace="ml", pod="p1"
ONE_SERIES = bytes.fromhex("0a1c0a0f0a096e616d65737061636512026d6c0a090a03706f6412027031")


def test_replay_of_a_recorded_input(tmp_path: Path) -> None:
    """The crash file round-trips: what the driver records, ``--replay`` re-runs."""
    crash_file = tmp_path / "input.bin"
    rec = CrashFile(crash_file)
    rec.record(1, 0, ONE_SERIES)
    rec.map.flush()
    proc = _run(["--seed", "1", "--replay", str(crash_file)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replay: RW 1.0" in proc.stdout
    assert "the edit" not in proc.stdout
    got = CrashFile.read(crash_file)
    assert got is not None and (got.version, got.raw, got.block) == (1, ONE_SERIES, None)


@pytest.mark.parametrize("damaged", [False, True])
def test_replay_of_a_recorded_edit(tmp_path: Path, damaged: bool) -> None:
    """A crash in the snappy edit leaves the sender's block beside the request; the
    replay runs the edit of that block again (a damaged block: never a crash, used or
    not; a true one: its output must decode to the splice's body)."""
    crash_file = tmp_path / "input.bin"
    block = bytes(cramjam.snappy.compress_raw(ONE_SERIES))
    if damaged:
        block = block[:-3]
    rec = CrashFile(crash_file)
    rec.record(1, 0, ONE_SERIES, block)
    rec.map.flush()
    got = CrashFile.read(crash_file)
    assert got is not None and (got.raw, got.block) == (ONE_SERIES, block)
    proc = _run(["--seed", "1", "--replay", str(crash_file)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the edit of block {block.hex()}" in proc.stdout
    assert "edit: OK" in proc.stdout


def test_replay_of_a_recorded_conversion(tmp_path: Path) -> None:
    """A crash while converting to RW 1.0 is recorded as such, and replayed as such."""
    crash_file = tmp_path / "input.bin"
    rec = CrashFile(crash_file)
    raw = bytes.fromhex("2200220870736575646f2a040a020101")  # "", "pseudo"; {pseudo=pseudo}
    rec.record(CONVERTING, 0, raw)
    rec.map.flush()
    proc = _run(["--seed", "1", "--replay", str(crash_file)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replay: RW 2.0 -> 1.0" in proc.stdout and "conversion: OK" in proc.stdout
