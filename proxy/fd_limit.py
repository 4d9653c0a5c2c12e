"""File descriptors: the soft ``RLIMIT_NOFILE`` raised to the hard one at start, checked
against what the settings need, and the listener kept quiet and cheap at the limit.

Containers often start with a soft limit of 1024 (containerd 2 and Docker 25+ inherit
systemd's 1024:524288), far below ``server.max_connections`` (4096). The start raises the
soft limit to the hard one, as the Go runtime does for Prometheus and vmagent, and warns
when even that is below what the settings may hold open: each client connection, an
upstream connection for each of them up to the pool's size, and a margin for the rest
(the listener, watches, the jq sandbox child's pipes, files).

At the limit, CPython 3.11's accept loop (``selector_events._accept_connection``) does not
return after ``EMFILE``: it tries again for every slot of the backlog, and each try logs an
error with a traceback and schedules one more retry, so the retries multiply. Measured:
5,600-7,800 log lines/s and half a core for as long as the limit held. :class:`AcceptGuard`
lets the accept loop see one failure a turn (the rest of the turn finds no connection
waiting), so asyncio pauses the listener for its retry delay (1 s) and tries once again;
each failure is counted, and an episode is logged as one warning when it starts and one
line with its count when accepting works again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("karta.fd_limit")

#: descriptors beyond the connections: the listener, the event loop's, the Kubernetes
#: watches, the jq sandbox child's pipes, TLS and snapshot files, the log (about 28 at rest)
FD_MARGIN = 64

#: accept's errors for a resource the process or host ran out of -> the counter's reason
ACCEPT_ERRNOS = {errno.EMFILE: "fd_limit", errno.ENFILE: "fd_limit",
                 errno.ENOBUFS: "no_memory", errno.ENOMEM: "no_memory"}


def fds_needed(max_connections: int, upstream_connections: int) -> int:
    """The descriptors the settings may hold open at once: every client connection
    (``server.max_connections``), an upstream connection for each up to the pool's size
    (``upstream.max_connections``), and :data:`FD_MARGIN`."""
    return max_connections + upstream_connections + FD_MARGIN


def raise_nofile() -> tuple[int, int, int]:
    """The soft ``RLIMIT_NOFILE`` raised to the hard limit: (soft before, soft now, hard).
    An unlimited hard limit (which Linux does not allow for descriptors) or a refused
    raise leaves it as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or hard == resource.RLIM_INFINITY:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft, hard
    return soft, hard, hard


def check_nofile(max_connections: int, upstream_connections: int) -> int:
    """At start: the soft limit raised (logged at info), and a warning naming the
    settings when it stays below what they need. Returns the soft limit in force."""
    before, soft, hard = raise_nofile()
    log.info("file descriptor limit", extra={
        "soft": soft, "hard": hard, **({"raised_from": before} if before != soft else {})})
    needed = fds_needed(max_connections, upstream_connections)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "the file descriptor limit (RLIMIT_NOFILE, %d) is below what the settings may "
            "hold open: server.max_connections (%d) + upstream.max_connections (%d) + %d = "
            "%d. At the limit new connections wait in the kernel's backlog, and requests "
            "fail to reach the upstream; raise the hard limit (ulimit -n, the container "
            "runtime's nofile, systemd's LimitNOFILE) or lower server.max_connections "
            "(docs/operations.md, \"File descriptors\")", soft, max_connections,
            upstream_connections, FD_MARGIN, needed,
            extra={"limit": soft, "needed": needed, "kind": "fd_limit"})
    return soft


class _OneFailureATurn:
    """A listening socket as asyncio's accept loop sees it for one turn: after one accept
    that fails for want of a resource, the rest of the turn finds no connection waiting
    (``BlockingIOError``, which ends the loop quietly)."""

    __slots__ = ("accepted", "error", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.error: OSError | None = None
        self.accepted = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.error is not None:
            raise BlockingIOError(errno.EAGAIN, "paused after a failed accept")
        try:
            conn = self.sock.accept()
        except OSError as e:
            if e.errno in ACCEPT_ERRNOS:
                self.error = e
            raise
        self.accepted += 1
        return conn

    def __getattr__(self, name: str) -> Any:  # fileno, family, ... for asyncio
        return getattr(self.sock, name)


#: the guard of each loop (one per loop, whatever number of proxies it runs)
_GUARDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AcceptGuard] = \
    weakref.WeakKeyDictionary()


class AcceptGuard:
    """One failure a turn for every listener of a loop, counted (``on_failure``
    callbacks, by reason) and logged once per episode. :func:`guard_accepts` installs it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.on_failure: list[Callable[[str], None]] = []
        #: failed accepts in the episode going on (0: none), and when it began
        self.failures = 0
        self._since = 0.0
        #: the listener's turn in progress (its failure is reported to the handler in it)
        self._turn: _OneFailureATurn | None = None
        self._accept: Callable[..., Any] = getattr(loop, "_accept_connection")  # noqa: B009
        self._handler = loop.get_exception_handler()
        # an instance attribute: asyncio's _start_serving looks it up at each (re)start
        setattr(loop, "_accept_connection", self._accept_connection)  # noqa: B010
        loop.set_exception_handler(self._exception)

    def _accept_connection(self, protocol_factory: Any, sock: Any, *args: Any) -> None:
        turn = _OneFailureATurn(sock.sock if isinstance(sock, _OneFailureATurn) else sock)
        self._turn = turn
        try:
            self._accept(protocol_factory, turn, *args)
        finally:
            self._turn = None
        if turn.error is not None:
            self._failed(turn.error)
        elif turn.accepted and self.failures:
            self._ended()

    def _failed(self, error: OSError) -> None:
        reason = ACCEPT_ERRNOS.get(error.errno or 0, "fd_limit")
        for callback in self.on_failure:
            callback(reason)
        if not self.failures:
            self._since = time.monotonic()
            log.warning(
                "not accepting connections: %s; retrying every second, the connections "
                "wait in the kernel's backlog (docs/operations.md, \"File descriptors\")",
                os.strerror(error.errno or 0),
                extra={"kind": "accept_failed", "reason": reason, "open_fds": _open_fds(),
                       "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]})
        self.failures += 1

    def _ended(self) -> None:
        log.warning("accepting connections again", extra={
            "kind": "accept_failed", "failed_accepts": self.failures,
            "seconds": round(time.monotonic() - self._since, 1)})
        self.failures = 0

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The failures this guard counted and logged are not logged again by asyncio (an
        error with a traceback each); everything else goes where it went."""
        turn = self._turn
        if turn is not None and turn.error is not None \
                and context.get("exception") is turn.error:
            return
        if self._handler is not None:
            self._handler(loop, context)
        else:
            loop.default_exception_handler(context)


def guard_accepts(loop: asyncio.AbstractEventLoop) -> AcceptGuard | None:
    """The loop's guard, installed at the first call; None for a loop without asyncio's
    selector accept loop (another event loop implementation: left as it is)."""
    guard = _GUARDS.get(loop)
    if guard is None and hasattr(loop, "_accept_connection"):
        guard = _GUARDS[loop] = AcceptGuard(loop)
    return guard


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - not Linux
        return -1
