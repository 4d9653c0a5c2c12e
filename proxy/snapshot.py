"""The snapshot source: the pod index from a file or folder of Kubernetes objects.

A snapshot stands in for a live cluster (``--snapshot PATH``): the way to try the proxy
without one, to run it where the API server is out of reach, and to test it. It is the
same index the watches fill; the rest of the proxy cannot tell the two apart.

Accepted, in any mix, from a file or a folder (recursively; ``*.yaml``, ``*.yml``,
``*.json``, in sorted order):

- multi-document YAML;
- a ``kubectl get -A -o yaml`` (or ``-o json``) ``List``, and typed lists as the API serves
  them (``PodList`` items carry no ``kind``; it is taken from the list);
- JSON: one object, a List, or an array of objects;
- Karta (``run.ai``) and ResourceInterface (``optimization.nvidia.com``) descriptions
  among the objects: parsed with the file name as their source, invalid ones reported and
  skipped, the rest in force.

A file that cannot be read or parsed is reported with its reason and skipped; objects
that are not Kubernetes objects are reported and skipped; nothing here raises past the
loader except a path that does not exist at all. Objects without ``metadata.uid`` (hand
written snapshots) get a stable one derived from API group, kind, namespace and name, and
owner references without a uid get the same derivation, so owner chains still connect.

With ``reload_seconds`` the source polls the files' mtimes and applies what changed:
changed and new objects are upserted, vanished ones deleted. A file that fails to parse
on reload keeps its previous objects, so a half-written save never empties the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import yaml

from proxy import memory
from proxy.index import PodIndex
from proxy.karta.batches import alone_if_failing, object_name
from proxy.karta.description import DescriptionError, is_description_object, parse_description
from proxy.karta.engine import Engine
from proxy.karta.files import folder_files
from proxy.karta.model import Description, GroupKind
from proxy.karta.owners import group_kind
from proxy.karta.packed import Packed, pack
from proxy.karta.results import ChangeSet
from proxy.karta.slim import slim_pod
from proxy.karta.yamltext import (
    HANDED_OUT,
    Item,
    Refused,
    Reread,
    load_documents,
    read_documents,
    yaml_error,
)
from proxy.tasks import cancel_and_wait
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

SUFFIXES = (".yaml", ".yml", ".json")
#: one file's size limit; a 100k-pod ``kubectl get -o yaml`` is a few hundred MiB
MAX_FILE_BYTES = 1024 * 1024 * 1024
#: folders: files beyond this are reported and skipped
MAX_FILES = 10_000
#: the ``freshness`` resource name this source marks
FRESHNESS_RESOURCE = "snapshot"
#: the engine's description source name for descriptions found in snapshot files
DESCRIPTION_SOURCE = "snapshot"
#: minimum poll interval for reloads
MIN_RELOAD_SECONDS = 0.2

_UID_NAMESPACE = uuid.UUID("1b4e28ba-2fa1-41d2-883f-0016d3cca427")

class SnapshotError(Exception):
    """The snapshot path itself is unusable (missing, or no loadable file at all)."""


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class ObjectStub:
    """An object as a source holds it: its identity, a digest that tells whether the next
    read of it changed, and while it is still to be applied its JSON text.

    Read for a source, objects are held as text (``read_snapshot(packed=True)``): parsed
    dicts are ~5x their text, and a 37.5k-pod snapshot's would all be alive before the
    engine had seen one (~190 MB). Once applied, a source keeps only the identity and the
    digest, to apply only the difference on reload.
    """

    __slots__ = ("api_version", "digest", "kind", "name", "namespace", "text", "uid")

    def __init__(self, obj: Mapping[str, Any], digest: bytes, text: str | None = None) -> None:
        md = obj["metadata"]
        self.api_version: str = _intern(obj["apiVersion"])
        self.kind: str = _intern(obj["kind"])
        self.uid: str = md["uid"]
        self.name: str = md.get("name") or ""
        self.namespace: str = _intern(md.get("namespace") or "")
        self.digest = digest
        self.text = text

    def load(self) -> dict[str, Any]:
        """The object, parsed again from its text (only stubs still to be applied have it)."""
        assert self.text is not None, "an applied stub has no object any more"
        obj: dict[str, Any] = json.loads(self.text)
        return obj

    def applied(self) -> ObjectStub:
        """The stub without its text (slot by slot: ``copy.copy`` took 7 us, 0.4 s of a
        reload at 37.5k pods)."""
        out = ObjectStub.__new__(ObjectStub)
        out.api_version, out.kind, out.uid = self.api_version, self.kind, self.uid
        out.name, out.namespace, out.digest = self.name, self.namespace, self.digest
        out.text = None
        return out

    def as_object(self) -> dict[str, Any]:
        """The object as a deletion needs it (kind and uid; name for the log)."""
        return {"apiVersion": self.api_version, "kind": self.kind,
                "metadata": {"uid": self.uid, "name": self.name, "namespace": self.namespace}}


def _text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def digest(obj: Mapping[str, Any]) -> bytes | None:
    """A digest equal only for equal objects (the text of :func:`pack`); None for objects
    JSON does not carry exactly (NaN, non-string keys, ``!!binary``): kept whole."""
    packed = pack(obj)
    return _text_digest(packed.text) if isinstance(packed, Packed) else None


def hold(obj: Mapping[str, Any], applied: Mapping[str, Held] | None = None) -> Held:
    """An object read for a source: as a stub with its text, or whole if JSON does not
    carry it exactly. An object the engine already has (the same digest as the applied
    stub of its uid in ``applied``) is that stub, without a text: on a reload that is
    nearly every object, and a second stub and a text each were ~50 MB at 37.5k pods."""
    packed = pack(obj)
    if not isinstance(packed, Packed):
        return obj
    digest = _text_digest(packed.text)
    kept = applied.get(obj["metadata"]["uid"]) if applied is not None else None
    if isinstance(kept, ObjectStub) and kept.text is None and kept.digest == digest:
        return kept
    return ObjectStub(obj, digest, packed.text)


_INTERNED: dict[str, str] = {}


def _intern(s: str) -> str:
    """One string object for the few kinds, apiVersions and namespaces of a cluster."""
    if len(_INTERNED) > 100_000:  # a hostile snapshot must not grow this without bound
        _INTERNED.clear()
    return _INTERNED.setdefault(s, s)


#: an object as parsed, or as remembered once applied
Held = Mapping[str, Any] | ObjectStub


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


@dataclass
class FileContent:
    """What one file holds, parsed but not yet fed to an engine (or, once applied and
    compacted, stubs of what it held)."""

    path: str
    objects: list[Held] = field(default_factory=list)
    descriptions: list[Description] = field(default_factory=list)
    description_errors: list[DescriptionError] = field(default_factory=list)
    #: the description documents as read (parsed descriptions do not compare by value)
    description_docs: list[Any] = field(default_factory=list)
    #: "where: why" for documents that are not Kubernetes objects
    invalid: list[str] = field(default_factory=list)
    uids_derived: int = 0


#: objects freed per step of :meth:`SnapshotContent.release`
RELEASE_SLICE = 2000

#: called once per object by work that runs in a worker thread during a reload: a
#: :class:`~proxy.yielding.ThreadPacer`, or nothing
Pace = Callable[[], None]


def _unpaced() -> None:
    pass


@dataclass
class SnapshotContent:
    """Every file of a snapshot path, parsed."""

    path: str
    files: dict[str, FileContent] = field(default_factory=dict)
    skipped: list[SkippedFile] = field(default_factory=list)

    def objects(self, pace: Pace = _unpaced) -> dict[str, Held]:
        """Objects by uid; a later file (sorted order) wins over an earlier one."""
        out: dict[str, Held] = {}
        for fc in self.files.values():
            for obj in fc.objects:
                out[_uid(obj)] = obj
                pace()
        return out

    def compact(self, pace: Pace = _unpaced) -> SnapshotContent:
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

    def release(self, pace: Pace = _unpaced) -> None:
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


# -- reading ---------------------------------------------------------------------------------


def snapshot_files(path: str | Path) -> tuple[list[Path], list[SkippedFile]]:
    """The files a snapshot path stands for; raises ``SnapshotError`` if it does not exist."""
    p = Path(path)
    if p.is_file():
        return [p], []
    if not p.is_dir():
        raise SnapshotError(f"snapshot {path}: no such file or folder")
    files: list[Path] = []
    skipped: list[SkippedFile] = []
    for f in folder_files(p):  # hidden files and folders are not snapshot data
        if f.suffix.lower() not in SUFFIXES:
            skipped.append(SkippedFile(str(f), f"not {'/'.join(SUFFIXES)}"))
        elif len(files) >= MAX_FILES:
            skipped.append(SkippedFile(str(f), f"more than {MAX_FILES} files in the folder"))
        else:
            files.append(f)
    return files, skipped


def read_file(
    path: str | Path, *, max_bytes: int = MAX_FILE_BYTES, packed: bool = False,
    pace: Pace = _unpaced, applied: Mapping[str, Held] | None = None,
) -> FileContent | SkippedFile:
    """Parse one file; a file that cannot be read or parsed comes back as ``SkippedFile``.

    ``packed``: objects held as :class:`ObjectStub` with their text (see there), as a
    source reads them, but for those ``applied`` already (see :func:`hold`); else as
    parsed dicts."""
    p = Path(path)
    source = str(p)
    json_file = p.suffix.lower() == ".json"
    fc = FileContent(source)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            return SkippedFile(source, f"too large ({size} bytes > {max_bytes})")
        if json_file:  # read through a window, never whole (_JsonStream)
            with p.open(encoding="utf-8") as f:
                _classify_all(fc, _json_items(f, pace), packed, applied, pace)
        else:  # built from the parser's events, read a block at a time, a list's items
            # handed out as they are built (yamltext.read_documents); documents without
            # cycles: no collection walks them
            with p.open(encoding="utf-8") as f, memory.collections_paused():
                try:
                    _classify_all(fc, _yaml_items(f, pace), packed, applied, pace)
                except Reread:  # what was read is dropped; the file read again whole
                    f.seek(0)
                    fc = _classify_all(FileContent(source),
                                       _flatten(load_documents(f, pace), release=True),
                                       packed, applied, pace)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if json_file:
            return SkippedFile(source, _unreadable(p, e))
        if isinstance(e, UnicodeDecodeError):
            return SkippedFile(source, f"not UTF-8 text ({e.reason} at byte {e.start})")
        return SkippedFile(source, f"invalid YAML: {e}")  # a tagged value its constructor refused
    except OSError as e:
        return SkippedFile(source, f"cannot read: {e.strerror or e}")
    except yaml.YAMLError as e:
        return SkippedFile(source, yaml_error(e))
    except RecursionError:
        return SkippedFile(source, "nested too deeply")
    except (TypeError, KeyError, AttributeError) as e:
        # a half-written object whose fields are of another type than the reader expects
        # (``spec: nodeName`` cut from its value): the file, not the proxy, is at fault
        return SkippedFile(source, f"an object of an unexpected shape ({type(e).__name__}: "
                                   f"{e})")
    if not fc.objects and not fc.descriptions and not fc.description_errors:
        # an empty file too: ``kubectl get ... -o yaml > snap.yaml`` empties it before
        # kubectl writes, and a reload in between took it for a cluster without pods
        # (every pod deleted, every fact series ended); skipped, it keeps its objects
        why = fc.invalid[0] if fc.invalid else "the file is empty"
        return SkippedFile(source, f"no Kubernetes objects ({why})")
    return fc


def _classify_all(fc: FileContent, items: Iterator[tuple[str, Any]], packed: bool,
                  applied: Mapping[str, Held] | None, pace: Pace) -> FileContent:
    """Every (where, item) of a file into ``fc``, pacing after each."""
    for where, item in items:
        _classify(fc, where, item, packed, applied)
        del item  # not held through the pause: an item is freed once classified
        pace()
    return fc


def _unreadable(p: Path, e: ValueError) -> str:
    """Why a JSON file was refused, said as of the whole file: a window's error has
    positions within the window (the file is read whole again, for this only)."""
    try:
        json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as u:
        return f"not UTF-8 text ({u.reason} at byte {u.start})"
    except ValueError as j:
        return f"invalid JSON: {j}"
    except (OSError, RecursionError):
        pass
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason})"
    return f"invalid JSON: {e}"


def read_snapshot(
    path: str | Path, *, max_bytes: int = MAX_FILE_BYTES, packed: bool = False,
    pace: Pace = _unpaced, applied: Mapping[str, Held] | None = None,
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


_JSON = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
#: characters of a JSON file read at a time: what :class:`_JsonStream` holds, beyond the
#: value being decoded
READ_CHARS = 1 << 20


class _JsonStream:
    """JSON values decoded one at a time from a window that slides over a text stream.

    A List of a large cluster (``kubectl get ... -o json``) is tens of megabytes; read
    whole, its bytes and its text were both alive while it decoded: a reload at 37.5k
    pods (37 MB) added 72 MB to the peak RSS for that alone. The window holds about
    ``READ_CHARS`` and the value being decoded."""

    def __init__(self, f: IO[str]) -> None:
        self._f = f
        self._buf = ""
        self._pos = 0
        self._eof = False

    def _more(self) -> bool:
        """Slide the window on: what is left of it, and the next chunk."""
        if self._eof:
            return False
        chunk = self._f.read(READ_CHARS)
        if not chunk:
            self._eof = True
            return False
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def at(self, ch: str) -> bool:
        """Whether the next non-space character is ``ch`` (False at the end)."""
        while True:
            self._pos = _SPACE.match(self._buf, self._pos).end()  # type: ignore[union-attr]
            if self._pos < len(self._buf) or not self._more():
                return self._buf.startswith(ch, self._pos)

    def expect(self, ch: str) -> None:
        if not self.at(ch):
            raise json.JSONDecodeError(f"expected {ch!r}", self._buf, self._pos)
        self._pos += 1

    def value(self) -> Any:
        self.at("")
        while True:
            try:
                value, end = _JSON.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                if self._more():  # cut at the window's end, or broken: more tells
                    continue
                raise
            if len(self._buf) - end <= 2 and self._more():
                # a number cut at the window's end decodes as a shorter one: "12" of
                # "123", "0" of "0." + "5", "1" of "1e" + "3"; decoded again with more
                continue
            self._pos = end
            return value

    def array(self) -> Iterator[Any]:
        """The values of the array the stream is at, one at a time."""
        self.expect("[")
        if self.at("]"):
            self._pos += 1
            return
        while True:
            yield self.value()
            if self.at("]"):
                self._pos += 1
                return
            self.expect(",")

    def end(self) -> None:
        """Nothing but space may be left."""
        self.at("")
        if self._pos < len(self._buf):
            raise json.JSONDecodeError("extra data", self._buf, self._pos)


def _json_items(f: IO[str], pace: Pace = _unpaced) -> Iterator[tuple[str, Any]]:
    """What ``_flatten`` yields for a JSON file, a ``*List``'s (or an array's) items
    decoded one at a time from ``f`` (seekable: read twice).

    Only one item is alive at once, not the whole list (~5x the text), and the text is
    read through a window (:class:`_JsonStream`). A first pass finds the list's kind
    (kubectl writes it after the items), decoding and dropping the items; a second
    yields them. Anything else (a single object) is decoded whole.
    """
    s = _JsonStream(f)
    if s.at("["):
        for j, value in enumerate(s.array()):
            yield f"document 1[{j}]", value
        s.end()
        return
    if not s.at("{"):
        value = s.value()
        s.end()
        yield from _flatten([value])
        return
    members, has_items = _members(s, pace)
    f.seek(0)
    if not has_items or not _list_kind(members):
        yield from _flatten([json.load(f)])
        return
    kind, api = members["kind"], members.get("apiVersion")
    s = _JsonStream(f)
    s.expect("{")
    while True:
        key = s.value()
        s.expect(":")
        if key == "items" and s.at("["):
            break
        s.value()
        s.expect(",")
    for j, item in enumerate(s.array()):
        item = _listed(item, kind, api)
        yield f"document 1.items[{j}]", item


def _members(s: _JsonStream, pace: Pace = _unpaced) -> tuple[dict[str, Any], bool]:
    """The top-level members of the JSON object ``s`` is at but ``items``, which is only
    walked (its values dropped as decoded); and whether there is an ``items`` array."""
    members: dict[str, Any] = {}
    has_items = False
    s.expect("{")
    if not s.at("}"):
        while True:
            key = s.value()
            if not isinstance(key, str):
                raise json.JSONDecodeError("expected a member name", "", 0)
            s.expect(":")
            if key == "items" and s.at("["):
                has_items = True
                for _ in s.array():  # decoded and dropped one by one
                    pace()
            else:
                members[key] = s.value()
            if s.at("}"):
                break
            s.expect(",")
    s.expect("}")
    s.end()
    return members, has_items


def _yaml_items(f: IO[str], pace: Pace = _unpaced) -> Iterator[tuple[str, Any]]:
    """What ``_flatten`` yields for a YAML file, a list's items handed out as they are
    built (``read_documents``), not after the whole list is: +304 MB of peak RSS for a
    37.5k-pod ``kubectl get -o yaml`` export otherwise.

    Whether the items are a list's is known only at the document's end (``kubectl`` puts
    ``kind`` after ``items``): an item is passed on at once when that does not change
    it (it has a ``kind`` of its own, as kubectl's items do, or the list's ``kind`` and
    ``apiVersion`` came first), else kept until the end, and so is every later one, to
    keep their order. A document that turns out not to be a list raises ``Reread``."""
    pending: list[Item] = []
    #: the list's kind and apiVersion given to items before the document's end
    given: tuple[Any, Any] | None = None
    for part in read_documents(f, pace):
        if isinstance(part, Refused):  # an alias or a key given twice: only it is skipped
            yield part.where, part
            continue
        if isinstance(part, Item):
            item, head = part.value, part.head
            if head is None:  # a document that is a sequence: opened whatever it holds
                yield f"document {part.document}[{part.index}]", item
            elif pending:
                pending.append(part)
            elif not (isinstance(item, Mapping) and "kind" not in item):
                yield f"document {part.document}.items[{part.index}]", item
            elif _list_kind(head) and "apiVersion" in head:
                given = (head["kind"], head["apiVersion"])
                yield f"document {part.document}.items[{part.index}]", _listed(item, *given)
            else:
                pending.append(part)
            del item
            continue
        doc = part.value
        if not part.opened:
            yield from _flatten([doc], first=part.number)
            continue
        if isinstance(doc, list):
            continue
        if (part.opened > 1 or doc.get("items") is not HANDED_OUT or not _list_kind(doc)
                or given not in (None, (doc["kind"], doc.get("apiVersion")))):
            raise Reread
        for p in pending:
            yield (f"document {p.document}.items[{p.index}]",
                   _listed(p.value, doc["kind"], doc.get("apiVersion")))
        pending.clear()
        given = None


def _list_kind(doc: Mapping[Any, Any]) -> bool:
    """Whether ``doc`` is a ``*List`` by its kind (its items are opened)."""
    kind = doc.get("kind")
    return isinstance(kind, str) and kind.endswith("List")


def _listed(item: Any, list_kind: str, api: Any) -> Any:
    """A list's item as read on its own: the items of a typed list from the API
    (``PodList``, ...) leave their ``kind`` off, given back here with the list's
    ``apiVersion``."""
    if list_kind != "List" and isinstance(item, Mapping) and "kind" not in item:
        return {"apiVersion": api, "kind": list_kind[: -len("List")], **item}
    return item


def _flatten(docs: Iterable[Any], *, release: bool = False, first: int = 1
             ) -> Iterator[tuple[str, Any]]:
    """Documents -> (where, item): arrays and ``*List`` objects opened one level deep.

    ``release``: the documents are the caller's to give up. Each item is dropped from its
    document as it is handed out (and each document from a list ``docs``), so the
    caller's reference is the last one and they are freed one at a time as it goes,
    not all at once at the end. ``first``: the number of the first document."""
    for i, doc in enumerate(docs):
        if release and isinstance(docs, list):
            docs[i] = None
        here = f"document {i + first}"
        list_kind = ""
        if isinstance(doc, list):
            items: list[Any] = doc
            opened = f"{here}["
        elif isinstance(doc, Mapping) and _list_kind(doc) and isinstance(doc.get("items"), list):
            items = doc["items"]
            opened = f"{here}.items["
            list_kind = doc["kind"]
        else:
            yield here, doc
            continue
        for j, item in enumerate(items):
            if release:
                items[j] = None
            if list_kind:
                item = _listed(item, list_kind, doc.get("apiVersion"))
            yield f"{opened}{j}]", item
            del item


def _classify(fc: FileContent, where: str, item: Any, packed: bool = False,
              applied: Mapping[str, Held] | None = None) -> None:
    if isinstance(item, Refused):
        fc.invalid.append(f"{fc.path}: {where}: {item}")
        return
    if not isinstance(item, Mapping):
        fc.invalid.append(f"{fc.path}: {where}: not an object but {type(item).__name__}")
        return
    if is_description_object(item):
        fc.description_docs.append(item)
        try:
            fc.descriptions.append(parse_description(item, fc.path))
        except DescriptionError as e:
            e.path = f"{where}: {e.path}" if e.path else where
            fc.description_errors.append(e)
        except RecursionError:
            fc.description_errors.append(DescriptionError(fc.path, "", where, "nested too deeply"))
        return
    kind, api, md = item.get("kind"), item.get("apiVersion"), item.get("metadata")
    if not isinstance(kind, str) or not kind or not isinstance(api, str) or not api:
        fc.invalid.append(f"{fc.path}: {where}: apiVersion and kind are required")
        return
    if not isinstance(md, Mapping) or not isinstance(md.get("name"), str) or not md["name"]:
        fc.invalid.append(f"{fc.path}: {where}: {kind} without metadata.name")
        return
    if (wrong := _wrong_metadata(md)) is not None:
        fc.invalid.append(f"{fc.path}: {where}: {kind} {md['name']}: {wrong}")
        return
    obj, derived = _with_uids(item, md)
    fc.uids_derived += derived
    if kind == "Pod" and api == "v1":
        # what the watches keep of a pod, so a snapshot of a large cluster holds as little
        obj = slim_pod(dict(obj))
    fc.objects.append(hold(obj, applied) if packed else obj)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "mapping"
    return type(value).__name__


def _not_text(value: Any, path: str, *, optional: bool = True) -> str | None:
    """Why ``value`` is not what a string field of the API may hold, or None."""
    if isinstance(value, str) or (optional and value is None):
        return None
    return f"{path}: must be a string, got {_type_name(value)}"


def _wrong_metadata(md: Mapping[str, Any]) -> str | None:
    """Why the metadata the proxy reads cannot be the API's, or None: the field and the
    type found. Taken as they were, a ``namespace: [a, b]`` stamped its list's text on
    the pod's series, and a ``uid: 12345`` got a derived uid while its pods' references
    to 12345 were ignored."""
    for name in ("namespace", "uid"):
        if (why := _not_text(md.get(name), f"metadata.{name}")) is not None:
            return why
    for name in ("labels", "annotations"):
        pairs = md.get(name)
        if pairs is None:
            continue
        if not isinstance(pairs, Mapping):
            return f"metadata.{name}: must be a mapping, got {_type_name(pairs)}"
        for key, value in pairs.items():
            if not isinstance(key, str):
                return f"metadata.{name}: keys must be strings, got {_type_name(key)} {key!r}"
            if not isinstance(value, str):
                return f"metadata.{name}.{key}: must be a string, got {_type_name(value)}"
    refs = md.get("ownerReferences")
    if refs is None:
        return None
    if not isinstance(refs, list):
        return f"metadata.ownerReferences: must be a list, got {_type_name(refs)}"
    for i, ref in enumerate(refs):
        path = f"metadata.ownerReferences[{i}]"
        if not isinstance(ref, Mapping):
            return f"{path}: must be a mapping, got {_type_name(ref)}"
        for name in ("apiVersion", "kind", "name", "uid"):
            if (why := _not_text(ref.get(name), f"{path}.{name}")) is not None:
                return why
        if not isinstance(ref.get("controller", False), bool | None):
            return f"{path}.controller: must be true or false, got {_type_name(ref['controller'])}"
    return None


#: kinds Kubernetes defines as cluster-scoped that may be named as owners: a reference
#: from a namespaced object to one of them derives its uid without the namespace, as the
#: owner's own is derived (an owner is in its dependent's namespace, or cluster-scoped)
CLUSTER_SCOPED: frozenset[tuple[str, str]] = frozenset({
    ("", "Node"), ("", "Namespace"), ("", "PersistentVolume"),
    ("storage.k8s.io", "StorageClass"), ("storage.k8s.io", "CSIDriver"),
    ("storage.k8s.io", "CSINode"), ("storage.k8s.io", "VolumeAttachment"),
    ("rbac.authorization.k8s.io", "ClusterRole"),
    ("rbac.authorization.k8s.io", "ClusterRoleBinding"),
    ("apiextensions.k8s.io", "CustomResourceDefinition"),
    ("apiregistration.k8s.io", "APIService"), ("scheduling.k8s.io", "PriorityClass"),
    ("networking.k8s.io", "IngressClass"), ("node.k8s.io", "RuntimeClass"),
    ("certificates.k8s.io", "CertificateSigningRequest"),
    ("admissionregistration.k8s.io", "MutatingWebhookConfiguration"),
    ("admissionregistration.k8s.io", "ValidatingWebhookConfiguration"),
    ("run.ai", "Karta"), ("optimization.nvidia.com", "ResourceInterface"),
})


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def derived_uid(api_version: str, kind: str, namespace: str, name: str) -> str:
    """The uid given to an object written without one (stable across loads), from its
    API group, kind, namespace and name: a Knative ``serving.knative.dev`` Service and a
    core Service of one name are two objects (without the group they were one, the later
    replacing the other, and a pod moved to the wrong workload). The core group's are
    what they were before the group counted."""
    group = _group(api_version)
    key = f"{group}/{kind}/{namespace}/{name}" if group else f"{kind}/{namespace}/{name}"
    return str(uuid.uuid5(_UID_NAMESPACE, key))


def _with_uids(obj: Mapping[str, Any], md: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    """Fill in missing uids (object and owner references) without touching the input."""
    derived = 0
    ns = md.get("namespace") or ""
    new_md: dict[str, Any] | None = None
    if not isinstance(md.get("uid"), str) or not md.get("uid"):
        new_md = dict(md)
        new_md["uid"] = derived_uid(obj["apiVersion"], obj["kind"], ns, md["name"])
        derived += 1
    refs = md.get("ownerReferences")
    if isinstance(refs, list) and any(
        isinstance(r, Mapping) and not r.get("uid") and r.get("kind") and r.get("name")
        for r in refs
    ):
        new_refs = []
        for r in refs:
            if isinstance(r, Mapping) and not r.get("uid") and r.get("kind") and r.get("name"):
                api, kind = str(r.get("apiVersion") or ""), str(r["kind"])
                owner_ns = "" if (_group(api), kind) in CLUSTER_SCOPED else ns
                r = {**r, "uid": derived_uid(api, kind, owner_ns, str(r["name"]))}
                derived += 1
            new_refs.append(r)
        new_md = dict(new_md if new_md is not None else md)
        new_md["ownerReferences"] = new_refs
    if new_md is None:
        return obj, 0
    return {**obj, "metadata": new_md}, derived


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
                 pace: Pace = _unpaced, old: Mapping[str, Held] | None = None
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


def _signature(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when any snapshot file is saved, added or removed."""
    try:
        files, _ = snapshot_files(path)
    except SnapshotError:
        return ()
    out = []
    for f in files:
        with contextlib.suppress(OSError):
            st = f.stat()
            out.append((str(f), st.st_mtime_ns, st.st_size))
    return tuple(out)


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


def _compact_releasing(content: SnapshotContent, previous: SnapshotContent,
                       pace: Pace = _unpaced) -> SnapshotContent:
    """``content`` compacted to keep; the read ``content`` and the ``previous`` kept one
    released (in a worker thread, slice by slice, not freed on the event loop)."""
    kept = content.compact(pace)
    content.release(pace)
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
    ) -> None:
        self.path = str(path)
        #: whether a request is being relayed: a reload's work in its thread waits for it
        self.busy = busy
        self.engine = engine
        self.index = index
        self.reload_seconds = max(MIN_RELOAD_SECONDS, reload_seconds) if reload_seconds else None
        self.report: SnapshotReport | None = None
        self.reloads = 0
        self._content: SnapshotContent | None = None
        self._signature: tuple[tuple[str, int, int], ...] = ()
        self._task: asyncio.Task[None] | None = None
        #: the kinds the engine kept whole when this source last fed it (full_kinds)
        self._full: frozenset[GroupKind] = frozenset()
        #: a reload and a feeding of newly whole kinds each read ``_content`` and replace
        #: or feed from it: one at a time
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Load, apply to the index, mark it ready and fresh; raises ``SnapshotError``."""
        self._signature = await asyncio.to_thread(_signature, self.path)
        content = await asyncio.to_thread(read_snapshot, self.path, packed=True)
        if not content.files:
            reasons = "; ".join(str(s) for s in content.skipped[:5]) or "no snapshot files"
            raise SnapshotError(f"snapshot {self.path}: nothing could be loaded: {reasons}")
        self.report = apply_content(content, self.engine)
        self._full = full_kinds(self.engine)
        self._content = content.compact()
        del content
        self.index.apply(self.report.changes)
        # the objects' texts are freed, the engine's records long-lived: out of the cyclic
        # collector's view and the freed heap handed back (proxy.memory.settle)
        memory.settle()
        self.index.ready = True
        self.index.mark_fresh(FRESHNESS_RESOURCE)
        log_report(self.report)
        if self.reload_seconds:
            self._task = asyncio.create_task(self._poll(), name="snapshot-reload")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def reload(self) -> SnapshotReport:
        """Apply what changed on disk since the last load (files that fail keep their objects)."""
        async with self._lock:
            report = await self._reload()
            await self._follow_kinds()
        return report

    async def follow_kinds(self) -> int:
        """Feed the engine again the objects of the kinds it keeps whole since this source
        last fed it; returns how many. For a change of descriptions from elsewhere (a
        configuration reload); a reload of the snapshot does it itself.

        The engine keeps an object whole only if its kind was described when the object
        arrived (:func:`full_kinds`); once applied, this source keeps only stubs without
        the objects' text, so the files are read again for them. Rare (a kind newly
        described), and off the event loop as a reload's read is. An object whose file
        changed since is left to the reload that change brings (as a new version, fed
        whole)."""
        async with self._lock:
            return await self._follow_kinds()

    async def _follow_kinds(self) -> int:
        if self._content is None:
            return 0
        now = full_kinds(self.engine)
        newly, self._full = now - self._full, now
        if not newly:
            return 0
        held = self._content.objects()
        again = {uid: o for uid, o in held.items() if _group_kind(o) in newly}
        if not again:
            return 0
        pace = ThreadPacer(self.busy, RELOAD_DEFER_SECONDS)
        if any(not _has_body(o) for o in again.values()):
            # read with the stubs of every other object: only these get their text
            others = {uid: o for uid, o in held.items() if uid not in again}
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
                else:  # changed or gone since: the next reload applies that
                    del again[uid]
            del found
        feed = _feed_order(again.values())
        report = SnapshotReport(self.path)
        loop_pace = Pacer(self.busy, pace.remaining())
        await in_runs(len(feed), lambda i, j: self.index.apply(
            _upsert(self.engine, feed[i:j], report)), Slices(LOOP_RUN_SECONDS, first=16),
            loop_pace)
        for problem in report.invalid_objects:
            log.error("snapshot: object skipped: %s", problem, extra={"snapshot": self.path})
        log.info("snapshot: objects of newly described kinds fed again", extra={
            "snapshot": self.path, "kinds": sorted(str(gk) for gk in newly),
            "objects": len(feed)})
        return len(feed)

    async def _reload(self) -> SnapshotReport:
        assert self._content is not None, "start() first"
        pace = ThreadPacer(self.busy, RELOAD_DEFER_SECONDS)
        self._signature = await asyncio.to_thread(_signature, self.path)
        # what the engine has: an unchanged object read again is its stub (see hold)
        applied = await asyncio.to_thread(self._content.objects, pace)
        try:
            content = await asyncio.to_thread(read_snapshot, self.path, packed=True, pace=pace,
                                              applied=applied)
        except SnapshotError as e:  # the whole path vanished: keep serving what we have
            log.error("snapshot: reload failed, keeping the last state", extra={"error": str(e)})
            content = SnapshotContent(self.path, skipped=[SkippedFile(self.path, str(e))])
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
        # not settle(): its full collection of the whole heap held the loop ~0.55 s at
        # 37.5k pods, for nothing (a reload leaves no cyclic garbage: measured, and held
        # by test_a_reload_leaves_no_cyclic_garbage)
        memory.freeze_survivors()
        await memory.trim_off_loop()
        self.index.mark_fresh(FRESHNESS_RESOURCE)
        log_report(report, reload=True)
        return report

    async def _poll(self) -> None:
        assert self.reload_seconds is not None
        while True:
            await asyncio.sleep(self.reload_seconds)
            try:
                sig = await asyncio.to_thread(_signature, self.path)
                if sig != self._signature:
                    await self.reload()
                else:
                    self.index.mark_fresh(FRESHNESS_RESOURCE)
            except Exception:  # never let a reload end the process
                log.exception("snapshot: reload failed")
