"""The sender of the high-cardinality mode: several processes, one keep-alive connection
each, sending pre-built bodies.

The processes are forked once the bodies are built, so they share them with the parent
(copy-on-write) and a phase only passes indexes. Two ways to send:

- ``saturate``: every process takes the next body as soon as its previous request is
  answered (a shared counter hands them out in order): as many requests in flight as
  there are processes, the relay is never waiting on the sender;
- ``paced``: an open-loop schedule, request ``k`` due at ``t0 + k / rate``, the processes
  taking turns; latency is counted from the due time, so a slow answer that delays the
  next send is charged to the relay, not hidden (no coordinated omission). Several relays
  can be paced together (``run_together``): each still gets ``rate`` requests a second,
  relay ``j`` of ``n`` shifted by ``j / (n * rate)``, so their requests take turns and
  every relay's latencies are taken through the same stretch of the machine's noise.

Sending a pre-built body costs the sender little more than the kernel's loopback copy: a
raw socket, the head prebuilt, head and body in one ``sendmsg``, the answer's status read
(``Client``); the senders share the two cores with the relay, above all in the 2-core
row, so they are kept cheap.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.sharedctypes
import socket
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


def request_head(protocol: str) -> bytes:
    """The request line and headers of a write, up to ``Content-Length: `` (the length
    and the blank line follow per body)."""
    lines = [f"POST {WRITE_PATH} HTTP/1.1", "Host: 127.0.0.1",
             *(f"{k}: {v}" for k, v in HEADERS[protocol].items()), "Content-Length: "]
    return "\r\n".join(lines).encode()


class Client:
    """One keep-alive connection on a raw socket: the prebuilt head and the body go out in
    one ``sendmsg`` (no copy of the body, no header building), the answer is read for its
    status and its body skipped. Sender CPU shares the box's cores with the relay it
    measures, so it is kept to little more than the kernel's copies: 125-190 us of CPU per
    340 KB request, against 290-510 us through ``http.client`` (measured, same sink)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._port = 0

    def send(self, port: int, body: bytes, head: bytes) -> tuple[bool, str]:
        for attempt in (0, 1):
            if self._sock is None or self._port != port:
                self.close()
                self._sock = socket.create_connection(("127.0.0.1", port), timeout=120)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._port = port
            try:
                status, text, close = self._exchange(self._sock, head, body)
            except (OSError, ValueError) as exc:
                self.close()
                if attempt:
                    return False, repr(exc)
                continue
            if close:
                self.close()
            if status // 100 != 2:
                return False, f"HTTP {status}: {text[:200]!r}"
            return True, ""
        return False, "unreachable"

    @staticmethod
    def _exchange(sock: socket.socket, head: bytes, body: bytes) -> tuple[int, bytes, bool]:
        """Write one request, read its answer: (status, body, the server closes)."""
        first = head + b"%d\r\n\r\n" % len(body)
        sent = sock.sendmsg([first, body])
        if sent < len(first) + len(body):
            sock.sendall(memoryview(first + body)[sent:])  # rare: a partial write
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            chunk = sock.recv(65536)
            if not chunk:
                raise ValueError("connection closed before the answer")
            buf += chunk
        lines = buf[:end].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (ln.partition(b":") for ln in lines[1:])}
        length = int(fields.get(b"content-length", b"0"))
        text = buf[end + 4:]
        while len(text) < length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ValueError("connection closed inside the answer")
            text += chunk
        return status, text[:length], fields.get(b"connection", b"").lower() == b"close"

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


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

    def outcome(self) -> tuple[int, str, list[tuple[int, float]]]:
        return self.errors, self.last, self.lat


def turn(c: int, relays: int, rate: float) -> tuple[float, int, int]:
    """Turn ``c`` of a paced run to ``relays`` relays at ``rate`` requests/s each: (seconds
    after the start it is due, the request, the relay). Request ``k`` goes to every relay
    in turn, relay ``j`` a ``j / relays`` share of the interval after relay 0."""
    k, j = divmod(c, relays)
    return (k + j / relays) / rate, k, j


def _worker(
    rank: int,
    size: int,
    conn: multiprocessing.connection.Connection,
    bodies: Mapping[str, Sequence[bytes]],
    counter: Any,
) -> None:
    clients: dict[int, Client] = {}  # one keep-alive connection per relay
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd is None:
            return
        targets, items, rate, t0 = cmd
        heads = [request_head(protocol) for _, protocol in targets]
        sources = [bodies[protocol] for _, protocol in targets]
        sends = [clients.setdefault(port, Client()).send for port, _ in targets]
        tallies = [_Tally() for _ in targets]
        n = len(targets)
        if rate:
            # paced: this process takes turns rank, rank + size, ... (in due order)
            for c in range(rank, len(items) * n, size):
                after, k, j = turn(c, n, rate)
                due = t0 + after
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                tallies[j].add(sends[j](targets[j][0], sources[j][items[k]], heads[j]),
                               items[k], due)
        else:  # saturating: one relay
            while True:
                with counter.get_lock():
                    k = counter.value
                    counter.value = k + 1
                if k >= len(items):
                    break
                t = time.monotonic()
                tallies[0].add(sends[0](targets[0][0], sources[0][items[k]], heads[0]),
                               items[k], t)
        conn.send((time.monotonic(), [tally.outcome() for tally in tallies]))


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
        return self._run([(port, protocol)], items, rate)[0]

    def run_together(
        self, targets: Sequence[tuple[int, str]], items: Sequence[int], rate: float
    ) -> list[Result]:
        """Pace ``items`` to each (port, protocol) of ``targets`` at ``rate``/s at once, the
        relays taking turns; one result per target."""
        return self._run(list(targets), items, rate)

    def _run(
        self, targets: list[tuple[int, str]], items: Sequence[int], rate: float | None
    ) -> list[Result]:
        if not rate and len(targets) != 1:
            raise ValueError("saturating sends go to one relay")
        items = list(items)
        with self._counter.get_lock():
            self._counter.value = 0
        t0 = time.monotonic() + (0.05 if rate else 0.0)
        started = time.monotonic()
        for conn in self._conns:
            conn.send((targets, items, rate or 0.0, t0))
        results = [Result(started=t0 if rate else started, ended=started) for _ in targets]
        for conn in self._conns:
            ended, outcomes = conn.recv()
            for result, (errors, last, lat) in zip(results, outcomes, strict=True):
                result.ended = max(result.ended, ended)
                result.errors += errors
                result.last_error = last or result.last_error
                result.latencies.extend(lat)
                result.sent += len(lat) + errors
        for result in results:
            result.latencies.sort()
        return results

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
