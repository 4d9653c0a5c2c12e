"""Returning freed heap: big blocks freed after a load stop counting in RSS."""

from __future__ import annotations

import ctypes.util
import gc
import platform
import threading
from pathlib import Path

import pytest

from proxy import memory
from tests import garbage


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"),
                    reason="glibc's malloc_trim")
def test_freed_blocks_of_a_load_are_returned() -> None:
    if memory._libc() is None:
        pytest.skip("no malloc_trim in this C library")
    # 60k strings of ~1 KB, the shape of a snapshot's object texts, with a small survivor
    # after every one so glibc cannot give the space back by itself when they are freed
    texts = [("x" * 1000) + str(i) for i in range(60_000)]
    keep = [str(i) * 40 for i in range(60_000)]
    del texts
    before = _rss()
    assert memory.trim()
    assert _rss() < before - 20 * 1024 * 1024
    assert keep[-1]


def test_trim_is_harmless_to_call_again() -> None:
    memory.trim()
    assert memory.trim() in (True, False)


async def test_the_event_loops_trim_runs_in_another_thread(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """``malloc_trim`` walks the whole heap (4-9 ms at 37.5k pods): not on the loop."""
    threads: list[int] = []

    def trim() -> bool:
        threads.append(threading.get_ident())
        return True

    monkeypatch.setattr(memory, "trim", trim)
    assert await memory.trim_off_loop()
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_arenas_are_capped_unless_the_operator_chose() -> None:
    """In a fresh process (before any thread): capped; with MALLOC_ARENA_MAX set, left
    to glibc, which reads the variable itself."""
    import os
    import subprocess
    import sys

    if memory._libc() is None:
        pytest.skip("no glibc")
    code = "from proxy import memory; print(memory.limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    mine = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert mine.stdout.strip() == "True"
    theirs = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"},
                            capture_output=True, text=True, timeout=60, check=True)
    assert theirs.stdout.strip() == "False"


def test_collect_and_freeze_frees_garbage_cycles_and_freezes_what_is_alive() -> None:
    """What a load builds is out of every later collection's walk as it is built; a
    cycle already garbage is collected first, never frozen for good."""
    with garbage.collections_off():
        gone = garbage.cycle()
        kept = garbage.cycle()()  # alive: held by ``kept``
        memory.collect_and_freeze()
        assert gone() is None, "a garbage cycle was frozen instead of freed"
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "still walked by gc"


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_request_buffers_stay_on_the_heap_unless_the_operator_chose() -> None:
    """Two threads doing what splice workers do (decode, a bigger body, encode, free)
    fault their pages in again and again on glibc's defaults, and reuse them once set
    (minor page faults of a fresh process over 80 such requests, with and without)."""
    import os
    import subprocess
    import sys

    if memory._libc() is None:
        pytest.skip("no glibc")
    code = (
        "import os, resource, sys, threading\n"
        "import cramjam\n"
        "from proxy import memory\n"
        "memory.limit_arenas()\n"
        "was_set = memory.keep_request_buffers() if sys.argv[1] == '1' else None\n"
        "z = cramjam.snappy.compress_raw(os.urandom(200_000) * 6)\n"
        "def work(n):\n"
        "    for _ in range(n):\n"
        "        raw = bytes(cramjam.snappy.decompress_raw(z))\n"
        "        out = raw + b'x' * 300_000\n"
        "        del raw\n"
        "        c = bytes(cramjam.snappy.compress_raw(out))\n"
        "        del out, c\n"
        "def both(n):\n"
        "    ts = [threading.Thread(target=work, args=(n,)) for _ in range(2)]\n"
        "    [t.start() for t in ts]; [t.join() for t in ts]\n"
        "both(5)\n"
        "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "both(40)\n"
        "print(was_set, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}

    def run(flag: str, extra: dict[str, str] | None = None) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", code, flag], env={**env, **(extra or {})},
                             capture_output=True, text=True, timeout=120, check=True)
        was_set, faults = out.stdout.split()
        return was_set, int(faults)

    _, default_faults = run("0")
    kept, kept_faults = run("1")
    assert kept == "True"
    assert kept_faults * 5 < default_faults, (kept_faults, default_faults)
    assert run("1", {"MALLOC_TRIM_THRESHOLD_": "131072"})[0] == "False"


@pytest.mark.parametrize("enabled", [True, False])
def test_collections_pause_inside_and_come_back_as_they_were(enabled: bool) -> None:
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with memory.collections_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), memory.collections_paused():
            raise RuntimeError
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_collections_paused_in_two_threads_end_with_the_last() -> None:
    """Pauses that overlap: the first to leave does not end the other's; the last puts
    the collector back as it was before the first."""
    import gc
    import threading

    was = gc.isenabled()
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with memory.collections_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    try:
        with memory.collections_paused():
            t.start()
            assert inside.wait(10)
        assert not gc.isenabled()  # the other thread is still inside
        leave.set()
        t.join(10)
        assert gc.isenabled()
    finally:
        leave.set()
        t.join(10)
        (gc.enable if was else gc.disable)()


async def test_a_connection_open_at_a_freeze_is_freed_once_closed() -> None:
    """A watch's or a sender's connection alive when the fact writer froze the heap, then
    closed: its transport is freed by reference counting, not left as a frozen cycle
    (never collected) for the process's life.

    The sender's side is served by aiohttp, as the proxy serves it: asyncio's own stream
    server (``asyncio.start_server``) makes such a cycle itself from Python 3.12 (the
    accepted connection's done callback, a closure over its transport, on the task that
    serves it), which the proxy never runs."""
    import asyncio
    import gc
    import weakref

    from aiohttp import web

    accepted: list[weakref.ref[asyncio.BaseTransport]] = []

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        accepted.append(weakref.ref(request.transport))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = weakref.ref(writer.transport)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):  # bounded: an answer that never comes fails
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert accepted  # the connection stays open (keep-alive)
        memory.freeze_survivors()  # the connection is open: frozen with its transport
        try:
            writer.close()
            await writer.wait_closed()
            del reader, writer
            gc.collect()  # what the proxy collects: never the frozen
            assert client() is None, "the closed transport stays, a frozen cycle"
            # the server's side closes too: its EOF, close and connection_lost take a few
            # loop turns, which no fixed sleep promises; waited for (bounded)
            async with asyncio.timeout(10):
                while accepted[0]() is not None:
                    await asyncio.sleep(0.01)
                    gc.collect()
        finally:
            gc.unfreeze()
    finally:
        await runner.cleanup()
