"""Loading and validating Karta descriptions: the samples, every validation error, files,
folders, and which description wins for one GroupKind."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.karta.description import (
    DescriptionError,
    is_description_object,
    load_description_file,
    load_description_paths,
    parse_description,
    read_description_paths,
    select_descriptions,
)
from proxy.karta.jqexpr import output_numbers
from proxy.karta.model import GVK, Description, GroupKind
from tests.karta.descriptions import component, karta

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "karta" / "descriptions"
ROOT = "spec.structureDefinition.rootComponent"
CHILDREN = "spec.structureDefinition.childComponents"
_DELETE = object()


def samples_dir() -> Path:
    if not SAMPLES.is_dir():
        pytest.skip("../shared/karta/descriptions is absent")
    return SAMPLES


# -- the upstream samples -------------------------------------------------------------------

#: file -> (name, GroupKind, form, pod-bearing components in declaration order)
EXPECTED_SAMPLES: dict[str, tuple[str, GroupKind, str, tuple[str, ...]]] = {
    "ri-jobset.yaml": (
        "ri-jobset.jobset.x-k8s.io",
        GroupKind("jobset.x-k8s.io", "JobSet"),
        "ResourceInterface",
        ("replicatedjob",),
    ),
    "ri-kserve.yaml": (
        "serving-kserve-io-inferenceservice-v1beta1",
        GroupKind("serving.kserve.io", "InferenceService"),
        "ResourceInterface",
        ("predictor", "transformer"),
    ),
    "ri-pytorch.yaml": (
        "kubeflow-org-pytorchjob-v1",
        GroupKind("kubeflow.org", "PyTorchJob"),
        "ResourceInterface",
        ("master", "worker"),
    ),
    "ri-raycluster.yaml": (
        "ray-io-raycluster-v1",
        GroupKind("ray.io", "RayCluster"),
        "ResourceInterface",
        ("head", "worker"),
    ),
    "wm-apps-statefulset-v1.yaml": (
        "apps-statefulset-v1",
        GroupKind("apps", "StatefulSet"),
        "Karta",
        ("statefulset",),
    ),
    "wm-leaderworkerset-x-k8s-io-leaderworkerset-v1.yaml": (
        "leaderworkerset-x-k8s-io-leaderworkerset-v1",
        GroupKind("leaderworkerset.x-k8s.io", "LeaderWorkerSet"),
        "Karta",
        ("leader", "worker"),
    ),
    "wm-raycluster.yaml": (
        "ray-io-raycluster-v1",
        GroupKind("ray.io", "RayCluster"),
        "Karta",
        ("head", "worker"),
    ),
    "wm-rayjob.yaml": (
        "ray-io-rayjob-v1",
        GroupKind("ray.io", "RayJob"),
        "Karta",
        ("head", "worker"),
    ),
    "wm-rayservice.yaml": (
        "ray-io-rayservice-v1",
        GroupKind("ray.io", "RayService"),
        "Karta",
        ("head", "worker"),
    ),
    "wm-serving-knative-dev-service-v1.yaml": (
        "serving-knative-dev-service-v1",
        GroupKind("serving.knative.dev", "Service"),
        "Karta",
        ("revision",),
    ),
    "wm-serving-kserve-io-llminferenceservice-v1alpha1.yaml": (
        "serving-kserve-io-llminferenceservice-v1alpha1",
        GroupKind("serving.kserve.io", "LLMInferenceService"),
        "Karta",
        ("main", "prefill", "worker", "router-scheduler"),
    ),
}


@pytest.mark.parametrize("filename", sorted(EXPECTED_SAMPLES))
def test_sample_loads(filename: str) -> None:
    path = samples_dir() / filename
    if not path.exists():
        pytest.skip(f"{filename} is absent")
    descs, errors = load_description_file(path)
    assert errors == []
    assert len(descs) == 1
    d = descs[0]
    name, gk, form, pod_components = EXPECTED_SAMPLES[filename]
    assert (d.name, d.group_kind, d.form) == (name, gk, form)
    assert tuple(c.name for c in d.pod_components) == pod_components
    assert d.source == str(path)
    assert not d.builtin
    assert d.status is not None


def test_every_sample_file_is_covered() -> None:
    names = {p.name for p in samples_dir().iterdir() if p.suffix == ".yaml"}
    assert names - set(EXPECTED_SAMPLES) <= {"ri-mpijob.yaml"}


def test_mpijob_sample_gives_the_precise_yaml_error() -> None:
    path = samples_dir() / "ri-mpijob.yaml"
    if not path.exists():
        pytest.skip("ri-mpijob.yaml is absent")
    descs, errors = load_description_file(path)
    assert descs == []
    assert len(errors) == 1
    err = errors[0]
    assert (err.source, err.name, err.path) == (str(path), "", "")
    # `status: "False"          running:` -- the mapping key glued onto a value
    assert err.reason.startswith("invalid YAML: line 25, column 42: ")
    assert "line 24" in err.reason


def test_sample_details() -> None:
    path = samples_dir() / "wm-leaderworkerset-x-k8s-io-leaderworkerset-v1.yaml"
    if not path.exists():
        pytest.skip("LWS sample absent")
    (d,), _ = load_description_file(path)
    group = d.children[0]
    assert group.name == "group" and group.kind is None and not group.pod_bearing
    assert group.pod_selector is not None and group.pod_selector.replica_key_path is not None
    worker = d.children[2]
    assert worker.owner_ref == "group"
    assert worker.pod_selector is not None and worker.pod_selector.type_selector is not None
    ts = worker.pod_selector.type_selector
    assert ts.value is None and ts.key_path is not None
    leader = d.children[1].pod_selector
    assert leader is not None and leader.type_selector is not None
    assert leader.type_selector.value == "0"

    rayjob = samples_dir() / "wm-rayjob.yaml"
    if rayjob.exists():
        (rj,), _ = load_description_file(rayjob)
        assert rj.status is not None
        assert rj.status.reason_field == "reason"  # `reasonFieldName: null` -> default
        worker_c = rj.children[1]
        assert worker_c.instance_id_path is not None
        assert worker_c.pod_selector is not None
        assert worker_c.pod_selector.instance_id_path is not None

    knative = samples_dir() / "wm-serving-knative-dev-service-v1.yaml"
    if knative.exists():
        (kn,), _ = load_description_file(knative)
        assert kn.additional_child_kinds == (GVK("apps", "v1", "Deployment"),)


def test_sample_folder_loads_all_but_mpijob() -> None:
    descs, errors = load_description_paths([samples_dir()])
    assert len(descs) == len(EXPECTED_SAMPLES)
    assert [Path(e.source).name for e in errors] == ["ri-mpijob.yaml"]


# -- validation: one tiny description per error ------------------------------------------------


def base() -> dict[str, Any]:
    """A small valid description: root with two pod-bearing children and a status."""
    status = {"phaseDefinition": {"path": ".status.phase"},
              "statusMappings": {"running": [{"byPhase": "Running"}]}}
    return karta("tiny", component("root", "example.com", "Tiny", statusDefinition=status), [
        {
            "name": "a",
            "ownerRef": "root",
            "specDefinition": {"podTemplateSpecPath": ".spec.a"},
            "podSelector": {
                "componentTypeSelector": {"keyPath": ".metadata.labels.role", "value": "a"}
            },
        },
        {
            "name": "b",
            "ownerRef": "root",
            "specDefinition": {"podTemplateSpecPath": ".spec.b[]"},
            "instanceIdPath": ".spec.b[].name",
            "podSelector": {
                "componentTypeSelector": {"matchLabels": {"role": "b"}},
                "componentInstanceSelector": {"idPath": ".metadata.labels.group"},
            },
        },
    ])


def structure(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["structureDefinition"]


def root(obj: dict[str, Any]) -> dict[str, Any]:
    return structure(obj)["rootComponent"]


def child(obj: dict[str, Any], i: int) -> dict[str, Any]:
    return structure(obj)["childComponents"][i]


def error_of(obj: Any, source: str = "test.yaml") -> DescriptionError:
    with pytest.raises(DescriptionError) as info:
        parse_description(obj, source)
    return info.value


def test_base_is_valid() -> None:
    d = parse_description(base(), "test.yaml")
    assert d.name == "tiny" and d.source == "test.yaml" and d.form == "Karta"
    assert d.group_kind == GroupKind("example.com", "Tiny")
    assert [c.name for c in d.pod_components] == ["a", "b"]
    b = d.children[1]
    assert b.pod_selector is not None and b.pod_selector.type_selector is not None
    assert b.pod_selector.type_selector.match_labels == (("role", "b"),)


def test_error_str_format() -> None:
    err = DescriptionError("f.yaml", "tiny", "spec.x", "bad")
    assert str(err) == "f.yaml (tiny): spec.x: bad"
    assert err == DescriptionError("f.yaml", "tiny", "spec.x", "bad")
    assert len({err, DescriptionError("f.yaml", "tiny", "spec.x", "bad")}) == 1


#: one invalid edit of base() per error: (edit, path, reason), the reason exact
INVALID: list[Any] = [
    pytest.param(lambda o: structure(o).pop("rootComponent"), ROOT, "required",
                 id="no-root-component"),
    pytest.param(lambda o: root(o).pop("kind"), f"{ROOT}.kind", "required", id="no-root-kind"),
    pytest.param(lambda o: root(o)["kind"].pop("kind"), f"{ROOT}.kind.kind", "required",
                 id="root-kind-without-kind-name"),
    pytest.param(lambda o: o["spec"].pop("structureDefinition"), "spec.structureDefinition",
                 "required", id="no-structure"),
    pytest.param(lambda o: child(o, 0)["specDefinition"].update(podTemplateSpecPath="  "),
                 f"{CHILDREN}[0].specDefinition.podTemplateSpecPath", "empty jq expression",
                 id="empty-jq"),
    pytest.param(lambda o: child(o, 1).update(ownerRef="nope"), f"{CHILDREN}[1].ownerRef",
                 "unknown component 'nope'", id="unknown-owner-ref"),
    pytest.param(lambda o: (child(o, 0).update(ownerRef="b"), child(o, 1).update(ownerRef="a")),
                 f"{CHILDREN}[0].ownerRef", "ownerRef cycle: a -> b -> a", id="owner-ref-cycle"),
    pytest.param(lambda o: child(o, 1).update(ownerRef="b"), f"{CHILDREN}[1].ownerRef",
                 "ownerRef cycle: b -> b", id="owner-ref-to-itself"),
    pytest.param(lambda o: root(o).update(ownerRef="a"), f"{ROOT}.ownerRef",
                 "the root component has no owner", id="root-with-owner-ref"),
    pytest.param(lambda o: child(o, 1).update(name="a"), f"{CHILDREN}[1].name",
                 f"duplicate component name 'a' (also at {CHILDREN}[0])",
                 id="duplicate-child-names"),
    pytest.param(lambda o: child(o, 0).update(name="root"), f"{CHILDREN}[0].name",
                 f"duplicate component name 'root' (also at {ROOT})", id="child-named-like-root"),
    pytest.param(lambda o: child(o, 0).pop("name"), f"{CHILDREN}[0].name", "required",
                 id="child-without-name"),
    pytest.param(lambda o: child(o, 1)["podSelector"].pop("componentInstanceSelector"),
                 f"{CHILDREN}[1].instanceIdPath",
                 "instanceIdPath needs podSelector.componentInstanceSelector",
                 id="instance-id-path-without-instance-selector"),
    pytest.param(lambda o: child(o, 1).pop("instanceIdPath"),
                 f"{CHILDREN}[1].podSelector.componentInstanceSelector",
                 "componentInstanceSelector needs instanceIdPath",
                 id="instance-selector-without-instance-id-path"),
    pytest.param(lambda o: child(o, 1)["podSelector"].update(componentInstanceSelector={}),
                 f"{CHILDREN}[1].podSelector.componentInstanceSelector.idPath", "required",
                 id="instance-selector-without-id-path"),
    pytest.param(lambda o: child(o, 0)["podSelector"].update(componentTypeSelector={"value": "a"}),
                 f"{CHILDREN}[0].podSelector.componentTypeSelector",
                 "needs keyPath or matchLabels", id="type-selector-without-key-path-or-labels"),
    pytest.param(lambda o: child(o, 1)["podSelector"]["componentTypeSelector"].update(value="b"),
                 f"{CHILDREN}[1].podSelector.componentTypeSelector.value", "value needs keyPath",
                 id="type-selector-value-without-key-path"),
    pytest.param(lambda o: child(o, 1)["podSelector"]["componentTypeSelector"].update(
                     matchLabels={"role": ["b"]}),
                 f"{CHILDREN}[1].podSelector.componentTypeSelector.matchLabels",
                 "label 'role': keys and values must be strings", id="match-labels-not-strings"),
    pytest.param(lambda o: root(o)["statusDefinition"].pop("statusMappings"),
                 f"{ROOT}.statusDefinition.statusMappings", "required",
                 id="status-definition-without-mappings"),
    pytest.param(lambda o: root(o)["statusDefinition"]["statusMappings"].update(
                     failed=[{"byConditions": [{"status": "True"}]}]),
                 f"{ROOT}.statusDefinition.statusMappings.failed[0].byConditions[0].type",
                 "required", id="condition-matcher-without-type"),
    pytest.param(lambda o: root(o)["statusDefinition"]["statusMappings"].update(
                     failed={"byPhase": "x"}),
                 f"{ROOT}.statusDefinition.statusMappings.failed", "must be a list, got mapping",
                 id="matchers-not-a-list"),
    pytest.param(lambda o: root(o)["statusDefinition"]["statusMappings"].update(
                     failed=[{"byExpression": {"expression": ".a"}}]),
                 f"{ROOT}.statusDefinition.statusMappings.failed[0].byExpression.expectedResult",
                 "required", id="expression-matcher-without-expected-result"),
    pytest.param(lambda o: child(o, 0)["specDefinition"].update(metadataPath=".spec.a.metadata"),
                 f"{CHILDREN}[0].specDefinition.metadataPath",
                 "metadataPath is used only with podSpecPath",
                 id="metadata-path-without-pod-spec-path"),
    pytest.param(lambda o: child(o, 0)["specDefinition"].update(podSpecPath=".spec.a.spec"),
                 f"{CHILDREN}[0].specDefinition",
                 "only one of podTemplateSpecPath, podSpecPath, fragmentedPodSpecDefinition "
                 "may be set", id="two-spec-variants"),
    pytest.param(lambda o: structure(o).update(childComponents={"name": "a"}), CHILDREN,
                 "must be a list, got mapping", id="children-not-a-list"),
    pytest.param(lambda o: root(o).update(kind="Tiny"), f"{ROOT}.kind",
                 "must be a mapping, got str", id="kind-not-a-mapping"),
]


@pytest.mark.parametrize(("edit", "path", "reason"), INVALID)
def test_invalid_description(edit: Callable[[dict[str, Any]], object], path: str,
                             reason: str) -> None:
    obj = base()
    edit(obj)
    err = error_of(obj)
    assert (err.source, err.name, err.path, err.reason) == ("test.yaml", "tiny", path, reason)


@pytest.mark.parametrize("key", ["paused", "Running"])  # unknown, and not lowercase
def test_unknown_status_mapping_key(key: str) -> None:
    obj = base()
    root(obj)["statusDefinition"]["statusMappings"][key] = [{"byPhase": "Paused"}]
    err = error_of(obj)
    assert err.path == f"{ROOT}.statusDefinition.statusMappings.{key}"
    assert err.reason.startswith(f"unknown status '{key}' (expected one of ")
    assert "running" in err.reason


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (
            lambda o: child(o, 1)["podSelector"]["componentInstanceSelector"].update(idPath=".a["),
            f"{CHILDREN}[1].podSelector.componentInstanceSelector.idPath",
        ),
        (
            lambda o: child(o, 0)["podSelector"]["componentTypeSelector"].update(keyPath=".x |"),
            f"{CHILDREN}[0].podSelector.componentTypeSelector.keyPath",
        ),
        (lambda o: child(o, 1).update(instanceIdPath="..."), f"{CHILDREN}[1].instanceIdPath"),
        (
            lambda o: child(o, 0)["specDefinition"].update(podTemplateSpecPath="{"),
            f"{CHILDREN}[0].specDefinition.podTemplateSpecPath",
        ),
        (
            lambda o: child(o, 0).update(scaleDefinition={"replicasPath": ".a +"}),
            f"{CHILDREN}[0].scaleDefinition.replicasPath",
        ),
        (
            lambda o: child(o, 0).update(scaleDefinition={"maxReplicasPath": "if"}),
            f"{CHILDREN}[0].scaleDefinition.maxReplicasPath",
        ),
        (
            lambda o: root(o)["statusDefinition"]["phaseDefinition"].update(path=".["),
            f"{ROOT}.statusDefinition.phaseDefinition.path",
        ),
        (
            lambda o: root(o)["statusDefinition"].update(conditionsDefinition={"path": "]"}),
            f"{ROOT}.statusDefinition.conditionsDefinition.path",
        ),
        (
            lambda o: root(o)["statusDefinition"]["statusMappings"].update(
                failed=[
                    {"byPhase": "x"},
                    {"byExpression": {"expression": ".a ==", "expectedResult": "true"}},
                ]
            ),
            f"{ROOT}.statusDefinition.statusMappings.failed[1].byExpression.expression",
        ),
        (
            lambda o: child(o, 0)["specDefinition"].update(
                podTemplateSpecPath=None, fragmentedPodSpecDefinition={"imagePath": ".x[["}
            ),
            f"{CHILDREN}[0].specDefinition.fragmentedPodSpecDefinition.imagePath",
        ),
    ],
)
def test_jq_that_does_not_compile(mutate: Any, path: str) -> None:
    obj = base()
    mutate(obj)
    err = error_of(obj)
    assert (err.source, err.name, err.path) == ("test.yaml", "tiny", path)
    assert "compile" in err.reason or "syntax error" in err.reason


def test_jq_error_reason_is_jqs_message() -> None:
    obj = base()
    child(obj, 0)["podSelector"]["componentTypeSelector"]["keyPath"] = ".x |"
    err = error_of(obj)
    assert "syntax error" in err.reason
    assert "\n" not in err.reason


def test_numeric_literal_is_a_jq_expression() -> None:
    obj = base()
    child(obj, 0)["scaleDefinition"] = {"replicasPath": 2, "minReplicasPath": "1"}
    d = parse_description(obj, "test.yaml")
    scale = d.children[0].scale
    assert scale is not None and scale.replicas is not None and scale.min_replicas is not None
    assert output_numbers(scale.replicas.all({})) == [2.0]
    assert output_numbers(scale.min_replicas.all({})) == [1.0]


def test_owner_chain_through_children_is_fine() -> None:
    obj = base()
    child(obj, 1)["ownerRef"] = "a"
    d = parse_description(obj, "test.yaml")
    assert d.children[1].owner_ref == "a"


def test_child_without_owner_ref_hangs_under_root() -> None:
    obj = base()
    del child(obj, 0)["ownerRef"]
    d = parse_description(obj, "test.yaml")
    assert d.children[0].owner_ref == "root"


def test_a_status_definition_on_a_child_is_not_read() -> None:
    """The phase comes from the root's ``statusDefinition`` only (upstream reads it there):
    a child's neither adds to it nor stands in for a missing one."""
    obj = base()
    child(obj, 0)["statusDefinition"] = {"statusMappings": {"failed": [{}]}}
    d = parse_description(obj, "test.yaml")
    assert d.status is not None
    assert [name for name, _ in d.status.mappings] == ["Running"]
    del root(obj)["statusDefinition"]
    assert parse_description(obj, "test.yaml").status is None


def test_type_selector_numeric_value_is_its_text() -> None:
    obj = base()
    child(obj, 0)["podSelector"]["componentTypeSelector"]["value"] = 0
    d = parse_description(obj, "test.yaml")
    sel = d.children[0].pod_selector
    assert sel is not None and sel.type_selector is not None
    assert sel.type_selector.value == "0"


def test_unquoted_yaml_scalars_in_matchers_are_text() -> None:
    obj = base()
    root(obj)["statusDefinition"]["statusMappings"]["failed"] = [
        {
            "byConditions": [{"type": "Failed", "status": True}],
            "byExpression": {"expression": ".a", "expectedResult": 3},
        }
    ]
    d = parse_description(obj, "test.yaml")
    assert d.status is not None
    failed = dict(d.status.mappings)["Failed"][0]
    assert failed.by_conditions[0].status == "True"  # a condition's spelling, see below
    assert failed.expected_result == "3"


@pytest.mark.parametrize(("written", "status"), [("True", "True"), ("true", "True"),
                                                 ("False", "False"), ('"True"', "True"),
                                                 ("Unknown", "Unknown")])
def test_an_unquoted_boolean_condition_status_is_the_apis_spelling(
        tmp_path: Path, written: str, status: str) -> None:
    # ``status: True`` loaded as the boolean, compared as "true", and never matched a
    # condition: their statuses are "True", "False" and "Unknown"
    from proxy.karta.status import evaluate_status

    obj = base()
    obj["spec"]["structureDefinition"]["rootComponent"]["statusDefinition"] = {
        "conditionsDefinition": {"path": ".status.conditions"},
        "statusMappings": {"running": [{"byConditions": [{"type": "Ready", "status": "X"}]}]}}
    f = tmp_path / "d.yaml"
    f.write_text(yaml.safe_dump(obj).replace("status: X", f"status: {written}"))
    (d,), errors = load_description_file(f)
    assert errors == [] and d.status is not None
    ((_, (matcher,)),) = d.status.mappings
    assert matcher.by_conditions[0].status == status
    ready = {"status": {"conditions": [{"type": "Ready", "status": status}]}}
    assert evaluate_status(d.status, ready).phase == "Running"


def test_condition_field_names_default_when_null() -> None:
    obj = base()
    root(obj)["statusDefinition"]["conditionsDefinition"] = {
        "path": ".status.conditions",
        "typeFieldName": "kind",
        "reasonFieldName": None,
    }
    d = parse_description(obj, "test.yaml")
    assert d.status is not None
    assert (d.status.type_field, d.status.status_field, d.status.reason_field) == (
        "kind",
        "status",
        "reason",
    )


def test_metadata_path_with_pod_spec_path() -> None:
    obj = base()
    child(obj, 0)["specDefinition"] = {"podSpecPath": ".spec.a.spec", "metadataPath": ".m"}
    assert parse_description(obj, "test.yaml").children[0].pod_bearing


def test_pod_bearing_variants_and_root() -> None:
    obj = base()
    root(obj)["specDefinition"] = {"podTemplateSpecPath": ".spec.template"}
    child(obj, 0)["specDefinition"] = {"fragmentedPodSpecDefinition": {"containersPath": ".c"}}
    child(obj, 1)["specDefinition"] = {}
    d = parse_description(obj, "test.yaml")
    assert [c.name for c in d.pod_components] == ["root", "a"]
    assert d.root.pod_bearing and not d.children[1].pod_bearing


def test_not_a_description() -> None:
    err = error_of({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
    assert err.path == "" and err.reason.startswith("not a description")
    err = error_of([base()])  # a YAML list of descriptions at the top: said how to write it
    assert err.reason == ("not a mapping but list (several descriptions go in documents "
                          "separated by ---, or in the items of a kind: List)")


def test_is_description_object() -> None:
    assert is_description_object({"apiVersion": "run.ai/v1alpha1", "kind": "Karta"})
    assert is_description_object({"apiVersion": "run.ai/v2", "kind": "Karta"})
    assert is_description_object(
        {"apiVersion": "optimization.nvidia.com/v1alpha1", "kind": "ResourceInterface"}
    )
    assert not is_description_object({"apiVersion": "run.ai/v1alpha1", "kind": "ResourceInterface"})
    assert not is_description_object({"apiVersion": "apps/v1", "kind": "Karta"})
    assert not is_description_object({"kind": "Karta"})
    assert not is_description_object({"apiVersion": 1, "kind": "Karta"})


def test_resource_interface_without_name_gets_a_stable_name() -> None:
    obj = base()
    obj["apiVersion"] = "optimization.nvidia.com/v1alpha1"
    obj["kind"] = "ResourceInterface"
    del obj["metadata"]
    d = parse_description(obj, "ri.yaml")
    assert (d.name, d.form) == ("ri-tiny.example.com", "ResourceInterface")
    child(obj, 0)["ownerRef"] = "nope"
    assert error_of(obj).name == "ri-tiny.example.com"
    root(obj)["kind"]["group"] = ""
    assert error_of(obj).name == "ri-tiny"


def test_karta_without_name_gets_a_stable_name() -> None:
    obj = base()
    obj["metadata"] = {}
    assert parse_description(obj, "k.yaml").name == "karta-tiny.example.com"


def test_unknown_fields_are_ignored() -> None:
    obj = base()
    obj["spec"]["optimizationInstructions"] = {"gangScheduling": {"podGroups": [{"x": "["}]}}
    root(obj)["suspendDefinition"] = {"suspendActions": [{"path": ".spec.suspend"}]}
    child(obj, 0)["somethingNew"] = {"x": 1}
    assert parse_description(obj, "test.yaml").name == "tiny"


def _renamed(m: dict[str, Any], old: str, new: str) -> None:
    m[new] = m.pop(old)


@pytest.mark.parametrize(("edit", "path", "meant"), [
    pytest.param(lambda o: _renamed(root(o), "statusDefinition", "statusDefiniton"),
                 f"{ROOT}.statusDefiniton", "statusDefinition", id="status-definition"),
    pytest.param(lambda o: _renamed(child(o, 0), "podSelector", "podSelecter"),
                 f"{CHILDREN}[0].podSelecter", "podSelector", id="pod-selector"),
    pytest.param(lambda o: child(o, 0).update(scaleDefinition={"replicas": ".spec.n"}),
                 f"{CHILDREN}[0].scaleDefinition.replicas", "replicasPath", id="replicas"),
    pytest.param(lambda o: _renamed(child(o, 0)["podSelector"]["componentTypeSelector"],
                                    "keyPath", "keypath"),
                 f"{CHILDREN}[0].podSelector.componentTypeSelector.keypath", "keyPath",
                 id="key-path-case"),
    pytest.param(lambda o: child(o, 0).update(instanceIDPath=".spec.ids[]"),
                 f"{CHILDREN}[0].instanceIDPath", "instanceIdPath", id="instance-id-path"),
    pytest.param(lambda o: child(o, 0)["podSelector"].update(
                     replicaSelector={"keypath": ".metadata.labels.i"}),
                 f"{CHILDREN}[0].podSelector.replicaSelector.keypath", "keyPath",
                 id="replica-selector-section"),
    pytest.param(lambda o: _renamed(root(o)["statusDefinition"]["statusMappings"]["running"][0],
                                    "byPhase", "byphase"),
                 f"{ROOT}.statusDefinition.statusMappings.running[0].byphase", "byPhase",
                 id="by-phase"),
    pytest.param(lambda o: _renamed(root(o)["kind"], "version", "verison"),
                 f"{ROOT}.kind.verison", "version", id="kind-version"),
    pytest.param(lambda o: _renamed(structure(o), "childComponents", "childComponent"),
                 "spec.structureDefinition.childComponent", "childComponents", id="children"),
])
def test_a_misspelt_field_is_refused_naming_the_field_meant(
        edit: Callable[[dict[str, Any]], object], path: str, meant: str) -> None:
    """A field the proxy does not know is ignored (upstream's newer ones), so a misspelt
    one was too, without a word: ``statusDefiniton`` left every workload ``Undefined``,
    ``podSelecter`` put every pod in the first component. One a letter or a case away
    from a field of the CRD there is refused, the field meant named."""
    obj = base()
    edit(obj)
    err = error_of(obj)
    assert (err.path, err.reason.split("?")[0]) == (
        path, f"unknown field {path.rpartition('.')[2]!r}: did you mean {meant!r}")


def test_a_near_miss_field_of_an_api_object_is_warned_of_not_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Karta object from the API server was checked against the CRD installed there,
    which may be newer than the proxy: a field it added a letter away from one the proxy
    knows is no typo, and refusing the description took its kind's attribution away. It
    is warned of, and ignored as any unknown field is."""
    obj = base()
    _renamed(root(obj), "statusDefinition", "statusDefiniton")
    with caplog.at_level(logging.WARNING, logger="proxy.karta.description"):
        d = parse_description(obj, "api:Karta/tiny")
    assert d.status is None
    assert any("unknown field" in r.getMessage() and "statusDefinition" in r.getMessage()
               for r in caplog.records)


def test_builtin_flag_and_source() -> None:
    d = parse_description(base(), "builtin:tiny", builtin=True)
    assert d.builtin and d.source == "builtin:tiny"


# -- files and folders ------------------------------------------------------------------------


def test_multi_document_file_keeps_the_valid_ones(tmp_path: Path) -> None:
    bad = base()
    bad["metadata"]["name"] = "bad"
    child(bad, 1)["ownerRef"] = "nope"
    other = base()
    other["metadata"]["name"] = "other"
    root(other)["kind"]["kind"] = "Other"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    f = tmp_path / "many.yaml"
    f.write_text(yaml.safe_dump_all([base(), bad, None, pod, other]))
    descs, errors = load_description_file(f)
    assert [d.name for d in descs] == ["tiny", "other"]
    assert [(e.source, e.name, e.path) for e in errors] == [
        (str(f), "bad", f"{CHILDREN}[1].ownerRef"),
        (str(f), "", ""),
    ]
    assert errors[1].reason.startswith("not a description")


def test_kubernetes_list(tmp_path: Path) -> None:
    bad = base()
    del root(bad)["kind"]
    f = tmp_path / "list.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [base(), bad]}))
    descs, errors = load_description_file(f)
    assert [d.name for d in descs] == ["tiny"]
    assert [(e.name, e.path, e.reason) for e in errors] == [
        ("tiny", f"items[1].{ROOT}.kind", "required")
    ]


def test_karta_list_kind_from_the_api(tmp_path: Path) -> None:
    f = tmp_path / "list.json"
    f.write_text(
        json.dumps({"apiVersion": "run.ai/v1alpha1", "kind": "KartaList", "items": [base()]})
    )
    descs, errors = load_description_file(f)
    assert ([d.name for d in descs], errors) == (["tiny"], [])


def test_json_file(tmp_path: Path) -> None:
    f = tmp_path / "d.json"
    f.write_text(json.dumps(base()))
    descs, errors = load_description_file(f)
    assert ([d.name for d in descs], errors) == (["tiny"], [])
    g = tmp_path / "broken.json"
    g.write_text('{"apiVersion": ')
    descs, errors = load_description_file(g)
    assert descs == [] and len(errors) == 1
    assert errors[0].source == str(g) and errors[0].reason.startswith("invalid JSON: ")


def test_yaml_error_after_a_valid_document(tmp_path: Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text(yaml.safe_dump(base()) + "---\nkind: [unclosed\n")
    descs, errors = load_description_file(f)
    assert [d.name for d in descs] == ["tiny"]
    assert len(errors) == 1 and errors[0].reason.startswith("invalid YAML: line ")


def test_unreadable_and_empty_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    descs, errors = load_description_file(missing)
    assert descs == [] and errors[0].source == str(missing)
    assert errors[0].reason.startswith("cannot read: ")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    descs, errors = load_description_file(binary)
    assert descs == [] and len(errors) == 1
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_description_file(empty) == ([], [])


def test_scalar_document(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("just a string\n")
    descs, errors = load_description_file(f)
    assert descs == [] and errors[0].reason == "not a mapping but str"


def test_folder_loading(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    one = base()
    two = base()
    two["metadata"]["name"] = "two"
    root(two)["kind"]["kind"] = "Two"
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(one))
    (tmp_path / "sub" / "a.yml").write_text(yaml.safe_dump(two))
    (tmp_path / "notes.txt").write_text("not a description")
    (tmp_path / "c.json").write_text("[")
    descs, errors = load_description_paths([tmp_path, tmp_path / "nowhere"])
    assert sorted(d.name for d in descs) == ["tiny", "two"]
    assert [(Path(e.source).name, e.reason.split(":")[0]) for e in errors] == [
        ("c.json", "invalid JSON"),
        ("nowhere", "no such file or folder"),
    ]
    descs, errors = load_description_paths([tmp_path / "b.yaml"])
    assert [d.name for d in descs] == ["tiny"] and errors == []
    # the files passed over for their names, for the log to say (a ConfigMap key
    # "raycluster" without a suffix was read by no one, without a word)
    (tmp_path / "sub" / "raycluster").write_text(yaml.safe_dump(two))
    (tmp_path / ".hidden").write_text("x")
    read = read_description_paths([tmp_path, tmp_path / "b.yaml"])
    assert read.unread == {str(tmp_path): [str(tmp_path / "notes.txt"),
                                           str(tmp_path / "sub" / "raycluster")]}


DUP = """apiVersion: run.ai/v1alpha1
kind: Karta
metadata: {name: dup}
spec:
  structureDefinition:
    rootComponent:
      name: r
      kind: {group: ex.com, version: v1, kind: Thing}
      statusDefinition:
        conditionsDefinition: {path: .status.conditions}
        statusMappings:
          failed:
          - byConditions: [{type: Failed, status: "True"}]
          running:
          - byConditions: [{type: Ready, status: "True"}]
          failed:
          - byConditions: [{type: Stalled, status: "True"}]
"""


def test_a_key_given_twice_rejects_its_description(tmp_path: Path) -> None:
    # the second ``failed`` replaced the first silently; kubectl and yaml.v2 refuse it
    f = tmp_path / "dup.yaml"
    head = yaml.safe_dump(base()) + "---\n"
    f.write_text(head + DUP)
    descs, errors = load_description_file(f)
    assert [d.name for d in descs] == ["tiny"]
    line = head.count("\n") + 16  # the second ``failed``, 16th line of DUP
    assert errors == [DescriptionError(
        str(f), "", "spec.structureDefinition.rootComponent.statusDefinition.statusMappings.failed",
        f"duplicate key 'failed' at line {line}, column 11 (kubectl refuses a key given "
        "twice; the last one would win silently)")]


def test_an_alias_rejects_its_description(tmp_path: Path) -> None:
    text = DUP.replace("          failed:\n          - byConditions: [{type: Stalled",
                       "          degraded:\n          - byConditions: [{type: Stalled")
    text = text.replace("running:\n          - byConditions: [{type: Ready, status: \"True\"}]",
                        "running: &r\n          - byConditions: [{type: Ready, status: \"True\"}]"
                        "\n          resuming: *r")
    f = tmp_path / "alias.yaml"
    f.write_text(text + "---\n" + yaml.safe_dump(base()))
    descs, errors = load_description_file(f)
    assert [d.name for d in descs] == ["tiny"]
    assert [(e.path, e.reason.split(":")[0]) for e in errors] == [
        ("spec.structureDefinition.rootComponent.statusDefinition.statusMappings.resuming",
         "YAML alias *r at line 16, column 21")]


def test_unquoted_timestamps_in_a_description_are_strings(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    obj = base()
    root(obj)["statusDefinition"]["statusMappings"]["running"] = [
        {"byExpression": {"expression": ".status.since", "expectedResult": "2026-01-01"}}]
    text = yaml.safe_dump(obj)
    f.write_text(text.replace("'2026-01-01'", "2026-01-01"))
    assert "expectedResult: 2026-01-01\n" in f.read_text()
    (desc,), errors = load_description_file(f)
    assert errors == []
    assert desc.status is not None
    (_, (matcher,)), = desc.status.mappings
    assert matcher.expected_result == "2026-01-01"


def configmap_mount(folder: Path, versions: list[tuple[str, str]], current: int) -> None:
    """``folder`` as kubelet mounts a ConfigMap: a ``..<timestamp>/`` folder per version
    (name -> text), ``..data`` linking to the current one, each key a link through it."""
    for stamp, (name, text) in enumerate(versions):
        (folder / f"..2026_12_03_1{stamp}_00_00.{stamp}").mkdir(parents=True)
        (folder / f"..2026_12_03_1{stamp}_00_00.{stamp}" / name).write_text(text)
    (folder / "..data").symlink_to(f"..2026_12_03_1{current}_00_00.{current}")
    (folder / versions[current][0]).symlink_to(f"..data/{versions[current][0]}")


def test_a_configmap_mount_is_read_once_in_its_current_version(tmp_path: Path) -> None:
    old, new = base(), base()
    root(new)["statusDefinition"]["statusMappings"]["running"][0]["byPhase"] = "Ready"
    # mid-update: the old version still there, sorting after ``..data``
    configmap_mount(tmp_path, [("tiny.yaml", yaml.safe_dump(new)),
                               ("tiny.yaml", yaml.safe_dump(old))], current=0)
    descs, errors = load_description_paths([tmp_path])
    assert errors == []
    assert [(d.name, d.source) for d in descs] == [("tiny", str(tmp_path / "tiny.yaml"))]
    assert descs[0].status is not None
    (_, (matcher,)), = descs[0].status.mappings
    assert matcher.by_phase == "Ready"


def test_a_subfolder_that_cannot_be_listed_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rglob`` skipped it without a word: its descriptions were gone, no error, and a
    reload applied that. It is an error naming the folder; a hidden one is not read."""
    from tests.unreadable import unreadable

    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "tiny.yaml").write_text(yaml.safe_dump(base()))
    (tmp_path / ".old").mkdir()
    assert [d.name for d in load_description_paths([tmp_path])[0]] == ["tiny"]
    with unreadable(tmp_path / "team", monkeypatch):
        descs, errors = load_description_paths([tmp_path])
    assert descs == []
    assert [str(e) for e in errors] == [
        f"{tmp_path} (): cannot read the folder {tmp_path / 'team'}: Permission denied"]
    with unreadable(tmp_path / ".old", monkeypatch):
        descs, errors = load_description_paths([tmp_path])
    assert [d.name for d in descs] == ["tiny"] and errors == []


def test_an_emptied_file_keeps_the_descriptions_it_held(tmp_path: Path) -> None:
    """Emptied (a save caught between truncating and writing, ``> file``), a file kept
    nothing of what it held; it keeps the previous read's descriptions, marked as found
    empty. A file holding anything else (a comment) holds what it says: nothing."""
    from proxy.karta.description import read_description_paths

    other = base()
    other["metadata"]["name"] = "other"
    root(other)["kind"]["kind"] = "Other"
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(base()))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(other))
    first = read_description_paths([tmp_path])
    assert [d.name for d in first.descriptions()] == ["tiny", "other"] and not first.empty
    (tmp_path / "a.yaml").write_text("")
    second = read_description_paths([tmp_path], first)
    assert [d.name for d in second.descriptions()] == ["tiny", "other"]
    assert second.empty == {str(tmp_path / "a.yaml"): 1} and second.errors == []
    assert second.kept() == [str(tmp_path / "a.yaml")]
    (tmp_path / "a.yaml").write_text(" \n\n")  # still nothing but whitespace: still kept
    third = read_description_paths([tmp_path], second)
    assert [d.name for d in third.descriptions()] == ["tiny", "other"]
    # without a previous read (a start) there is nothing to keep: empty, and said so
    alone = read_description_paths([tmp_path])
    assert [d.name for d in alone.descriptions()] == ["other"]
    assert alone.empty == {str(tmp_path / "a.yaml"): 0} and alone.kept() == []
    # a comment is meant: the file describes nothing
    (tmp_path / "a.yaml").write_text("# nothing here any more\n")
    fourth = read_description_paths([tmp_path], third)
    assert [d.name for d in fourth.descriptions()] == ["other"] and not fourth.empty
    # the tuple API reads without a previous read
    assert [d.name for d in load_description_paths([tmp_path])[0]] == ["other"]


# -- which description wins -------------------------------------------------------------------


def make(
    name: str,
    *,
    kind: str = "Tiny",
    version: str = "v1",
    form: str = "Karta",
    builtin: bool = False,
    source: str = "",
) -> Description:
    obj = copy.deepcopy(base())
    obj["metadata"]["name"] = name
    root(obj)["kind"].update(kind=kind, version=version)
    if form == "ResourceInterface":
        obj.update(apiVersion="optimization.nvidia.com/v1alpha1", kind="ResourceInterface")
    return parse_description(obj, source or f"{name}.yaml", builtin=builtin)


@pytest.mark.parametrize(("kind", "hint"), [
    ("deployment", "'Deployment'?"), ("tiny", "'Tiny'?"), ("rayCluster", "'RayCluster'?"),
    ("_Tiny", ""), ("9Tiny", ""),
])
def test_a_kind_not_spelled_as_kubernetes_kinds_are_is_refused(kind: str, hint: str) -> None:
    """A root kind ``deployment`` was accepted and matched nothing (kinds are matched as
    the API spells them), silently: refused at load, naming the CamelCase spelling."""
    obj = base()
    obj["spec"]["structureDefinition"]["rootComponent"]["kind"]["kind"] = kind
    err = error_of(obj)
    assert err.path == "spec.structureDefinition.rootComponent.kind.kind"
    assert err.reason.startswith(f"not a Kubernetes kind: {kind!r}")
    assert err.reason.endswith(f"{hint})" if hint else f"{kind!r}")


def test_user_beats_builtin_without_error() -> None:
    user = make("zzz-user")
    builtin = make("aaa-builtin", builtin=True, source="builtin:aaa-builtin")
    winners, errors = select_descriptions([builtin, user])
    assert winners == {GroupKind("example.com", "Tiny"): user}
    assert errors == []


def test_user_resource_interface_beats_builtin_karta() -> None:
    user = make("ri", form="ResourceInterface")
    builtin = make("b", builtin=True)
    winners, errors = select_descriptions([builtin, user])
    assert winners[user.group_kind] is user and errors == []


def test_karta_beats_resource_interface() -> None:
    ri = make("aaa", form="ResourceInterface")
    karta = make("zzz")
    winners, errors = select_descriptions([ri, karta])
    assert winners[karta.group_kind] is karta
    assert len(errors) == 1
    err = errors[0]
    assert (err.source, err.name, err.path) == ("aaa.yaml", "aaa", f"{ROOT}.kind")
    assert err.reason == (
        "another description of Tiny.example.com wins: 'zzz' from zzz.yaml "
        "(the Karta form beats ResourceInterface)"
    )


def test_name_sorting_first_wins_whatever_the_version() -> None:
    b = make("b", version="v2")
    a = make("a", version="v1beta1")
    c = make("c")
    winners, errors = select_descriptions([b, c, a])
    assert winners == {GroupKind("example.com", "Tiny"): a}
    assert [(e.name, e.reason.endswith("(the name sorting first wins)")) for e in errors] == [
        ("b", True),
        ("c", True),
    ]


def test_same_name_twice() -> None:
    a1 = make("a", source="x/a.yaml")
    a2 = make("a", source="y/a.yaml")
    winners, errors = select_descriptions([a2, a1])
    assert winners[a1.group_kind] is a1
    assert [e.source for e in errors] == ["y/a.yaml"]


def test_two_builtins_for_one_kind_is_reported() -> None:
    a = make("a", builtin=True)
    b = make("b", builtin=True)
    winners, errors = select_descriptions([a, b])
    assert winners[a.group_kind] is a and [e.name for e in errors] == ["b"]


def test_different_kinds_all_win() -> None:
    a = make("a", kind="One")
    b = make("b", kind="Two")
    winners, errors = select_descriptions([a, b])
    assert set(winners.values()) == {a, b} and errors == []


# -- jq that could stop the engine ------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "banned"),
    [
        ("def f: f; f", "def"),
        (".spec | recurse(.a)", "recurse"),
        ("[range(0; 1e18)] | length", "range"),
        ("repeat(.)", "repeat"),
        ("env.HOME", "env"),
        ("$ENV.AWS_SECRET_ACCESS_KEY", "$ENV"),
        ('"id-\\(env.HOME)"', "env"),
        ('"a\\("(")")b\\(input)"', "input"),
        ("halt_error", "halt_error"),
        # an audit's bypasses of the names above: a loop over a string's code points
        # stalled the engine ~7 s per object event, a state doubled per step made libjq
        # abort the process (out of memory)
        ('reduce ("x" | .[]?) as $x (0; .+1)', "reduce"),
        ('reduce (.a[]) as $x ("ab"; .+.)', "reduce"),
        ("foreach .a[] as $x (0; .+1)", "foreach"),
        ('.metadata.name | explode | length', "explode"),
        ("[65] | implode", "implode"),
        ('.metadata.annotations["x"] | fromjson', "fromjson"),
        ("[paths] | length", "paths"),
        ("[leaf_paths] | length", "leaf_paths"),
        ("[path(..)] | length", "path"),
        ("[tostream] | length", "tostream"),
        ('"x" * 10000000', "*"),
        ('.metadata.name * "x"', "*"),
        ('.a *= "x"', "*"),
        ('"id-\\("x" * 1e9)"', "*"),
        ('@text "x" * 1e9', "*"),
    ],
)
def test_jq_that_may_not_end_or_reads_outside_is_refused(expression: str, banned: str) -> None:
    obj = base()
    child(obj, 0)["scaleDefinition"] = {"replicasPath": expression}
    err = error_of(obj)
    assert err.path == f"{CHILDREN}[0].scaleDefinition.replicasPath"
    assert err.reason.startswith(f"jq {banned!r} is not allowed in descriptions (")


@pytest.mark.parametrize(
    "expression",
    [
        ".spec.range",
        '.metadata.labels["range"]',
        '.a | select(.type == "while") | .b',
        ".x # env is only a comment\n| .y",
        ".a as $range | $range",
        "[..] | length",
        "limit(1; .spec.workerGroupSpecs[]?.groupName)",
        '"\\(.a)-\\(.b)"',
        # multiplication of numbers (the built-in CronJob's, the LeaderWorkerSet sample's)
        "(.spec.replicas // 1) * ((.spec.leaderWorkerTemplate.size // 1) - 1)",
        ".spec.replicas * 2",
        '.metadata.labels["a*b"] // "*"',
        ".spec.reduce.paths",
        '.a | tojson | length',
        'getpath(["spec", "replicas"])',
    ],
)
def test_harmless_names_are_allowed(expression: str) -> None:
    obj = base()
    child(obj, 0)["scaleDefinition"] = {"replicasPath": expression}
    assert parse_description(obj, "test.yaml").children[0].scale is not None


# -- parse never fails other than with DescriptionError ---------------------------------------

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.sampled_from([".a", ".[", "root", "a", "b", "Running", ""])
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, (*prefix, i)))
    return out


BASE_PATHS = _paths(base())[1:]


@settings(max_examples=200, deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(BASE_PATHS), json_like | st.just(_DELETE)), min_size=1, max_size=3
    )
)
def test_parse_only_raises_description_error(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    obj = base()
    for path, value in edits:
        parent: Any = obj
        try:
            for key in path[:-1]:
                parent = parent[key]
            if value is _DELETE:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed this path
    try:
        d = parse_description(obj, "fuzz.yaml")
    except DescriptionError as err:
        assert err.source == "fuzz.yaml" and err.reason
        assert "\n" not in str(err)
    else:
        names = [d.root.name, *(c.name for c in d.children)]
        assert len(set(names)) == len(names)
        assert all(c.pod_bearing for c in d.pod_components)


def test_odd_keys_stay_on_one_line() -> None:
    obj = base()
    root(obj)["statusDefinition"]["statusMappings"]["\n"] = []
    err = error_of(obj)
    assert err.path == f'{ROOT}.statusDefinition.statusMappings["\\n"]'
    assert "\n" not in str(err)


def test_names_and_kinds_are_plain_tokens() -> None:
    obj = base()
    obj["metadata"]["name"] = "two\nlines"
    err = error_of(obj)
    assert (err.name, err.path) == ("karta-tiny.example.com", "metadata.name")
    assert err.reason == "must be a name without spaces, got 'two\\nlines'"
    obj = base()
    obj["metadata"]["name"] = 7
    assert error_of(obj).path == "metadata.name"
    for field, value in (("kind", "My Kind"), ("group", "Example.COM"), ("version", "v 1")):
        obj = base()
        root(obj)["kind"][field] = value
        err = error_of(obj)
        assert err.path == f"{ROOT}.kind.{field}", field
    obj = base()
    obj["metadata"] = {}
    root(obj)["kind"]["kind"] = "a\nb"
    err = error_of(obj)
    assert (err.name, err.path) == ("", f"{ROOT}.kind.kind")


def test_an_error_carries_the_raw_root_kind_of_a_description_object() -> None:
    """What the engine marks as described by an invalid description, from every source:
    the root kind as written, when the object is a description at all."""
    bad = karta("broken", component("x", "example.com", "Widget",
                                    statusDefinition={"phaseDefinition": {"path": ".a | ]["}}))
    with pytest.raises(DescriptionError) as err:
        parse_description(bad, "test")
    assert err.value.kind == GroupKind("example.com", "Widget")
    core = karta("core", {"name": "x", "kind": {"group": None, "version": "v1", "kind": "Pod"},
                          "podSelector": 3})
    with pytest.raises(DescriptionError) as err:
        parse_description(core, "test")
    assert err.value.kind == GroupKind("", "Pod")
    with pytest.raises(DescriptionError) as err:
        parse_description({"apiVersion": "v1", "kind": "Pod", "spec": bad["spec"]}, "test")
    assert err.value.kind is None  # not a description: no kind of its own
    with pytest.raises(DescriptionError) as err:
        parse_description(karta("nokind", {"name": "x"}), "test")
    assert err.value.kind is None
