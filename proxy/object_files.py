"""Files of Kubernetes objects, read: what a snapshot path holds, object by object.

The snapshot source (:mod:`proxy.snapshot`) diffs and applies what this reads; the demo
exporter reads its cluster through it too. Accepted, in any mix, from a file or a folder
(recursively; ``*.yaml``, ``*.yml``, ``*.json``, in sorted order):

- multi-document YAML, read as Kubernetes reads it (aliases and keys given twice refused,
  timestamps kept as strings: :mod:`proxy.karta.yamltext`);
- a ``kubectl get -A -o yaml`` (or ``-o json``) ``List``, and typed lists as the API serves
  them (``PodList`` items carry no ``kind``; it is taken from the list);
- JSON: one object, a List, or an array of objects;
- Karta (``run.ai``) and ResourceInterface (``optimization.nvidia.com``) descriptions
  among the objects: parsed with the file name as their source, invalid ones reported.

A file that cannot be read or parsed comes back as a :class:`SkippedFile` with its
reason; objects that are not Kubernetes objects are listed with their reason and left
out; nothing here raises but for a path that does not exist at all, or a folder (the
path or one below it) that cannot be listed. Objects without ``metadata.uid`` (hand
written snapshots) get a stable one derived from API group, kind, namespace and name,
and owner references without a uid get the same derivation, so owner chains still
connect.

Large files are read an item at a time, never whole (a 37.5k-pod List is tens of
megabytes of text and ~5x that parsed), and a source may hold what it read as text
(:class:`ObjectStub`, :func:`hold`) rather than as parsed objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from proxy import memory
from proxy.karta.description import DescriptionError, is_description_object, parse_description
from proxy.karta.files import folder_files
from proxy.karta.model import Description
from proxy.karta.packed import Packed, pack
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

SUFFIXES = (".yaml", ".yml", ".json")
#: one file's size limit; a 100k-pod ``kubectl get -o yaml`` is a few hundred MiB
MAX_FILE_BYTES = 1024 * 1024 * 1024
#: folders: files beyond this are reported and skipped
MAX_FILES = 10_000

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

    Read for a source, objects are held as text (``read_file(packed=True)``): parsed
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
        """The object, parsed again from its text (only stubs still to be applied have it).

        Its uid and name are the stub's own strings, not the parse's equal copies: the
        engine keeps them (a pod's key, its name in its attribution) for as long as the
        source keeps the stub, so one string serves both instead of two (~8 MB at 37.5k
        pods, where the source's stubs and the engine's records each held a copy)."""
        assert self.text is not None, "an applied stub has no object any more"
        obj: dict[str, Any] = json.loads(self.text)
        md = obj.get("metadata")
        if type(md) is dict:
            if md.get("uid") == self.uid:
                md["uid"] = self.uid
            if md.get("name") == self.name:
                md["name"] = self.name
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


#: called once per object by work that runs in a worker thread during a reload: a
#: :class:`~proxy.yielding.ThreadPacer`, or nothing
Pace = Callable[[], None]


def unpaced() -> None:
    """The pace of work with nothing to give way to: it never pauses."""


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


def snapshot_files(path: str | Path) -> tuple[list[Path], list[SkippedFile]]:
    """The files a snapshot path stands for; raises ``SnapshotError`` if it does not exist,
    or is a folder that cannot be listed, or holds one (not hidden) that cannot be: taken
    for an empty one, every object in it was deleted."""
    p = Path(path)
    if p.is_file():
        return [p], []
    if not p.is_dir():
        raise SnapshotError(f"snapshot {path}: no such file or folder")
    try:  # a folder walked without read permission reads as empty (rglob says nothing)
        with os.scandir(p):
            pass
    except OSError as e:
        raise SnapshotError(f"snapshot {path}: cannot read the folder: {e.strerror or e}"
                            ) from e
    try:  # hidden files and folders are not snapshot data
        listed = folder_files(p)
    except OSError as e:
        where = f" {e.filename}" if e.filename is not None else ""
        raise SnapshotError(f"snapshot {path}: cannot read the folder{where}: "
                            f"{e.strerror or e}") from e
    files: list[Path] = []
    skipped: list[SkippedFile] = []
    for f in listed:
        if f.suffix.lower() not in SUFFIXES:
            skipped.append(SkippedFile(str(f), f"not {'/'.join(SUFFIXES)}"))
        elif len(files) >= MAX_FILES:
            skipped.append(SkippedFile(str(f), f"more than {MAX_FILES} files in the folder"))
        else:
            files.append(f)
    return files, skipped


def read_file(
    path: str | Path, *, max_bytes: int = MAX_FILE_BYTES, packed: bool = False,
    pace: Pace = unpaced, applied: Mapping[str, Held] | None = None, slim_pods: bool = True,
) -> FileContent | SkippedFile:
    """Parse one file; a file that cannot be read or parsed comes back as ``SkippedFile``.

    ``packed``: objects held as :class:`ObjectStub` with their text (see there), as a
    source reads them, but for those ``applied`` already (see :func:`hold`); else as
    parsed dicts. ``slim_pods``: pods kept as the watches keep them (``slim_pod``), so a
    snapshot of a large cluster holds as little; False for a reader of what that drops
    (the demo exporter models its containers' resources)."""
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
                _classify_all(fc, _json_items(f, pace), packed, applied, pace, slim_pods)
        else:  # built from the parser's events, read a block at a time, a list's items
            # handed out as they are built (yamltext.read_documents); documents without
            # cycles: no collection walks them
            with p.open(encoding="utf-8") as f, memory.collections_paused():
                try:
                    _classify_all(fc, _yaml_items(f, pace), packed, applied, pace,
                                  slim_pods)
                except Reread:  # what was read is dropped; the file read again whole
                    f.seek(0)
                    fc = _classify_all(FileContent(source),
                                       _flatten(load_documents(f, pace), release=True),
                                       packed, applied, pace, slim_pods)
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
                  applied: Mapping[str, Held] | None, pace: Pace, slim_pods: bool
                  ) -> FileContent:
    """Every (where, item) of a file into ``fc``, pacing after each."""
    for where, item in items:
        _classify(fc, where, item, packed, applied, slim_pods=slim_pods)
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


def _json_items(f: IO[str], pace: Pace = unpaced) -> Iterator[tuple[str, Any]]:
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


def _members(s: _JsonStream, pace: Pace = unpaced) -> tuple[dict[str, Any], bool]:
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


def _yaml_items(f: IO[str], pace: Pace = unpaced) -> Iterator[tuple[str, Any]]:
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
              applied: Mapping[str, Held] | None = None, *, slim_pods: bool = True) -> None:
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
    wrong = (_not_unicode(api, "apiVersion") or _not_unicode(kind, "kind")
             or _wrong_metadata(md))
    if wrong is not None:
        named = f"{kind} {md['name']}".encode("utf-8", "backslashreplace").decode()
        fc.invalid.append(f"{fc.path}: {where}: {named}: {wrong}")
        return
    obj, derived = _with_uids(item, md)
    fc.uids_derived += derived
    if slim_pods and kind == "Pod" and api == "v1":
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
    if isinstance(value, str):
        return _not_unicode(value, path)
    if optional and value is None:
        return None
    return f"{path}: must be a string, got {_type_name(value)}"


def _not_unicode(value: str, path: str) -> str | None:
    """Why ``value`` cannot be UTF-8 (a lone surrogate: JSON's or YAML's ``"\\ud800"``
    escape), or None. The API server never serves one (Go decodes the escape as
    U+FFFD); taken from a file, a name or label with one passed the engine and raised
    ``UnicodeEncodeError`` where it was made bytes: the index's key (a traceback that
    ended the start), the attribution page (a 500)."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"{path}: not Unicode text: a lone surrogate "
                f"(\\u{ord(value[e.start]):04x}) at character {e.start}")
    return None


def _wrong_metadata(md: Mapping[str, Any]) -> str | None:
    """Why the metadata the proxy reads cannot be the API's, or None: the field and the
    type found. Taken as they were, a ``namespace: [a, b]`` stamped its list's text on
    the pod's series, and a ``uid: 12345`` got a derived uid while its pods' references
    to 12345 were ignored."""
    for name in ("name", "namespace", "uid"):
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
            if (why := _not_unicode(key, f"metadata.{name}: a key")) is not None:
                return why
            if (why := _not_text(value, f"metadata.{name}.{key}", optional=False)) is not None:
                return why
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

