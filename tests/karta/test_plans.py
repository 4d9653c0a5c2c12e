"""The descriptions compiled for the engine (``proxy.karta.plans``): the plain-lookup fast
path of a pod selector answers what jq answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.karta.jqexpr import JqError, JqExpr, JqIdError
from proxy.karta.jqexpr import outputs_equal as _equals
from proxy.karta.jqexpr import outputs_present as _present
from proxy.karta.jqexpr import single_output_id as _single_id
from proxy.karta.model import GroupKind
from proxy.karta.owners import OwnerRef
from proxy.karta.plans import _PodRec, _Probe

# -- the plain-lookup fast path agrees with jq ------------------------------------------


def _id_or_refused(single_id: Callable[[], str | None]) -> str | None:
    """The id, or "refused" for one that cannot be a label value (a control character)."""
    try:
        return single_id()
    except JqIdError:
        return "<refused>"


_KEYS = st.sampled_from(["role", "app", "a.b/c", "x-y", "", "0"])
_VALUES = st.one_of(st.sampled_from(["", "a", "0", "true", "null"]), st.text(max_size=3))


@settings(max_examples=200, deadline=None)
@given(
    labels=st.one_of(st.none(), st.dictionaries(_KEYS, _VALUES, max_size=3)),
    key=_KEYS,
    value=_VALUES,
    form=st.sampled_from(['.metadata.labels["{k}"]', ".metadata.labels.{k}",
                          '.metadata.annotations["{k}"]', ".metadata.name",
                          ".metadata.namespace"]),
)
def test_probe_fast_path_matches_jq(
    labels: dict[str, str] | None, key: str, value: str, form: str
) -> None:
    src = form.format(k=key)
    try:
        expr = JqExpr(src)
    except ValueError:
        return  # e.g. ``.metadata.labels.a.b/c`` is not a plain lookup in jq either
    probe = _Probe(expr)
    rec = _PodRec("uid-1")
    rec.name, rec.namespace, rec.labels, rec.annotations = "p", "ns", labels, labels
    doc = rec.jq_input()
    out = probe.outputs(rec)
    assert _present(out) == _present(expr.all(doc))
    assert _equals(out, value) == _equals(expr.all(doc), value)
    assert _id_or_refused(lambda: _single_id(out)) == \
        _id_or_refused(lambda: _single_id(expr.all(doc)))


@pytest.mark.parametrize("owner_kind", [None, "Pod", "ReplicaSet"])
@pytest.mark.parametrize("src", [
    ".metadata.ownerReferences[]? | select(.controller == true) | .kind",
    " .metadata.ownerReferences[]?|select( .controller==true )|.kind ",
])
def test_controller_kind_fast_path_matches_jq(owner_kind: str | None, src: str) -> None:
    """The built-in Pod description's selector for pods controlled by a pod."""
    expr = JqExpr(src)
    probe = _Probe(expr)
    assert probe.field == "controller_kind"
    rec = _PodRec("uid-1")
    rec.name, rec.namespace = "p", "ns"
    if owner_kind is not None:
        rec.owner = OwnerRef("o-1", GroupKind("", owner_kind), "o", "v1")
    doc = rec.jq_input()
    assert probe.outputs(rec) == expr.all(doc)
    assert _equals(probe.outputs(rec), "Pod") == _equals(expr.all(doc), "Pod")
    assert _present(probe.outputs(rec)) == _present(expr.all(doc))


_MAPS = st.one_of(st.none(), st.dictionaries(_KEYS, _VALUES, max_size=3),
                  st.sampled_from(["text", 3, ["a"]]))


@settings(max_examples=300, deadline=None)
@given(
    labels=_MAPS,
    annotations=_MAPS,
    first=st.tuples(st.sampled_from(["labels", "annotations"]), _KEYS,
                    st.sampled_from(['["{k}"]', ".{k}"])),
    second=st.tuples(st.sampled_from(["labels", "annotations"]), _KEYS,
                     st.sampled_from(['["{k}"]', ".{k}"])),
    value=_VALUES,
)
def test_probe_fast_path_of_one_lookup_else_another_matches_jq(
    labels: Any, annotations: Any, first: tuple[str, str, str],
    second: tuple[str, str, str], value: str,
) -> None:
    """``.metadata.labels["k"] // .metadata.annotations["k"]`` (the built-in Job's
    completion index: label, else annotation) is answered without libjq, as jq would."""
    parts = [f".metadata.{m}{form.format(k=k)}" for m, k, form in (first, second)]
    src = " // ".join(parts)
    try:
        expr = JqExpr(src)
    except ValueError:
        return  # ``.metadata.labels.a.b/c``: not a plain lookup in jq either
    probe = _Probe(expr)
    plain = all(form == '["{k}"]' or k.isidentifier() for _, k, form in (first, second))
    assert (probe.field == "alt") == plain
    rec = _PodRec("uid-1")
    rec.name, rec.namespace, rec.labels, rec.annotations = "p", "ns", labels, annotations
    doc = rec.jq_input()
    try:
        want = expr.all(doc)
    except JqError:  # the second lookup on a non-map: jq's error, from the probe too
        with pytest.raises(JqError):
            probe.outputs(rec)
        return
    out = probe.outputs(rec)
    assert out == want
    assert _present(out) == _present(expr.all(doc))
    assert _equals(out, value) == _equals(expr.all(doc), value)
    assert _id_or_refused(lambda: _single_id(out)) == \
        _id_or_refused(lambda: _single_id(expr.all(doc)))


def test_the_builtin_jobs_replica_selector_takes_the_fast_path() -> None:
    from proxy.karta.builtin import builtin_descriptions

    (job,) = [d for d in builtin_descriptions() if d.group_kind.kind == "Job"]
    sel = job.root.pod_selector
    assert sel is not None and sel.replica_key_path is not None
    assert _Probe(sel.replica_key_path).field == "alt"
