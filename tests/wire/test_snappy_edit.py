"""The splice's output as a snappy block made from the sender's block
(``Splicer.splice_snappy``, ``proxy/wire/_snappy_edit.c``), against the reference.

The contract: for a block that decodes to the request (``raw``, or the part of it from
``base``), the native splice answers a snappy block (``encoded``) that decodes, with any
strict decoder, to exactly the body the pure-Python splice makes of ``raw``; its counts
and tallies are the reference's. A block that does not hold together (truncated, a
declared length short of the request, an element that reads past it) is not used: the
body is then compressed as before, and is still the reference's. Nothing here may crash
or read out of bounds (the bounded fuzz run, ``fuzz_native.py``, tries that too).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import snappy
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.handler import splice_in_parts
from proxy.wire.native import Splicer, native_available, split_v1
from proxy.wire.plan import SpliceResult
from proxy.wire.primitives import Protocol, len_field
from tests.wire.fuzz_native import (
    WIDE_PODS,
    Gen,
    Setup,
    encode,
    random_setup,
    sender_block,
    splicers,
)
from tests.wire.snappy_blocks import element_kinds, random_block
from tests.wire.test_native_differential import SETTINGS, examples, randoms

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

PROTOCOLS = {1: Protocol.V1, 2: Protocol.V2}


def reference_body(python: Splicer, version: int, raw: bytes) -> bytes:
    res = python.splice_v1(raw) if version == 1 else python.splice_v2(raw)
    return bytes(res.body)


def check_edit(native: Splicer, python: Splicer, version: int, raw: bytes, block: bytes
               ) -> bytes:
    """The native block decodes to the reference body; counts and tallies agree."""
    protocol = PROTOCOLS[version]
    ref = python.splice_v1(raw) if version == 1 else python.splice_v2(raw)
    got = native.splice_snappy(protocol, raw, block)
    assert got.encoded, f"a consistent block was not used: {raw.hex()}"
    decoded = snappy.uncompress(got.body)
    assert decoded == bytes(ref.body), (
        f"RW {version}.0: the edited block decodes to other bytes\ninput: {raw.hex()}\n"
        f"block: {block.hex()}\nnative: {got.body.hex()}")
    assert (got.counts, got.attributed, got.unattributed, got.stripped) == (
        ref.counts, ref.attributed, ref.unattributed, ref.stripped)
    if bytes(ref.body) == raw:  # nothing changed: the sender's block goes out as it came
        assert got.body is block or snappy.uncompress(got.body) == raw
    return got.body


@SETTINGS
@given(rnd=randoms, setup_rnd=randoms, version=st.sampled_from([1, 2]))
def test_edited_blocks_decode_to_the_reference(rnd: random.Random, setup_rnd: random.Random,
                                               version: int) -> None:
    gen = Gen(rnd)
    raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
    native, python = splicers(random_setup(setup_rnd))
    check_edit(native, python, version, raw, sender_block(raw, rnd))


@settings(SETTINGS, max_examples=examples(60))
@given(rnd=randoms, setup_rnd=randoms, version=st.sampled_from([1, 2]))
def test_wide_requests_with_many_stamps(rnd: random.Random, setup_rnd: random.Random,
                                        version: int) -> None:
    # many series of many pods: stamps written again as copies of their first, by field
    gen = Gen(rnd, huge=False, pods=WIDE_PODS, series=(100, 500))
    raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
    native, python = splicers(random_setup(setup_rnd, WIDE_PODS))
    check_edit(native, python, version, raw, sender_block(raw, rnd))


@settings(SETTINGS, max_examples=examples(300))
@given(rnd=randoms, setup_rnd=randoms, pieces=st.integers(2, 5))
def test_parts_from_one_block_join_to_the_whole(rnd: random.Random, setup_rnd: random.Random,
                                                pieces: int) -> None:
    # the handler's requests in parts (``splice_in_parts``): each part's block made from
    # the whole request's block at the part's offset, the blocks joined behind one preamble
    raw = encode(Gen(rnd, huge=False).request_v1())
    block = sender_block(raw, rnd)
    native, python = splicers(random_setup(setup_rnd))

    def part(piece: bytes | memoryview, whole: bytes, base: int) -> SpliceResult:
        got = native.splice_snappy(Protocol.V1, piece, whole, base)
        assert got.encoded, "a part's block was compressed again, not made from the sender's"
        return got

    merged, joined = splice_in_parts(raw, block, split_v1(raw, pieces), part, _PARTS)
    ref = python.splice_v1(raw)
    assert snappy.uncompress(joined) == bytes(ref.body)
    assert (merged.counts, merged.attributed, merged.unattributed, merged.stripped) == (
        ref.counts, ref.attributed, ref.unattributed, ref.stripped)


_PARTS = ThreadPoolExecutor(1, thread_name_prefix="test-part")


def _broken(block: bytes, rnd: random.Random) -> bytes:
    how = rnd.choice(["truncate", "short", "garbage", "flip"])
    if how == "truncate":
        return block[:rnd.randrange(len(block))]
    if how == "short":  # a declared length short of the request
        return b"\x01" + block[len(snappy.compress(b"")) :]
    if how == "garbage":
        return bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 40)))
    b = bytearray(block)
    b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
    return bytes(b)


@settings(SETTINGS, max_examples=examples(400))
@given(rnd=randoms, setup_rnd=randoms, version=st.sampled_from([1, 2]))
def test_a_block_that_does_not_hold_is_not_used(rnd: random.Random, setup_rnd: random.Random,
                                                version: int) -> None:
    # never a crash or a read past its end; when the edit cannot use it, the body is
    # compressed as before: the reference's all the same
    gen = Gen(rnd, huge=False)
    raw = encode(gen.request_v1() if version == 1 else gen.request_v2())
    native, python = splicers(random_setup(setup_rnd))
    block = _broken(sender_block(raw, rnd), rnd)
    got = native.splice_snappy(PROTOCOLS[version], raw, block)
    if got.encoded and got.body is block:
        return  # nothing to change: the block went out as the sender sent it
    if got.encoded:
        # the block held together (a flipped literal byte): the edit trusts the caller's
        # promise that it decodes to raw, so only its framing is checked here
        snappy.uncompress(got.body)
        return
    assert snappy.uncompress(got.body) == reference_body(python, version, raw)


def test_an_unchanged_request_goes_out_as_the_sender_compressed_it() -> None:
    # no pod in the table: nothing to stamp, so the sender's own block is the answer
    setup = random_setup(random.Random(3))
    empty = Splicer(setup.plan, "native")
    raw = len_field(1, len_field(1, len_field(1, b"__name__") + len_field(2, b"up"))
                 + len_field(2, b"\x09" + bytes(8) + b"\x10\x01"))
    block = snappy.compress(raw)
    got = empty.splice_snappy(Protocol.V1, raw, block)
    assert got.encoded and got.body is block


def test_the_python_splice_answers_a_compressed_body_too() -> None:
    rnd = random.Random(5)
    setup = random_setup(rnd)
    _, python = splicers(setup)
    raw = encode(Gen(rnd).request_v1())
    got = python.splice_snappy(Protocol.V1, raw, snappy.compress(raw))
    assert snappy.uncompress(got.body) == reference_body(python, 1, raw)


def test_realistic_stamps_cost_little_next_to_compressing_again() -> None:
    # 2,000 series of 200 pods of 20 workloads, in random order: the edited block is
    # within 15% of what compressing the spliced body again gives
    rnd = random.Random(11)
    pods = [(f"ns{w % 5}", f"wl{w}-{i}") for w in range(20) for i in range(10)]
    answers: list[tuple[bytes, bytes, tuple[tuple[str, str], ...] | str]] = [
        (ns.encode(), pod.encode(), (
        ("karta_component", "worker"), ("karta_kind", "Deployment"),
        ("karta_namespace", ns), ("karta_workload", pod.rsplit("-", 1)[0])))
        for ns, pod in pods]
    base_setup = random_setup(random.Random(1))
    setup = Setup("realistic", base_setup.plan, answers)
    native, python = splicers(setup)
    series = []
    for _ in range(2000):
        ns, pod = rnd.choice(pods)
        labels = sorted({b"__name__": b"container_cpu_usage_seconds_total",
                         b"container": b"app", b"namespace": ns.encode(),
                         b"pod": pod.encode(), b"node": b"node-%d" % rnd.randrange(50),
                         b"id": b"/kubepods/burstable/pod%032x" % rnd.getrandbits(128)}.items())
        lab = b"".join(len_field(1, len_field(1, k) + len_field(2, v)) for k, v in labels)
        sample = len_field(2, b"\x09" + rnd.randbytes(8) + b"\x10" + b"\x01")
        series.append(len_field(1, lab + sample))
    raw = b"".join(series)
    block = snappy.compress(raw)
    edited = check_edit(native, python, 1, raw, block)
    again = snappy.compress(reference_body(python, 1, raw))
    assert len(edited) <= 1.15 * len(again), (len(edited), len(again), len(block))


def far_request(n: int = 3000, rnd: random.Random | None = None) -> bytes:
    """RW 1.0 series of one pod whose `id` values repeat ~100 KiB apart: a sender's copies
    of them reach further back than a copy-2 can (copy-4)."""
    rnd = rnd or random.Random(7)
    ids = [b"/kubepods/burstable/pod%032x" % rnd.getrandbits(128) for _ in range(n // 2)]
    series = []
    for i in range(n):
        labels = sorted({b"__name__": b"container_memory_rss", b"namespace": b"ml",
                         b"pod": b"train-head", b"id": ids[i % len(ids)]}.items())
        lab = b"".join(len_field(1, len_field(1, k) + len_field(2, v)) for k, v in labels)
        series.append(len_field(1, lab + len_field(2, b"\x09" + bytes(8) + b"\x10\x01")))
    return b"".join(series)


def test_far_copies_go_out_as_copy4() -> None:
    # a source over 64 KiB back, in the sender's block and in ours (the stamps move it)
    raw = far_request()
    block = random_block(raw, random.Random(3))
    assert element_kinds(block)["copy4"] > 100
    setup = random_setup(random.Random(2))
    native, python = splicers(Setup("one-pod", setup.plan, [
        (b"ml", b"train-head", (("karta_workload", "train"), ("karta_kind", "Job")))]))
    edited = check_edit(native, python, 1, raw, block)
    assert element_kinds(edited)["copy4"] > 100
