"""Which splice runs: the native one (``_splice.c``) when it is built, else the pure-Python
reference, with a loud warning, since that one costs ~50-100x more CPU per series. The RW
2.0 -> 1.0 conversion follows the same build (``convert_v2``, ``convert_v2_form``: None
without it), chosen request by request in :mod:`proxy.wire.conversion`.

:class:`Splicer` is what the enrichment layer holds: a plan compiled for the chosen
implementation and that implementation's pod table. Both implementations answer the same
:class:`~proxy.wire.plan.SpliceResult` for the same request.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

from proxy.compression import DecodeError, compress
from proxy.wire import splice_v1 as _py_v1
from proxy.wire import splice_v2 as _py_v2
from proxy.wire.plan import LabelLimited, OverLimit, SplicePlan, SpliceResult
from proxy.wire.podtable import PodTable
from proxy.wire.primitives import Counts, Protocol, read_field

log = logging.getLogger("karta.wire")

_native: ModuleType | None
try:
    from proxy.wire import _splice
except ImportError as exc:  # not built: no compiler at install time
    _native = None
    NATIVE_MISSING = f"{exc}"
else:
    _native = _splice
    _splice.set_error_class(DecodeError)
    NATIVE_MISSING = ""

Implementation = Literal["native", "python"]
#: asked by a splice past its limit, with its estimate for the whole request: the new limit
Grow = Callable[[int], int]
#: the splice a new :class:`Splicer` uses unless told otherwise
DEFAULT: Implementation = "native" if _native is not None else "python"


def native_available() -> bool:
    return _native is not None


def warn_if_python() -> None:
    """The start-up warning when the native splice is missing."""
    if _native is None:
        log.warning(
            "native splice not built: running the pure-Python splice and RW 2.0 -> 1.0 "
            "conversion, ~50-100x the CPU per series; reinstall with a C compiler and the "
            "Python headers (python3 -m pip install -e .)",
            extra={"error": NATIVE_MISSING},
        )


def _compile(plan: SplicePlan) -> Any:
    """The plan as the native splice reads it: plain tuples and bytes."""
    assert _native is not None

    def pairs(ps: Any) -> list[tuple[bytes, bytes, list[tuple[bytes, Any, Any]]]]:
        return [
            (p.namespace, p.pod, [
                (u.label, tuple(sorted(u.literals)) if u.literals is not None else None,
                 None if u.literals is not None else u.matches)
                for u in p.unless
            ])
            for p in ps
        ]

    return _native.Plan(
        pairs(plan.pairs),
        [(r.prefix, pairs(r.pairs)) for r in plan.rules],
        plan.keep_sent,
        sorted(plan.stamped),
        plan.workload_label,
        plan.drop_sent,
        plan.max_labels,
        plan.cluster,
    )


class Splicer:
    """A plan and a pod table, spliced by one implementation."""

    def __init__(self, plan: SplicePlan, implementation: Implementation | None = None) -> None:
        impl = implementation or DEFAULT
        if impl == "native" and _native is None:
            raise RuntimeError(f"the native splice is not built: {NATIVE_MISSING}")
        self.plan = plan
        self.implementation: Implementation = impl
        self.table: Any
        if impl == "native":
            assert _native is not None
            self._compiled = _compile(plan)
            self.table = _native.PodTable()
        else:
            self._compiled = None
            self.table = PodTable()

    def splice_v1(self, raw: bytes | memoryview, limit: int | None = None,
                  grow: Grow | None = None) -> SpliceResult:
        """``limit``: the bytes the splice may hold beside ``raw`` (its scratch and what it
        adds; None: no limit). Past it ``grow(need)`` (``need``: the estimate for the whole
        request) answers the new limit, and when it gives none above what is held,
        :class:`~proxy.wire.plan.OverLimit`: the native splice stops before it holds more."""
        if self._compiled is None:
            return _within(_py_v1.splice_v1(bytes(raw), self.plan, self.table), raw, limit,
                           grow)
        assert _native is not None
        return _result(_native.splice_v1(raw, self._compiled, self.table, None, 0,
                                         _limit(limit), grow))

    def splice_v2(self, raw: bytes | memoryview, limit: int | None = None,
                  grow: Grow | None = None) -> SpliceResult:
        if self._compiled is None:
            return _within(_py_v2.splice_v2(bytes(raw), self.plan, self.table), raw, limit,
                           grow)
        assert _native is not None
        return _result(_native.splice_v2(raw, self._compiled, self.table, None, 0,
                                         _limit(limit), grow))

    def splice_snappy(self, protocol: Protocol, raw: bytes | memoryview, block: bytes,
                      base: int = 0, limit: int | None = None, grow: Grow | None = None
                      ) -> SpliceResult:
        """The splice with its body as a snappy block: ``block`` is the sender's snappy
        block, ``raw`` its decoded bytes from offset ``base`` (the whole of them, or the
        part of a request in parts).

        The native splice makes the block from the sender's own (``_snappy_edit.c``: its
        elements kept, their offsets moved, nothing compressed again); the reference
        compresses the spliced body. Either decodes to what :meth:`splice_v1` /
        :meth:`splice_v2` answer for ``raw``."""
        if self._compiled is None:
            result = (self.splice_v2(raw, limit, grow) if protocol is Protocol.V2
                      else self.splice_v1(raw, limit, grow))
            result.body = compress(result.body, "snappy")
            return result
        assert _native is not None
        splice = _native.splice_v2 if protocol is Protocol.V2 else _native.splice_v1
        result = _result(splice(raw, self._compiled, self.table, block, base, _limit(limit),
                                grow))
        if not result.encoded:  # a block the edit could not use: compressed as before
            result.body = compress(result.body, "snappy")
        return result


def _limit(limit: int | None) -> int:
    return -1 if limit is None else max(0, limit)


def _within(result: SpliceResult, raw: bytes | memoryview, limit: int | None,
            grow: Grow | None) -> SpliceResult:
    """The reference's limit: what it added, judged once made (it holds its output as it
    goes; the native splice stops before it holds more)."""
    grown = len(result.body) - len(raw)
    if limit is not None and grown > max(0, limit) and (grow is None or grow(grown) < grown):
        raise OverLimit(grown)
    return result


def split_v1(raw: bytes | memoryview, pieces: int) -> list[int]:
    """Where an RW 1.0 request can be cut into ``pieces`` parts spliced apart
    (:func:`proxy.wire.splice_v1.split_points`; the same cuts from either implementation,
    so either may split for a splicer of the other)."""
    if _native is None:
        return _py_v1.split_points(bytes(raw), pieces)
    cuts: list[int] = _native.split_v1(raw, pieces)
    return cuts


def _result(t: tuple[Any, ...] | int) -> SpliceResult:
    if isinstance(t, int):
        raise OverLimit(t)
    (body, series, samples, histograms, exemplars, attributed, reasons, stripped, encoded,
     limited, flooded, other_cluster) = t
    return SpliceResult(body, Counts(series, samples, histograms, exemplars), attributed, reasons,
                        stripped, encoded,
                        None if limited is None else LabelLimited(*limited), flooded,
                        other_cluster)


def field_count(raw: bytes) -> int:
    """How many top-level fields ``raw`` has: what :func:`field_ends` will hold, known
    before it is allocated (a request cut in parts charges it to its byte budget first).
    ``DecodeError`` for a field that cannot be read."""
    count = _native.field_ends(raw, True) if _native is not None else None
    if isinstance(count, int):
        return count
    return len(_walk(raw))


def field_ends(raw: bytes) -> memoryview:
    """The end of every top-level field of ``raw``, 4 bytes each (a list of ints was ~40
    a field, one field a series: 620k of them in a 31 MiB RW 2.0 body). ``DecodeError``
    for a field that cannot be read."""
    packed = _native.field_ends(raw) if _native is not None else None
    if isinstance(packed, bytes):
        return memoryview(packed).cast("I")
    return memoryview(_walk(raw))


def _walk(raw: bytes) -> array[int]:
    """The field ends read here: without the native module, or to raise the error of a
    field it could not read."""
    ends = array("I")
    pos, n = 0, len(raw)
    while pos < n:
        pos = read_field(raw, pos, n)[3]
        ends.append(pos)
    return ends


# -- RW 2.0 -> 1.0 ------------------------------------------------------------------------

#: the native conversion (``_convert.c``): a request's converted size (``size`` None) or
#: its bytes at that size, None when it leaves the request to the reference; None when
#: the extension is not built. Which conversion runs is :mod:`proxy.wire.conversion`'s.
convert_v2: Callable[..., int | bytes | None] | None = (
    _native.convert_v2 if _native is not None else None)
#: the native conversion's count of a request: (size, histograms, samples), the
#: reference's ``V1Form`` (custom-bucket histograms become classic series: fewer
#: histograms, more samples), None when it leaves the request to the reference; None
#: when the extension is not built
convert_v2_form: Callable[[bytes | memoryview], tuple[int, int, int] | None] | None = (
    _native.convert_v2_form if _native is not None else None)
