"""A remote-write receiver that keeps nothing: answers 204 and counts what arrived.

Raw asyncio rather than aiohttp, so that the upstream takes as little of the box's two
cores as it can while a relay is being measured. It still decompresses every body and
counts the series in it (a scan of the top-level protobuf fields) and how many carry a
``karta_workload`` label: the benchmark waits on those counts for asynchronous relays
(vmagent answers its sender before forwarding) and checks that every relay delivered
every series and what it stamped.

    python null_upstream.py --listen 127.0.0.1:PORT

``GET /stats`` answers a JSON object of the counters; ``GET /-/ready`` answers 200.

RW 1.0 and RW 2.0 (``Content-Type: ...;proto=io.prometheus.write.v2.Request``) bodies are
both counted; ``v2_series`` says how many series came as RW 2.0.

``--defer`` (the high-cardinality mode): answer 204 at once and keep the body; the counts
are made when ``/stats`` is asked (or when 1 GiB is pending), so the sink costs the
box next to nothing while a relay is being measured (the benchmark asks only between
phases). It also tells apart the benchmark's own samples (their timestamps are in
2023-2024, see ``corpus.BASE_TIMESTAMP_MS``) from anything else, such as karta-proxy's
fact series: ``samples`` and ``stamped`` count the corpus', ``other_series`` the rest;
``last_arrival`` is the ``time.monotonic()`` of the last body (the clock is the
machine's, so the benchmark can end a phase's wall time there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import time

import snappy

#: Label{name="karta_workload", value=...}: the name field, then the value field's tag
KARTA_WORKLOAD_LABEL = b"\x0a\x0ekarta_workload\x12"
KARTA_WORKLOAD = b"karta_workload"
#: one Sample as the benchmark encodes it (RW 1.0 and 2.0 alike: field 2 of TimeSeries,
#: 16 bytes: value 0x09 + double, timestamp 0x10 + 6-byte varint) with a timestamp in
#: [49 * 2**35, 50 * 2**35) ms, i.e. 2023-05-09 .. 2024-06-10: the corpus' clock, never
#: the wall clock of the machine (karta-proxy's fact series carry that)
CORPUS_SAMPLE = re.compile(rb"\x12\x10\x09.{8}\x10[\x80-\xff]{5}\x31", re.DOTALL)
V2_CONTENT_TYPE = b"io.prometheus.write.v2.request"
#: a drain stalls the sink for seconds (it counts every body it kept), so it must not come
#: inside a phase: a paced run of 600 2,000-series requests with karta-proxy's fact writes
#: every 15 s is ~300 MB, and at 256 MiB the drain in its middle made a p99 of 1.7 s
DEFER_LIMIT = 1024 * 1024 * 1024


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.series = 0
        self.stamped = 0
        self.bytes = 0
        self.errors = 0
        self.v2_series = 0
        # --defer only
        self.samples = 0
        self.other_series = 0
        self.last_arrival = 0.0
        self.pending = 0

    def as_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def count_series(body: bytes) -> int:
    """Number of ``WriteRequest.timeseries`` (field 1) entries, skipping everything else."""
    n = 0
    pos = 0
    end = len(body)
    while pos < end:
        key = body[pos]
        if key & 0x80:
            key, pos = _varint(body, pos)
        else:
            pos += 1
        wire = key & 0x07
        if wire == 2:
            length, pos = _varint(body, pos)
            pos += length
            if key == 0x0A:
                n += 1
        elif wire == 0:
            _, pos = _varint(body, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire} at {pos}")
    if pos != end:
        raise ValueError("truncated body")
    return n


def _skip(body: bytes, pos: int, wire: int) -> int:
    if wire == 2:
        length, pos = _varint(body, pos)
        return pos + length
    if wire == 0:
        return _varint(body, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    raise ValueError(f"wire type {wire} at {pos}")


def _refs(body: bytes, start: int, end: int) -> list[int]:
    """The ``labels_refs`` of one RW 2.0 TimeSeries (packed or not)."""
    refs: list[int] = []
    pos = start
    while pos < end:
        key, pos = _varint(body, pos)
        if key == 0x0A:  # packed
            length, pos = _varint(body, pos)
            stop = pos + length
            while pos < stop:
                ref, pos = _varint(body, pos)
                refs.append(ref)
        elif key == 0x08:
            ref, pos = _varint(body, pos)
            refs.append(ref)
        else:
            pos = _skip(body, pos, key & 0x07)
    return refs


def scan_v2(body: bytes) -> tuple[int, int]:
    """(series, series with a ``karta_workload`` label) of an RW 2.0 ``Request``."""
    pos = 0
    end = len(body)
    symbols = 0
    workload = -1
    series: list[tuple[int, int]] = []
    while pos < end:
        key, pos = _varint(body, pos)
        wire = key & 0x07
        if wire != 2:
            pos = _skip(body, pos, wire)
            continue
        length, pos = _varint(body, pos)
        if key == 0x22:  # symbols
            if workload < 0 and length == 14 and body[pos : pos + 14] == KARTA_WORKLOAD:
                workload = symbols
            symbols += 1
        elif key == 0x2A:  # timeseries
            series.append((pos, pos + length))
        pos += length
    if pos != end:
        raise ValueError("truncated body")
    stamped = 0
    if workload >= 0:
        # refs below 16384 are 1-2 byte varints; a 2-byte needle (ref >= 128) then only
        # matches that very ref, and a label value "karta_workload" does not occur
        needle = encode_varint(workload)
        fast = workload >= 128 and symbols <= 16384
        for start, stop in series:
            if fast and body[start] == 0x0A:
                length, p = _varint(body, start + 1)
                if body.find(needle, p, p + length) >= 0:
                    stamped += 1
            else:
                refs = _refs(body, start, stop)
                if workload in refs[0::2]:
                    stamped += 1
    return len(series), stamped


def encode_varint(n: int) -> bytes:
    """A protobuf varint (the corpus builds its bodies with it too: this module imports
    nothing of the project, so that it runs as a script anywhere)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def count(stats: Stats, raw: bytes, v2: bool, corpus_only: bool) -> None:
    """Add one uncompressed body to the counters."""
    if v2:
        series, stamped = scan_v2(raw)
        stats.v2_series += series
    else:
        series, stamped = count_series(raw), raw.count(KARTA_WORKLOAD_LABEL)
    stats.series += series
    if not corpus_only:
        stats.stamped += stamped
        return
    samples = len(CORPUS_SAMPLE.findall(raw))
    if samples:
        stats.samples += samples
        stats.stamped += stamped
    else:
        stats.other_series += series


class _Connection(asyncio.Protocol):
    def __init__(self, stats: Stats, defer: bool = False) -> None:
        self._stats = stats
        self._defer = defer
        self._buf = bytearray()
        self._need: int | None = None
        self._head: tuple[bytes, bytes, bool, bool] = (b"", b"", False, False)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            if self._need is None:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self._buf[:end])
                del self._buf[: end + 4]
                self._need, self._head = self._parse_head(head)
            if len(self._buf) < self._need:
                return
            body = bytes(self._buf[: self._need])
            del self._buf[: self._need]
            self._need = None
            self._respond(body)

    @staticmethod
    def _parse_head(head: bytes) -> tuple[int, tuple[bytes, bytes, bool, bool]]:
        lines = head.split(b"\r\n")
        method, path, _ = [*lines[0].split(b" ", 2), b"", b""][:3]
        length = 0
        snappy_body = False
        v2 = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"content-encoding":
                snappy_body = value.strip().lower() == b"snappy"
            elif name == b"content-type":
                v2 = V2_CONTENT_TYPE in value.lower()
        return length, (method, path, snappy_body, v2)

    def _respond(self, body: bytes) -> None:
        method, path, snappy_body, v2 = self._head
        assert self._transport is not None
        if method == b"GET":
            if path.startswith(b"/stats"):
                _drain(self._stats)
            payload = self._stats.as_json() if path.startswith(b"/stats") else b"ok"
            self._transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode()
                + b"\r\n\r\n"
                + payload
            )
            return
        stats = self._stats
        stats.requests += 1
        stats.bytes += len(body)
        if self._defer:
            _PENDING.append((body, snappy_body, v2))
            stats.pending += len(body)
            stats.last_arrival = time.monotonic()
            self._transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            if stats.pending > DEFER_LIMIT:
                _drain(stats)
            return
        try:
            raw = snappy.uncompress(body) if snappy_body else body
            count(stats, raw, v2, corpus_only=False)
        except Exception:  # a bad body is counted, never fatal: this is a sink
            stats.errors += 1
            self._transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 8\r\n\r\nbad body")
            return
        self._transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")


#: --defer: bodies received and not counted yet (body, snappy, RW 2.0)
_PENDING: list[tuple[bytes, bool, bool]] = []


def _drain(stats: Stats) -> None:
    bodies = _PENDING[:]
    _PENDING.clear()
    for body, snappy_body, v2 in bodies:
        try:
            raw = snappy.uncompress(body) if snappy_body else body
            count(stats, raw, v2, corpus_only=True)
        except Exception:  # answered 204 already; the benchmark sees the error count
            stats.errors += 1
    stats.pending = 0


async def serve(host: str, port: int, defer: bool = False) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(stats, defer), host, port, backlog=256)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument(
        "--defer", action="store_true", help="answer at once, count when /stats is asked"
    )
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port), args.defer))


if __name__ == "__main__":
    main()
