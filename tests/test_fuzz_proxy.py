"""The fuzz run: >10k generated requests against a real proxy process, bounded in time.

Asserts, case by case: no 5xx (the upstream is healthy), valid requests are stored whole,
a body under the other protocol's Content-Type is never a 2xx that stored nothing; and
for everything that reached the upstream: valid RW, labels sorted and unique with
non-empty names, no ``karta_*`` label a sender forged. At the end the process is up and
its memory did not grow with the run. The HTTP framing part sends broken requests over
raw sockets. ``KARTA_FUZZ_CASES`` / ``KARTA_FUZZ_SEED`` change the run (a failure prints
both, plus the case number).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import yaml

from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2pb
from proxy.pb.prometheus import remote_pb2
from tests.fuzz_cases import FORGED, Case, Generator
from tests.scripted import Received, ScriptedUpstream, rw2_receiver

REPO = Path(__file__).resolve().parents[1]
DEMO_SNAPSHOT = REPO / "proxy" / "demo_data" / "snapshot.yaml"
CASES = int(os.environ.get("KARTA_FUZZ_CASES", "10500"))
SEED = int(os.environ.get("KARTA_FUZZ_SEED", "20261201"))
#: the whole run's time bound (the cases stop early past it, and say so)
DEADLINE_SECONDS = 240.0
#: memory growth allowed from after the warm-up to the end
RSS_GROWTH_KIB = 64 * 1024

WriteRequest: Any = cast(Any, remote_pb2).WriteRequest
RequestV2: Any = cast(Any, v2pb).Request


def demo_pods() -> list[tuple[str, str]]:
    pods = []
    for doc in yaml.safe_load_all(DEMO_SNAPSHOT.read_text()):
        for item in (doc or {}).get("items", [doc] if doc else []):
            if item.get("kind") == "Pod":
                pods.append((item["metadata"]["namespace"], item["metadata"]["name"]))
    assert pods
    return pods


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@dataclass
class Forwarded:
    series: int
    samples: int


def check_forwarded(rec: Received) -> Forwarded:
    """Everything the upstream got must be valid RW with clean label sets."""
    raw = rec.raw
    v2 = "io.prometheus.write.v2.Request" in rec.headers["Content-Type"]
    label_sets: list[list[tuple[str, str]]] = []
    samples = 0
    if v2:
        req = RequestV2.FromString(raw)  # raises on bad framing or invalid UTF-8
        syms = list(req.symbols)
        assert not syms or syms[0] == "", "symbols must start with the empty string"
        for ts in req.timeseries:
            refs = list(ts.labels_refs)
            assert len(refs) % 2 == 0 and all(r < len(syms) for r in refs), refs
            label_sets.append([(syms[refs[i]], syms[refs[i + 1]])
                               for i in range(0, len(refs), 2)])
            for ex in ts.exemplars:
                assert len(ex.labels_refs) % 2 == 0
                assert all(r < len(syms) for r in ex.labels_refs)
            assert ts.metadata.help_ref < len(syms) and ts.metadata.unit_ref < len(syms)
            samples += len(ts.samples)
    else:
        req = WriteRequest.FromString(raw)
        for ts in req.timeseries:
            label_sets.append([(lb.name, lb.value) for lb in ts.labels])
            samples += len(ts.samples)
    for labels in label_sets:
        names = [k for k, _ in labels]
        assert all(names), f"empty label name in {labels}"
        assert names == sorted(names) and len(set(names)) == len(names), \
            f"labels not sorted and unique: {names}"
        forged = [(k, v) for k, v in labels if k.startswith("karta_") and v == FORGED]
        assert not forged, f"sender-supplied karta_* labels reached the upstream: {forged}"
    return Forwarded(len(label_sets), samples)


@pytest.fixture
async def proxy_process(tmp_path: Path) -> AsyncIterator[tuple[int, str, ScriptedUpstream]]:
    from tests.peers.conftest import free_port

    port = free_port()
    async with ScriptedUpstream(rule=rw2_receiver) as up:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "--snapshot", str(DEMO_SNAPSHOT),
            "--upstream-url", up.url, "--listen-address", f"127.0.0.1:{port}", "--no-facts",
            "--log-level", "error",
            cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    try:
                        async with s.get(base + "/-/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("proxy process never became ready")
            yield proc.pid, base, up
            assert proc.returncode is None, "the proxy process died during the run"
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0


def _describe(i: int, case: Case) -> str:
    return (f"case {i} of seed {SEED} ({case.family} {case.notes}, headers {case.headers}, "
            f"body {case.body[:48]!r}...)")


async def test_generated_requests(proxy_process: tuple[int, str, ScriptedUpstream]) -> None:
    pid, base, up = proxy_process
    gen = Generator(SEED, demo_pods(), int(time.time() * 1000))
    url = base + "/api/v1/write"
    started = time.monotonic()
    statuses: dict[str, int] = {}
    rss_warm = 0
    done = 0
    checked = 0
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector,
                                     skip_auto_headers=("Content-Type",)) as s:
        for i, case in enumerate(gen.cases(CASES)):
            if time.monotonic() - started > DEADLINE_SECONDS:
                break
            before = len(up.received)
            async with s.post(url, data=case.body, headers=case.headers) as resp:
                text = await resp.text(errors="replace")
                status = resp.status
            statuses[f"{case.family}:{status}"] = statuses.get(f"{case.family}:{status}", 0) + 1
            what = _describe(i, case)
            assert status < 500, f"{status} {text!r} for {what}"
            assert 200 <= status < 300 or 400 <= status < 500, f"{status} for {what}"
            new = up.received[before:]
            assert len(new) == (1 if 200 <= status < 300 else 0), f"upstream got {len(new)}"
            for rec in new:
                try:
                    got = check_forwarded(rec)
                except Exception as e:  # the message names the case
                    raise AssertionError(f"{e} -- forwarded for {what}") from None
                checked += 1
                if case.valid or case.family == "crossed":
                    assert (got.series, got.samples) == (case.series, case.samples), \
                        f"stored {got} of {case.series} series / {case.samples} samples: {what}"
            if case.valid:
                assert 200 <= status < 300, f"valid request refused: {status} {text!r} {what}"
                if "io.prometheus.write.v2.Request" in case.headers.get("Content-Type", ""):
                    assert resp.headers.get("X-Prometheus-Remote-Write-Samples-Written") == \
                        str(case.samples), what
            done += 1
            if done == 500:
                rss_warm = rss_kib(pid)
            up.received.clear()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {done} cases in {elapsed:.1f} s (seed {SEED}), {checked} forwarded bodies "
          f"checked; {dict(sorted(statuses.items()))}")
    assert done >= min(CASES, 10_000), f"only {done} cases within {DEADLINE_SECONDS} s"
    growth = rss_kib(pid) - rss_warm
    assert growth < RSS_GROWTH_KIB, f"RSS grew {growth} KiB over the run"
    async with aiohttp.ClientSession() as s, s.get(base + "/-/healthy") as r:
        assert r.status == 200


# -- HTTP framing over raw sockets ----------------------------------------------------------


def framing_cases(seed: int, n: int) -> list[tuple[str, bytes]]:
    """Broken HTTP requests; each must end in a 4xx or a closed connection."""
    import random

    r = random.Random(seed)
    body = b"\x00"  # snappy of an empty body: a valid (empty) write
    head = (b"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf"
            b"\r\nContent-Encoding: snappy\r\n")
    makers: Sequence[tuple[str, Any]] = [
        ("garbage_line", lambda: r.randbytes(r.randint(1, 200)) + b"\r\n\r\n"),
        ("bad_chunk_size", lambda: head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
         + body + b"\r\n0\r\n\r\n"),
        ("chunk_too_long", lambda: head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n"
         + body + b"\r\n0\r\n\r\n"),
        ("negative_length", lambda: head + b"Content-Length: -5\r\n\r\n" + body),
        ("two_lengths", lambda: head + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n" + body),
        ("length_and_chunked", lambda: head + b"Content-Length: 1\r\nTransfer-Encoding: "
         b"chunked\r\n\r\n1\r\n\x00\r\n0\r\n\r\n"),
        ("huge_header", lambda: head + b"X-Big: " + b"a" * r.choice([9000, 70000]) + b"\r\n"
         b"Content-Length: 1\r\n\r\n" + body),
        ("bad_version", lambda: b"POST /api/v1/write HTTP/9.9\r\nContent-Length: 1\r\n\r\n"
         + body),
        ("bad_header_line", lambda: head + b"no colon here\r\nContent-Length: 1\r\n\r\n" + body),
        ("nul_in_header", lambda: head + b"X-A: a\x00b\r\nContent-Length: 1\r\n\r\n" + body),
        ("short_body_then_close", lambda: head + b"Content-Length: 100\r\n\r\n" + body),
    ]
    return [(name, make()) for name, make in (r.choice(makers) for _ in range(n))]


async def _exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return await asyncio.wait_for(reader.read(4096), 10)
    except (ConnectionError, TimeoutError):
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_broken_http_framing(proxy_process: tuple[int, str, ScriptedUpstream]) -> None:
    pid, base, up = proxy_process
    port = int(base.rsplit(":", 1)[1])
    seen: dict[str, set[str]] = {}
    for name, data in framing_cases(SEED, 400):
        answer = await _exchange(port, data)
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
        seen.setdefault(name, set()).add(status)
        assert status == "closed" or status.startswith("4"), (name, answer[:200])
    print(f"\nframing: {dict(sorted((k, sorted(v)) for k, v in seen.items()))}")
    assert up.received == [], "a broken request reached the upstream"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/-/healthy") as r:
            assert r.status == 200
        async with s.post(base + "/api/v1/write", data=b"\x00",
                          headers={"Content-Type": "application/x-protobuf",
                                   "Content-Encoding": "snappy"}) as r:
            assert r.status in (204, 400)  # an empty write still answered
    assert rss_kib(pid) < 512 * 1024
