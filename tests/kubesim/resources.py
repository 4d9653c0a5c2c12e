"""The resource types the simulator serves: what discovery lists and what paths route to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResourceType:
    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool = True
    #: built-in types are typed on a real server: list items carry no apiVersion/kind
    builtin: bool = False
    verbs: tuple[str, ...] = ("create", "delete", "get", "list", "patch", "update", "watch")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        """Group + plural: one store per resource whatever the version."""
        return (self.group, self.plural)

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    def discovery_entry(self) -> dict[str, object]:
        return {
            "name": self.plural,
            "singularName": self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(self.verbs),
        }


POD = ResourceType("", "v1", "Pod", "pods", builtin=True)
NAMESPACE = ResourceType("", "v1", "Namespace", "namespaces", namespaced=False, builtin=True)
REPLICA_SET = ResourceType("apps", "v1", "ReplicaSet", "replicasets", builtin=True)
DEPLOYMENT = ResourceType("apps", "v1", "Deployment", "deployments", builtin=True)
STATEFUL_SET = ResourceType("apps", "v1", "StatefulSet", "statefulsets", builtin=True)
DAEMON_SET = ResourceType("apps", "v1", "DaemonSet", "daemonsets", builtin=True)
JOB = ResourceType("batch", "v1", "Job", "jobs", builtin=True)
CRON_JOB = ResourceType("batch", "v1", "CronJob", "cronjobs", builtin=True)
LEASE = ResourceType("coordination.k8s.io", "v1", "Lease", "leases", builtin=True)

#: What a bare cluster serves (no CRDs installed).
CORE_TYPES: tuple[ResourceType, ...] = (
    POD,
    REPLICA_SET,
    DEPLOYMENT,
    STATEFUL_SET,
    DAEMON_SET,
    JOB,
    CRON_JOB,
    LEASE,
)

# CRDs; register them on a running simulator with ``sim.register(...)``.
RAY_JOB = ResourceType("ray.io", "v1", "RayJob", "rayjobs")
RAY_CLUSTER = ResourceType("ray.io", "v1", "RayCluster", "rayclusters")
RAY_SERVICE = ResourceType("ray.io", "v1", "RayService", "rayservices")
JOB_SET = ResourceType("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
LEADER_WORKER_SET = ResourceType(
    "leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets"
)
KARTA = ResourceType("run.ai", "v1alpha1", "Karta", "kartas", namespaced=False)
RESOURCE_INTERFACE = ResourceType(
    "optimization.nvidia.com", "v1alpha1", "ResourceInterface", "resourceinterfaces",
    namespaced=False,
)

CRD_TYPES: tuple[ResourceType, ...] = (
    RAY_JOB,
    RAY_CLUSTER,
    RAY_SERVICE,
    JOB_SET,
    LEADER_WORKER_SET,
    KARTA,
    RESOURCE_INTERFACE,
)
