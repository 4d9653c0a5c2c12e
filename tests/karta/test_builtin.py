"""The project's built-in descriptions of core kinds: they load through the ordinary
parser, and their scale and status definitions say the right thing about small,
realistic objects as the Kubernetes controllers write them."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

import pytest
import yaml

from proxy.karta.builtin import builtin_descriptions, builtin_files
from proxy.karta.description import (
    load_description_paths,
    parse_description,
    select_descriptions,
)
from proxy.karta.engine import Engine
from proxy.karta.jqexpr import output_numbers
from proxy.karta.model import GVK, Description, GroupKind
from proxy.karta.status import StatusResult, evaluate_status
from tests.karta.clusters import SAMPLES
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
    assert output_numbers(scale.replicas.all(obj)) == [replicas]


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


def served_statefulset(
    strategy: dict[str, Any], *, current: int, updated: int, ready: int, revision: str,
) -> dict[str, Any]:
    """A StatefulSet ``web`` of 3 as the API server returns it, whose template was changed
    (generation 2, observed) from revision ``web-5d8f7c6b9`` to ``revision``: ``current``
    pods on the old revision, ``updated`` on the new one."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "web", "namespace": "shop", "uid": "0d9c1e4a-55c3-4c8e-9f5b-2b1f3c4d5e6f",
            "generation": 2, "resourceVersion": "918273",
            "creationTimestamp": "2026-11-02T08:00:00Z", "labels": {"app": "web"},
        },
        "spec": {
            "replicas": 3,
            "serviceName": "web",
            "podManagementPolicy": "OrderedReady",
            "revisionHistoryLimit": 10,
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain",
                                                     "whenScaled": "Retain"},
            "selector": {"matchLabels": {"app": "web"}},
            "updateStrategy": strategy,
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]}},
        },
        "status": {
            "observedGeneration": 2,
            "replicas": current + updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": current,
            "updatedReplicas": updated,
            # the controller promotes currentRevision only for RollingUpdate, once every
            # pod is updated and ready (completeRollingUpdate): never for OnDelete
            "currentRevision": "web-5d8f7c6b9",
            "updateRevision": revision,
            "collisionCount": 0,
        },
    }


ON_DELETE = {"type": "OnDelete"}
ROLLING = {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}


def test_an_ondelete_statefulset_with_every_pod_recreated_is_running() -> None:
    """OnDelete: the StatefulSet controller never moves currentRevision to updateRevision
    (kubernetes#73492, #106055), so comparing them held such a set Initializing forever
    after any template change, every pod recreated on the new revision and ready."""
    done = served_statefulset(ON_DELETE, current=0, updated=3, ready=3, revision="web-7b9d4f8c5")
    assert phase("StatefulSet", done) == StatusResult("Running", ("Running",), "")
    one_down = served_statefulset(ON_DELETE, current=0, updated=3, ready=2,
                                  revision="web-7b9d4f8c5")
    assert phase("StatefulSet", one_down).phase == "Degraded"
    # an old pod not deleted yet: the rollout is not done
    waiting = served_statefulset(ON_DELETE, current=1, updated=2, ready=3,
                                 revision="web-7b9d4f8c5")
    assert phase("StatefulSet", waiting).phase == "Initializing"
    # the template put back to the current revision with every pod on the other one:
    # the revisions agree, but no pod is on the template, and the counts say so
    back = served_statefulset(ON_DELETE, current=0, updated=0, ready=3,
                              revision="web-5d8f7c6b9")
    back["status"].update(currentReplicas=3, updatedReplicas=0, replicas=3)
    assert phase("StatefulSet", back).phase == "Initializing"
    # a set that never changed its template: the revisions agree from creation on
    never = served_statefulset(ON_DELETE, current=3, updated=0, ready=3,
                               revision="web-5d8f7c6b9")
    never["status"]["updatedReplicas"] = 3
    assert phase("StatefulSet", never).phase == "Running"


def test_a_rolling_update_statefulset_is_settled_when_the_controller_ends_the_rollout() -> None:
    # every pod updated, the last one not ready: the controller has not ended the rollout
    # (currentRevision not promoted), so Initializing, as a Deployment with a surplus pod
    last = served_statefulset(ROLLING, current=0, updated=3, ready=2, revision="web-7b9d4f8c5")
    assert phase("StatefulSet", last).phase == "Initializing"
    ended = copy.deepcopy(last)
    ended["status"].update(readyReplicas=3, availableReplicas=3, currentReplicas=3,
                           currentRevision="web-7b9d4f8c5")
    assert phase("StatefulSet", ended) == StatusResult("Running", ("Running",), "")
    # held by a partition: the pods below it stay on the old revision
    held = served_statefulset({"type": "RollingUpdate", "rollingUpdate": {"partition": 2}},
                              current=2, updated=1, ready=3, revision="web-7b9d4f8c5")
    assert phase("StatefulSet", held).phase == "Initializing"
    # rolled back to the current revision while one pod was on the new one
    back = served_statefulset(ROLLING, current=2, updated=0, ready=3, revision="web-5d8f7c6b9")
    back["status"]["updatedReplicas"] = 2
    assert phase("StatefulSet", back).phase == "Initializing"
    # no updateStrategy written (a hand-written object): RollingUpdate, the API's default
    bare = copy.deepcopy(last)
    del bare["spec"]["updateStrategy"]
    assert phase("StatefulSet", bare).phase == "Initializing"


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


def _unix(when: str) -> float:
    return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()


def served_job(
    spec: dict[str, Any], status: dict[str, Any], conditions: list[dict[str, str]]
) -> dict[str, Any]:
    """A Job as a 1.31+ API server returns it (defaults filled in)."""
    full_spec: dict[str, Any] = {
        "parallelism": 3, "completions": 3, "backoffLimit": 6, "completionMode": "NonIndexed",
        "suspend": False, "manualSelector": False, "podReplacementPolicy": "TerminatingOrFailed",
        "selector": {"matchLabels": {"batch.kubernetes.io/controller-uid": "5c1f"}},
        "template": {"metadata": {"labels": {"batch.kubernetes.io/job-name": "train"}},
                     "spec": {"restartPolicy": "Never",
                              "containers": [{"name": "train", "image": "trainer:2"}]}},
    }
    full_spec.update(spec)
    full_status: dict[str, Any] = {"startTime": "2026-11-30T09:00:00Z", "ready": 0,
                                   "uncountedTerminatedPods": {}, **status}
    full_status["conditions"] = [
        {"lastProbeTime": c["lastTransitionTime"], **c} for c in conditions]
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train", "namespace": "ml", "uid": "5c1f",
                     "generation": 1, "creationTimestamp": "2026-11-30T08:59:59Z"},
        "spec": full_spec, "status": full_status,
    }


def _true(kind: str, reason: str, message: str, at: str) -> dict[str, str]:
    """A Job condition set to True at ``at``."""
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": at}


BACKOFF = "Job has reached the specified backoff limit"
MATCHED = "Matched rules at index 0"
FAILURE_TARGET = _true("FailureTarget", "BackoffLimitExceeded", BACKOFF, "2026-11-30T09:10:00Z")
FAILED = _true("Failed", "BackoffLimitExceeded", BACKOFF, "2026-11-30T09:10:31Z")
SUCCESS_MET = _true("SuccessCriteriaMet", "SuccessPolicy", MATCHED, "2026-11-30T09:20:00Z")
COMPLETE = _true("Complete", "SuccessPolicy", MATCHED, "2026-11-30T09:20:29Z")


def test_a_failed_job_is_failed_while_its_pods_terminate() -> None:
    """Since 1.31 the Job controller sets FailureTarget=True first (backoffLimit,
    backoffLimitPerIndex, podFailurePolicy, activeDeadlineSeconds) and Failed=True only
    once every pod has terminated; terminating pods are not active. It read Initializing
    meanwhile (no active pod, not finished)."""
    failing = served_job({"backoffLimit": 0},
                         {"active": 0, "terminating": 2, "failed": 1}, [FAILURE_TARGET])
    since = _unix(FAILURE_TARGET["lastTransitionTime"])
    assert phase("Job", failing) == StatusResult("Failed", ("Failed",), "", since)
    # once the pods are gone: Failed, still dated by when the failure was decided
    failed = served_job({"backoffLimit": 0}, {"terminating": 0, "failed": 3},
                        [FAILURE_TARGET, FAILED])
    assert phase("Job", failed) == StatusResult("Failed", ("Failed",), "", since)
    # a Job from before 1.31 (Failed alone) is dated by Failed
    old = served_job({"backoffLimit": 0}, {"failed": 3}, [FAILED])
    assert phase("Job", old).since == _unix(FAILED["lastTransitionTime"])
    deadline = served_job({"activeDeadlineSeconds": 600}, {"active": 0, "terminating": 3},
                          [{**FAILURE_TARGET, "reason": "DeadlineExceeded",
                            "message": "Job was active longer than specified deadline"}])
    assert phase("Job", deadline).phase == "Failed"


SUSPENDED = {"type": "Suspended", "status": "True", "reason": "JobSuspended",
             "message": "Job suspended", "lastTransitionTime": "2026-11-30T09:30:00Z"}


def test_a_job_suspended_is_suspending_while_its_pods_terminate() -> None:
    """Suspending a Job deletes its active pods and sets Suspended=True at once; a pod
    being deleted is no longer active but terminating. With ``.status.active`` alone
    the Job read Suspended while its pods still ran their grace period (a checkpointing
    trainer's minutes), and Suspending showed only in the instant before the deletion."""
    stopping = served_job({"suspend": True}, {"active": 0, "terminating": 3}, [SUSPENDED])
    assert phase("Job", stopping).phase == "Suspending"
    stopped = served_job({"suspend": True}, {"active": 0, "terminating": 0}, [SUSPENDED])
    assert phase("Job", stopped) == StatusResult(
        "Suspended", ("Suspended",), "", _unix(SUSPENDED["lastTransitionTime"]))
    # a cluster without the count (before 1.28): as before
    older = served_job({"suspend": True}, {"active": 0}, [SUSPENDED])
    assert phase("Job", older).phase == "Suspended"


def test_a_job_that_met_its_success_criteria_is_completed_while_its_pods_terminate() -> None:
    """SuccessCriteriaMet=True (a successPolicy met; from 1.33 every completion) comes
    before Complete=True, which waits for the remaining pods to terminate."""
    indexed = {"completionMode": "Indexed",
               "successPolicy": {"rules": [{"succeededIndexes": "0"}]}}
    met = served_job(indexed, {"active": 0, "terminating": 2, "succeeded": 1,
                               "completedIndexes": "0"}, [SUCCESS_MET])
    since = _unix(SUCCESS_MET["lastTransitionTime"])
    assert phase("Job", met) == StatusResult("Completed", ("Completed",), "", since)
    done = served_job(indexed, {"terminating": 0, "succeeded": 1, "completedIndexes": "0",
                                "completionTime": "2026-11-30T09:20:29Z"},
                      [SUCCESS_MET, COMPLETE])
    assert phase("Job", done) == StatusResult("Completed", ("Completed",), "", since)
    # 1.33+: a plain completion is marked the same way
    reached = served_job({}, {"active": 0, "terminating": 1, "succeeded": 3},
                         [{**SUCCESS_MET, "reason": "CompletionsReached",
                           "message": "Reached expected number of succeeded pods"}])
    assert phase("Job", reached).phase == "Completed"
    # a condition that is not True does not finish a Job
    maybe = served_job({}, {"active": 0}, [{**SUCCESS_MET, "status": "False"}])
    assert phase("Job", maybe).phase == "Initializing"


def job_pod(name: str, job: dict[str, Any], index: str | None, *,
            label: bool = True) -> dict[str, Any]:
    """A pod of ``job`` as the Job controller makes it (an Indexed Job's carries its
    completion index as an annotation, and from 1.28 as a label too)."""
    labels = {"batch.kubernetes.io/controller-uid": job["metadata"]["uid"],
              "batch.kubernetes.io/job-name": job["metadata"]["name"],
              "controller-uid": job["metadata"]["uid"], "job-name": job["metadata"]["name"]}
    annotations = {}
    if index is not None:
        annotations["batch.kubernetes.io/job-completion-index"] = index
        if label:
            labels["batch.kubernetes.io/job-completion-index"] = index
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": job["metadata"]["namespace"],
                     "uid": f"pod-{name}", "labels": labels, "annotations": annotations,
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                          "name": job["metadata"]["name"],
                                          "uid": job["metadata"]["uid"], "controller": True,
                                          "blockOwnerDeletion": True}]},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"},
    }


def test_an_indexed_jobs_pods_carry_their_completion_index_as_replica() -> None:
    indexed = served_job({"completionMode": "Indexed"}, {"active": 3}, [])
    plain = served_job({}, {"active": 1}, [])
    plain["metadata"].update(name="etl", uid="9e2a")
    e = Engine()
    e.upsert_many([indexed, plain,
                   job_pod("train-0-x7k2p", indexed, "0"),
                   job_pod("train-1-a1b2c", indexed, "1"),
                   job_pod("train-2-d3e4f", indexed, "2", label=False),  # before 1.28
                   job_pod("etl-q8w9e", plain, None)])
    got = {a.pod: (a.workload and a.workload.name, a.component, a.replica) for a in e.pods()}
    assert got == {"train-0-x7k2p": ("train", "job", "0"),
                   "train-1-a1b2c": ("train", "job", "1"),
                   "train-2-d3e4f": ("train", "job", "2"),
                   "etl-q8w9e": ("etl", "job", "")}
    assert e.description_warnings == []  # the selector reads only what the engine keeps


def test_a_job_below_a_described_owner_takes_the_owners_replica_not_its_index() -> None:
    """Only the top workload's description places a pod: an Indexed Job owned by a JobSet
    or a CronJob is no workload of its own, and its replicaSelector does not apply; the
    CronJob's own reads the same index (a run of an Indexed jobTemplate), the JobSet
    sample's none."""
    if not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is not beside the checkout")
    descs, errors = load_description_paths([SAMPLES / "ri-jobset.yaml"])
    assert errors == []
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": "pretrain", "namespace": "ml", "uid": "js-1",
                           "generation": 1},
              "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {
                  "spec": {"completionMode": "Indexed", "parallelism": 2}}}]},
              "status": {"conditions": []}}
    job = served_job({"completionMode": "Indexed", "parallelism": 2, "completions": 2},
                     {"active": 2}, [])
    job["metadata"].update(name="pretrain-workers-0", namespace="ml", uid="job-w0",
                           labels={"jobset.sigs.k8s.io/replicatedjob-name": "workers"},
                           ownerReferences=[{"apiVersion": "jobset.x-k8s.io/v1alpha2",
                                             "kind": "JobSet", "name": "pretrain",
                                             "uid": "js-1", "controller": True}])
    cron = {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "nightly", "namespace": "ml", "uid": "cj-1"},
            "spec": {"schedule": "0 2 * * *", "jobTemplate": {"spec": {
                "completionMode": "Indexed", "parallelism": 2}}},
            "status": {"active": [{"kind": "Job", "name": "nightly-29000000",
                                   "namespace": "ml", "uid": "job-n1"}]}}
    nightly = served_job({"completionMode": "Indexed", "parallelism": 2}, {"active": 2}, [])
    nightly["metadata"].update(name="nightly-29000000", namespace="ml", uid="job-n1",
                               ownerReferences=[{"apiVersion": "batch/v1", "kind": "CronJob",
                                                 "name": "nightly", "uid": "cj-1",
                                                 "controller": True}])
    pods = []
    for i in ("0", "1"):
        p = job_pod(f"pretrain-workers-0-{i}-abcde", job, i)
        p["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"] = "workers"
        pods.append(p)
        pods.append(job_pod(f"nightly-29000000-{i}-fghij", nightly, i))
    e = Engine()
    e.add_descriptions(descs, source="samples")
    e.upsert_many([jobset, job, cron, nightly, *pods])
    got = {a.pod: (a.workload and a.workload.kind, a.component, a.instance, a.replica)
           for a in e.pods()}
    assert got == {
        "pretrain-workers-0-0-abcde": ("JobSet", "replicatedjob", "workers", ""),
        "pretrain-workers-0-1-abcde": ("JobSet", "replicatedjob", "workers", ""),
        # a CronJob's own description gives a run's pods their completion index
        "nightly-29000000-0-fghij": ("CronJob", "cronjob", "", "0"),
        "nightly-29000000-1-fghij": ("CronJob", "cronjob", "", "1"),
    }


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
