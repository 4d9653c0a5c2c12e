"""Karta description objects for tests and benchmarks, as the API serves them.

A test writes its description inline so the case reads at a glance; the envelope around
the structure (apiVersion, kind, metadata, spec.structureDefinition) and the Ray shapes
several tests and the engine benchmark describe are written once, here.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

API_VERSION = "run.ai/v1alpha1"


def component(name: str, group: str, kind: str, version: str = "v1", **fields: Any) -> Obj:
    """A component with a kind (every root, and a child that is not a grouping one)."""
    return {"name": name, "kind": {"group": group, "version": version, "kind": kind}, **fields}


def karta(name: str, root: Obj, children: list[Obj] | None = None, **structure: Any) -> Obj:
    """A Karta object named ``name`` around its structureDefinition; ``structure`` holds
    the other structure fields (``additionalChildKinds``)."""
    definition: Obj = {"rootComponent": root}
    if children is not None:
        definition["childComponents"] = children
    definition.update(structure)
    return {"apiVersion": API_VERSION, "kind": "Karta", "metadata": {"name": name},
            "spec": {"structureDefinition": definition}}


def ray_components(owner: str, cluster_spec: str = ".spec", *, head_replicas: bool = True,
                   worker_replicas: bool = True) -> list[Obj]:
    """The head and the worker components of a Ray cluster spec at ``cluster_spec`` (a
    RayCluster's ``.spec``, a RayJob's ``.spec.rayClusterSpec``): pods told apart by their
    ``ray.io/node-type`` label, a worker's instance its group (``ray.io/group``), checked
    against the spec's group names. Replicas: one head, a group's ``replicas``."""
    groups = f"{cluster_spec}.workerGroupSpecs[]?"
    node_type = '.metadata.labels["ray.io/node-type"]'
    head: Obj = {
        "name": "head", "ownerRef": owner,
        "specDefinition": {"podTemplateSpecPath": f"{cluster_spec}.headGroupSpec.template"},
        "podSelector": {"componentTypeSelector": {"keyPath": node_type, "value": "head"}},
    }
    worker: Obj = {
        "name": "worker", "ownerRef": owner,
        "specDefinition": {"podTemplateSpecPath": f"{groups}.template"},
        "instanceIdPath": f"{groups}.groupName",
        "podSelector": {
            "componentTypeSelector": {"keyPath": node_type, "value": "worker"},
            "componentInstanceSelector": {"idPath": '.metadata.labels["ray.io/group"]'},
        },
    }
    if head_replicas:
        head["scaleDefinition"] = {"replicasPath": "1"}
    if worker_replicas:
        worker["scaleDefinition"] = {"replicasPath": f"{groups}.replicas"}
    return [head, worker]


def raycluster_karta(name: str = "test-raycluster", *, head_replicas: bool = True) -> Obj:
    """The project's own RayCluster description: phase from ``.status.state``."""
    root = component("raycluster", "ray.io", "RayCluster", statusDefinition={
        "phaseDefinition": {"path": ".status.state"},
        "statusMappings": {"running": [{"byPhase": "ready"}], "failed": [{"byPhase": "failed"}]},
    })
    return karta(name, root, ray_components("raycluster", head_replicas=head_replicas))


#: The RayCluster description the kube source tests create in the cluster.
RAYCLUSTER_KARTA = raycluster_karta()

#: The project's own small RayJob description: pods sit under a RayCluster the RayJob owns.
RAYJOB_KARTA = karta(
    "test-rayjob",
    component("rayjob", "ray.io", "RayJob", statusDefinition={
        "phaseDefinition": {"path": ".status.jobStatus"},
        "statusMappings": {"running": [{"byPhase": "RUNNING"}]},
    }),
    ray_components("rayjob", ".spec.rayClusterSpec", head_replicas=False, worker_replicas=False),
    additionalChildKinds=[{"group": "ray.io", "version": "v1", "kind": "RayCluster"}],
)

#: A JobSet description, for a kind the cluster does not serve until its CRD is installed.
JOBSET_KARTA = karta("test-jobset", component(
    "jobset", "jobset.x-k8s.io", "JobSet", "v1alpha2",
    specDefinition={"podTemplateSpecPath": ".spec.template"}))

#: A kind no built-in describes, for a description added later: phase from
#: ``.status.state`` (``ready``: Running), desired replicas from ``.spec.replicas``.
TRAINER_KARTA = karta("trainer", component(
    "trainer", "example.com", "Trainer",
    specDefinition={"podTemplateSpecPath": ".spec.template"},
    scaleDefinition={"replicasPath": ".spec.replicas"},
    statusDefinition={"phaseDefinition": {"path": ".status.state"},
                      "statusMappings": {"running": [{"byPhase": "ready"}]}}))
