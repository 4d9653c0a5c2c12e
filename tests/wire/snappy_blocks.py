"""Snappy blocks of every shape a sender may write, for the compressed-domain splice
(``proxy/wire/_snappy_edit.c``) to take apart: literals of 1 byte to several KiB (tags of
one to four length bytes), copy-1, copy-2 and copy-4 elements, overlapping copies (offset
below the length), copies of 1-3 bytes (legal, though no common encoder writes them),
and offsets far back. cramjam's own encoder (what python-snappy and Rust senders write)
makes only some of these, and small blocks never reach copy-4.
"""

from __future__ import annotations

import random

from proxy.wire.primitives import encode_uvarint


def _literal(data: bytes) -> bytes:
    x = len(data) - 1
    if x < 60:
        return bytes([x << 2]) + data
    nb = (x.bit_length() + 7) // 8
    return bytes([(59 + nb) << 2]) + x.to_bytes(nb, "little") + data


def _copy(offset: int, length: int, kind: int) -> bytes:
    if kind == 1:
        return bytes([1 | (length - 4) << 2 | (offset >> 8) << 5, offset & 0xFF])
    if kind == 2:
        return bytes([2 | (length - 1) << 2]) + offset.to_bytes(2, "little")
    return bytes([3 | (length - 1) << 2]) + offset.to_bytes(4, "little")


def random_block(data: bytes, rnd: random.Random) -> bytes:
    """A valid snappy block of ``data`` whose elements are chosen at random: at each
    position a copy where some earlier position (a 4-byte match remembered: its last or its
    first occurrence, so offsets reach far back; or the byte before: runs) repeats what
    follows, else a literal of random length."""
    out = bytearray(encode_uvarint(len(data)))
    last: dict[bytes, int] = {}
    first: dict[bytes, int] = {}
    i = 0
    n = len(data)
    while i < n:
        candidates = []
        gram = data[i:i + 4]
        if len(gram) == 4 and gram in last:
            candidates.append(i - last[gram])
            candidates.append(i - first[gram])
        if i >= 1:
            candidates.append(1)
        if i >= 2:
            candidates.append(rnd.randint(1, i))
        best = (0, 0)
        for d in candidates:
            k = 0
            while k < 64 and i + k < n and data[i + k] == data[i + k - d]:
                k += 1
            if k > best[1]:
                best = (d, k)
        d, k = best
        if k and rnd.random() < 0.85:
            k = rnd.randint(1, k) if rnd.random() < 0.2 else k
            kinds = [3]
            if d < 65536:
                kinds.append(2)
            if d < 2048 and 4 <= k <= 11:
                kinds.append(1)
            out += _copy(d, k, rnd.choice(kinds))
            step = k
        else:
            step = min(n - i, rnd.choice([1, 2, 5, 17, 60, 61, 200, 300, 5000]))
            out += _literal(data[i:i + step])
        for j in range(i, min(i + step, n - 3)):
            last[data[j:j + 4]] = j
            first.setdefault(data[j:j + 4], j)
        i += step
    return bytes(out)


def element_kinds(block: bytes) -> dict[str, int]:
    """How many elements of each kind a snappy block holds (literal, copy1, copy2, copy4)."""
    p = 0
    while block[p] & 0x80:
        p += 1
    p += 1
    kinds = {"literal": 0, "copy1": 0, "copy2": 0, "copy4": 0}
    while p < len(block):
        tag = block[p]
        p += 1
        kind = tag & 3
        if kind == 0:
            x = tag >> 2
            if x >= 60:
                nb = x - 59
                x = int.from_bytes(block[p:p + nb], "little")
                p += nb
            p += x + 1
            kinds["literal"] += 1
        else:
            p += (1, 2, 4)[kind - 1]
            kinds[("copy1", "copy2", "copy4")[kind - 1]] += 1
    return kinds
