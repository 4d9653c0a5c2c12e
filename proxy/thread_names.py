"""The names the operating system shows for the proxy's threads.

Python 3.11 names its threads only for itself: ``top -H``, ``ps -L``, ``perf`` and
``/proc/PID/task/TID/comm`` all see every thread as the process's own name, so an
operator cannot tell the event loop from a splice worker when one of them burns a core.
:func:`name_os_thread` gives the calling thread its Python name at the OS level too; the
worker pools call it as each thread starts. (Python 3.14 does this itself; this is a
no-op where ``prctl`` is missing.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: Linux's ``PR_SET_NAME``: the calling thread's name, at most 15 bytes and a NUL
_PR_SET_NAME = 15
#: the longest name the kernel keeps (``TASK_COMM_LEN`` - 1)
MAX_NAME_BYTES = 15


def _prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


_prctl_fn = _prctl()


def os_name(name: str) -> bytes:
    """``name`` as the kernel will keep it: UTF-8, cut to 15 bytes on a character
    boundary (``karta-splice_0`` fits whole)."""
    raw = name.encode("utf-8")[:MAX_NAME_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def name_os_thread() -> bool:
    """Give the calling thread its Python name at the OS level; False where that cannot be
    done (not Linux, the call refused). Never raises: a name is a convenience."""
    if _prctl_fn is None:
        return False
    name = os_name(threading.current_thread().name)
    return _prctl_fn(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) == 0


def named_pool(prefix: str, max_workers: int | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads the OS knows by their Python names (``prefix_0``, ...)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=prefix, initializer=name_os_thread)
