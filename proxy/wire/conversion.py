"""RW 2.0 -> 1.0 as the proxy runs it, request by request: the native conversion
(``_convert.c``: custom-bucket histograms to classic series and histogram staleness
markers included) when the extension is built and takes the request, else the reference
(:mod:`proxy.wire.convert`), which answers or raises as it always did. Each answer is the
reference's, byte for byte, and each ``V1Form`` its counts too.

The native conversion declines only what the reference refuses (it then raises its own
error) and what no sender makes: a custom-bucket histogram whose running delta sum or
span index leaves an int64, a size past a ``size_t``. The reference takes those whole."""

from __future__ import annotations

from proxy.wire import convert as _py_convert
from proxy.wire.convert import V1Form
from proxy.wire.native import convert_v2, convert_v2_form


def v1_form(raw_v2: bytes | memoryview) -> V1Form:
    """What an RW 2.0 request converts to (:func:`proxy.wire.convert.v1_form`), counted by
    the native conversion (``_convert.c``: ~100x less CPU, nothing of the conversion
    allocated) when it is built and takes the request, else by the reference, raising what
    it raises. The native one counts the size and the count changes alike (custom-bucket
    histograms and the markers that end them become classic series: ``histograms``
    fewer, ``samples`` more; a lone marker a float one), as the reference counts them."""
    counted = convert_v2_form(raw_v2) if convert_v2_form is not None else None
    if counted is not None:
        return V1Form(*counted)
    return _py_convert.v1_form(bytes(raw_v2))


def check_size(raw_v2: bytes, limit: int | None) -> V1Form:
    """:func:`proxy.wire.convert.check_size` counted by :func:`v1_form` (natively when it
    can)."""
    return _py_convert.check_size(raw_v2, limit, v1_form)


def v2_to_v1(raw_v2: bytes | memoryview, size: int | None = None) -> bytes:
    """An RW 2.0 request as RW 1.0 (:func:`proxy.wire.convert.v2_to_v1`, byte for byte):
    natively when the extension is built and takes the request, else the reference. The
    bytes are allocated once at their size: ``size`` is :func:`v1_form`'s of the request
    when the caller has it (counting again is ~1/3 of the walk), else counted here."""
    if convert_v2 is not None:
        if size is None:
            counted = convert_v2(raw_v2)
            size = counted if isinstance(counted, int) else None
        if size is not None:
            out = convert_v2(raw_v2, size)
            if out is not None:
                assert isinstance(out, bytes)
                return out
    return _py_convert.v2_to_v1(bytes(raw_v2))
