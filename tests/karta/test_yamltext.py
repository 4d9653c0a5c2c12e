"""One wording for a YAML parse error, whoever reads the file; documents built from the
parser's events equal PyYAML's own; what Kubernetes does not read as YAML 1.1 does (an
alias, a key given twice, a timestamp) read as Kubernetes reads it."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.karta import yamltext
from proxy.karta.yamltext import (
    HANDED_OUT,
    Document,
    Item,
    Loader,
    Refused,
    Reread,
    iter_documents,
    load_documents,
    read_documents,
    yaml_error,
)


def parse_error(text: str) -> yaml.YAMLError:
    with pytest.raises(yaml.YAMLError) as e:
        list(yaml.load_all(text, Loader=Loader))
    return e.value


def test_position_problem_and_context_on_one_line() -> None:
    got = yaml_error(parse_error("a:\n  b: 1\n c: 2\n"))
    assert got.startswith("invalid YAML: line 3, column 2: "), got
    assert "(while parsing a block mapping at line 1, column 1)" in got, got
    assert "\n" not in got


def test_an_error_without_a_position_is_its_own_text_cut_short() -> None:
    got = yaml_error(yaml.YAMLError("first\nsecond " + "x" * 400))
    assert got.startswith("invalid YAML: first second x")
    assert len(got) == 300 and got.endswith("...")


# -- load_documents ----------------------------------------------------------------------

#: strings that resolve to something else when plain, or look like they might
_TRICKY = ["yes", "No", "on", "OFF", "~", "null", "", "1e3", "0x1F", "0o17", "017", "1_000",
           ".5", "-.inf", ".NaN", "2024-01-01", "2024-01-01T12:00:00Z", "12:30:00", "<<",
           "=", "-", "- a", "a: b", "#x", "&a", "*a", "!t", "%", "@", "`", "'", '"', "\\",
           "\t", "é", "\u2028", " lead", "trail ", "multi\nline", "true", "False", "0"]
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.floats(allow_nan=False), st.sampled_from(_TRICKY), st.text(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), st.sampled_from(_TRICKY),
                                  st.integers(), st.booleans()), inner, max_size=4),
    ),
    max_leaves=25,
)


def _plain(doc: Any) -> Any:
    """A refused document as what it was refused for and where, whoever refused it (the
    event builder names the alias, PyYAML's composer only the node it names)."""
    if isinstance(doc, Refused):
        return ("refused", doc.document, doc.index, doc.path,
                "alias" if doc.reason.startswith("YAML alias") else doc.reason.split(" at ")[0])
    return doc


def _reference(text: str) -> list[Any]:
    """What PyYAML's composer and constructor make of ``text`` (``Loader``), each document
    checked on the composed nodes (``refusal``)."""
    return [_plain(p.value if isinstance(p, Document) else p)
            for p in yamltext._pyyaml_parts(io.StringIO(text), lambda: None)]


def _ours(text: str) -> list[Any]:
    return [_plain(d) for d in load_documents(io.StringIO(text))]


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(_values, min_size=1, max_size=3), flow=st.sampled_from([None, True, False]),
       start=st.booleans(), width=st.sampled_from([8, 80]))
def test_documents_built_from_events_equal_pyyamls(docs: list[Any], flow: bool | None,
                                                    start: bool, width: int) -> None:
    text = yaml.safe_dump_all(docs, default_flow_style=flow, explicit_start=start,
                              width=width, allow_unicode=True)
    assert load_documents(io.StringIO(text)) == _reference(text)
    assert _reference(text) == [d for d in yaml.load_all(text, Loader=Loader) if d is not None]


#: what the event builder leaves to PyYAML: each is read again with ``Loader``
UNUSUAL = {
    "merge key": "more:\n  <<: {x: 1}\n  y: 2\n",
    "set": "!!set {a, b}\n",
    "ordered map": "!!omap [a: 1, b: 2]\n",
    "value key": "= : 1\n",
}


@pytest.mark.parametrize("text", list(UNUSUAL.values()), ids=list(UNUSUAL))
def test_what_the_builder_leaves_to_pyyaml_comes_out_the_same(text: str) -> None:
    assert load_documents(io.StringIO(text)) == _reference(text)
    assert _reference(text) == list(yaml.load_all(text, Loader=Loader))


#: text -> (path, why) of the first document, refused; the second is read
REFUSED = {
    "anchor and alias": ("a: &x {b: 1}\nc: *x\n", "c", "alias"),
    "anchored scalar": ("a: &s text\nb: *s\n", "b", "alias"),
    "alias as a key": ("a: &k x\n*k : 1\n", "", "alias"),
    "an alias of what holds it": ("a: &a [1, *a]\n", "a[1]", "alias"),
    "merge of an alias": ("base: &b {x: 1}\nmore:\n  <<: *b\n  y: 2\n", "more", "alias"),
    "nested aliases": ("".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10 if i else ["lol"])
                               + "]\n" for i in range(8)), "l1[0]", "alias"),
    "a key given twice": ("a: 1\nb: {c: [1, {d: 1, d: 2}]}\n", "b.c[1].d", "duplicate key 'd'"),
    "a key given twice, the other spelled otherwise": ("1: a\n0x1: b\n", "1", "duplicate key 1"),
    "a key given twice beside a merge": ("m: {<<: {x: 1}, y: 2, y: 3}\n", "m.y",
                                         "duplicate key 'y'"),
    "a key given twice after an alias": ("a: &x 1\nb: *x\nb: 2\n", "b", "alias"),
}


@pytest.mark.parametrize("case", list(REFUSED.values()), ids=list(REFUSED))
def test_an_alias_or_a_key_given_twice_refuses_its_document_only(
        case: tuple[str, str, str]) -> None:
    text, path, why = case
    text += "---\nnext: 2026-01-01T00:00:00Z\n"
    expected = [("refused", 1, None, path, why), {"next": "2026-01-01T00:00:00Z"}]
    assert _ours(text) == expected
    assert _reference(text) == expected
    (refused, _), = [(p, 0) for p in iter_documents(io.StringIO(text)) if isinstance(p, Refused)]
    assert refused.where == "document 1" and "line " in refused.reason


def test_a_refusal_names_the_line_and_the_key() -> None:
    (alias, dup), = [load_documents(io.StringIO("a: &x [1]\nb:\n  c: *x\n---\nk: 1\nk: 2\n"))]
    assert isinstance(alias, Refused) and isinstance(dup, Refused)
    assert str(alias) == ("b.c: YAML alias *x at line 3, column 6: aliases are not accepted "
                          "(kubectl never writes one, and a few nested ones can stand for "
                          "gigabytes)")
    assert str(dup).startswith("k: duplicate key 'k' at line 6, column 1 (kubectl refuses")
    assert dup.document == 2


def test_a_refusal_with_aliases_allowed_finds_only_keys_given_twice() -> None:
    """The configuration file's check (proxy/config.py): aliases and merge keys pass, a
    key overriding a merged one is no duplicate, a key given twice in any mapping (one
    an alias names, one merged in) is found once, where it is written."""

    def found(text: str) -> Any:
        loader = yaml.SafeLoader(text)
        try:
            return yamltext.refusal(loader.get_single_node(), loader, aliases=True)
        finally:
            loader.dispose()

    assert found("a: &x {b: 1}\nc: *x\nd: {<<: *x, b: 2}\ne: [*x, *x]\n") is None
    dup = found("a: &x {b: 1, b: 2}\nc: *x\n")
    assert isinstance(dup, yamltext.DuplicateKey)
    assert (dup.mapping, dup.key, dup.node.value, dup.node.start_mark.line) == ("a", "b", "b", 0)
    dup = found("a:\n  <<: {b: 1, b: 2}\n")
    assert isinstance(dup, yamltext.DuplicateKey) and dup.mapping == "a"
    # ten levels of ten aliases: looked through once each, not 10**10 times
    bomb = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10 if i else ["lol"]) + "]\n"
                   for i in range(11))
    assert found(bomb) is None


def test_an_alias_bomb_is_refused_without_being_expanded() -> None:
    # ten levels of ten aliases: 10**10 strings if anything expanded them
    text = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10 if i else ["lol"]) + "]\n"
                   for i in range(11))
    (doc,) = load_documents(io.StringIO(text))
    assert isinstance(doc, Refused) and doc.path == "l1[0]"
    # left to PyYAML by a merge key before it: refused on the composed nodes
    (doc,) = load_documents(io.StringIO("m: {<<: {x: 1}}\n" + text))
    assert isinstance(doc, Refused) and doc.path == "l1[0]"


def test_timestamps_are_the_strings_written() -> None:
    text = ("t: 2026-01-01T00:00:00Z\nd: 2024-01-02\ns: 2024-01-01 10:00:00.5 +02:00\n"
            "e: !!timestamp 2024-01-03\n")
    expected = [{"t": "2026-01-01T00:00:00Z", "d": "2024-01-02",
                 "s": "2024-01-01 10:00:00.5 +02:00", "e": "2024-01-03"}]
    assert load_documents(io.StringIO(text)) == expected
    assert load_documents(io.StringIO("m: {<<: {x: 1}}\n---\n" + text))[1:] == expected
    assert list(yaml.load_all(text, Loader=Loader)) == expected


@pytest.mark.parametrize("text", [
    "? [a, b]\n: 1\n",  # a key that cannot be a dict key
    "a: !!python/name:os.system x\n",  # a tag the safe loader refuses
    "a: *undefined\n",
    "a: &x 1\nb: *x\nc: *undefined\n",  # in what a refusal skips, too
    "[&a 1, &a 2]\n",  # an anchor given twice
    "a: {b: 1, b: 2}\nc: &d 1\nd: &d 2\n",
    "a: [1, 2\nb: 3\n",  # a syntax error, and one late in a long stream:
    "k: v\n" * 5000 + "x: [\n",
])
def test_a_refused_stream_raises_what_pyyaml_raises(text: str) -> None:
    with pytest.raises(yaml.YAMLError) as ours:
        load_documents(io.StringIO(text))
    assert yaml_error(ours.value) == yaml_error(parse_error(text))


def test_standard_tags_and_non_string_scalars_are_built_as_pyyaml_builds_them() -> None:
    text = ("a: !!str 1\nb: !!int '7'\nc: !!float 2\nd: 2024-01-01 10:00:00\n"
            "e: !!binary aGVsbG8=\nf: !!null ''\ng: !!bool yes\nh: .nan\n"
            "1: int key\nfalse: bool key\n~: null key\n"
            "---\n--- ~\n---\n- !!map {x: 1}\n- !!seq [1]\n- ! plain\n")
    ours, ref = load_documents(io.StringIO(text)), _reference(text)
    assert math.isnan(ours[0].pop("h")) and math.isnan(ref[0].pop("h"))
    assert ours == ref and len(ours) == 2
    assert ours[0]["d"] == "2024-01-01 10:00:00"  # a timestamp: the string written


class _Reads(io.StringIO):
    """A text stream that remembers the largest read."""

    largest = 0

    def read(self, size: int | None = -1) -> str:
        got = super().read(size)
        self.largest = max(self.largest, len(got))
        return got


def test_one_big_document_is_read_a_block_at_a_time_and_paced() -> None:
    pods = [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"p{i}", "namespace": "ns", "uid": f"u{i}",
                          "labels": {"app": "a", "n": str(i)}}} for i in range(2000)]
    text = yaml.safe_dump({"apiVersion": "v1", "items": pods, "kind": "List"})
    paces = 0

    def pace() -> None:
        nonlocal paces
        paces += 1

    stream = _Reads(text)
    assert load_documents(stream, pace) == _reference(text)
    assert stream.largest < len(text) // 10
    # ~16 events a pod: a pause every _PACE_EVERY events, not one for the document
    assert paces >= 2000 * 16 // yamltext._PACE_EVERY


def _outcome(load: Any, text: str) -> tuple[str, str]:
    """What loading ``text`` gives: the documents' repr (NaN-safe), or the error raised."""
    try:
        return "ok", repr([_plain(d) for d in load(text)])
    except Exception as e:  # any refusal, compared by type and text
        return type(e).__name__, yaml_error(e) if isinstance(e, yaml.YAMLError) else str(e)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab01.-:?,[]{}#&*!|>'\"%@`~<= \n\t\\")), max_size=40))
def test_any_text_loads_or_is_refused_as_pyyaml_does(text: str) -> None:
    ours = _outcome(lambda t: load_documents(io.StringIO(t)), text)
    assert ours == _outcome(lambda t: [p.value if isinstance(p, Document) else p for p in
                                       yamltext._pyyaml_parts(io.StringIO(t), lambda: None)], text)


# -- read_documents ----------------------------------------------------------------------


def _reassembled(text: str) -> list[Any]:
    """The documents of ``read_documents``, their items put back where they were handed
    out from."""
    docs: list[Any] = []
    items: dict[int, list[Any]] = {}
    for part in read_documents(io.StringIO(text)):
        if isinstance(part, Item):
            got = items.setdefault(part.document, [])
            assert part.index == len(got)
            got.append(part.value)
            continue
        assert isinstance(part, Document) and part.number == len(docs) + 1
        doc, opened = part.value, items.pop(part.number, [])
        if isinstance(doc, list) and part.opened:
            assert doc == []  # a document that is a sequence: every element handed out
            doc = opened
        elif part.opened:
            assert part.opened == 1 and doc["items"] is HANDED_OUT
            doc["items"] = opened
        else:
            assert not opened
        docs.append(doc)
    assert not items
    return docs


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(st.one_of(
    _values,
    st.dictionaries(st.sampled_from(["apiVersion", "kind", "items", "metadata"]),
                    _values, max_size=4),
    st.fixed_dictionaries({"items": st.lists(_values, max_size=4)},
                          optional={"kind": st.sampled_from(["List", "PodList", "Pod", 7])}),
), min_size=1, max_size=3), flow=st.sampled_from([None, True, False]),
    sort_keys=st.booleans())
def test_documents_with_their_items_handed_out_equal_pyyamls(
        docs: list[Any], flow: bool | None, sort_keys: bool) -> None:
    text = yaml.safe_dump_all(docs, default_flow_style=flow, sort_keys=sort_keys,
                              allow_unicode=True)
    assert _reassembled(text) == _reference(text)


def test_only_a_top_level_items_sequence_is_handed_out() -> None:
    text = ("kind: List\nitems:\n- {a: 1, items: [x, y]}\n- [2]\nmetadata: {items: [z]}\n"
            "---\n- {b: 1}\n- 3\n---\nitems: {a: 1}\n---\n[[4]]\n")
    parts, heads = [], []
    for p in read_documents(io.StringIO(text)):  # the head as it is when the item comes
        parts.append(p)
        heads.append(dict(p.head) if isinstance(p, Item) and p.head is not None else None)
    assert [(p.document, p.index, p.value, h) for p, h in zip(parts, heads, strict=True)
            if isinstance(p, Item)] == [
        (1, 0, {"a": 1, "items": ["x", "y"]}, {"kind": "List"}),
        (1, 1, [2], {"kind": "List"}),
        (2, 0, {"b": 1}, None),
        (2, 1, 3, None),
        (4, 0, [4], None),
    ]
    assert [p for p in parts if isinstance(p, Document)] == [
        Document(1, {"kind": "List", "items": HANDED_OUT, "metadata": {"items": ["z"]}}, 1),
        Document(2, [], 1),
        Document(3, {"items": {"a": 1}}),
        Document(4, [], 1),
    ]
    assert _reassembled(text) == _reference(text)


def test_an_item_is_handed_out_before_its_list_is_read() -> None:
    pods = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}"}}
            for i in range(5000)]
    stream = _Reads(yaml.safe_dump({"apiVersion": "v1", "items": pods, "kind": "List"}))
    first = next(read_documents(stream))
    assert isinstance(first, Item) and first.value == pods[0]
    assert stream.tell() < len(stream.getvalue()) // 10


@pytest.mark.parametrize("text", [
    "items: [a]\n---\nb: {<<: {x: 1}}\n",  # a merge key after a document handed out
    "items: [a, b]\nkind: !!set {List}\n",  # a set after an item
    "items: [a, b]\nkind: List\nkind: List\n",  # its items handed out, the document refused
    "items: [a, b]\nkind: &k List\nx: *k\n",
])
def test_what_needs_pyyaml_after_something_was_handed_out_is_a_reread(text: str) -> None:
    with pytest.raises(Reread):
        list(read_documents(io.StringIO(text)))
    assert _ours(text) == _reference(text)


def test_what_needs_pyyaml_before_anything_was_handed_out_is_read_by_it() -> None:
    text = "a: {<<: {b: 1}}\nitems: [1, 2]\n---\nitems: [3]\n"
    parts = list(read_documents(io.StringIO(text)))
    assert parts == [Document(1, _reference(text)[0]), Document(2, {"items": [3]})]


def test_an_element_handed_out_is_refused_alone() -> None:
    text = ("kind: List\nitems:\n- {a: 1}\n- {b: &x 1, c: *x}\n- {d: {e: 1, e: 2}}\n- *x\n"
            "- {f: 1}\n---\n- [1, 1]\n- &y {g: *y}\n")
    parts = list(read_documents(io.StringIO(text)))
    got = [(type(p).__name__, getattr(p, "where", None), getattr(p, "path", None))
           for p in parts]
    assert got == [("Item", None, None), ("Refused", "document 1.items[1]", "c"),
                   ("Refused", "document 1.items[2]", "d.e"),
                   ("Refused", "document 1.items[3]", ""),
                   ("Item", None, None), ("Document", None, None),
                   ("Item", None, None), ("Refused", "document 2[1]", "g"),
                   ("Document", None, None)]
    assert [p.value for p in parts if isinstance(p, Item)] == [{"a": 1}, {"f": 1}, [1, 1]]
    assert [p.index for p in parts if isinstance(p, Item)] == [0, 4, 0]
