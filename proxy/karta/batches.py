"""Engine calls over a batch that one object's engine failure cannot fail whole.

The engine is fed in batches (a watch's slice of events, a snapshot's runs, what a
description change owes). An exception from the engine is a bug, but a bug on one object
must cost that object only: its batch is given again one object at a time, and each
object the engine still fails on is reported, never raised. Every writer of the engine
(the watches, the snapshot, a configuration reload) goes through :func:`alone_if_failing`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from proxy.karta.results import ChangeSet, PartialBatch

log = logging.getLogger(__name__)

T = TypeVar("T")


def alone_if_failing(items: Sequence[T], call: Callable[[Sequence[T]], ChangeSet],
                     failed: Callable[[T, Exception], None]) -> ChangeSet:
    """``call(items)``; if the engine fails on them, ``call`` on each item alone, and
    ``failed(item, error)`` for each it fails on again (count it, log it, report it).

    What the batch changed before its failure (``PartialBatch.changes``) comes first in
    the answer: the engine holds it already, and given again, those objects are unchanged
    and give nothing. Engine failures are bugs, logged with their tracebacks; this keeps
    them from costing the rest of the batch, not from costing anything."""
    cs = ChangeSet()
    try:
        return call(items)
    except Exception as e:
        log.exception("engine failed on a batch of %d; retrying object by object", len(items))
        _salvage(e, cs)
    for item in items:
        try:
            cs.merge(call([item]))
        except Exception as e:
            failed(item, _salvage(e, cs))
    return cs


def _salvage(error: Exception, cs: ChangeSet) -> Exception:
    """What the engine changed before ``error`` (a :class:`PartialBatch`'s changes),
    merged into ``cs``; the error to report: the engine's own, not the wrapper."""
    if not isinstance(error, PartialBatch):
        return error
    if error.changes is not None:
        cs.merge(error.changes)
    return error.__cause__ if isinstance(error.__cause__, Exception) else error


def object_name(obj: Mapping[str, Any]) -> str:
    """``Kind namespace/name``: how an object the engine failed on is named in a log line
    or a report."""
    md = obj.get("metadata") or {}
    return f"{obj.get('kind')} {md.get('namespace', '')}/{md.get('name')}"
