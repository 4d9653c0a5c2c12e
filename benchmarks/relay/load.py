"""The sender of the high-cardinality mode: several processes, one keep-alive connection
each, sending pre-built bodies.

The processes are forked once the bodies are built, so they share them with the parent
(copy-on-write) and a phase only passes indexes. Two ways to send:

- ``saturate``: every process takes the next body as soon as its previous request is
  answered (a shared counter hands them out in order): as many requests in flight as
  there are processes, the relay is never waiting on the sender;
- ``paced``: an open-loop schedule, request ``k`` due at ``t0 + k / rate``, the processes
  taking turns; latency is counted from the due time, so a slow answer that delays the
  next send is charged to the relay, not hidden (no coordinated omission).

Sending a pre-built body costs the sender ~0.1 ms of CPU per request (``http.client``,
the kernel's loopback copy), far below any relay's cost per request.
"""

from __future__ import annotations

import contextlib
import http.client
import multiprocessing
import multiprocessing.connection
import multiprocessing.sharedctypes
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

WRITE_PATH = "/api/v1/write"
HEADERS = {
    "v1": {
        "Content-Type": "application/x-protobuf",
        "Content-Encoding": "snappy",
        "X-Prometheus-Remote-Write-Version": "0.1.0",
        "User-Agent": "karta-relay-bench/1",
    },
    "v2": {
        "Content-Type": "application/x-protobuf;proto=io.prometheus.write.v2.Request",
        "Content-Encoding": "snappy",
        "X-Prometheus-Remote-Write-Version": "2.0.0",
        "User-Agent": "karta-relay-bench/1",
    },
}


@dataclass
class Result:
    """What the senders did in one phase."""

    started: float  # time.monotonic() when the phase was handed out
    ended: float  # the last answer
    sent: int = 0
    errors: int = 0
    last_error: str = ""
    #: (body index, seconds) per request answered 2xx
    latencies: list[tuple[int, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class _Client:
    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._port = 0

    def send(self, port: int, body: bytes, headers: dict[str, str]) -> tuple[bool, str]:
        for attempt in (0, 1):
            if self._conn is None or self._port != port:
                if self._conn is not None:
                    self._conn.close()
                self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                self._port = port
            try:
                self._conn.request("POST", WRITE_PATH, body=body, headers=headers)
                resp = self._conn.getresponse()
                text = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._conn.close()
                self._conn = None
                if attempt:
                    return False, repr(exc)
                continue
            if resp.status // 100 != 2:
                return False, f"HTTP {resp.status}: {text[:200]!r}"
            return True, ""
        return False, "unreachable"


@dataclass
class _Tally:
    """One command's outcome in a sender process: the answered items' latencies (from when
    each was due, if paced, else from its send) and the failures."""

    lat: list[tuple[int, float]] = field(default_factory=list)
    errors: int = 0
    last: str = ""

    def add(self, sent: tuple[bool, str], item: int, since: float) -> None:
        ok, why = sent
        if ok:
            self.lat.append((item, time.monotonic() - since))
        else:
            self.errors += 1
            self.last = why


def _worker(
    rank: int,
    size: int,
    conn: multiprocessing.connection.Connection,
    bodies: Mapping[str, Sequence[bytes]],
    counter: Any,
) -> None:
    client = _Client()
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd is None:
            return
        port, protocol, items, rate, t0 = cmd
        headers = HEADERS[protocol]
        source = bodies[protocol]
        tally = _Tally()
        if rate:  # paced: this process sends items rank, rank + size, ...
            for k in range(rank, len(items), size):
                due = t0 + k / rate
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                tally.add(client.send(port, source[items[k]], headers), items[k], due)
        else:
            while True:
                with counter.get_lock():
                    k = counter.value
                    counter.value = k + 1
                if k >= len(items):
                    break
                t = time.monotonic()
                tally.add(client.send(port, source[items[k]], headers), items[k], t)
        conn.send((time.monotonic(), tally.errors, tally.last, tally.lat))


class SenderPool:
    """``size`` forked sender processes over the same bodies."""

    def __init__(self, bodies: Mapping[str, Sequence[bytes]], size: int = 4) -> None:
        ctx = multiprocessing.get_context("fork")
        self.size = size
        self._counter = ctx.Value("l", 0)
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, size, child, bodies, self._counter),
                daemon=True,
                name=f"relay-bench-sender-{rank}",
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(
        self, port: int, protocol: str, items: Sequence[int], rate: float | None = None
    ) -> Result:
        """Send bodies ``items`` (indexes) to ``port``; saturating, or paced at ``rate``/s."""
        items = list(items)
        with self._counter.get_lock():
            self._counter.value = 0
        t0 = time.monotonic() + (0.05 if rate else 0.0)
        started = time.monotonic()
        for conn in self._conns:
            conn.send((port, protocol, items, rate or 0.0, t0))
        result = Result(started=t0 if rate else started, ended=started)
        for conn in self._conns:
            ended, errors, last, lat = conn.recv()
            result.ended = max(result.ended, ended)
            result.errors += errors
            result.last_error = last or result.last_error
            result.latencies.extend(lat)
            result.sent += len(lat) + errors
        result.latencies.sort()
        return result

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
