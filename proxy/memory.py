"""Handing freed heap back to the operating system after a big load.

CPython allocates objects over 512 bytes (a snapshot object's JSON text, a long label
value) from glibc's malloc, which keeps freed memory for reuse instead of returning it.
After a load that freed many such blocks (a snapshot read, then applied), the process
would carry them as RSS for its whole life: ~20-30 MB at 37.5k pods, and the peak of the
fact write that follows is that much higher. ``malloc_trim(0)`` returns them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - musl and others have no malloc_trim
    except (OSError, AttributeError):
        return None
    return libc


def trim() -> bool:
    """Return free heap to the OS where the C library can (glibc); True if it did."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except OSError:  # pragma: no cover - a libc that cannot be called
        log.debug("malloc_trim failed", exc_info=True)
        return False
