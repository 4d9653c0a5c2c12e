"""The native splice against the pure-Python reference, on random requests.

The contract (``proxy/wire/native.py``): for the same plan, table contents and request
bytes, both give a byte-identical body (the input object itself when nothing changes),
equal counts, attributed and unattributed tallies, or both raise ``DecodeError`` with the
same kind and status.

Requests come from the wire-level generator in ``fuzz_native.py`` (driven by hypothesis'
``st.randoms()``): RW 1.0 and 2.0 with the pair labels, DCGM names, karta_ labels sent by
the sender, unsorted and duplicated names, empty values, long and multi-byte strings,
labels after samples, unknown fields at every level, non-minimal varints, exemplars,
histograms, metadata, unpacked / split refs, repeated symbols, refs above 127, empty
symbol tables, series without labels, series with and without a cluster label (the
plan's value, another, empty); plans with either policy, with and without rules, literal
and regex ``unless`` (the regex one calls back into Python from C), with and without the
cluster check (its label the usual one, one a pair reads, a long one). Invalid
requests are valid ones poisoned in a way that is certainly refused (field number 0 or
past 2^29 - 1, groups, wire types 6 / 7, over-long varints, lengths past the end, wrong
wire types for known fields, invalid UTF-8, odd refs, refs past the table, a first
symbol that is not empty) or mutated byte-wise (both must still agree).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from proxy.compression import DecodeError
from proxy.enrichment import build_plan
from proxy.pb.io.prometheus.write.v2 import types_pb2 as pb2
from proxy.pb.prometheus import remote_pb2
from proxy.wire.native import Splicer, native_available, split_v1
from proxy.wire.plan import renumbered
from proxy.wire.splice_v1 import series_before, split_points
from tests.wire.fuzz_native import (
    POISONS_V1,
    POISONS_V2,
    WIDE_PODS,
    Gen,
    Outcome,
    Setup,
    both,
    encode,
    expected_kind,
    fixed_setups,
    key,
    mutate,
    outcome,
    poison,
    random_setup,
    splicers,
    varint,
)

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

# The generator draws from a ``random.Random`` that hypothesis seeds (``use_true_random``:
# its own choice-tracking Random costs ~20x more per example, and shrinks a request built
# from thousands of draws slowly and poorly). So no shrink phase either: every assertion
# message carries the failing input as hex.
#: KARTA_DIFF_SCALE=20 runs 20x the examples (a longer hunt than CI's)
SCALE = float(os.environ.get("KARTA_DIFF_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


SETTINGS = settings(
    max_examples=examples(1000),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
randoms = st.randoms(use_true_random=True)


def check_agree(setup: Setup, version: int, raw: bytes) -> tuple[Outcome, Outcome]:
    native, python = splicers(setup)
    nat, py = both(native, python, version, raw)
    assert nat == py, (
        f"native and python disagree on RW {version}.0, setup {setup.name}\n"
        f"input: {raw.hex()}\nnative: {nat.describe()}\npython: {py.describe()}"
    )
    return nat, py


def _counts_v1(raw: bytes) -> tuple[int, int, int, int]:
    req = remote_pb2.WriteRequest.FromString(raw)
    return (len(req.timeseries), sum(len(t.samples) for t in req.timeseries),
            sum(len(t.histograms) for t in req.timeseries),
            sum(len(t.exemplars) for t in req.timeseries))


def _counts_v2(raw: bytes) -> tuple[int, int, int, int]:
    req = pb2.Request.FromString(raw)
    return (len(req.timeseries), sum(len(t.samples) for t in req.timeseries),
            sum(len(t.histograms) for t in req.timeseries),
            sum(len(t.exemplars) for t in req.timeseries))


def check_valid(setup: Setup, version: int, raw: bytes) -> None:
    """Agreement, plus what a valid request must give: a result whose counts are what
    the generated classes count, a body they read, the input itself when unchanged."""
    nat, _ = check_agree(setup, version, raw)
    assert nat.ok, f"a valid request refused: {nat.describe()} for {raw.hex()}"
    counts = _counts_v1 if version == 1 else _counts_v2
    assert nat.counts == counts(raw)
    assert nat.attributed + sum(n for _, n in nat.unattributed) == nat.counts[0]
    if nat.same_object:
        return
    assert nat.body != raw, "an edit that changed nothing: the input object should come back"
    assert counts(nat.body) == nat.counts


@SETTINGS
@given(rnd=randoms, setup_rnd=randoms)
def test_valid_v1(rnd: random.Random, setup_rnd: random.Random) -> None:
    check_valid(random_setup(setup_rnd), 1, encode(Gen(rnd).request_v1()))


@SETTINGS
@given(rnd=randoms, setup_rnd=randoms)
def test_valid_v2(rnd: random.Random, setup_rnd: random.Random) -> None:
    check_valid(random_setup(setup_rnd), 2, encode(Gen(rnd).request_v2()))


@settings(SETTINGS, max_examples=examples(600))
@given(rnd=randoms, setup_rnd=randoms, what=st.sampled_from(POISONS_V1))
def test_poisoned_v1(rnd: random.Random, setup_rnd: random.Random, what: str) -> None:
    check_poisoned(rnd, setup_rnd, 1, what)


@settings(SETTINGS, max_examples=examples(600))
@given(rnd=randoms, setup_rnd=randoms, what=st.sampled_from(POISONS_V2))
def test_poisoned_v2(rnd: random.Random, setup_rnd: random.Random, what: str) -> None:
    check_poisoned(rnd, setup_rnd, 2, what)


def check_poisoned(rnd: random.Random, setup_rnd: random.Random, version: int,
                   what: str) -> None:
    """A request with one ``what`` defect: both splices refuse it, as that defect's kind."""
    gen = Gen(rnd, huge=False)
    nodes = gen.request_v1() if version == 1 else gen.request_v2()
    poison(nodes, version, what, rnd)
    raw = encode(nodes)
    nat, _ = check_agree(random_setup(setup_rnd), version, raw)
    assert not nat.ok, f"{what}: an invalid request accepted: {raw.hex()}"
    assert nat.error == (expected_kind(what), 400)


@settings(SETTINGS, max_examples=examples(1000))
@given(rnd=randoms, setup_rnd=randoms, version=st.sampled_from([1, 2]),
       parse_as=st.sampled_from(["same", "same", "same", "other"]),
       steps=st.integers(1, 4))
def test_mutated(rnd: random.Random, setup_rnd: random.Random, version: int, parse_as: str,
                 steps: int) -> None:
    """Byte-level mutants (truncation, flips, inserts, over-long varints, edited lengths,
    wrong wire types, bad UTF-8), also read as the other protocol: same answer."""
    gen = Gen(rnd, huge=False)
    raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
    for _ in range(steps):
        raw = mutate(raw, rnd)
    check_agree(random_setup(setup_rnd), version if parse_as == "same" else 3 - version, raw)


# -- fixed cases, each on the fuzzer's setups (default plan, keep, no rules, regex) ---------

SETUPS = fixed_setups(7)


def f(num: int, *parts: bytes) -> bytes:
    """A length-delimited field."""
    payload = b"".join(parts)
    return key(num, 2) + varint(len(payload)) + payload


def lab(name: bytes, value: bytes) -> bytes:
    return f(1, f(1, name), f(2, value))


SAMPLE = bytes.fromhex("09000000000000f03f1000")
POD_LABELS = lab(b"namespace", b"ml") + lab(b"pod", b"train-head")
EDGE_V1 = {
    "empty": b"",
    "empty series": f(1),
    "series with an empty label": f(1, f(1)),
    "labels after a sample": f(1, f(2, SAMPLE), POD_LABELS),
    "labels around a sample": f(1, lab(b"namespace", b"ml"), f(2, SAMPLE), lab(b"pod", b"ghost")),
    "truncated length": b"\x0a",
    "length past the end": b"\x0a\x05",
    "11-byte varint length": b"\x0a" + b"\x80" * 10 + b"\x00",
    "10-byte varint past 64 bits": b"\x08" + b"\xff" * 9 + b"\x02",
    "10-byte varint of 2^63": b"\x08" + b"\x80" * 9 + b"\x01",
    "field number 0": b"\x00\x01",
    "field number 2^29": key(2**29, 0) + b"\x01",
    "field number 2^29 - 1": key(2**29 - 1, 0) + b"\x01",
    "group start": b"\x0b",
    "group end": b"\x0c",
    "wire type 6": b"\x0e",
    "wire type 7 in a series": f(1, b"\x0f"),
    "timeseries as varint": b"\x08\x01",
    "label as fixed32": f(1, b"\x0d\x00\x00\x00\x00"),
    "name as varint": f(1, f(1, b"\x08\x01")),
    "sample as varint": f(1, b"\x10\x01"),
    "a label running past its series": f(1, b"\x0a\x05\x0a\x01"),
    "overlong utf-8 in a name": f(1, lab(b"\xc0\xaf", b"v"), POD_LABELS),
    "surrogate in a value": f(1, POD_LABELS, lab(b"n", b"\xed\xa0\x80a")),
    "f5 in a value": f(1, lab(b"n", b"\xf5\x80\x80\x80")),
    "truncated utf-8 at the end": f(1, lab(b"n", b"\xe2\x82")),
    "bad utf-8 in an overridden name": f(1, f(1, f(1, b"\xff"), f(1, b"n"))),
    "stamped pod, over-long label tag": f(1, b"\x8a\x00" + POD_LABELS[1:]),
}
SYMS = f(4) + f(4, b"namespace") + f(4, b"ml") + f(4, b"pod") + f(4, b"train-head")
EDGE_V2 = {
    "empty": b"",
    "empty series": f(5),
    "empty symbol": f(4),
    "no symbols, series without refs": f(5, f(1)),
    "no symbols, a ref": f(5, f(1, b"\x00")),
    "odd refs": f(4) + f(5, f(1, b"\x00")),
    "ref past the table": f(4) + f(5, f(1, b"\x00\x01")),
    "first symbol not empty": f(4, b"x") + f(5),
    "stamped, symbols after the series": f(5, f(1, b"\x01\x02\x03\x04")) + SYMS,
    "stamped, symbols around the series": SYMS[:13] + f(5, f(1, b"\x01\x02\x03\x04"))
    + SYMS[13:],
    "stamped, unpacked refs": SYMS + f(5, b"\x08\x01\x08\x02\x08\x03\x08\x04"),
    "stamped, refs split": SYMS + f(5, f(1, b"\x01"), f(2, SAMPLE), f(1, b"\x02\x03\x04")),
    "refs as fixed64": f(4) + f(5, b"\x09" + bytes(8)),
    "refs as fixed32": f(4) + f(5, b"\x0d" + bytes(4)),
    "surrogate symbol": f(4) + f(4, b"\xed\xa0\x80"),
    "overlong symbol": f(4) + f(4, b"\xc0\xaf"),
    "bad first symbol": f(4, b"\xff"),
    "symbols as varint": b"\x20\x00",
    "series as fixed32": b"\x2d" + bytes(4),
    "huge ref": f(4) + f(5, f(1, b"\xff" * 9 + b"\x01" + b"\x00")),
    "ref of 2^32": f(4) + f(5, f(1, varint(2**32) + b"\x00")),
    "refs with a truncated varint": SYMS + f(5, f(1, b"\x01\x82")),
    # the largest named (the native splice named the first, 5: the audit's case)
    "two refs past the table": f(4) + f(4, b"a") + f(4, b"b") + f(5, f(1, b"\x05\x09")),
    "a ref past 2^32 after one past the table": f(4) + f(5, f(1, b"\x07" + varint(2**33))),
}


@pytest.mark.parametrize("raw", list(EDGE_V1.values()), ids=list(EDGE_V1))
def test_edge_cases_v1(raw: bytes) -> None:
    for setup in SETUPS:
        check_agree(setup, 1, raw)


@pytest.mark.parametrize("raw", list(EDGE_V2.values()), ids=list(EDGE_V2))
def test_edge_cases_v2(raw: bytes) -> None:
    for setup in SETUPS:
        check_agree(setup, 2, raw)


def test_a_ref_past_the_table_is_named_alike() -> None:
    """The refusal's text is compared (``fuzz_native.worded``): both name the largest ref."""
    nat, _ = check_agree(SETUPS[0], 2, EDGE_V2["two refs past the table"])
    assert "symbol reference 9 past the table of 3" in nat.message


def test_generated_requests_are_attributed_often() -> None:
    """The generator is worth its examples: many series name a pod the table stamps,
    and many requests change (so the splice paths, not only the pass-through, run), and
    many series lose a sender's karta_* label (the drop paths, stamped or not), and some
    go unstamped for the label limit."""
    rnd = random.Random(11)
    stats = {1: [0, 0, 0, 0, 0], 2: [0, 0, 0, 0, 0]}
    for i in range(200):
        version = 1 + i % 2
        gen = Gen(rnd, huge=False)
        raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
        nat, _ = check_agree(SETUPS[i % len(SETUPS)], version, raw)
        assert nat.ok
        stats[version][0] += nat.counts[0]
        stats[version][1] += nat.attributed
        stats[version][2] += not nat.same_object
        stats[version][3] += nat.stripped
        stats[version][4] += dict(nat.unattributed).get("label_limit", 0)
    for version, (series, attributed, changed, stripped, limited) in stats.items():
        assert attributed > series // 5, (version, stats)
        assert changed > 20, (version, stats)
        assert stripped > 20, (version, stats)
        assert limited > 1, (version, stats)


def _many_pairs_agree(pairs: list[tuple[str, str]]) -> None:
    """A plan of these pairs compiles on both sides, and a series named through its last
    pair is stamped alike."""
    setup = Setup(f"{len(pairs)} pairs", build_plan(pairs, [], "replace"),
                  [(b"ml", b"p", (("karta_workload", "w"),))])
    ns, pod = pairs[-1]
    raw = f(1, lab(ns.encode(), b"ml"), lab(pod.encode(), b"p"), lab(b"a", b"b"))
    nat, _ = check_agree(setup, 1, raw)
    assert nat.attributed == 1 and not nat.same_object


def test_a_plan_of_many_pairs_compiles_natively() -> None:
    _many_pairs_agree([(f"ns_label_{i}", f"pod_label_{i}") for i in range(29)])
    rnd = random.Random(3)
    names = list(dict.fromkeys(
        "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz_", k=12)) for _ in range(980)))
    _many_pairs_agree(list(zip(names[0::2], names[1::2], strict=False)))


@pytest.mark.parametrize("pairs", [
    [(f"ns_{i}_of_cluster", f"pod_{i}_of_cluster") for i in range(1, 10)],
    [(f"ns{i}", f"pod{i}") for i in range(91)],
], ids=["9 pairs", "91 numbered pairs"])
def test_a_plan_of_similar_names_compiles_natively(pairs: list[tuple[str, str]]) -> None:
    """Names of one length with the same first, middle and last byte share one of the
    native plan's name buckets (pod10, pod20, .. pod90): a full bucket must not refuse
    the plan (it did, as the 64-name limit before it)."""
    _many_pairs_agree(pairs)


@settings(SETTINGS, max_examples=examples(40))
@given(rnd=randoms, setup_rnd=randoms, version=st.sampled_from([1, 2]))
def test_wide_requests(rnd: random.Random, setup_rnd: random.Random, version: int) -> None:
    """Hundreds of series over hundreds of pods, each pod with stamp values and reasons of
    its own: the native splice's per-request tables (appended symbols, the memo of each
    stamp's refs, the reason tally) grow past their first size."""
    gen = Gen(rnd, huge=False, pods=WIDE_PODS, series=(100, 500))
    raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
    check_valid(random_setup(setup_rnd, WIDE_PODS, unique=True), version, raw)


# -- a request in parts (the handler splices big RW 1.0 requests so, one part per worker) --


def in_parts(splicer: Splicer, raw: bytes, cuts: list[int]) -> Outcome:
    """The outcome of splicing the parts one by one, summed as the handler sums them: the
    bodies joined, the counts added, the first part's error in request order, the first
    label_limit series of the first part that has one (and other_cluster value)."""
    bodies, counts, attributed, stripped = [], [0, 0, 0, 0], 0, 0
    limited = other = None
    reasons: dict[str, int] = {}
    for a, b in itertools.pairwise([0, *cuts, len(raw)]):
        part = outcome(splicer.splice_v1, raw[a:b])
        if not part.ok:  # naming its series by the index in the whole, as the handler does
            err = renumbered(DecodeError(*part.error, part.message), series_before(raw, a))
            return dataclasses.replace(part, message=err.message)
        bodies.append(part.body)
        counts = [x + y for x, y in zip(counts, part.counts, strict=True)]
        attributed += part.attributed
        stripped += part.stripped
        limited = limited or part.label_limited
        other = other or part.other_cluster
        for reason, n in part.unattributed:
            reasons[reason] = reasons.get(reason, 0) + n
    body = b"".join(bodies)
    return Outcome(True, body, body == raw, (counts[0], counts[1], counts[2], counts[3]),
                   attributed, tuple(sorted(reasons.items())), stripped=stripped,
                   label_limited=limited, other_cluster=other)


def check_parts(setup: Setup, raw: bytes, pieces: int) -> list[int]:
    """Both implementations cut where the reference does, and the parts, spliced apart,
    give what the whole gives (both implementations)."""
    cuts = split_points(raw, pieces)
    assert cuts == split_v1(raw, pieces), f"native cuts differ for {raw.hex()}"
    assert cuts == sorted(set(cuts)) and all(0 < c < len(raw) for c in cuts)
    assert len(cuts) < pieces
    for splicer in splicers(setup):
        whole = outcome(splicer.splice_v1, raw)
        parts = in_parts(splicer, raw, cuts)
        if whole.ok:
            # "same object" is the whole's notion; the parts' is "the same bytes"
            whole = dataclasses.replace(whole, same_object=whole.body == raw)
        assert parts == whole, (
            f"{splicer.implementation}: {pieces} parts at {cuts} differ from the whole\n"
            f"input: {raw.hex()}\nparts: {parts.describe()}\nwhole: {whole.describe()}")
    return cuts


@settings(SETTINGS, max_examples=examples(300))
@given(rnd=randoms, setup_rnd=randoms, pieces=st.integers(1, 5),
       defect=st.sampled_from(["none", "none", "poison", "mutate"]))
def test_parts_splice_as_the_whole(rnd: random.Random, setup_rnd: random.Random, pieces: int,
                                   defect: str) -> None:
    gen = Gen(rnd, huge=False)
    nodes = gen.request_v1()
    if defect == "poison":
        poison(nodes, 1, rnd.choice(POISONS_V1), rnd)
    raw = encode(nodes)
    if defect == "mutate":
        raw = mutate(raw, rnd)
    check_parts(random_setup(setup_rnd), raw, pieces)


def test_parts_cut_near_the_fractions() -> None:
    series = [f(1, lab(b"__name__", b"m%02d" % i), lab(b"pod", b"p")) for i in range(100)]
    raw = b"".join(series)
    size = len(series[0])
    cuts = check_parts(SETUPS[0], raw, 4)
    assert len(cuts) == 3
    for k, cut in enumerate(cuts, 1):
        assert cut % size == 0 and 0 <= cut - len(raw) * k // 4 < size
    assert split_points(b"\x0a\xff\xff\x03" + raw, 2) == []  # the first field runs past the end
    # a truncated last series is past the last cut: the last part gets the whole's error
    assert check_parts(SETUPS[0], raw[:-1], 4) == cuts
    assert split_points(series[0] * 3, 8) == [size, 2 * size]  # fewer fields than pieces
    assert split_points(raw, 1) == [] and split_points(b"", 3) == []
    with pytest.raises(ValueError):
        split_v1(raw, 0)
