"""Structured logs: one JSON object per line, so log pipelines can filter on fields.

Callers pass context through ``extra={...}``; every extra key becomes a top-level field.
``text`` format exists for people reading a terminal; ``auto`` (the default) picks it when
stderr is one, as Prometheus' own tools do, so a first run reads well and a container's log
still parses.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

#: attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


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
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v!r}" for k, v in _extras(record).items())
        line = f"{ts} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
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
    a person and a supervisor's log see the same thing whatever the log format."""
    print(f"{PROG}: error: {message}", file=stream or sys.stderr, flush=True)


def resolve_format(fmt: str, stream: IO[str]) -> str:
    """``auto`` -> ``text`` on a terminal, ``json`` otherwise; other formats stay."""
    if fmt != "auto":
        return fmt
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "json"


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
