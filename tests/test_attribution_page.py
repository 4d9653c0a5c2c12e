"""The attribution status page and its JSON twins, on the demo snapshot in-process: the
answers, the errors, escaping of what the cluster names, and the page in headless Chromium
(searched through its form, read as rendered, kept as a screenshot)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import Settings
from proxy.demo import BUNDLED_SNAPSHOT
from proxy.karta.results import ChangeSet
from proxy.runtime import Proxy
from tests.peers.conftest import free_port, wait_until

#: a pod whose every name is markup: the page must show it as text
EVIL_NAME = "<script>alert(1)</script>"
EVIL_NS = 'evil"><b>ns'
EVIL_KIND = "<img src=x onerror=alert(2)>"
EVIL_OWNER = "</td><script>alert(3)</script>"
EVIL_POD = f"""apiVersion: v1
kind: Pod
metadata:
  name: "{EVIL_NAME}"
  namespace: '{EVIL_NS}'
  uid: evil-pod-1
  labels: {{x: "<i>"}}
  ownerReferences:
  - {{apiVersion: evil.example/v1, kind: "{EVIL_KIND}", name: "{EVIL_OWNER}",
     uid: evil-owner-1, controller: true}}
spec: {{containers: [{{name: c, image: x}}]}}
status: {{phase: Running}}
"""


@pytest.fixture
async def proxy(running: Proxy) -> str:
    """``running``'s base URL."""
    return f"http://127.0.0.1:{running.port}"


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Proxy]:
    """karta-proxy on the demo snapshot plus the hostile pod."""
    snap = tmp_path / "snapshot"
    snap.mkdir()
    shutil.copy(BUNDLED_SNAPSHOT, snap / "demo.yaml")
    (snap / "evil.yaml").write_text(EVIL_POD)
    s = Settings()
    s.snapshot = str(snap)
    s.upstream.url = "http://127.0.0.1:9/api/v1/write"  # nothing is written in these tests
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    p = Proxy(s)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def _get(url: str, **params: str) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as s, s.get(
        url, params=params, timeout=aiohttp.ClientTimeout(total=10)
    ) as r:
        text = await r.text()
        body = await r.json() if r.content_type == "application/json" else None
        return r.status, text, (body, r.headers)


async def test_api_explains_an_attributed_pod(proxy: str) -> None:
    status, _, (body, _) = await _get(proxy + "/api/v1/attribution", namespace="web",
                                      pod="frontend-6d8f7b9c5d-4xkqp")
    assert status == 200 and body["status"] == "success"
    d = body["data"]
    assert d["attributed"] is True and d["reason"] == ""
    assert {k: d["workload"][k] for k in ("kind", "group", "name", "namespace")} == {
        "kind": "Deployment", "group": "apps", "name": "frontend", "namespace": "web"}
    assert (d["component"], d["instance"], d["description"]) == (
        "deployment", "", "builtin-apps-deployment")
    assert [(c["kind"], c["name"], c["description"], c["workload"]) for c in d["chain"]] == [
        ("ReplicaSet", "frontend-6d8f7b9c5d", "builtin-apps-replicaset", False),
        ("Deployment", "frontend", "builtin-apps-deployment", True),
    ]
    assert d["walk_end"] == "top_reached"
    idx = d["index"]
    assert idx["ready"] is True and idx["stale"] is False
    assert [f["resource"] for f in idx["freshness"]] == ["snapshot"]
    assert 0 <= idx["freshness"][0]["age_seconds"] < 60


async def test_api_explains_an_unattributed_pod_and_lists_them(proxy: str) -> None:
    status, _, (body, _) = await _get(proxy + "/api/v1/attribution", namespace="ml",
                                      pod="allreduce-bench-worker-0")
    assert status == 200
    d = body["data"]
    assert d["attributed"] is False and d["workload"] is None
    assert d["reason"] == "no_described_owner"
    assert [(c["kind"], c["described"]) for c in d["chain"]] == [("MPIJob", False)]

    status, _, (body, _) = await _get(proxy + "/api/v1/attribution/unattributed")
    assert status == 200
    d = body["data"]
    assert d["total"] == 2
    by_reason = {r["reason"]: r for r in d["reasons"]}
    assert set(by_reason) == {"no_described_owner", "owner_missing"}
    assert by_reason["no_described_owner"]["pods"] == [
        {"namespace": "ml", "pod": "allreduce-bench-worker-0",
         "uid": "c7c521eb-58c8-5155-a056-66de81b20ee1"}]
    assert by_reason["owner_missing"]["pods"][0]["pod"] == EVIL_NAME
    assert not any(r["truncated"] for r in d["reasons"])
    status, _, (body, _) = await _get(proxy + "/api/v1/attribution/unattributed", limit="1")
    assert status == 200 and all(len(r["pods"]) == 1 for r in body["data"]["reasons"])


async def test_the_unattributed_listings_are_built_off_the_loop_once_per_index_change(
    running: Proxy, proxy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built on the event loop per view, 4 clients fetching the 45k-pod listing raised the
    relayed writes' p50 from 3.9 to 62 ms (a 45k-pod snapshot, 5000 unattributed).
    Now a thread builds it from a copy of the pod list, once per change of the index."""
    from proxy import attribution_page

    threads: list[str] = []
    real = getattr(attribution_page, "unattributed_of", None)

    def spy(pods: Any, limit: int = attribution_page.LIST_LIMIT) -> Any:
        threads.append(threading.current_thread().name)
        assert real is not None
        return real(pods, limit)

    monkeypatch.setattr(attribution_page, "unattributed_of", spy, raising=False)
    url = proxy + "/api/v1/attribution/unattributed"
    first = await asyncio.gather(*(_get(url) for _ in range(4)))
    assert {f[0] for f in first} == {200}
    assert len(threads) == 1, threads  # four views, one build
    assert threads[0] != threading.main_thread().name
    await _get(url)
    await _get(proxy + "/attribution")  # the page's listing is cut from the same build
    await _get(proxy + "/attribution")
    # every limit too: a client cycling it made a whole build per request (14-72 ms at
    # 10k-80k unattributed pods, one build at a time for every view)
    for limit in range(1, 21):
        status, _, (body, _) = await _get(url, limit=str(limit))
        assert status == 200 and all(len(r["pods"]) <= limit for r in body["data"]["reasons"])
    assert len(threads) == 1, threads
    # the index changes: built again, and the answer follows
    att = next(a for a in running.index.pods.values() if a.pod == "allreduce-bench-worker-0")
    running.index.apply(ChangeSet(pods={att.uid: None}))
    status, _, (body, _) = await _get(url)
    assert status == 200 and body["data"]["total"] == 1, body
    assert len(threads) == 2
    assert body["data"]["index"]["ready"] is True


def _old_reasons_json(groups: list[Any]) -> str:
    """The ``reasons`` list as the JSON answer made it before its pods were serialized once
    per generation: ``json.dumps`` of the listing cut to the limit (per request)."""
    return json.dumps([
        {"reason": g.reason, "count": g.count, "truncated": g.count > len(g.pods),
         "pods": [{"namespace": a.namespace, "pod": a.pod, "uid": a.uid} for a in g.pods]}
        for g in groups
    ])


def _old_answer(groups: list[Any], index_json: str) -> bytes:
    total = sum(g.count for g in groups)
    return (f'{{"status": "success", "data": {{"total": {total}, "reasons": '
            f'{_old_reasons_json(groups)}, "index": {index_json}}}}}').encode()


def _hostile_pods() -> list[Any]:
    """Unattributed pods of three reasons (and one attributed) whose names need every kind
    of JSON escape: quotes, backslashes, control characters, non-ASCII, astral plane."""
    from proxy.karta.results import PodAttribution, WorkloadRef

    odd = ['"', "\\", "\n\t\x00\x1f\x7f", "é", "日本", "\U0001f600", "</script>", "\u2028", ""]
    pods = [PodAttribution(f"ns{i % 4}{odd[i % len(odd)]}", f"pod-{i:03d}{odd[(i * 7) % len(odd)]}",
                           f"uid-{i}{odd[(i * 5) % len(odd)]}",
                           reason=("owner_missing", "no_described_owner", "")[i % 3])
            for i in range(60)]
    pods += [PodAttribution("ns", f"late-{i}", f"late-{i}", reason="hop_limit") for i in range(2)]
    pods.append(PodAttribution("ns", "placed", "placed-uid",
                               workload=WorkloadRef("ns", "apps", "Deployment", "d", "d-uid")))
    return pods


@pytest.mark.parametrize("size", [0, 1, 63])
def test_every_limit_answers_the_bytes_json_dumps_made(size: int) -> None:
    """The JSON answer is cut from pods serialized once per generation (``json_listing``):
    byte for byte what ``json.dumps`` of the listing cut to the limit made per request, for
    every limit (0, 1, each count, all, over all) and an empty listing; the page's listing
    is the HTML it was."""
    from proxy.attribution_page import (
        LIST_LIMIT,
        MAX_LIST_LIMIT,
        _unattributed_html,
        at_most,
        json_listing,
        page_listing,
        unattributed_of,
    )

    pods = _hostile_pods()[:size]
    groups = unattributed_of(pods, None)
    assert size < 63 or sorted(g.count for g in groups) == [2, 20, 20, 20]
    listing = json_listing(groups)
    index_json = json.dumps({"ready": True, "stale": False, "freshness": []})
    counts = {g.count for g in groups}
    limits = set(range(0, 25)) | {c + d for c in counts for d in (-1, 0, 1)} | {
        size, size + 1, LIST_LIMIT, MAX_LIST_LIMIT}
    for limit in sorted(x for x in limits if x >= 0):
        cut = at_most(groups, limit)
        assert listing.answer(limit, index_json) == _old_answer(cut, index_json), limit
        assert b"".join(listing.reasons(limit)).decode() == _old_reasons_json(cut), limit
    assert page_listing(groups) == _unattributed_html(unattributed_of(pods, LIST_LIMIT))
    if size == 0:
        assert listing.answer(5, index_json) == (
            b'{"status": "success", "data": {"total": 0, "reasons": [], "index": '
            + index_json.encode() + b"}}")


async def test_the_listing_is_serialized_once_per_index_change_whatever_the_limit(
    running: Proxy, proxy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Renderings were kept by (view, limit), 8 at most: a client changing ``limit`` per
    request had the whole listing ``json.dumps``-ed per request (~57 ms at 40k pods, one C
    call holding the GIL: the relayed writes' p99 went from 5.0 to 79 ms, the audit's
    run_listing_repro.sh). Now 20 limits and the page cost one serialization each per
    generation of the index, and each answer is the bytes it was."""
    from proxy import attribution_page

    made: list[str] = []

    def spy(what: str, real: Any) -> Any:
        def render(groups: Any) -> Any:
            made.append(what)
            return real(groups)
        return render

    for name in ("json_listing", "page_listing"):
        monkeypatch.setattr(attribution_page, name, spy(name, getattr(attribution_page, name)))
    url = proxy + "/api/v1/attribution/unattributed"
    pods = list(running.index.pods.values())
    for limit in range(1, 21):
        # odd limits: the answer written in steps of 100 bytes (as one of 40k pods is)
        monkeypatch.setattr(attribution_page, "ANSWER_STEP", 100 if limit % 2 else 256 * 1024)
        async with aiohttp.ClientSession() as s, s.get(url, params={"limit": str(limit)}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == \
                "application/json; charset=utf-8"
            body = await r.read()
            assert r.headers["Content-Length"] == str(len(body))
        # the index's freshness is of the moment of each answer: the rest is fixed
        index_json = body.rsplit(b', "index": ', 1)[1]
        groups = attribution_page.unattributed_of(pods, limit)
        assert body == _old_answer(groups, index_json[:-2].decode()), limit
    await _get(proxy + "/attribution")
    await _get(proxy + "/attribution", namespace="web", pod="postgres-0")
    assert sorted(made) == ["json_listing", "page_listing"], made
    # the index changes: one more of each, and the answer follows
    att = next(a for a in running.index.pods.values() if a.pod == "allreduce-bench-worker-0")
    running.index.apply(ChangeSet(pods={att.uid: None}))
    for limit in (1, 2, 3):
        status, _, (body, _) = await _get(url, limit=str(limit))
        assert status == 200 and body["data"]["total"] == 1
    _, page, _ = await _get(proxy + "/attribution")
    assert "Unattributed pods (1)" in page
    assert sorted(made) == ["json_listing", "json_listing", "page_listing", "page_listing"]


async def test_landing_and_attribution_pages_count_the_pods_alike(
    running: Proxy, proxy: str,
) -> None:
    """The landing page said "pods in index: 15" (the attributed ones), the attribution
    page "pods: 16" (all) of the same index: both say both now."""
    import re

    known = len(running.index.pods)
    attributed = sum(1 for a in running.index.pods.values() if a.workload is not None)
    assert attributed < known
    want = f"{attributed} attributed / {known} in all"
    _, landing, _ = await _get(proxy + "/")
    _, page, _ = await _get(proxy + "/attribution")
    assert re.search(rf"<th>pods in index</th><td>{want}</td>", landing), landing
    assert f"pods: {want};" in page


async def test_a_deleted_pod_is_said_to_be_deleted_with_the_stamp_its_name_still_gives(
    running: Proxy, proxy: str,
) -> None:
    """A deleted pod's name stamps its late series for karta.tombstone_seconds; the API
    said "no pod ... in the index" meanwhile (found by the docs audit)."""
    att = next(a for a in running.index.pods.values() if a.pod == "postgres-0")
    stamp = dict(running.index.lookup(att.namespace.encode(), b"postgres-0") or ())
    assert stamp
    running.index.apply(running.engine.delete(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"uid": att.uid}}))
    status, _, (body, _) = await _get(proxy + "/api/v1/attribution",
                                      namespace=att.namespace, pod="postgres-0")
    assert status == 404 and body["errorType"] == "not_found"
    assert "was deleted" in body["error"] and "karta.tombstone_seconds" in body["error"]
    tomb = body["tombstone"]
    assert tomb["uid"] == att.uid and tomb["labels"] == stamp
    assert 0 < tomb["seconds_left"] <= running.settings.karta.tombstone_seconds
    status, text, _ = await _get(proxy + "/attribution", namespace=att.namespace,
                                 pod="postgres-0")
    assert status == 404 and "was deleted" in text


async def test_api_errors(proxy: str) -> None:
    status, _, (body, _) = await _get(proxy + "/api/v1/attribution", namespace="web",
                                      pod="nope")
    assert status == 404
    assert body == {"status": "error", "errorType": "not_found",
                    "error": "no pod web/nope in the index"}
    for params in ({}, {"namespace": "web"}, {"pod": "postgres-0"},
                   {"namespace": "", "pod": "postgres-0"}):
        status, _, (body, _) = await _get(proxy + "/api/v1/attribution", **params)
        assert status == 400 and body["errorType"] == "bad_data", params
    for limit in ("0", "x", "-1", "100001"):
        status, _, (body, _) = await _get(proxy + "/api/v1/attribution/unattributed",
                                          limit=limit)
        assert status == 400 and body["errorType"] == "bad_data", limit


async def test_every_json_answer_says_it_is_json_and_nothing_else(proxy: str) -> None:
    """They quote the query and the cluster's names: a browser must not sniff them as
    HTML (X-Content-Type-Options), errors and successes alike."""
    for path, params in (("/api/v1/attribution", {"namespace": "web", "pod": "nope"}),
                         ("/api/v1/attribution", {"namespace": "<b>"}),
                         ("/api/v1/attribution/unattributed", {}),
                         ("/api/v1/attribution/unattributed", {"limit": "<script>"})):
        _, _, (body, headers) = await _get(proxy + path, **params)
        assert body is not None, (path, params)
        assert headers["X-Content-Type-Options"] == "nosniff", (path, params)


async def test_page_escapes_what_the_cluster_names(proxy: str) -> None:
    status, text, (_, headers) = await _get(proxy + "/attribution", namespace=EVIL_NS,
                                            pod=EVIL_NAME)
    assert status == 200
    assert "script-src" not in headers["Content-Security-Policy"]  # no script allowed
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    for raw in (EVIL_NAME, EVIL_NS, EVIL_KIND, EVIL_OWNER, "<i>", "<script"):
        assert raw not in text, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;img src=x onerror=alert(2)&gt;" in text
    assert "owner_missing" in text
    # the form keeps the search, escaped inside the attribute
    assert 'value="evil&quot;&gt;&lt;b&gt;ns"' in text
    # the unattributed list links to the pod, its query string escaped too
    assert "namespace=evil%22%3E%3Cb%3Ens&amp;pod=%3Cscript%3Ealert%281%29%3C%2Fscript%3E" \
        in text


async def test_page_status_codes_and_landing_link(proxy: str) -> None:
    status, text, _ = await _get(proxy + "/attribution")
    assert status == 200 and "Unattributed pods (2)" in text and 'id="result"' not in text
    status, text, _ = await _get(proxy + "/attribution", namespace="web", pod="nope")
    assert status == 404 and "no pod web/nope in the index" in text
    status, text, _ = await _get(proxy + "/attribution", namespace="web")
    assert status == 400 and "both namespace and pod are required" in text
    status, text, _ = await _get(proxy + "/")
    assert status == 200 and '<a href="/attribution">' in text


# -- headless Chromium, over WebDriver (chromedriver's HTTP API; no client library) -------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


class WebDriver:
    """The few WebDriver commands the test needs, over chromedriver's HTTP API."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base, self.session = http, base, ""

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base}/session/{self.session}{path}" if self.session else self.base + path
        async with self.http.request(method, url, json=body) as r:
            out = await r.json()
            if r.status != 200:
                raise AssertionError(f"WebDriver {method} {path}: {r.status} {out}")
            return out["value"]

    async def start(self, profile: Path) -> None:
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1200,1400",
                f"--user-data-dir={profile}"]
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args}}}}
        self.session = (await self.call("POST", "/session", caps))["sessionId"]

    async def find(self, css: str) -> str:
        el = await self.call("POST", "/element", {"using": "css selector", "value": css})
        return str(el[ELEMENT])

    async def text(self, css: str) -> str:
        return str(await self.call("GET", f"/element/{await self.find(css)}/text"))


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[WebDriver]:
    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(binary, os.X_OK):
            pytest.skip(f"{binary} not installed (Debian package: {package})")
    port = free_port()
    driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            wd = WebDriver(http, f"http://127.0.0.1:{port}")

            async def up() -> bool:
                return bool((await wd.call("GET", "/status"))["ready"])

            await wait_until(up, timeout=60, what="chromedriver")
            await wd.start(tmp_path / "chromium-profile")
            try:
                yield wd
            finally:
                await wd.call("DELETE", "")
    finally:
        driver.terminate()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


async def test_page_in_headless_chromium(proxy: str, browser: WebDriver,
                                         tmp_path: Path) -> None:
    wd = browser
    await wd.call("POST", "/url", {"url": proxy + "/"})
    landing_link = await wd.find('a[href="/attribution"]')
    await wd.call("POST", f"/element/{landing_link}/click", {})
    unattributed = await wd.text("#unattributed")
    assert "Unattributed pods (2)" in unattributed
    assert "no_described_owner (1)" in unattributed and "ml/allreduce-bench-worker-0" in \
        unattributed
    assert "snapshot" in await wd.text("#index")

    # search a pod through the form
    for name, value in (("namespace", "ml"), ("pod", "llm-finetune-raycluster-k7x2p-head-8jz5c")):
        el = await wd.find(f"input[name={name}]")
        await wd.call("POST", f"/element/{el}/clear", {})
        await wd.call("POST", f"/element/{el}/value", {"text": value})
    await wd.call("POST", f"/element/{await wd.find('#search button')}/click", {})

    async def searched() -> bool:
        return "pod=llm-finetune" in str(await wd.call("GET", "/url"))

    await wait_until(searched, timeout=30, what="the search page")
    answer = await wd.text("#answer")
    assert "RayJob.ray.io ml/llm-finetune" in answer
    assert "demo-rayjob" in answer
    chain = (await wd.text("#chain")).splitlines()
    assert chain[0].startswith("Pod ml/llm-finetune-raycluster-k7x2p-head-8jz5c")
    assert chain[1].startswith("RayCluster.ray.io llm-finetune-raycluster-k7x2p")
    assert "not described" in chain[1]
    assert chain[2].startswith("RayJob.ray.io llm-finetune") and "workload" in chain[2]
    assert "top_reached" in await wd.text("#walk-end")

    shot = base64.b64decode(await wd.call("GET", "/screenshot"))
    assert shot.startswith(b"\x89PNG")
    out_dir = Path(os.environ.get("ARTIFACTS_DIR") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attribution-page.png"
    path.write_bytes(shot)
    print(f"attribution page screenshot: {path}")

    # the hostile pod, rendered: its names show as text, nothing runs
    unattributed = await wd.text("#unattributed")
    assert f"{EVIL_NS}/{EVIL_NAME}" in unattributed
    link = await wd.find("#unattributed a[href*='evil']")
    await wd.call("POST", f"/element/{link}/click", {})

    async def followed() -> bool:
        return "evil-owner" not in str(await wd.call("GET", "/url")) and "pod=%3Cscript" in \
            str(await wd.call("GET", "/url"))

    await wait_until(followed, timeout=30, what="the hostile pod's page")
    assert f"{EVIL_NS}/{EVIL_NAME}" in await wd.text("#result h2")
    assert EVIL_OWNER in await wd.text("#chain")
    async with wd.http.get(f"{wd.base}/session/{wd.session}/alert/text") as r:
        assert r.status == 404 and (await r.json())["value"]["error"] == "no such alert"


def test_without_an_engine_the_index_answers_alone() -> None:
    """build_app without ``explain`` (tests, embedders): the answer, no chain."""
    from proxy.attribution_page import find_pod, report_json
    from proxy.index import PodIndex
    from proxy.karta.engine import Engine
    from proxy.snapshot import load_snapshot

    index = PodIndex()
    index.apply(load_snapshot(BUNDLED_SNAPSHOT, Engine()).changes)
    report = find_pod(index, None, "web", "postgres-1")
    assert report is not None and report.explanation is None
    data = report_json(report, index, 0.0)
    assert data["workload"]["name"] == "postgres" and data["chain"] is None
    assert find_pod(index, None, "web", "nope") is None


class _NoScan(dict[Any, Any]):
    """A pod table that fails a scan: the views must find a pod by its name, not walk all
    of them on the event loop (3-4 ms each at 45k pods; 4 clients viewing one pod in a loop
    added 15 ms to the relayed writes' p50)."""

    def values(self) -> Any:
        raise AssertionError("a scan of every pod")


async def test_one_pods_view_finds_it_without_a_scan(
    running: Proxy, proxy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.karta.engine import Engine

    real = Engine.explain
    uids: list[str | None] = []

    def spy(self: Engine, namespace: str, pod: str, uid: str | None = None) -> Any:
        uids.append(uid)
        found = self._pods.get(uid) if uid else None  # what explain finds without a scan
        assert found is not None and (found.namespace, found.name) == (namespace, pod)
        return real(self, namespace, pod, uid)

    monkeypatch.setattr(Engine, "explain", spy)
    for ns, pod in (("web", "frontend-6d8f7b9c5d-4xkqp"), ("ml", "allreduce-bench-worker-0")):
        status, _, (body, _) = await _get(proxy + "/api/v1/attribution", namespace=ns, pod=pod)
        assert status == 200 and body["data"]["chain"] is not None, body
        assert uids[-1] == body["data"]["uid"]


def test_without_an_engine_the_index_finds_the_pod_by_name() -> None:
    from proxy.attribution_page import find_pod
    from proxy.index import PodIndex
    from proxy.karta.engine import Engine
    from proxy.snapshot import load_snapshot

    index = PodIndex()
    index.apply(load_snapshot(BUNDLED_SNAPSHOT, Engine()).changes)
    index.pods = _NoScan(index.pods)
    for ns, pod in (("web", "postgres-1"), ("ml", "allreduce-bench-worker-0")):
        report = find_pod(index, None, ns, pod)
        assert report is not None and report.attribution.pod == pod
    assert find_pod(index, None, "web", "nope") is None


def test_the_routes_are_in_the_operations_endpoints_table() -> None:
    from proxy.attribution_page import API_PATH, PAGE_PATH, UNATTRIBUTED_API_PATH

    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `GET ")]
    for path in (PAGE_PATH, API_PATH, UNATTRIBUTED_API_PATH):
        assert any(row.startswith(f"| `GET {path}") for row in rows), path


async def test_before_the_index_is_ready_no_pod_is_said_attributed(
        running: Proxy, proxy: str) -> None:
    """A half-listed index (pods before their ReplicaSets) walks a pod up to its owner not
    listed yet as its workload: an audit's start (``forward_before_ready``, so ready for a
    Service) showed a pod "attributed" to ReplicaSet/web-1. Until the index is ready the
    page and its JSON twins answer 503 saying so, and the landing page counts no pod
    attributed."""
    running.index.ready = False
    try:
        status, _, (body, _) = await _get(proxy + "/api/v1/attribution", namespace="web",
                                          pod="frontend-6d8f7b9c5d-4xkqp")
        assert status == 503 and body["errorType"] == "unavailable"
        assert "not ready yet" in body["error"]
        status, _, (body, _) = await _get(proxy + "/api/v1/attribution/unattributed")
        assert status == 503 and body["errorType"] == "unavailable"
        status, text, _ = await _get(proxy + "/attribution", namespace="web",
                                     pod="frontend-6d8f7b9c5d-4xkqp")
        assert status == 503 and "not ready yet" in text
        assert "builtin-apps-deployment" not in text
        status, text, _ = await _get(proxy + "/")
        assert status == 200 and "known so far (the index is loading)" in text
        assert " attributed / " not in text
    finally:
        running.index.ready = True
    status, text, _ = await _get(proxy + "/")
    assert " attributed / " in text
