"""Where one benchmark run writes: its scratch directory (snapshots, configs and the
relays' logs), removed afterwards unless ``--keep`` asks to look at those files once the
run is over; and its results file (``--json``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def discard_work_dir(work: Path, *, keep: bool) -> None:
    """Run last, after the processes writing into ``work`` have stopped."""
    if keep:
        print(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def results_path(value: str) -> Path:
    """``--json``'s type: the file's directory made now, so that a run of many minutes does
    not end on a path it cannot write (argparse turns the error into a usage message)."""
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make {path.parent}: {e.strerror}") from None
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    return path
