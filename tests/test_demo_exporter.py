"""The fixture exporter serves text Prometheus' parser reads, with counters that advance."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo_exporter import (
    DEMO_SNAPSHOT,
    FixtureExporter,
    _serve,
    load_objects,
)
from proxy.object_files import SnapshotError
from tests.clock import ManualClock
from tests.ipv6 import needs_ipv6

SNAPSHOT = DEMO_SNAPSHOT


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


async def test_routes_parse_and_counters_advance() -> None:
    clock = ManualClock(1_800_000_000.0)
    async with FixtureExporter(SNAPSHOT, clock=clock) as exp, aiohttp.ClientSession() as http:

        async def get(path: str) -> str:
            async with http.get(exp.url + path) as r:
                assert r.status == 200
                return await r.text()

        cadvisor = _samples(await get("/metrics/cadvisor"))
        resource = _samples(await get("/metrics/resource"))
        dcgm = _samples(await get("/metrics"))
        clock.now += 30
        later = _samples(await get("/metrics/cadvisor"))
        dcgm_later = _samples(await get("/metrics"))

    pod = "frontend-6d8f7b9c5d-4xkqp"
    cpu = {
        k: v
        for k, v in cadvisor.items()
        if k[0] == "container_cpu_usage_seconds_total" and ("pod", pod) in k[1]
    }
    assert len(cpu) == 3  # app container, POD sandbox, pod cgroup
    containers = {dict(k[1]).get("container", "") for k in cpu}
    assert containers == {"frontend", "POD", ""}
    rate = exp.model.pod("web", pod).containers[0].cpu_cores
    for k, v in cpu.items():
        if dict(k[1]).get("container") == "frontend":
            assert later[k] - v == pytest.approx(rate * 30)
    assert any(k[0] == "pod_cpu_usage_seconds_total" for k in resource)
    util = {dict(k[1]).get("pod"): v for k, v in dcgm.items() if k[0] == "DCGM_FI_DEV_GPU_UTIL"}
    assert "pretrain-workers-1-0-m2n4r" in util  # raw exporter labels: pod/namespace
    assert None in util  # an idle GPU has no pod labels
    # the energy counter (mJ) advances at the GPU's power draw (W), idle GPUs' too; the
    # power gauge stays; prometheus_client's parser names counter samples ..._total
    power = {dict(k[1])["UUID"]: v for k, v in dcgm.items() if k[0] == "DCGM_FI_DEV_POWER_USAGE"}
    energy = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"
    advanced = {dict(k[1])["UUID"]: dcgm_later[k] - v for k, v in dcgm.items() if k[0] == energy}
    assert power.keys() == advanced.keys() == {g.uuid for g in exp.model.gpus}
    for gpu, watts in power.items():
        assert 0 < watts <= 400 and advanced[gpu] == pytest.approx(watts * 1000 * 30, abs=1)
    assert {k: v for k, v in dcgm_later.items() if k[0] != energy} == {
        k: v for k, v in dcgm.items() if k[0] != energy}
    assert exp.scrapes == {"cadvisor": 2, "resource": 1, "dcgm": 2}


async def test_exporter_of_objects_with_node_filter() -> None:
    objs = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": "n", "uid": "u"},
            "spec": {
                "nodeName": "node-a",
                "containers": [
                    {
                        "name": "c",
                        "image": "i",
                        "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "1"}},
                    }
                ],
            },
        }
    ]
    async with FixtureExporter(objs) as exp, aiohttp.ClientSession() as http:
        async with http.get(exp.url + "/metrics?node=node-a") as r:
            dcgm = _samples(await r.text())
        async with http.get(exp.url + "/metrics/resource?node=other") as r:
            resource = _samples(await r.text())
    assert {dict(k[1])["pod"] for k in dcgm} == {"p"}
    assert not any(k[0] == "pod_cpu_usage_seconds_total" for k in resource)


def test_objects_are_read_as_the_snapshot_reads_them_with_pods_whole(tmp_path: Path) -> None:
    """A typed list's items take the list's kind (they were dropped as kindless), and a
    pod with a controller keeps its containers (the snapshot source's slim pod has none)."""
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "p-1",
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "rs", "uid": "rs-1", "controller": True}]},
           "spec": {"nodeName": "n1", "containers": [
               {"name": "c", "image": "img", "resources": {"requests": {"cpu": "1"}}}]}}
    (tmp_path / "pods.json").write_text(json.dumps(
        {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [pod]}))
    (obj,) = load_objects(tmp_path)
    assert obj["kind"] == "Pod" and obj["spec"]["containers"][0]["image"] == "img"


def test_what_the_reader_sets_aside_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: &n a, labels: {x: *n}}\n")
    with pytest.raises(SnapshotError, match="aliases are not accepted"):
        load_objects(f)
    f.write_text("kind: [\n")
    with pytest.raises(SnapshotError, match="invalid YAML"):
        load_objects(f)


@needs_ipv6
async def test_serve_takes_a_bracketed_ipv6_address_and_names_it_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--serve [::1]:PORT`` looked up the name "[::1]" (a start error), and the URL it
    printed, ``http://::1:PORT``, named no port."""
    task = asyncio.create_task(_serve(str(SNAPSHOT), "[::1]:0"))
    try:
        url = ""
        for _ in range(100):  # up to 5 s
            out = capsys.readouterr().out
            if match := re.search(r"fixture exporter on (\S+)", out):
                url = match.group(1)
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        assert url.startswith("http://[::1]:"), url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
                http.get(url + "/metrics") as r:
            assert r.status == 200
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
