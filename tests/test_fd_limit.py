"""File descriptors: the soft limit raised at start and checked against the settings, and
a real process at its descriptor limit (``prlimit``) that neither floods its log nor
spins, counts the failed accepts, and serves again once the connections close."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import snappy

from proxy import fd_limit
from tests.proxy_harness import CT_V1, SNAPSHOT, series_v1
from tests.scripted import ScriptedUpstream

REPO = Path(__file__).resolve().parents[1]


def test_the_soft_limit_is_raised_to_the_hard_one(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    limits = [1024, 524288]
    monkeypatch.setattr(resource, "getrlimit", lambda _: tuple(limits))
    monkeypatch.setattr(resource, "setrlimit", lambda _, new: limits.__setitem__(0, new[0]))
    with caplog.at_level(logging.INFO, "karta.fd_limit"):
        assert fd_limit.check_nofile(4096, 64) == 524288
    (line,) = caplog.records
    assert (line.msg, line.soft, line.hard, line.raised_from) == (  # type: ignore[attr-defined]
        "file descriptor limit", 524288, 524288, 1024)


def test_a_hard_limit_below_what_the_settings_need_is_a_warning_naming_them(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    with caplog.at_level(logging.INFO, "karta.fd_limit"):
        assert fd_limit.check_nofile(4096, 64) == 1024
    warning = caplog.records[-1]
    assert warning.levelno == logging.WARNING
    text = warning.getMessage()
    assert "server.max_connections (4096) + upstream.max_connections (64) + 64 = 4224" in text
    assert "(RLIMIT_NOFILE, 1024)" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, "karta.fd_limit"):
        fd_limit.check_nofile(896, 64)  # 1024 fits
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connect_and_send(port: int, count: int, request: bytes) -> list[socket.socket]:
    """Up to ``count`` connections, each sending ``request``; those the kernel's backlog
    has no room for time out and are left out. Three timeouts in a row: the backlog is
    full, and the rest would each wait out the timeout as well (~30 of them, 9 s)."""
    held = []
    timeouts = 0
    for _ in range(count):
        s = socket.socket()
        s.settimeout(0.3)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(request)
        except OSError:
            s.close()
            timeouts += 1
            if timeouts == 3:
                break
            continue
        timeouts = 0
        held.append(s)
    return held


@pytest.mark.skipif(shutil.which("prlimit") is None or not Path("/proc/self/stat").exists(),
                    reason="needs prlimit and /proc")
async def test_at_the_descriptor_limit_the_log_stays_quiet_and_the_cpu_idle(
        tmp_path: Path) -> None:
    # CPython 3.11's accept loop logged a traceback per backlog slot per turn at EMFILE,
    # its retries multiplying: 5,600-7,800 lines/s and half a core while the limit held
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "proxy.log"
    body = snappy.compress(series_v1({"__name__": "up", "namespace": "shop",
                                      "pod": "cart-7d9f8-abcde"}))
    request = (f"POST /api/v1/write HTTP/1.1\r\nHost: x\r\nContent-Type: {CT_V1}\r\n"
               f"Content-Encoding: snappy\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    base = f"http://127.0.0.1:{port}"
    # a connection per request: each one accepted anew
    async with ScriptedUpstream() as up, aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=3),
            connector=aiohttp.TCPConnector(force_close=True)) as session:
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                "prlimit", "--nofile=64:64", sys.executable, "-m", "proxy",
                "--snapshot", str(snap), "--upstream-url", up.url,
                "--listen-address", f"127.0.0.1:{port}", "--no-facts", "--log-format", "json",
                cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=log_file)
        held: list[socket.socket] = []
        try:
            for _ in range(200):  # ready within 20 s
                try:
                    async with session.get(base + "/-/ready") as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                assert proc.returncode is None, log_path.read_text()
                await asyncio.sleep(0.1)
            # 150 connections more than the limit: it is reached, the rest wait in the backlog
            held = await asyncio.to_thread(_connect_and_send, port, 214, request)
            assert len(held) > 64
            await asyncio.sleep(1.0)
            lines, cpu, started = (log_path.read_bytes().count(b"\n"),
                                   _cpu_seconds(proc.pid), time.monotonic())
            await asyncio.sleep(3.0)
            elapsed = time.monotonic() - started
            new_lines = log_path.read_bytes().count(b"\n") - lines
            busy = _cpu_seconds(proc.pid) - cpu
            print(f"at the limit: {new_lines / elapsed:.1f} log lines/s, "
                  f"CPU {100 * busy / elapsed:.0f}% over {elapsed:.1f} s")
            assert new_lines < 50, log_path.read_text()[-3000:]
            assert busy < 0.5
            for s in held:
                s.close()
            held.clear()
            status = 0
            for _ in range(100):  # served again within 10 s
                try:
                    async with session.post(base + "/api/v1/write", data=body, headers={
                            "Content-Type": CT_V1, "Content-Encoding": "snappy"}) as r:
                        status = r.status
                    if status == 204:
                        break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.1)
            assert status == 204
            async with session.get(base + "/metrics?facts=false") as r:
                page = await r.text()
            (errors,) = [line for line in page.splitlines() if line.startswith(
                'karta_proxy_accept_errors_total{reason="fd_limit"}')]
            assert float(errors.split()[-1]) > 0
        finally:
            for s in held:
                s.close()
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0
    records = [json.loads(line) for line in log_path.read_text().splitlines()
               if line.startswith("{")]
    episodes = [r for r in records if r.get("kind") == "accept_failed"]
    assert [r["msg"].split(":")[0] for r in episodes] == [
        "not accepting connections", "accepting connections again"]
    assert episodes[-1]["failed_accepts"] > 0
    assert not [r for r in records if r["logger"] == "asyncio"]
