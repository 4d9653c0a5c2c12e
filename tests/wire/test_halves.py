"""Cutting a request at series boundaries (proxy.wire.halves): parts are requests of their
own, every series in exactly one, halves by bytes."""

from __future__ import annotations

from typing import Any, cast

import pytest

from proxy.compression import DecodeError
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2
from proxy.pb.prometheus import remote_pb2
from proxy.wire.halves import layout
from proxy.wire.primitives import Protocol, encode_uvarint

WriteRequest: Any = cast(Any, remote_pb2).WriteRequest
RequestV2: Any = cast(Any, v2).Request


def v1(sizes: list[int]) -> bytes:
    """Series whose label values are ``sizes`` bytes long, metadata between and after."""
    req = WriteRequest()
    for i, n in enumerate(sizes):
        ts = req.timeseries.add()
        ts.labels.add(name="pod", value=str(i) * n)
        ts.samples.add(value=float(i), timestamp=i)
    req.metadata.add(type=1, metric_family_name="m", help="h")
    return req.SerializeToString()


def test_the_middle_is_by_bytes_and_leaves_a_series_on_each_side() -> None:
    lay = layout(v1([1000, 10, 10, 10]), Protocol.V1)
    assert lay.middle(0, 4) == 1  # the big one alone: the others together are smaller
    assert lay.middle(1, 4) in (2, 3)  # three of a size: either is a half
    assert lay.middle(2, 4) == 3
    lay = layout(v1([10, 10, 10, 1000]), Protocol.V1)
    assert lay.middle(0, 4) == 3
    with pytest.raises(ValueError):
        lay.middle(2, 3)


def test_v1_parts_share_the_series_and_the_first_takes_the_rest() -> None:
    raw = v1([5, 6, 7, 8, 9])
    lay = layout(raw, Protocol.V1)
    assert len(lay.series) == 5 and len(lay.other) == 1
    first, second = WriteRequest.FromString(lay.part(0, 2)), WriteRequest.FromString(lay.part(2, 5))
    whole = WriteRequest.FromString(raw)
    assert list(first.timeseries) + list(second.timeseries) == list(whole.timeseries)
    assert len(first.metadata) == 1 and len(second.metadata) == 0
    assert lay.part(0, 5) == raw  # one slice: the whole, byte for byte


def test_v2_parts_each_carry_the_whole_symbol_table() -> None:
    req = RequestV2()
    req.symbols.extend(["", "pod", "a", "b", "c"])
    for ref in (2, 3, 4):
        ts = req.timeseries.add()
        ts.labels_refs.extend([1, ref])
        ts.samples.add(value=1.0, timestamp=ref)
    raw = req.SerializeToString()
    lay = layout(raw, Protocol.V2)
    parts = [RequestV2.FromString(lay.part(a, b)) for a, b in ((0, 1), (1, 3))]
    assert all(list(p.symbols) == list(req.symbols) for p in parts)
    assert [list(t.labels_refs) for p in parts for t in p.timeseries] == [[1, 2], [1, 3], [1, 4]]
    assert lay.part(0, 3) == raw


def test_unknown_fields_of_long_tags_stay_with_the_first_part_and_bad_bodies_raise() -> None:
    raw = v1([3, 4])
    # field 16, length-delimited: a two-byte tag whose first byte is 0x82
    unknown = encode_uvarint(16 << 3 | 2) + b"\x02" + b"\x0a\x00"
    lay = layout(unknown + raw, Protocol.V1)
    assert len(lay.series) == 2 and len(lay.other) == 2
    assert lay.part(1, 2) == raw[lay.series[1].start - len(unknown):lay.series[1].end
                                 - len(unknown)]
    assert lay.part(0, 1).startswith(unknown)
    one = layout(raw[:lay.series[0].end - len(unknown)], Protocol.V1)  # one field alone
    assert len(one.series) == 1 and not one.other
    with pytest.raises(DecodeError):
        layout(raw[:-1], Protocol.V1)
