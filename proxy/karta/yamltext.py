"""Reading YAML text: libyaml's safe loader where present, big streams built from its
events (:func:`load_documents`), and a parse error as one line.

Kubernetes objects and Karta descriptions are read as Kubernetes reads them
(``sigs.k8s.io/yaml``, the JSON they stand for), not as YAML 1.1 allows: a timestamp is
the string written (``lastTransitionTime: 2026-01-01T00:00:00Z`` is the API's
string, not a ``datetime`` jq cannot serialize); an alias is refused, never expanded (a
600-byte file of nested aliases stood for gigabytes once its objects were serialized;
kubectl never writes one); a key given twice in one mapping is refused, as kubectl and
the API server refuse it, where YAML loaders keep the last silently. What is refused is
one document, or one element of a document's top-level ``items``
(:class:`Refused`): the rest of the stream is read.

Description files, snapshot files and the configuration file all tell an operator that a
file is not valid YAML; the line and column are what finds the mistake, so all three say
it in one wording, made here (:func:`yaml_error`). A key given twice is found here for
all three too (as the event builder builds, or on PyYAML's composed nodes by
:func:`refusal`, which the configuration file's loader calls with aliases and merge keys
allowed, and words what it finds its own way: proxy/config.py). It sits in
``proxy.karta`` because the engine's package imports nothing above it
(``tests/test_layout.py``) and its description files need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import yaml

from proxy.shown import one_line

_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_MERGE = "tag:yaml.org,2002:merge"


class Loader(_SafeLoader):
    """libyaml's safe loader when present (several times faster on big snapshots), with
    timestamps read as the strings they are written as. Aliases and keys given twice
    are found by :func:`refusal` on the composed nodes, before anything is built."""


Loader.add_constructor(_TIMESTAMP, yaml.SafeLoader.construct_yaml_str)

#: a reason is a log line and an attribution-page cell, not a dump of the file
_LIMIT = 300


def yaml_error(exc: yaml.YAMLError) -> str:
    """``invalid YAML: line L, column C: problem (context at line L, column C)``, positions
    1-based as editors count them; an error without a position is its own text. One line,
    at most ``_LIMIT`` characters."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return _one_line(f"invalid YAML: {exc}")
    text = f"invalid YAML: line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        text += f" ({context})"
    return _one_line(text)


def _one_line(text: str) -> str:
    text = one_line(text)
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."



#: what a mapping being built is waiting for: its next key
_NO_KEY: Any = object()
_STR = "tag:yaml.org,2002:str"
_MAP_TAGS = (None, "!", "tag:yaml.org,2002:map")
_SEQ_TAGS = (None, "!", "tag:yaml.org,2002:seq")
#: keys the safe constructor gives a meaning of their own (``<<`` merges, ``=`` values)
_VALUE = "tag:yaml.org,2002:value"
_KEY_TAGS = (_MERGE, _VALUE)
#: events between two calls of ``pace``
_PACE_EVERY = 256
_NO_ALIASES = ("aliases are not accepted (kubectl never writes one, and a few nested ones "
               "can stand for gigabytes)")


class _Unusual(Exception):
    """A feature the event builder leaves to PyYAML's own composer and constructor."""


class Reread(Exception):
    """What :func:`read_documents` handed out is to be dropped and the stream read again
    whole (:func:`load_documents`): the rest of it needs PyYAML (a merge key, a tag other
    than the standard ones, ...) or refuses a document some of whose items were handed
    out, or, raised by its caller, a document whose items were handed out was not the
    list they were handed out for."""


class _HandedOut:
    """The value of a sequence whose elements were handed out one by one."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "HANDED_OUT"


#: what stands in a built document for its ``items`` handed out one by one
HANDED_OUT: Any = _HandedOut()


@dataclass(slots=True)
class Item:
    """One element of a document's top-level ``items`` sequence, or of a document that is
    a sequence, handed out as soon as it is built."""

    #: the document's number among the stream's non-empty documents, from 1
    document: int
    index: int
    value: Any
    #: the document's mapping as built so far (its keys before ``items``); ``None`` for
    #: an element of a document that is itself a sequence
    head: dict[Any, Any] | None


@dataclass(slots=True)
class Document:
    """One non-empty document of the stream, complete."""

    number: int
    #: with :data:`HANDED_OUT` for a sequence whose elements were handed out (an empty
    #: list for a document that is itself one)
    value: Any
    #: how many of its sequences were handed out as items (two: ``items`` given twice)
    opened: int = 0


@dataclass(slots=True)
class Refused:
    """A document not built, or (:func:`read_documents`) an element of its top-level
    ``items`` or of a document that is a sequence not handed out: it holds an alias or
    a key given twice. It counts among the stream's documents as a :class:`Document`."""

    document: int
    #: the element's index; ``None``: the whole document
    index: int | None
    #: where in the document (or the element) it was found, ``spec.template.labels.app``
    path: str
    #: why, with its line and column
    reason: str
    #: the element was one of the document's ``items`` (else of the document itself)
    in_items: bool = False

    @property
    def where(self) -> str:
        """``document 2``, ``document 2.items[5]`` or ``document 2[5]``."""
        here = f"document {self.document}"
        if self.index is None:
            return here
        return f"{here}.items[{self.index}]" if self.in_items else f"{here}[{self.index}]"

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _duplicate(key: Any, mark: Any) -> str:
    return (f"duplicate key {key!r} at {_at(mark)} (kubectl refuses a key given twice; "
            "the last one would win silently)")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


@dataclass(frozen=True, slots=True)
class DuplicateKey:
    """A key given twice in one mapping, as :func:`refusal` finds it: each reader words it
    its own way (a Kubernetes document here, the configuration file in proxy/config.py)."""

    #: where the mapping is: ``spec.template.labels``, "" for the document's top
    mapping: str
    #: the key as built
    key: Any
    #: its second occurrence (the text written: ``node.value``; where: ``node.start_mark``)
    node: Any

    @property
    def path(self) -> str:
        return _join(self.mapping, self.key)

    @property
    def reason(self) -> str:
        return _duplicate(self.key, self.node.start_mark)


@dataclass(frozen=True, slots=True)
class Alias:
    """An alias, as :func:`refusal` finds it: a node met a second time."""

    #: where the alias is
    path: str
    #: the node it names
    node: Any

    @property
    def reason(self) -> str:
        return f"YAML alias (of the node at {_at(self.node.start_mark)}): {_NO_ALIASES}"


def refusal(node: Any, loader: Any, *, aliases: bool = False) -> DuplicateKey | Alias | None:
    """The first alias or key given twice in a document composed by PyYAML, in document
    order; ``None`` when it has neither. PyYAML's composer makes an alias the node it
    names, so an alias is a node met twice: found here before anything is built (built,
    the nodes stay shared, and serializing the objects expands them). With ``aliases``
    (the configuration file, where aliases and merge keys are the operator's to use) an
    alias is no refusal, and what it names is looked through once. The keys a merge
    (``<<``) brings in are not the mapping's own: overriding one is no duplicate. Keys
    are built to be compared (``loader``'s cache: reset it after a refusal)."""
    seen: set[int] = set()
    #: (node, where it is, for a mapping's key: the keys before it and its value)
    stack: list[tuple[Any, str, set[Any] | None, Any]] = [(node, "", None, None)]
    while stack:
        n, path, keys, key = stack.pop()
        again = id(n) in seen
        if again and not aliases:
            return Alias(path, n)
        seen.add(id(n))
        if keys is not None:
            with contextlib.suppress(TypeError):  # unhashable: refused when built
                if key in keys:
                    return DuplicateKey(path, key, n)
                keys.add(key)
        if again:  # an alias, allowed: what it names was looked through where it was
            continue
        if isinstance(n, yaml.MappingNode):
            mine: set[Any] = set()
            children: list[tuple[Any, str, set[Any] | None, Any]] = []
            for k, v in n.value:
                if k.tag == _MERGE or not isinstance(k, yaml.ScalarNode):
                    # a merge, or a key the constructor refuses
                    children += [(k, path, None, None), (v, path, None, None)]
                else:
                    # ``=`` is the key "=" to the constructor (``flatten_mapping``)
                    key = k.value if k.tag == _VALUE else loader.construct_object(k)
                    children += [(k, path, mine, key), (v, _join(path, key), None, None)]
            stack.extend(reversed(children))
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(reversed([(v, f"{path}[{i}]", None, None)
                                   for i, v in enumerate(n.value)]))
    return None


def iter_documents(stream: IO[str], pace: Callable[[], None] = lambda: None
                   ) -> Iterator[Document | Refused]:
    """Every non-empty document of a YAML stream as :func:`load_documents` reads it, one
    at a time as each is complete: a syntax error raises after the documents before it."""
    done = 0
    try:
        for part in _built(stream, pace, open_items=False):
            assert not isinstance(part, Item)
            done += 1
            yield part
        return
    except _Unusual:
        stream.seek(0)
    for part in _pyyaml_parts(stream, pace):  # read again from the start: the rest
        if (part.document if isinstance(part, Refused) else part.number) > done:
            yield part


def load_documents(stream: IO[str], pace: Callable[[], None] = lambda: None) -> list[Any]:
    """Every non-empty document of a YAML stream, read from the stream a block at a time:
    equal to what ``yaml.load_all(stream, Loader)`` makes, but for a document with an
    alias or a key given twice, which is a :class:`Refused` in its place.

    A Kubernetes export is one document (``kubectl get -o yaml`` writes a ``List``), and
    libyaml composes a whole document into nodes before anything is built, with the GIL
    held and no chance to pause: at 37.5k pods (40 MB) that took 42 s, holding a
    reload's event loop up to 10.8 s at a time. Built here from the parser's events,
    the same file takes ~8 s and ``pace`` is called every ``_PACE_EVERY`` events.
    Merge keys and tags other than the standard ones are left to PyYAML: the stream is
    read again from its start with ``Loader``, each document checked by :func:`refusal`."""
    return [part.value if isinstance(part, Document) else part
            for part in iter_documents(stream, pace)]


def read_documents(stream: IO[str], pace: Callable[[], None] = lambda: None
                   ) -> Iterator[Item | Document | Refused]:
    """The documents of :func:`load_documents`, with the elements of a top-level
    ``items`` sequence (and of a document that is a sequence) handed out one at a time as
    they are built, before their document is complete; an element with an alias or a
    key given twice is a :class:`Refused` of its own, the rest of its document is read.

    A ``List`` of 37.5k pods built whole before its first item is read costs ~300 MB at
    its peak; handed out one by one, only the item being read is alive. ``kubectl``
    sorts keys, so ``items`` comes before ``kind``: only the caller, at the document's
    end, knows whether the items were a list's, and raises :class:`Reread` if not.
    Raises :class:`Reread` itself when, after handing something out, the stream turns
    out to need PyYAML's loader, or a document whose items were handed out is refused
    (read again whole, it is refused whole)."""
    handed = False
    try:
        for part in _built(stream, pace, open_items=True):
            handed = True
            yield part
        return
    except _Unusual:
        if handed:
            raise Reread from None
    stream.seek(0)
    yield from _pyyaml_parts(stream, pace)


def _pyyaml_parts(stream: IO[str], pace: Callable[[], None]) -> Iterator[Document | Refused]:
    """The stream's documents composed and built by PyYAML, each checked by
    :func:`refusal` first."""
    loader = Loader(stream)
    try:
        number = 0
        while loader.check_node():
            node = loader.get_node()
            found = refusal(node, loader)
            if found is not None:
                loader.constructed_objects = {}
                number += 1
                yield Refused(number, None, found.path, found.reason)
            elif (doc := loader.construct_document(node)) is not None:
                number += 1
                yield Document(number, doc)
            pace()
    finally:
        loader.dispose()


def _field_path(open_: list[Any], keys: list[Any], start: int) -> str:
    """Where the node being read is, below ``open_[start]``: ``spec.containers[2].name``."""
    path = ""
    for i in range(start, len(open_)):
        if type(open_[i]) is dict:
            if (key := keys[i]) is _NO_KEY:
                break
            path = _join(path, key)
        else:
            path += f"[{len(open_[i])}]"
    return path


def _anchor(event: Any, anchors: dict[str, Any]) -> None:
    """Note the anchor of ``event``; one given twice in a document is a syntax error."""
    if event.anchor in anchors:
        raise yaml.composer.ComposerError("found duplicate anchor; first occurrence",
                                          anchors[event.anchor], "second occurrence",
                                          event.start_mark)
    anchors[event.anchor] = event.start_mark


def _defined(event: Any, anchors: dict[str, Any]) -> None:
    """An alias to no anchor before it is a syntax error."""
    if event.anchor not in anchors:
        raise yaml.composer.ComposerError(None, None, "found undefined alias", event.start_mark)


def _cut(get: Callable[[], Any], open_: list[Any], keys: list[Any], base: int, key: Any,
         anchors: dict[str, Any]) -> str:
    """Where the node being read is below ``open_[base]`` (and its ``key``, when a key
    is refused); the events of what is open below it read past, and it dropped."""
    path = _field_path(open_, keys, base)
    if key is not _NO_KEY:
        path = _join(path, key)
    _skip(get, len(open_) - base, anchors)
    del open_[base:], keys[base:]
    return path


def _skip(get: Callable[[], Any], depth: int, anchors: dict[str, Any]) -> None:
    """Read past the events of ``depth`` collections left open (what is a syntax error
    to PyYAML's composer there is one still)."""
    while depth:
        event = get()
        kind = type(event)
        if kind is yaml.AliasEvent:
            _defined(event, anchors)
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            depth -= 1
        else:  # a scalar, or a collection's start
            if event.anchor is not None:
                _anchor(event, anchors)
            if kind is not yaml.ScalarEvent:
                depth += 1


def _built(stream: IO[str], pace: Callable[[], None], open_items: bool
           ) -> Iterator[Item | Document | Refused]:
    """The documents built from libyaml's events, and with ``open_items`` their items
    (see :func:`read_documents`); ``_Unusual`` for what is not built here (see
    :func:`load_documents`)."""
    loader = Loader(stream)
    try:
        get, resolve = loader.get_event, loader.resolve
        constructors = loader.yaml_constructors
        #: first character -> the patterns a plain scalar so starting may resolve by;
        #: most start otherwise (names, labels) and are strings without a call
        implicit = loader.yaml_implicit_resolvers
        number = 0
        #: the mappings and sequences being built, innermost last, and for each its key
        #: waiting for a value (``_NO_KEY``: none; a sequence's is never used)
        open_: list[Any] = []
        keys: list[Any] = []
        root: Any = None
        #: the sequence whose elements are handed out rather than kept, its place in
        #: ``open_`` (1 or 2), and how many sequences of the document were
        opening: list[Any] | None = None
        depth = handed = opened = 0
        #: the anchors of the document and where each is (aliases are refused, but what
        #: is a syntax error to PyYAML's composer is one here too)
        anchors: dict[str, Any] = {}
        #: the document is refused, yielded at its end
        refused: Refused | None = None
        n = 0
        while True:
            event = get()
            kind = type(event)
            if kind is yaml.ScalarEvent:
                if event.anchor is not None:
                    _anchor(event, anchors)
                tag, value = event.tag, event.value
                if tag is None or tag == "!":
                    tag = (resolve(yaml.ScalarNode, value, event.implicit)
                           if event.implicit[0] and value[:1] in implicit else _STR)
                if tag == _STR:  # a timestamp too, by the constructor (Loader)
                    obj: Any = value
                else:
                    make = constructors.get(tag)
                    if make is None or tag in _KEY_TAGS:
                        raise _Unusual
                    obj = make(loader, yaml.ScalarNode(tag, value, style=event.style))
            elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
                mapping = kind is yaml.MappingStartEvent
                if event.tag not in (_MAP_TAGS if mapping else _SEQ_TAGS):
                    raise _Unusual
                if event.anchor is not None:
                    _anchor(event, anchors)
                open_.append({} if mapping else [])
                if open_items and not mapping and (
                        len(open_) == 1
                        or (len(open_) == 2 and keys[0] == "items" and type(open_[0]) is dict)):
                    opening, depth, handed = open_[-1], len(open_), 0
                keys.append(_NO_KEY)
                continue
            elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
                obj = open_.pop()
                keys.pop()
                if obj is opening:
                    opening = None
                    opened += 1
                    if open_:
                        obj = HANDED_OUT
            elif kind is yaml.DocumentEndEvent:
                if refused is not None:
                    number += 1
                    yield refused
                elif root is not None:
                    number += 1
                    yield Document(number, root, opened)
                root = refused = None
                opened = 0
                anchors.clear()
                pace()
                continue
            elif kind is yaml.StreamEndEvent:
                return
            elif kind is yaml.AliasEvent:
                _defined(event, anchors)
                why = f"YAML alias *{event.anchor} at {_at(event.start_mark)}: {_NO_ALIASES}"
                # the rest of the element handed out, or of the document, is read past
                path = _cut(get, open_, keys, depth if opening is not None else 0, _NO_KEY,
                            anchors)
                if opening is not None:  # an element handed out: only it is refused
                    yield Refused(number + 1, handed, path, why, in_items=depth == 2)
                    handed += 1
                elif opened:  # some of the document's elements were handed out
                    raise _Unusual
                else:
                    refused = Refused(number + 1, None, path, why)
                continue
            else:  # the stream's and a document's start
                continue
            if not open_:
                root = obj
            elif type(top := open_[-1]) is list:
                if top is opening:
                    yield Item(number + 1, handed, obj, open_[0] if len(open_) == 2 else None)
                    handed += 1
                else:
                    top.append(obj)
            elif (key := keys[-1]) is _NO_KEY:
                if isinstance(obj, (dict, list)):  # the constructor's "unhashable key"
                    raise _Unusual
                if obj in top:  # as for an alias, above
                    why = _duplicate(obj, event.start_mark)
                    path = _cut(get, open_, keys, depth if opening is not None else 0, obj,
                                anchors)
                    if opening is not None:
                        yield Refused(number + 1, handed, path, why, in_items=depth == 2)
                        handed += 1
                    elif opened:
                        raise _Unusual
                    else:
                        refused = Refused(number + 1, None, path, why)
                    continue
                keys[-1] = obj
            else:
                top[key] = obj
                keys[-1] = _NO_KEY
            n += 1
            if n % _PACE_EVERY == 0:
                pace()
    finally:
        loader.dispose()
