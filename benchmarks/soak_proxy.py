"""``karta-proxy`` as its own process, with a measurement hook for the churn soak.

The churn soak (``churn_soak.py``) measured the proxy in its own process, beside the API
simulator and the senders: their memory could not be told from the proxy's. This runs
the product's command line (``proxy.cli.main``, the same start: arenas, thresholds,
logging, signals) with two additions for the soak:

- ``SOAK_EXPIRE_SECONDS``: the housekeeping pass's interval (30 s in the product; the
  soak's cycles settle in seconds with 1 s, and what it drops is the same);
- ``SIGUSR1``: measure, on the event loop, what the request file (``SOAK_REQUEST``)
  asks, and write the answer next to it. A measurement must not change what it measures
  for the cycles after it: the raw figures come first, the collection that needs the
  frozen heap unfrozen (what ``gc.freeze`` holds that is garbage, which the product
  never collects) runs in a forked child, and the parent only trims (as the fact writer
  does after each write).

``SOAK_TRACEMALLOC=N`` starts ``tracemalloc`` with N frames before the proxy does; a
request may then ask for a snapshot dump.

    SOAK_REQUEST=/tmp/req.json python benchmarks/soak_proxy.py --config FILE
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import json
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from churn_soak import live_objects, structures  # noqa: E402

from proxy import cli, runtime  # noqa: E402

_proxies: list[runtime.Proxy] = []


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): byte counts as ``size_t``."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def status() -> dict[str, float]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` in MiB (``/proc/self/status``)."""
    out: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = round(int(rest.split()[0]) / 1024, 2)
        elif key == "Threads":
            out[key] = int(rest)
    return out


def heap() -> dict[str, float]:
    """glibc's heap in MiB, over every arena: ``arena`` the sbrk'd and arena heaps,
    ``in_use`` allocated, ``free`` free in them (held as RSS once touched, unless
    trimmed), ``mmapped`` blocks mapped on their own."""
    m = _libc.mallinfo2()
    mib = 1 << 20
    return {"arena": round(m.arena / mib, 2), "in_use": round(m.uordblks / mib, 2),
            "free": round(m.fordblks / mib, 2), "mmapped": round(m.hblkhd / mib, 2),
            "top_free": round(m.keepcost / mib, 2)}


def _describe(obj: object) -> dict[str, Any]:
    """One object of the garbage: what it is, and what among the garbage holds it (the
    cycle that keeps it)."""
    holders = []
    for r in gc.get_referrers(obj):
        if r is gc.garbage:
            continue
        if isinstance(r, dict):
            owners = [type(h).__qualname__ for h in gc.get_referrers(r) if h is not gc.garbage]
            holders.append(f"dict of {owners[:3]}: {[k for k, v in r.items() if v is obj]}")
        else:
            holders.append(f"{type(r).__qualname__} {repr(r)[:160]}")
    return {"repr": repr(obj)[:300], "held_by": holders[:8]}


def _audit_in_child(out: Path) -> None:
    """In a forked child: what the frozen heap holds that is garbage, and the audit of
    structures and objects over the whole heap. Never returns."""
    code = 0
    try:
        gc.collect()
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        kinds = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        if kinds:  # which cycle: three of the kind most common among the garbage
            top = kinds.most_common(1)[0][0]
            examples = [_describe(o) for o in gc.garbage
                        if f"{type(o).__module__}.{type(o).__qualname__}" == top][:3]
        else:
            examples = []
        gc.garbage.clear()
        gc.set_debug(0)
        proxy = _proxies[-1]
        result = {"frozen": frozen, "frozen_garbage": found,
                  "frozen_garbage_kinds": dict(kinds.most_common(15)),
                  "frozen_garbage_examples": examples,
                  "structures": structures(proxy), "objects": live_objects(),
                  "pods": len(proxy.index.pods),
                  "fact_series": len(getattr(proxy.facts, "_written", ()) or ())
                  if proxy.facts else 0}
        out.write_text(json.dumps(result))
    except BaseException as e:  # the child must end here, whatever it was
        out.write_text(json.dumps({"error": repr(e)}))
        code = 1
    os._exit(code)


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """Raw RSS and heap, then (optionally) the forked audit, then RSS after the trim."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"seq": request["seq"], "raw": status(), "heap_raw": heap(),
                           "tasks": len(asyncio.all_tasks()),
                           "freeze_count": gc.get_freeze_count()}
    if request.get("audit"):
        child_out = Path(request["answer"] + ".child")
        pid = os.fork()
        if pid == 0:
            _audit_in_child(child_out)
        os.waitpid(pid, 0)
        out.update(json.loads(child_out.read_text()))
        child_out.unlink()
    out["collected"] = gc.collect()  # the unfrozen heap only, as the fact writer's does
    out["after_gc"] = status()
    _libc.malloc_trim(0)
    out["trimmed"] = status()
    out["heap_trimmed"] = heap()
    dump = request.get("tracemalloc_dump")
    if dump and tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(dump)
    out["measure_seconds"] = round(time.monotonic() - t0, 3)
    return out


def _on_request(path: Path) -> None:
    request = json.loads(path.read_text())
    answer = Path(request["answer"])
    tmp = answer.with_suffix(".tmp")
    tmp.write_text(json.dumps(measure(request)))
    tmp.rename(answer)


def main() -> int:
    expire = os.environ.get("SOAK_EXPIRE_SECONDS")
    if expire:
        runtime.EXPIRE_INTERVAL_SECONDS = float(expire)
    frames = int(os.environ.get("SOAK_TRACEMALLOC", "0") or 0)
    if frames:
        tracemalloc.start(frames)
    request = Path(os.environ["SOAK_REQUEST"])
    init = runtime.Proxy.__init__

    def record(self: runtime.Proxy, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _proxies.append(self)

    runtime.Proxy.__init__ = record  # type: ignore[method-assign]

    def on_signal(signum: int, frame: object) -> None:
        # on the loop, between its callbacks: not inside whatever the signal interrupted
        asyncio.get_running_loop().call_soon_threadsafe(_on_request, request)

    signal.signal(signal.SIGUSR1, on_signal)
    return cli.main()


if __name__ == "__main__":
    raise SystemExit(main())
