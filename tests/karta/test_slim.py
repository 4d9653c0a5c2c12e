"""What the engine keeps of an object (``proxy.karta.slim``): the heavy metadata dropped
alike from the objects the engine keeps (``_trim``, a copy) and from pods (``slim_pod``,
in place), the rest of the metadata untouched."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.karta.slim import POD_SPEC_KEEP, _trim, slim_pod

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _pod(owner_kind: str | None, **metadata: Any) -> dict[str, Any]:
    md: dict[str, Any] = {"name": "p", "namespace": "ns", "uid": "u-p", **metadata}
    if owner_kind is not None:
        md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": "o",
                                  "uid": "u-o", "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md,
            "spec": {"nodeName": "n-1", "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready"}]}}


HEAVY = {"managedFields": [{"manager": "kubectl"}],
         "annotations": {LAST_APPLIED: "{...}", "team": "a"}, "labels": {"app": "web"}}


@pytest.mark.parametrize("owner_kind", [None, "ReplicaSet"])
def test_trim_and_slim_pod_drop_the_same_metadata(owner_kind: str | None) -> None:
    trimmed = _trim(_pod(owner_kind, **copy.deepcopy(HEAVY)))
    slimmed = slim_pod(_pod(owner_kind, **copy.deepcopy(HEAVY)))
    want = {"name": "p", "namespace": "ns", "uid": "u-p", "annotations": {"team": "a"},
            "labels": {"app": "web"}}
    for md in (trimmed["metadata"], slimmed["metadata"]):
        assert {k: v for k, v in md.items() if k != "ownerReferences"} == want


def test_trim_copies_and_leaves_the_object_alone() -> None:
    obj = _pod("ReplicaSet", **copy.deepcopy(HEAVY))
    before = copy.deepcopy(obj)
    out = _trim(obj)
    assert obj == before
    assert out["spec"] is obj["spec"]  # a shallow copy: only the metadata is new
    light = _pod("ReplicaSet", labels={"app": "web"}, annotations={"team": "a"})
    assert _trim(light) is light  # nothing to drop: nothing copied
    assert _trim({"kind": "X", "metadata": "?"}) == {"kind": "X", "metadata": "?"}


def test_slim_pod_keeps_a_bare_pod_whole_and_of_a_controlled_one_what_attribution_reads(
) -> None:
    bare = slim_pod(_pod(None, **copy.deepcopy(HEAVY)))
    assert bare["status"]["conditions"] == [{"type": "Ready"}]
    assert bare["spec"]["containers"]
    owned = slim_pod(_pod("ReplicaSet", **copy.deepcopy(HEAVY)))
    assert owned["status"] == {"phase": "Running"}
    assert owned["spec"] == {"nodeName": "n-1"}
    assert set(owned["spec"]) <= set(POD_SPEC_KEEP)
