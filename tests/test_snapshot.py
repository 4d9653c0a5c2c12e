"""The snapshot source: every accepted format, bad input reported, reloads, the demo cluster."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import snapshot
from proxy.index import PodIndex
from proxy.karta.description import parse_description
from proxy.karta.engine import Engine
from proxy.karta.model import GroupKind
from proxy.object_files import ObjectStub, SnapshotError, derived_uid
from proxy.snapshot import SnapshotSource, load_snapshot, read_snapshot
from tests.karta.descriptions import TRAINER_KARTA, component, karta
from tests.karta.engine_bugs import fail_on_pod
from tests.loop_turns import LoopTurns
from tests.process import stop
from tests.unreadable import unprivileged, unreadable

DEMO = Path(__file__).resolve().parents[1] / "proxy" / "demo_data" / "snapshot.yaml"


def _deployment() -> list[dict[str, Any]]:
    """A Deployment, its ReplicaSet and one pod, as the API serves them."""
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "api", "namespace": "shop", "uid": "d-1"},
            "spec": {"replicas": 1},
            "status": {"replicas": 1, "availableReplicas": 1, "readyReplicas": 1},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": "api-5f6d",
                "namespace": "shop",
                "uid": "rs-1",
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "Deployment", "name": "api",
                     "uid": "d-1", "controller": True},
                ],
            },
        },
        _pod("api-5f6d-x1", "p-1", ("ReplicaSet", "api-5f6d", "rs-1")),
    ]  # fmt: skip


def _pod(name: str, uid: str | None, owner: tuple[str, str, str | None] | None) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": "shop"}
    if uid:
        md["uid"] = uid
    if owner:
        kind, oname, ouid = owner
        ref: dict[str, Any] = {"apiVersion": "apps/v1", "kind": kind, "name": oname,
                               "controller": True}  # fmt: skip
        if ouid:
            ref["uid"] = ouid
        md["ownerReferences"] = [ref]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": {"containers": []}}


def _workload_of(index: PodIndex, pod: str, ns: str = "shop") -> str | None:
    pairs = index.lookup(ns.encode(), pod.encode())
    return dict(pairs).get("karta_workload") if pairs else None


def _load(path: Path) -> tuple[Engine, PodIndex, Any]:
    engine = Engine()
    index = PodIndex()
    report = load_snapshot(path, engine)
    index.apply(report.changes)
    return engine, index, report


def test_multi_document_yaml(tmp_path: Path) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump_all(_deployment()) + "---\n")  # trailing empty document
    _, index, report = _load(f)
    assert report.ok, report.problems()
    assert report.objects == {"Deployment": 1, "ReplicaSet": 1, "Pod": 1}
    assert _workload_of(index, "api-5f6d-x1") == "api"
    assert report.pods_attributed == 1


def test_kubectl_list_yaml(tmp_path: Path) -> None:
    f = tmp_path / "all.yml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": _deployment(),
                                 "metadata": {"resourceVersion": ""}}))  # fmt: skip
    _, index, report = _load(f)
    assert report.ok, report.problems()
    assert _workload_of(index, "api-5f6d-x1") == "api"


def test_typed_list_items_take_the_list_kind(tmp_path: Path) -> None:
    """``GET /api/v1/pods`` answers a PodList whose items carry no kind or apiVersion."""
    objs = _deployment()
    pod = {k: v for k, v in objs[2].items() if k not in ("kind", "apiVersion")}
    f = tmp_path / "pods.json"
    f.write_text(json.dumps({"apiVersion": "v1", "kind": "PodList", "items": [pod]}))
    owners = tmp_path / "owners.json"
    owners.write_text(json.dumps(objs[:2]))  # a JSON array
    _, index, report = _load(tmp_path)
    assert report.ok, report.problems()
    assert report.objects["Pod"] == 1
    assert _workload_of(index, "api-5f6d-x1") == "api"


def test_json_object_list_and_array(tmp_path: Path) -> None:
    d, rs, pod = _deployment()
    (tmp_path / "a.json").write_text(json.dumps(d))
    (tmp_path / "b.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List",
                                                 "items": [rs]}))  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps([pod]))
    _, index, report = _load(tmp_path)
    assert report.ok, report.problems()
    assert len(report.files) == 3
    assert _workload_of(index, "api-5f6d-x1") == "api"


def test_folder_recursive_sorted_and_foreign_files_reported(tmp_path: Path) -> None:
    d, rs, pod = _deployment()
    (tmp_path / "owners").mkdir()
    (tmp_path / "owners" / "deploy.yaml").write_text(yaml.safe_dump_all([d, rs]))
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump(pod))
    (tmp_path / "README.md").write_text("not a snapshot")
    (tmp_path / ".hidden.yaml.swp").write_text("editor junk")
    _, index, report = _load(tmp_path)
    assert [Path(f).name for f in report.files] == ["deploy.yaml", "pods.yaml"]
    assert [Path(s.path).name for s in report.skipped] == ["README.md"]
    assert _workload_of(index, "api-5f6d-x1") == "api"


def test_bad_files_reported_and_the_rest_loaded(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(yaml.safe_dump_all(_deployment()))
    (tmp_path / "broken.yaml").write_text("kind: Pod\nmetadata: {name: [unclosed\n")
    (tmp_path / "broken.json").write_text('{"kind": "Pod",')
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "scalars.yaml").write_text("just a string\n---\n42\n")
    (tmp_path / "partial.yaml").write_text(
        yaml.safe_dump_all([{"kind": "Pod"}, {"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"namespace": "x"}}, _pod("solo", "p-9", None)])
    )  # fmt: skip
    _, index, report = _load(tmp_path)
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert reasons["broken.yaml"].startswith("invalid YAML: line 3, column 1")
    assert reasons["broken.json"].startswith("invalid JSON")
    assert "UTF-8" in reasons["binary.yaml"]
    assert "no Kubernetes objects" in reasons["scalars.yaml"]
    assert len(report.invalid_objects) == 2
    assert any("apiVersion and kind are required" in s for s in report.invalid_objects)
    assert any("without metadata.name" in s for s in report.invalid_objects)
    assert not report.ok
    assert _workload_of(index, "api-5f6d-x1") == "api"
    assert _workload_of(index, "solo") == "solo"  # a bare pod is its own workload


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no such file or folder"):
        load_snapshot(tmp_path / "nope.yaml", Engine())


def test_text_that_is_not_unicode_skips_its_object(tmp_path: Path) -> None:
    """A lone surrogate (JSON's "\\ud800" escape, which the API server decodes as U+FFFD;
    the YAML reader refuses the file) in a field the proxy makes bytes of: a namespace
    with one raised UnicodeEncodeError out of the index (a traceback that ended the
    start), an owner's kind a 500 on the attribution page."""
    bad = "x\ud800"
    pods = [_pod("ns", "p-1", None), _pod("label", "p-2", None), _pod("owner", "p-3", None),
            _pod("kind", "p-4", None), _pod("solo", "p-5", None)]
    pods[0]["metadata"]["namespace"] = bad
    pods[1]["metadata"]["labels"] = {"app": bad}
    pods[2]["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": bad, "name": "o", "uid": "o-1", "controller": True}]
    pods[3]["kind"] = bad
    (tmp_path / "pods.json").write_text(json.dumps({"kind": "List", "items": pods}))
    _, index, report = _load(tmp_path)
    lone = sorted(m[1] for s in report.invalid_objects
                  if (m := re.search(r": ([\w.\[\]]+): not Unicode text: a lone ", s)))
    assert lone == ["kind", "metadata.labels.app", "metadata.namespace",
                    "metadata.ownerReferences[0].kind"], \
        report.invalid_objects
    assert all("not Unicode text: a lone surrogate (\\ud800) at character" in s
               for s in report.invalid_objects)
    assert _workload_of(index, "solo") == "solo"


def test_descriptions_in_a_snapshot_and_invalid_ones_skipped(tmp_path: Path) -> None:
    crd_obj = {
        "apiVersion": "example.com/v1", "kind": "Trainer",
        "metadata": {"name": "t1", "namespace": "shop", "uid": "t-1"},
        "status": {"state": "Training"},
    }  # fmt: skip
    desc = karta("trainer", component(
        "trainer", "example.com", "Trainer",
        statusDefinition={"phaseDefinition": {"path": ".status.state"},
                          "statusMappings": {"running": [{"byPhase": "Training"}]}},
    ), [{"name": "worker", "ownerRef": "trainer",
         "specDefinition": {"podTemplateSpecPath": ".spec.template"}}])  # fmt: skip
    bad = karta("broken", component(
        "x", "example.com", "Other",
        statusDefinition={"phaseDefinition": {"path": ".status | ]["}}))  # fmt: skip
    pod = _pod("t1-worker-0", "tp-1", None)
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "example.com/v1", "kind": "Trainer", "name": "t1", "uid": "t-1",
         "controller": True}
    ]  # fmt: skip
    f = tmp_path / "snap.yaml"
    f.write_text(yaml.safe_dump_all([desc, bad, crd_obj, pod]))
    engine, index, report = _load(f)
    assert report.objects["Karta"] == 1
    assert [e.name for e in report.description_errors] == ["broken"]
    assert "document 2" in report.description_errors[0].path
    assert any(e.name == "broken" for e in engine.description_errors)
    pairs = dict(index.lookup(b"shop", b"t1-worker-0") or ())
    assert pairs["karta_workload"] == "t1"
    assert pairs["karta_kind"] == "Trainer"
    assert pairs["karta_component"] == "worker"
    phases = {w.ref.name: w.phase for w in engine.workloads()}
    assert phases["t1"] == "Running"


def test_a_description_another_wins_over_is_a_problem_of_the_report(tmp_path: Path) -> None:
    """Two descriptions of one kind in a snapshot: the loser is not in force, and the
    report says so (it was reported nowhere: docs/karta.md says every loser is)."""
    def trainer(name: str) -> dict[str, Any]:
        return karta(name, component("trainer", "example.com", "Trainer"))

    (tmp_path / "a.yaml").write_text(yaml.safe_dump(trainer("aaa")))
    (tmp_path / "z.yaml").write_text(yaml.safe_dump(trainer("zzz")))
    engine, _, report = _load(tmp_path)
    assert engine.descriptions()[GroupKind("example.com", "Trainer")].name == "aaa"
    assert [e.name for e in report.description_losers] == ["zzz"]
    assert not report.ok
    [problem] = report.problems()
    assert problem.startswith("description not in force: ")
    assert "z.yaml (zzz)" in problem and "'aaa' from" in problem
    # a user description of a kind the built-ins describe replaces one: no problem
    (tmp_path / "z.yaml").write_text(yaml.safe_dump(
        karta("mine", component("d", "apps", "Deployment"))))
    _, _, report = _load(tmp_path)
    assert report.ok and report.problems() == []


def test_missing_uids_are_derived_and_owner_chains_still_connect(tmp_path: Path) -> None:
    objs = _deployment()
    for o in objs:
        del o["metadata"]["uid"]
        for ref in o["metadata"].get("ownerReferences", []):
            del ref["uid"]
    f = tmp_path / "hand-written.yaml"
    f.write_text(yaml.safe_dump_all(objs))
    engine, index, report = _load(f)
    assert report.uids_derived == 5  # three objects, two owner references
    assert _workload_of(index, "api-5f6d-x1") == "api"
    uid = derived_uid("v1", "Pod", "shop", "api-5f6d-x1")
    att = engine.pod(uid)
    assert att is not None and att.workload is not None
    assert att.workload.uid == derived_uid("apps/v1", "Deployment", "shop", "api")


def test_derived_uids_tell_api_groups_apart(tmp_path: Path) -> None:
    # a Knative-like Service and a core Service of one name, neither with a uid: they
    # were one object ("Service 1"), the core one replacing the other, and the pod went
    # to the wrong workload
    desc = karta("svc", component("svc", "example.com", "Service",
                                  specDefinition={"podTemplateSpecPath": ".spec.template"}))
    custom = {"apiVersion": "example.com/v1", "kind": "Service",
              "metadata": {"name": "hello", "namespace": "shop"}}
    core = {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "hello", "namespace": "shop"}}
    pod = _pod("hello-x", None, None)
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "example.com/v1", "kind": "Service",
                                           "name": "hello", "controller": True}]
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump_all([desc, custom, pod, core]))
    engine, index, report = _load(f)
    assert report.objects["Service"] == 2 and report.uids_derived == 4
    pairs = dict(index.lookup(b"shop", b"hello-x") or ())
    assert (pairs["karta_workload"], pairs["karta_kind"]) == ("hello", "Service")
    (wl,) = [w for w in engine.workloads() if w.ref.name == "hello"]
    assert wl.ref.uid == derived_uid("example.com/v1", "Service", "shop", "hello")
    assert wl.ref.uid != derived_uid("v1", "Service", "shop", "hello")


def test_a_reference_to_a_cluster_scoped_owner_derives_without_the_namespace(
    tmp_path: Path,
) -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}
    pod = _pod("static-n1", None, None)
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "n1",
                                           "controller": True}]
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump_all([node, pod]))
    objs = read_snapshot(f).objects()
    uid = derived_uid("v1", "Node", "", "n1")
    assert uid in objs
    (p,) = [o for o in objs.values() if isinstance(o, dict) and o["kind"] == "Pod"]
    assert p["metadata"]["ownerReferences"][0]["uid"] == uid


def test_input_objects_are_not_mutated(tmp_path: Path) -> None:
    objs = _deployment()
    del objs[2]["metadata"]["uid"]
    before = json.dumps(objs, sort_keys=True)
    content = read_snapshot(_write(tmp_path / "s.yaml", objs))
    assert content.files and json.dumps(objs, sort_keys=True) == before


def _write(path: Path, objs: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(objs))
    return path


async def test_source_start_marks_ready_and_fresh(tmp_path: Path) -> None:
    index = PodIndex()
    src = SnapshotSource(_write(tmp_path / "s.yaml", _deployment()), Engine(), index)
    assert not index.ready
    await src.start()
    try:
        assert index.ready
        assert "snapshot" in index.freshness
        assert _workload_of(index, "api-5f6d-x1") == "api"
        assert src.report is not None and src.report.ok
        # the loaded state is out of the cyclic collector's walk (memory.collect_and_freeze)
        assert not any(o is index.pods for o in gc.get_objects())
    finally:
        await src.stop()
        gc.unfreeze()


async def test_source_with_nothing_loadable_fails_to_start(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("{{{{")
    src = SnapshotSource(tmp_path, Engine(), PodIndex())
    with pytest.raises(SnapshotError, match=r"nothing could be loaded.*broken\.yaml"):
        await src.start()


async def test_reload_applies_additions_changes_and_deletions(tmp_path: Path) -> None:
    index = PodIndex()
    f = _write(tmp_path / "s.yaml", _deployment())
    src = SnapshotSource(f, Engine(), index, reload_seconds=0.2)
    await src.start()
    try:
        objs = _deployment()
        objs.append(_pod("late", "p-2", None))  # a new bare pod
        objs[2]["metadata"]["labels"] = {"changed": "yes"}
        _write(f, objs)
        os.utime(f, ns=(1, 1))  # a different mtime whatever the clock resolution
        await _until(lambda: _workload_of(index, "late") == "late")
        assert _workload_of(index, "api-5f6d-x1") == "api"
        # the pod goes away: a tombstone keeps its labels, the engine forgets it
        _write(f, _deployment()[:2])
        os.utime(f, ns=(2, 2))
        await _until(lambda: src.reloads >= 2)
        assert src.engine.pod("p-1") is None
        assert index.tombstones() == 2
    finally:
        await src.stop()


async def test_reload_keeps_the_objects_of_a_file_that_no_longer_parses(tmp_path: Path) -> None:
    index = PodIndex()
    f = _write(tmp_path / "s.yaml", _deployment())
    src = SnapshotSource(tmp_path, Engine(), index)
    await src.start()
    f.write_text("kind: Pod\nmetadata: {name: [half-saved\n")
    report = await src.reload()
    assert [Path(s.path).name for s in report.skipped] == ["s.yaml"]
    assert src.engine.pod("p-1") is not None
    assert _workload_of(index, "api-5f6d-x1") == "api"
    assert index.tombstones() == 0


@pytest.mark.parametrize("content", [
    "",  # `kubectl get ... -o yaml > s.yaml` empties the file before kubectl writes
    "# saved by hand\n---\n",
    # half a pod: `spec: nodeName` cut from its value made the reader raise a TypeError
    "apiVersion: v1\nkind: Pod\nmetadata: {name: p-1, namespace: shop, ownerReferences: "
    "[{apiVersion: apps/v1, kind: ReplicaSet, name: rs, uid: rs1, controller: true}]}\n"
    "spec: nodeName\n",
])
async def test_reload_keeps_the_objects_of_a_file_emptied_or_cut(
        tmp_path: Path, content: str) -> None:
    index = PodIndex()
    f = _write(tmp_path / "s.yaml", _deployment())
    src = SnapshotSource(tmp_path, Engine(), index)
    await src.start()
    f.write_text(content)
    report = await src.reload()
    assert [Path(s.path).name for s in report.skipped] == ["s.yaml"], report
    assert src.engine.pod("p-1") is not None
    assert _workload_of(index, "api-5f6d-x1") == "api"
    assert index.tombstones() == 0


# -- a path that cannot be read, and files caught mid-save ---------------------------------


def _attributions(engine: Engine) -> dict[str, tuple[str, str]]:
    """namespace/pod -> (kind, name) of its workload ("" for none)."""
    return {f"{a.namespace}/{a.pod}": (a.workload.kind if a.workload else "",
                                       a.workload.name if a.workload else "")
            for a in engine.pods()}


def _demo_copy(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "cluster.yaml"
    path.write_text(DEMO.read_text())
    return path


async def test_a_snapshot_folder_gone_for_a_reload_keeps_every_object(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder moved away: its files are not deletions (every pod was, and tombstoned),
    one warning however many reloads, one info line once it is back."""
    caplog.set_level(logging.INFO, "karta.snapshot")
    _demo_copy(tmp_path / "snap")
    index = PodIndex()
    src = SnapshotSource(tmp_path / "snap", Engine(), index)
    await src.start()
    before = _attributions(src.engine)
    (tmp_path / "snap").rename(tmp_path / "away")
    for _ in range(3):
        report = await src.reload()
        assert [s.path for s in report.skipped] == [str(tmp_path / "snap")]
        assert not report.changes
    assert _attributions(src.engine) == before
    assert index.tombstones() == 0 and len(index) == 15
    assert caplog.text.count("the path cannot be read") == 1
    assert index.stale  # karta_proxy_index_stale 1: the source is cut off
    (tmp_path / "away").rename(tmp_path / "snap")
    report = await src.reload()
    assert report.ok and not report.changes and report.pods_attributed == 15
    assert caplog.text.count("the path can be read again") == 1
    assert index.tombstones() == 0 and not index.stale


async def test_a_relative_snapshot_file_gone_for_a_reload_keeps_every_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--snapshot ./snapg/cluster.yaml`` removed and written again: the path given and
    the file's key were two spellings (``./snapg/...``, ``snapg/...``), and the file's
    objects, looked up by the first, were all deleted."""
    monkeypatch.chdir(tmp_path)
    path = _demo_copy(tmp_path / "snapg")
    index = PodIndex()
    src = SnapshotSource("./snapg/cluster.yaml", Engine(), index)
    await src.start()
    before = _attributions(src.engine)
    path.unlink()
    await src.reload()
    assert _attributions(src.engine) == before and index.tombstones() == 0
    path.write_text(DEMO.read_text())
    assert not (await src.reload()).changes
    assert index.tombstones() == 0


async def test_a_folder_that_cannot_be_listed_keeps_every_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Walked without read permission a folder reads as empty (``rglob`` says nothing):
    every object in it was deleted."""
    folder = tmp_path / "snap"
    _demo_copy(folder)
    index = PodIndex()
    src = SnapshotSource(folder, Engine(), index)
    await src.start()
    scandir = os.scandir

    def refused(p: Any) -> Any:
        if Path(p) == folder:
            raise PermissionError(13, "Permission denied", str(p))
        return scandir(p)

    monkeypatch.setattr(os, "scandir", refused)
    report = await src.reload()
    assert [s.reason for s in report.skipped] == [
        f"snapshot {folder}: cannot read the folder: Permission denied"]
    assert index.tombstones() == 0 and len(index) == 15


def _split_demo(folder: Path) -> Path:
    """The demo snapshot as a folder: its pods in ``pods/``, the rest at the top; the
    subfolder returned."""
    docs = list(yaml.safe_load_all(DEMO.read_text()))
    sub = folder / "pods"
    sub.mkdir(parents=True)
    (folder / "owners.yaml").write_text(yaml.safe_dump_all(
        [d for d in docs if d and d.get("kind") != "Pod"]))
    (sub / "pods.yaml").write_text(yaml.safe_dump_all(
        [d for d in docs if d and d.get("kind") == "Pod"]))
    return sub


def test_a_subfolder_that_cannot_be_listed_is_an_error_not_an_empty_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rglob`` skipped a subfolder it could not list without a word: its files read
    as removed. It is an error naming that folder, as the path's own folder is; a hidden
    one is not read at all, so it is none."""
    sub = _split_demo(tmp_path / "snap")
    (tmp_path / "snap" / ".old").mkdir()
    every = read_snapshot(DEMO).objects().keys()
    assert read_snapshot(tmp_path / "snap").objects().keys() == every
    why = f"snapshot {tmp_path / 'snap'}: cannot read the folder {sub}: Permission denied"
    with unreadable(sub, monkeypatch), pytest.raises(SnapshotError, match=re.escape(why)):
        read_snapshot(tmp_path / "snap")
    with unreadable(tmp_path / "snap" / ".old", monkeypatch):
        assert read_snapshot(tmp_path / "snap").objects().keys() == every


async def test_a_subfolder_that_cannot_be_listed_keeps_every_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the poller's own steps: the 16 pods of an unlistable ``pods/`` were
    deleted (tombstoned, the index fresh); now every object is kept, the index is stale
    and not fresh, and it is counted once, until the folder can be read again."""
    sub = _split_demo(tmp_path / "snap")
    index = PodIndex()
    src = SnapshotSource(tmp_path / "snap", Engine(), index)
    await src.start()
    before = _attributions(src.engine)
    assert len(before) == 16
    fresh = index.freshness["snapshot"]
    with unreadable(sub, monkeypatch):
        for _ in range(3):
            assert not await src.poll()
        assert index.stale and index.freshness["snapshot"] == fresh
        assert _attributions(src.engine) == before and index.tombstones() == 0
        assert _unapplied(src, "path_unreadable") == 1
        report = await src.reload()  # an explicit reload reads nothing either
        assert [s.reason for s in report.skipped] == [
            f"snapshot {tmp_path / 'snap'}: cannot read the folder {sub}: Permission denied"]
    assert not await src.poll()
    assert not index.stale and index.freshness["snapshot"] > fresh
    assert _attributions(src.engine) == before and index.tombstones() == 0
    assert src.reloads == 0


async def test_a_subfolder_that_cannot_be_listed_in_the_real_process(
        tmp_path: Path) -> None:
    """The real ``karta-proxy`` on a snapshot folder whose ``pods/`` its permissions
    deny it (root: started without CAP_DAC_READ_SEARCH): every pod kept, the index
    stale, the warning logged; it was read as empty (16 pods tombstoned, the index not
    stale)."""
    import sys

    import aiohttp

    from tests.peers.conftest import free_port
    from tests.scripted import ScriptedUpstream

    prefix = unprivileged()
    sub = _split_demo(tmp_path / "snap")
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    async def metrics(session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(base + "/metrics") as r:
            text = await r.text()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r"^(karta_proxy_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    async def until(session: aiohttp.ClientSession, check: Any, what: str) -> dict[str, float]:
        for _ in range(150):
            with contextlib.suppress(aiohttp.ClientError):
                got = await metrics(session)
                if check(got):
                    return got
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    unreadable_count = 'karta_proxy_snapshot_changes_unapplied_total{reason="path_unreadable"}'
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "proxy", "--snapshot", str(tmp_path / "snap"),
            "--snapshot-reload-seconds", "0.2", "--no-facts", "--upstream-url", up.url,
            "--listen-address", f"127.0.0.1:{port}", "--log-format", "text",
            cwd=Path(__file__).resolve().parents[1],
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            first = await until(session, lambda m: m.get("karta_proxy_index_ready") == 1,
                                "the process ready")
            assert first["karta_proxy_index_pods"] == 15
            sub.chmod(0)
            try:
                gone = await until(session, lambda m: m["karta_proxy_index_stale"] == 1
                                   or m["karta_proxy_index_tombstones"] > 0,
                                   "the poll that finds pods/ unreadable")
                await asyncio.sleep(0.5)  # more polls: still nothing deleted
                gone = await metrics(session)
                assert gone["karta_proxy_index_tombstones"] == 0
                assert gone["karta_proxy_index_stale"] == 1
                assert gone[unreadable_count] == 1
            finally:
                sub.chmod(0o755)
            back = await until(session, lambda m: m["karta_proxy_index_stale"] == 0,
                               "the folder readable again")
            assert back["karta_proxy_index_tombstones"] == 0
            assert back["karta_proxy_index_pods"] == 15
        finally:
            log = await stop(proc)
    assert proc.returncode == 0, log[-2000:]
    assert log.count("snapshot: the path cannot be read") == 1, log[-3000:]
    assert f"cannot read the folder {sub}: Permission denied" in log
    assert "snapshot: the path can be read again" in log


async def test_the_snapshot_is_not_fresh_while_its_path_is_gone(tmp_path: Path) -> None:
    """Through the poller: the freshness of ``snapshot`` stops while the folder is away
    (it advanced at every poll, the empty path "unchanged"), so ``KartaIndexStale`` can
    fire, and advances again once it is back; no pod is lost."""
    _demo_copy(tmp_path / "snap")
    index = PodIndex()
    src = SnapshotSource(tmp_path / "snap", Engine(), index, reload_seconds=0.2)
    await src.start()
    try:
        (tmp_path / "snap").rename(tmp_path / "away")
        await asyncio.sleep(0.3)  # the poll that finds it gone, and the one in flight
        gone = index.freshness["snapshot"]
        await asyncio.sleep(1.0)
        assert index.freshness["snapshot"] == gone and index.stale
        assert index.tombstones() == 0 and len(index) == 15
        (tmp_path / "away").rename(tmp_path / "snap")
        await _until(lambda: index.freshness["snapshot"] > gone)
        assert index.tombstones() == 0 and src.reloads == 0 and not index.stale
    finally:
        await src.stop()


@dataclass
class Polled:
    """A source started on one Deployment's file and polled by hand, and that file's
    text with one more bare pod, ``late``, to write in."""
    file: Path
    index: PodIndex
    source: SnapshotSource
    with_late: str


async def _polled(tmp_path: Path) -> Polled:
    f = _write(tmp_path / "s.yaml", _deployment())
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    objs = _deployment()
    objs.append(_pod("late", "p-2", None))
    return Polled(f, index, src, yaml.safe_dump_all(objs))


async def test_a_change_is_read_once_two_polls_find_the_files_alike(tmp_path: Path) -> None:
    p = await _polled(tmp_path)
    f, index, src = p.file, p.index, p.source
    fresh = index.freshness["snapshot"]
    assert not await src.poll()
    assert index.freshness["snapshot"] > fresh  # unchanged: current
    f.write_text(p.with_late)
    os.utime(f, ns=(1, 1))
    fresh = index.freshness["snapshot"]
    assert not await src.poll()  # changed since the last poll: maybe still being written
    assert _workload_of(index, "late") is None and index.freshness["snapshot"] == fresh
    assert await src.poll()  # alike at two polls: read
    assert _workload_of(index, "late") == "late" and src.reloads == 1
    assert index.freshness["snapshot"] > fresh


def _unapplied(src: SnapshotSource, reason: str) -> float | None:
    return src.registry.get_sample_value(
        "karta_proxy_snapshot_changes_unapplied_total", {"reason": reason})


async def test_files_that_never_stop_changing_are_not_applied_and_said_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rewritten between every two polls, with other bytes each time: nothing is
    applied, and after ``UNSETTLED_WARN_POLLS`` polls one warning names the path and
    why, and the counter an alert reads counts it once."""
    f = _write(tmp_path / "s.yaml", _deployment())
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    fresh = index.freshness["snapshot"]
    assert _unapplied(src, "files_keep_changing") == 0
    for n in range(2 * snapshot.UNSETTLED_WARN_POLLS):
        objs = _deployment()
        objs[0]["spec"]["replicas"] = n + 2  # rewritten between every two polls
        _write(f, objs)
        os.utime(f, ns=(n + 1, n + 1))
        assert not await src.poll()
    assert src.reloads == 0 and index.freshness["snapshot"] == fresh
    (warned,) = [r for r in caplog.records if "the files keep changing" in r.getMessage()]
    assert warned.levelname == "WARNING"
    assert warned.__dict__["snapshot"] == str(f)
    assert warned.__dict__["reason"] == "no two polls in a row found them alike"
    assert warned.__dict__["polls"] == snapshot.UNSETTLED_WARN_POLLS
    assert _unapplied(src, "files_keep_changing") == 1
    assert _unapplied(src, "path_unreadable") == 0


async def test_files_rewritten_with_the_same_bytes_at_every_poll_are_applied(
        tmp_path: Path) -> None:
    """A writer rewriting the same content more often than the polls (a new stamp at
    every poll): never applied, as no two polls found the stamps alike; now the bytes
    alike at two polls are, and once applied a rewrite of the applied bytes is no
    change (fresh, nothing read)."""
    p = await _polled(tmp_path)
    f, index, src, text = p.file, p.index, p.source, p.with_late
    applied_at = None
    for n in range(2 * snapshot.UNSETTLED_WARN_POLLS):
        f.write_text(text)  # the same bytes, saved again
        os.utime(f, ns=(n + 1, n + 1))
        if await src.poll():
            applied_at = applied_at or n + 1
    assert applied_at == 2  # the second poll that saw them
    assert _workload_of(index, "late") == "late" and src.reloads == 1
    fresh = index.freshness["snapshot"]
    f.write_text(text)
    os.utime(f, ns=(10**9, 10**9))
    assert not await src.poll()
    assert src.reloads == 1 and index.freshness["snapshot"] > fresh
    assert _unapplied(src, "files_keep_changing") == 0


async def test_a_rewrite_caught_by_the_read_is_not_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes alike at two polls, but the writer truncates and writes again while they
    are read: the read (the file cut after its first object) is dropped, not applied;
    read again between two rewrites, the file is applied whole."""
    p = await _polled(tmp_path)
    f, index, src, text = p.file, p.index, p.source, p.with_late
    read = snapshot.read_snapshot
    cut: list[int] = []

    def rewritten_while_read(*args: Any, **kwargs: Any) -> Any:
        f.write_text(text[:text.index("---")])  # truncated, the first object written
        got = read(*args, **kwargs)
        cut.append(len(got.objects()))
        f.write_text(text)  # the rest: the same bytes as before, a new stamp
        return got

    monkeypatch.setattr(snapshot, "read_snapshot", rewritten_while_read)
    for n in range(4):
        f.write_text(text)
        os.utime(f, ns=(n + 1, n + 1))
        assert not await src.poll()
    assert cut == [1, 1, 1]  # the polls after the first read, and each read was cut
    assert src.engine.pod("p-1") is not None and src.reloads == 0
    assert _workload_of(index, "late") is None and index.tombstones() == 0
    monkeypatch.setattr(snapshot, "read_snapshot", read)
    for n in range(4, 6):
        f.write_text(text)
        os.utime(f, ns=(n + 1, n + 1))
        if await src.poll():
            break
    assert src.reloads == 1 and _workload_of(index, "late") == "late"
    assert _workload_of(index, "api-5f6d-x1") == "api" and index.tombstones() == 0


async def test_a_writer_rewriting_the_same_bytes_in_place_is_applied_whole(
        tmp_path: Path) -> None:
    """Through the poller: the demo snapshot and one more pod rewritten in place
    (truncated, then written) every 50 ms, polled every 0.2 s. It never settled by its
    stamps, so the new pod never came; now it does, and no poll applied a cut file."""
    path = _demo_copy(tmp_path / "snap")
    index = PodIndex()
    src = SnapshotSource(path, Engine(), index, reload_seconds=0.2)
    await src.start()
    before = _attributions(src.engine)
    text = DEMO.read_text() + "---\n" + yaml.safe_dump(_pod("late", "late-1", None))
    seen: list[dict[str, tuple[str, str]]] = []
    try:
        for _ in range(100):  # 5 s
            path.write_text(text)
            if src.reloads:
                break
            seen.append(_attributions(src.engine))
            await asyncio.sleep(0.05)
        assert src.reloads == 1
        after = {**before, "shop/late": ("Pod", "late")}
        assert _attributions(src.engine) == after
        # nothing cut applied: a state seen is the one before, or the whole file's (an
        # apply yields to the loop, and a loaded box saw it under way, not yet counted)
        assert seen and all(s in (before, after) for s in seen)
        assert index.tombstones() == 0
    finally:
        await src.stop()


async def test_a_write_during_the_read_drops_the_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alike at two polls, then written to while read: what was read is not applied,
    and is read again once the files stop changing."""
    f = _write(tmp_path / "s.yaml", _deployment())
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    _write(f, _deployment()[:2])  # the pod gone
    os.utime(f, ns=(1, 1))
    read = snapshot.read_snapshot

    def written_to_while_read(*args: Any, **kwargs: Any) -> Any:
        got = read(*args, **kwargs)
        os.utime(f, ns=(2, 2))  # the writer's next chunk
        return got

    assert not await src.poll()
    monkeypatch.setattr(snapshot, "read_snapshot", written_to_while_read)
    assert not await src.poll()
    assert src.engine.pod("p-1") is not None and src.reloads == 0
    monkeypatch.setattr(snapshot, "read_snapshot", read)
    assert await src.poll()
    assert src.engine.pod("p-1") is None and src.reloads == 1


def _cuts(lines: list[str]) -> list[int]:
    """Every line cut of a file but after a comment or a blank line (as the audit's scan
    counted them): within an object, or at a ``---``."""
    return [k for k in range(1, len(lines))
            if lines[k - 1].strip() and not lines[k - 1].lstrip().startswith("#")]


async def test_no_cut_of_a_file_being_written_is_applied(tmp_path: Path) -> None:
    """The demo snapshot saved in place, caught at every line: the first poll that sees a
    cut file does not read it; the writer's rest restores the file. Read at once, 689 of
    the 741 cuts were applied (the 24 at a ``---`` and 665 of the 717 within an object:
    the pods after the cut deleted, and in 60 a pod cut before its ``ownerReferences``
    stamped as a bare ``Pod``); the other 52 did not parse, and kept their objects."""
    path = _demo_copy(tmp_path / "snap")
    text = DEMO.read_text()
    lines = text.splitlines(keepends=True)
    full = path.stat()
    index = PodIndex()
    src = SnapshotSource(path, Engine(), index)
    await src.start()
    before = _attributions(src.engine)
    cuts = _cuts(lines)
    assert len(cuts) == 741
    applied = []
    for n, k in enumerate(cuts):
        path.write_text("".join(lines[:k]))
        os.utime(path, ns=(n + 1, n + 1))
        if await src.poll() or _attributions(src.engine) != before:
            applied.append(k)
        path.write_text(text)  # the rest: the file as it was
        os.utime(path, ns=(full.st_atime_ns, full.st_mtime_ns))
        assert not await src.poll()
    assert applied == [] and src.reloads == 0 and index.tombstones() == 0


async def test_a_file_saved_in_place_by_a_slow_writer_is_never_applied_half_written(
        tmp_path: Path) -> None:
    """Through the poller: the demo snapshot written in place in chunks 0.1 s apart,
    polled every 0.4 s. Read at every change, the poll caught the file cut (pods after
    the cut tombstoned); now only the whole file, once it stopped changing."""
    path = _demo_copy(tmp_path / "snap")
    lines = DEMO.read_text().splitlines(keepends=True)
    index = PodIndex()
    src = SnapshotSource(path, Engine(), index, reload_seconds=0.4)
    await src.start()
    before = _attributions(src.engine)
    seen: list[dict[str, tuple[str, str]]] = []
    try:
        with path.open("w") as f:
            for i in range(0, len(lines), len(lines) // 12):
                f.write("".join(lines[i:i + len(lines) // 12]))
                f.flush()
                seen.append(_attributions(src.engine))
                await asyncio.sleep(0.1)
        await _until(lambda: src.reloads >= 1)
        assert all(s == before for s in seen)
        assert src.reloads == 1
        assert _attributions(src.engine) == before and index.tombstones() == 0
    finally:
        await src.stop()


async def test_a_reload_leaves_no_cyclic_garbage(tmp_path: Path) -> None:
    """A reload freezes what it leaves (``freeze_survivors``) instead of collecting the
    whole heap (``settle``: ~0.55 s with the loop held at 37.5k pods). That is only
    sound while the objects a reload replaces hold no reference cycles: a cycle among
    frozen objects is never collected. Pods relabelled, a workload deleted, and the
    description changed, removed and put back."""
    demo = [d for d in yaml.safe_load_all(DEMO.read_text()) if d]

    def variant(change: Any) -> list[dict[str, Any]]:
        objs = json.loads(json.dumps(demo))
        return [o for o in objs if change(o) is not False]

    def relabel(o: dict[str, Any]) -> None:
        if o["kind"] == "Pod":
            o["metadata"].setdefault("labels", {})["rev"] = "1"

    first_pod = next(o["metadata"]["name"] for o in demo if o["kind"] == "Pod")
    variants = [
        variant(relabel),
        variant(lambda o: o["metadata"]["name"] != first_pod),
        variant(lambda o: o["kind"] != "Karta" or o["metadata"].update(labels={"rev": "1"})),
        variant(lambda o: o["kind"] != "Karta"),
        demo,
    ]
    f = _write(tmp_path / "s.yaml", demo)
    src = SnapshotSource(f, Engine(), PodIndex())
    # what earlier tests' sources froze alive and dropped since is no reload's garbage
    # (their first loads never unfreeze: a cycle frozen alive is only found unfrozen)
    gc.unfreeze()
    await src.start()
    gc.collect()
    gc.freeze()
    try:
        reports = []
        for objs in variants:
            _write(f, objs)
            reports.append(await src.reload())
        relabelled, one_pod_less, _, undescribed, back = reports
        assert src.report is not None
        assert one_pod_less.objects["Pod"] == relabelled.objects["Pod"] - 1
        assert undescribed.workloads != back.workloads and undescribed.changes
        assert back.changes
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        assert gc.garbage == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()


async def test_a_reload_does_not_freeze_the_garbage_it_finds(tmp_path: Path) -> None:
    """A reload freezes what is alive, process-wide: a reference cycle already garbage
    then (another part of the process' broken connection, its traceback) was frozen with
    it for good. The reload collects first."""
    from tests.garbage import collections_off, cycle

    demo = [d for d in yaml.safe_load_all(DEMO.read_text()) if d]
    src = SnapshotSource(_write(tmp_path / "s.yaml", demo), Engine(), PodIndex())
    await src.start()
    with collections_off():
        gone = cycle()
        await src.reload()
        alive = gone() is not None
    assert not alive, "the cycle was frozen with the reload's survivors"


async def test_a_reload_diffs_and_compacts_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diff and the compaction of a reload read every object (~0.6 s at 37.5k pods)
    and freeing the old contents is ~30 ms: the loop keeps its turns meanwhile. Each
    step is made to block until the loop has turned three times (5 s at most); the loop
    turns during it only if it runs in a worker thread. (Blocking a fixed 50 ms, a loaded
    machine could give the loop fewer turns in it.) Only the reload under watch blocks:
    the start and the reload after it have no loop counting turns, and each of their
    steps waited out the 5 s (20 s in all)."""

    import proxy.snapshot as snapshot

    loop = LoopTurns(0.001)
    during: dict[str, int] = {}
    watching = threading.Event()

    def blocking(name: str, step: Any) -> Any:
        def run(*args: Any) -> Any:
            if not watching.is_set():
                return step(*args)
            before = loop.turns
            deadline = time.monotonic() + 5
            while loop.turns - before < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            out = step(*args)
            during[name] = loop.turns - before
            return out
        return run

    monkeypatch.setattr(snapshot, "plan_content", blocking("plan", snapshot.plan_content))
    monkeypatch.setattr(snapshot, "_compact_releasing",
                        blocking("compact", snapshot._compact_releasing))
    f = _write(tmp_path / "s.yaml", _deployment())
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()

    try:
        async with loop:
            _write(f, [*_deployment(), _pod("late", "p-2", None)])
            watching.set()
            report = await src.reload()
            watching.clear()
    finally:
        gc.unfreeze()
    assert set(report.changes.pods) == {"p-2"} and _workload_of(index, "late") == "late"
    assert during["plan"] >= 3 and during["compact"] >= 3, during
    assert _workload_of(index, "api-5f6d-x1") == "api"
    again = await src.reload()  # the kept content is whole after the old ones' release
    assert not again.changes and again.objects == report.objects


def _deployment_of(pods: int, *, bare: bool = False) -> list[dict[str, Any]]:
    """``_deployment`` with ``pods`` pods; ``bare``: each without its owner, to change
    every pod's attribution (each is then a workload of its own)."""
    owner = None if bare else ("ReplicaSet", "api-5f6d", "rs-1")
    return _deployment()[:2] + [_pod(f"api-5f6d-{i}", f"p-{i}", owner) for i in range(pods)]


def _bare(engine: Engine, i: int) -> bool:
    """Whether the engine has pod ``i`` of ``_deployment_of`` as a bare pod now."""
    att = engine.pod(f"p-{i}")
    return att is not None and att.workload is not None and att.workload.kind == "Pod"


async def test_a_reload_applies_its_changes_in_runs_that_let_the_loop_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's share of a reload is on the event loop (15-27 ms in one go at 37.5k
    pods, 1% changed): in runs of ``LOOP_RUN_SECONDS``, with the loop let in between.
    Each object is made to cost 1 ms here, 100 ms in all."""
    f = _write(tmp_path / "s.yaml", _deployment_of(100))
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    _each_object_costs_a_millisecond(monkeypatch)
    turns: list[int] = []

    async def tick() -> None:
        # the turns made while the engine holds some changed pods but not all
        while True:
            if _bare(src.engine, 0) and not _bare(src.engine, 99):
                turns.append(1)
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        _write(f, _deployment_of(100, bare=True))
        report = await src.reload()
    finally:
        ticker.cancel()
        gc.unfreeze()
    assert len(report.changes.pods) == 100 and report.pods_attributed == 100
    assert len(turns) >= 10, len(turns)


def _some_applied(engine: Engine, pods: int) -> bool:
    """Whether the engine holds pod 0 of ``_deployment_of(pods)`` and not yet the last."""
    return engine.pod("p-0") is not None and engine.pod(f"p-{pods - 1}") is None


def _each_object_costs_a_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's application of the snapshot made slow: 1 ms an object."""
    upsert = snapshot._upsert

    def slow(engine: Engine, held: list[Any], report: Any) -> Any:
        time.sleep(0.001 * len(held))
        return upsert(engine, held, report)

    monkeypatch.setattr(snapshot, "_upsert", slow)


async def test_the_first_load_applies_in_runs_that_let_the_loop_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load's application to the engine held the event loop in one go (4.7-7.6
    s at 37.5k pods: a SIGTERM, a probe waited for all of it); now in runs, the loop let
    in between, the index not ready until the last. Each object is made to cost 1 ms
    here, 100 ms in all."""
    _each_object_costs_a_millisecond(monkeypatch)
    index = PodIndex()
    src = SnapshotSource(_write(tmp_path / "s.yaml", _deployment_of(100)), Engine(), index)
    turns: list[bool] = []

    async def tick() -> None:
        # the turns made while the engine holds some pods but not all: whether ready
        while True:
            if _some_applied(src.engine, 100):
                turns.append(index.ready)
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        await src.start()
    finally:
        ticker.cancel()
        await src.stop()
        gc.unfreeze()
    assert len(turns) >= 10 and not any(turns), turns
    assert src.report is not None and src.report.pods_attributed == 100
    assert len(index.pods) == 100 and index.ready


async def test_the_first_load_never_collects_the_whole_heap(tmp_path: Path) -> None:
    """The first load freezes what the engine builds as it goes; its end collected the
    whole heap once (``memory.settle``: unfrozen, then one full pass: 0.22-0.55 s with
    the event loop held at 37.5k pods). Now every collection it makes walks only what is
    not frozen; what is garbage is still collected before each freeze."""
    from tests.garbage import cycle, whole_heap_collections

    src = SnapshotSource(_write(tmp_path / "s.yaml", _deployment_of(50)), Engine(), PodIndex())
    with whole_heap_collections() as whole:
        gone = cycle()
        await src.start()
        assert src.index.ready and len(src.index.pods) == 50
        assert gone() is None, "a cycle already garbage was frozen"
    await src.stop()
    assert whole == [], whole


async def test_a_stop_ends_the_first_loads_apply_between_two_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM during the first load's application cancels the start at the next
    run's end: it waited for all of it (6.5-7.0 s from the signal to the exit at 37.5k
    pods). Each object costs 1 ms here, 1 s in all."""
    _each_object_costs_a_millisecond(monkeypatch)
    index = PodIndex()
    src = SnapshotSource(_write(tmp_path / "s.yaml", _deployment_of(1000)), Engine(), index)
    starting = asyncio.create_task(src.start())
    try:
        await _until(lambda: _some_applied(src.engine, 1000) or starting.done())
        assert not starting.done()
        began = time.monotonic()
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        took = time.monotonic() - began
    finally:
        await src.stop()
        gc.unfreeze()
    assert starting.cancelled() and took < 0.2, took
    assert src.engine.pod("p-999") is None and not index.ready


async def test_a_reload_waits_for_requests_within_one_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's share on the loop gets what the thread's work left of the reload's
    ``RELOAD_DEFER_SECONDS``, not a budget of its own: under constant load a reload ends
    at most that much later."""
    budgets: list[float] = []
    pacer = snapshot.Pacer

    def recorded(busy: Any, budget: float) -> Any:
        budgets.append(budget)
        return pacer(busy, budget)

    monkeypatch.setattr(snapshot, "RELOAD_DEFER_SECONDS", 0.5)
    monkeypatch.setattr(snapshot, "Pacer", recorded)
    f = _write(tmp_path / "s.yaml", _deployment_of(3))
    src = SnapshotSource(f, Engine(), PodIndex(), busy=lambda: True)
    await src.start()
    try:
        _write(f, _deployment_of(3, bare=True))
        await src.reload()
    finally:
        gc.unfreeze()
    assert len(budgets) == 1 and budgets[0] < 0.5


async def test_a_description_change_during_a_reload_is_not_undone_by_it(
    tmp_path: Path
) -> None:
    """Another writer of the engine may run while a reload's changes are applied (a
    configuration reload sets the descriptions, and applies its changes to the index at
    once): what the reload changed before lands in the index before it, not after."""
    f = _write(tmp_path / "s.yaml", _deployment_of(200))
    engine = Engine()
    index = PodIndex()
    src = SnapshotSource(f, engine, index)
    await src.start()
    swapped = False

    async def reconfigure() -> None:
        # once the reload has changed some pods in the engine, take the builtin
        # descriptions away, as a configuration reload does
        nonlocal swapped
        while not _bare(engine, 0):
            await asyncio.sleep(0)
        index.apply(engine.remove_descriptions("builtin"))
        swapped = True

    task = asyncio.create_task(reconfigure())
    try:
        _write(f, _deployment_of(200, bare=True))
        await src.reload()
        await asyncio.wait_for(task, 30)  # bounded: a reload that never got there fails
    finally:
        task.cancel()
        gc.unfreeze()
    assert swapped
    for i in range(200):  # no description: a bare pod is not attributed, in both
        att = engine.pod(f"p-{i}")
        assert att is not None and att.reason == "no_controller_owner", att
        assert _workload_of(index, f"api-5f6d-{i}") is None, i


async def test_a_reload_keeps_the_stubs_of_what_did_not_change(tmp_path: Path) -> None:
    """A reload reads every object again, but what the engine has already stays the one
    stub it was: no second stub and no text for it while the reload runs."""
    pods = [_pod(f"p{i}", f"u-{i}", None) for i in range(3)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"kind": "List", "items": pods}))
    src = SnapshotSource(path, Engine(), PodIndex())
    await src.start()
    try:
        assert src._content is not None
        before = src._content.objects()
        pods[1]["metadata"]["labels"] = {"changed": "yes"}
        path.write_text(json.dumps({"kind": "List", "items": pods}))
        read = snapshot.read_snapshot(path, packed=True, applied=src._content.objects())
        after = read.objects()
        assert after["u-0"] is before["u-0"] and after["u-2"] is before["u-2"]
        changed = after["u-1"]
        assert isinstance(changed, ObjectStub) and changed.text and changed is not before["u-1"]
        report = await src.reload()
        assert report.objects["Pod"] == 3 and not report.invalid_objects
        labels = src.engine._pods["u-1"].labels
        assert labels is not None and dict(labels) == {"changed": "yes"}
        assert src.engine._pods["u-0"].labels is None
    finally:
        gc.unfreeze()


def test_release_drops_the_objects_but_not_those_a_kept_content_shares(
    tmp_path: Path,
) -> None:
    from proxy.snapshot import RELEASE_SLICE, _compact_releasing

    pods = [_pod(f"p{i}", f"u-{i}", None) for i in range(RELEASE_SLICE + 5)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))
    first = read_snapshot(path, packed=True)
    kept = first.compact()
    again = read_snapshot(path, packed=True)
    newer = _compact_releasing(again, kept)
    assert again.files == {} and kept.files == {}
    (fc,) = newer.files.values()
    assert len(fc.objects) == len(pods)
    assert all(isinstance(o, ObjectStub) and o.text is None for o in fc.objects)


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


#: namespace/pod -> kind, workload, component, instance, replica, reason ("-" for empty)
DEMO_TABLE = """
batch/nightly-etl-7q2wd Job nightly-etl job - - -
default/debug-shell Pod debug-shell pod - - -
gpu-monitoring/dcgm-exporter-5wz8k DaemonSet dcgm-exporter daemonset - - -
gpu-monitoring/dcgm-exporter-r7p2j DaemonSet dcgm-exporter daemonset - - -
ml/allreduce-bench-worker-0 - - - - - no_described_owner
ml/llm-finetune-4rj6t RayJob llm-finetune submitter - - -
ml/llm-finetune-raycluster-k7x2p-gpu-group-worker-2xk9d RayJob llm-finetune worker gpu-group - -
ml/llm-finetune-raycluster-k7x2p-gpu-group-worker-7mnbv RayJob llm-finetune worker gpu-group - -
ml/llm-finetune-raycluster-k7x2p-head-8jz5c RayJob llm-finetune head - - -
ml/pretrain-driver-0-0-bq9tw JobSet pretrain replicatedjob driver 0 -
ml/pretrain-workers-0-0-h5k8s JobSet pretrain replicatedjob workers 0 -
ml/pretrain-workers-1-0-m2n4r JobSet pretrain replicatedjob workers 1 -
web/frontend-6d8f7b9c5d-4xkqp Deployment frontend deployment - - -
web/frontend-6d8f7b9c5d-9zt2m Deployment frontend deployment - - -
web/postgres-0 StatefulSet postgres statefulset - - -
web/postgres-1 StatefulSet postgres statefulset - - -
"""


def test_demo_snapshot_attribution_table() -> None:
    engine, _, report = _load(DEMO)
    assert report.ok, report.problems()
    table = {
        f"{a.namespace}/{a.pod}": [
            a.workload.kind if a.workload else "",
            a.workload.name if a.workload else "",
            a.component,
            a.instance,
            a.replica,
            a.reason,
        ]
        for a in engine.pods()
    }
    expected = {
        row[0]: ["" if v == "-" else v for v in row[1:]]
        for row in (line.split() for line in DEMO_TABLE.strip().splitlines())
    }
    assert table == expected
    phases = {w.ref.name: w.phase for w in engine.workloads()}
    assert set(phases.values()) == {"Running"}
    assert len(phases) == 7


# -- what a source holds ------------------------------------------------------------------


def test_a_source_reads_objects_as_text_and_keeps_only_stubs_once_applied(
    tmp_path: Path,
) -> None:
    from proxy.snapshot import apply_content

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": _deployment()}))
    content = read_snapshot(path, packed=True)
    (fc,) = content.files.values()
    assert all(isinstance(o, ObjectStub) and o.text for o in fc.objects)
    engine, index = Engine(), PodIndex()
    report = apply_content(content, engine)
    index.apply(report.changes)
    assert _workload_of(index, "api-5f6d-x1") == "api"
    kept = content.compact()
    (kfc,) = kept.files.values()
    assert all(isinstance(o, ObjectStub) and o.text is None for o in kfc.objects)
    # unchanged: nothing to apply; changed and removed: applied from the stubs
    again = apply_content(read_snapshot(path, packed=True), engine, previous=kept)
    assert not again.changes
    objs = _deployment()
    objs[2]["metadata"]["labels"] = {"changed": "yes"}
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objs[1:]}))
    changed = apply_content(read_snapshot(path, packed=True), engine, previous=kept)
    assert set(changed.changes.workloads) == {"d-1"}  # the Deployment went away
    assert engine.pod("p-1") is not None


def test_what_the_source_and_the_engine_both_keep_is_kept_once(tmp_path: Path) -> None:
    """Strings equal across the stubs, the engine's records and the index are one object
    each (16 MB less at 37.5k pods, ``benchmarks/memory_bench.py``): a pod's uid and name
    are its stub's; its namespace, its owner's apiVersion and its (component, instance)
    key are shared with its siblings; the index's keys share the namespace's bytes."""
    from proxy.snapshot import apply_content

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List",
                                "items": _deployment_of(3)}))
    content = read_snapshot(path, packed=True)
    engine, index = Engine(), PodIndex()
    index.apply(apply_content(content, engine).changes)
    stubs = {o.uid: o for o in content.compact().objects().values()
             if isinstance(o, ObjectStub)}
    recs = [engine._pods[f"p-{i}"] for i in range(3)]
    for rec in recs:
        stub = stubs[rec.uid]
        assert rec.uid is stub.uid and rec.name is stub.name
        assert rec.att is not None and rec.att.pod is stub.name and rec.att.uid is stub.uid
    first, *others = recs
    for rec in others:
        assert rec.namespace is first.namespace and rec.key is first.key
        assert rec.owner is not None and first.owner is not None
        assert rec.owner.api_version is first.owner.api_version
    keys = [index._key_by_uid[f"p-{i}"] for i in range(3)]
    assert keys[1][0] is keys[0][0] and keys[2][0] is keys[0][0]
    assert _workload_of(index, "api-5f6d-2") == "api"


async def test_reload_of_objects_json_does_not_carry_exactly(tmp_path: Path) -> None:
    """What JSON does not carry exactly (a key that is not a string) stays a parsed object
    (compared whole on reload), the rest stubs."""
    f = tmp_path / "s.yaml"
    objs = _deployment()
    text = yaml.safe_dump_all(objs) + "---\n" + (
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j, namespace: shop, uid: j-1}\n"
        "status: {7: seven, active: 1}\n")
    f.write_text(text)
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    assert src.report is not None and src.report.objects["Job"] == 1
    assert isinstance(src._content.objects()["j-1"], dict)  # type: ignore[union-attr]
    f.write_text(text.replace("active: 1", "active: 0"))
    report = await src.reload()
    assert set(report.changes.workloads) == {"j-1"}  # the Job's phase changed
    report = await src.reload()
    assert not report.changes


def test_an_object_shadowed_by_a_later_file_is_applied_when_that_file_goes(
    tmp_path: Path,
) -> None:
    from proxy.snapshot import apply_content

    pod = _pod("p", "p-9", None)
    _write(tmp_path / "a.yaml", [pod])
    later = dict(pod, metadata={**pod["metadata"], "labels": {"from": "b"}})
    _write(tmp_path / "b.yaml", [later])
    engine = Engine()
    first = read_snapshot(tmp_path, packed=True)
    apply_content(first, engine)
    kept = first.compact()
    (tmp_path / "b.yaml").unlink()
    report = apply_content(read_snapshot(tmp_path, packed=True), engine, previous=kept)
    assert report.objects["Pod"] == 1
    assert engine._pods["p-9"].labels is None  # a.yaml's version, without labels


async def test_an_engine_failure_on_one_object_of_a_reload_costs_that_object_only(
        tmp_path: Path) -> None:
    """An engine bug on one object of a reload's runs (a deletion, an upsert, a
    re-attribution a description change owes) skips that object, reported with the
    snapshot's skipped objects, and the rest of its run and the runs after it are
    applied."""
    objs = _deployment() + [_pod(f"bare-{i}", f"b-{i}", None) for i in range(4)]
    f = _write(tmp_path / "s.yaml", objs)
    engine, index = Engine(), PodIndex()
    src = SnapshotSource(f, engine, index)
    await src.start()
    real_delete, real_upsert = engine.delete_many, engine.upsert_many

    def named(objs: Any, bad: str) -> list[Any]:
        objs = list(objs)
        if any((o.get("metadata") or {}).get("name") == bad for o in objs):
            raise RuntimeError(f"engine bug on {bad}")
        return objs

    engine.delete_many = (  # type: ignore[method-assign]
        lambda objs, **kw: real_delete(named(objs, "bare-1"), **kw))
    engine.upsert_many = (  # type: ignore[method-assign]
        lambda objs, **kw: real_upsert(named(objs, "late-1"), **kw))
    try:
        # two bare pods go, two come
        _write(f, [*_deployment(), _pod("bare-0", "b-0", None), _pod("bare-3", "b-3", None),
                   _pod("late-0", "l-0", None), _pod("late-1", "l-1", None)])
        await src.reload()
    finally:
        gc.unfreeze()
    report = src.report
    assert report is not None
    assert sorted(report.invalid_objects) == [
        "Pod shop/late-1: engine error RuntimeError: engine bug on late-1",
        "the deletion of Pod shop/bare-1: engine error RuntimeError: engine bug on bare-1",
    ]
    assert engine.pod("b-2") is None and engine.pod("b-1") is not None  # only the culprit
    assert engine.pod("l-0") is not None and engine.pod("l-1") is None
    assert _workload_of(index, "late-0") == "late-0"


async def test_pods_upserted_before_an_engine_failure_reach_the_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails part-way through a reload's upserts (a bug on one pod): the pods
    it took before the failure are in the index, not only the engine (given again, they
    are unchanged and give nothing, so only the batch's own changes can carry them)."""
    f = _write(tmp_path / "s.yaml", _deployment())
    engine, index = Engine(), PodIndex()
    src = SnapshotSource(f, engine, index)
    await src.start()
    fail_on_pod(monkeypatch, "late-1", "engine bug on late-1")
    try:
        _write(f, [*_deployment(), *(_pod(f"late-{i}", f"l-{i}", None) for i in range(3))])
        await src.reload()
    finally:
        gc.unfreeze()
    assert src.report is not None and src.report.invalid_objects == [
        "Pod shop/late-1: engine error RuntimeError: engine bug on late-1"]
    assert [_workload_of(index, f"late-{i}") for i in range(3)] == ["late-0", None, "late-2"]


def test_an_engine_failure_on_an_owed_object_costs_that_object_only(tmp_path: Path) -> None:
    """A description change in a snapshot owes its kind's objects a new attribution; one
    the engine fails on keeps the old one, reported, and the others get theirs."""
    def trainer(name: str) -> list[dict[str, Any]]:
        pod = _pod(f"{name}-worker-0", f"{name}-p", None)
        pod["metadata"]["ownerReferences"] = [
            {"apiVersion": "example.com/v1", "kind": "Trainer", "name": name,
             "uid": f"{name}-uid", "controller": True}]
        return [{"apiVersion": "example.com/v1", "kind": "Trainer",
                 "metadata": {"name": name, "namespace": "shop", "uid": f"{name}-uid"}}, pod]

    def desc(component_name: str) -> dict[str, Any]:
        return karta("trainer", component("trainer", "example.com", "Trainer"), [
            {"name": component_name, "ownerRef": "trainer",
             "specDefinition": {"podTemplateSpecPath": ".spec.template"}}])

    objs = trainer("a") + trainer("b") + trainer("c")
    before = read_snapshot(_write(tmp_path / "before.yaml", [*objs, desc("worker")]))
    engine = Engine()
    first = snapshot.apply_content(before, engine)
    assert not first.invalid_objects
    real = engine.reattribute

    def failing(uids: Any) -> Any:
        uids = list(uids)
        if "b-uid" in uids:
            raise RuntimeError("engine bug")
        return real(uids)

    engine.reattribute = failing  # type: ignore[method-assign]
    after = read_snapshot(_write(tmp_path / "after.yaml", [*objs, desc("gpu")]))
    report = snapshot.apply_content(after, engine, previous=before)
    assert report.invalid_objects == [
        "the re-attribution of b-uid: engine error RuntimeError: engine bug"]
    components = {n: (engine.pod(f"{n}-p") or pytest.fail(n)).component for n in "abc"}
    assert components == {"a": "gpu", "b": "worker", "c": "gpu"}


# -- a kind described later ----------------------------------------------------------------------


def _trainer_cluster() -> list[dict[str, Any]]:
    """A Trainer (a kind no built-in describes) with a status and 3 replicas, and its pod."""
    owner = {"apiVersion": "example.com/v1", "kind": "Trainer", "name": "t",
             "uid": "t-uid", "controller": True}
    return [
        {"apiVersion": "example.com/v1", "kind": "Trainer",
         "metadata": {"name": "t", "namespace": "shop", "uid": "t-uid"},
         "spec": {"replicas": 3}, "status": {"state": "ready"}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "t-0", "namespace": "shop", "uid": "t-0", "ownerReferences": [owner]},
         "spec": {"containers": []}},
    ]


def _trainer_facts(engine: Engine) -> tuple[str, str, float | None]:
    facts = engine.workload("t-uid")
    assert facts is not None
    return facts.phase, facts.phase_reason, facts.replicas[0].desired


def test_a_description_added_on_reload_feeds_its_kinds_unchanged_objects_again(
        tmp_path: Path) -> None:
    """The engine keeps an object whole only if its kind was described when it came: a
    Trainer loaded before its description read ``workload_object_missing`` (no phase, no
    desired count) until the Trainer itself changed; now as on a fresh start."""
    _write(tmp_path / "cluster.yaml", _trainer_cluster())
    before = read_snapshot(tmp_path)
    engine = Engine()
    snapshot.apply_content(before, engine)
    assert engine.workload("t-uid") is None
    _write(tmp_path / "zz-trainer.yaml", [TRAINER_KARTA])
    snapshot.apply_content(read_snapshot(tmp_path), engine, previous=before)
    assert _trainer_facts(engine) == ("Running", "", 3.0)


async def test_a_source_reload_that_adds_a_description_feeds_its_kinds_objects_again(
        tmp_path: Path) -> None:
    """The same through the source, which keeps only stubs of what it applied: the files
    are read again for the objects of the newly described kind."""
    _write(tmp_path / "cluster.yaml", _trainer_cluster())
    engine = Engine()
    index = PodIndex()
    src = SnapshotSource(tmp_path, engine, index)
    await src.start()
    try:
        _write(tmp_path / "zz-trainer.yaml", [TRAINER_KARTA])
        await src.reload()
        assert _trainer_facts(engine) == ("Running", "", 3.0)
        assert _workload_of(index, "t-0") == "t"
        # nothing newly described: nothing fed again
        assert await src.follow_kinds() == 0
    finally:
        await src.stop()
        gc.unfreeze()


async def test_a_description_from_elsewhere_has_the_source_feed_its_kinds_objects_again(
        tmp_path: Path) -> None:
    """A configuration reload describes the kind (not the snapshot): ``follow_kinds``
    feeds the source's objects of it again; one changed on disk since is left to the
    reload that change brings."""
    objs = _trainer_cluster()
    other = {**objs[0], "metadata": {"name": "u", "namespace": "shop", "uid": "u-uid"}}
    _write(tmp_path / "cluster.yaml", [*objs, other])
    engine = Engine()
    src = SnapshotSource(tmp_path, engine, PodIndex())
    await src.start()
    try:
        engine.add_descriptions([parse_description(TRAINER_KARTA, "files")])
        assert _trainer_facts(engine)[1] == "workload_object_missing"
        _write(tmp_path / "cluster.yaml", [*objs, {**other, "spec": {"replicas": 9}}])
        assert await src.follow_kinds() == 1
        assert _trainer_facts(engine) == ("Running", "", 3.0)
        assert await src.follow_kinds() == 0
        await src.reload()
        u = engine.workload("u-uid")
        assert u is not None and u.replicas[0].desired == 9.0
    finally:
        await src.stop()
        gc.unfreeze()


def test_a_configmap_mount_is_read_once_in_its_current_version(tmp_path: Path) -> None:
    from tests.karta.test_description import configmap_mount

    new, old = _pod("p", "p-1", None), _pod("p", "p-1", None)
    new["metadata"]["labels"] = {"v": "new"}
    configmap_mount(tmp_path, [("snap.yaml", yaml.safe_dump(new)),
                               ("snap.yaml", yaml.safe_dump(old))], current=0)
    content = read_snapshot(tmp_path)
    assert list(content.files) == [str(tmp_path / "snap.yaml")] and not content.skipped
    (obj,) = content.objects().values()
    assert isinstance(obj, dict) and obj["metadata"]["labels"] == {"v": "new"}


# -- YAML read as Kubernetes reads it -------------------------------------------------------


def _lol(levels: int) -> str:
    """A ConfigMap of nested aliases, ten to a level: ~600 bytes standing for 10**levels
    strings once expanded."""
    rows = "".join(f"  l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 10 if i else ['"lol"'] * 10)
                   + "]\n" for i in range(levels + 1))
    return ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: lol, namespace: shop}\n"
            f"data:\n{rows}")


async def test_an_alias_bomb_skips_its_document_and_the_rest_is_served(tmp_path: Path) -> None:
    f = tmp_path / "lol.yaml"
    # 7 levels raised MemoryError out of SnapshotSource.start (6: 5.6 s and 1.1 GB); 5
    # levels, quick to expand, were loaded
    f.write_text(_lol(5) + "---\n" + yaml.safe_dump(_pod("p", "p-1", None)))
    index = PodIndex()
    src = SnapshotSource(f, Engine(), index)
    await src.start()
    report = src.report
    assert report is not None and index.ready
    assert dict(report.objects) == {"Pod": 1}
    assert report.invalid_objects == [
        f"{f}: document 1: data.l1[0]: YAML alias *l0 at line 6, column 12: aliases are not "
        "accepted (kubectl never writes one, and a few nested ones can stand for gigabytes)"]
    assert _workload_of(index, "p") == "p"
    await src.stop()


def test_an_alias_in_one_item_of_a_list_skips_that_item(tmp_path: Path) -> None:
    pods = [_pod(f"p{i}", f"p-{i}", None) for i in range(3)]
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": pods})
    text = text.replace("name: p1\n", "name: &n p1\n    labels: {copy: *n}\n")
    (tmp_path / "s.yaml").write_text(text)
    _, index, report = _load(tmp_path / "s.yaml")
    assert report.objects["Pod"] == 2
    (why,) = report.invalid_objects
    assert why.startswith(f"{tmp_path / 's.yaml'}: document 1.items[1]: metadata.labels.copy: "
                          "YAML alias *n at line ")
    assert _workload_of(index, "p2") == "p2" and _workload_of(index, "p1") is None


def test_a_key_given_twice_skips_its_object(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("apiVersion: v1\nkind: Pod\nmetadata:\n  name: b\n  namespace: shop\n"
                 "  labels: {team: x}\n  labels: {team: y}\n---\n"
                 + yaml.safe_dump(_pod("a", "p-a", None)))
    _, _, report = _load(f)
    assert report.objects["Pod"] == 1
    assert report.invalid_objects == [
        f"{f}: document 1: metadata.labels: duplicate key 'labels' at line 7, column 3 "
        "(kubectl refuses a key given twice; the last one would win silently)"]


def test_unquoted_timestamps_are_read_as_the_apis_strings(tmp_path: Path) -> None:
    objs = _deployment()
    objs[0]["metadata"]["generation"] = 1
    objs[0]["status"] = {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3,
                         "readyReplicas": 3, "conditions": [
                             {"type": "Available", "status": "True",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    objs[0]["spec"]["replicas"] = 3
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump_all(objs).replace("'2026-01-01T00:00:00Z'",
                                                  "2026-01-01T00:00:00Z"))
    assert "lastTransitionTime: 2026-01-01T00:00:00Z\n" in f.read_text()
    engine, _, report = _load(f)
    assert report.ok
    (wl,) = engine.workloads()
    # a datetime made the scale path fail (desired None, workload_jq_error)
    assert [r.desired for r in wl.replicas] == [3.0]
    assert not engine.jq_errors
    assert wl.phase == "Running" and wl.phase_since_source == "object"
    held = read_snapshot(f, packed=True).objects()["d-1"]
    assert isinstance(held, ObjectStub)  # JSON carries it: held as text


@pytest.mark.parametrize(("metadata", "why"), [
    ("{name: q, namespace: [a, b]}", "metadata.namespace: must be a string, got list"),
    ("{name: q, namespace: shop, uid: 12345}", "metadata.uid: must be a string, got int"),
    ("{name: q, namespace: shop, labels: [a, b]}", "metadata.labels: must be a mapping, got list"),
    ("{name: q, namespace: shop, labels: {ver: 1.0}}",
     "metadata.labels.ver: must be a string, got float"),
    ("{name: q, namespace: shop, labels: {1: a}}",
     "metadata.labels: keys must be strings, got int 1"),
    ("{name: q, namespace: shop, annotations: {x: yes}}",
     "metadata.annotations.x: must be a string, got bool"),
    ("{name: q, namespace: shop, annotations: {on: x}}",  # YAML 1.1's true
     "metadata.annotations: keys must be strings, got bool True"),
    ("{name: q, namespace: shop, ownerReferences: {a: 1}}",
     "metadata.ownerReferences: must be a list, got mapping"),
    ("{name: q, namespace: shop, ownerReferences: [x]}",
     "metadata.ownerReferences[0]: must be a mapping, got str"),
    ("{name: q, namespace: shop, ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, "
     "name: r, uid: 12345, controller: true}]}",
     "metadata.ownerReferences[0].uid: must be a string, got int"),
    ("{name: q, namespace: shop, ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, "
     "name: r, controller: 'true'}]}",
     "metadata.ownerReferences[0].controller: must be true or false, got str"),
])
def test_metadata_of_the_wrong_type_skips_its_object(tmp_path: Path, metadata: str,
                                                     why: str) -> None:
    # taken as they were: the namespace list's text was stamped on the pod's series, an
    # int uid was replaced by a derived one and its pods' references to it ignored
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(_pod("p", "p-1", None))
                 + f"---\napiVersion: v1\nkind: Pod\nmetadata: {metadata}\n")
    _, index, report = _load(f)
    assert report.objects["Pod"] == 1
    assert report.invalid_objects == [f"{f}: document 2: Pod q: {why}"]
    assert _workload_of(index, "p") == "p"


def test_api_objects_with_every_metadata_field_load(tmp_path: Path) -> None:
    pod = _pod("p", "p-1", ("ReplicaSet", "r", "r-1"))
    pod["metadata"].update(labels={"a": "1"}, annotations={"b": ""}, namespace="shop")
    pod["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] = True
    rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
          "metadata": {"name": "r", "namespace": "shop", "uid": "r-1", "labels": None}}
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [rs, pod]}))
    _, _, report = _load(f)
    assert report.ok and report.objects == {"Pod": 1, "ReplicaSet": 1}


async def test_a_stop_ends_the_first_loads_read_in_its_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during the first load: the start is cancelled and the source stopped, and
    the read in its thread ends at its next pause. It ran on, and the process waited for
    it at its exit (SIGTERM 3 s after the start at 37.5k pods: 6.6 s to exit). Here the
    read is one that pauses until abandoned (10 s at most)."""
    import threading
    import time

    from proxy.yielding import Abandoned

    reading = threading.Event()
    ended: list[str] = []

    def endless_read(path: object, **kwargs: Any) -> object:
        pace = kwargs.get("pace", snapshot.unpaced)
        reading.set()
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                pace()
                time.sleep(0.001)
        except Abandoned:
            ended.append("abandoned")
            raise
        ended.append("ran to its end")
        return read_snapshot(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshot, "read_snapshot", endless_read)
    src = SnapshotSource(_write(tmp_path / "s.yaml", _deployment()), Engine(), PodIndex())
    starting = asyncio.create_task(src.start())
    assert await asyncio.to_thread(reading.wait, 5)
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    t0 = time.monotonic()
    await src.stop()
    while not ended and time.monotonic() - t0 < 5:
        await asyncio.sleep(0.01)
    assert ended == ["abandoned"] and time.monotonic() - t0 < 2
