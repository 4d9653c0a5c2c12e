"""Body encodings: round trips, limits checked before allocation, corrupt input -> 4xx."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import cramjam
import pytest
import snappy

from proxy.compression import (
    ZSTD_WALK_STEPS,
    DecodeError,
    SnappyPart,
    block_part,
    compress,
    decompress,
    decompress_scratch,
    join_snappy,
    snappy_declared_length,
    zstd_declared_length,
)

DATA = b"container_cpu_usage_seconds_total" * 3000


@pytest.mark.parametrize("encoding", ["snappy", "zstd", "SNAPPY", " zstd "])
def test_round_trip(encoding: str) -> None:
    assert decompress(compress(DATA, encoding), encoding, max_decoded=len(DATA)) == DATA


def test_snappy_is_block_format() -> None:
    # the block format starts with the varint of the decoded length; framed starts with ff
    body = compress(DATA, "snappy")
    assert snappy_declared_length(body) == len(DATA)
    assert snappy.uncompress(body) == DATA


def _err(body: bytes, encoding: str, max_decoded: int = 1 << 20) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decompress(body, encoding, max_decoded=max_decoded)
    return info.value


@pytest.mark.parametrize("encoding", ["", "identity", "gzip", "br", "snappy-framed"])
def test_unsupported_encoding_is_415(encoding: str) -> None:
    e = _err(compress(DATA, "snappy"), encoding)
    assert (e.status, e.kind) == (415, "unsupported_encoding")
    assert "snappy or zstd" in e.message


@pytest.mark.parametrize("encoding", ["snappy", "zstd"])
def test_empty_body_is_400(encoding: str) -> None:
    e = _err(b"", encoding)
    assert (e.status, e.kind) == (400, "empty_body")


def test_limit_exactly_at_the_boundary() -> None:
    body = compress(DATA, "snappy")
    assert decompress(body, "snappy", max_decoded=len(DATA)) == DATA
    e = _err(body, "snappy", max_decoded=len(DATA) - 1)
    assert (e.status, e.kind) == (413, "too_large")


def test_snappy_bomb_refused_from_the_header_alone() -> None:
    # declares 4 GiB - 1 and carries nothing: refused before any allocation
    bomb = b"\xff\xff\xff\xff\x0f" + b"\x00" * 16
    e = _err(bomb, "snappy", max_decoded=64 << 20)
    assert (e.status, e.kind) == (413, "too_large")
    assert str(0xFFFFFFFF) in e.message


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xff\xff\xff\xff\xff",  # length header never ends
        b"\x80",  # truncated header
        b"\x05abc",  # declares 5, literal missing
        compress(DATA, "snappy")[:50],  # truncated
        b"\x0a" + b"\xfe" * 40,  # garbage
    ],
)
def test_corrupt_snappy_is_400(body: bytes) -> None:
    e = _err(body, "snappy")
    assert (e.status, e.kind) == (400, "snappy_corrupt")


def test_snappy_that_lies_about_its_length_is_400() -> None:
    body = compress(DATA, "snappy")
    # replace the header (3 bytes for ~100 KB) by a smaller declared length
    lie = b"\x0a" + body[3:]
    e = _err(lie, "snappy")
    assert e.status == 400


def test_zstd_declared_size_checked_before_decompressing() -> None:
    body = compress(DATA, "zstd")
    assert zstd_declared_length(body) == len(DATA)
    e = _err(body, "zstd", max_decoded=len(DATA) - 1)
    assert (e.status, e.kind) == (413, "too_large")


def _zstd_streamed(data: bytes) -> bytes:
    comp = cramjam.zstd.Compressor()
    comp.compress(data)
    return bytes(comp.finish())


def test_zstd_without_declared_size_is_bounded() -> None:
    bomb = _zstd_streamed(b"\x00" * (16 << 20))  # ~16 MiB of zeros in a few hundred bytes
    assert zstd_declared_length(bomb) is None
    assert len(bomb) < 4096
    e = _err(bomb, "zstd", max_decoded=2 << 20)
    assert (e.status, e.kind) == (413, "too_large")
    # and within the limit it decodes (the buffer grows to fit)
    assert len(decompress(bomb, "zstd", max_decoded=16 << 20)) == 16 << 20


def test_zstd_header_walk_is_bounded() -> None:
    # 15 MB of empty frames were 1.75M steps of Python walking headers on the event loop
    # (6 s); past ZSTD_WALK_STEPS frames and blocks the body declares no size
    empty = bytes(cramjam.zstd.compress(b""))  # a frame and its one block: two steps
    assert zstd_declared_length(empty * (ZSTD_WALK_STEPS // 2)) == 0
    many = empty * (ZSTD_WALK_STEPS // 2 + 1)
    assert zstd_declared_length(many) is None
    assert decompress(many, "zstd", max_decoded=1 << 20) == b""  # in C, to the limit
    bomb = empty * 1_000_000
    assert zstd_declared_length(bomb) is None


def test_zstd_multiple_frames() -> None:
    body = compress(b"a" * 1000, "zstd") + _zstd_streamed(b"b" * 1000)
    assert decompress(body, "zstd", max_decoded=2000) == b"a" * 1000 + b"b" * 1000


@pytest.mark.parametrize(
    "body",
    [
        b"\x28\xb5\x2f\xfd",
        b"garbage!",
        compress(DATA, "zstd")[:-3],
        compress(DATA, "zstd")[:12] + b"\x00" * 40,
    ],
)
def test_corrupt_zstd_is_400(body: bytes) -> None:
    e = _err(body, "zstd")
    assert (e.status, e.kind) == (400, "zstd_corrupt")


def test_compress_refuses_unknown_encoding() -> None:
    with pytest.raises(ValueError):
        compress(DATA, "gzip")


def snappy_part(data: bytes) -> SnappyPart:
    """One part of a body compressed on its own, as a worker compresses its part."""
    return block_part(compress(data, "snappy"))


@pytest.mark.parametrize("cuts", [[], [1], [5, 17], [len(DATA) // 2], [0, 0, 10]])
def test_parts_compressed_apart_join_into_one_block(cuts: list[int]) -> None:
    # repetitive data: every part's back-copies reach far back inside the part only
    bounds = [0, *cuts, len(DATA)]
    parts = [snappy_part(DATA[a:b]) for a, b in itertools.pairwise(bounds)]
    joined = join_snappy(parts)
    assert snappy_declared_length(joined) == len(DATA)
    assert snappy.uncompress(joined) == DATA
    assert bytes(cramjam.snappy.decompress_raw(joined)) == DATA
    assert decompress(joined, "snappy", max_decoded=len(DATA)) == DATA


def test_joined_block_has_one_preamble_of_any_width() -> None:
    big = bytes(range(256)) * 600  # 153,600 bytes: a three-byte length preamble
    joined = join_snappy([snappy_part(big), snappy_part(b""), snappy_part(big[:100])])
    assert snappy.uncompress(joined) == big + big[:100]
    assert join_snappy([snappy_part(b"")]) == snappy.compress(b"")


# -- the scratch buffers -------------------------------------------------------------------


def test_scratch_decode_is_the_decode() -> None:
    from proxy.compression import decompress_scratch

    for data in (b"", b"x", DATA, bytes(range(256)) * 5000):
        body = compress(data, "snappy") if data else snappy.compress(b"")
        out = decompress_scratch(body, "snappy", max_decoded=1 << 24)
        assert bytes(out) == data
    # zstd has no scratch buffer: bytes, as from decompress
    z = compress(DATA, "zstd")
    assert decompress_scratch(z, "zstd", max_decoded=1 << 24) == DATA


def test_scratch_view_is_reused_by_the_next_call_of_the_thread() -> None:
    """The contract the splice relies on: a view is good until the thread's next call."""
    from proxy.compression import decompress_scratch

    a = decompress_scratch(compress(b"a" * 5000, "snappy"), "snappy", max_decoded=1 << 20)
    kept = bytes(a)
    b = decompress_scratch(compress(b"b" * 5000, "snappy"), "snappy", max_decoded=1 << 20)
    assert bytes(b) == b"b" * 5000
    assert bytes(a) == b"b" * 5000 != kept  # the same memory, overwritten


def test_scratch_grows_and_a_live_view_of_the_old_buffer_stays_valid() -> None:
    from proxy.compression import decompress_scratch

    small = decompress_scratch(compress(b"s" * 1000, "snappy"), "snappy", max_decoded=1 << 24)
    big = decompress_scratch(compress(b"B" * (3 << 20), "snappy"), "snappy",
                             max_decoded=1 << 24)
    assert bytes(small) == b"s" * 1000  # the old mapping lives while a view does
    assert bytes(big) == b"B" * (3 << 20)


def test_scratch_is_per_thread() -> None:
    import threading

    from proxy.compression import decompress_scratch

    bodies = {i: compress(bytes([65 + i]) * 200_000, "snappy") for i in range(4)}
    seen: dict[int, bool] = {}
    start = threading.Barrier(4)

    def work(i: int) -> None:
        start.wait()
        ok = True
        for _ in range(30):
            out = decompress_scratch(bodies[i], "snappy", max_decoded=1 << 20)
            ok &= bytes(out) == bytes([65 + i]) * 200_000
        seen[i] = ok

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == dict.fromkeys(range(4), True)


def test_scratch_decode_refuses_what_decompress_refuses() -> None:
    from proxy.compression import decompress_scratch

    body = compress(DATA, "snappy")
    with pytest.raises(DecodeError) as info:
        decompress_scratch(body[:-7], "snappy", max_decoded=1 << 20)
    assert (info.value.kind, info.value.status) == ("snappy_corrupt", 400)
    with pytest.raises(DecodeError) as info:
        decompress_scratch(body, "snappy", max_decoded=len(DATA) - 1)
    assert (info.value.kind, info.value.status) == ("too_large", 413)
    # a block that decodes to more than its header declares: refused, whatever room the
    # scratch buffer has past the declared length
    lying = bytes([10]) + compress(b"z" * 100_000, "snappy")[3:]
    with pytest.raises(DecodeError) as info:
        decompress_scratch(lying, "snappy", max_decoded=1 << 20)
    assert (info.value.kind, info.value.status) == ("snappy_corrupt", 400)


def test_past_the_scratch_size_bodies_are_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.compression as c

    monkeypatch.setattr(c, "SCRATCH_BYTES", 1000)
    kept = len(c._SCRATCH.decoded)
    out = c.decompress_scratch(compress(DATA, "snappy"), "snappy", max_decoded=1 << 20)
    # a mapping of its own, gone with the view: the thread keeps no bigger buffer
    assert out == DATA and out.obj is not c._SCRATCH.decoded  # type: ignore[union-attr]
    assert len(c._SCRATCH.decoded) == kept
    assert snappy.uncompress(c.compress(DATA, "snappy")) == DATA


def test_compress_through_scratch_is_snappys_block() -> None:
    for data in (b"", b"q", DATA, bytes(range(256)) * 9000):
        out = compress(data, "snappy")
        assert type(out) is bytes
        assert out == snappy.compress(data)
        assert snappy.uncompress(out) == data


def test_a_big_body_is_decoded_once_not_copied() -> None:
    # decoded into a buffer and then copied into bytes: two decoded bodies at once, for
    # every zstd request and every snappy one past the scratch buffer (up to
    # max_decoded_bytes each), and a zstd body that declares no size zeroed a buffer of
    # the whole limit first
    import tracemalloc

    import cramjam

    from proxy.compression import decompress_scratch

    raw = bytes(range(256)) * (16 << 12)  # 16 MiB
    for body, encoding in ((bytes(cramjam.zstd.compress(raw)), "zstd"),  # declares its size
                           (_zstd_without_size(raw), "zstd"),
                           (snappy.compress(raw), "snappy")):  # past the scratch buffer
        tracemalloc.start()
        try:
            out = decompress_scratch(body, encoding, max_decoded=64 << 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out == raw
        # decoded into a mapping of its own (untraced; resident only where written), no
        # copy of it on the heap
        assert peak < len(raw) // 4, (encoding, peak / len(raw))
        del out


def _zstd_without_size(raw: bytes) -> bytes:
    """A zstd frame that declares no content size (a streaming compressor's)."""
    import cramjam

    c = cramjam.zstd.Compressor()
    c.compress(raw)
    out = bytes(c.finish())
    from proxy.compression import zstd_declared_length

    assert zstd_declared_length(out) is None
    return out


def test_small_bodies_encoded_and_decoded_in_many_threads_at_once_stay_intact() -> None:
    # every thread's scratch buffers started as one shared page, used as it was for a
    # body that fit it: two threads encoding (or decoding) small bodies at once wrote
    # into the same page, and sent each other's bytes (parts of a request sent at once)
    bodies = [bytes([i]) * 40 + str(i).encode() * 300 for i in range(64)]

    def round_trip(body: bytes) -> bool:
        encoded = compress(body, "snappy")
        return bytes(decompress_scratch(encoded, "snappy", max_decoded=1 << 20)) == body \
            and snappy.uncompress(encoded) == body

    for _ in range(20):
        with ThreadPoolExecutor(8) as pool:  # fresh threads: fresh scratch buffers
            assert all(pool.map(round_trip, bodies))
