"""The wire primitives (proxy.wire.primitives) read on their own: the protocol a
Content-Type names, what names a series, and the text a log line names it by."""

from __future__ import annotations

from typing import Any, cast

import pytest

from proxy.compression import DecodeError
from proxy.pb.prometheus import remote_pb2
from proxy.wire.primitives import Protocol, labels_of, protocol_from_content_type, series_text

WriteRequest: Any = cast(Any, remote_pb2).WriteRequest


# -- content negotiation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ct", "proto"),
    [
        ("application/x-protobuf", Protocol.V1),
        ("application/x-protobuf;proto=prometheus.WriteRequest", Protocol.V1),
        ("Application/X-Protobuf; proto=prometheus.WriteRequest", Protocol.V1),
        ("application/x-protobuf;proto=io.prometheus.write.v2.Request", Protocol.V2),
        ('application/x-protobuf; proto="io.prometheus.write.v2.Request"', Protocol.V2),
    ],
)
def test_protocol_from_content_type(ct: str, proto: Protocol) -> None:
    assert protocol_from_content_type(ct) is proto


def test_no_content_type_is_rw1() -> None:
    assert protocol_from_content_type("") is Protocol.V1


@pytest.mark.parametrize(
    "ct", ["application/json", "text/plain", "application/x-protobuf;proto=foo.Bar"]
)
def test_unsupported_content_type_is_415(ct: str) -> None:
    with pytest.raises(DecodeError) as info:
        protocol_from_content_type(ct)
    assert info.value.status == 415


# -- labels -------------------------------------------------------------------------------


def timeseries_field(labels: list[tuple[str, str]], value: float = 1.0) -> bytes:
    """One whole TimeSeries field (tag and length first), as a WriteRequest holds it."""
    req = WriteRequest()
    ts = req.timeseries.add()
    for name, value_ in labels:
        ts.labels.add(name=name, value=value_)
    ts.samples.add(value=value, timestamp=1000)
    return cast(bytes, req.SerializeToString())


def test_labels_of_is_what_names_the_series_whatever_its_sample() -> None:
    labels = [("__name__", "up"), ("job", "api")]
    one, other = timeseries_field(labels, 1.0), timeseries_field(labels, float("nan"))
    assert one != other
    assert labels_of(one) == labels_of(other)
    assert labels_of(one) != labels_of(timeseries_field([("__name__", "up")]))
    # the label fields themselves: a TimeSeries of them alone is the same series
    assert series_text(labels_of(one)) == 'up{job="api"}'


def test_labels_of_a_series_without_labels_is_empty() -> None:
    assert labels_of(timeseries_field([])) == b""


def test_series_text_names_the_metric_then_its_labels_in_order() -> None:
    field = timeseries_field([("job", "api"), ("__name__", "up"), ("pod", "a-1")])
    assert series_text(labels_of(field)) == 'up{job="api", pod="a-1"}'
    assert series_text(labels_of(timeseries_field([("job", "x")]))) == '{job="x"}'
    assert series_text(b"") == "{}"


def test_series_text_shows_bytes_that_are_not_utf8_replaced() -> None:
    # a Label of name "k" and value b"\xff": what a log line must still show, not refuse
    label = b"\x0a\x06" + b"\x0a\x01k" + b"\x12\x01\xff"
    assert series_text(label) == '{k="\ufffd"}'


def test_series_text_cuts_long_values_and_says_their_length() -> None:
    """A fact series refused for a 5000-byte label value (an id over the upstream's
    limit) is named in a log line: not with the value whole."""
    field = timeseries_field([("__name__", "up"), ("karta_instance", "i" * 5000), ("a", "b")])
    text = series_text(labels_of(field))
    assert text == 'up{karta_instance="' + "i" * 64 + '...(5000 bytes)", a="b"}'
