"""The jq sandbox's child in this process: the programs of a request run as one program
on one parse of the input, with the answers of each program run alone (the old way).

The child's own functions are called here (no subprocess; its CPU backstop, an
``RLIMIT_CPU`` of the calling process, replaced by a counter); the real child, its
limits and the parent's deadline are ``test_jq_sandbox.py``'s."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import jq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.karta import jq_child
from proxy.karta.builtin import builtin_descriptions
from proxy.karta.description import load_description_paths
from proxy.karta.jq_sandbox import request_frame
from proxy.karta.jqexpr import JqExpr, jq_text
from tests.karta.clusters import SAMPLES, all_clusters, load_cluster
from tests.karta.test_jq_sandbox import EXPRESSIONS, json_values


def _sources(node: Any, out: set[str]) -> None:
    """Every jq expression's source in a parsed description."""
    if isinstance(node, JqExpr):
        out.add(node.source)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            _sources(getattr(node, f.name), out)
    elif isinstance(node, (list, tuple, set, frozenset)):
        for item in node:
            _sources(item, out)
    elif isinstance(node, dict):
        for item in node.values():
            _sources(item, out)


#: programs that a combined form could get wrong: each must come out as it does alone
TRICKY = [
    # errors: strings, other values (worded by the binding: json.dumps; run alone when
    # too deep for it), a NUL in a message, an error after outputs
    'error("boom")', "error(null)", 'error({"a": 1})', "error(1)", "error([true])",
    'error({"é": "\\u0000", "b": [1.5, -0]})', "error(1e1000)", "error(nan)",
    "error(100000000000000000001)", "error(reduce range(1200) as $i (0; [.]))",
    'error("a\\u0000b")', "error", '1, error("late")', 'try error("x") catch .',
    "1 / 0", "{} | .[0]", ".[]", ".a.b.c", "tonumber", '.a | test("(")',
    '[.[]?] | implode', "[limit(-1; 1, 2)]",
    # what ends or reads across the combined program: run alone
    "halt", "1, halt, 2", '"bye" | halt_error', "halt_error(1)", "input", "[inputs]",
    "first(inputs)", "input_line_number", "input_filename", "$__loc__", "$__loc__.line",
    # definitions, comments, labels, limits, paths
    "def f: .a?; f", "def f(g): [g, g]; f(.[]?)", ". # a comment", "1, # two\n2",
    ". # continued \\\n| 2", ".a? # continued \\", "label $out | 1, break $out, 2",
    "first(.[]?)", "first(empty)", "[limit(2; .[]?)]", "[limit(0; 1, 2)]",
    "[paths]", "path(..)", "del(.a)?", ".a = 1", "to_entries?", "[.[]?] | length",
    ". as {a: $x} | $x", ".[]? as [$a] | $a", "reduce .[]? as $x (0; . + 1)",
    "foreach (.[]?) as $x (0; . + 1)", "getpath([\"a\", \"b\"])?", "tojson", "tostream",
    # numbers, strings, the environment
    "nan", "[nan]", "infinite", "-infinite", "1e1000", "100000000000000000000000001",
    "1.000000000000000000001", "-0", '"\\u0000"', '"é \\u2603"', "$ENV | type",
    "env | type", "builtins | length > 10", "now | type", "[splits(\", \")]?",
    # deep outputs (Python's recursion limit in the conversion), big outputs (over the
    # answer's cap, made small here)
    "reduce range(2000) as $i (null; [.])", "[range(100)]", '"x" * 300',
    # not one program alone: not compiled alone, so never combined
    ".a)", "(", '1)]] catch [false, .]), (try [true, [.[] | (2', 'import "x" as x; .',
    'include "x"; .', '"\\ud800"',
]


@functools.cache
def _corpus() -> tuple[str, ...]:
    """The built-in descriptions' expressions, the shared samples' (when beside the
    checkout), the sandbox tests' and the tricky ones."""
    found: set[str] = set()
    for desc in builtin_descriptions():
        _sources(desc, found)
    if SAMPLES.is_dir():
        descs, _ = load_description_paths(sorted(SAMPLES.iterdir()))  # an invalid one set aside
        for desc in descs:
            _sources(desc, found)
    return (*sorted(found), *EXPRESSIONS, *TRICKY)


@functools.cache
def _objects() -> tuple[str, ...]:
    """The fixtures' workload objects and pods as jq reads them: what the expressions
    were written for."""
    texts = []
    for path in all_clusters():
        cluster = load_cluster(path)
        texts += [jq_text(obj) for obj in (*cluster.objects, *cluster.pods[:2])]
    return tuple(texts)


#: texts that are not one JSON value: none, several, cut off, not UTF-8 encodable
ODD_TEXTS = ["", "  ", "1 2", '{"a": 1} {"a": [2]}', "1 [", "[", "{", "nan", '"\ud800"',
             '{"a": "\ud800"}', '{"a": 1}\n', "[" * 3000 + "]" * 3000]

texts = st.one_of(
    json_values.map(jq_text),
    st.lists(json_values.map(jq_text), min_size=2, max_size=3).map(" ".join),
    st.sampled_from(ODD_TEXTS),
    st.deferred(lambda: st.sampled_from(_objects())),
)


class _Calls:
    """The child's jq binding, counting what runs: parses (``input_text``: libjq
    parses the text at each) and compilations."""

    def __init__(self) -> None:
        self.parses = 0
        self.compiles = 0

    def compile(self, source: str) -> Any:
        self.compiles += 1
        return _CountedProgram(jq.compile(source), self)


class _CountedProgram:
    def __init__(self, program: Any, calls: _Calls) -> None:
        self._program = program
        self._calls = calls

    def input_text(self, text: str, **kwargs: Any) -> Any:
        self._calls.parses += 1
        return self._program.input_text(text, **kwargs)


@pytest.fixture
def arms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The CPU backstop's moves, counted instead of made (in this process they would
    bound the test run's CPU)."""
    moves: list[int] = []
    monkeypatch.setattr(jq_child, "_arm_cpu_backstop", moves.append)
    return moves


#: the child's caches, shared by the examples as by a child's requests
_PROGRAMS: dict[bytes, Any] = {}
_TOGETHER: dict[tuple[bytes, ...], Any] = {}


def _alone(sources: list[bytes], text: str) -> list[tuple[bytes, bytes]]:
    """The answers as the child gave them before: each program run alone."""
    return [jq_child._evaluate(jq.compile, {}, s, text) for s in sources]


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(picks=st.lists(st.integers(0, 10**6), min_size=2, max_size=8), text=texts)
def test_a_request_answers_what_each_program_alone_answers(
        picks: list[int], text: str, arms: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Statuses and payloads byte for byte, whatever runs combined, alone, or falls
    back part way; the backstop moved once per program at least."""
    monkeypatch.setattr(jq_child, "MAX_ANSWER_BYTES", 200)  # the cap reached by some
    corpus = _corpus()
    sources = [corpus[i % len(corpus)].encode("utf-8", "surrogatepass") for i in picks]
    arms.clear()
    got = list(jq_child._answers(jq.compile, _PROGRAMS, _TOGETHER, sources, text, 7))
    assert got == _alone(sources, text)
    assert len(arms) >= len(sources) and set(arms) == {7}


def test_the_corpus_runs_combined() -> None:
    """The descriptions' expressions combine (else the property above held by running
    everything alone); the tricky ones that must not, do not."""
    corpus = [s.encode() for s in _corpus()[:-len(TRICKY) - len(EXPRESSIONS)]]
    assert len(corpus) > 30
    assert jq_child.combined(jq.compile, {}, {}, corpus) is not None
    for alone in ("halt", "input", "[inputs]", "$__loc__", 'import "x" as x; .',
                  ".a? # continued \\", ".a)", "("):
        assert jq_child.combined(jq.compile, {}, {}, [b".", alone.encode()]) is None, alone
    for combined in (".inputs", '.a["halted"] | not', ". # a comment", "def f: .a?; f",
                     ". # continued \\\n| 2"):
        assert jq_child.combined(jq.compile, {}, {}, [b".", combined.encode()]), combined


def test_the_compiled_programs_kept_are_bounded_by_their_sources_bytes(
        arms: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled program takes ~65 times its source: 4,096 combined ones of six paths
    were ~94 MB in a child limited to 256 MiB (64 at least), beside the input it parses.
    Each cache keeps at most MAX_SOURCE_BYTES of sources, the least recently used going
    first (one used at every request stays, whatever the edits around it)."""
    monkeypatch.setattr(jq_child, "MAX_SOURCE_BYTES", 2000)
    programs: dict[bytes, Any] = {}
    together: dict[tuple[bytes, ...], Any] = {}
    hot = [b".status.phase", b".spec.replicas // 1"]
    for i in range(200):  # a description edited 200 times, its old paths never asked again
        edited = [b".metadata.labels[\"v%d\"]" % i, b".status.nodes | length"]
        for sources in (edited, hot):
            assert list(jq_child._answers(jq.compile, programs, together, sources,
                                          '{"status": {"phase": "Running"}}', 7))
        for cache in (programs, together):
            assert sum(map(jq_child._source_bytes, cache)) <= 2000
    assert tuple(hot) in together  # (its programs alone not asked since: gone)
    assert len(together) < 100 and len(programs) < 150


def _serve(calls: _Calls, requests: list[tuple[list[str], str]]
           ) -> Iterator[list[tuple[bytes, bytes]]]:
    """``serve`` in a thread over pipes, with ``calls`` as its jq binding: each request's
    answers (status, payload)."""
    to_child, requests_fd = os.pipe()
    answers_fd, from_child = os.pipe()
    thread = threading.Thread(target=jq_child.serve, args=(to_child, from_child, 3),
                              daemon=True)
    thread.start()
    try:
        assert _frame(answers_fd) == jq_child.HELLO
        for sources, text in requests:
            jq_child._write_all(requests_fd, request_frame(sources, text.encode()))
            yield [(f[:1], f[1:]) for f in (_frame(answers_fd) for _ in sources)]
    finally:
        os.close(requests_fd)  # the child's input ends: serve returns
        thread.join(10)
        for fd in (to_child, answers_fd, from_child):
            os.close(fd)
    assert not thread.is_alive()


def _frame(fd: int) -> bytes:
    head = jq_child._read_exact(fd, 4)
    assert head is not None
    body = jq_child._read_exact(fd, int.from_bytes(head, "big"))
    assert body is not None
    return body


def test_a_request_parses_its_input_once(monkeypatch: pytest.MonkeyPatch,
                                         arms: list[int]) -> None:
    """N programs on one input: one parse (there were N, one per program: ~40 ms each
    for a 1.5 MB object), the backstop still moved before each program, the answers
    each program's; a program that errors with a value that is not a string is run
    once too (it was run again alone for the binding's wording of it: twice its CPU,
    past the parent's deadline where alone it answered), and a request of one program
    is one parse as before."""
    calls = _Calls()
    monkeypatch.setitem(sys.modules, "jq", SimpleNamespace(compile=calls.compile))
    obj = jq_text({"status": {"phase": "Running", "nodes": {"n1": {"type": "Pod"}}},
                   "metadata": {"name": "wf"}})
    exprs = [".status.phase", ".metadata.name", "[.status.nodes[] | .type]", ".spec.x",
             'error("not here")']
    got = _serve(calls, [(exprs, obj), (exprs, obj), ([".a", "error({})"], obj),
                         ([".metadata.name"], obj)])
    assert next(got) == [(b"o", b'["Running"]'), (b"o", b'["wf"]'), (b"o", b'[["Pod"]]'),
                         (b"o", b"[null]"), (b"e", b"not here")]
    assert calls.parses == 1
    assert arms == [3] * len(exprs)
    assert next(got) == _alone([e.encode() for e in exprs], obj)
    assert calls.parses == 2  # and nothing compiled again
    compiles = calls.compiles
    assert next(got) == [(b"o", b"[null]"), (b"e", b"{}")]
    assert calls.parses == 2 + 1  # error({}) not run again alone
    assert next(got) == [(b"o", b'["wf"]')]
    assert calls.parses == 4
    assert calls.compiles == compiles + 3  # the pair's programs, and the pair
    with pytest.raises(StopIteration):
        next(got)


def test_a_program_that_does_not_compile_fails_alone(arms: list[int]) -> None:
    """Its compile error is its answer; the others answer as ever (run alone)."""
    got = list(jq_child._answers(jq.compile, {}, {}, [b".a", b".a)", b".b"], '{"a":1}', 3))
    assert got[0] == (b"o", b"[1]") and got[2] == (b"o", b"[null]")
    assert got[1][0] == b"x" and got[1][1].startswith(b"does not compile: ")


def test_the_combined_programs_kept_are_bounded(monkeypatch: pytest.MonkeyPatch,
                                                arms: list[int]) -> None:
    monkeypatch.setattr(jq_child, "MAX_PROGRAMS", 3)
    programs: dict[bytes, Any] = {}
    together: dict[tuple[bytes, ...], Any] = {}
    for i in range(5):
        sources = [f".a + {i}".encode(), b".a"]
        assert list(jq_child._answers(jq.compile, programs, together, sources, '{"a":1}', 3)
                    ) == [(b"o", f"[{1 + i}]".encode()), (b"o", b"[1]")]
        assert len(together) <= 3 and len(programs) <= 3
    assert list(together) == [(f".a + {i}".encode(), b".a") for i in (2, 3, 4)]
