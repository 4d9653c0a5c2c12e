"""Synthetic cluster fixtures: small YAML files -> Kubernetes objects + expected answers.

A fixture (``tests/karta/fixtures/*.yaml``) has:

``descriptions``
    list of description sets; each set is a list of sample file names from
    ``../shared/karta/descriptions/`` (``[]`` = built-ins only). The cluster is checked
    once per set, with the same expectations.
``builtins``
    built-in descriptions on (default true).
``namespace``
    default namespace of every object (default ``team-a``).
``objects``
    full objects except pods. ``owner: Kind/name`` names the controller owner among the
    fixture's objects or pods; ``owner: {apiVersion, kind, name}`` names one that is not
    in the fixture. ``metadata.uid`` defaults to ``<kind>-<name>`` in lower case.
``pods``
    ``{name, owner, labels, annotations, phase, status, spec, expect}``; ``expect`` is
    ``[Kind/name, component, instance, replica]`` or ``{reason: <why unattributed>}``;
    ``status`` (the whole status, conditions included) replaces ``{phase: <phase>}``,
    ``spec`` is merged into the default one.
``workloads``
    ``Kind/name -> {phase, reason?, since?, replicas: [[component, instance, desired, min,
    max, observed], ...]}``; exactly these workloads must exist. ``since`` is the phase's
    start as the object says it (RFC 3339); without it, the phase must be dated by the
    engine's clock (observed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "karta" / "descriptions"


def uid_of(kind: str, name: str) -> str:
    return f"{kind.lower()}-{name}"


@dataclass
class Cluster:
    name: str
    description_sets: list[list[str]]
    builtins: bool
    objects: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    expect_pods: dict[str, Any] = field(default_factory=dict)
    expect_workloads: dict[str, Any] = field(default_factory=dict)

    @property
    def everything(self) -> list[dict[str, Any]]:
        return [*self.objects, *self.pods]


def _owner_ref(owner: Any, by_name: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if isinstance(owner, str):
        target = by_name[owner]
        api, kind, name = target["apiVersion"], target["kind"], target["metadata"]["name"]
    else:
        api, kind, name = owner["apiVersion"], owner["kind"], owner["name"]
    return {
        "apiVersion": api,
        "kind": kind,
        "name": name,
        "uid": uid_of(kind, name),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def load_cluster(path: Path) -> Cluster:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    ns = raw.get("namespace", "team-a")
    objects: list[dict[str, Any]] = []
    owners: list[Any] = []
    for o in raw.get("objects") or []:
        o = dict(o)
        owners.append(o.pop("owner", None))
        omd = o.setdefault("metadata", {})
        omd.setdefault("namespace", ns)
        omd.setdefault("uid", uid_of(o["kind"], omd["name"]))
        objects.append(o)
    pods: list[dict[str, Any]] = []
    expect_pods: dict[str, Any] = {}
    for p in raw.get("pods") or []:
        md: dict[str, Any] = {"name": p["name"], "namespace": ns, "uid": uid_of("Pod", p["name"])}
        if p.get("labels"):
            md["labels"] = {str(k): str(v) for k, v in p["labels"].items()}
        if p.get("annotations"):
            md["annotations"] = {str(k): str(v) for k, v in p["annotations"].items()}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": md,
            "spec": {"containers": [{"name": "main", "image": "example.com/app:1"}],
                     **(p.get("spec") or {})},
            "status": p.get("status") or {"phase": p.get("phase", "Running")},
        }
        pods.append(pod)
        owners.append(p.get("owner"))
        expect_pods[md["uid"]] = p["expect"]
    by_name = {f"{o['kind']}/{o['metadata']['name']}": o for o in [*objects, *pods]}
    for o, owner in zip([*objects, *pods], owners, strict=True):
        if owner is not None:
            o["metadata"]["ownerReferences"] = [_owner_ref(owner, by_name)]
    sets = raw.get("descriptions", [[]])
    return Cluster(
        name=path.stem,
        description_sets=[list(s) for s in sets],
        builtins=raw.get("builtins", True),
        objects=objects,
        pods=pods,
        expect_pods=expect_pods,
        expect_workloads=raw.get("workloads") or {},
    )


def all_clusters() -> list[Path]:
    return sorted(FIXTURES.glob("*.yaml"))
