"""The assembled proxy: fact series reach the upstream through the same client, and the
fact writer's metrics are on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from proxy import via
from proxy.config import ConfigError, Settings, load_settings, validate
from proxy.runtime import Proxy
from proxy.sender import Series, decode_v1, send_series
from tests.ipv6 import needs_ipv6
from tests.peers.conftest import wait_until
from tests.proxy_harness import SNAPSHOT
from tests.scripted import Received, Reply, ScriptedUpstream

if TYPE_CHECKING:
    from tests.kubesim import KubeSim


def writing_facts(tmp_path: Path, upstream_url: str) -> Settings:
    """The snapshot proxy's settings with facts written every 0.2 s."""
    s = snapshot_settings(tmp_path, upstream_url)
    s.facts.enabled = True
    s.facts.interval_seconds = 0.2
    return s


async def first_fact_write(up: ScriptedUpstream) -> None:
    async def written() -> bool:
        return bool(up.received)

    await wait_until(written, timeout=10, what="fact series upstream")


async def test_facts_written_upstream_and_served(tmp_path: Path) -> None:
    async with ScriptedUpstream() as up, started(writing_facts(tmp_path, up.url)) as p:
        await first_fact_write(up)
        async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{p.port}/metrics"
        ) as r:
            text = await r.text()
    names = {ser.labels["__name__"] for rec in up.received for ser in decode_v1(rec.raw)}
    assert any(n.startswith("karta_") for n in names), names
    assert "karta_pod_info" in names  # pod facts always go into the stream
    assert up.received[0].headers["Content-Type"] == "application/x-protobuf"
    # the workload facts on /metrics (pod facts only when asked), and the writer's state
    assert any(line.startswith("karta_workload_info") and "cart" in line
               for line in text.splitlines())
    assert "karta_pod_info" not in text
    assert "karta_proxy_index_pods 1.0" in text
    assert "karta_proxy_fact_writer_leader 1.0" in text


async def test_snapshot_mode_has_no_cluster_identity_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No API server of the snapshot's cluster to read kube-system's uid from: no read,
    one info line, and karta_contract_info written without karta_cluster_uid."""
    caplog.set_level(logging.INFO, logger="karta.runtime")
    async with ScriptedUpstream() as up, started(writing_facts(tmp_path, up.url)) as p:
        await first_fact_write(up)
        assert p.cluster_identity is None
    infos = [ser.labels for rec in up.received for ser in decode_v1(rec.raw)
             if ser.labels["__name__"] == "karta_contract_info"]
    assert infos and all("karta_cluster_uid" not in labels for labels in infos)
    assert [r.getMessage() for r in caplog.records
            if "cluster identity: none in snapshot mode" in r.getMessage()]


async def test_facts_reach_a_header_tenanted_upstream_with_facts_headers(tmp_path: Path) -> None:
    """A Mimir-like upstream refuses a write without X-Scope-OrgID (401): the facts, sent
    with no tenant header, reached no tenant at all (found by the tenancy audit).
    facts.headers gives their tenant; a sender's request does not get it, and
    upstream.headers still win."""
    def mimir(got: Received) -> Reply:
        tenant = got.headers.getall("X-Scope-OrgID", [])
        return Reply(204) if len(tenant) == 1 else Reply(401, body=b"no org id")

    async with ScriptedUpstream(rule=mimir) as up:
        s = snapshot_settings(tmp_path, up.url)
        s.facts.enabled = True
        s.facts.interval_seconds = 0.2
        s.facts.headers = {"x-scope-orgid": "ops"}
        async with started(s) as p:
            async def written() -> bool:
                return any(r.headers.get("X-Scope-OrgID") == "ops" for r in up.received)

            await wait_until(written, timeout=10, what="facts written to tenant ops")
            series = [Series({"__name__": "m", "namespace": "shop",
                              "pod": "cart-7d9f8-abcde"}, [(int(time.time() * 1000), 1.0)])]
            status, _, _ = await send_series(f"http://127.0.0.1:{p.port}/api/v1/write", series,
                                             headers={"X-Scope-OrgID": "team-a"})
            assert status == 204
    facts = [r for r in up.received if any(
        ser.labels["__name__"].startswith("karta_") for ser in decode_v1(r.raw))]
    relayed = [r for r in up.received if r not in facts]
    assert facts and all(r.headers.getall("X-Scope-OrgID") == ["ops"] for r in facts)
    assert [r.headers.getall("X-Scope-OrgID") for r in relayed] == [["team-a"]]

    # both naming one header is a settings error (the facts went to "fixed" silently);
    # past the check (settings built in code), upstream.headers still win, as over a
    # sender's
    async with ScriptedUpstream() as up:
        s = snapshot_settings(tmp_path, up.url)
        s.facts.enabled = True
        s.facts.interval_seconds = 0.2
        s.facts.headers = {"X-Scope-OrgID": "ops"}
        s.upstream.headers = {"X-Scope-OrgID": "fixed"}
        with pytest.raises(ConfigError, match=r"facts\.headers\.X-Scope-OrgID: never sent"):
            validate(s)
        async with started(s):
            async def written_fixed() -> bool:
                return bool(up.received)

            await wait_until(written_fixed, timeout=10, what="facts written")
    assert all(r.headers.getall("X-Scope-OrgID") == ["fixed"] for r in up.received)


async def test_facts_without_a_tenant_header_on_a_mimir_path_are_noted_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """upstream.url a Mimir push path, facts.headers without a tenant: one info line at
    start names facts.headers (not a warning: a single-tenant Mimir takes them); none
    once facts.headers names the tenant, nor with facts off."""
    caplog.set_level(logging.INFO, logger="karta.runtime")
    async with ScriptedUpstream() as up:
        push = up.url.replace("/api/v1/write", "/api/v1/push")
        for headers, enabled, noted in (({}, True, True), ({"X-Scope-OrgID": "ops"}, True, False),
                                        ({}, False, False)):
            caplog.clear()
            s = snapshot_settings(tmp_path, push)
            s.facts.enabled = enabled
            s.facts.headers = headers
            async with started(s):
                pass
            lines = [r for r in caplog.records if "fact writes name no tenant" in r.getMessage()]
            assert len(lines) == int(noted), (headers, enabled, lines)
            assert all(r.levelno == logging.INFO and "facts.headers" in r.getMessage()
                       for r in lines)


async def test_metrics_pod_facts_switch(tmp_path: Path) -> None:
    """facts.metrics_pod_facts: true puts the per-pod facts on /metrics as well."""
    async with ScriptedUpstream() as up:
        s = snapshot_settings(tmp_path, up.url)
        s.facts.metrics_pod_facts = True
        async with started(s) as p:
            text = await get_text(p, "/metrics")
    assert 'karta_pod_info{' in text and 'pod="cart-7d9f8-abcde"' in text


async def test_metrics_has_the_standard_collectors_and_one_build_info(tmp_path: Path) -> None:
    """Stock dashboards read process_* and python_*; exactly one *_build_info series."""
    from proxy import __version__
    from proxy.wire.native import DEFAULT as SPLICE

    async with started(snapshot_settings(tmp_path)) as p:
        text = await get_text(p, "/metrics")
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    for prefix in ("process_cpu_seconds_total ", "process_resident_memory_bytes ",
                   "process_open_fds ", "process_start_time_seconds ", "python_info{",
                   "python_gc_objects_collected_total{"):
        assert any(s.startswith(prefix) for s in samples), prefix
    build = [s for s in samples if s.split("{")[0].split(" ")[0].endswith("_build_info")]
    assert build == [f'karta_build_info{{karta_writer="karta-proxy",splice="{SPLICE}",'
                     f'version="{__version__}"}} 1.0']


async def test_serve_reports_a_failed_start_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve() turns a start failure into EXIT_START and one plain line naming the fix;
    nothing listens (the port stays the other holder's)."""
    import socket

    from proxy.runtime import EXIT_START, serve

    s = snapshot_settings(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        s.server.listen_address = f"127.0.0.1:{holder.getsockname()[1]}"
        assert await asyncio.wait_for(serve(s), 30) == EXIT_START
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"karta-proxy: error: cannot listen on {s.server.listen_address}")
    assert "cannot start" not in "\n".join(err)


async def get_text(p: Proxy, path: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(
        f"http://127.0.0.1:{p.port}{path}"
    ) as r:
        assert r.status == 200
        return await r.text()


def snapshot_settings(tmp_path: Path, upstream_url: str = "http://127.0.0.1:9/api/v1/write",
                      *, base: Settings | None = None) -> Settings:
    """A proxy on the test snapshot, on a free port, facts off, upstream unreachable
    unless named; ``base``: settings loaded from a file, completed the same way."""
    snap = tmp_path / "snap.yaml"
    snap.write_text(SNAPSHOT)
    s = base if base is not None else Settings()
    s.snapshot = str(snap)
    s.upstream.url = upstream_url
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = False
    return s


@contextlib.asynccontextmanager
async def started(s: Settings) -> AsyncIterator[Proxy]:
    """The proxy started on ``s``, stopped however the test ends."""
    p = Proxy(s)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def test_snapshot_reload_follows_the_files(tmp_path: Path) -> None:
    """snapshot_reload_seconds polls the snapshot: a pod added to the file gets labels, a
    pod removed from it becomes a tombstone (still labelled)."""
    s = snapshot_settings(tmp_path)
    snap = Path(s.snapshot)
    s.snapshot_reload_seconds = 0.2
    async with started(s) as p:
        assert p.index.lookup(b"shop", b"cart-7d9f8-fghij") is None
        second = SNAPSHOT.split("---\n")[-1].replace("abcde", "fghij").replace("p-cart", "p-2")
        without_first = "---\n".join(SNAPSHOT.split("---\n")[:-1])
        snap.write_text(without_first + "---\n" + second)
        deadline = time.monotonic() + 10
        while p.index.lookup(b"shop", b"cart-7d9f8-fghij") is None:
            assert time.monotonic() < deadline, "snapshot change not picked up"
            await asyncio.sleep(0.05)
        assert "p-cart" not in p.index.pods  # gone from the file: a tombstone
        assert p.index.lookup(b"shop", b"cart-7d9f8-abcde") is not None


async def test_a_snapshot_dropping_a_pods_owners_keeps_its_workload_until_the_ghosts_expire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot reload that drops the Deployment and its ReplicaSet (a cascade delete
    caught mid-way) is a removal as a watch's is: the pod still walks through the
    ReplicaSet's ghost to the Deployment, for ``karta.tombstone_seconds``; then the
    expiry loop drops the ghosts and the pod is placed again, from its reference."""
    import proxy.runtime

    monkeypatch.setattr(proxy.runtime, "EXPIRE_INTERVAL_SECONDS", 0.05)
    s = snapshot_settings(tmp_path)
    snap = Path(s.snapshot)
    s.snapshot_reload_seconds = 0.2
    s.karta.tombstone_seconds = 1.0
    async with started(s) as p:

        def kind() -> str:
            return dict(p.index.lookup(b"shop", b"cart-7d9f8-abcde") or ()).get(
                "karta_kind", "")

        assert kind() == "Deployment"
        snap.write_text(SNAPSHOT.split("---\n")[-1])  # the pod alone
        await wait_until(lambda: asyncio.sleep(0, "rs-cart" not in p.engine._graph.objects),
                         timeout=10, what="the owners' removal")
        assert kind() == "Deployment"
        assert p.engine.ghosts() == 2 and p.engine._graph.ghost_seconds == 1.0
        await wait_until(lambda: asyncio.sleep(0, kind() == "ReplicaSet"),
                         timeout=10, what="the ghosts' expiry")
        assert p.engine.ghosts() == 0


async def test_a_forward_header_never_forwarded_is_warned_of_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """upstream.forward_headers naming a header the proxy never forwards (its own, or one
    hop's) was taken and ignored without a word; the start now says which and why."""
    caplog.set_level(logging.WARNING, logger="karta.runtime")
    s = snapshot_settings(tmp_path)
    s.upstream.forward_headers = ["X-Scope-OrgID", "Host", "content-type"]
    async with started(s):
        pass
    (line,) = [r.getMessage() for r in caplog.records
               if "upstream.forward_headers" in r.getMessage()]
    assert "Host, content-type: never forwarded" in line, line
    caplog.clear()
    async with started(snapshot_settings(tmp_path)):  # the default list: no warning
        pass
    assert not [r for r in caplog.records if "upstream.forward_headers" in r.getMessage()]


async def test_snapshot_reload_off(tmp_path: Path) -> None:
    s = snapshot_settings(tmp_path)
    snap = Path(s.snapshot)
    s.snapshot_reload_seconds = 0
    async with started(s) as p:
        snap.write_text(SNAPSHOT.replace("abcde", "fghij").replace("p-cart", "p-2"))
        await asyncio.sleep(0.6)
        assert p.index.lookup(b"shop", b"cart-7d9f8-fghij") is None
        assert p.index.lookup(b"shop", b"cart-7d9f8-abcde") is not None


def _electing(tmp_path: Path, upstream_url: str, sim: KubeSim) -> Settings:
    """:func:`writing_facts`, under a Lease on ``sim``."""
    s = writing_facts(tmp_path, upstream_url)
    s.kube.kubeconfig = str(sim.write_kubeconfig())
    s.facts.leader_election = True
    return s


async def _the_lease(sim: KubeSim) -> list[dict[str, Any]]:
    """The Leases on ``sim`` once the fact writer has taken one."""
    from tests.kubesim.resources import LEASE

    await wait_until(lambda: asyncio.sleep(0, bool(sim.objects(LEASE))),
                     timeout=10, what="the fact writer's Lease")
    return sim.objects(LEASE)


async def test_lease_in_the_own_namespace_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """facts.lease_namespace empty: the Lease is taken in the pod's namespace."""
    from tests.kubesim import KubeSim

    monkeypatch.setenv("POD_NAMESPACE", "karta-proxy")
    async with KubeSim() as sim, ScriptedUpstream() as up:
        s = _electing(tmp_path, up.url, sim)
        async with started(s) as p:
            (lease,) = await _the_lease(sim)
            assert lease["metadata"]["namespace"] == "karta-proxy"
            assert lease["metadata"]["name"] == "karta-proxy-facts"
            assert p.lease_namespace == "karta-proxy"


#: a Deployment's pod through an undescribed owner (``Shard``): two references up
SHARDED = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: cart, namespace: shop, uid: d-cart}
spec: {replicas: 1, selector: {matchLabels: {app: cart}}}
---
apiVersion: example.com/v1
kind: Shard
metadata:
  name: cart-shard
  namespace: shop
  uid: s-cart
  ownerReferences:
  - {apiVersion: apps/v1, kind: Deployment, name: cart, uid: d-cart, controller: true}
---
apiVersion: v1
kind: Pod
metadata:
  name: cart-0
  namespace: shop
  uid: p-cart
  ownerReferences:
  - {apiVersion: example.com/v1, kind: Shard, name: cart-shard, uid: s-cart, controller: true}
spec: {nodeName: n1, containers: [{name: cart, image: cart:1}]}
status: {phase: Running}
"""


@pytest.mark.parametrize(("hops", "answer"), [(1, "hop_limit"), (2, "cart")])
async def test_max_owner_hops_bounds_the_walk(tmp_path: Path, hops: int, answer: str) -> None:
    """karta.max_owner_hops, read by the runtime alone for the engine (the engine's tests
    give it by hand): one reference does not reach the Deployment above the Shard."""
    s = snapshot_settings(tmp_path)
    Path(s.snapshot).write_text(SHARDED)
    s.karta.max_owner_hops = hops
    async with started(s) as p:
        got = p.index.answer(b"shop", b"cart-0")
    assert (got if isinstance(got, str) else dict(got or ())["karta_workload"]) == answer


async def test_the_lease_settings_reach_the_lease(tmp_path: Path) -> None:
    """facts.lease_name, lease_namespace, identity and lease_duration_seconds as the Lease
    the assembled proxy writes carries them (each was read by the runtime alone; the
    elector's tests give it these values by hand)."""
    from tests.kubesim import KubeSim

    async with KubeSim() as sim, ScriptedUpstream() as up:
        s = _electing(tmp_path, up.url, sim)
        s.facts.lease_name = "facts.shop"
        s.facts.lease_namespace = "karta-system"
        s.facts.identity = "replica-a"
        s.facts.lease_duration_seconds = 7.5
        async with started(s):
            (lease,) = await _the_lease(sim)
    assert (lease["metadata"]["namespace"], lease["metadata"]["name"]) == (
        "karta-system", "facts.shop")
    assert lease["spec"]["holderIdentity"] == "replica-a"
    assert lease["spec"]["leaseDurationSeconds"] == 8  # whole seconds, rounded up


@pytest.mark.parametrize("value", ["Karta Proxy", "karta_proxy", "-x", "a" * 64])
async def test_an_own_namespace_no_namespace_can_have_is_a_start_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """$POD_NAMESPACE set by hand to a name no namespace can have: every Lease round was
    refused by the API, no writer ever elected, and nothing said why but the failures'
    counter. Now the start fails, naming the variable and the setting that overrides it."""
    from proxy.runtime import StartError
    from tests.kubesim import KubeSim
    from tests.kubesim.resources import LEASE

    monkeypatch.setenv("POD_NAMESPACE", value)
    async with KubeSim() as sim, ScriptedUpstream() as up:
        s = snapshot_settings(tmp_path, up.url)
        s.kube.kubeconfig = str(sim.write_kubeconfig())
        s.facts.enabled = True
        s.facts.leader_election = True
        p = Proxy(s)
        try:
            with pytest.raises(StartError, match=r"\$POD_NAMESPACE.*facts\.lease_namespace"):
                await p.start()
        finally:
            await p.stop()
        assert not sim.objects(LEASE)
        s.facts.lease_namespace = "karta-proxy"  # the setting wins over the variable
        async with started(s):
            await wait_until(lambda: asyncio.sleep(0, bool(sim.objects(LEASE))),
                             timeout=10, what="the Lease in the set namespace")


def electing_settings(sim: KubeSim, up: ScriptedUpstream, *, interval: float) -> Settings:
    """A cluster-mode proxy on the simulator that elects its fact writer."""
    s = Settings()
    s.kube.kubeconfig = str(sim.write_kubeconfig())
    s.upstream.url = up.url
    s.server.listen_address = "127.0.0.1:0"
    s.facts.enabled = True
    s.facts.leader_election = True
    s.facts.interval_seconds = interval
    return s


async def test_a_replica_campaigns_for_the_fact_lease_only_once_its_index_is_loaded(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica still syncing (its pod reads failing) won the lease and wrote nothing for
    as long, its leader gauge at 1; it now campaigns once the index is loaded and its fact
    writer has walked it standing by."""
    from tests.kube.conftest import deployment
    from tests.kubesim import KubeSim
    from tests.kubesim.resources import LEASE, POD

    monkeypatch.setenv("POD_NAMESPACE", "karta-proxy")
    async with KubeSim() as sim, ScriptedUpstream() as up:
        deployment(sim, "web", "shop", replicas=1)
        sim.fail_resource(POD, 500)
        s = electing_settings(sim, up, interval=0.2)
        s.facts.lease_duration_seconds = 1.5
        p = Proxy(s)
        starting = asyncio.create_task(p.start())  # start waits for the first list
        try:
            await asyncio.sleep(1.5)
            assert not p.index.ready and not sim.objects(LEASE)
            sim.fail_resource(POD, None)
            await asyncio.wait_for(starting, 15)

            async def leading() -> bool:
                return p.metrics.registry.get_sample_value(
                    "karta_proxy_fact_writer_leader") == 1

            await wait_until(leading, timeout=15, what="the lease, once loaded")
            assert p.index.ready and sim.objects(LEASE)
        finally:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(BaseException):
                    await starting
            await p.stop()


async def test_a_stop_while_the_fact_writer_still_waits_to_campaign_ends(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM within the first fact interval with leader election on (the shipped
    # cluster Deployment): the campaign waited for a standby walk after the index's
    # load, which the stopped writer would never make, and the stop waited for it
    from proxy.facts import FactWriter
    from tests.kube.conftest import deployment
    from tests.kubesim import KubeSim

    monkeypatch.setenv("POD_NAMESPACE", "karta-proxy")

    async def no_walk(self: FactWriter, now: float) -> None:
        """The writer's walk not yet made, for as long as the test needs: the campaign
        waits for it whatever the timing (a walk made before the campaign first looked
        let it run, and the test flaked on a loaded machine)."""

    monkeypatch.setattr(FactWriter, "_stand_by", no_walk)
    async with KubeSim() as sim, ScriptedUpstream() as up:
        deployment(sim, "web", "shop", replicas=1)
        p = Proxy(electing_settings(sim, up, interval=60))
        starting = asyncio.create_task(p.start())
        try:
            await asyncio.wait_for(starting, 15)

            async def loaded() -> bool:
                return p.index.ready

            await wait_until(loaded, timeout=15, what="the index's load")
            await asyncio.sleep(0.5)  # loaded: the campaign waits for the writer's walk
            assert p.metrics.registry.get_sample_value("karta_proxy_fact_writer_leader") == 0
            assert p._elector_task is not None and not p._elector_task.done()
        finally:
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(BaseException):
                    await starting
            stopping = asyncio.create_task(p.stop())
            done, _ = await asyncio.wait({stopping}, timeout=5)
            if not done:  # (cancelled, the old stop swallowed it and went on)
                stopping.cancel()
                with contextlib.suppress(BaseException):
                    await stopping
                pytest.fail("the stop waited for the campaign")


@pytest.mark.parametrize("allow", [False, True])
async def test_node_mode_writes_no_facts_unless_allowed(
    allow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A node-mode replica sees one node's pods: its facts would be partial, so it writes
    none (and says so) unless facts.allow_in_node_mode."""
    from tests.kube.conftest import deployment
    from tests.kubesim import KubeSim

    caplog.set_level(logging.INFO, logger="karta.runtime")
    async with KubeSim() as sim, ScriptedUpstream() as up:
        deployment(sim, "web", "shop", replicas=2, node="n1")
        s = Settings()
        s.kube.kubeconfig = str(sim.write_kubeconfig())
        s.kube.node_name = "n1"
        s.upstream.url = up.url
        s.server.listen_address = "127.0.0.1:0"
        s.facts.interval_seconds = 0.1
        s.facts.allow_in_node_mode = allow
        async with started(s) as p:
            assert p.index.lookup(b"shop", b"web-1-0") is not None  # the data path works
            if allow:  # a write waited for, however slow the machine's first one
                async def written() -> bool:
                    return bool(up.received)

                await wait_until(written, timeout=15, what="a fact write")
            else:  # several intervals: none written
                await asyncio.sleep(0.5)
            # nor served on /metrics: one node's pods counted against every workload
            exposed = generate_latest(p.metrics.registry).decode()
            assert ("karta_component_observed_pods" in exposed) is allow
            assert "karta_proxy_index_ready" in exposed  # the operational ones stay
    assert p.writes_facts is allow
    assert (p.facts is not None) is allow
    assert bool(up.received) is allow  # only fact writes reach the upstream here
    noted = any("not written in node mode" in r.getMessage() for r in caplog.records)
    assert noted is not allow


async def test_configured_pod_label_rules_reach_the_enricher(tmp_path: Path) -> None:
    """A rule set in the YAML file decides which labels name the pod."""
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "enrich:\n"
        "  pod_label_rules:\n"
        "  - metric_prefix: app_\n"
        "    pod_label_pairs:\n"
        "    - {namespace: target_ns, pod: target_pod}\n"
    )
    async with ScriptedUpstream() as up:
        s = snapshot_settings(tmp_path, up.url, base=load_settings(cfg))
        async with started(s) as p:
            ruled = Series({"__name__": "app_requests_total", "target_ns": "shop",
                            "target_pod": "cart-7d9f8-abcde"}, [(1_000, 1.0)])
            unruled = Series({"__name__": "other_total", "target_ns": "shop",
                              "target_pod": "cart-7d9f8-abcde"}, [(1_000, 1.0)])
            status, _, _ = await send_series(
                f"http://127.0.0.1:{p.port}/api/v1/write", [ruled, unruled]
            )
    assert status == 204
    got = {ser.labels["__name__"]: ser.labels for rec in up.received for ser in decode_v1(rec.raw)}
    assert got["app_requests_total"]["karta_workload"] == "cart"
    assert "karta_workload" not in got["other_total"]  # the default pairs name no pod here


def _holding(gate: asyncio.Event, others: list[float]) -> Callable[[Received], Reply]:
    """An upstream rule: the request of ``relayed_total`` is answered once ``gate`` is set
    (:func:`_answer_later`), anything else at once (when it arrived, in ``others``). Held
    by a gate, not for a fixed 0.5 s: a loaded machine could let it be answered before
    the test saw it in flight, or before the work that must wait for it had begun."""

    def rule(rec: Received) -> Reply:
        if "relayed_total" in {ser.labels["__name__"] for ser in decode_v1(rec.raw)}:
            return Reply(gate=gate)
        others.append(time.monotonic())
        return Reply()

    return rule


async def _answer_later(gate: asyncio.Event, answered: list[float]) -> None:
    """The held request answered 0.5 s from now (when, in ``answered``): the work started
    meanwhile must wait for it."""
    await asyncio.sleep(0.5)
    answered.append(time.monotonic())
    gate.set()


async def _relaying(p: Proxy) -> asyncio.Task[tuple[int, dict[str, str], str]]:
    """A request of ``relayed_total`` sent to ``p``, once ``p`` is handling it."""
    relayed = asyncio.create_task(send_series(
        f"http://127.0.0.1:{p.port}/api/v1/write",
        [Series({"__name__": "relayed_total", "namespace": "shop",
                 "pod": "cart-7d9f8-abcde"}, [(1_000, 1.0)])]))

    async def relaying() -> bool:
        return p.handler.relaying()

    await wait_until(relaying, timeout=10, what="the request in the proxy")
    return relayed


async def test_a_fact_write_waits_for_the_request_being_relayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fact writer yields to the remote-write handler: a write made while a request is
    being relayed sends nothing until that request is answered."""
    import proxy.facts.writer as fw
    from proxy import yielding
    from proxy.facts import FactWriter

    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 1)  # a pause after the first group
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    answered: list[float] = []
    facts: list[float] = []  # when each fact request arrives
    gate = asyncio.Event()

    async with ScriptedUpstream(rule=_holding(gate, facts)) as up:
        s = snapshot_settings(tmp_path, up.url)
        s.facts.enabled = True
        s.facts.interval_seconds = 600  # the first write at start, then only when asked
        async with started(s) as p:
            writer = p.facts
            assert isinstance(writer, FactWriter)

            async def first_written() -> bool:
                return writer.writes_ok == 1

            await wait_until(first_written, timeout=10, what="the first fact write")
            relayed = await _relaying(p)
            before = len(facts)
            answering = asyncio.create_task(_answer_later(gate, answered))
            assert await writer.write_once()
            await answering
            assert not p.handler.relaying()
            status, _, _ = await relayed
    assert status == 204
    assert len(answered) == 1 and facts[before:]
    assert min(facts[before:]) >= answered[0]


async def test_a_metrics_page_waits_for_the_request_being_relayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /metrics page (the fact families: ~1 s of Python at 37.5k pods) gives way to the
    remote-write handler as a fact write does: it ends only once the request being
    relayed is answered, and it is whole."""
    from proxy import yielding

    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    answered: list[float] = []
    gate = asyncio.Event()

    async with ScriptedUpstream(rule=_holding(gate, [])) as up, \
            started(snapshot_settings(tmp_path, up.url)) as p:
        relayed = await _relaying(p)
        answering = asyncio.create_task(_answer_later(gate, answered))
        text = await get_text(p, "/metrics")
        served = time.monotonic()
        await answering
        status, _, _ = await relayed
    assert status == 204 and len(answered) == 1
    assert served >= answered[0]
    assert "karta_workload_info{" in text and "karta_proxy_index_pods" in text


async def test_a_snapshot_reload_waits_for_the_request_being_relayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot reload reads and diffs in a worker thread, which gives way to the
    remote-write handler as the loop's background work does: it ends only once the
    request being relayed is answered, and applies what changed."""
    from proxy import yielding
    from proxy.snapshot import SnapshotSource

    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    monkeypatch.setattr(yielding, "THREAD_STRETCH_SECONDS", 0.0)  # pause at every object
    answered: list[float] = []
    gate = asyncio.Event()
    async with ScriptedUpstream(rule=_holding(gate, [])) as up, \
            started(snapshot_settings(tmp_path, up.url)) as p:
        source = p.source
        assert isinstance(source, SnapshotSource)
        relayed = await _relaying(p)
        answering = asyncio.create_task(_answer_later(gate, answered))
        report = await source.reload()
        reloaded = time.monotonic()
        await answering
        status, _, _ = await relayed
    assert status == 204 and len(answered) == 1
    assert reloaded >= answered[0]
    assert report.objects and not report.changes  # the same files: read, nothing to apply


async def test_every_family_on_metrics_is_documented(tmp_path: Path) -> None:
    """An operator looks a metric up by name: every ``karta_proxy_*`` / ``karta_source_*``
    family the assembled proxy serves (TLS on, so its refusal counter is there too; facts
    on, so the writer's) has a row in a metric table of the docs: operations.md for the
    proxy's own, metrics.md for the contract, kubernetes.md for the sources."""
    import re
    import ssl

    from prometheus_client.parser import text_string_to_metric_families

    from tests.tls_certs import Authority

    docs = Path(__file__).resolve().parents[1] / "docs"
    rows: set[str] = set()
    for page in ("operations.md", "metrics.md", "kubernetes.md"):
        rows |= set(re.findall(r"^\| `(karta_[a-z0-9_]+)`", (docs / page).read_text(), re.M))
    ca = Authority(tmp_path / "pki")
    server = ca.issue("proxy", server=True)
    s = snapshot_settings(tmp_path)
    s.facts.enabled = True
    s.server.tls_cert_file, s.server.tls_key_file = str(server.cert), str(server.key)
    async with started(s) as p, aiohttp.ClientSession() as session, session.get(
        f"https://127.0.0.1:{p.port}/metrics",
        ssl=ssl.create_default_context(cafile=str(ca.ca_file)),
    ) as r:
        assert r.status == 200
        text = await r.text()
    served = {f.name for f in text_string_to_metric_families(text)
              if f.name.startswith(("karta_proxy_", "karta_source_"))}
    assert "karta_proxy_tls_handshake_failures" in served
    assert "karta_proxy_fact_writer_leader" in served
    # the parser names a counter without its _total; the tables name the series
    missing = sorted(n for n in served if n not in rows and n + "_total" not in rows)
    assert not missing, f"served on /metrics but in no metric table: {missing}"


def test_a_listen_host_that_does_not_resolve_says_why() -> None:
    """A gaierror's errno is a negative EAI_* code: os.strerror made it "Unknown error -2"."""
    import socket

    from proxy.runtime import _listen_error

    e = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    message = str(_listen_error("nosuchhost.invalid:0", e))
    assert message.startswith("cannot listen on nosuchhost.invalid:0: Name or service not "
                              "known; "), message
    assert "Unknown error" not in message and "--listen-address" in message


async def test_the_upstream_password_is_on_no_page_and_in_no_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The start line and the landing page show the upstream URL without its userinfo
    (/metrics labels and error answers already did)."""
    caplog.set_level(logging.DEBUG)
    async with ScriptedUpstream() as up:
        url = up.url.replace("http://", "http://alice:PW-SECRET-xyz@")
        async with started(snapshot_settings(tmp_path, url)) as p:
            pages = [await get_text(p, path) for path in ("/", "/metrics")]
    start = [r for r in caplog.records if r.getMessage() == "starting karta-proxy"]
    assert start and start[0].__dict__["upstream_url"] == up.url
    assert start[0].__dict__["http_parser"] in ("llhttp", "python")
    # the name a 508 loop refusal gives this process, so that its replica can be found
    assert start[0].__dict__["via"] == via.PSEUDONYM
    assert up.url.split("//")[1] in pages[0]
    for text in (*pages, *(repr(r.__dict__) for r in caplog.records)):
        assert "PW-SECRET" not in text


async def test_a_stop_with_requests_on_a_slow_upstream_ends_within_the_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that finishes within the drain gets its answer; one still waiting on the
    upstream after it is ended (its sender sees the connection closed), and the stop ends
    soon after the drain. aiohttp's own shutdown waited the drain twice and then some:
    21-22 s for the documented 10. The ended ones are logged in one line and counted:
    their cancelled handlers left no trace (64 requests so ended, in an audit)."""
    from proxy import server

    drain = 2.0
    monkeypatch.setattr(server, "DRAIN_SECONDS", drain)

    def rule(rec: Received) -> Reply | None:
        if rec.raw == b"":
            return None  # the start's check: answered at once
        return Reply(204, delay=0.3 if b"fast" in rec.raw else 60.0)

    async def send(name: str, url: str) -> int | str:
        try:
            status, _, _ = await send_series(url, [Series({"__name__": name}, [(1, 1.0)])],
                                             timeout=120.0)
        except aiohttp.ClientError as e:
            return type(e).__name__
        return status

    async with ScriptedUpstream(rule=rule) as up:
        s = snapshot_settings(tmp_path, up.url)
        s.upstream.timeout_seconds = 120.0
        p = Proxy(s)
        await p.start()
        url = f"http://127.0.0.1:{p.port}/api/v1/write"
        sent = [asyncio.create_task(send(n, url)) for n in ("slow", "slow", "fast")]

        async def all_upstream() -> bool:
            return len(up.received) == 3

        await wait_until(all_upstream, timeout=10, what="the three requests upstream")
        began = time.monotonic()
        await asyncio.wait_for(p.stop(), timeout=4 * drain)
        took = time.monotonic() - began
        answers = await asyncio.wait_for(asyncio.gather(*sent), timeout=5)
    # soon after the drain (room for a loaded machine), not twice it and more as before
    assert drain <= took < drain + 1.5, took
    assert answers[2] == 204
    assert all(isinstance(a, str) for a in answers[:2]), answers
    ended = [r for r in caplog.records if r.levelno == logging.WARNING
             and "still in flight ended at stop" in r.getMessage()]
    assert [(r.getMessage(), r.__dict__["count"]) for r in ended] == [(
        "2 requests still in flight ended at stop, unanswered (their senders send them "
        "again)", 2)]


def test_an_invalid_description_file_at_start_marks_its_kind(tmp_path: Path) -> None:
    """An invalid description among the files read at start is kept with the engine's
    description errors, so its kind reads ``description_error`` as it does from a
    snapshot or an API object: a pod under a Job of the JobSet is not made a Job
    workload of its own (each Job was one). It is on /metrics, not only in the log:
    ``karta_proxy_description_errors{reason="invalid"}`` 1."""
    from tests.karta.test_engine import jobset_karta, obj, pod

    folder = tmp_path / "descriptions"
    folder.mkdir()
    (folder / "jobset.yaml").write_text(yaml.safe_dump(jobset_karta(ownerless=True)))
    s = snapshot_settings(tmp_path)
    s.karta.description_paths = [str(folder)]
    p = Proxy(s)
    get = p.metrics.registry.get_sample_value
    assert get("karta_proxy_description_errors", {"reason": "invalid"}) == 0
    p._load_description_files()
    assert [e.source for e in p.engine.description_errors] == [str(folder / "jobset.yaml")]
    assert get("karta_proxy_description_errors", {"reason": "invalid"}) == 1
    js = obj("jobset.x-k8s.io/v1alpha2", "JobSet", "js", spec={"replicatedJobs": []})
    job = obj("batch/v1", "Job", "js-workers-0", js, spec={"parallelism": 1})
    p.engine.upsert_many([js, job, pod("w", job)])
    att = p.engine.pod("pod-w")
    assert att is not None and att.reason == "description_error"


async def test_the_landing_page_says_which_descriptions_are_in_force_and_not_taken(
    tmp_path: Path,
) -> None:
    """An operator opening the page after an edit sees whether it was taken: the
    descriptions in force by origin, and those not taken by why, where only a log line
    said so."""
    from tests.karta.test_engine import jobset_karta

    folder = tmp_path / "descriptions"
    folder.mkdir()
    (folder / "jobset.yaml").write_text(yaml.safe_dump(jobset_karta(ownerless=True)))
    s = snapshot_settings(tmp_path)
    s.karta.description_paths = [str(folder)]
    async with started(s) as p:
        page = await get_text(p, "/")
        builtin = len(p.engine.descriptions())
    assert (f"<th>descriptions</th><td>{builtin} in force ({builtin} built in); not taken: "
            "1 invalid, 0 held at their last valid version, 0 another description won "
            "over (the log names each)</td>") in page, page
    async with started(snapshot_settings(tmp_path)) as p:
        page = await get_text(p, "/")
    assert f"<td>{builtin} in force ({builtin} built in); none not taken</td>" in page, page


async def test_serve_sizes_the_aux_pool_from_the_usable_cpus(tmp_path: Path) -> None:
    """asyncio's default pool (``karta-aux``) has ``min(32, cores + 4)`` threads for the
    cores the process may use (proxy.cpus), not for the host's: with this thread's
    affinity cut to one CPU, 5 threads, where ThreadPoolExecutor's own default, from
    ``os.cpu_count()``, gave the host's count + 4."""
    import os
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from proxy.runtime import EXIT_START, serve

    host = os.cpu_count() or 1
    if host < 2:
        pytest.skip("one CPU: the host's count and the usable count are the same")
    loop = asyncio.get_running_loop()
    s = snapshot_settings(tmp_path)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # this thread (the loop's) only
    try:
        with socket.socket() as holder:  # the start fails at once: serve() returns
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            s.server.listen_address = f"127.0.0.1:{holder.getsockname()[1]}"
            assert await asyncio.wait_for(serve(s), 30) == EXIT_START
    finally:
        os.sched_setaffinity(0, before)
    pool = loop._default_executor  # type: ignore[attr-defined]
    assert isinstance(pool, ThreadPoolExecutor)
    assert pool._max_workers == 5, (pool._max_workers, host)
    from proxy.runtime import aux_threads

    assert aux_threads(2) == 6 and aux_threads(64) == 32


async def test_an_idle_jq_child_killed_is_reaped_within_the_housekeeping_interval(
        tmp_path: Path) -> None:
    """The jq sandbox's idle child killed from outside is reaped by the proxy's
    housekeeping (no zombie left until the next object event) and counted once."""
    import os
    import signal

    from proxy.karta.jqexpr import JqExpr

    s = snapshot_settings(tmp_path)
    s.karta.jq_sandbox = True
    async with started(s) as p:
        box = p.jq_sandbox
        assert box is not None
        assert box.run(JqExpr("."), "1") == [1]
        pid = box.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # the housekeeping's 1 s, with room
        while os.path.exists(f"/proc/{pid}"):  # a zombie keeps its entry
            assert time.monotonic() < deadline, "the dead child was not reaped"
            await asyncio.sleep(0.05)
        assert box.restarts["died"] == 1
        text = await get_text(p, "/metrics")
        assert 'karta_proxy_jq_sandbox_restarts_total{reason="died"} 1.0' in text


async def test_a_jq_child_killed_during_an_evaluation_is_retried_without_an_object_event(
        tmp_path: Path) -> None:
    """The sandbox's child killed (SIGKILL) while it evaluates a Deployment's status: the
    phase is Undefined (jq_error) at that event, and right again within the backoff's
    first second, by the proxy's jq housekeeping, with no other event of the object (a
    quiet Deployment kept jq_error for days); the re-evaluation is counted."""
    import os
    import signal
    import threading

    s = snapshot_settings(tmp_path)
    s.karta.jq_sandbox = True
    s.karta.jq_timeout_seconds = 10.0  # the child stopped: the evaluation waits for it
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "cart", "namespace": "shop", "uid": "d-cart", "generation": 2},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "cart"}}},
        "status": {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1,
                   "readyReplicas": 1, "availableReplicas": 1},
    }
    async with started(s) as p:
        box = p.jq_sandbox
        assert box is not None
        p.index.apply(p.engine.upsert(deployment))
        facts = p.engine.workload("d-cart")
        assert facts is not None and facts.phase == "Running", facts
        pid = box.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the next evaluation is in flight until the kill
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        deployment["metadata"]["generation"] = 3  # type: ignore[index]
        deployment["status"]["observedGeneration"] = 3  # type: ignore[index]
        p.index.apply(p.engine.upsert(deployment))  # the object's last event
        killer.join()
        facts = p.engine.workload("d-cart")
        assert facts is not None and facts.phase == "Undefined", facts
        assert "the jq sandbox child died during the evaluation (killed by SIGKILL)" \
            in facts.phase_reason, facts.phase_reason
        deadline = time.monotonic() + 10
        while (facts := p.engine.workload("d-cart")) is None or facts.phase != "Running":
            assert time.monotonic() < deadline, facts
            await asyncio.sleep(0.05)
        text = await get_text(p, "/metrics")
    assert "karta_proxy_jq_retries_total 1.0" in text


@pytest.mark.parametrize("cluster", ["my-cluster", "prod-eu-1"])
async def test_a_start_at_the_shipped_cluster_placeholder_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, cluster: str) -> None:
    # an upgrade to 1.10.0 that kept the ConfigMap's my-cluster lost every stamp of agents
    # naming their real cluster, said only by a counter and an alert minutes later
    from tests.proxy_harness import proxy_running

    caplog.set_level(logging.INFO, logger="karta")
    async with ScriptedUpstream() as up, proxy_running(
            tmp_path, up, facts_settings={"external_labels": {"cluster": cluster}}):
        pass
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if "placeholder" in r.getMessage()]
    if cluster != "my-cluster":
        assert said == []
        return
    assert said == [("WARNING", (
        "facts.external_labels.cluster is 'my-cluster', the shipped ConfigMap's placeholder: "
        "set it to this cluster's name, the value its agents send as cluster; meanwhile "
        "relayed series of any other cluster are forwarded unstamped (other_cluster), and "
        "two clusters left at it merge into one in a shared TSDB"))]


@pytest.mark.parametrize("mode", ["cluster", "node"])
def test_the_shipped_configmaps_hold_the_placeholder_the_start_warns_of(mode: str) -> None:
    from proxy.config import PLACEHOLDER_CLUSTER

    root = Path(__file__).resolve().parent.parent
    configmap = yaml.safe_load((root / "config/kubernetes" / mode / "configmap.yaml").read_text())
    (text,) = configmap["data"].values()
    assert yaml.safe_load(text)["facts"]["external_labels"]["cluster"] == PLACEHOLDER_CLUSTER


def _port_free_on_both_families() -> int:
    """A port free on 127.0.0.1 and ::1 alike (a wildcard listener binds both); bounded."""
    import socket

    for _ in range(20):
        with socket.socket() as v4:
            v4.bind(("127.0.0.1", 0))
            port = int(v4.getsockname()[1])
            with socket.socket(socket.AF_INET6) as v6:
                try:
                    v6.bind(("::1", port))
                except OSError:
                    continue
                return port
    pytest.fail("no port free on both 127.0.0.1 and ::1 in 20 tries")


@needs_ipv6
@pytest.mark.parametrize("host", ["", "[::]"])
@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_wildcard_listen_address_serves_ipv4_and_ipv6(
        tmp_path: Path, host: str, tls: bool) -> None:
    """``:PORT`` and ``[::]:PORT`` serve both families, as Prometheus' do: ``:PORT`` was
    bound on 0.0.0.0 alone (the shipped 0.0.0.0:9091 too), so an IPv6-only cluster's pod
    IP was refused; ``[::]`` was asyncio's IPv6-only socket, refusing every IPv4 client."""
    import ssl

    from tests.tls_certs import Authority

    s = snapshot_settings(tmp_path)
    s.server.listen_address = f"{host}:{_port_free_on_both_families()}"
    context: ssl.SSLContext | bool = True  # aiohttp's default checks
    if tls:
        ca = Authority(tmp_path / "pki")
        server = ca.issue("proxy", server=True)
        s.server.tls_cert_file, s.server.tls_key_file = str(server.cert), str(server.key)
        context = ssl.create_default_context(cafile=str(ca.ca_file))
    scheme = "https" if tls else "http"
    timeout = aiohttp.ClientTimeout(total=5)
    async with started(s) as p, aiohttp.ClientSession(timeout=timeout) as session:
        for address in ("127.0.0.1", "[::1]"):
            async with session.get(f"{scheme}://{address}:{p.port}/-/healthy",
                                   ssl=context) as r:
                assert r.status == 200, address
