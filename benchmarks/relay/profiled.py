"""Run a Python relay with its main thread (the event loop) profiled in thread CPU time,
between two signals: ``SIGUSR1`` starts counting, ``SIGUSR2`` stops and writes the
``cProfile`` stats to OUT (then ``OUT.done``), so start-up and warm-up stay out.

    python profiled.py OUT -m proxy --listen-address ...
    python profiled.py OUT path/to/passthrough.py --listen ...

``cProfile`` sets its hook on the thread that enables it: this one, the main thread, where
the signal handler runs. The worker threads are not counted. CPU time
(``time.thread_time``), not wall time, so a busy machine does not inflate the figures;
each call still pays the profiler's own cost, so compare call counts first.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    out = Path(sys.argv[1])
    target = sys.argv[2:]
    profile = cProfile.Profile(time.thread_time)

    def start(_signum: int, _frame: FrameType | None) -> None:
        profile.enable()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(str(out))
        out.with_name(out.name + ".done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    if target[:1] == ["-m"]:
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
