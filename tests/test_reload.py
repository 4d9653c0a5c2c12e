"""Reload (proxy/reload.py, Proxy.reload in proxy/runtime.py): SIGHUP and POST /-/reload
read the configuration and the description files again, apply what is live, keep the
rest until a restart, and keep everything when the new configuration is invalid.

In-process for the logic (the assembled proxy, a real HTTP server, a scripted upstream);
one test runs the real ``karta-proxy`` process and sends it SIGHUP."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.cli import build_parser, settings_from_args
from proxy.config import Settings, load_settings, validate
from proxy.reload import changed_keys, merge
from proxy.runtime import Proxy
from proxy.sender import Series, decode_v1, send_series
from proxy.server import LIFECYCLE_DISABLED
from tests.karta.descriptions import RAYJOB_KARTA, TRAINER_KARTA
from tests.karta.runs import record_runs
from tests.process import stop
from tests.proxy_harness import CART, SNAPSHOT
from tests.scripted import ScriptedUpstream

REPO = Path(__file__).resolve().parents[1]
CART_POD = {"__name__": "up", "namespace": "shop", "pod": "cart-7d9f8-abcde"}
#: the cart pod named through other labels than the default pairs
CART_OTHER = {"__name__": "up", "app_ns": "shop", "app_pod": "cart-7d9f8-abcde"}

#: a user description of Deployment: it wins over the built-in; its component is "web"
WEB_DEPLOYMENT = """\
apiVersion: run.ai/v1alpha1
kind: Karta
metadata: {name: my-deployment}
spec:
  structureDefinition:
    rootComponent:
      name: web
      kind: {group: apps, version: v1, kind: Deployment}
      specDefinition: {podTemplateSpecPath: .spec.template}
    additionalChildKinds:
      - {group: apps, version: v1, kind: ReplicaSet}
"""

RELOADS_OK = "karta_proxy_config_last_reload_successful"
RELOAD_TS = "karta_proxy_config_last_reload_success_timestamp_seconds"
RESTART = "karta_proxy_config_restart_required"


# -- which keys are live ---------------------------------------------------------------------


def test_merge_applies_live_keys_and_keeps_the_rest() -> None:
    running = Settings()
    loaded = Settings()
    loaded.server.listen_address = "127.0.0.1:1"
    loaded.server.worker_threads = 3
    loaded.upstream.url = "http://elsewhere/api/v1/write"
    loaded.enrich.conflict_policy = "keep"
    loaded.enrich.pod_label_pairs = [("a", "b")]
    loaded.karta.builtins = False
    loaded.log_level = "debug"
    m = merge(running, loaded)
    assert set(m.applied) == {"enrich.conflict_policy", "enrich.pod_label_pairs",
                              "karta.builtins", "log_level"}
    assert set(m.restart_required) == {"server.listen_address", "server.worker_threads",
                                       "upstream.url"}
    assert m.settings.server.listen_address == running.server.listen_address
    assert m.settings.server.worker_threads == 0
    assert m.settings.upstream.url == ""
    assert m.settings.enrich.pod_label_pairs == [("a", "b")]
    assert m.settings.log_level == "debug"
    # the running settings are not touched, and the merge shares nothing with the loaded
    assert running.enrich.conflict_policy == "replace"
    loaded.enrich.pod_label_pairs.append(("c", "d"))
    assert m.settings.enrich.pod_label_pairs == [("a", "b")]
    assert changed_keys(running, Settings()) == []


# -- the assembled proxy ----------------------------------------------------------------------


@dataclass
class Running:
    proxy: Proxy
    upstream: ScriptedUpstream
    config: Path
    base: str
    session: aiohttp.ClientSession

    def metric(self, name: str) -> float:
        v = self.proxy.metrics.registry.get_sample_value(name, {})
        assert v is not None, name
        return v

    def write_config(self, **extra: Any) -> None:
        """The test's config file: the fixture's keys, with ``extra`` sections merged in."""
        data: dict[str, Any] = {
            "snapshot": str(self.config.parent / "snap.yaml"),
            "upstream": {"url": self.upstream.url, "timeout_seconds": 5.0},
            "server": {"listen_address": "127.0.0.1:0", "enable_lifecycle": True},
            "facts": {"enabled": False},
        }
        for k, v in extra.items():
            data[k] = {**data[k], **v} if isinstance(v, dict) and k in data else v
        self.config.write_text(yaml.safe_dump(data))

    async def send(self, labels: dict[str, str]) -> dict[str, str]:
        """One series through the proxy; the labels the upstream got."""
        before = len(self.upstream.received)
        status, _, body = await send_series(self.base + "/api/v1/write",
                                            [Series(labels, [(1000, 1.0)])],
                                            session=self.session)
        assert status == 204, body
        (got,) = decode_v1(self.upstream.received[before].raw)
        return dict(got.labels)

    async def post_reload(self) -> tuple[int, str]:
        async with self.session.post(self.base + "/-/reload") as r:
            return r.status, await r.text()


def _loader(path: Path) -> Any:
    def load() -> Settings:
        s = load_settings(path)
        validate(s)
        return s

    return load


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    (tmp_path / "descriptions").mkdir()
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        r = Running(None, up, config, "", session)  # type: ignore[arg-type]
        r.write_config(karta={"description_paths": [str(tmp_path / "descriptions")]})
        p = Proxy(_loader(config)(), loader=_loader(config))
        await p.start()
        r.proxy, r.base = p, f"http://127.0.0.1:{p.port}"
        try:
            yield r
        finally:
            await p.stop()


async def test_descriptions_and_enrich_change_on_reload(running: Running) -> None:
    r = running
    assert r.metric(RELOADS_OK) == 1.0
    started_ts = r.metric(RELOAD_TS)
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    assert await r.send(CART_OTHER) == CART_OTHER  # no pair names app_ns / app_pod

    (r.config.parent / "descriptions" / "web.yaml").write_text(WEB_DEPLOYMENT)
    r.write_config(
        karta={"description_paths": [str(r.config.parent / "descriptions")]},
        enrich={"pod_label_pairs": [["namespace", "pod"], ["app_ns", "app_pod"]]})
    status, text = await r.post_reload()
    assert (status, text) == (200, "configuration reloaded\n")
    web = {**CART, "karta_component": "web"}
    assert await r.send(CART_POD) == {**CART_POD, **web}  # the new description
    assert await r.send(CART_OTHER) == {**CART_OTHER, **web}  # the new plan
    assert r.metric(RELOADS_OK) == 1.0
    assert r.metric(RELOAD_TS) > started_ts
    assert r.metric(RESTART) == 0.0

    # the description file goes away: the built-in is back, at the next reload
    (r.config.parent / "descriptions" / "web.yaml").unlink()
    assert (await r.post_reload())[0] == 200
    assert await r.send(CART_POD) == {**CART_POD, **CART}


async def test_sender_karta_labels_setting_reaches_the_plan(running: Running) -> None:
    r = running
    spoofed = {"__name__": "up", "karta_team": "someone-else"}  # names no pod
    assert await r.send(spoofed) == {"__name__": "up"}  # default: drop
    r.write_config(enrich={"sender_karta_labels": "keep"})
    assert (await r.post_reload())[0] == 200
    assert await r.send(spoofed) == spoofed


async def test_the_label_limit_reaches_the_plan_on_reload(running: Running) -> None:
    """upstream.max_labels_per_series is the plan's, live as enrich.* is (the rest of
    upstream takes a restart): a cart series of 3 labels gets its 5-label stamp under
    the default 30, goes unstamped under 7, and is stamped again under 0 (no limit)."""
    r = running
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    for limit, stamped in ((7, False), (0, True)):
        r.write_config(upstream={"max_labels_per_series": limit})
        status, text = await r.post_reload()
        assert (status, text) == (200, "configuration reloaded\n")
        assert await r.send(CART_POD) == ({**CART_POD, **CART} if stamped else CART_POD)
    assert r.metric(RESTART) == 0.0


async def test_builtins_switch_reloads(running: Running) -> None:
    r = running
    r.write_config(karta={"builtins": False})
    assert (await r.post_reload())[0] == 200
    assert await r.send(CART_POD) == CART_POD  # nothing describes a Deployment now
    r.write_config(karta={"builtins": True})
    assert (await r.post_reload())[0] == 200
    assert await r.send(CART_POD) == {**CART_POD, **CART}


@pytest.mark.parametrize("breakage", ["yaml", "unknown_key", "bad_value", "bad_description",
                                      "missing_path", "not_utf8"])
async def test_an_invalid_config_keeps_the_old_one(running: Running, breakage: str) -> None:
    r = running
    folder = r.config.parent / "descriptions"
    good_ts = r.metric(RELOAD_TS)
    if breakage == "yaml":
        r.config.write_text("upstream: [unclosed\n")
    elif breakage == "not_utf8":
        r.config.write_bytes(b"\xff\xfe")
    elif breakage == "unknown_key":
        r.write_config(enrich={"pod_label_pairs": [["app_ns", "app_pod"]]},
                       server={"listen_adress": "x"})
    elif breakage == "bad_value":
        r.write_config(enrich={"pod_label_pairs": [["app_ns", "app_pod"]],
                               "conflict_policy": "sometimes"})
    elif breakage == "bad_description":
        (folder / "web.yaml").write_text(WEB_DEPLOYMENT.replace("kind: Deployment}",
                                                                "kind: }"))
        r.write_config(karta={"description_paths": [str(folder)]},
                       enrich={"pod_label_pairs": [["app_ns", "app_pod"]]})
    else:
        r.write_config(karta={"description_paths": [str(folder / "gone")]},
                       enrich={"pod_label_pairs": [["app_ns", "app_pod"]]})
    status, text = await r.post_reload()
    assert status == 500 and text.startswith("reload failed: "), (status, text)
    if breakage == "not_utf8":
        assert f"{r.config}: not UTF-8 text" in text, text
    assert r.metric(RELOADS_OK) == 0.0
    assert r.metric(RELOAD_TS) == good_ts
    # nothing of the new file applied: the old pairs and descriptions enrich as before
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    assert await r.send(CART_OTHER) == CART_OTHER
    # fixed: the next reload succeeds
    (folder / "web.yaml").unlink(missing_ok=True)
    r.write_config(karta={"description_paths": [str(folder)]})
    assert (await r.post_reload())[0] == 200
    assert r.metric(RELOADS_OK) == 1.0


async def test_a_description_subfolder_that_cannot_be_listed_fails_the_reload(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as empty (``rglob``), an unlistable subfolder's descriptions were dropped by
    a reload that answered 200; it fails, naming the folder, and they stay in force."""
    from tests.unreadable import unreadable

    r = running
    team = r.config.parent / "descriptions" / "team"
    team.mkdir()
    (team / "web.yaml").write_text(WEB_DEPLOYMENT)
    assert (await r.post_reload())[0] == 200
    web = {**CART_POD, **CART, "karta_component": "web"}
    assert await r.send(CART_POD) == web
    with unreadable(team, monkeypatch):
        status, text = await r.post_reload()
    assert status == 500, text
    assert f"cannot read the folder {team}: Permission denied" in text
    assert r.metric(RELOADS_OK) == 0.0
    assert await r.send(CART_POD) == web  # the descriptions in force stay
    assert (await r.post_reload())[0] == 200
    assert await r.send(CART_POD) == web


async def test_an_emptied_description_file_keeps_its_descriptions(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    """A description file emptied (``> web.yaml``, or a save caught midway) when a
    reload reads it: its description was dropped, the cart's series stamped by the
    built-in (``component="deployment"``) until the file was whole again. It stays in
    force, the answer and one warning (not one per reload) name the file."""
    r = running
    web_file = r.config.parent / "descriptions" / "web.yaml"
    web_file.write_text(WEB_DEPLOYMENT)
    assert (await r.post_reload())[0] == 200
    web = {**CART_POD, **CART, "karta_component": "web"}
    assert await r.send(CART_POD) == web
    web_file.write_text("")
    caplog.set_level(logging.INFO, logger="karta")
    for _ in range(2):
        status, text = await r.post_reload()
        assert status == 200, text
        assert await r.send(CART_POD) == web
        assert text == ("configuration reloaded\ndescription files found empty, their "
                        f"previous descriptions kept: {web_file}\n")
    warned = [rec for rec in caplog.records if rec.levelname == "WARNING"
              and rec.getMessage().startswith("description file is empty")]
    assert [rec.__dict__["file"] for rec in warned] == [str(web_file)]
    assert "1 description(s) it held stay in force" in warned[0].getMessage()
    web_file.write_text(WEB_DEPLOYMENT.replace("name: web", "name: site"))
    assert await r.post_reload() == (200, "configuration reloaded\n")
    assert await r.send(CART_POD) == {**web, "karta_component": "site"}
    assert "description file is no longer empty" in caplog.text
    web_file.write_text("# no description here any more\n")  # meant: it describes none
    assert await r.post_reload() == (200, "configuration reloaded\n")
    assert await r.send(CART_POD) == {**CART_POD, **CART}


def test_a_folders_files_not_read_for_their_names_are_warned_of_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A description folder's file without .yaml, .yml or .json (a ConfigMap key named
    ``raycluster``) was passed over without a word, its kind undescribed: a warning
    names it, at the start and at a reload that finds it so first, not at each one."""
    from proxy.karta.description import read_description_paths
    from proxy.runtime import _log_description_files

    (tmp_path / "raycluster").write_text(yaml.safe_dump(RAYJOB_KARTA))
    caplog.set_level(logging.WARNING, logger="karta")
    first = read_description_paths([tmp_path])
    _log_description_files(first, None)
    again = read_description_paths([tmp_path], first)
    _log_description_files(again, first)
    warned = [r for r in caplog.records
              if r.getMessage().startswith("description folder holds files that are not read")]
    assert [(r.__dict__["folder"], r.__dict__["files"]) for r in warned] == [
        (str(tmp_path), [str(tmp_path / "raycluster")])]
    (tmp_path / "raycluster").rename(tmp_path / "raycluster.yaml")
    caplog.clear()
    _log_description_files(read_description_paths([tmp_path], again), again)
    assert not caplog.records


async def test_keys_that_take_a_restart_keep_their_running_value(running: Running) -> None:
    r = running
    r.write_config(karta={"description_paths": [str(r.config.parent / "descriptions")]},
                   server={"listen_address": "127.0.0.1:1", "worker_threads": 2},
                   enrich={"pod_label_pairs": [["app_ns", "app_pod"]]})
    status, text = await r.post_reload()
    assert status == 200
    assert "server.listen_address" in text and "server.worker_threads" in text, text
    assert r.metric(RESTART) == 1.0
    assert r.proxy.settings.server.listen_address == "127.0.0.1:0"
    assert r.proxy.settings.server.worker_threads == 0
    # the live part of the same file applied, and the proxy still serves where it was
    assert await r.send(CART_OTHER) == {**CART_OTHER, **CART}


async def test_the_jq_sandbox_limits_apply_on_reload_and_its_switch_takes_a_restart(
        running: Running) -> None:
    """The proxy evaluates in its jq sandbox from the start; a reload hands it new limits
    (its child ended, the next one started with them); ``karta.jq_sandbox`` waits for a
    restart. The stop ends the child and puts in-process evaluation back."""
    from proxy.karta.jqexpr import JqExpr, current_runner

    r = running
    box = r.proxy.jq_sandbox
    assert box is not None and current_runner() is box
    assert JqExpr(".a").all({"a": 1}) == [1]
    pid = box.child_pid
    assert pid is not None
    descriptions = str(r.config.parent / "descriptions")
    r.write_config(karta={"description_paths": [descriptions], "jq_timeout_seconds": 2.5,
                          "jq_memory_limit_bytes": 128 << 20})
    status, text = await r.post_reload()
    assert (status, text) == (200, "configuration reloaded\n")
    assert (box.timeout_seconds, box.memory_limit_bytes) == (2.5, 128 << 20)
    assert box.child_pid is None and not Path(f"/proc/{pid}").exists()  # ended, reaped
    assert r.proxy.settings.karta.jq_timeout_seconds == 2.5
    assert r.metric(RESTART) == 0.0
    r.write_config(karta={"description_paths": [descriptions], "jq_sandbox": False})
    status, text = await r.post_reload()
    assert status == 200 and "karta.jq_sandbox" in text, text
    assert r.metric(RESTART) == 1.0
    assert current_runner() is box
    assert JqExpr(".a").all({"a": 2}) == [2]
    pid = box.child_pid
    await r.proxy.stop()
    assert current_runner() is not box
    assert not Path(f"/proc/{pid}").exists()


async def test_reload_endpoint_methods(running: Running) -> None:
    async with running.session.get(running.base + "/-/reload") as resp:
        assert resp.status == 405
        assert "POST" in resp.headers.get("Allow", "")
    async with running.session.put(running.base + "/-/reload") as resp:
        assert resp.status == 200


async def test_the_reload_endpoint_is_off_unless_the_lifecycle_api_is_enabled(
    tmp_path: Path,
) -> None:
    """POST /-/reload was served to whoever reached the port, with no switch (a reload
    re-reads and re-evaluates every file, as often as anyone asks). As Prometheus without
    --web.enable-lifecycle, it now answers 403 saying how to enable it, unless
    server.enable_lifecycle is on; SIGHUP's reload goes on either way."""
    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        config.write_text(yaml.safe_dump({
            "snapshot": str(tmp_path / "snap.yaml"), "upstream": {"url": up.url},
            "server": {"listen_address": "127.0.0.1:0"}, "facts": {"enabled": False}}))
        p = Proxy(_loader(config)(), loader=_loader(config))
        await p.start()
        try:
            base = f"http://127.0.0.1:{p.port}"
            for method in ("POST", "PUT"):
                async with session.request(method, base + "/-/reload") as resp:
                    assert resp.status == 403
                    assert await resp.text() == LIFECYCLE_DISABLED
            assert (await p.reload()).ok  # what SIGHUP runs
        finally:
            await p.stop()
    assert "--web.enable-lifecycle" in LIFECYCLE_DISABLED
    args = build_parser().parse_args(["--web.enable-lifecycle", "--upstream-url", "http://t/w"])
    assert settings_from_args(args, env={}).server.enable_lifecycle


async def test_concurrent_reloads_run_one_at_a_time(tmp_path: Path) -> None:
    """SIGHUP and /-/reload at once: one reload at a time, each sees a whole file."""
    import threading

    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    s = Settings()
    s.snapshot = str(tmp_path / "snap.yaml")
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    active, peak = 0, 0
    lock = threading.Lock()

    def slow_loader() -> Settings:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1
        return s

    async with ScriptedUpstream() as up:
        s.upstream.url = up.url
        p = Proxy(s, loader=slow_loader)
        await p.start()
        try:
            outcomes = await asyncio.gather(*(p.reload() for _ in range(5)))
        finally:
            await p.stop()
    assert all(o.ok for o in outcomes)
    assert peak == 1


def _cluster(deployments: int, pods_each: int) -> str:
    """A snapshot of ``deployments`` Deployments in ``shop``, each with a ReplicaSet and
    ``pods_each`` pods."""
    objs: list[dict[str, Any]] = []
    for d in range(deployments):
        name = f"web{d}"
        objs.append({"apiVersion": "apps/v1", "kind": "Deployment",
                     "metadata": {"name": name, "namespace": "shop", "uid": f"d{d}"},
                     "spec": {"replicas": pods_each}})
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": f"d{d}",
                 "controller": True}
        objs.append({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                     "metadata": {"name": f"{name}-1", "namespace": "shop", "uid": f"rs{d}",
                                  "ownerReferences": [owner]}})
        rs = {**owner, "kind": "ReplicaSet", "name": f"{name}-1", "uid": f"rs{d}"}
        objs.extend({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{name}-1-{i}", "namespace": "shop",
                                  "uid": f"p{d}-{i}", "ownerReferences": [rs]},
                     "status": {"phase": "Running"}} for i in range(pods_each))
    return yaml.safe_dump_all(objs)


def _described_config(tmp_path: Path, snapshot: str) -> tuple[Path, Path]:
    """Settings for a proxy on ``snapshot`` whose descriptions are read from a folder
    (empty yet) at each reload; the settings file and the folder."""
    (tmp_path / "snap.yaml").write_text(snapshot)
    folder = tmp_path / "descriptions"
    folder.mkdir()
    config = tmp_path / "karta-proxy.yaml"
    config.write_text(yaml.safe_dump({
        "snapshot": str(tmp_path / "snap.yaml"), "server": {"listen_address": "127.0.0.1:0"},
        "facts": {"enabled": False}, "karta": {"description_paths": [str(folder)]},
        "upstream": {"url": "http://127.0.0.1:9/api/v1/write"}}))
    return config, folder


async def _described_proxy(tmp_path: Path, snapshot: str) -> tuple[Proxy, Path]:
    """A started proxy of :func:`_described_config`; the proxy and the folder."""
    config, folder = _described_config(tmp_path, snapshot)
    p = Proxy(_loader(config)(), loader=_loader(config))
    await p.start()
    return p, folder


async def test_a_reload_during_the_first_load_waits_for_it(tmp_path: Path) -> None:
    """The first load applies the snapshot in runs that let the event loop turn (in one
    go it held the loop, a SIGTERM waiting for all of it). A configuration reload asked
    for meanwhile (SIGHUP, new descriptions) waits for the last run: between two, the
    pods applied so far would be attributed under the old descriptions and re-attributed,
    those after under the new ones. Each pod maps to one attribution, the new one."""
    config, folder = _described_config(tmp_path, _cluster(400, 10))
    p = Proxy(_loader(config)(), loader=_loader(config))
    # (ready, pods in the index) when the reload's descriptions reached the engine
    at_describe: list[tuple[bool, int]] = []
    describe = p.engine.change_descriptions

    def noting(descs: Any, **kwargs: Any) -> Any:
        if kwargs.get("source") == "files" and descs:
            at_describe.append((p.index.ready, len(p.index.pods)))
        return describe(descs, **kwargs)

    p.engine.change_descriptions = noting  # type: ignore[method-assign]
    starting = asyncio.create_task(p.start())
    try:
        deadline = time.monotonic() + 15
        while not 0 < len(p.index.pods) < 4000 and not starting.done():
            assert time.monotonic() < deadline, "the load never began"
            await asyncio.sleep(0)
        assert not starting.done(), "the first load held the loop: no turn during it"
        (folder / "web.yaml").write_text(WEB_DEPLOYMENT)
        reload = asyncio.create_task(p.reload())
        await starting
        assert (await reload).ok
        assert at_describe == [(True, 4000)]
        components = {a.component for a in p.index.pods.values()}
        assert components == {"web"} and len(p.index.pods) == 4000
        assert p.engine.pod("p7-3").component == "web"  # type: ignore[union-attr]
    finally:
        await p.stop()


async def test_a_description_change_is_reattributed_in_runs_and_an_unchanged_one_not_at_all(
        tmp_path: Path) -> None:
    """A reload whose description files change re-attributes every pod of the kind in
    runs that let the event loop turn (in one go: the loop held for all of them), and a
    reload that reads the same files again re-attributes nothing."""
    p, folder = await _described_proxy(tmp_path, _cluster(400, 10))
    reattributed = record_runs(p.engine)
    turns = 0
    stop = False
    # the loop's turns counted at each run: it turned between every two (not timed: a
    # gap between turns is the machine's too, and a loaded one made gaps of any length)
    turns_at_runs: list[int] = []
    counting = p.engine.reattribute

    def noting(uids: Any) -> Any:
        turns_at_runs.append(turns)
        return counting(uids)

    p.engine.reattribute = noting  # type: ignore[method-assign]

    async def ticker() -> None:
        nonlocal turns
        while not stop:
            await asyncio.sleep(0)
            turns += 1

    try:
        (folder / "web.yaml").write_text(WEB_DEPLOYMENT)
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        assert (await p.reload()).ok
        stop = True
        await tick
        att = p.engine.pod("p7-3")
        assert att is not None and att.component == "web"
        # the 400 Deployments, each with what lies below it (4,000 pods, 400 ReplicaSets),
        # in runs (one go held the loop ~0.3 s)
        assert sum(reattributed) == 400 and len(reattributed) >= 5, reattributed
        assert all(b > a for a, b in itertools.pairwise(turns_at_runs)), turns_at_runs

        reattributed.clear()
        assert (await p.reload()).ok  # the same files read again
        assert sum(reattributed) == 0
    finally:
        await p.stop()


#: a Trainer (a kind TRAINER_KARTA describes) and its pod, for a snapshot
TRAINER = {"apiVersion": "example.com/v1", "kind": "Trainer",
           "metadata": {"name": "t", "namespace": "shop", "uid": "t-uid"},
           "spec": {"replicas": 3}, "status": {"state": "ready"}}
TRAINER_POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {
    "name": "t-0", "namespace": "shop", "uid": "t-0", "ownerReferences": [
        {"apiVersion": "example.com/v1", "kind": "Trainer", "name": "t", "uid": "t-uid",
         "controller": True}]}}


def _trainer_running(p: Proxy) -> None:
    """The Trainer is read whole: its phase and desired count, not
    ``workload_object_missing``."""
    facts = p.engine.workload("t-uid")
    assert facts is not None
    assert (facts.phase, facts.phase_reason, facts.replicas[0].desired) == (
        "Running", "", 3.0)


async def test_a_description_a_reload_adds_in_snapshot_mode_reads_its_kinds_objects_whole(
        tmp_path: Path) -> None:
    """A kind the description files describe only from a reload on: the snapshot's
    objects of it were kept without their body (undescribed when they came), so the
    source feeds them again; they read ``workload_object_missing`` (no phase, no desired
    count) until each changed."""
    snap = yaml.safe_dump_all([TRAINER, TRAINER_POD])
    p, folder = await _described_proxy(tmp_path, snap)
    try:
        (folder / "trainer.yaml").write_text(yaml.safe_dump(TRAINER_KARTA))
        assert (await p.reload()).ok
        _trainer_running(p)
    finally:
        await p.stop()


async def test_a_description_a_reload_adds_in_kubernetes_mode_is_watched_at_once(
        tmp_path: Path) -> None:
    """A RayJob described by a reload's files: its watch switched from metadata to whole
    objects only at the kube source's next recheck (29.1 s in the audit), the RayJob
    reading Undefined / ``workload_object_missing`` until then, where the same
    description as a Karta object in the cluster was followed in 0.1 s. The reload now
    wakes the source's follower."""
    from proxy.karta.model import GroupKind
    from proxy.kube.source import KubeSource
    from tests.kube.conftest import eventually
    from tests.kube.test_source import rayjob
    from tests.kubesim import KubeSim
    from tests.kubesim.resources import KARTA, RAY_CLUSTER, RAY_JOB, RESOURCE_INTERFACE

    async with KubeSim(bookmark_interval=0.2) as sim:
        sim.register(RAY_JOB, RAY_CLUSTER, KARTA, RESOURCE_INTERFACE)
        rayjob(sim)
        job_uid = sim.get("ray.io/v1", "RayJob", "train", "ml")["metadata"]["uid"]
        folder = tmp_path / "descriptions"
        folder.mkdir()
        config = tmp_path / "karta-proxy.yaml"
        config.write_text(yaml.safe_dump({
            "server": {"listen_address": "127.0.0.1:0"}, "facts": {"enabled": False},
            "kube": {"kubeconfig": str(sim.write_kubeconfig(tmp_path / "kubeconfig"))},
            "karta": {"description_paths": [str(folder)]},
            "upstream": {"url": "http://127.0.0.1:9/api/v1/write"}}))
        p = Proxy(_loader(config)(), loader=_loader(config))
        await p.start()
        try:
            source = p.source
            assert isinstance(source, KubeSource)
            rayjobs = GroupKind("ray.io", "RayJob")
            assert source.watchers[rayjobs][0] == "metadata"  # an owner on the pods' chain
            (folder / "rayjob.yaml").write_text(yaml.safe_dump(RAYJOB_KARTA))
            assert (await p.reload()).ok

            def running() -> bool:
                facts = p.engine.workload(job_uid)
                return (source.watchers[rayjobs][0] == "full" and facts is not None
                        and facts.phase == "Running")

            await eventually(running, timeout=3)  # the recheck interval is 30 s here
        finally:
            await p.stop()


async def test_an_engine_failure_in_a_reloads_runs_costs_only_its_culprit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An engine bug on one object a description change owes keeps that object (with
    what lies below it) at its old attribution, logged; the rest of its run and the
    runs after it are re-attributed, and the reload succeeds."""
    p, folder = await _described_proxy(tmp_path, _cluster(60, 2))
    real = p.engine.reattribute
    runs: list[int] = []

    def failing(uids: Any) -> Any:
        uids = list(uids)
        runs.append(len(uids))
        if "d3" in uids:
            raise RuntimeError("engine bug")
        return real(uids)

    p.engine.reattribute = failing  # type: ignore[method-assign]
    try:
        (folder / "web.yaml").write_text(WEB_DEPLOYMENT)
        with caplog.at_level(logging.ERROR):
            assert (await p.reload()).ok
        for d in range(60):
            att = p.engine.pod(f"p{d}-1")
            assert att is not None
            assert (att.component == "web") == (d != 3), (d, att)
            assert (dict(p.index.lookup(b"shop", f"web{d}-1-1".encode()) or ())
                    .get("karta_component") == "web") == (d != 3), d
        assert len(runs) >= 3  # in runs, d3's given again alone
        assert "engine failed on the re-attribution of 1 of 60 objects" in caplog.text
        assert caplog.text.count("engine failed on the re-attribution") == 1
    finally:
        await p.stop()


# -- a reload is applied whole, or what it applied is recorded (the settings audit) -------


async def test_a_refused_reload_applies_nothing_and_a_later_one_still_applies(
        running: Running) -> None:
    """The audit's sequence: builtins off and a label limit the native plan cannot take
    (2**63) answered 500 OverflowError, but the built-ins were removed already (the plan
    was compiled after them, past the point of no return); reloading the original file
    answered 200 and changed nothing (the settings in force still said builtins on): only
    a restart stamped the cart pod again."""
    r = running
    original = r.config.read_text()
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    r.write_config(karta={"builtins": False}, upstream={"max_labels_per_series": 2**63})
    status, text = await r.post_reload()
    assert status == 500, (status, text)
    assert await r.send(CART_POD) == {**CART_POD, **CART}  # nothing of it applied
    assert "upstream.max_labels_per_series: must be 0 to 65536" in text, text
    assert r.proxy.settings.karta.builtins is True
    r.config.write_text(original)
    assert (await r.post_reload())[0] == 200
    assert await r.send(CART_POD) == {**CART_POD, **CART}


async def test_the_new_plan_is_compiled_before_anything_is_applied(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the compile of a valid plan raises (here: a limit of 7, made to fail as
    2**63 did), it fails the reload in its trial phase: the built-in switch of the same
    file is not applied."""
    import proxy.enrichment

    real = proxy.enrichment.Splicer

    def splicer(plan: Any, *args: Any) -> Any:
        if plan.max_labels == 7:
            raise OverflowError("Python int too large to convert to C ssize_t")
        return real(plan, *args)

    monkeypatch.setattr(proxy.enrichment, "Splicer", splicer)
    r = running
    r.write_config(karta={"builtins": False}, upstream={"max_labels_per_series": 7})
    status, text = await r.post_reload()
    assert status == 500 and "enrich: Python int too large" in text, (status, text)
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    assert r.proxy.settings.karta.builtins is True
    assert r.proxy.settings.upstream.max_labels_per_series == 30


async def test_a_failure_while_applying_is_recorded_so_the_next_reload_mends_it(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the point of no return nothing should fail; were something to (an engine bug
    in the files' descriptions, after the built-ins were removed), the settings in force
    say what was applied, and the next reload of the original file puts it back."""
    r = running
    p = r.proxy
    original = r.config.read_text()
    real = p._describe

    async def describe(descs: Any, source: str) -> None:
        if source == "files":
            raise RuntimeError("engine bug")
        await real(descs, source)

    monkeypatch.setattr(p, "_describe", describe)
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)  # restored
    r.write_config(karta={"builtins": False,
                          "description_paths": [str(r.config.parent / "descriptions")]},
                   log_level="debug")
    status, text = await r.post_reload()
    assert status == 500 and "RuntimeError: engine bug (while applying; in force from the " \
        "new configuration: log_level, karta.builtins)" in text, (status, text)
    assert await r.send(CART_POD) == CART_POD  # the built-ins went
    assert p.settings.karta.builtins is False and p.settings.log_level == "debug"
    assert r.metric(RELOADS_OK) == 0.0
    monkeypatch.setattr(p, "_describe", real)
    r.config.write_text(original)
    status, text = await r.post_reload()
    assert status == 200, text
    assert await r.send(CART_POD) == {**CART_POD, **CART}
    assert p.settings.karta.builtins is True and p.settings.log_level == "info"


async def test_a_config_file_emptied_is_refused_at_a_reload(tmp_path: Path) -> None:
    """An empty or comment-only file (a ConfigMap caught mid-save) reset enrich.*, the
    description paths and log_level to their defaults with a 200; the CLI's loader
    refuses it now, and what is in force stays."""
    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        r = Running(None, up, config, "", session)  # type: ignore[arg-type]
        # the rest on the command line, as the audit's: the file holds enrich only
        config.write_text(yaml.safe_dump({"enrich": {"pod_label_pairs": [["app_ns",
                                                                           "app_pod"]]}}))
        args = build_parser().parse_args([
            "--config", str(config), "--snapshot", str(tmp_path / "snap.yaml"),
            "--upstream-url", up.url, "--listen-address", "127.0.0.1:0",
            "--web.enable-lifecycle", "--no-facts"])
        p = Proxy(settings_from_args(args, env={}),
                  loader=lambda: settings_from_args(args, env={}, reloading=True))
        await p.start()
        r.proxy, r.base = p, f"http://127.0.0.1:{p.port}"
        try:
            assert await r.send(CART_OTHER) == {**CART_OTHER, **CART}
            for text in ("", "# being rewritten\n"):
                config.write_text(text)
                status, body = await r.post_reload()
                assert status == 500 and "the file holds no settings" in body, body
                assert await r.send(CART_OTHER) == {**CART_OTHER, **CART}
            config.write_text("{}\n")  # every default, said so: applied
            status, body = await r.post_reload()
            assert status == 200, body
            assert await r.send(CART_OTHER) == CART_OTHER
        finally:
            await p.stop()


# -- the real process ---------------------------------------------------------------------------


async def _metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("karta_proxy_config_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def _until(check: Any, what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = await check()
            if got:
                return got
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _started(config: Path, port: int, session: aiohttp.ClientSession
                   ) -> tuple[asyncio.subprocess.Process, str]:
    """The real ``karta-proxy`` on ``config``, text log on its stderr, once it is ready;
    and its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--config", str(config),
        "--listen-address", f"127.0.0.1:{port}", "--log-format", "text", cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        async with session.get(base + "/-/ready") as resp:
            return resp.status == 200

    try:
        await _until(ready, "the process ready")
    except BaseException:
        await stop(proc)
        raise
    return proc, base


async def test_sighup_reloads_the_process_and_a_bad_file_keeps_it_running(
    tmp_path: Path,
) -> None:
    from tests.peers.conftest import free_port

    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    port = free_port()
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        def write(pairs: list[list[str]], policy: str = "replace") -> None:
            config.write_text(yaml.safe_dump({
                "snapshot": str(tmp_path / "snap.yaml"), "facts": {"enabled": False},
                "upstream": {"url": up.url},
                "enrich": {"pod_label_pairs": pairs, "conflict_policy": policy}}))

        write([["namespace", "pod"]])
        proc, base = await _started(config, port, session)
        try:
            first = await _metrics(session, base)
            assert first[RELOADS_OK] == 1.0 and first[RELOAD_TS] > 0

            async def stamped(labels: dict[str, str]) -> dict[str, str]:
                n = len(up.received)
                status, _, _ = await send_series(base + "/api/v1/write",
                                                 [Series(labels, [(1000, 1.0)])],
                                                 session=session)
                assert status == 204
                (got,) = decode_v1(up.received[n].raw)
                return dict(got.labels)

            assert await stamped(CART_OTHER) == CART_OTHER
            write([["app_ns", "app_pod"]])
            await asyncio.sleep(0.05)  # the timestamp has a resolution; make it move
            proc.send_signal(signal.SIGHUP)

            async def reloaded() -> dict[str, float] | None:
                m = await _metrics(session, base)
                return m if m[RELOAD_TS] > first[RELOAD_TS] else None

            after = await _until(reloaded, "a successful reload after SIGHUP")
            assert after[RELOADS_OK] == 1.0
            assert await stamped(CART_OTHER) == {**CART_OTHER, **CART}

            write([["namespace", "pod"]], policy="sometimes")
            proc.send_signal(signal.SIGHUP)

            async def failed() -> bool:
                return (await _metrics(session, base))[RELOADS_OK] == 0.0

            await _until(failed, "the failed reload reported")
            assert proc.returncode is None, "SIGHUP must not end the process"
            assert (await _metrics(session, base))[RELOAD_TS] == after[RELOAD_TS]
            assert await stamped(CART_OTHER) == {**CART_OTHER, **CART}  # the old config
        finally:
            log = await stop(proc)
    assert proc.returncode == 0, log[-2000:]
    assert "configuration reloaded" in log
    assert "reload failed; the configuration in force stays" in log
    assert "enrich.conflict_policy" in log  # the log says why


async def test_a_burst_of_sighups_runs_one_reload_per_turn_not_one_per_signal(
    tmp_path: Path,
) -> None:
    """A reloader sidecar may signal once per file of a ConfigMap: 40 SIGHUPs 2 ms apart
    ran a whole reload each (the kernel merging a few). One reload waiting for its turn
    stands for every SIGHUP before it (it reads the files after them), so a burst runs a
    few, and the last reload still reads the last file."""
    from tests.peers.conftest import free_port

    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    port = free_port()
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        def write(level: str) -> None:
            config.write_text(yaml.safe_dump({
                "snapshot": str(tmp_path / "snap.yaml"), "facts": {"enabled": False},
                "upstream": {"url": up.url}, "log_level": level}))

        write("info")
        proc, _ = await _started(config, port, session)
        try:
            for i in range(40):
                if i == 39:
                    write("debug")  # the last file: the burst's last reload reads it
                proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.002)
            await asyncio.sleep(1.0)
        finally:
            log = await stop(proc)
    assert proc.returncode == 0, log[-2000:]
    reloads = log.count("reloading the configuration")
    # measured: 39 one per signal, 10-11 one per turn (a reload of this file ~8 ms)
    assert 1 <= reloads <= 20, (reloads, log[-3000:])
    assert log.count("configuration reloaded") == reloads
    # the last file was read: a reload applied it, and none after it changed anything (a
    # reload already waiting when the file was written may be the one that read it, the
    # last then finding nothing new: seen under load)
    applied = log.split("configuration reloaded applied=['log_level']")
    assert len(applied) == 2, log[-2000:]
    assert all("applied=[]" in line for line in applied[1].splitlines()
               if "configuration reloaded" in line), log[-2000:]


async def test_a_reload_reads_the_upstream_tls_files_again(tmp_path: Path) -> None:
    """The upstream's CA fixed on disk: SIGHUP (``reload``) builds a new client context,
    the next write is stored. The context was built once at start: writes stayed 502,
    and the reload said applied=[] restart_required=[]."""
    from tests.test_runtime import snapshot_settings
    from tests.tls_certs import Authority

    right = Authority(tmp_path / "right", "right-ca")
    wrong = Authority(tmp_path / "wrong", "wrong-ca")
    served = right.issue("tsdb", server=True)
    ca_file = tmp_path / "upstream-ca.pem"
    ca_file.write_bytes(wrong.ca_file.read_bytes())
    async with ScriptedUpstream(ssl_context=served.server_context()) as up, \
            aiohttp.ClientSession() as c:
        s = snapshot_settings(tmp_path, up.url)
        s.upstream.tls_ca_file = str(ca_file)
        s.upstream.timeout_seconds = 5.0
        p = Proxy(s, loader=lambda: copy.deepcopy(s))
        await p.start()
        try:
            url = f"http://127.0.0.1:{p.port}/api/v1/write"
            status, _, _ = await send_series(url, [Series(CART_POD, [(1000, 1.0)])], session=c)
            assert status == 502
            ca_file.write_bytes(right.ca_file.read_bytes())
            assert (await p.reload()).ok
            status, _, body = await send_series(url, [Series(CART_POD, [(1000, 1.0)])],
                                                session=c)
            assert status == 204, body
            # a CA file that does not load fails the reload, and the context in use stays
            ca_file.write_text("not a certificate\n")
            outcome = await p.reload()
            assert not outcome.ok and "upstream TLS" in outcome.error, outcome
        finally:
            await p.stop()


async def test_the_cluster_label_reloads_against_the_cluster_the_proxy_started_as(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """enrich.cluster_label is live as enrich.* is; the proxy's own value of it,
    facts.external_labels, takes a restart: a reload checks the new label against the
    cluster the process started as. A label the external labels lack turns the check off,
    said in an info line."""
    caplog.set_level(logging.INFO, logger="karta.runtime")
    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    config = tmp_path / "karta-proxy.yaml"
    c2 = {**CART_POD, "cluster": "c2", "region": "eu"}
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        r = Running(None, up, config, "", session)  # type: ignore[arg-type]
        r.write_config(facts={"external_labels": {"cluster": "c1"}})
        p = Proxy(_loader(config)(), loader=_loader(config))
        await p.start()
        r.proxy, r.base = p, f"http://127.0.0.1:{p.port}"
        try:
            assert await r.send(c2) == c2  # another cluster's: unstamped
            steps: list[tuple[dict[str, Any], bool]] = [
                ({"enrich": {"cluster_label": ""}}, True),  # off
                # the label back, the facts' cluster changed: still c1 until a restart
                ({"enrich": {"cluster_label": "cluster"},
                  "facts": {"external_labels": {"cluster": "c2"}}}, False),
                # a label the (running) external labels lack: off, and said
                ({"enrich": {"cluster_label": "region"}}, True),
            ]
            for extra, stamped in steps:
                r.write_config(**extra)
                assert (await r.post_reload())[0] == 200
                assert await r.send(c2) == ({**c2, **CART} if stamped else c2)
            assert r.metric(RESTART) == 1.0
        finally:
            await p.stop()
    said = [m.getMessage() for m in caplog.records if "is not checked" in m.getMessage()]
    assert said == [
        "relayed series' region label is not checked: facts.external_labels has no region "
        "(this proxy's cluster), so a series labelled with another cluster's region is "
        "stamped with this cluster's pods; set facts.external_labels.region to the value "
        "this cluster's agents send (enrich.cluster_label names another label, \"\" turns "
        "this line off)"]


async def test_a_reload_refuses_a_cluster_check_against_an_upstream_url_of_another_cluster(
        tmp_path: Path) -> None:
    """upstream.url's extra_label storing every series under another cluster than
    facts.external_labels' is a settings error (proxy.config.check_stored_cluster). A
    reload refuses it in the file it reads, and also where the file agrees but the process
    would not: upstream.url and facts.external_labels take a restart, so a new
    enrich.cluster_label meets the running ones. Either way the running configuration
    stays (the check off here: the series stamped), where the reload applied a check that
    left every request unstamped."""
    (tmp_path / "snap.yaml").write_text(SNAPSHOT)
    config = tmp_path / "karta-proxy.yaml"
    async with ScriptedUpstream() as up, aiohttp.ClientSession() as session:
        r = Running(None, up, config, "", session)  # type: ignore[arg-type]
        c2_url = {"url": up.url + "?extra_label=cluster=c2"}
        r.write_config(upstream=c2_url, enrich={"cluster_label": ""},
                       facts={"external_labels": {"cluster": "c1"}})
        p = Proxy(_loader(config)(), loader=_loader(config))
        await p.start()
        r.proxy, r.base = p, f"http://127.0.0.1:{p.port}"
        try:
            assert await r.send(CART_POD) == {**CART_POD, **CART}
            refusal = ("reload failed: upstream.url: its extra_label sets cluster=c2 on every "
                       "series VictoriaMetrics stores through it, but this proxy's cluster "
                       "is cluster=c1")
            steps: list[tuple[dict[str, Any], str]] = [
                # the file's own settings disagree
                ({"upstream": c2_url, "enrich": {"cluster_label": "cluster"},
                  "facts": {"external_labels": {"cluster": "c1"}}}, ""),
                # the file's agree, the running upstream.url (a restart key) does not
                ({"enrich": {"cluster_label": "cluster"},
                  "facts": {"external_labels": {"cluster": "c1"}}},
                 " (a reload keeps the running upstream.url and facts.external_labels: "
                 "they take a restart)\n"),
                # nor do the running external labels with the file's upstream.url
                ({"upstream": c2_url, "enrich": {"cluster_label": "cluster"},
                  "facts": {"external_labels": {"cluster": "c2"}}}, "restart)\n"),
            ]
            for extra, ending in steps:
                r.write_config(**extra)
                status, text = await r.post_reload()
                assert status == 500 and text.startswith(refusal), text
                assert text.endswith(ending) and ("a reload keeps" in text) == bool(ending)
                assert r.metric(RELOADS_OK) == 0.0
                assert p.settings.enrich.cluster_label == ""
                assert await r.send(CART_POD) == {**CART_POD, **CART}
        finally:
            await p.stop()


@pytest.mark.parametrize("rewrites", [0, 3])
async def test_a_kind_newly_described_while_the_snapshot_is_rewritten_is_fed_whole_later(
        tmp_path: Path, rewrites: int) -> None:
    """A reload that describes a kind feeds the snapshot's objects of it again, read from
    the files: caught mid-rewrite (the object not in the file yet), they were dropped
    ("the next reload applies that") and the kind marked as fed, so the next reads of
    the same bytes fed nothing: ``workload_object_missing`` until the object changed.
    ``rewrites``: the files rewritten with the same bytes at polls before, so the polls
    after find them as applied by their bytes and read nothing (fed there too)."""
    whole = yaml.safe_dump_all([TRAINER_POD, TRAINER])
    p, folder = await _described_proxy(tmp_path, whole)
    snap = tmp_path / "snap.yaml"
    source: Any = p.source
    try:
        for _ in range(rewrites):
            await asyncio.sleep(0.02)  # a new mtime
            snap.write_text(whole)
            await source.poll()
        (folder / "trainer.yaml").write_text(yaml.safe_dump(TRAINER_KARTA))
        snap.write_text(whole[:whole.index("---")])  # the writer half-way through
        assert (await p.reload()).ok
        await asyncio.sleep(0.02)
        snap.write_text(whole)  # the writer done: the same objects as before
        for _ in range(3):  # a change is read once two polls in a row agree
            await source.poll()
        _trainer_running(p)
    finally:
        await p.stop()


async def test_objects_owed_from_a_file_that_stays_broken_are_not_read_again_at_every_poll(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The objects a reload's read missed are tried again by a poll that finds the files
    as applied only once the files changed since that read: a file that stays broken
    (its objects kept from its last good read) would be read again at every poll."""
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / "a.yaml").write_text(yaml.safe_dump(TRAINER_POD))
    (folder / "b.yaml").write_text(yaml.safe_dump(TRAINER))
    descs = tmp_path / "descriptions"
    descs.mkdir()
    config = tmp_path / "karta-proxy.yaml"
    config.write_text(yaml.safe_dump({
        "snapshot": str(folder), "server": {"listen_address": "127.0.0.1:0"},
        "facts": {"enabled": False}, "karta": {"description_paths": [str(descs)]},
        "upstream": {"url": "http://127.0.0.1:9/api/v1/write"}}))
    p = Proxy(_loader(config)(), loader=_loader(config))
    await p.start()
    source: Any = p.source
    try:
        await asyncio.sleep(0.02)  # a new mtime
        (folder / "b.yaml").write_text("kind: [\n")  # broken: its objects are kept
        for _ in range(2):
            await source.poll()
        (descs / "trainer.yaml").write_text(yaml.safe_dump(TRAINER_KARTA))
        with caplog.at_level(logging.WARNING, "karta.snapshot"):
            assert (await p.reload()).ok
            for _ in range(3):
                await source.poll()
        owed = [r for r in caplog.records if "not found in the files as applied" in r.message]
        assert len(owed) == 1, [r.message for r in owed]
    finally:
        await p.stop()
