"""One wording for a YAML parse error, whoever reads the file; documents built from the
parser's events equal PyYAML's own."""

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
    Reread,
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


def _reference(text: str) -> list[Any]:
    return [d for d in yaml.load_all(text, Loader=Loader) if d is not None]


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(_values, min_size=1, max_size=3), flow=st.sampled_from([None, True, False]),
       start=st.booleans(), width=st.sampled_from([8, 80]))
def test_documents_built_from_events_equal_pyyamls(docs: list[Any], flow: bool | None,
                                                    start: bool, width: int) -> None:
    text = yaml.safe_dump_all(docs, default_flow_style=flow, explicit_start=start,
                              width=width, allow_unicode=True)
    assert load_documents(io.StringIO(text)) == _reference(text)


#: what the event builder leaves to PyYAML: each is read again with ``yaml.load_all``
UNUSUAL = {
    "anchor and alias": "a: &x {b: 1}\nc: *x\n",
    "merge key": "base: &b {x: 1}\nmore:\n  <<: *b\n  y: 2\n",
    "set": "!!set {a, b}\n",
    "ordered map": "!!omap [a: 1, b: 2]\n",
    "value key": "= : 1\n",
    "anchored scalar": "a: &s text\nb: *s\n",
}


@pytest.mark.parametrize("text", list(UNUSUAL.values()), ids=list(UNUSUAL))
def test_what_the_builder_leaves_to_pyyaml_comes_out_the_same(text: str) -> None:
    assert load_documents(io.StringIO(text)) == _reference(text)


@pytest.mark.parametrize("text", [
    "? [a, b]\n: 1\n",  # a key that cannot be a dict key
    "a: !!python/name:os.system x\n",  # a tag the safe loader refuses
    "a: *undefined\n",
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
            "1: int key\ntrue: bool key\n~: null key\n"
            "---\n--- ~\n---\n- !!map {x: 1}\n- !!seq [1]\n- ! plain\n")
    ours, ref = load_documents(io.StringIO(text)), _reference(text)
    assert math.isnan(ours[0].pop("h")) and math.isnan(ref[0].pop("h"))
    assert ours == ref and len(ours) == 2


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
        return "ok", repr(load(text))
    except Exception as e:  # any refusal, compared by type and text
        return type(e).__name__, yaml_error(e) if isinstance(e, yaml.YAMLError) else str(e)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab01.-:?,[]{}#&*!|>'\"%@`~<= \n\t\\")), max_size=40))
def test_any_text_loads_or_is_refused_as_pyyaml_does(text: str) -> None:
    ours = _outcome(lambda t: load_documents(io.StringIO(t)), text)
    assert ours == _outcome(_reference, text)


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
        assert part.number == len(docs) + 1
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
    "items: [a]\n---\nb: &x 1\nc: *x\n",  # an alias after a document handed out
    "items: [a, b]\nkind: &k List\n",  # an anchor after an item
])
def test_what_needs_pyyaml_after_something_was_handed_out_is_a_reread(text: str) -> None:
    with pytest.raises(Reread):
        list(read_documents(io.StringIO(text)))
    assert load_documents(io.StringIO(text)) == _reference(text)


def test_what_needs_pyyaml_before_anything_was_handed_out_is_read_by_it() -> None:
    text = "a: &x {b: 1}\nc: *x\nitems: [1, 2]\n---\nitems: [3]\n"
    parts = list(read_documents(io.StringIO(text)))
    assert parts == [Document(1, _reference(text)[0]), Document(2, {"items": [3]})]
