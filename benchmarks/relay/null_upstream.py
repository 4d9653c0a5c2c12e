"""A remote-write receiver that keeps nothing: answers 204 and counts what arrived.

Raw asyncio rather than aiohttp, so that the upstream takes as little of the box's two
cores as it can while a relay is being measured. It still decompresses every body and
counts the series in it (a scan of the top-level protobuf fields) and how many carry a
``karta_workload`` label: the benchmark waits on those counts for asynchronous relays
(vmagent answers its sender before forwarding) and checks that every relay delivered
every series and what it stamped.

    python null_upstream.py --listen 127.0.0.1:PORT

``GET /stats`` answers a JSON object of the counters; ``GET /-/ready`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

import snappy

#: Label{name="karta_workload", value=...}: the name field, then the value field's tag
KARTA_WORKLOAD_LABEL = b"\x0a\x0ekarta_workload\x12"


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.series = 0
        self.stamped = 0
        self.bytes = 0
        self.errors = 0

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


class _Connection(asyncio.Protocol):
    def __init__(self, stats: Stats) -> None:
        self._stats = stats
        self._buf = bytearray()
        self._need: int | None = None
        self._head: tuple[bytes, bytes, bool] = (b"", b"", False)
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
    def _parse_head(head: bytes) -> tuple[int, tuple[bytes, bytes, bool]]:
        lines = head.split(b"\r\n")
        method, path, _ = [*lines[0].split(b" ", 2), b"", b""][:3]
        length = 0
        snappy_body = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"content-encoding":
                snappy_body = value.strip().lower() == b"snappy"
        return length, (method, path, snappy_body)

    def _respond(self, body: bytes) -> None:
        method, path, snappy_body = self._head
        assert self._transport is not None
        if method == b"GET":
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
        try:
            raw = snappy.uncompress(body) if snappy_body else body
            stats.series += count_series(raw)
            stats.stamped += raw.count(KARTA_WORKLOAD_LABEL)
        except Exception:  # a bad body is counted, never fatal: this is a sink
            stats.errors += 1
            self._transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 8\r\n\r\nbad body")
            return
        self._transport.write(b"HTTP/1.1 204 No Content\r\n\r\n")


async def serve(host: str, port: int) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(stats), host, port, backlog=256)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port)))


if __name__ == "__main__":
    main()
