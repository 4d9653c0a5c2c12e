"""Log formats: JSON for pipelines, text for people, ``auto`` choosing by whether stderr is
a terminal (a real pseudo-terminal here, not a stand-in)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from proxy.log import DISTINCT_COUNTED, MAX_KEYS, Throttled, resolve_format, setup_logging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pty_stream() -> Iterator[IO[str]]:
    primary, secondary = os.openpty()
    stream = os.fdopen(secondary, "w")
    try:
        yield stream
    finally:
        stream.close()
        os.close(primary)


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_auto_is_text_on_a_terminal_and_json_elsewhere(pty_stream: IO[str]) -> None:
    assert resolve_format("auto", pty_stream) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    with open(os.devnull, "w") as devnull:  # a file, not a terminal
        assert resolve_format("auto", devnull) == "json"
    # a configured format is kept whatever the stream
    assert resolve_format("json", pty_stream) == "json"
    assert resolve_format("text", io.StringIO()) == "text"


def test_setup_logging_auto_writes_json_to_a_pipe() -> None:
    out = io.StringIO()
    setup_logging("info", "auto", stream=out)
    logging.getLogger("karta.test").info("hello", extra={"port": 1})
    rec = json.loads(out.getvalue())
    assert (rec["msg"], rec["port"], rec["level"]) == ("hello", 1, "info")


def test_text_format_is_one_readable_line() -> None:
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("karta.test").warning("upstream slow", extra={"upstream_status": 503})
    line = out.getvalue()
    assert line.count("\n") == 1 and not line.startswith("{")
    assert "warning karta.test: upstream slow upstream_status=503" in line


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_quoted_value_cannot_forge_lines_or_colour_the_terminal(fmt: str) -> None:
    """The audit's annotation, quoted by a jq error into a message: a newline made a whole
    forged line in the text format, an ANSI escape coloured the screen."""
    out = io.StringIO()
    setup_logging("info", fmt, stream=out)
    hostile = "x\n21:13:00 info    karta.runtime: FORGED LINE\x1b[31mred\x1b[0m\r\x85\u2028"
    logging.getLogger("karta.test").warning("jq error: %s", hostile)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert not any(c in text[:-1] for c in "\r\x1b\x85\u2028")
    if fmt == "json":
        assert json.loads(text)["msg"] == f"jq error: {hostile}"  # escaped by JSON itself
    else:
        assert "FORGED LINE\\x1b[31mred\\x1b[0m\\x0d\\x85\\u2028" in text


def test_the_default_is_auto() -> None:
    from proxy.config import Settings

    assert Settings().log_format == "auto"


def test_a_process_logging_into_a_pipe_logs_json() -> None:
    """The default, end to end: a child whose stderr is a pipe (a container log) gets JSON."""
    code = ("import logging; from proxy.config import Settings; from proxy.log import "
            "setup_logging; s = Settings(); setup_logging(s.log_level, s.log_format); "
            "logging.getLogger('karta.x').info('up')")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stderr)["msg"] == "up"


async def test_throttled_lines_one_at_once_the_rest_in_a_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    lines = Throttled(logging.getLogger("karta.test"), "refused", "refused, summed",
                      peer_field="remote", interval=10.0, clock=lambda: now[0])
    for i in range(5):
        lines.event("a", {"kind": "a", "remote": f"10.0.0.{i % 2}", "n": i})
    lines.event("b", {"kind": "b", "remote": "10.0.0.9"})
    assert [r.getMessage() for r in caplog.records] == ["refused", "refused"]
    lines.close()  # the stop writes what waits
    (summary,) = [r for r in caplog.records if r.getMessage() == "refused, summed"]
    assert (summary.__dict__["count"], summary.__dict__["peers"], summary.__dict__["n"],
            summary.__dict__["last_peer"]) == (4, "10.0.0.0, 10.0.0.1", 4, "10.0.0.0")
    assert "remote" not in summary.__dict__
    caplog.clear()
    now[0] += 10.0  # the next interval: a line of its own again
    lines.event("a", {"kind": "a", "remote": "10.0.0.1"})
    assert [r.getMessage() for r in caplog.records] == ["refused"]


async def test_throttled_state_stays_bounded_whatever_the_keys(
        caplog: pytest.LogCaptureFixture) -> None:
    """A key a sender chooses (a label value) made a window each, kept for good, and a
    line each: 2,000 values, 2,000 windows and lines. Past ``MAX_KEYS`` the idle windows
    are dropped, and within one interval the new keys share one window, its lines
    marked."""
    now = [100.0]
    lines = Throttled(logging.getLogger("karta.test"), "refused", "refused, summed",
                      peer_field=None, interval=10.0, clock=lambda: now[0])
    for i in range(2000):
        lines.event(f"v{i}", {"n": i})
    assert len(lines._windows) == MAX_KEYS + 1  # and the overflow's
    firsts = [r for r in caplog.records if r.getMessage() == "refused"]
    assert [r.__dict__["n"] for r in firsts] == [*range(MAX_KEYS), MAX_KEYS]
    assert "keys_over_limit" not in firsts[0].__dict__
    assert firsts[-1].__dict__["keys_over_limit"] == MAX_KEYS
    lines.close()
    (summary,) = [r for r in caplog.records if r.getMessage() == "refused, summed"]
    assert (summary.__dict__["count"], summary.__dict__["n"]) == (2000 - MAX_KEYS - 1, 1999)
    caplog.clear()
    now[0] += 20.0  # every window idle: a new key drops them and gets its own
    lines.event("new", {"n": -1})
    assert list(lines._windows) == ["new"]
    assert [r.__dict__.get("keys_over_limit") for r in caplog.records] == [None]


async def test_throttled_summary_counts_the_distinct_values_of_a_field(
        caplog: pytest.LogCaptureFixture) -> None:
    """One key standing for many values (another cluster's name, the sender's to choose)
    says in its summary how many there were, up to DISTINCT_COUNTED."""
    now = [100.0]
    lines = Throttled(logging.getLogger("karta.test"), "seen", "seen, summed",
                      peer_field=None, interval=10.0, clock=lambda: now[0],
                      distinct_field="seen")
    for i in range(30):
        lines.event("k", {"seen": f"c{i % 5}"})
    lines.close()
    (summary,) = [r for r in caplog.records if r.getMessage() == "seen, summed"]
    assert (summary.__dict__["count"], summary.__dict__["seen_values"],
            summary.__dict__["seen"]) == (29, 5, "c4")
    caplog.clear()
    now[0] += 10.0
    for i in range(DISTINCT_COUNTED + 50):
        lines.event("k", {"seen": f"d{i}"})
    lines.close()
    (summary,) = [r for r in caplog.records if r.getMessage() == "seen, summed"]
    assert summary.__dict__["seen_values"] == DISTINCT_COUNTED


def test_a_json_line_holds_no_lone_surrogate() -> None:
    """aiohttp keeps a header's bytes that are not UTF-8 as lone surrogates (a User-Agent
    ``caf\\xe9`` is ``"caf\\udce9"``), and refusals log the user agent: the line's JSON
    said ``"caf\\udce9"``, an escape of no character, which strict parsers (Rust's
    serde_json, as in Vector) refuse, the whole line lost. Now the text ``\\udce9``."""
    code = ("import logging; from proxy.log import setup_logging; "
            "setup_logging('info', 'json'); "
            "logging.getLogger('karta.x').warning('request refused', "
            "extra={'user_agent': 'caf\\udce9', 'seen': '\\ud800x'})")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stderr.decode("utf-8"))
    json.dumps(rec, ensure_ascii=False).encode("utf-8")  # no lone surrogate in any value
    assert (rec["user_agent"], rec["seen"]) == ("caf\\udce9", "\\ud800x")
