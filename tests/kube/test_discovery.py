"""Discovery on its own, against the simulator: GroupKind -> served resource, cached,
misses refreshed at most every ``refresh_interval`` (an injected clock, no sleeps)."""

from __future__ import annotations

from proxy.karta.model import GroupKind
from proxy.kube.client import KubeClient
from proxy.kube.discovery import ApiResource, Discovery
from tests.clock import ManualClock
from tests.kubesim import KubeSim
from tests.kubesim.resources import JOB_SET, ResourceType


def discovery_requests(sim: KubeSim) -> int:
    return sum(1 for _, path, _, _ in sim.requests if path == "/apis" or path == "/api/v1"
               or (path.startswith("/apis/") and path.count("/") == 3))


def test_api_resource_names_and_paths() -> None:
    pods = ApiResource("", "v1", "Pod", "pods", True)
    assert (pods.api_version, pods.name, pods.group_kind) == ("v1", "pods", GroupKind("", "Pod"))
    assert pods.path() == "/api/v1/pods"
    assert pods.path("ml") == "/api/v1/namespaces/ml/pods"
    karta = ApiResource("run.ai", "v1alpha1", "Karta", "kartas", False)
    assert (karta.api_version, karta.name) == ("run.ai/v1alpha1", "kartas.run.ai")
    assert karta.path("ml") == "/apis/run.ai/v1alpha1/kartas"  # cluster-scoped: no namespace


async def test_resolves_core_builtin_and_crd_kinds(sim: KubeSim, client: KubeClient) -> None:
    d = Discovery(client)
    assert await d.resolve(GroupKind("", "Pod")) == ApiResource("", "v1", "Pod", "pods", True)
    assert await d.resolve(GroupKind("apps", "ReplicaSet")) == ApiResource(
        "apps", "v1", "ReplicaSet", "replicasets", True)
    assert await d.resolve(GroupKind("ray.io", "RayJob")) == ApiResource(
        "ray.io", "v1", "RayJob", "rayjobs", True)
    karta = await d.resolve(GroupKind("run.ai", "Karta"))
    assert karta is not None and not karta.namespaced


async def test_answers_are_cached(sim: KubeSim, client: KubeClient) -> None:
    d = Discovery(client)
    await d.resolve(GroupKind("ray.io", "RayJob"))
    asked = discovery_requests(sim)
    assert await d.resolve(GroupKind("ray.io", "RayJob")) is not None
    assert await d.resolve(GroupKind("ray.io", "RayCluster")) is not None  # same group/version
    assert discovery_requests(sim) == asked
    d.invalidate()
    await d.resolve(GroupKind("ray.io", "RayJob"))
    assert discovery_requests(sim) > asked


async def test_a_miss_refreshes_at_most_every_interval(sim: KubeSim,
                                                       client: KubeClient) -> None:
    clock = ManualClock(100.0)
    d = Discovery(client, refresh_interval=30.0, clock=clock)
    gk = GroupKind(JOB_SET.group, JOB_SET.kind)
    assert await d.resolve(gk) is None  # not installed
    sim.register(JOB_SET)
    clock.now += 29
    assert await d.resolve(gk) is None  # the group list is fresh: not asked again
    clock.now += 1
    found = await d.resolve(gk)
    assert found is not None and found.plural == "jobsets"


async def test_unknown_group_and_kind(sim: KubeSim, client: KubeClient) -> None:
    d = Discovery(client)
    assert await d.resolve(GroupKind("nothing.example", "Thing")) is None
    assert await d.resolve(GroupKind("apps", "Nothing")) is None
    assert await d.resolve(GroupKind("", "Nothing")) is None


async def test_kinds_without_list_and_watch_are_not_served(sim: KubeSim,
                                                           client: KubeClient) -> None:
    sim.register(ResourceType("example.com", "v1", "Review", "reviews", verbs=("create",)))
    d = Discovery(client)
    assert await d.resolve(GroupKind("example.com", "Review")) is None


async def test_a_group_gone_after_the_group_list_is_not_served(
        sim: KubeSim, client: KubeClient) -> None:
    """The group list (cached) still names a group whose resource list now 404s."""
    sim.register(JOB_SET)
    d = Discovery(client)
    assert await d.resolve(GroupKind("", "Pod")) is not None  # fetches the group list
    sim.unregister(JOB_SET)
    assert await d.resolve(GroupKind(JOB_SET.group, JOB_SET.kind)) is None
    assert any(path == f"/apis/{JOB_SET.group}/{JOB_SET.version}"
               for _, path, _, _ in sim.requests)
