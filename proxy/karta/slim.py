"""What the engine keeps of a cluster object: the heavy metadata dropped from every object
kept, and of a pod that has a controller only what attribution reads.

Memory grows with pods (100k in a large cluster), so each kept pod must be small: the
watches and the snapshot slim pods before the engine sees them (``slim_pod``), the engine
trims the whole objects it keeps (``_trim``) and shares a pod's label strings with its
siblings (``_interned``). Apart from the engine, so a source can slim pods without
importing it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from proxy.karta.owners import NODE, OwnerRef, controller_ref

_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _light_metadata(md: Mapping[str, Any]) -> dict[str, Any] | None:
    """``md`` without what no description reads and what weighs most: ``managedFields``
    and kubectl's last-applied annotation (a copy of the whole object). A new dict, or
    None when ``md`` holds neither (nothing to copy). The one list of what is dropped,
    for the objects the engine keeps and for pods alike."""
    ann = md.get("annotations")
    heavy_ann = isinstance(ann, Mapping) and _LAST_APPLIED in ann
    if "managedFields" not in md and not heavy_ann:
        return None
    light = {k: v for k, v in md.items() if k != "managedFields"}
    if heavy_ann and isinstance(ann, Mapping):
        light["annotations"] = {k: v for k, v in ann.items() if k != _LAST_APPLIED}
    return light


def _trim(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """``obj`` without its heavy metadata (:func:`_light_metadata`): a shallow copy, or
    ``obj`` itself when there is nothing to drop; ``obj`` is not changed."""
    md = obj.get("metadata")
    if not isinstance(md, Mapping):
        return obj
    light = _light_metadata(md)
    if light is None:
        return obj
    out = dict(obj)
    out["metadata"] = light
    return out


#: pod spec fields attribution can use; the rest (containers, volumes, ...) is dropped
#: before the engine sees the object
POD_SPEC_KEEP = ("nodeName", "hostname", "subdomain", "schedulerName", "priorityClassName")


def slim_pod(obj: dict[str, Any]) -> dict[str, Any]:
    """Keep metadata, status.phase and the few spec fields attribution may read.

    A pod without a controller is its own workload (the bare-pod description reads its
    status, a user description of Pod may read more): it is kept whole, and so is a
    static pod's mirror (controlled by its Node, a workload of its own too). Such pods
    are few; the 100k pods of controllers are what must stay small.

    The heavy metadata goes as from any object kept (:func:`_light_metadata`), but in
    ``obj`` itself: the caller's dict, its ``metadata`` replaced (no copy of the pod).
    """
    md = obj.get("metadata") or {}
    light = _light_metadata(md)
    if light is not None:
        md = obj["metadata"] = light
    if pod_controller(md.get("ownerReferences")) is None:
        return obj
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    out: dict[str, Any] = {
        "apiVersion": obj.get("apiVersion", "v1"),
        "kind": "Pod",
        "metadata": md,
        "spec": {k: spec[k] for k in POD_SPEC_KEEP if k in spec},
    }
    if "phase" in status:
        out["status"] = {"phase": status["phase"]}
    return out


def pod_controller(refs: Any) -> OwnerRef | None:
    """A pod's controller as attribution sees it: a mirror pod's Node is none.

    The kubelet mirrors a static pod into the API with its Node as controller; nothing
    above the Node manages it, so it is a workload of its own, like a bare pod (and the
    engine need not watch Nodes to learn that)."""
    ref = controller_ref(refs)
    return None if ref is not None and ref.gk == NODE else ref


def _interned(m: Any, *, values: bool) -> Any:
    """A pod's label (or annotation) map as the engine keeps it: its own copy, keys (and
    label values) interned, so the pods of a workload share one string per key and value
    instead of a copy each (~10 MB at 37.5k pods). ``sys.intern`` strings die with their
    last user, so churn does not accumulate them. Anything but a string map is kept as
    it is (selectors decide what it means)."""
    if type(m) is not dict:
        return m
    intern = sys.intern
    out: dict[Any, Any] = {}
    for k, v in m.items():
        if type(k) is str:
            k = intern(k)
        if values and type(v) is str:
            v = intern(v)
        out[k] = v
    return out
