"""The project's built-in descriptions of core kinds: they load through the ordinary
parser, and their scale and status definitions say the right thing about small,
realistic objects as the Kubernetes controllers write them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from proxy.karta.builtin import builtin_descriptions, builtin_files
from proxy.karta.description import parse_description, select_descriptions
from proxy.karta.model import GVK, Description, GroupKind
from proxy.karta.status import StatusResult, evaluate_status
from tests.karta.descriptions import component, karta
from tests.karta.workloads import statefulset

EXPECTED = {
    GroupKind("apps", "Deployment"): "builtin-apps-deployment",
    GroupKind("apps", "StatefulSet"): "builtin-apps-statefulset",
    GroupKind("apps", "DaemonSet"): "builtin-apps-daemonset",
    GroupKind("apps", "ReplicaSet"): "builtin-apps-replicaset",
    GroupKind("batch", "Job"): "builtin-batch-job",
    GroupKind("batch", "CronJob"): "builtin-batch-cronjob",
    GroupKind("", "Pod"): "builtin-core-pod",
}


def builtin(kind: str) -> Description:
    (d,) = [d for d in builtin_descriptions() if d.group_kind.kind == kind]
    return d


def test_every_builtin_file_parses_through_parse_description() -> None:
    names = []
    for path in builtin_files():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert len(docs) == 1, path
        d = parse_description(docs[0], str(path))
        assert d.form == "Karta" and not d.builtin
        names.append(d.name)
    assert sorted(names) == sorted(EXPECTED.values())


def test_builtins_cover_the_core_kinds() -> None:
    descs = builtin_descriptions()
    assert {d.group_kind: d.name for d in descs} == EXPECTED
    for d in descs:
        assert d.builtin
        assert d.source == f"builtin:{d.name}"
        if d.name == "builtin-core-pod":  # the pod, and the pods it controls
            assert [c.name for c in d.pod_components] == ["pod", "controlled"]
            assert [c.name for c in d.children] == ["controlled"]
            continue
        assert d.pod_components == (d.root,), d.name  # the root carries the pods
        assert d.children == ()
        assert d.status is not None
        assert d.root.scale is not None and d.root.scale.replicas is not None


def test_builtins_are_parsed_once() -> None:
    first = builtin_descriptions()
    second = builtin_descriptions()
    assert all(a is b for a, b in zip(first, second, strict=True))
    first.clear()  # callers get their own list
    assert len(builtin_descriptions()) == len(EXPECTED)


def test_intermediate_kinds() -> None:
    assert builtin("Deployment").additional_child_kinds == (GVK("apps", "v1", "ReplicaSet"),)
    assert builtin("CronJob").additional_child_kinds == (GVK("batch", "v1", "Job"),)
    assert builtin("Pod").root.kind == GVK("", "v1", "Pod")


def test_user_description_overrides_a_builtin() -> None:
    user = karta("my-deployments", component(
        "d", "apps", "Deployment", specDefinition={"podTemplateSpecPath": ".spec.template"}))
    mine = parse_description(user, "mine.yaml")
    winners, errors = select_descriptions([*builtin_descriptions(), mine])
    assert errors == []
    assert winners[GroupKind("apps", "Deployment")] is mine
    assert winners[GroupKind("apps", "StatefulSet")].name == "builtin-apps-statefulset"


# -- desired replicas -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "obj", "replicas"),
    [
        ("Deployment", {"spec": {"replicas": 3}}, 3.0),
        ("Deployment", {"spec": {}}, 1.0),
        ("Deployment", {"spec": {"replicas": 0}}, 0.0),
        ("StatefulSet", {"spec": {"replicas": 5}}, 5.0),
        ("ReplicaSet", {"spec": {}}, 1.0),
        ("DaemonSet", {"spec": {}, "status": {"desiredNumberScheduled": 4}}, 4.0),
        ("DaemonSet", {"spec": {}}, 0.0),
        ("Job", {"spec": {"parallelism": 8}}, 8.0),
        ("Job", {"spec": {}}, 1.0),
        ("CronJob", {"spec": {"jobTemplate": {"spec": {"parallelism": 2}}}}, 0.0),
        (
            "CronJob",
            {
                "spec": {"jobTemplate": {"spec": {"parallelism": 2}}},
                "status": {"active": [{"name": "a"}, {"name": "b"}]},
            },
            4.0,
        ),
        ("CronJob", {"spec": {}, "status": {"active": [{"name": "a"}]}}, 1.0),
        ("Pod", {"spec": {}}, 1.0),
    ],
)
def test_desired_replicas(kind: str, obj: dict[str, Any], replicas: float) -> None:
    scale = builtin(kind).root.scale
    assert scale is not None and scale.replicas is not None
    assert scale.replicas.number(obj) == replicas


# -- phases -----------------------------------------------------------------------------------


def phase(kind: str, obj: dict[str, Any]) -> StatusResult:
    return evaluate_status(builtin(kind).status, obj)


def deployment(
    replicas: int,
    *,
    ready: int,
    updated: int | None = None,
    total: int | None = None,
    generation: int = 2,
    observed: int = 2,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "observedGeneration": observed,
        "replicas": replicas if total is None else total,
        "updatedReplicas": replicas if updated is None else updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
    }
    if conditions is not None:
        status["conditions"] = conditions
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default", "generation": generation},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": []}}},
        "status": status,
    }


AVAILABLE = {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
UNAVAILABLE = {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"}
PROGRESSING = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
DEADLINE = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}


def test_deployment_phases() -> None:
    running = deployment(3, ready=3, conditions=[AVAILABLE, PROGRESSING])
    assert phase("Deployment", running) == StatusResult("Running", ("Running",), "")
    # without conditions (a hand-written snapshot object) the replica counts decide
    assert phase("Deployment", deployment(3, ready=3)).phase == "Running"
    # every pod ready but not yet available (minReadySeconds): still coming up
    waiting = deployment(3, ready=3, conditions=[UNAVAILABLE, PROGRESSING])
    assert phase("Deployment", waiting) == StatusResult("Initializing", ("Initializing",), "")
    degraded = deployment(3, ready=1, conditions=[AVAILABLE, PROGRESSING])
    assert phase("Deployment", degraded).phase == "Degraded"
    starting = deployment(3, ready=0, updated=0, total=0, conditions=[UNAVAILABLE])
    assert phase("Deployment", starting).phase == "Initializing"
    rolling = deployment(3, ready=3, updated=1, total=4, conditions=[AVAILABLE, PROGRESSING])
    assert phase("Deployment", rolling).phase == "Initializing"
    # a rolling update with every new pod created and an old one still running (surplus,
    # maxSurge) and a new one not ready yet: not settled, so Initializing, not Degraded
    surplus = deployment(4, ready=3, total=5, conditions=[AVAILABLE, PROGRESSING])
    assert phase("Deployment", surplus) == StatusResult("Initializing", ("Initializing",), "")
    unobserved = deployment(3, ready=3, generation=3, observed=2, conditions=[AVAILABLE])
    assert phase("Deployment", unobserved).phase == "Initializing"
    stuck = deployment(3, ready=0, updated=1, total=3, conditions=[UNAVAILABLE, DEADLINE])
    assert phase("Deployment", stuck) == StatusResult("Failed", ("Failed", "Initializing"), "")
    quota = deployment(3, ready=2, total=2, updated=2, conditions=[AVAILABLE])
    quota["status"]["conditions"].append({"type": "ReplicaFailure", "status": "True"})
    assert phase("Deployment", quota).phase == "Degraded"
    # scaled to zero and settled: running, with zero desired replicas (facts say the rest)
    zero = deployment(0, ready=0, conditions=[AVAILABLE])
    del zero["status"]["readyReplicas"], zero["status"]["updatedReplicas"]
    assert phase("Deployment", zero).phase == "Running"


def test_statefulset_phases() -> None:
    assert phase("StatefulSet", statefulset(3, ready=3)).phase == "Running"
    assert phase("StatefulSet", statefulset(3, ready=2)).phase == "Degraded"
    assert phase("StatefulSet", statefulset(3, ready=0)).phase == "Initializing"
    rolling = statefulset(3, ready=3, updated=1, revision="r2")
    assert phase("StatefulSet", rolling).phase == "Initializing"
    # the controller leaves updateRevision out until it has one
    fresh = statefulset(1, ready=1)
    del fresh["status"]["updateRevision"]
    assert phase("StatefulSet", fresh).phase == "Running"


def daemonset(desired: int, *, ready: int, updated: int | None = None) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {},
        "status": {
            "observedGeneration": 1,
            "desiredNumberScheduled": desired,
            "currentNumberScheduled": desired,
            "numberReady": ready,
            "updatedNumberScheduled": desired if updated is None else updated,
        },
    }


def test_daemonset_phases() -> None:
    assert phase("DaemonSet", daemonset(4, ready=4)).phase == "Running"
    assert phase("DaemonSet", daemonset(4, ready=3)).phase == "Degraded"
    assert phase("DaemonSet", daemonset(4, ready=0)).phase == "Initializing"
    assert phase("DaemonSet", daemonset(4, ready=4, updated=2)).phase == "Initializing"
    assert phase("DaemonSet", daemonset(0, ready=0)).phase == "Running"  # no matching node


def test_replicaset_phases() -> None:
    def rs(replicas: int, ready: int, total: int) -> dict[str, Any]:
        return {
            "metadata": {"generation": 1},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": total, "readyReplicas": ready},
        }

    assert phase("ReplicaSet", rs(2, 2, 2)).phase == "Running"
    assert phase("ReplicaSet", rs(2, 1, 2)).phase == "Degraded"
    assert phase("ReplicaSet", rs(2, 0, 2)).phase == "Initializing"
    assert phase("ReplicaSet", rs(2, 0, 0)).phase == "Initializing"


def job(
    *, active: int = 0, suspend: bool | None = None, conditions: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"parallelism": 2, "completions": 4}
    if suspend is not None:
        spec["suspend"] = suspend
    status: dict[str, Any] = {}
    if active:
        status["active"] = active
    if conditions is not None:
        status["conditions"] = conditions
    return {"apiVersion": "batch/v1", "kind": "Job", "spec": spec, "status": status}


def test_job_phases() -> None:
    assert phase("Job", job()).phase == "Initializing"
    assert phase("Job", job(active=2, suspend=False)).phase == "Running"
    complete = [
        {"type": "SuccessCriteriaMet", "status": "True"},
        {"type": "Complete", "status": "True"},
    ]
    assert phase("Job", job(conditions=complete)) == StatusResult("Completed", ("Completed",), "")
    failed = [{"type": "FailureTarget", "status": "True"}, {"type": "Failed", "status": "True"}]
    assert phase("Job", job(conditions=failed)).phase == "Failed"
    # terminating pods of a failed job are still active: Failed wins
    assert phase("Job", job(active=1, conditions=failed)) == StatusResult(
        "Failed", ("Running", "Failed"), ""
    )
    suspended = [{"type": "Suspended", "status": "True"}]
    assert phase("Job", job(suspend=True, conditions=suspended)).phase == "Suspended"
    assert phase("Job", job(suspend=True, active=2)).phase == "Suspending"
    not_done = [{"type": "Complete", "status": "False"}]
    assert phase("Job", job(conditions=not_done)).phase == "Initializing"


def cronjob(**status: Any) -> dict[str, Any]:
    suspend = status.pop("suspend", False)
    return {"spec": {"suspend": suspend, "schedule": "*/5 * * * *"}, "status": status}


def test_cronjob_phases() -> None:
    assert phase("CronJob", cronjob()).phase == "Initializing"
    assert phase("CronJob", cronjob(suspend=True)).phase == "Suspended"
    active = cronjob(active=[{"name": "c-1"}], lastScheduleTime="2026-01-01T10:05:00Z")
    assert phase("CronJob", active).phase == "Running"
    ok_run = cronjob(
        lastScheduleTime="2026-01-01T10:05:00Z", lastSuccessfulTime="2026-01-01T10:05:42Z"
    )
    assert phase("CronJob", ok_run).phase == "Completed"
    bad_run = cronjob(
        lastScheduleTime="2026-01-01T10:10:00Z", lastSuccessfulTime="2026-01-01T10:05:42Z"
    )
    assert phase("CronJob", bad_run).phase == "Failed"
    never_ok = cronjob(lastScheduleTime="2026-01-01T10:10:00Z")
    assert phase("CronJob", never_ok).phase == "Failed"
    suspended_active = cronjob(suspend=True, active=[{"name": "c-1"}])
    assert phase("CronJob", suspended_active).phase == "Suspended"


@pytest.mark.parametrize(
    ("pod_phase", "expected"),
    [
        ("Pending", "Initializing"),
        ("Running", "Running"),
        ("Succeeded", "Completed"),
        ("Failed", "Failed"),
        ("Unknown", "Undefined"),
    ],
)
def test_pod_phases(pod_phase: str, expected: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": {}, "status": {"phase": pod_phase}}
    assert phase("Pod", pod).phase == expected
