"""Reading YAML text: libyaml's safe loader where present, big streams built from its
events (:func:`load_documents`), and a parse error as one line.

Description files, snapshot files and the configuration file all tell an operator that a
file is not valid YAML; the line and column are what finds the mistake, so all three say
it in one wording, made here. It sits in ``proxy.karta`` because the engine's package
imports nothing above it (``tests/test_layout.py``) and its description files need it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import yaml

#: libyaml's safe loader when present: several times faster on big snapshots
Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

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
    text = " ".join(text.split())
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."


#: what a mapping being built is waiting for: its next key
_NO_KEY: Any = object()
_STR = "tag:yaml.org,2002:str"
_MAP_TAGS = (None, "!", "tag:yaml.org,2002:map")
_SEQ_TAGS = (None, "!", "tag:yaml.org,2002:seq")
#: keys the safe constructor gives a meaning of their own (``<<`` merges, ``=`` values)
_KEY_TAGS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")
#: events between two calls of ``pace``
_PACE_EVERY = 256


class _Unusual(Exception):
    """A feature the event builder leaves to PyYAML's own composer and constructor."""


class Reread(Exception):
    """What :func:`read_documents` handed out is to be dropped and the stream read again
    whole (:func:`load_documents`): the rest of it needs PyYAML (an alias, a merge key,
    ...), or, raised by its caller, a document whose items were handed out was not the
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


def load_documents(stream: IO[str], pace: Callable[[], None] = lambda: None) -> list[Any]:
    """Every non-empty document of a YAML stream, equal to what ``yaml.load_all(stream,
    Loader)`` makes, read from the stream a block at a time.

    A Kubernetes export is one document (``kubectl get -o yaml`` writes a ``List``), and
    libyaml composes a whole document into nodes before anything is built, with the GIL
    held and no chance to pause: at 37.5k pods (40 MB) that took 42 s, holding a
    reload's event loop up to 10.8 s at a time. Built here from the parser's events,
    the same file takes ~8 s and ``pace`` is called every ``_PACE_EVERY`` events.
    Anchors, aliases, merge keys and tags other than the standard ones are left to
    PyYAML: the stream is read again from its start with ``yaml.load_all``."""
    try:
        return [part.value for part in _built(stream, pace, open_items=False)
                if isinstance(part, Document)]
    except _Unusual:
        stream.seek(0)
    return _pyyaml_documents(stream, pace)


def read_documents(stream: IO[str], pace: Callable[[], None] = lambda: None
                   ) -> Iterator[Item | Document]:
    """The documents of :func:`load_documents`, with the elements of a top-level
    ``items`` sequence (and of a document that is a sequence) handed out one at a time as
    they are built, before their document is complete.

    A ``List`` of 37.5k pods built whole before its first item is read costs ~300 MB at
    its peak; handed out one by one, only the item being read is alive. ``kubectl``
    sorts keys, so ``items`` comes before ``kind``: only the caller, at the document's
    end, knows whether the items were a list's, and raises :class:`Reread` if not.
    Raises :class:`Reread` itself when, after handing something out, the stream turns
    out to need PyYAML's loader."""
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
    for i, doc in enumerate(_pyyaml_documents(stream, pace), 1):
        yield Document(i, doc)


def _pyyaml_documents(stream: IO[str], pace: Callable[[], None]) -> list[Any]:
    docs = []
    for doc in yaml.load_all(stream, Loader=Loader):
        if doc is not None:
            docs.append(doc)
        pace()
    return docs


def _built(stream: IO[str], pace: Callable[[], None], open_items: bool
           ) -> Iterator[Item | Document]:
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
        #: the sequence whose elements are handed out rather than kept, and how many
        #: sequences of the document were
        opening: list[Any] | None = None
        handed = opened = 0
        n = 0
        while True:
            event = get()
            kind = type(event)
            if kind is yaml.ScalarEvent:
                if event.anchor is not None:
                    raise _Unusual
                tag, value = event.tag, event.value
                if tag is None or tag == "!":
                    tag = (resolve(yaml.ScalarNode, value, event.implicit)
                           if event.implicit[0] and value[:1] in implicit else _STR)
                if tag == _STR:
                    obj: Any = value
                else:
                    make = constructors.get(tag)
                    if make is None or tag in _KEY_TAGS:
                        raise _Unusual
                    obj = make(loader, yaml.ScalarNode(tag, value, style=event.style))
            elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
                mapping = kind is yaml.MappingStartEvent
                if event.anchor is not None or event.tag not in (
                        _MAP_TAGS if mapping else _SEQ_TAGS):
                    raise _Unusual
                open_.append({} if mapping else [])
                if open_items and not mapping and (
                        len(open_) == 1
                        or (len(open_) == 2 and keys[0] == "items" and type(open_[0]) is dict)):
                    opening, handed = open_[-1], 0
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
                if root is not None:
                    number += 1
                    yield Document(number, root, opened)
                root = None
                opened = 0
                pace()
                continue
            elif kind is yaml.StreamEndEvent:
                return
            elif kind is yaml.AliasEvent:
                raise _Unusual
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
                keys[-1] = obj
            else:
                top[key] = obj
                keys[-1] = _NO_KEY
            n += 1
            if n % _PACE_EVERY == 0:
                pace()
    finally:
        loader.dispose()
