"""RW 2.0 -> 1.0 as the proxy runs it, request by request: the native conversion
(``_convert.c``, custom-bucket histograms to classic series included) when the extension
is built and takes the request; the series it leaves to the reference (those with a
histogram staleness marker) converted by the reference and the rest natively
(:mod:`proxy.wire.mixed`); else the reference (:mod:`proxy.wire.convert`), which
answers or raises as it always did. Each answer is the reference's, byte for byte, and
each ``V1Form`` its counts too."""

from __future__ import annotations

from proxy.wire import convert as _py_convert
from proxy.wire import mixed
from proxy.wire.convert import V1Form
from proxy.wire.native import convert_v2, convert_v2_form


def v1_form(raw_v2: bytes | memoryview) -> V1Form:
    """What an RW 2.0 request converts to (:func:`proxy.wire.convert.v1_form`), counted by
    the native conversion (``_convert.c``: ~100x less CPU, nothing of the conversion
    allocated) when it is built and takes the request, else by the reference. The native
    one counts the size and the count changes alike (custom-bucket histograms become
    classic series: ``histograms`` fewer, ``samples`` more, as the reference counts them);
    it leaves histogram staleness markers and anything malformed to the reference: a
    request with such series is counted by both, those series by the reference and the
    rest natively (:mod:`proxy.wire.mixed`), and the reference takes the whole only when
    that fails, raising what it raises."""
    counted = convert_v2_form(raw_v2) if convert_v2_form is not None else None
    if counted is not None:
        return V1Form(*counted)
    if convert_v2_form is not None:
        form = mixed.form(bytes(raw_v2), convert_v2_form)
        if form is not None:
            return form
    return _py_convert.v1_form(bytes(raw_v2))


def check_size(raw_v2: bytes, limit: int | None) -> V1Form:
    """:func:`proxy.wire.convert.check_size` counted by :func:`v1_form` (natively when it
    can)."""
    return _py_convert.check_size(raw_v2, limit, v1_form)


def v2_to_v1(raw_v2: bytes | memoryview, size: int | None = None) -> bytes:
    """An RW 2.0 request as RW 1.0 (:func:`proxy.wire.convert.v2_to_v1`, byte for byte):
    natively when the extension is built and takes the request, the series it leaves to
    the reference by the reference and the rest natively when it does not
    (:mod:`proxy.wire.mixed`), else the reference. The bytes are allocated once at their
    size: ``size`` is :func:`v1_form`'s of the request when the caller has it (counting
    again is ~1/3 of the walk), else counted here."""
    if convert_v2 is not None:
        if size is None:
            counted = convert_v2(raw_v2)
            size = counted if isinstance(counted, int) else None
        if size is not None:
            out = convert_v2(raw_v2, size)
            if out is not None:
                assert isinstance(out, bytes)
                return out
        made = mixed.converted(bytes(raw_v2), convert_v2)
        if made is not None:
            return made
    return _py_convert.v2_to_v1(bytes(raw_v2))
