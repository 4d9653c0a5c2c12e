"""The reader of Kubernetes object files: JSON and YAML lists read an item at a time,
yet as if parsed whole; files it cannot read refused with their reason."""

from __future__ import annotations

import io
import json
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import object_files
from proxy.karta.yamltext import Reread, load_documents
from proxy.object_files import (
    READ_CHARS,
    FileContent,
    SkippedFile,
    _classify,
    _flatten,
    _json_items,
    _yaml_items,
    read_file,
)
from tests.test_snapshot import _pod


def test_flatten_can_release_what_it_handed_out() -> None:
    """A read's documents are freed an item at a time as they are read (``release``),
    not whole at the end; the items are the same either way."""
    def docs() -> list[Any]:
        return [{"kind": "PodList", "apiVersion": "v1", "items": [{"metadata": {"name": "a"}},
                                                                 {"metadata": {"name": "b"}}]},
                [{"kind": "Pod"}, {"kind": "Pod", "n": 2}], {"kind": "Pod", "n": 3}]

    kept = docs()
    released = docs()
    items = released[0]["items"]
    gen = _flatten(released, release=True)
    got = [next(gen)]
    assert released[0] is None  # the list lets go of the document
    got.append(next(gen))
    assert items == [None, None]  # and of each item handed out
    got.extend(gen)
    assert got == list(_flatten(kept)) and len(got) == 5
    assert released == [None, None, None]
    assert got[0][1] == {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}}


def test_a_yaml_value_its_tag_refuses_is_an_invalid_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("kind: Pod\nmetadata: {name: x}\nspec: {n: !!int abc}\n")
    got = read_file(f)
    assert isinstance(got, SkippedFile)
    assert got.reason.startswith("invalid YAML: ") and "abc" in got.reason, got.reason


def test_an_empty_snapshot_is_nothing_loadable(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    fc = read_file(tmp_path / "empty.yaml")
    assert isinstance(fc, SkippedFile) and "no Kubernetes objects" in fc.reason


# -- JSON lists are read one item at a time -----------------------------------------------


#: one document each: lists as kubectl and the API write them, and what is not one
LIST_DOCS: list[Any] = [
    # kubectl get -o json: kind after the items
    {"apiVersion": "v1", "items": [{"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": "a"}}], "kind": "List",
     "metadata": {}},
    # the API's typed list: kind first, items without kind
    {"kind": "PodList", "apiVersion": "v1", "metadata": {},
     "items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]},
    {"kind": "List", "items": []},
    {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"},
     "items": [1, 2]},  # not a List: an object with an items field of its own
    [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a"}}],
    {"kind": "List"},
    "just a string",
]


@pytest.mark.parametrize("doc", LIST_DOCS)
@pytest.mark.parametrize("window", [1, 2, 7, 64, READ_CHARS])
def test_json_items_are_what_a_whole_parse_gives(
        doc: Any, window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the window's size, down to one character: values cut at its end (a
    number, a string, an object) are read on with the next chunk."""
    monkeypatch.setattr(object_files, "READ_CHARS", window)
    for text in (json.dumps(doc), json.dumps(doc, indent=2), f"  {json.dumps(doc)}\n"):
        assert list(_json_items(io.StringIO(text))) == list(_flatten([doc]))


@pytest.mark.parametrize("window", [1, 3, READ_CHARS])
@pytest.mark.parametrize("text", ['{"kind": "List", "items": [1, 2', '{"kind": "List"} x',
                                  '{"kind": "List", "items": [1,, 2]}', '{"a" 1}', "{",
                                  "", "  ", "[1, 2] 3", "[1 2]", '"a" "b"', "12 3", "[",
                                  '{"kind": "List", "items": [1, 2], 3: 4}'])
def test_json_items_refuse_what_json_refuses(
        text: str, window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(object_files, "READ_CHARS", window)
    with pytest.raises(ValueError):
        list(_json_items(io.StringIO(text)))
    with pytest.raises(ValueError):
        json.loads(text)


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20))
@settings(max_examples=300, deadline=None)
def test_json_items_of_any_list_are_its_items(item: Any) -> None:
    """Any JSON value as the items of a List, read through a 3-character window."""
    doc = {"items": [item, {"n": item}], "kind": "List", "apiVersion": "v1"}
    old = object_files.READ_CHARS
    object_files.READ_CHARS = 3
    try:
        for text in (json.dumps(doc), json.dumps(doc, indent=1)):
            assert list(_json_items(io.StringIO(text))) == list(_flatten([doc]))
    finally:
        object_files.READ_CHARS = old


def test_a_json_file_is_never_read_whole(tmp_path: Path) -> None:
    """A 6 MB List is read through the window: the largest read is READ_CHARS."""
    pods = [_pod(f"p{i}", f"u-{i}", None) for i in range(20_000)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"items": pods, "kind": "List", "apiVersion": "v1"}))
    reads: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kw: Any) -> Any:
        f = real_open(self, *args, **kw)
        read = f.read

        def sized(n: int = -1) -> Any:
            reads.append(n)
            return read(n)

        f.read = sized
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "open", counting_open)
        fc = read_file(path)
    assert not isinstance(fc, SkippedFile) and len(fc.objects) == len(pods)
    assert reads and all(0 < n <= READ_CHARS for n in reads)


def test_a_broken_json_file_is_refused_with_positions_in_the_file(tmp_path: Path) -> None:
    good = json.dumps({"kind": "List", "items": [{"a": i} for i in range(5000)]})
    path = tmp_path / "broken.json"
    path.write_text(good[:-20] + "x" + good[-19:])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(object_files, "READ_CHARS", 1000)
        got = read_file(path)
    assert isinstance(got, SkippedFile)
    try:
        json.loads(path.read_text())
    except ValueError as e:
        assert got.reason == f"invalid JSON: {e}"
    (tmp_path / "latin.json").write_bytes(b'{"kind": "List", "items": ["\xe9"]}')
    got = read_file(tmp_path / "latin.json")
    assert isinstance(got, SkippedFile) and got.reason.startswith("not UTF-8 text (")
    assert "at byte 28" in got.reason  # in the file, not in a window


def test_a_json_list_snapshot_loads_its_pods_slimmed(tmp_path: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p-1", "namespace": "ns", "uid": "u1",
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "rs", "uid": "r1", "controller": True}]},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x" * 1000}]},
           "status": {"phase": "Running", "containerStatuses": [{"name": "c"}]}}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"apiVersion": "v1", "items": [pod], "kind": "List"}))
    fc = read_file(path)
    assert not isinstance(fc, SkippedFile)
    (obj,) = fc.objects
    assert isinstance(obj, dict)  # read_file holds parsed objects unless packed=True
    assert obj["spec"] == {"nodeName": "n1"} and obj["status"] == {"phase": "Running"}


# -- YAML lists are read one item at a time -----------------------------------------------


def _as_read(fc: FileContent | SkippedFile) -> Any:
    if isinstance(fc, SkippedFile):
        return fc.reason
    return fc.objects, fc.invalid, fc.description_docs, fc.uids_derived


def _read_whole(path: Path) -> Any:
    """What ``read_file`` gave before a list's items were handed out as built: every
    document parsed whole (a document with an alias or a key given twice refused whole),
    then classified."""
    fc = FileContent(str(path))
    docs = load_documents(io.StringIO(path.read_text()))
    for where, item in _flatten(docs):
        _classify(fc, where, item)
    if not fc.objects and not fc.description_docs:
        return f"no Kubernetes objects ({fc.invalid[0] if fc.invalid else 'the file is empty'})"
    return _as_read(fc)


_POD_A = "{apiVersion: v1, kind: Pod, metadata: {name: a}}"
#: what only YAML text can say (keys given twice, refused), or orders kubectl does not write
YAML_LISTS = {
    "items given twice": f"apiVersion: v1\nkind: List\nitems: [{_POD_A}]\n"
                         "items: [{apiVersion: v1, kind: Pod, metadata: {name: b}}]\n",
    "items, then not a sequence": f"items:\n- {_POD_A}\nitems: ~\nkind: List\n",
    "kind after kindless items": "apiVersion: v1\nitems:\n- metadata: {name: a}\nkind: PodList\n",
    "apiVersion after kindless items": "kind: PodList\nitems:\n- metadata: {name: a}\n"
                                       "apiVersion: v1\n",
    "kind given again after items": "apiVersion: v1\nkind: PodList\nitems:\n"
                                    "- metadata: {name: a}\nkind: ServiceList\n",
    "kinds of their own and not": f"apiVersion: v1\nitems:\n- {_POD_A}\n- metadata: {{name: b}}\n"
                                  "- {kind: Pod, apiVersion: v1, metadata: {name: c}}\n"
                                  "kind: PodList\n",
    "a kindless item of a plain List": "apiVersion: v1\nitems:\n- metadata: {name: a}\n"
                                       "kind: List\n",
    "an alias after an item": f"items: [{_POD_A}, &b {{kind: Pod}}]\nkind: List\nx: *b\n",
    "documents around a list": f"{_POD_A}\n---\nitems: [{_POD_A}, 3]\nkind: List\n---\n"
                               "- {kind: Pod}\n---\n~\n---\nitems: [x]\nkind: Widget\n",
}


@pytest.mark.parametrize("text", [*(yaml.safe_dump(d, sort_keys=s) for d in LIST_DOCS
                                    for s in (True, False)), *YAML_LISTS.values()],
                         ids=[*(f"{i}-{s}" for i in range(len(LIST_DOCS)) for s in "sk"),
                              *YAML_LISTS])
def test_a_yaml_file_reads_as_if_parsed_whole(text: str, tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert _as_read(read_file(path)) == _read_whole(path)


@pytest.mark.parametrize("name", ["items given twice", "items, then not a sequence",
                                  "kind given again after items", "an alias after an item"])
def test_a_yaml_document_not_the_list_its_items_were_read_for_is_read_again(name: str) -> None:
    with pytest.raises(Reread):
        list(_yaml_items(io.StringIO(YAML_LISTS[name])))


_list_docs = st.fixed_dictionaries(
    {"items": st.lists(st.one_of(
        st.fixed_dictionaries({"metadata": st.fixed_dictionaries({"name": st.sampled_from("ab")})},
                              optional={"kind": st.sampled_from(["Pod", "Service"]),
                                        "apiVersion": st.just("v1")}),
        st.integers(), st.none()), max_size=4)},
    optional={"kind": st.sampled_from(["List", "PodList", "Widget", "", 3]),
              "apiVersion": st.sampled_from(["v1", "apps/v1"]),
              "metadata": st.builds(dict)})  # a fresh one each: one shared is dumped as an alias


@settings(max_examples=200, deadline=None)
@given(docs=st.lists(st.one_of(_list_docs, st.lists(_list_docs, max_size=2)),
                     min_size=1, max_size=3), sort_keys=st.booleans(),
       flow=st.sampled_from([None, True, False]))
def test_any_yaml_lists_read_as_if_parsed_whole(docs: list[Any], sort_keys: bool,
                                                flow: bool | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=sort_keys, default_flow_style=flow))
        assert _as_read(read_file(path)) == _read_whole(path)


def test_a_yaml_list_is_read_one_item_at_a_time(tmp_path: Path) -> None:
    """A 3,000-pod ``kubectl get -o yaml`` export: the read's peak is what it keeps (held
    as a source holds them) and one item, not the whole list built first (6x)."""
    pods = [_pod(f"p{i}", f"u-{i}", ("ReplicaSet", "rs", "rs-1")) for i in range(3000)]
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "items": pods, "kind": "List",
                                    "metadata": {"resourceVersion": ""}}))
    tracemalloc.start()
    try:
        fc = read_file(path, packed=True)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not isinstance(fc, SkippedFile) and len(fc.objects) == 3000
    assert peak < 1.5 * kept, (kept, peak)
