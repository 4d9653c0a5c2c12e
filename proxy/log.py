"""Structured logs: one JSON object per line, so log pipelines can filter on fields.

Callers pass context through ``extra={...}``; every extra key becomes a top-level field.
``text`` format exists for people reading a terminal; ``auto`` (the default) picks it when
stderr is one, as Prometheus' own tools do, so a first run reads well and a container's log
still parses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from proxy.shown import one_line

#: attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


#: what ``json.dumps(ensure_ascii=False)`` leaves raw that a terminal or a line splitter
#: takes as a control or a line break (DEL, C1 such as NEL, U+2028 / U+2029): as JSON
#: escapes, so a line holds one record whatever the values quote. And lone surrogates
#: (aiohttp's form of a header's bytes that are not UTF-8: a User-Agent ``caf\\xe9`` is
#: ``caf\\udce9``): as the text ``\\udce9``, as the text format's ``repr`` shows them,
#: since written raw they came out as the JSON escape of no character, which strict
#: parsers (serde_json) refuse, the whole line with it
_JSON_CONTROLS = {c: f"\\u{c:04x}" for c in (*range(0x7F, 0xA0), 0x2028, 0x2029)} | {
    c: f"\\\\u{c:04x}" for c in range(0xD800, 0xE000)}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False).translate(_JSON_CONTROLS)


#: control characters (C0, DEL, C1) and Unicode's line breaks, each as its escape: a
#: message quotes what others wrote (a jq error quotes a pod annotation, a name from a
#: snapshot), and a newline or an ANSI escape in it forged whole lines in a terminal (an
#: audit: an annotation read by ``fromjson`` printed ``info karta.runtime: FORGED LINE``
#: and coloured the screen). JSON lines escape them by themselves
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    0x2028: "\\u2028", 0x2029: "\\u2029"}


class TextFormatter(logging.Formatter):
    """One line per record for a person at a terminal; the extra fields ``repr``'d, the
    message with its control characters escaped (``_CONTROLS``)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v!r}" for k, v in _extras(record).items())
        message = record.getMessage().translate(_CONTROLS)
        line = f"{ts} {record.levelname.lower():7} {record.name}: {message}"
        if extras:
            line += " " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


#: the program name that starts an operator-facing error line
PROG = "karta-proxy"


def error_line(message: str, stream: IO[str] | None = None) -> None:
    """The one plain line a failed start ends with, whatever failed (a setting, the port,
    the snapshot, the cluster): ``karta-proxy: error: ...``, as argparse words its own, so
    a person and a supervisor's log see the same thing whatever the log format. One
    line whatever the message quotes (a path or a value with a line break in it, as
    ``--config $'a\\nb'`` gave): its control characters escaped as the text log's are."""
    print(f"{PROG}: error: {message.translate(_CONTROLS)}", file=stream or sys.stderr,
          flush=True)


def failure_line(exc: BaseException, timeout: float) -> str:
    """One line for a call that failed with ``exc`` after being given ``timeout`` seconds:
    a timeout says how long it was given (``str(TimeoutError())`` is empty, and a line
    that ended in ``: `` said nothing), anything else its type and text on one line, cut
    to 300 characters."""
    if isinstance(exc, TimeoutError):  # asyncio's too, since Python 3.11
        return f"no answer within {timeout:.3g} s"
    text = one_line(str(exc) or "")[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def resolve_format(fmt: str, stream: IO[str]) -> str:
    """``auto`` -> ``text`` on a terminal, ``json`` otherwise; other formats stay."""
    if fmt != "auto":
        return fmt
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "json"


class HeldRecords(logging.Handler):
    """What is logged before logging is set up (the settings say how to log, and reading
    them may warn, e.g. of a removed setting): kept, then given to the handlers
    ``setup_logging`` installs (:meth:`replay`; ``release`` is the handler lock's).
    Without it Python's last-resort handler prints the bare message, dropping its fields,
    in no log format."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        logging.getLogger().addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def replay(self) -> None:
        """Stop holding; log what was held through the root logger's handlers now."""
        root = logging.getLogger()
        root.removeHandler(self)
        for record in self.records:
            if record.levelno >= root.getEffectiveLevel():
                root.handle(record)
        self.records.clear()


def setup_logging(level: str = "info", fmt: str = "auto", stream: IO[str] | None = None) -> None:
    """Configure the root logger once per process (replaces earlier handlers)."""
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter() if resolve_format(fmt, out) == "json"
                         else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's access log is one line per remote-write request: far too chatty at info
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


#: how long one kind of frequent event is logged as one line (the first at once, the
#: rest in one summary line at the end of the interval)
THROTTLE_SECONDS = 10.0
#: peers named in a summary line (a fleet of them would make one line of every address)
PEERS_NAMED = 8
#: keys a :class:`Throttled` keeps a window for at once: past them, after its idle windows
#: were dropped, a new key's events share one window (``OVERFLOW_KEY``). A key may come
#: from a sender (a label value, an upstream's error text), and a window is ~640 bytes
MAX_KEYS = 256
#: the window of the keys past ``MAX_KEYS``; its lines say so (``keys_over_limit``)
OVERFLOW_KEY = "\0overflow"
#: distinct values of ``distinct_field`` counted for a summary line (more read as this)
DISTINCT_COUNTED = 100


@dataclass
class _Window:
    """The log state of one key: when the next line may go, and what waits for it."""

    next_line_at: float = 0.0
    suppressed: int = 0
    last: dict[str, Any] | None = None
    last_peer: str = ""
    hosts: set[str] = field(default_factory=set)
    #: the hashes of the ``distinct_field`` values of the events held
    #: (``DISTINCT_COUNTED`` at most)
    values: set[int] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None

    def idle(self, now: float) -> bool:
        """Nothing held and its interval over: a new window would do the same."""
        return self.timer is None and self.suppressed == 0 and now >= self.next_line_at


class Throttled:
    """Log lines of events that can come by the thousand (refused TLS handshakes, header
    timeouts of idle connections): per key, the first of an interval at once, the rest
    of it in one summary line at its end (count, the peers' hosts, the last one's fields),
    so a fleet of misconfigured agents or a slowloris makes one line per key and interval.
    Counting is the caller's: every event is counted, only the lines are throttled.

    ``level``: the lines' level (a refusal under overload is info, not a warning);
    ``peer_field`` None: events with no peer (an upstream's failures), and a summary
    that names none; ``distinct_field``: a field whose distinct values a summary counts
    (``<field>_values``, up to ``DISTINCT_COUNTED``), for a key that stands for many.

    The state is bounded whatever the keys: a window whose interval is over with nothing
    held is dropped once ``MAX_KEYS`` are kept, and past them (a flood of keys within
    one interval) the new keys' events share one window, their lines marked
    ``keys_over_limit``. Without that, a key a sender chooses (2,000 distinct values
    made 2,000 windows, ~640 bytes each) grew the process for good, a line each.
    """

    def __init__(self, logger: logging.Logger, message: str, summary: str, *,
                 peer_field: str | None = "peer", level: int = logging.WARNING,
                 interval: float = THROTTLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 distinct_field: str | None = None) -> None:
        self._log = logger
        self._message = message
        self._summary = summary
        self._peer_field = peer_field
        self._distinct_field = distinct_field
        self.level = level
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        #: no idle window to drop before then (the earliest a kept one's interval ends)
        self._prune_at = 0.0

    def event(self, key: str, extra: dict[str, Any], *, at_once: bool = False) -> None:
        """One event of ``key`` with its fields (``peer_field`` among them).

        ``at_once``: its line now whatever the interval (news the reader must not wait
        for, as a state that changed back), the summary of the ones held written first,
        so that the lines stay in the order of the events; a new interval begins."""
        now = self._clock()
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= MAX_KEYS:
                self._prune(now)
            if len(self._windows) >= MAX_KEYS:
                key, extra = OVERFLOW_KEY, {**extra, "keys_over_limit": MAX_KEYS}
                w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window()
        if at_once and w.suppressed:
            if w.timer is not None:
                w.timer.cancel()
            self._summarize(key)
        if at_once or (w.suppressed == 0 and now >= w.next_line_at):
            w.next_line_at = now + self.interval
            self._log.log(self.level, self._message, extra=extra)
            return
        peer = "" if self._peer_field is None else str(extra.get(self._peer_field, ""))
        w.suppressed += 1
        w.last, w.last_peer = extra, peer
        if self._peer_field is not None and len(w.hosts) <= PEERS_NAMED:
            w.hosts.add(peer.rsplit(":", 1)[0] if peer.count(":") == 1 or "]" in peer
                        else peer)
        if self._distinct_field is not None and len(w.values) < DISTINCT_COUNTED:
            w.values.add(hash(str(extra.get(self._distinct_field, ""))))
        if w.timer is None:
            w.timer = asyncio.get_running_loop().call_later(
                max(0.0, w.next_line_at - now), self._summarize, key)

    def _summarize(self, key: str) -> None:
        w = self._windows[key]
        w.timer = None
        if w.suppressed == 0 or w.last is None:
            return
        fields = {k: v for k, v in w.last.items() if k != self._peer_field}
        summary: dict[str, Any] = {**fields, "count": w.suppressed, "seconds": self.interval}
        if self._peer_field is not None:
            hosts = sorted(w.hosts)
            summary["peers"] = ", ".join(hosts[:PEERS_NAMED]) + (
                ", ..." if len(hosts) > PEERS_NAMED else "")
            summary["last_peer"] = w.last_peer
        if self._distinct_field is not None:
            summary[f"{self._distinct_field}_values"] = len(w.values)
        self._log.log(self.level, self._summary, extra=summary)
        w.next_line_at = self._clock() + self.interval
        w.suppressed, w.last, w.hosts, w.values = 0, None, set(), set()

    def _prune(self, now: float) -> None:
        """Drop the idle windows (at most once per interval end: in a flood of new keys
        every window is live, and each new key would walk them all)."""
        if now < self._prune_at:
            return
        windows = self._windows
        for key in [k for k, w in windows.items() if w.idle(now)]:
            del windows[key]
        self._prune_at = min((w.next_line_at for w in windows.values()), default=now)

    def close(self) -> None:
        """Write what waits for a summary now (the proxy is stopping); cancel the timers."""
        for key, w in self._windows.items():
            if w.timer is not None:
                w.timer.cancel()
                self._summarize(key)
