"""The snapshot source: the pod index from a file or folder of Kubernetes objects.

A snapshot stands in for a live cluster (``--snapshot PATH``): the way to try the proxy
without one, to run it where the API server is out of reach, and to test it. It is the
same index the watches fill; the rest of the proxy cannot tell the two apart.

What a snapshot path holds is read by :mod:`proxy.object_files` (the formats accepted,
files and objects skipped with their reason, uids derived for objects written without
one); this module diffs it against what was applied before and feeds the difference to
the engine. Nothing here raises past the loader except a path that does not exist at
all, or one of which no file could be loaded at start.

With ``reload_seconds`` the source polls the files' mtimes and sizes and applies what
changed: changed and new objects are upserted, vanished ones deleted. A change is read
only once the files have stopped changing (the same at two polls in a row, by their
stamps or, rewritten in place, by their bytes; and through the read): a file saved in
place is read half-written otherwise, and a half file is often valid YAML (fewer
objects, a pod without its owner). A file that fails to parse
on reload keeps its previous objects, and a path that cannot be read at all (moved
away, not listable) keeps every object, without the index being marked fresh meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from proxy import memory
from proxy.index import PodIndex
from proxy.karta.batches import alone_if_failing, object_name
from proxy.karta.description import DescriptionError
from proxy.karta.engine import Engine
from proxy.karta.model import Description, GroupKind
from proxy.karta.owners import group_kind
from proxy.karta.results import ChangeSet
from proxy.metrics import present_at_zero
from proxy.object_files import (
    MAX_FILE_BYTES,
    FileContent,
    Held,
    ObjectStub,
    Pace,
    SkippedFile,
    SnapshotError,
    digest,
    read_file,
    snapshot_files,
    unpaced,
)
from proxy.tasks import cancel_and_wait
from proxy.tls_files import FileStamp, stamp
from proxy.yielding import (
    LOOP_RUN_SECONDS,
    RELOAD_DEFER_SECONDS,
    Busy,
    Pacer,
    Slices,
    ThreadPacer,
    in_runs,
)

log = logging.getLogger("karta.snapshot")

#: the ``freshness`` resource name this source marks
FRESHNESS_RESOURCE = "snapshot"
#: the engine's description source name for descriptions found in snapshot files
DESCRIPTION_SOURCE = "snapshot"
#: minimum poll interval for reloads
MIN_RELOAD_SECONDS = 0.2
#: polls a change of the files may wait for them to stop changing before it is logged
#: and counted (``karta_proxy_snapshot_changes_unapplied_total{reason="files_keep_changing"}``)
UNSETTLED_WARN_POLLS = 10
#: the operational counter of changes that could not be applied for long, by reason
UNAPPLIED_METRIC = "karta_proxy_snapshot_changes_unapplied"
#: its reasons, each present at 0 from the start: the files kept changing for
#: ``UNSETTLED_WARN_POLLS`` polls; the path (or a folder below it) could not be read
UNAPPLIED_REASONS: tuple[str, ...] = ("files_keep_changing", "path_unreadable")
#: bytes of a file hashed at a time (:func:`file_digest`)
DIGEST_CHUNK = 1 << 20
#: during the first load's application, what the engine built is collected and frozen
#: after this many seconds of runs (:meth:`SnapshotSource._apply_first`): 60 times at
#: 37.5k pods, a few ms each
FIRST_LOAD_FREEZE_SECONDS = 0.1


def _uid(obj: Held) -> str:
    if isinstance(obj, ObjectStub):
        return obj.uid
    uid: str = obj["metadata"]["uid"]
    return uid


def _same(old: Held | None, new: Held) -> bool:
    if old is None:
        return False
    if isinstance(new, ObjectStub):
        return isinstance(old, ObjectStub) and old.digest == new.digest
    if isinstance(old, ObjectStub):
        return old.digest == digest(new)
    return old == new


def _kind(obj: Held) -> str:
    return obj.kind if isinstance(obj, ObjectStub) else str(obj["kind"])


def _load(obj: Held) -> Mapping[str, Any]:
    return obj.load() if isinstance(obj, ObjectStub) else obj


def _group_kind(obj: Held) -> GroupKind:
    if isinstance(obj, ObjectStub):
        return group_kind(obj.api_version, obj.kind)
    return group_kind(str(obj["apiVersion"]), str(obj["kind"]))


def _has_body(obj: Held) -> bool:
    """The whole object is at hand: a parsed one, or a stub still carrying its text."""
    return not isinstance(obj, ObjectStub) or obj.text is not None


def full_kinds(engine: Engine) -> frozenset[GroupKind]:
    """The kinds whose objects the engine keeps whole.

    It keeps an object whole only if its kind wants it so when the object arrives: a
    kind that wants it later (a description added) must be fed its objects again, or
    its workloads read ``workload_object_missing`` until each object changes."""
    return frozenset(gk for gk, mode in engine.required_kinds().items() if mode == "full")


#: objects freed per step of :meth:`SnapshotContent.release`
RELEASE_SLICE = 2000


@dataclass
class SnapshotContent:
    """Every file of a snapshot path, parsed."""

    path: str
    files: dict[str, FileContent] = field(default_factory=dict)
    skipped: list[SkippedFile] = field(default_factory=list)

    def objects(self, pace: Pace = unpaced) -> dict[str, Held]:
        """Objects by uid; a later file (sorted order) wins over an earlier one."""
        out: dict[str, Held] = {}
        for fc in self.files.values():
            for obj in fc.objects:
                out[_uid(obj)] = obj
                pace()
        return out

    def compact(self, pace: Pace = unpaced) -> SnapshotContent:
        """This content as a source keeps it after applying it: every object that won
        (see :meth:`objects`) as an :class:`ObjectStub`; shadowed objects and those
        without a digest stay whole, so a later reload applies exactly what it did."""
        winners = {id(o) for o in self.objects(pace).values()}
        out = SnapshotContent(self.path, skipped=list(self.skipped))
        for path, fc in self.files.items():
            objs: list[Held] = []
            for o in fc.objects:
                pace()
                if id(o) not in winners:
                    objs.append(o)
                elif isinstance(o, ObjectStub):
                    objs.append(o.applied() if o.text is not None else o)
                else:
                    d = digest(o)
                    objs.append(ObjectStub(o, d) if d is not None else o)
            out.files[path] = replace(fc, objects=objs)
        return out

    def release(self, pace: Pace = unpaced) -> None:
        """Drop every object, a slice at a time. Freeing a whole content in one go (one
        ``del``) is one C call: ~30 ms with the GIL held at 37.5k pods, wherever it
        runs; in slices a worker thread frees it while the event loop keeps its turns.
        The file entries go too; the objects live on where another content holds them."""
        for fc in self.files.values():
            objs = fc.objects
            while objs:
                del objs[-RELEASE_SLICE:]
                pace()
        self.files.clear()

    def descriptions(self) -> list[Description]:
        return [d for fc in self.files.values() for d in fc.descriptions]

    def description_errors(self) -> list[DescriptionError]:
        return [e for fc in self.files.values() for e in fc.description_errors]

    def description_docs(self) -> list[tuple[str, Any]]:
        return [(fc.path, d) for fc in self.files.values() for d in fc.description_docs]


@dataclass
class SnapshotReport:
    """What a load did: counts by kind, what was skipped and why, the engine's answer."""

    path: str
    files: list[str] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    #: objects handed to the engine, by kind (descriptions under Karta / ResourceInterface)
    objects: Counter[str] = field(default_factory=Counter)
    invalid_objects: list[str] = field(default_factory=list)
    descriptions: list[str] = field(default_factory=list)
    description_errors: list[DescriptionError] = field(default_factory=list)
    #: the snapshot's valid descriptions another description wins over for their kind
    #: (not in force), each naming the winner
    description_losers: list[DescriptionError] = field(default_factory=list)
    uids_derived: int = 0
    pods_attributed: int = 0
    #: unattributed pods by the engine's reason
    pods_unattributed: Counter[str] = field(default_factory=Counter)
    workloads: int = 0
    changes: ChangeSet = field(default_factory=ChangeSet)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Nothing was skipped: every file, object and description loaded, and every
        description is in force."""
        return not (self.skipped or self.invalid_objects or self.description_errors
                    or self.description_losers)

    def problems(self) -> list[str]:
        return (
            [f"file skipped: {s}" for s in self.skipped]
            + [f"object skipped: {s}" for s in self.invalid_objects]
            + [f"description skipped: {e}" for e in self.description_errors]
            + [f"description not in force: {e}" for e in self.description_losers]
        )

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.objects.items()))
        unatt = sum(self.pods_unattributed.values())
        return (
            f"snapshot {self.path}: {len(self.files)} file(s), {kinds or 'no objects'}; "
            f"{self.workloads} workloads, {self.pods_attributed} pods attributed, "
            f"{unatt} unattributed; {len(self.skipped)} file(s), "
            f"{len(self.invalid_objects)} object(s), {len(self.description_errors)} "
            f"description(s) skipped; {self.seconds * 1000:.0f} ms"
        )


def read_snapshot(
    path: str | Path, *, max_bytes: int = MAX_FILE_BYTES, packed: bool = False,
    pace: Pace = unpaced, applied: Mapping[str, Held] | None = None,
) -> SnapshotContent:
    """Every file of a snapshot path, parsed; raises ``SnapshotError`` only for the path."""
    files, skipped = snapshot_files(path)
    content = SnapshotContent(str(path), skipped=list(skipped))
    for f in files:
        got = read_file(f, max_bytes=max_bytes, packed=packed, pace=pace, applied=applied)
        if isinstance(got, SkippedFile):
            content.skipped.append(got)
        else:
            content.files[got.path] = got
    return content


# -- feeding an engine ------------------------------------------------------------------------


def _feed_order(objs: Iterable[Held]) -> list[Held]:
    """Owners and workloads before pods: pods then attribute in one pass, not re-attribute."""
    items = list(objs)
    return [o for o in items if _kind(o) != "Pod"] + [o for o in items if _kind(o) == "Pod"]


def _upsert(engine: Engine, held: list[Held], report: SnapshotReport) -> ChangeSet:
    # objects held as text are parsed one at a time, as the engine takes them
    return alone_if_failing(held, lambda batch: engine.upsert_many(_load(o) for o in batch),
                            _skipping(report, lambda o: object_name(_load(o))))


def _skipping(report: SnapshotReport, name: Callable[[Any], str]
              ) -> Callable[[Any, Exception], None]:
    """What to do with an object the engine fails on (a bug, proxy.karta.batches): it is
    skipped and reported with the snapshot's other skipped objects, one log line each
    (``log_report``; the batch's traceback is logged once where it failed, not once per
    object: an engine bug that hits every pod would log tens of thousands)."""
    def failed(item: Any, error: Exception) -> None:
        report.invalid_objects.append(
            f"{name(item)}: engine error {type(error).__name__}: {error}")

    return failed


@dataclass
class ContentPlan:
    """What applying a content to the engine takes, worked out from the content alone
    (and the previous one): it can be made in a worker thread, off the event loop."""

    report: SnapshotReport
    #: the descriptions to set, or None: unchanged since the previous content
    descriptions: tuple[list[Description], list[DescriptionError]] | None
    gone: list[Mapping[str, Any]]
    #: new or changed objects, in feed order
    fresh: list[Held]
    #: when the descriptions changed, the other objects, in feed order: those of a kind
    #: the new descriptions make the engine keep whole are fed again (see
    #: :func:`full_kinds`); empty otherwise
    unchanged: list[Held] = field(default_factory=list)


def plan_content(content: SnapshotContent, previous: SnapshotContent | None = None,
                 pace: Pace = unpaced, old: Mapping[str, Held] | None = None
                 ) -> ContentPlan:
    """Diff ``content`` against ``previous`` (None: a first load, everything is new);
    ``old``: ``previous.objects()``, when the caller made it already.

    At 37.5k pods this is ~0.2 s of Python over every object; a reload makes it in a
    thread so that the event loop only waits for the engine's share (the changes)."""
    report = SnapshotReport(content.path, files=list(content.files), skipped=list(content.skipped))
    for fc in content.files.values():
        report.invalid_objects.extend(fc.invalid)
        report.uids_derived += fc.uids_derived
        for d in fc.descriptions:
            report.objects[d.form] += 1
    descs = content.descriptions()
    errors = content.description_errors()
    report.descriptions = [f"{d.name} ({d.group_kind})" for d in descs]
    report.description_errors = errors
    first = previous is None
    changed_descriptions = (first and bool(descs or errors)) or (
        previous is not None and content.description_docs() != previous.description_docs()
    )
    objs = content.objects(pace)
    if old is None:
        old = previous.objects(pace) if previous is not None else {}
    gone: list[Mapping[str, Any]] = []
    for uid, o in old.items():
        if uid not in objs:
            gone.append(o.as_object() if isinstance(o, ObjectStub) else o)
        pace()
    fresh: list[Held] = []
    unchanged: list[Held] = []
    for uid, o in objs.items():
        report.objects[_kind(o)] += 1
        # a stub without text is a kept file's object that won before too: applied as is
        if not (isinstance(o, ObjectStub) and o.text is None) and not _same(old.get(uid), o):
            fresh.append(o)
        elif changed_descriptions:
            unchanged.append(o)
        pace()
    return ContentPlan(report, (descs, errors) if changed_descriptions else None, gone,
                       _feed_order(fresh), _feed_order(unchanged))


def apply_plan(plan: ContentPlan, engine: Engine) -> SnapshotReport:
    """Hand a plan's changes to the engine; the report with the engine's answer."""
    for _ in apply_steps(plan, engine):
        pass
    return plan.report


def apply_steps(plan: ContentPlan, engine: Engine, index: PodIndex | None = None
                ) -> Iterator[None]:
    """:func:`apply_plan`, yielding where the event loop may run (runs of about
    ``LOOP_RUN_SECONDS``). With ``index``, each run's changes are applied to it at
    once, as a watch's are: another writer of the engine between two runs (a
    configuration reload's descriptions) applies its changes at once too, and this
    reload's older ones must not land after them. ``plan.report.changes`` gets them all
    either way."""
    started = time.monotonic()
    report = plan.report
    changes = report.changes = ChangeSet()
    slices = Slices(LOOP_RUN_SECONDS, first=16)

    def done(cs: ChangeSet) -> None:
        changes.merge(cs)
        if index is not None and cs:
            index.apply(cs)

    again: list[Held] = []
    if plan.descriptions is not None:
        descs, errors = plan.descriptions
        before = full_kinds(engine)
        change = engine.change_descriptions(descs, source=DESCRIPTION_SOURCE, errors=errors)
        done(change.changes)
        yield
        owed = change.owed
        owed_failed = _skipping(report, lambda uid: f"the re-attribution of {uid}")
        yield from slices.run(len(owed), lambda i, j: done(
            alone_if_failing(owed[i:j], engine.reattribute, owed_failed)))
        newly = full_kinds(engine) - before
        if newly:
            # a stub without its text is fed again by the source (SnapshotSource.follow_kinds)
            again = [o for o in plan.unchanged if _has_body(o) and _group_kind(o) in newly]
    gone, fresh = plan.gone, plan.fresh
    gone_failed = _skipping(report, lambda obj: f"the deletion of {object_name(obj)}")
    yield from slices.run(len(gone), lambda i, j: done(
        alone_if_failing(gone[i:j], engine.delete_many, gone_failed)))
    yield from slices.run(len(again), lambda i, j: done(_upsert(engine, again[i:j], report)))
    yield from slices.run(len(fresh), lambda i, j: done(_upsert(engine, fresh[i:j], report)))
    attributions = list(engine.pods())

    def count(i: int, j: int) -> None:
        for att in attributions[i:j]:
            if att.workload is not None:
                report.pods_attributed += 1
            else:
                report.pods_unattributed[att.reason or "unattributed"] += 1

    yield from slices.run(len(attributions), count)
    report.workloads = sum(1 for _ in engine.workloads())
    files = set(report.files)
    report.description_losers = [e for e in engine.selection_losers() if e.source in files]
    report.seconds += time.monotonic() - started


def apply_content(
    content: SnapshotContent, engine: Engine, *, previous: SnapshotContent | None = None
) -> SnapshotReport:
    """Feed parsed content to ``engine``; with ``previous``, only what changed since."""
    started = time.monotonic()
    plan = plan_content(content, previous)
    plan.report.seconds = time.monotonic() - started
    return apply_plan(plan, engine)


def load_snapshot(path: str | Path, engine: Engine) -> SnapshotReport:
    """Read a snapshot path and feed everything to ``engine``; never raises for bad files.

    Raises ``SnapshotError`` when the path does not exist. The returned report carries the
    engine's change set, for ``PodIndex.apply``.
    """
    started = time.monotonic()
    content = read_snapshot(path)
    report = apply_content(content, engine)
    report.seconds = time.monotonic() - started
    return report


@dataclass
class PathState:
    """A snapshot path as a poll finds it: the stamp of each of its files, or why the
    path itself cannot be read (then ``files`` is empty, and means nothing).

    ``digests``: a digest of the bytes of some files (those whose stamp had changed
    since the state before, :func:`path_state`), for each the bytes the file held at
    its stamp here. Not part of equality: two states are alike by their stamps."""

    files: dict[str, FileStamp] = field(default_factory=dict)
    unreadable: str | None = None
    digests: dict[str, bytes] = field(default_factory=dict, compare=False)


def file_digest(path: str, expected: FileStamp) -> bytes | None:
    """A digest of the file's bytes, if the file is at ``expected`` before and after they
    are read (else None: it is being written, and what was read is no state it was in).
    Read a chunk at a time: a snapshot file may be hundreds of megabytes."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            if FileStamp.of(os.fstat(f.fileno())) != expected:
                return None
            while chunk := f.read(DIGEST_CHUNK):
                h.update(chunk)
        if stamp(path) != expected:
            return None
    except OSError:
        return None
    return h.digest()


def with_digests(state: PathState, since: PathState | None) -> PathState:
    """``state`` with a digest of each file whose stamp differs from ``since`` (for the
    others, ``since``'s digest, where it had one: their bytes are those it hashed).

    What lets a file rewritten with the same bytes at every poll settle: its stamp
    never holds from one poll to the next, its bytes do (:func:`same_bytes`)."""
    if state.unreadable is not None or since is None or since.unreadable is not None:
        return state
    digests: dict[str, bytes] = {}
    for f, st in state.files.items():
        if since.files.get(f) == st:
            if f in since.digests:
                digests[f] = since.digests[f]
        elif (d := file_digest(f, st)) is not None:
            digests[f] = d
    return replace(state, digests=digests)


def same_bytes(before: PathState, now: PathState) -> bool:
    """Whether ``now`` holds the same files with the same bytes as ``before``: each at
    the same stamp, or (rewritten since) hashed alike at both."""
    if before.unreadable is not None or now.unreadable is not None:
        return False
    if before.files.keys() != now.files.keys():
        return False
    for f, st in now.files.items():
        if before.files[f] == st:
            continue
        d = now.digests.get(f)
        if d is None or before.digests.get(f) != d:
            return False
    return True


def path_state(path: str | Path, since: PathState | None = None) -> PathState:
    """Stat every file of a snapshot path (``snapshot_files``); never raises. With
    ``since``, the files whose stamp changed since are hashed (:func:`with_digests`)."""
    try:
        files, _ = snapshot_files(path)
    except SnapshotError as e:
        return PathState(unreadable=str(e))
    out: dict[str, FileStamp] = {}
    for f in files:
        with contextlib.suppress(OSError):  # gone since listed: as if not listed
            st = stamp(str(f))  # its inode too: a file renamed over it
            if st is not None:  # (None only for the path "")
                out[str(f)] = st
    return with_digests(PathState(out), since)


def log_report(report: SnapshotReport, *, reload: bool = False) -> None:
    for problem in report.problems():
        log.error("snapshot: %s", problem, extra={"snapshot": report.path})
    log.info(
        "snapshot reloaded" if reload else "snapshot loaded",
        extra={
            "snapshot": report.path,
            "files": len(report.files),
            "objects": dict(report.objects),
            "workloads": report.workloads,
            "pods_attributed": report.pods_attributed,
            "pods_unattributed": dict(report.pods_unattributed),
            "files_skipped": len(report.skipped),
            "objects_skipped": len(report.invalid_objects),
            "descriptions_skipped": len(report.description_errors),
            "descriptions_not_in_force": len(report.description_losers),
            "uids_derived": report.uids_derived,
            "seconds": round(report.seconds, 3),
        },
    )


def _compact_releasing(content: SnapshotContent, previous: SnapshotContent | None,
                       pace: Pace = unpaced) -> SnapshotContent:
    """``content`` compacted to keep; the read ``content`` and the ``previous`` kept one
    (None at the first load) released (in a worker thread, slice by slice, not freed on
    the event loop)."""
    kept = content.compact(pace)
    content.release(pace)
    if previous is not None:
        previous.release(pace)
    return kept


class SnapshotSource:
    """A source of the pod index, like the watches: ``start()`` loads, ``stop()`` ends polling."""

    def __init__(
        self,
        path: str | Path,
        engine: Engine,
        index: PodIndex,
        *,
        reload_seconds: float | None = None,
        busy: Busy | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.path = str(path)
        #: where the source's counter is served (the proxy's /metrics registry)
        self.registry = registry = (metrics_registry if metrics_registry is not None
                                    else CollectorRegistry())
        #: changes that could not be applied for long, by reason (UNAPPLIED_REASONS): the
        #: log says it once, this keeps the count an alert can read
        self.unapplied = present_at_zero(MetricCounter(
            UNAPPLIED_METRIC, "Times a change of the snapshot's files went unapplied for "
            "long, by reason: files_keep_changing (no two polls in a row found them alike, "
            "by stamp or by bytes, for snapshot.UNSETTLED_WARN_POLLS polls; once per such "
            "run), path_unreadable (the path or a folder below it could not be read; once "
            "each time it goes, every object kept and the index stale meanwhile).",
            ["reason"], registry=registry), UNAPPLIED_REASONS)
        #: whether a request is being relayed: a reload's work in its thread waits for it
        self.busy = busy
        self.engine = engine
        self.index = index
        self.reload_seconds = max(MIN_RELOAD_SECONDS, reload_seconds) if reload_seconds else None
        self.report: SnapshotReport | None = None
        self.reloads = 0
        self._content: SnapshotContent | None = None
        #: the path as it was when what is applied was read
        self._applied = PathState()
        #: the path as the last poll found it: a change is read once two polls agree
        self._seen = PathState()
        #: polls the current change has waited for the files to stop changing
        self._waited = 0
        #: why the last poll that found a change did not apply it (for the warning)
        self._unsettled_why = ""
        #: why the path cannot be read, from when it went until it is back; None: it can
        self._unreadable: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: the kinds the engine kept whole when this source last fed it (full_kinds)
        self._full: frozenset[GroupKind] = frozenset()
        #: objects of those kinds not yet fed whole: not found in the files as they were
        #: applied when :meth:`follow_kinds` read them (by uid, as then held)
        self._owed: dict[str, Held] = {}
        #: the files as they were before the read that missed them: a poll that finds
        #: the files as applied tries the owed again only once they are no longer so
        #: (files that stay broken are not read again at every poll)
        self._owed_at = PathState()
        #: a reload and a feeding of newly whole kinds each read ``_content`` and replace
        #: or feed from it: one at a time
        self._lock = asyncio.Lock()
        #: the pacers of the work in threads under way, abandoned at a stop
        self._pacers: weakref.WeakSet[ThreadPacer] = weakref.WeakSet()

    def _pacer(self, budget: float) -> ThreadPacer:
        pace = ThreadPacer(self.busy, budget)
        self._pacers.add(pace)
        return pace

    async def start(self) -> None:
        """Load, apply to the index, mark it ready and fresh; raises ``SnapshotError``.

        Read at once, however recently the files changed: there is nothing older to
        serve meanwhile. Nothing here holds the event loop long (see
        :meth:`_apply_first`): a stop, a probe, a SIGHUP are heard within a run."""
        self._applied = self._seen = await asyncio.to_thread(path_state, self.path)
        # paced for a stop only (no budget: nothing is relayed before the index is ready)
        pace = self._pacer(0.0)
        read_at = time.monotonic()
        content = await asyncio.to_thread(read_snapshot, self.path, packed=True, pace=pace)
        if not content.files:
            reasons = "; ".join(str(s) for s in content.skipped[:5]) or "no snapshot files"
            raise SnapshotError(f"snapshot {self.path}: nothing could be loaded: {reasons}")
        started = time.monotonic()
        plan = await asyncio.to_thread(plan_content, content, None, pace)
        # the apply is most of a long start (~5-8 s at 37.5k pods): the log says when
        log.info("snapshot read; applying it", extra={
            "snapshot": self.path, "objects": len(plan.fresh),
            "seconds": round(started - read_at, 3)})
        await self._apply_first(plan)
        report = self.report = plan.report
        report.seconds = time.monotonic() - started
        del plan
        self._full = full_kinds(self.engine)
        self._content = await asyncio.to_thread(_compact_releasing, content, None, pace)
        del content
        # the objects' texts are freed, the engine's records long-lived: what the last
        # run left is collected and frozen as the runs' were, and the freed heap handed
        # back off the loop. Not one collection of the whole heap (unfrozen first): it
        # held the loop 0.22-0.55 s at 37.5k pods
        memory.collect_and_freeze()
        await memory.trim_off_loop()
        self.index.ready = True
        self.index.mark_fresh(FRESHNESS_RESOURCE)
        log_report(report)
        if self.reload_seconds:
            self._task = asyncio.create_task(self._poll(), name="snapshot-reload")

    async def _apply_first(self, plan: ContentPlan) -> None:
        """The first load's changes to the engine, in runs of ``LOOP_RUN_SECONDS`` with a
        turn of the event loop after each, each run applied to the index at once.

        In one go this held the loop 4.7-7.6 s at 37.5k pods: a SIGTERM then waited for
        it (exit 6.5-7.0 s after the signal), as did the loop's every other task. In runs
        a stop cancels it between two. The splice sees no half-applied index: until
        ``index.ready`` every request is spliced unstamped (``Enricher.unstamped_splicer``),
        and the listener is not even open in snapshot mode. Nothing else writes the
        engine meanwhile: a configuration reload (SIGHUP) waits for the start
        (``Proxy.start`` holds its lock), and the polls start after it.

        What the engine builds is long-lived: every ``FIRST_LOAD_FREEZE_SECONDS`` of runs
        it is collected (only what is not frozen: a few ms) and frozen, so that the full
        collections the runs' allocations set off walk what came since, not everything
        built so far (up to 0.19 s each at 37.5k pods, unfrozen)."""
        memory.collect_and_freeze()
        frozen = time.monotonic()
        for _ in apply_steps(plan, self.engine, self.index):
            if time.monotonic() - frozen >= FIRST_LOAD_FREEZE_SECONDS:
                memory.collect_and_freeze()
                frozen = time.monotonic()
            await asyncio.sleep(0)

    async def stop(self) -> None:
        """Stop the polls, and end the work a reload (or the first load) left running in a
        thread at its next pause: cancelled, the coroutine stops waiting for it, but the
        thread ran on, and the process waited for it at its exit."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for pace in list(self._pacers):
            pace.abandon()

    async def reload(self, settled: PathState | None = None, *, rewritten: bool = False
                     ) -> SnapshotReport:
        """Apply what changed on disk since the last load (files that fail keep their
        objects; a path that cannot be read keeps them all).

        ``settled``: the path as two polls in a row found it (:meth:`poll`); the read is
        applied only if the files are still so before and after it, else dropped (the
        report names the path as skipped, changed while read). Without it, what is read
        is applied, as an explicit reload asks. ``rewritten``: the polls found the files'
        bytes alike, not their stamps (a writer rewriting the same content): the read is
        applied only if no file changed stamp while it was read and the bytes are still
        those the polls found (:func:`same_bytes`), so it is never a half-written file."""
        async with self._lock:
            report = await self._reload(settled, rewritten=rewritten)
            await self._follow_kinds()
        return report

    async def follow_kinds(self) -> int:
        """Feed the engine again the objects of the kinds it keeps whole since this source
        last fed it; returns how many. For a change of descriptions from elsewhere (a
        configuration reload); a reload of the snapshot does it itself.

        The engine keeps an object whole only if its kind was described when the object
        arrived (:func:`full_kinds`); once applied, this source keeps only stubs without
        the objects' text, so the files are read again for them. Rare (a kind newly
        described), and off the event loop as a reload's read is. An object not found
        in the files as it was applied is owed: tried again at the next call (each
        snapshot reload makes one) unless that reload brought a new version of it (fed
        whole) or took it away. Before, it was left to "the reload that change brings":
        files caught mid-rewrite, then written back with the same bytes, brought none,
        and its workload read ``workload_object_missing`` until the object changed."""
        async with self._lock:
            return await self._follow_kinds()

    async def _follow_kinds(self) -> int:
        if self._content is None:
            return 0
        now = full_kinds(self.engine)
        newly, self._full = now - self._full, now
        owed, self._owed = self._owed, {}
        if not newly and not owed:
            return 0
        held = self._content.objects()
        again = {uid: o for uid, o in held.items() if _group_kind(o) in newly}
        # those missed last time, unless a reload since brought a new version of them (fed
        # whole) or took them away, or their kind is no longer kept whole
        again.update((uid, o) for uid, o in ((uid, held.get(uid)) for uid in owed)
                     if o is not None and _same(owed[uid], o) and _group_kind(o) in now)
        if not again:
            return 0
        pace = self._pacer(RELOAD_DEFER_SECONDS)
        at = self._owed_at
        if any(not _has_body(o) for o in again.values()):
            # read with the stubs of every other object: only these get their text
            others = {uid: o for uid, o in held.items() if uid not in again}
            at = await asyncio.to_thread(path_state, self.path)
            try:
                read = await asyncio.to_thread(read_snapshot, self.path, packed=True,
                                               pace=pace, applied=others)
            except SnapshotError as e:
                log.error("snapshot: reading the objects of newly described kinds failed",
                          extra={"error": str(e)})
                read = SnapshotContent(self.path)
            found = read.objects(pace)
            del read
            for uid, o in list(again.items()):
                if _has_body(o):
                    continue
                new = found.get(uid)
                if new is not None and _has_body(new) and _same(o, new):
                    again[uid] = new
                else:  # changed or gone since, or not read: tried at the next call
                    del again[uid]
                    self._owed[uid] = o
            del found
        if self._owed:
            self._owed_at = at
            log.warning("snapshot: objects of newly described kinds not found in the files "
                        "as applied (changed since, or the files caught mid-rewrite or "
                        "unreadable); tried again at the next reload", extra={
                            "snapshot": self.path, "objects": len(self._owed)})
        feed = _feed_order(again.values())
        report = SnapshotReport(self.path)
        loop_pace = Pacer(self.busy, pace.remaining())
        await in_runs(len(feed), lambda i, j: self.index.apply(
            _upsert(self.engine, feed[i:j], report)), Slices(LOOP_RUN_SECONDS, first=16),
            loop_pace)
        for problem in report.invalid_objects:
            log.error("snapshot: object skipped: %s", problem, extra={"snapshot": self.path})
        log.info("snapshot: objects of newly described kinds fed again", extra={
            "snapshot": self.path,
            # a retry of owed objects has no kind newly described: theirs are named
            "kinds": sorted({str(gk) for gk in newly} | {str(_group_kind(o)) for o in feed}),
            "objects": len(feed)})
        return len(feed)

    def _path_unreadable(self, why: str) -> SnapshotReport:
        """The path cannot be read (moved away, not listable): every object last loaded
        from it is kept, the index is stale (the source is cut off, as the watches are
        from an unreachable API server) and not marked fresh until it is back, so its
        freshness ages and ``KartaIndexStale`` can fire. Read as a folder or file without
        any files, it deleted every pod, and the polls that followed, finding nothing
        changed in nothing, marked the empty index fresh. A warning when it goes (not
        one per poll); the report: the path skipped, nothing changed."""
        if self._unreadable is None:
            log.warning("snapshot: the path cannot be read; every object last loaded from "
                        "it is kept, and the index is stale until it is back",
                        extra={"snapshot": self.path, "error": why})
            self.unapplied.labels("path_unreadable").inc()
        self._unreadable = why
        self.index.stale = True
        return SnapshotReport(self.path, skipped=[SkippedFile(self.path, why)])

    def _path_readable(self) -> None:
        if self._unreadable is not None:
            log.info("snapshot: the path can be read again",
                     extra={"snapshot": self.path, "was": self._unreadable})
            self._unreadable = None
            self.index.stale = False

    async def _reload(self, settled: PathState | None = None, *, rewritten: bool = False
                      ) -> SnapshotReport:
        assert self._content is not None, "start() first"
        # a poll's settled state is the listing just made: a change since shows after the
        # read below, not by walking the path a second time in a row. Settled by bytes,
        # the stamps moved since (rewritten in place): the read must fall between two
        # rewrites, so the listing is made again right before it
        before = settled if settled is not None and not rewritten else await asyncio.to_thread(
            path_state, self.path)
        if before.unreadable is not None:
            return self._path_unreadable(before.unreadable)
        # the garbage since the last freeze, before this reload freezes what is alive
        memory.collect_unfrozen()
        pace = self._pacer(RELOAD_DEFER_SECONDS)
        # what the engine has: an unchanged object read again is its stub (see hold)
        applied = await asyncio.to_thread(self._content.objects, pace)
        try:
            content = await asyncio.to_thread(read_snapshot, self.path, packed=True, pace=pace,
                                              applied=applied)
        except SnapshotError as e:  # gone between the stat and the read
            return self._path_unreadable(str(e))
        if settled is not None:
            # a write begun during the read (the polls saw none before it)
            after = await asyncio.to_thread(path_state, self.path)
            if after != settled:
                # rewritten since the polls: if not during the read, what was read is
                # what they found only if the bytes are still theirs; if during it, the
                # next poll compares its bytes with these
                after = await asyncio.to_thread(with_digests, after, settled)
            if after != before or not same_bytes(settled, after):
                del applied  # the read freed in the thread, as a kept content is
                await asyncio.to_thread(content.release, pace)
                return self._changed_while_read(after)
            before = with_digests(after, settled) if after == settled else after
        self._path_readable()
        self._applied = self._seen = before
        # (a skipped file is named as its kept content is, both read from snapshot_files;
        # the path itself, spelled as given, is never looked up here: _path_unreadable)
        for s in content.skipped:
            kept = self._content.files.get(s.path)
            if kept is not None:  # unreadable now (half-saved?): keep its last good objects
                content.files[s.path] = kept
        content.files = dict(sorted(content.files.items()))
        # what was read lives until compacted: left tracked, the compaction's allocations
        # set off a full collection over all of it (72-88 ms, GIL held)
        memory.freeze_survivors()
        # the diff and the compaction read every object (~0.6 s at 37.5k pods): in a
        # thread, as the read is, so the event loop holds only for the engine's share
        started = time.monotonic()
        plan = await asyncio.to_thread(plan_content, content, self._content, pace, applied)
        plan.report.seconds = time.monotonic() - started
        report = plan.report
        # the engine's share on the loop, in runs that give way to the requests relayed
        # (proxy.yielding), each applied to the index at once; within what is left of the
        # reload's one budget
        loop_pace = Pacer(self.busy, pace.remaining())
        for _ in apply_steps(plan, self.engine, self.index):
            await loop_pace.pause()
        del plan, applied
        self._content = await asyncio.to_thread(_compact_releasing, content, self._content,
                                                pace)
        del content
        self.report = report
        self.reloads += 1
        # not a collection of the whole heap (unfrozen first): it held the loop ~0.55 s at
        # 37.5k pods, for nothing (a reload leaves no cyclic garbage: measured, and held
        # by test_a_reload_leaves_no_cyclic_garbage)
        memory.freeze_survivors()
        await memory.trim_off_loop()
        self.index.mark_fresh(FRESHNESS_RESOURCE)
        log_report(report, reload=True)
        return report

    def _changed_while_read(self, now: PathState) -> SnapshotReport:
        """The files changed between the polls that agreed and the read (or during it):
        nothing applied; read once they agree again."""
        self._seen = now
        self._unsettled_why = "they changed while they were read"
        return SnapshotReport(self.path, skipped=[SkippedFile(
            self.path, "changed while it was read: read again once it stops changing")])

    async def poll(self) -> bool:
        """One poll of the files: whether it applied a change.

        A change is read once two polls in a row find the files alike (mtime and size of
        each), so it lands one poll interval after the last write; a file saved in place
        (truncated, then written: a shell redirect, ``kubectl get > s.yaml``) was read
        half-written otherwise, and a multi-document file cut at a line end is valid YAML:
        the pods after the cut were deleted, a pod cut before its ``ownerReferences``
        stamped as a bare Pod. A writer pausing longer than a poll interval mid-file is
        still read half-written: only a write elsewhere and a rename into place is safe.

        Files whose stamps change at every poll but whose bytes do not (a writer
        rewriting the same content more often than the polls) are alike by their bytes:
        the files whose stamp changed since the last poll are hashed, and a change found
        with the same bytes at two polls in a row is read as a settled one is, applied
        only if the read falls between two rewrites (:meth:`reload`). Without that, such
        files were never applied. A change that has not settled after
        ``UNSETTLED_WARN_POLLS`` polls is logged once, with why, and counted.

        The index is marked fresh only when the files are as applied: not while a change
        waits, nor while the path cannot be read."""
        now = await asyncio.to_thread(path_state, self.path, self._seen)
        if now.unreadable is not None:
            self._path_unreadable(now.unreadable)
            self._seen = now
            return False
        self._path_readable()
        if now == self._applied or same_bytes(self._applied, now):
            # as applied, or rewritten with the bytes applied: nothing to read
            self._applied = self._seen = now
            self._waited = 0
            self.index.mark_fresh(FRESHNESS_RESOURCE)
            if self._owed and now != self._owed_at:
                # a read of the files missed them; as applied, they hold them
                async with self._lock:
                    await self._follow_kinds()
            return False
        if now == self._seen or same_bytes(self._seen, now):
            reloads = self.reloads
            await self.reload(settled=now, rewritten=now != self._seen)
            if self.reloads != reloads:
                self._waited = 0
                return True
            # changed while read, or gone since: not applied
        else:  # changed since the last poll: maybe still being written
            self._seen = now
            self._unsettled_why = "no two polls in a row found them alike"
        self._waited += 1
        if self._waited == UNSETTLED_WARN_POLLS:
            log.warning("snapshot: the files keep changing; a change is applied once two "
                        "polls in a row find them alike, by their stamps or their bytes "
                        "(write them elsewhere and rename them into place, or poll more "
                        "often than they are rewritten)",
                        extra={"snapshot": self.path, "polls": self._waited,
                               "reason": self._unsettled_why})
            self.unapplied.labels("files_keep_changing").inc()
        return False

    async def _poll(self) -> None:
        assert self.reload_seconds is not None
        while True:
            await asyncio.sleep(self.reload_seconds)
            try:
                await self.poll()
            except Exception:  # never let a reload end the process
                log.exception("snapshot: reload failed")
