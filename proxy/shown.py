"""How a refusal shows bytes it did not accept: the first :data:`SHOWN` bytes, printable
ASCII as it is and every other byte as ``\\xNN``.

One rule for every refusal that quotes what a sender or a description's author wrote:
the relay's (a label string, ``proxy.wire``; the native splice follows it byte for byte)
and the engine's (an id an expression yielded, ``proxy.karta.jqexpr.checked_id``). A
leaf, importing nothing of the project: the wire layer and the engine each stay free of
the other and of the layers above them (``tests/test_layout.py``).
"""

from __future__ import annotations

#: bytes a refusal shows (the native splice's ``SHOWN``)
SHOWN = 64


def shown(s: bytes) -> str:
    """``s`` as a refusal shows it: its first :data:`SHOWN` bytes, printable ASCII as it
    is and every other byte (``\\``, ``"``, anything not ASCII, invalid UTF-8 included)
    as ``\\xNN``, ``...`` after a cut: safe in a log line and a response body, and the
    same in Python and in the native splice."""
    out = "".join(chr(b) if 0x20 <= b < 0x7F and b not in b'\\"' else f"\\x{b:02x}"
                  for b in s[:SHOWN])
    return out + "..." if len(s) > SHOWN else out
