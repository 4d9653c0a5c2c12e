"""The simulator behaves like an API server where the watch code depends on it.

Driven through kubernetes-asyncio (unpatched), the same client the proxy uses.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.kubesim import ApiError, Conflict, KubeSim
from tests.kubesim.resources import KARTA, POD, RAY_JOB

META_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
META_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


def pod(name: str, ns: str = "default", node: str = "", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
    }


async def raw(api: k8s.ApiClient, path: str, accept: str = "application/json",
              **query: str) -> aiohttp.ClientResponse:
    resp: aiohttp.ClientResponse = await api.call_api(
        path, "GET", query_params=list(query.items()), header_params={"Accept": accept},
        auth_settings=["BearerToken"], _preload_content=False,
    )
    return resp


async def events(resp: aiohttp.ClientResponse, n: int, timeout: float = 5.0
                 ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    async def read() -> None:
        while len(out) < n:
            line = await resp.content.readline()
            if not line:
                return
            out.append(json.loads(line))

    await asyncio.wait_for(read(), timeout)
    return out


async def test_discovery_lists_core_kinds_and_runtime_crds(sim: KubeSim,
                                                           api: k8s.ApiClient) -> None:
    groups = await k8s.ApisApi(api).get_api_versions()
    names = {g.name for g in groups.groups}
    assert {"apps", "batch", "coordination.k8s.io"} <= names
    assert "ray.io" not in names
    sim.register(RAY_JOB, KARTA)
    groups = await k8s.ApisApi(api).get_api_versions()
    assert {"ray.io", "run.ai"} <= {g.name for g in groups.groups}
    resources = json.loads(await (await raw(api, "/apis/run.ai/v1alpha1")).read())
    karta = next(r for r in resources["resources"] if r["kind"] == "Karta")
    assert karta["name"] == "kartas" and karta["namespaced"] is False
    core = await k8s.CoreV1Api(api).get_api_resources()
    assert "pods" in {r.name for r in core.resources}


async def test_typed_api_and_pagination(sim: KubeSim, api: k8s.ApiClient) -> None:
    for i in range(7):
        sim.create(pod(f"p{i}", ns="a" if i % 2 else "b", node="n1" if i < 3 else "n2"))
    core = k8s.CoreV1Api(api)
    first = await core.list_pod_for_all_namespaces(limit=3)
    assert len(first.items) == 3 and first.metadata._continue
    names = [p.metadata.name for p in first.items]
    rest = await core.list_pod_for_all_namespaces(limit=3, _continue=first.metadata._continue)
    names += [p.metadata.name for p in rest.items]
    last = await core.list_pod_for_all_namespaces(limit=3, _continue=rest.metadata._continue)
    names += [p.metadata.name for p in last.items]
    assert sorted(names) == [f"p{i}" for i in range(7)] and not last.metadata._continue
    assert len((await core.list_namespaced_pod("a")).items) == 3
    on_n1 = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert {p.metadata.name for p in on_n1.items} == {"p0", "p1", "p2"}


async def test_list_items_are_typed_and_metadata_only(sim: KubeSim,
                                                      api: k8s.ApiClient) -> None:
    sim.create(pod("p", app="x"))
    doc = json.loads(await (await raw(api, "/api/v1/pods")).read())
    assert doc["kind"] == "PodList" and "kind" not in doc["items"][0]
    meta = json.loads(await (await raw(api, "/api/v1/pods", accept=META_LIST)).read())
    assert meta["kind"] == "PartialObjectMetadataList"
    assert meta["items"][0]["kind"] == "PartialObjectMetadata"
    assert "spec" not in meta["items"][0]
    labelled = json.loads(await (await raw(api, "/api/v1/pods", labelSelector="app in (x,y)"))
                          .read())
    assert len(labelled["items"]) == 1


async def test_watch_events_bookmarks_and_filters(sim: KubeSim, api: k8s.ApiClient) -> None:
    sim.create(pod("early", node="n1"))
    rv = str(sim.resource_version)
    resp = await raw(api, "/api/v1/pods", watch="1", resourceVersion=rv,
                     allowWatchBookmarks="true", fieldSelector="spec.nodeName=n1")
    p = sim.create(pod("late"))  # unscheduled: not on n1 yet
    p["spec"]["nodeName"] = "n1"
    sim.update(p)  # bound to n1: the filtered watch sees ADDED
    sim.delete(p)
    got = await events(resp, 3)
    assert [e["type"] for e in got] == ["ADDED", "DELETED", "BOOKMARK"]
    assert got[2]["object"]["metadata"]["resourceVersion"] == str(sim.resource_version)
    resp.release()


async def test_metadata_watch_and_list_form_refusal(sim: KubeSim, api: k8s.ApiClient) -> None:
    resp = await raw(api, "/api/v1/pods", accept=META_WATCH, watch="1", resourceVersion="0")
    sim.create(pod("m"))
    (ev,) = await events(resp, 1)
    assert ev["object"]["kind"] == "PartialObjectMetadata" and "spec" not in ev["object"]
    resp.release()
    wrong = await raw(api, "/api/v1/pods", accept=META_LIST, watch="1", resourceVersion="0")
    assert await wrong.read() == b""


async def test_kubernetes_asyncio_watch_sees_410_after_compaction(sim: KubeSim,
                                                                  api: k8s.ApiClient) -> None:
    from kubernetes_asyncio import watch

    sim.create(pod("a"))
    old = str(sim.resource_version)
    sim.create(pod("b"))
    sim.compact()
    w = watch.Watch()
    with pytest.raises(ApiException) as err:
        async for _ in w.stream(k8s.CoreV1Api(api).list_pod_for_all_namespaces,
                                resource_version=old, timeout_seconds=5):
            pass
    assert err.value.status == 410
    await w.close()


async def test_server_timeout_disconnect_and_outage(sim: KubeSim, api: k8s.ApiClient) -> None:
    resp = await raw(api, "/api/v1/pods", watch="1", timeoutSeconds="0.3")
    assert await asyncio.wait_for(resp.read(), 5) == b""  # clean end after the timeout
    resp = await raw(api, "/api/v1/pods", watch="1")
    await asyncio.sleep(0.05)
    assert sim.disconnect_watches() == 1
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(resp.read(), 5)
    sim.create(pod("kept"))
    await sim.stop()
    with pytest.raises(aiohttp.ClientConnectorError):
        await raw(api, "/api/v1/pods")
    await sim.start()
    doc = json.loads(await (await raw(api, "/api/v1/pods")).read())
    assert [p["metadata"]["name"] for p in doc["items"]] == ["kept"]


async def test_hung_watch_stays_open_and_silent(sim: KubeSim, api: k8s.ApiClient) -> None:
    resp = await raw(api, "/api/v1/pods", watch="1", resourceVersion="0",
                     allowWatchBookmarks="true", timeoutSeconds="1")
    sim.create(pod("before"))
    (ev,) = await events(resp, 1)
    assert ev["type"] == "ADDED"
    assert sim.hang_watches() == 1
    sim.create(pod("after"))
    # no event, no bookmark (every 0.2 s) and no end at timeoutSeconds=1
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(resp.content.readany(), 1.5)
    assert sim.watch_count() == 1
    fresh = await raw(api, "/api/v1/pods", watch="1", resourceVersion="0")
    got = await events(fresh, 2)  # new watches are served normally
    assert [e["object"]["metadata"]["name"] for e in got] == ["before", "after"]
    fresh.release()
    assert sim.disconnect_watches() >= 1  # the hung one breaks like any other
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(resp.read(), 5)


async def test_held_watch_flushes_its_events_and_an_error_in_one_chunk(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    resp = await raw(api, "/api/v1/pods", watch="1", resourceVersion="0",
                     allowWatchBookmarks="true", timeoutSeconds="30")
    sim.create(pod("before"))
    (ev,) = await events(resp, 1)
    assert sim.hold_watches() == 1
    sim.create(pod("a"))
    sim.create(pod("b"))
    await asyncio.sleep(0.5)  # held back: no event and no bookmark (every 0.2 s)
    assert not resp.content.is_eof()
    assert resp.content.total_bytes == len(json.dumps(ev, separators=(",", ":"))) + 1
    assert sim.flush_watches(error=ApiError(500, "InternalError", "boom"),
                             raw=b"{broken\n") == 1
    body = await asyncio.wait_for(resp.read(), 5)  # then a clean end
    lines = body.splitlines()
    assert [json.loads(x)["type"] for x in lines[:3]] == ["ADDED", "ADDED", "ERROR"]
    assert json.loads(lines[2])["object"]["code"] == 500 and lines[3] == b"{broken"


async def test_failing_resource_and_empty_watches(sim: KubeSim, api: k8s.ApiClient) -> None:
    sim.fail_resource(POD, 403)
    with pytest.raises(ApiException) as refused:
        await k8s.CoreV1Api(api).list_pod_for_all_namespaces()
    assert refused.value.status == 403
    assert json.loads(refused.value.body or b"{}")["reason"] == "Forbidden"
    groups = await k8s.CoreV1Api(api).get_api_resources()  # discovery still lists it
    assert "pods" in {r.name for r in groups.resources}
    sim.fail_resource(POD, 500, accept="as=PartialObjectMetadata")
    await k8s.CoreV1Api(api).list_pod_for_all_namespaces()  # full objects: served
    meta = await raw(api, "/api/v1/pods", accept=META_LIST)
    assert meta.status == 500
    sim.fail_resource(POD, None)
    assert (await raw(api, "/api/v1/pods", accept=META_LIST)).status == 200
    sim.empty_watches = True
    resp = await raw(api, "/api/v1/pods", watch="1", timeoutSeconds="30")
    assert await asyncio.wait_for(resp.read(), 2) == b""  # at once, cleanly


async def test_a_resource_failing_its_lists_and_watches_only_serves_its_gets(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``collections_only``: a watch cut off while the store answers a GET of one object
    (what the owner fetch relies on); without it, GETs fail too."""
    created = sim.create({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": "p", "namespace": "default"}})
    sim.fail_resource(POD, 500, collections_only=True)
    assert (await raw(api, "/api/v1/namespaces/default/pods")).status == 500
    assert (await raw(api, "/api/v1/pods", watch="1")).status == 500
    one = await raw(api, "/api/v1/namespaces/default/pods/p")
    assert one.status == 200
    assert json.loads(await one.read())["metadata"]["uid"] == created["metadata"]["uid"]
    sim.fail_resource(POD, 500)
    assert (await raw(api, "/api/v1/namespaces/default/pods/p")).status == 500


async def test_lease_optimistic_concurrency(sim: KubeSim, api: k8s.ApiClient) -> None:
    coord = k8s.CoordinationV1Api(api)
    body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name="l", namespace="ns"),
                       spec=k8s.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15))
    created = await coord.create_namespaced_lease("ns", body)
    got = await coord.read_namespaced_lease("l", "ns")
    assert got.spec.holder_identity == "a"
    got.spec.holder_identity = "b"
    await coord.replace_namespaced_lease("l", "ns", got)
    created.spec.holder_identity = "c"  # stale resourceVersion
    with pytest.raises(ApiException) as err:
        await coord.replace_namespaced_lease("l", "ns", created)
    assert err.value.status == 409
    with pytest.raises(ApiException) as err:
        await coord.create_namespaced_lease("ns", body)
    assert err.value.status == 409
    stale = sim.get("coordination.k8s.io/v1", "Lease", "l", "ns")
    sim.update(stale)
    with pytest.raises(Conflict):
        sim.update(stale)


async def test_cascade_delete_and_auth(sim: KubeSim, api: k8s.ApiClient) -> None:
    rs = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                     "metadata": {"name": "rs", "namespace": "default"}})
    child = pod("rs-1")
    child["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "rs", "uid": rs["metadata"]["uid"],
                                             "controller": True}]
    sim.create(child)
    sim.delete(rs)
    assert sim.objects(sim.store.resources[("", "pods")].rtype) == []
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/api/v1/pods") as r:
        assert r.status == 401


async def test_a_delayed_resource_applies_a_write_its_client_gave_up_on(
    sim: KubeSim, api: k8s.ApiClient
) -> None:
    from tests.kubesim.resources import LEASE

    coord = k8s.CoordinationV1Api(api)
    body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name="l", namespace="ns"),
                       spec=k8s.V1LeaseSpec(holder_identity="a"))
    await coord.create_namespaced_lease("ns", body)
    sim.delay_resource(LEASE, 0.5, methods=("PUT",))
    got = await coord.read_namespaced_lease("l", "ns")  # a GET is not delayed
    got.spec.holder_identity = "b"
    with pytest.raises(asyncio.TimeoutError):
        await coord.replace_namespaced_lease("l", "ns", got, _request_timeout=0.1)
    for _ in range(200):  # applied once its wait is over, though the client left
        if sim.get("coordination.k8s.io/v1", "Lease", "l", "ns")["spec"]["holderIdentity"] == "b":
            break
        await asyncio.sleep(0.05)
    assert sim.get("coordination.k8s.io/v1", "Lease", "l", "ns")["spec"]["holderIdentity"] == "b"
    sim.delay_resource(LEASE, None)
    assert "coordination.k8s.io" not in {k[0] for k in sim.delayed_resources}


async def test_a_list_whose_later_pages_are_delayed_stays_at_its_first_pages_version(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``continued``: only the pages after the first wait; what is created meanwhile is
    not in them, and the list's resourceVersion is its first page's (kube-apiserver's
    paginated list is one snapshot)."""
    for i in range(2):
        sim.create(pod(f"p{i}"))
    sim.delay_resource(POD, 0.5, continued=True)
    core = k8s.CoreV1Api(api)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = await core.list_namespaced_pod("default", limit=1)
    assert loop.time() - t0 < 0.4  # the first page is not delayed
    sim.create(pod("p2"))
    t0 = loop.time()
    rest = await core.list_namespaced_pod("default", limit=5,
                                          _continue=first.metadata._continue)
    assert loop.time() - t0 >= 0.5
    assert [p.metadata.name for p in first.items + rest.items] == ["p0", "p1"]
    assert rest.metadata.resource_version == first.metadata.resource_version
    assert int(rest.metadata.resource_version) < sim.resource_version
    sim.delay_resource(POD, None)


async def _whole_list(core: k8s.CoreV1Api) -> list[str]:
    """The pods' names, listed a page of one, then the rest with its continue token."""
    first = await core.list_namespaced_pod("default", limit=1)
    rest = await core.list_namespaced_pod("default", limit=5,
                                          _continue=first.metadata._continue)
    return [p.metadata.name for p in first.items + rest.items]


def _expired(error: ApiException) -> bool:
    """kube-apiserver's answer to a continue token whose version was compacted."""
    return error.status == 410 and json.loads(error.body or b"{}")["reason"] == "Expired"


async def test_a_list_cut_part_way_fails_at_its_second_page_however_cut(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``cut_lists``: the first page is served, every page asked with a continue token
    answered with the status, the connection closed with no answer, or 410 Expired (the
    list's snapshot dropped, as a compaction does); served whole again once uncut."""
    for i in range(3):
        sim.create(pod(f"p{i}"))
    core = k8s.CoreV1Api(api)
    for cut in (500, "reset", "expire"):
        sim.cut_lists(POD, cut)
        first = await core.list_namespaced_pod("default", limit=1)
        assert [p.metadata.name for p in first.items] == ["p0"]
        with pytest.raises((ApiException, aiohttp.ClientError)) as raised:
            await core.list_namespaced_pod("default", limit=1,
                                           _continue=first.metadata._continue)
        if cut == "reset":
            assert isinstance(raised.value, aiohttp.ClientError)
        else:
            assert isinstance(raised.value, ApiException)
            if cut == "expire":
                assert _expired(raised.value)
            else:
                assert raised.value.status == 500
    sim.cut_lists(POD, None)
    assert await _whole_list(core) == ["p0", "p1", "p2"]


async def test_a_continue_token_dies_with_its_lists_ttl(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``list_token_ttl``: a continue token asked after that many seconds since its list's
    first page is answered 410 Expired (its resourceVersion compacted, as etcd does every
    5 minutes); one asked in time is served, and a new list gets a new token."""
    for i in range(3):
        sim.create(pod(f"p{i}"))
    sim.list_token_ttl = 0.3
    core = k8s.CoreV1Api(api)
    first = await core.list_namespaced_pod("default", limit=1)
    second = await core.list_namespaced_pod("default", limit=1,
                                            _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["p1"]
    await asyncio.sleep(0.4)
    with pytest.raises(ApiException) as raised:
        await core.list_namespaced_pod("default", limit=1,
                                       _continue=second.metadata._continue)
    assert _expired(raised.value)
    assert await _whole_list(core) == ["p0", "p1", "p2"]


async def test_a_watch_from_a_version_not_reached_is_silent_a_list_answered_504(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """As kube-apiserver's watch cache (cacheWatcher.process): a watch from a version
    the store has not reached (its etcd restored from a backup) is accepted and sent
    only what is newer than that version, bookmarks included, so nothing until the
    store passes it. A list from such a version is what gets 504 "Too large resource
    version" (storage.NewTooLargeResourceVersionError). The simulator answered the watch
    504, which a real server does not: the proxy's handling of it never ran there."""
    for i in range(5):
        sim.create(pod(f"p{i}"))
    assert sim.resource_version == 5
    sim.reset_store(resource_version=2)
    assert sim.resource_version == 2 and sim.objects(POD) == []
    assert sim.create(pod("new"))["metadata"]["resourceVersion"] == "3"
    listed = await raw(api, "/api/v1/pods", resourceVersion="5", limit="1")
    assert listed.status == 504
    status = json.loads(await listed.read())
    assert status["reason"] == "Timeout" and status["code"] == 504
    assert status["message"] == "Too large resource version: 5, current: 3"
    assert status["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
    consistent = await raw(api, "/api/v1/pods", limit="1")
    assert json.loads(await consistent.read())["metadata"]["resourceVersion"] == "3"
    watch = await raw(api, "/api/v1/pods", watch="1", resourceVersion="5",
                      allowWatchBookmarks="true", timeoutSeconds="30")
    assert watch.status == 200
    with pytest.raises(TimeoutError):  # 0.6 s: three bookmark intervals, none sent
        await events(watch, 1, timeout=0.6)
    for i in range(3):  # rv 4, 5 (not newer than 5: not sent), 6
        sim.create(pod(f"later{i}"))
    got = await events(watch, 2)
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in got] == [
        ("ADDED", "6"), ("BOOKMARK", "6")]
    watch.release()


async def test_reset_store_breaks_open_watches_or_moves_them(sim: KubeSim,
                                                             api: k8s.ApiClient) -> None:
    """Moved (``keep_watches``), an open watch from the old store's version 3 is sent
    nothing of the new store's until it passes 3."""
    sim.create(pod("old"))
    broken = await raw(api, "/api/v1/pods", watch="1", resourceVersion="1")
    await asyncio.sleep(0.05)
    sim.reset_store()
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(broken.read(), 5)
    for i in range(3):
        sim.create(pod(f"p{i}"))
    kept = await raw(api, "/api/v1/pods", watch="1", resourceVersion="3",
                     allowWatchBookmarks="true", timeoutSeconds="30")
    await asyncio.sleep(0.05)
    sim.reset_store(resource_version=1, keep_watches=True)
    sim.create(pod("moved"))  # rv 2
    with pytest.raises(TimeoutError):
        await events(kept, 1, timeout=0.6)
    sim.create(pod("moved-3"))
    sim.create(pod("moved-4"))
    got = await events(kept, 2)
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in got] == [
        ("ADDED", "4"), ("BOOKMARK", "4")]
    kept.release()


async def test_a_filtered_watch_gets_bookmarks_while_filtered_out_events_flow(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """Only a line sent to a watch puts its next bookmark off. Any event did, the ones
    its namespace or field selector drops too: a watch of a quiet namespace got no
    bookmark at all while another namespace churned."""
    resp = await raw(api, "/api/v1/namespaces/quiet/pods", watch="1",
                     resourceVersion=str(sim.resource_version), allowWatchBookmarks="true",
                     timeoutSeconds="1.5")
    for i in range(30):  # 1.5 s of churn elsewhere, an event every 0.05 s
        sim.create(pod(f"busy{i}", ns="busy"))
        await asyncio.sleep(0.05)
    lines = (await asyncio.wait_for(resp.read(), 5)).splitlines()
    kinds = [json.loads(x)["type"] for x in lines]
    assert set(kinds) == {"BOOKMARK"} and len(kinds) >= 3, kinds  # every 0.2 s


async def test_served_from_the_command_line_with_a_snapshots_objects(tmp_path: Path) -> None:
    """``python -m tests.kubesim`` (docs/kubernetes.md, "Trying it without a cluster"):
    the demo snapshot's objects, CRD kinds included, listed as a cluster's, and a stop
    by SIGTERM."""
    kubeconfig = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.kubesim", "--kubeconfig", str(kubeconfig),
        cwd=Path(__file__).resolve().parents[2], stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert "34 objects of" in line and kubeconfig.exists(), line
        cfg = k8s.Configuration()
        await k8s_config.load_kube_config(str(kubeconfig), client_configuration=cfg)
        async with k8s.ApiClient(cfg) as api:
            custom = k8s.CustomObjectsApi(api)
            jobs = await custom.list_cluster_custom_object("ray.io", "v1", "rayjobs")
            assert [j["metadata"]["name"] for j in jobs["items"]] == ["llm-finetune"]
            pods = await k8s.CoreV1Api(api).list_pod_for_all_namespaces()
            assert len(pods.items) == 16
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0


async def test_without_progress_notifications_a_quiet_kinds_watch_gets_no_bookmark(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``progress_notify = False``: a watch's bookmarks carry its kind's last change and
    come only once that is newer than the version the watch started from, as
    kube-apiserver's watch cache sends them when etcd sends it no progress
    notifications. A watch of pods from the store's version (a Job changed last) gets
    none while only Jobs change, then bookmarks once a pod changed."""
    sim.progress_notify = False
    sim.create(pod("p"))

    def job(name: str) -> dict[str, Any]:
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}}

    sim.create(job("j0"))
    rv = str(sim.resource_version)
    resp = await raw(api, "/api/v1/pods", watch="1", resourceVersion=rv,
                     allowWatchBookmarks="true", timeoutSeconds="1")
    for i in range(1, 4):
        sim.create(job(f"j{i}"))
        await asyncio.sleep(0.2)
    assert await asyncio.wait_for(resp.read(), 5) == b""  # 1 s, bookmarks every 0.2 s
    resp = await raw(api, "/api/v1/pods", watch="1", resourceVersion=rv,
                     allowWatchBookmarks="true", timeoutSeconds="1")
    q = sim.create(pod("q"))
    sim.create(job("j9"))
    got = [json.loads(x) for x in (await asyncio.wait_for(resp.read(), 5)).splitlines()]
    assert got[0]["type"] == "ADDED" and {e["type"] for e in got[1:]} == {"BOOKMARK"}
    assert len(got) >= 3
    assert {e["object"]["metadata"]["resourceVersion"] for e in got} == {
        q["metadata"]["resourceVersion"]}


async def test_an_object_leaving_a_watchs_selection_is_deleted_with_its_last_content(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """A change that moves an object out of a filtered watch's selection reaches it as
    DELETED carrying the object as it was before (still matching), at the change's
    resourceVersion, as kube-apiserver's watch cache sends it; the simulator sent the
    new content, which the selector does not match."""
    p = sim.create(pod("p", app="a"))
    resp = await raw(api, "/api/v1/pods", watch="1", labelSelector="app=a",
                     resourceVersion=p["metadata"]["resourceVersion"])
    p["metadata"]["labels"] = {"app": "b"}
    moved = sim.update(p)
    [got] = await events(resp, 1)
    resp.release()
    assert got["type"] == "DELETED"
    md = got["object"]["metadata"]
    assert md["labels"] == {"app": "a"}
    assert md["resourceVersion"] == moved["metadata"]["resourceVersion"]


async def test_a_429_of_api_priority_and_fairness_is_plain_text(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """``fail_resource(..., plain=True)``: kube-apiserver's API priority and fairness and
    max-in-flight filters reject with ``http.Error``: a text/plain body, no Status, the
    Retry-After header the only word of how long."""
    sim.fail_resource(POD, 429, retry_after=2, plain=True)
    resp = await raw(api, "/api/v1/pods")
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert resp.content_type == "text/plain"
    assert await resp.text() == "Too many requests, please try again later.\n"
    sim.fail_resource(POD, None)
    assert (await raw(api, "/api/v1/pods")).status == 200


async def test_an_expired_continue_token_is_answered_with_an_inconsistent_one(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """A continue token whose version was compacted gets 410 Expired whose Status holds
    a continue token (``metadata.continue``) for the rest of the list after the dead
    token's key, at the store's version now (``handleCompactedErrorForPaging``): what
    changed since the first page shows up, an inconsistent list."""
    for name in ("a", "b", "c"):
        sim.create(pod(name))
    core = k8s.CoreV1Api(api)
    first = await core.list_namespaced_pod("default", limit=1)
    sim.compact()  # the list's version compacted away
    sim.delete(pod("b"))
    sim.create(pod("d"))
    with pytest.raises(ApiException) as raised:
        await core.list_namespaced_pod("default", limit=1,
                                       _continue=first.metadata._continue)
    assert _expired(raised.value)
    status = json.loads(raised.value.body or b"{}")
    assert "inconsistent list" in status["message"]
    assert [status["metadata"]["continue"]] == sim.inconsistent_tokens
    rest = await core.list_namespaced_pod("default", limit=5,
                                          _continue=status["metadata"]["continue"])
    assert [p.metadata.name for p in rest.items] == ["c", "d"]
    assert rest.metadata.resource_version == str(sim.resource_version)


async def test_a_crd_served_at_two_versions_then_one(sim: KubeSim, api: k8s.ApiClient) -> None:
    """A CRD upgrade's middle step: both versions served, one group entry listing them
    by priority (v1 preferred), the same objects at either path; then the old one no
    longer served (404) and its open watch ended."""
    sim.register(RAY_JOB)
    sim.serve_versions(RAY_JOB, "v1", "v1alpha1")
    sim.create({"apiVersion": "ray.io/v1", "kind": "RayJob",
                "metadata": {"name": "a", "namespace": "ml"}})
    groups = (await k8s.ApisApi(api).get_api_versions()).groups
    ray = [g for g in groups if g.name == "ray.io"]
    assert len(ray) == 1
    assert [v.version for v in ray[0].versions] == ["v1", "v1alpha1"]
    assert ray[0].preferred_version.version == "v1"
    for version in ("v1", "v1alpha1"):
        body = json.loads(await (await raw(api, f"/apis/ray.io/{version}/rayjobs")).read())
        assert [o["metadata"]["name"] for o in body["items"]] == ["a"]
    watch = await raw(api, "/apis/ray.io/v1alpha1/rayjobs", watch="1", resourceVersion="0")
    assert (await events(watch, 1))[0]["type"] == "ADDED"
    sim.serve_versions(RAY_JOB, "v1")
    with pytest.raises(aiohttp.ClientPayloadError):  # ended, as storage rebuilt
        await events(watch, 1)
    assert (await raw(api, "/apis/ray.io/v1alpha1/rayjobs")).status == 404


async def test_a_crd_deleted_deletes_its_objects_then_ends_its_watches(
        sim: KubeSim, api: k8s.ApiClient) -> None:
    """As kube-apiserver's CRD finalizer: each object's DELETED on the open watch, then a
    clean end; the kind is no longer discovered, its path 404. Its objects vanished
    without an event (the watch cut) before."""
    sim.register(RAY_JOB)
    sim.create({"apiVersion": "ray.io/v1", "kind": "RayJob",
                "metadata": {"name": "a", "namespace": "ml"}})
    watch = await raw(api, "/apis/ray.io/v1/rayjobs", watch="1", resourceVersion="0")
    assert (await events(watch, 1))[0]["type"] == "ADDED"
    sim.unregister(RAY_JOB)
    got = await events(watch, 2)  # reads to the clean end: one event, no error
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in got] == [("DELETED", "a")]
    assert "ray.io" not in {g.name for g in (await k8s.ApisApi(api).get_api_versions()).groups}
    assert (await raw(api, "/apis/ray.io/v1/rayjobs")).status == 404
