"""Generic phase evaluation: upstream matcher semantics, the one-phase rule, the samples'
status definitions on small workload objects, and that evaluation never raises."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.karta.builtin import builtin_descriptions
from proxy.karta.description import load_description_paths, parse_description
from proxy.karta.model import GENERIC_PHASES, UPSTREAM_STATUS_ORDER, Description, StatusDefinition
from proxy.karta.status import PHASE_PRIORITY, StatusResult, evaluate_status
from tests.karta.descriptions import component, karta
from tests.karta.workloads import statefulset

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "karta" / "descriptions"


def sample(filename: str) -> Description:
    path = SAMPLES / filename
    if not path.is_file():
        pytest.skip(f"../shared/karta/descriptions/{filename} is absent")
    descs, errors = load_description_paths([path])
    assert errors == [] and len(descs) == 1
    return descs[0]


def status_of(filename: str, obj: dict[str, Any]) -> StatusResult:
    return evaluate_status(sample(filename).status, obj)


def cond(ctype: str, status: str, reason: str | None = None) -> dict[str, str]:
    out = {"type": ctype, "status": status}
    if reason is not None:
        out["reason"] = reason
    return out


def with_conditions(*conditions: dict[str, str]) -> dict[str, Any]:
    return {"status": {"conditions": list(conditions)}}


def ready(status: str, reason: str | None = None) -> dict[str, Any]:
    """An object whose one condition is ``Ready`` (Knative, KServe, RayService style)."""
    return with_conditions(cond("Ready", status, reason))


def ok(phase: str, *statuses: str) -> StatusResult:
    return StatusResult(phase, statuses or (phase,), "")


UNMATCHED = StatusResult("Undefined", ("Undefined",), "no_status_matched")


# -- the samples ------------------------------------------------------------------------------

RAYJOB = "wm-rayjob.yaml"
RAYCLUSTER, RAYCLUSTER_RI = "wm-raycluster.yaml", "ri-raycluster.yaml"
JOBSET = "ri-jobset.yaml"
PYTORCH = "ri-pytorch.yaml"
LWS = "wm-leaderworkerset-x-k8s-io-leaderworkerset-v1.yaml"
STATEFULSET = "wm-apps-statefulset-v1.yaml"
RAYSERVICE = "wm-rayservice.yaml"
KNATIVE = "wm-serving-knative-dev-service-v1.yaml"
KSERVE = "ri-kserve.yaml"
LLMISVC = "wm-serving-kserve-io-llminferenceservice-v1alpha1.yaml"

RAY_READY = {"spec": {}, "status": {"state": "ready"}}
RAY_SUSPENDED = {"spec": {"suspend": True}, "status": {"state": "suspended"}}

#: (sample file, workload object, the status evaluation expected)
SAMPLE_CASES = [
    *(pytest.param(RAYJOB, {"spec": {}, "status": {"jobStatus": job_status,
                                                    "jobDeploymentStatus": "Running"}},
                   ok(expected), id=f"rayjob-{job_status.lower()}")
      for job_status, expected in [("PENDING", "Initializing"), ("RUNNING", "Running"),
                                   ("SUCCEEDED", "Completed"), ("FAILED", "Failed")]),
    pytest.param(RAYJOB, {"spec": {"suspend": True}, "status": {"jobDeploymentStatus":
                                                                "Suspended"}},
                 ok("Suspended"), id="rayjob-suspended"),
    pytest.param(RAYJOB, {"status": {"jobStatus": "STOPPED"}}, UNMATCHED, id="rayjob-unknown"),
    pytest.param(RAYJOB, {}, UNMATCHED, id="rayjob-no-status"),
    # a phase that is not a string is no phase at all
    pytest.param(RAYJOB, {"status": {"jobStatus": ["RUNNING"]}}, UNMATCHED,
                 id="rayjob-phase-not-a-string"),
    pytest.param(RAYCLUSTER, RAY_READY, ok("Running"), id="raycluster-ready"),
    pytest.param(RAYCLUSTER_RI, RAY_READY, ok("Running"), id="raycluster-ri-ready"),
    pytest.param(RAYCLUSTER, {"status": {"state": "failed"}}, ok("Failed"),
                 id="raycluster-failed"),
    pytest.param(RAYCLUSTER, {"spec": {"suspend": True}}, ok("Suspended"),
                 id="raycluster-suspend-asked"),
    pytest.param(RAYCLUSTER, RAY_SUSPENDED, ok("Suspended"), id="raycluster-suspended"),
    # the older form has no suspended mapping
    pytest.param(RAYCLUSTER_RI, RAY_SUSPENDED, UNMATCHED, id="raycluster-ri-suspended"),
    pytest.param(JOBSET, with_conditions(cond("StartupPolicyCompleted", "True"),
                                         cond("Completed", "False"), cond("Failed", "False")),
                 ok("Running"), id="jobset-running"),
    pytest.param(JOBSET, with_conditions(cond("StartupPolicyInProgress", "True")),
                 ok("Initializing"), id="jobset-starting"),
    pytest.param(JOBSET, with_conditions(cond("StartupPolicyCompleted", "True"),
                                         cond("Completed", "True")),
                 ok("Completed"), id="jobset-completed"),
    pytest.param(JOBSET, with_conditions(cond("StartupPolicyCompleted", "True"),
                                         cond("Completed", "False"), cond("Failed", "True")),
                 ok("Failed"), id="jobset-failed"),
    # every byConditions entry must exist: Completed / Failed missing -> not running
    pytest.param(JOBSET, with_conditions(cond("StartupPolicyCompleted", "True")), UNMATCHED,
                 id="jobset-partial-conditions"),
    # running beats initializing
    pytest.param(PYTORCH, with_conditions(cond("Created", "True"), cond("Running", "True"),
                                          cond("Succeeded", "False"), cond("Failed", "False")),
                 ok("Running", "Running", "Initializing"), id="pytorch-running"),
    pytest.param(PYTORCH, with_conditions(cond("Created", "True"), cond("Running", "False"),
                                          cond("Succeeded", "True")),
                 ok("Completed", "Completed", "Initializing"), id="pytorch-completed"),
    # by expression, then by conditions
    pytest.param(LWS, {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
                 ok("Running"), id="lws-ready"),
    pytest.param(LWS, {"status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}},
                 UNMATCHED, id="lws-not-ready"),
    pytest.param(LWS, {"status": {"replicas": 2, "readyReplicas": 1,
                                  "conditions": [cond("Progressing", "True"),
                                                 cond("Available", "False")]}},
                 ok("Initializing"), id="lws-progressing"),
    pytest.param(LWS, with_conditions(cond("Available", "True"), cond("Progressing", "True")),
                 ok("Running", "Running", "Initializing"), id="lws-available"),
    pytest.param(LWS, with_conditions(cond("Available", "False"), cond("Progressing", "False"),
                                      cond("UpdateInProgress", "False")),
                 ok("Failed"), id="lws-failed"),
    pytest.param(STATEFULSET, statefulset(3, ready=3), ok("Running"), id="statefulset-ready"),
    pytest.param(STATEFULSET, statefulset(3, ready=1), ok("Degraded"), id="statefulset-degraded"),
    pytest.param(STATEFULSET, statefulset(3, ready=0), ok("Initializing"),
                 id="statefulset-starting"),
    pytest.param(STATEFULSET, statefulset(3, ready=3, updated=1, revision="r2"),
                 ok("Initializing"), id="statefulset-rolling"),
    # Ready=False is told apart by its reason
    pytest.param(RAYSERVICE, ready("True"), ok("Running"), id="rayservice-ready"),
    pytest.param(RAYSERVICE, ready("False", "ZeroServeEndpoints"),
                 ok("Degraded"), id="rayservice-zero-endpoints"),
    pytest.param(RAYSERVICE, ready("False", "Initializing"),
                 ok("Initializing"), id="rayservice-initializing"),
    pytest.param(RAYSERVICE, ready("False", "InitializingTimeout"),
                 ok("Failed"), id="rayservice-timeout"),
    pytest.param(RAYSERVICE, ready("False", "Other"), UNMATCHED, id="rayservice-other-reason"),
    pytest.param(KNATIVE, ready("Unknown"), ok("Initializing"), id="knative-unknown"),
    pytest.param(KNATIVE, ready("True"), ok("Running"), id="knative-ready"),
    pytest.param(KNATIVE, ready("False"), ok("Failed"), id="knative-failed"),
    pytest.param(KSERVE, with_conditions(cond("PredictorReady", "True"),
                                         cond("RoutesReady", "True"),
                                         cond("LatestDeploymentReady", "True")),
                 ok("Running"), id="kserve-ready"),
    # by expression
    pytest.param(LLMISVC, ready("True"), ok("Running"), id="llmisvc-ready"),
    pytest.param(LLMISVC, ready("False", "Progressing"),
                 ok("Initializing"), id="llmisvc-progressing"),
    pytest.param(LLMISVC, ready("False", "ImagePullBackOff"), ok("Failed"), id="llmisvc-broken"),
    # `.status.conditions // []` guards the expression when there is no status at all
    pytest.param(LLMISVC, {}, UNMATCHED, id="llmisvc-no-status"),
]


@pytest.mark.parametrize(("filename", "obj", "expected"), SAMPLE_CASES)
def test_sample_status(filename: str, obj: dict[str, Any], expected: StatusResult) -> None:
    assert status_of(filename, obj) == expected


# -- upstream matcher semantics, on tiny inline definitions -----------------------------------


def definition(status: dict[str, Any]) -> StatusDefinition:
    obj = karta("t", component("t", "example.com", "T", statusDefinition=status))
    d = parse_description(obj, "test")
    assert d.status is not None
    return d.status


CONDITIONS = {"path": ".status.conditions"}


def test_no_status_definition() -> None:
    assert evaluate_status(None, {"status": {}}) == StatusResult(
        "Undefined", ("Undefined",), "no_status_definition"
    )


def test_later_duplicate_condition_wins() -> None:
    sd = definition(
        {
            "conditionsDefinition": CONDITIONS,
            "statusMappings": {
                "running": [{"byConditions": [{"type": "Ready", "status": "True"}]}],
                "failed": [{"byConditions": [{"type": "Ready", "status": "False"}]}],
            },
        }
    )
    obj = with_conditions(cond("Ready", "False"), cond("Ready", "True"))
    assert evaluate_status(sd, obj) == ok("Running")
    obj = with_conditions(cond("Ready", "True"), cond("Ready", "False"))
    assert evaluate_status(sd, obj) == ok("Failed")


def test_condition_type_only_status_and_reason() -> None:
    sd = definition(
        {
            "conditionsDefinition": CONDITIONS,
            "statusMappings": {
                "initializing": [{"byConditions": [{"type": "Created"}]}],
                "failed": [{"byConditions": [{"type": "Ready", "reason": "Crash"}]}],
                "degraded": [
                    {"byConditions": [{"type": "Ready", "status": "False", "reason": "Slow"}]}
                ],
            },
        }
    )
    assert evaluate_status(sd, with_conditions(cond("Created", "False"))) == ok("Initializing")
    assert evaluate_status(sd, ready("True", "Crash")) == ok("Failed")
    assert evaluate_status(sd, ready("False", "Slow")) == ok("Degraded")
    assert evaluate_status(sd, ready("True", "Slow")) == UNMATCHED
    assert evaluate_status(sd, ready("False", "slow")) == UNMATCHED
    assert evaluate_status(sd, ready("False")) == UNMATCHED


def test_an_empty_phase_status_or_reason_is_not_given() -> None:
    """Upstream (Go) cannot tell "" from absent: ``byPhase: ""`` matches any phase and
    ``status: ""`` / ``reason: ""`` any value (they had to equal "")."""
    sd = definition({
        "phaseDefinition": {"path": ".status.phase"},
        "conditionsDefinition": CONDITIONS,
        "statusMappings": {
            "running": [{"byPhase": ""}],
            "degraded": [{"byConditions": [{"type": "Ready", "status": ""}]}],
            "failed": [{"byConditions": [{"type": "Broken", "reason": ""}]}],
        },
    })
    obj = {"status": {"phase": "Up", "conditions": [
        cond("Ready", "True"), cond("Broken", "True", "Disk")]}}
    assert evaluate_status(sd, obj) == ok("Failed", "Running", "Failed", "Degraded")
    (m,) = dict(sd.mappings)["Running"]
    assert m.by_phase is None


def test_a_failing_phase_or_conditions_path_aborts_even_if_no_matcher_reads_it() -> None:
    """Both paths are evaluated up front: a jq error in either aborts the evaluation, as
    upstream's does, not only when a matcher happens to read it."""
    unread_phase = definition({
        "phaseDefinition": {"path": ".status.phases[]"},
        "conditionsDefinition": CONDITIONS,
        "statusMappings": {"running": [{"byConditions": [{"type": "Ready"}]}]},
    })
    res = evaluate_status(unread_phase, ready("True"))
    assert (res.phase, res.reason.split(":")[0]) == ("Undefined", "jq_error")
    assert "(in .status.phases[])" in res.reason
    unread_conditions = definition({
        "phaseDefinition": {"path": ".status.phase"},
        "conditionsDefinition": {"path": ".status.conds[]"},
        "statusMappings": {"running": [{"byPhase": "X", "byConditions": [{"type": "Ready"}]}],
                           "failed": [{"byPhase": "F"}]},
    })
    res = evaluate_status(unread_conditions, {"status": {"phase": "F"}})
    assert (res.phase, res.reason.split(":")[0]) == ("Undefined", "jq_error")
    assert "(in .status.conds[])" in res.reason


def test_custom_condition_field_names() -> None:
    sd = definition(
        {
            "conditionsDefinition": {
                "path": ".status.health",
                "typeFieldName": "name",
                "statusFieldName": "ok",
                "reasonFieldName": "why",
            },
            "statusMappings": {
                "failed": [
                    {"byConditions": [{"type": "Disk", "status": "false", "reason": "Full"}]}
                ]
            },
        }
    )
    obj = {"status": {"health": [{"name": "Disk", "ok": False, "why": "Full"}]}}
    assert evaluate_status(sd, obj) == ok("Failed")
    obj = {"status": {"health": [{"type": "Disk", "status": "false", "reason": "Full"}]}}
    assert evaluate_status(sd, obj) == UNMATCHED


def test_conditions_path_shapes() -> None:
    sd = definition(
        {
            "conditionsDefinition": {"path": ".status.conditions[]?"},
            "statusMappings": {
                "running": [{"byConditions": [{"type": "Ready", "status": "True"}]}]
            },
        }
    )
    assert evaluate_status(sd, ready("True")) == ok("Running")
    assert evaluate_status(sd, {"status": {"conditions": "Ready"}}) == UNMATCHED
    sd = definition(
        {
            "conditionsDefinition": CONDITIONS,
            "statusMappings": {"running": [{"byConditions": [{"type": "Ready"}]}]},
        }
    )
    # one mapping where a list was expected reads as a single condition, like `[]?` output
    assert evaluate_status(sd, {"status": {"conditions": {"type": "Ready"}}}) == ok("Running")
    junk = {"status": {"conditions": [1, None, "x", {"status": "True"}, {"type": "Ready"}]}}
    assert evaluate_status(sd, junk) == ok("Running")


def test_by_phase_and_and_or() -> None:
    sd = definition(
        {
            "phaseDefinition": {"path": ".status.phase"},
            "conditionsDefinition": CONDITIONS,
            "statusMappings": {
                "running": [
                    {
                        "byPhase": "Up",
                        "byConditions": [{"type": "Ready", "status": "True"}],
                        "byExpression": {"expression": ".status.n > 0", "expectedResult": "true"},
                    },
                    {"byPhase": "Serving"},
                ],
            },
        }
    )
    full = {"status": {"phase": "Up", "n": 1, "conditions": [cond("Ready", "True")]}}
    assert evaluate_status(sd, full) == ok("Running")
    broken: dict[str, Any]
    for broken in ({"phase": "Down"}, {"n": 0}, {"conditions": []}):
        obj = {"status": {**full["status"], **broken}}
        assert evaluate_status(sd, obj) == UNMATCHED, broken
    assert evaluate_status(sd, {"status": {"phase": "Serving"}}) == ok("Running")
    assert evaluate_status(sd, {"status": {"phase": "up"}}) == UNMATCHED


def test_empty_matcher_matches_and_empty_list_does_not() -> None:
    sd = definition({"statusMappings": {"running": [{}], "failed": []}})
    assert evaluate_status(sd, {}) == ok("Running")


def test_phase_is_the_first_output_and_must_be_a_string() -> None:
    sd = definition(
        {
            "phaseDefinition": {"path": ".status.phases[]"},
            "statusMappings": {"running": [{"byPhase": "a"}], "failed": [{"byPhase": "b"}]},
        }
    )
    assert evaluate_status(sd, {"status": {"phases": ["a", "b"]}}) == ok("Running")
    assert evaluate_status(sd, {"status": {"phases": [1, "b"]}}) == UNMATCHED
    assert evaluate_status(sd, {"status": {"phases": []}}) == UNMATCHED


@pytest.mark.parametrize(
    ("expression", "expected", "value"),
    [
        (".v", "3", 3),
        (".v", "3", 3.0),
        (".v", "2.5", 2.5),
        (".v", "true", True),
        (".v", "null", None),
        (".v", "abc", "abc"),
        (".v | length", "2", [1, 2]),
        (".v[]", "x", ["x", "y"]),  # the first output counts
        (".v", '{"a":"é"}', {"a": "é"}),  # non-ASCII as jq and gojq write it
    ],
)
def test_by_expression_compares_tostring(expression: str, expected: str, value: Any) -> None:
    sd = definition(
        {
            "statusMappings": {
                "running": [
                    {"byExpression": {"expression": expression, "expectedResult": expected}}
                ]
            }
        }
    )
    assert evaluate_status(sd, {"v": value}) == ok("Running")


def test_by_expression_without_output_does_not_match() -> None:
    sd = definition(
        {
            "statusMappings": {
                "running": [{"byExpression": {"expression": "empty", "expectedResult": "null"}}]
            }
        }
    )
    assert evaluate_status(sd, {}) == UNMATCHED


def test_jq_runtime_error_gives_undefined_with_reason() -> None:
    sd = definition(
        {
            "phaseDefinition": {"path": ".status.phase"},
            "statusMappings": {
                "running": [{"byPhase": "Running"}],
                "failed": [
                    {"byExpression": {"expression": ".status.items[] | .x", "expectedResult": "1"}}
                ],
            },
        }
    )
    res = evaluate_status(sd, {"status": {"phase": "Running", "items": None}})
    assert (res.phase, res.statuses) == ("Undefined", ("Undefined",))
    assert res.reason.startswith("jq_error: Cannot iterate over null")
    assert "(in .status.items[] | .x)" in res.reason
    res = evaluate_status(sd, {"status": "weird"})
    assert res.phase == "Undefined" and res.reason.startswith("jq_error: Cannot index string")


def test_long_jq_error_reason_is_short() -> None:
    long_expr = ".status.items[] | " + " + ".join(f".f{i}" for i in range(100))
    sd = definition(
        {
            "statusMappings": {
                "failed": [{"byExpression": {"expression": long_expr, "expectedResult": "1"}}]
            }
        }
    )
    res = evaluate_status(sd, {"status": {"items": 5}})
    assert res.phase == "Undefined" and res.reason.startswith("jq_error: ")
    assert len(res.reason) <= 160


def test_object_that_is_not_json() -> None:
    sd = definition(
        {
            "statusMappings": {
                "running": [{"byExpression": {"expression": ".a", "expectedResult": "1"}}]
            }
        }
    )
    for bad in ({"a": b"bytes"}, {"a": math.nan}, {"a": {1, 2}}):
        res = evaluate_status(sd, bad)
        assert res.phase == "Undefined" and res.reason.startswith("invalid_object: ")


def test_all_statuses_in_upstream_order_and_priority() -> None:
    sd = definition({"statusMappings": {s.lower(): [{}] for s in reversed(UPSTREAM_STATUS_ORDER)}})
    res = evaluate_status(sd, {})
    assert res.statuses == UPSTREAM_STATUS_ORDER
    assert res.phase == PHASE_PRIORITY[0] == "Failed"


def test_priority_is_a_permutation_of_the_generic_statuses() -> None:
    assert sorted(PHASE_PRIORITY) == sorted(UPSTREAM_STATUS_ORDER)
    assert set(GENERIC_PHASES) == {*PHASE_PRIORITY, "Undefined"}


@pytest.mark.parametrize("i", range(len(PHASE_PRIORITY) - 1))
def test_priority_pairwise(i: int) -> None:
    higher, lower = PHASE_PRIORITY[i], PHASE_PRIORITY[i + 1]
    sd = definition({"statusMappings": {lower.lower(): [{}], higher.lower(): [{}]}})
    res = evaluate_status(sd, {})
    assert res.phase == higher
    assert res.statuses == tuple(s for s in UPSTREAM_STATUS_ORDER if s in (higher, lower))


# -- never raises -----------------------------------------------------------------------------


def all_descriptions() -> list[Description]:
    descs = list(builtin_descriptions())
    if SAMPLES.is_dir():
        loaded, _ = load_description_paths([SAMPLES])
        descs.extend(loaded)
    return descs


DESCRIPTIONS = all_descriptions()
KEYS = (
    "status",
    "spec",
    "metadata",
    "conditions",
    "type",
    "reason",
    "phase",
    "state",
    "jobStatus",
    "jobDeploymentStatus",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "observedGeneration",
    "generation",
    "suspend",
    "active",
    "currentRevision",
    "updateRevision",
    "desiredNumberScheduled",
    "numberReady",
    "updatedNumberScheduled",
    "lastScheduleTime",
    "lastSuccessfulTime",
    "items",
)
WORDS = ("True", "False", "Unknown", "Ready", "Running", "RUNNING", "ready", "Complete", "Failed")

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(WORDS)
    | st.text(max_size=8)
)
json_like = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)
conditions = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(WORDS) | json_like},
        optional={"status": st.sampled_from(WORDS) | json_like, "reason": json_like},
    ),
    max_size=5,
)
workloads = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.dictionaries(st.sampled_from(KEYS), json_like, max_size=3),
        "spec": json_like,
        "status": st.dictionaries(st.sampled_from(KEYS), json_like, max_size=6)
        | st.fixed_dictionaries({"conditions": conditions}, optional={"phase": json_like}),
    },
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(min_value=0, max_value=len(DESCRIPTIONS) - 1), obj=workloads)
def test_evaluate_status_never_raises(index: int, obj: dict[str, Any]) -> None:
    d = DESCRIPTIONS[index]
    res = evaluate_status(d.status, obj)
    assert res.phase in GENERIC_PHASES
    assert set(res.statuses) <= set(GENERIC_PHASES) and res.statuses
    if res.phase == "Undefined":
        assert res.statuses == ("Undefined",) and res.reason
    else:
        assert res.phase in res.statuses and res.reason == ""
        assert res.statuses == tuple(s for s in UPSTREAM_STATUS_ORDER if s in res.statuses)


def test_yaml_timestamps_compare_like_api_strings() -> None:
    (cron,) = [d for d in builtin_descriptions() if d.group_kind.kind == "CronJob"]
    obj = yaml.safe_load(
        "spec: {suspend: false}\n"
        "status:\n"
        "  lastScheduleTime: 2026-01-01T10:10:00Z\n"
        "  lastSuccessfulTime: 2026-01-01T10:05:42Z\n"
    )
    assert evaluate_status(cron.status, obj).phase == "Failed"
    obj["status"]["lastSuccessfulTime"] = obj["status"]["lastScheduleTime"]
    assert evaluate_status(cron.status, obj).phase == "Completed"
    sd = definition(
        {
            "statusMappings": {
                "running": [
                    {"byExpression": {"expression": ".t", "expectedResult": "2026-01-01T10:10:00Z"}}
                ]
            }
        }
    )
    assert evaluate_status(sd, obj | {"t": obj["status"]["lastScheduleTime"]}).phase == "Running"


# -- when the phase began, from the object ------------------------------------------------


def _lt(ctype: str, status: str, when: Any) -> dict[str, Any]:
    return {"type": ctype, "status": status, "lastTransitionTime": when}


DATED = definition({
    "conditionsDefinition": CONDITIONS,
    "phaseDefinition": {"path": ".status.phase"},
    "statusMappings": {
        "running": [
            {"byPhase": "Up"},  # matches first, but carries no evidence
            {"byConditions": [{"type": "Ready", "status": "True"},
                              {"type": "Synced", "status": "True"}]},
            {"byConditions": [{"type": "Ready", "status": "True"}]},
        ],
        "failed": [{"byExpression": {"expression": ".status.broken", "expectedResult": "true"}}],
    },
})


def test_since_is_the_latest_time_of_the_first_dated_matcher() -> None:
    conds = [_lt("Ready", "True", "2026-01-01T00:00:00Z"),
             _lt("Synced", "True", "2026-01-01T00:01:00.5Z")]
    obj: dict[str, Any] = {"status": {"phase": "Up", "conditions": conds}}
    res = evaluate_status(DATED, obj)
    assert (res.phase, res.since) == ("Running", 1767225660.5)
    # one of its conditions has no readable time: the next dated matcher gives it
    for bad in (None, "", "yesterday", 17):
        conds[1]["lastTransitionTime"] = bad
        assert evaluate_status(DATED, obj).since == 1767225600.0, bad
    # an offset other than Z is read as written
    conds[0]["lastTransitionTime"] = "2026-01-01T01:00:00+01:00"
    assert evaluate_status(DATED, obj).since == 1767225600.0


def test_a_condition_matched_by_its_reason_dates_from_when_it_took_the_reason() -> None:
    d = definition({
        "conditionsDefinition": CONDITIONS,
        "statusMappings": {
            "running": [{"byConditions": [{"type": "Progressing", "status": "True",
                                           "reason": "NewReplicaSetAvailable"}]}],
            "initializing": [{"byConditions": [{"type": "Progressing", "status": "True"}]}],
        },
    })
    cond = {**_lt("Progressing", "True", "2026-01-01T00:00:00Z"),
            "reason": "NewReplicaSetAvailable", "lastUpdateTime": "2026-01-02T00:00:00Z"}
    obj: dict[str, Any] = {"status": {"conditions": [cond]}}
    # the status stayed True (lastTransitionTime), the reason came at lastUpdateTime
    assert (evaluate_status(d, obj).phase, evaluate_status(d, obj).since) == (
        "Running", 1767312000.0)
    # an older or unreadable lastUpdateTime: lastTransitionTime
    for other in ("2025-12-31T00:00:00Z", "soon", None):
        cond["lastUpdateTime"] = other
        assert evaluate_status(d, obj).since == 1767225600.0, other
    # a matcher that names no reason: lastTransitionTime alone, whatever lastUpdateTime says
    cond.update(reason="ReplicaSetUpdated", lastUpdateTime="2026-01-02T00:00:00Z")
    res = evaluate_status(d, obj)
    assert (res.phase, res.since) == ("Initializing", 1767225600.0)


def test_no_evidence_without_a_dated_matcher() -> None:
    assert evaluate_status(DATED, {"status": {"phase": "Up"}}).since is None
    res = evaluate_status(DATED, {"status": {"broken": True}})
    assert (res.phase, res.since) == ("Failed", None)
    assert evaluate_status(DATED, {"status": {}}).since is None  # Undefined


def test_a_failing_dated_matcher_costs_the_evidence_not_the_phase() -> None:
    d = definition({
        "conditionsDefinition": CONDITIONS,
        "statusMappings": {"running": [
            {"byExpression": {"expression": ".status.up", "expectedResult": "true"}},
            {"byConditions": [{"type": "Ready"}],
             "byExpression": {"expression": ".status.n[]", "expectedResult": "1"}},
        ]},
    })
    obj = {"status": {"up": True, "n": None, "conditions": [
        _lt("Ready", "True", "2026-01-01T00:00:00Z")]}}
    assert evaluate_status(d, obj) == StatusResult("Running", ("Running",), "", None)


def _edited(obj: dict[str, Any], **status: Any) -> dict[str, Any]:
    """``obj`` with status fields replaced; a None value removes the field."""
    for key, value in status.items():
        if value is None:
            obj["status"].pop(key, None)
        else:
            obj["status"][key] = value
    return obj


def _on_delete(obj: dict[str, Any]) -> dict[str, Any]:
    obj["spec"]["updateStrategy"] = {"type": "OnDelete"}
    return obj


@pytest.mark.parametrize(("obj", "upstream", "builtin"), [
    # where they agree
    pytest.param(statefulset(3, ready=3), "Running", "Running", id="settled"),
    pytest.param(statefulset(3, ready=1), "Degraded", "Degraded", id="some-ready"),
    pytest.param(statefulset(3, ready=3, updated=1, revision="r2"), "Initializing",
                 "Initializing", id="rolling"),
    # OnDelete: the controller never promotes currentRevision, so the sample's compare
    # holds such a set Initializing after any template change, every pod recreated
    pytest.param(_on_delete(statefulset(3, ready=3, revision="r2")), "Initializing",
                 "Running", id="on-delete-recreated"),
    # no updateRevision (a controller not there yet, an object carrying only counts)
    pytest.param(_edited(statefulset(3, ready=3), updateRevision=None), "Initializing",
                 "Running", id="no-update-revision"),
    # a surplus pod (scaling down): the sample matches Initializing and Degraded, and
    # the priority picks Degraded; the built-in's settled wants replicas = D
    pytest.param(_edited(statefulset(3, ready=1), replicas=4), "Degraded", "Initializing",
                 id="surplus-pod"),
    # D = 0 not yet observed: nothing of the sample matches
    pytest.param(_edited(statefulset(0, ready=0), observedGeneration=0), "Undefined",
                 "Initializing", id="scaled-to-zero-unobserved"),
])
def test_the_builtin_statefulset_differs_from_the_upstream_sample_only_as_documented(
    obj: dict[str, Any], upstream: str, builtin: str,
) -> None:
    """docs/karta.md, "Built-in descriptions": the upstream sample of the one core kind
    upstream ships (``wm-apps-statefulset-v1.yaml``) replaces the built-in when a user
    loads it; these are the phases where the two differ, and why."""
    (ours,) = [d for d in builtin_descriptions() if d.root.kind is not None
               and d.root.kind.kind == "StatefulSet"]
    assert (status_of(STATEFULSET, obj).phase, evaluate_status(ours.status, obj).phase) == (
        upstream, builtin)


def test_builtins_date_their_phases_from_their_conditions() -> None:
    by_kind = {d.group_kind.kind: d for d in builtin_descriptions()}
    job = {"spec": {}, "status": {"conditions": [
        _lt("SuccessCriteriaMet", "True", "2026-01-01T00:00:00Z"),
        _lt("Complete", "True", "2026-01-01T00:00:01Z")]}}
    res = evaluate_status(by_kind["Job"].status, job)
    # SuccessCriteriaMet, when the outcome was decided, not Complete, a second later
    assert (res.phase, res.since) == ("Completed", 1767225600.0)
    suspended = {"spec": {"suspend": True}, "status": {"conditions": [
        _lt("Suspended", "True", "2026-01-01T00:00:00Z")]}}
    res = evaluate_status(by_kind["Job"].status, suspended)
    assert (res.phase, res.since) == ("Suspended", 1767225600.0)
    running_job = {"spec": {}, "status": {"active": 1}}
    assert evaluate_status(by_kind["Job"].status, running_job).since is None
    pod: dict[str, Any] = {"status": {"phase": "Failed", "conditions": [
        _lt("Initialized", "True", "2026-01-01T00:00:00Z"),
        _lt("Ready", "False", "2026-01-01T00:10:00Z")]}}
    res = evaluate_status(by_kind["Pod"].status, pod)
    assert (res.phase, res.since) == ("Failed", 1767226200.0)
    pod["status"]["phase"] = "Running"
    assert evaluate_status(by_kind["Pod"].status, pod).since == 1767225600.0
    pending = {"status": {"phase": "Pending", "conditions": [
        _lt("PodScheduled", "False", "2026-01-01T00:00:05Z")]}}
    assert evaluate_status(by_kind["Pod"].status, pending).since == 1767225605.0
    dep: dict[str, Any] = {"metadata": {"generation": 1}, "spec": {"replicas": 1},
           "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                      "readyReplicas": 1,
                      "conditions": [_lt("Available", "True", "2026-01-01T00:00:00Z")]}}
    res = evaluate_status(by_kind["Deployment"].status, dep)
    assert (res.phase, res.since) == ("Running", 1767225600.0)
    dep["status"]["conditions"] = []  # counts only (a hand-written snapshot): still Running
    res = evaluate_status(by_kind["Deployment"].status, dep)
    assert (res.phase, res.since) == ("Running", None)


def test_expressions_iterate_objects_in_key_order_as_gojq_does() -> None:
    """``byExpression`` and the phase path see the object with its keys sorted (gojq's
    iteration order), not in the order the object was written."""
    sd = definition({
        "phaseDefinition": {"path": ".status.replicaStates | to_entries[0].key"},
        "statusMappings": {
            "running": [{"byPhase": "alpha",
                         "byExpression": {"expression": "[.status.replicaStates[]] | .[0]",
                                          "expectedResult": "1"}}],
        },
    })
    obj = {"status": {"replicaStates": {"zeta": 2, "alpha": 1}}}
    assert evaluate_status(sd, obj) == ok("Running")
