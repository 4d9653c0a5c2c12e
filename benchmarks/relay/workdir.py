"""The scratch directory of one benchmark run: snapshots, configs and the relays' logs.

Removed afterwards unless ``--keep`` asks to look at those files once the run is over.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def discard_work_dir(work: Path, *, keep: bool) -> None:
    """Run last, after the processes writing into ``work`` have stopped."""
    if keep:
        print(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
