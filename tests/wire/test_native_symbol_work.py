"""Per-series work independent of symbol length (``_splice.c``, ``_convert.c``).

RW 2.0 names a string once and lets any number of series refer to it, so a series of a few
bytes of refs may name strings of 64 KiB. Work done per series on the strings themselves
made a request's CPU grow with series x symbol length, i.e. with the square of its size
(an audit: a 536 KB body cost 10.8 CPU-s). These tests count that work in the native code
(``_splice._v2_work_stats``, ``_splice._convert_stats``), never time it, and hold the output
to the Python reference:

- the pod key of a series (namespace and pod values of L bytes) is mixed from one hash per
  symbol, each long symbol hashed once per request;
- long label names with a common prefix are compared by their bytes up to a budget, then by
  the rank of their symbol in a sort of the table;
- a conversion's metadata strings are interned once per symbol, and the set of metadata is
  keyed on their ids.
"""

from __future__ import annotations

import random

import pytest

from proxy.wire import convert
from proxy.wire.conversion import v2_to_v1 as native_v2_to_v1
from proxy.wire.native import Splicer, native_available
from proxy.wire.plan import PodPair, SplicePlan
from proxy.wire.primitives import encode_uvarint as varint
from proxy.wire.primitives import len_field as field

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

from proxy.compression import DecodeError
from proxy.wire import _splice

SAMPLE = field(2, bytes.fromhex("09000000000000f03f1001"))
PLAN = SplicePlan(pairs=(PodPair(b"namespace", b"pod"),),
                  stamped=frozenset({b"karta_workload"}), workload_label=b"karta_workload")


def request(symbols: list[bytes], series: list[list[int]], extra: bytes = b"") -> bytes:
    return (b"".join(field(4, s) for s in symbols)
            + b"".join(field(5, field(1, b"".join(map(varint, refs))) + SAMPLE + extra)
                       for refs in series))


def splicers() -> tuple[Splicer, Splicer]:
    native, python = Splicer(PLAN, "native"), Splicer(PLAN, "python")
    for sp in (native, python):
        sp.table.set(b"ml", b"p", (("karta_workload", "w"),))
    return native, python


def same_as_reference(raw: bytes) -> tuple[int, int, bool]:
    """Splices raw both ways (same body and counts, or the same error); answers the native
    splice's work stats."""
    native, python = splicers()
    try:
        res = native.splice_v2(raw)
    except DecodeError as exc:
        stats = _splice._v2_work_stats()
        with pytest.raises(DecodeError) as ref_exc:
            python.splice_v2(raw)
        assert (exc.kind, exc.status, str(exc)) == (
            ref_exc.value.kind, ref_exc.value.status, str(ref_exc.value))
        return stats
    stats = _splice._v2_work_stats()
    ref = python.splice_v2(raw)
    assert res.body == ref.body
    assert (res.attributed, res.counts, res.unattributed, res.stripped) == (
        ref.attributed, ref.counts, ref.unattributed, ref.stripped)
    return stats


def long_pods(length: int, n: int) -> bytes:
    """The audit's A1: namespace and pod values of `length` bytes, n tiny series naming
    them (pod unknown), and one series of a known pod (stamped)."""
    symbols = [b"", b"__name__", b"m", b"namespace", b"n" * length, b"pod", b"p" * length,
               b"ml", b"p"]
    return request(symbols, [[1, 2, 3, 4, 5, 6]] * n + [[1, 2, 3, 7, 5, 8]])


@pytest.mark.parametrize("length", [4096, 65536])
def test_long_pod_symbols_are_hashed_once_a_request(length: int) -> None:
    """Each long namespace / pod symbol is hashed once, whatever the number of series
    naming it (the old key hashed both values in full for every series: n x 2L bytes);
    short values are hashed where named, as in RW 1.0."""
    work: dict[int, int] = {}
    for n in (1000, 4000):
        key_bytes, cmp_bytes, ranked = same_as_reference(long_pods(length, n))
        work[n] = key_bytes
        assert not ranked and cmp_bytes == 0
        # the two long symbols once, and "ml" / "p" of the stamped series
        assert key_bytes == 2 * length + 3
    assert work[1000] == work[4000]


def common_prefix_names(length: int, n: int) -> bytes:
    """The audit's A2: two label names of `length` bytes with a common prefix, n series
    naming both (sorted, values empty)."""
    symbols = [b"", b"__name__", b"m", b"x" * length + b"a", b"x" * length + b"b"]
    return request(symbols, [[1, 2, 3, 0, 4, 0]] * n)


def test_long_names_with_a_common_prefix_cost_a_bounded_compare() -> None:
    """Past 1 MiB + 1 KiB a series of long-name comparisons, the symbols are ranked once
    and the names compare by rank: the bytes compared stop growing with the series (the
    old splice compared 64 KiB for every series: n x L)."""
    length = 65536
    work: dict[int, int] = {}
    for n in (1000, 4000):
        key_bytes, cmp_bytes, ranked = same_as_reference(common_prefix_names(length, n))
        assert ranked and key_bytes == 0
        work[n] = cmp_bytes
        # the budget (reached after ~17 series), then the sort of the five symbols
        assert cmp_bytes <= (1 << 20) + 1024 * n + 16 * length, cmp_bytes
    assert work[4000] == work[1000]


def test_short_names_are_not_counted_nor_ranked() -> None:
    symbols = [b"", b"__name__", b"m", b"namespace", b"ml", b"pod", b"p", b"zone", b"a"]
    raw = request(symbols, [[1, 2, 3, 4, 5, 6, 7, 8]] * 500 + [[7, 8, 1, 2]] * 10)
    assert same_as_reference(raw)[1:] == (0, False)


def test_ranked_names_order_as_their_bytes() -> None:
    """Long names with a common prefix (one a prefix of another, some duplicated as two
    symbols), in series sorted, unsorted, stamped and with a sender's karta_* label: the
    budget passed in the first series, every later comparison is by rank, and the output,
    the counts and every refusal (a name repeated through two symbols of one string) are
    the reference's."""
    rnd = random.Random(7)
    prefix = b"l" * 70_000  # 16 comparisons of two such names pass the 1 MiB budget
    tails = [b"", b"a", b"ab", b"b", b"ba", b"c", b"\xc3\xa9", b"\x7f"]
    base = [b"", b"__name__", b"m", b"namespace", b"ml", b"pod", b"p", b"v", b"karta_x"]
    names = [prefix + t for t in tails]
    lead_names = [prefix + bytes([0x41 + i]) * 2 for i in range(17)]
    dups = [prefix + b"a", prefix + b"ba"]  # the same strings as two of `names`
    symbols = base + names + lead_names + dups
    first, nnames = len(base), len(names)
    lead = [1, 2] + [r for k in range(first + nnames, first + nnames + 17) for r in (k, 7)]
    errors = 0
    for _ in range(16):
        series: list[list[int]] = []
        for _ in range(40):
            picked = rnd.sample(range(first, first + nnames), rnd.randint(1, 5))
            if rnd.random() < 0.02:
                picked.append(rnd.choice(range(len(symbols) - 2, len(symbols))))
            labels = [[1, 2]] + [[k, 7] for k in picked]
            if rnd.random() < 0.5:
                labels += [[3, 4], [5, 6]]
            if rnd.random() < 0.1:
                labels.append([8, 7])
            if rnd.random() < 0.7:
                labels.sort(key=lambda lab: symbols[lab[0]])
            else:
                rnd.shuffle(labels)
            series.append([ref for lab in labels for ref in lab])
        raw = request(symbols, [lead, *series])
        try:
            splicers()[0].splice_v2(raw)
        except DecodeError:
            errors += 1
        assert same_as_reference(raw)[2]  # ranked
    assert 0 < errors < 16
    # a name repeated through two symbols of one string, found by rank
    raw = request(symbols, [lead, [1, 2, first + 1, 7, len(symbols) - 2, 7]])
    with pytest.raises(DecodeError, match="repeated"):
        splicers()[0].splice_v2(raw)
    assert same_as_reference(raw)[2]


def meta(type_: int, help_ref: int, unit_ref: int) -> bytes:
    return varint(1 << 3) + varint(type_) + varint(3 << 3) + varint(help_ref) + varint(
        4 << 3) + varint(unit_ref)


def long_help(length: int, n: int) -> bytes:
    """The audit's A3b: n series with metadata whose help is one `length`-byte symbol
    (and a duplicate of it as another symbol, and the family names of a histogram's
    series), deduplicated to a few MetricMetadata."""
    h = b"h" * length
    symbols = [b"", b"__name__", b"m", h, b"u", b"x_bucket", b"x_count", h, b"x"]
    out = [field(4, s) for s in symbols]
    for i in range(n):
        if i % 3 == 0:
            out.append(field(5, field(1, varint(1) + varint(2)) + SAMPLE
                             + field(5, meta(1, 3 if i % 2 else 7, 4))))
        else:
            name = 5 + i % 2 if i % 4 else 8
            out.append(field(5, field(1, varint(1) + varint(name)) + SAMPLE
                             + field(5, meta(3, 7 if i % 2 else 3, 0))))
    return b"".join(out)


@pytest.mark.parametrize("length", [4096, 16384])
def test_conversion_hashes_each_metadata_symbol_once(length: int) -> None:
    """Byte for byte the reference's; the metadata strings' bytes hashed and compared stay
    at a few times the distinct symbols' (the old set hashed every series' help: n x L,
    and compared it on every hit)."""
    work: dict[int, int] = {}
    for n in (600, 2400):
        raw = long_help(length, n)
        out = native_v2_to_v1(raw)
        work[n] = _splice._convert_stats()
        assert out == convert.v2_to_v1(raw)
        # h twice (two symbols, one content: hashed and compared), m, u, x, x_*'s family
        assert work[n] <= 4 * length + 64, work[n]
    assert work[600] == work[2400]
