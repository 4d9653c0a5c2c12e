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
from proxy.karta.yamltext import Loader, load_documents, yaml_error


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
