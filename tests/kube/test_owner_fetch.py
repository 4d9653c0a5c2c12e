"""Owners the watch has not delivered, fetched by GET (proxy/kube/owner_fetch.py), on the
simulator: the ReplicaSet watch cut off (or held back) while a Deployment's new pods
arrive. Every change set the index is given is recorded: no pod may ever be placed in a
made-up ``ReplicaSet`` workload while the ReplicaSet can be read."""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid

import pytest

from proxy import contract
from proxy.karta.engine import Engine
from proxy.karta.model import GroupKind
from proxy.karta.results import ChangeSet
from proxy.kube import owner_fetch
from proxy.kube.source import KubeSource
from proxy.kube.watcher import ResourceWatcher
from tests.kube.conftest import SourceFactory, deployment, eventually, labels, metric, owner, pod
from tests.kubesim import Gone, KubeSim
from tests.kubesim.resources import DEPLOYMENT, REPLICA_SET

NS = "shop"


def fetches(source: KubeSource, outcome: str) -> float:
    return metric(source, contract.OP_OWNER_FETCHES, {"outcome": outcome})


def record(source: KubeSource) -> list[tuple[str, str]]:
    """Every (kind, name) of a workload a pod was placed in, or the index held facts of,
    from now on."""
    seen: list[tuple[str, str]] = []

    def listener(cs: ChangeSet) -> None:
        seen.extend((a.workload.kind, a.workload.name) for a in cs.pods.values()
                    if a is not None and a.workload is not None)
        seen.extend((f.ref.kind, f.ref.name) for f in cs.workloads.values() if f is not None)

    source.index.subscribe(listener)
    return seen


def gets(sim: KubeSim, name: str) -> int:
    """GETs of the ReplicaSet ``name`` the simulator answered or refused."""
    return sum(1 for method, path, _, _ in sim.requests
               if method == "GET" and path.endswith(f"/replicasets/{name}"))


def new_rs(sim: KubeSim, dep: dict, name: str, *, owned: bool = True) -> dict:
    md: dict = {"name": name, "namespace": NS, "labels": {"app": "web"}}
    if owned:
        md["ownerReferences"] = owner(dep)
    return sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": md,
                       "spec": {"replicas": 3}})


def web(source: KubeSource, name: str) -> tuple[str | None, str | None]:
    got = labels(source, NS, name) or {}
    return got.get("karta_kind"), got.get("karta_workload")


async def test_a_pod_whose_replicaset_watch_is_cut_off_is_the_deployments_at_once(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The audit's shape: the ReplicaSet watch fails (500) while a Deployment rolls; the
    new ReplicaSet is fetched once for its three pods, which are the Deployment's from
    the moment the index knows them."""
    dep, _, _ = deployment(sim, "web", NS, replicas=3, rev="1")
    source = await make_source()
    seen = record(source)
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)
    sim.disconnect_watches()
    rs2 = new_rs(sim, dep, "web-2")
    for i in range(3):
        sim.create(pod(f"web-2-{i}", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: all(web(source, f"web-2-{i}") == ("Deployment", "web")
                                 for i in range(3)))
    assert ("ReplicaSet", "web-2") not in seen
    assert all(kind == "Deployment" for kind, _ in seen), seen
    assert gets(sim, "web-2") == 1  # one GET for the three pods
    assert fetches(source, "fetched") == 1
    assert source.owner_fetcher is not None and source.owner_fetcher.parked == 0
    # the watch back: its ADDED of web-2 changes nothing, and its deletion is followed
    sim.fail_resource(REPLICA_SET, None)
    await asyncio.sleep(1.5)
    assert all(kind == "Deployment" for kind, _ in seen), seen


async def test_a_late_watchs_older_event_does_not_undo_the_fetched_copy(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The pod is delivered before its ReplicaSet (whose watch holds back its events):
    the ReplicaSet is fetched as adopted by the Deployment; the watch then replays its
    creation, an orphan, which is older (resourceVersion) and skipped."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    seen = record(source)
    assert sim.hold_watches(REPLICA_SET) >= 1
    orphan = new_rs(sim, dep, "web-2", owned=False)  # created an orphan ...
    rs2 = copy.deepcopy(orphan)
    rs2["metadata"]["ownerReferences"] = owner(dep)
    rs2 = sim.update(rs2)  # ... and adopted
    sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"))
    assert fetches(source, "fetched") == 1
    # the held watch's creation event alone (the simulator's flush writes it with the
    # adoption, in one chunk: one slice, where the newer one would win anyway)
    (watcher,) = source.watchers[GroupKind("apps", "ReplicaSet")][1]
    source.handle(watcher, [("ADDED", copy.deepcopy(orphan))])
    assert web(source, "web-2-0") == ("Deployment", "web")
    sim.flush_watches()  # ADDED (the orphan), then MODIFIED (adopted)
    await asyncio.sleep(1.0)
    assert web(source, "web-2-0") == ("Deployment", "web")
    assert ("ReplicaSet", "web-2") not in seen, seen
    # a later change of it (newer) is applied as ever: deleted, the pod's owner is a ghost
    sim.delete(sim.get("apps/v1", "ReplicaSet", "web-2", NS), cascade=False)
    await eventually(lambda: source.engine.holds(rs2["metadata"]["uid"])
                     and rs2["metadata"]["uid"] not in source.index.workloads)


async def failing_replicasets_and_a_new_pod(sim: KubeSim, make_source: SourceFactory
                                            ) -> KubeSource:
    """A source with a Deployment listed, then every request for ReplicaSets failing (its
    GETs too) while a new ReplicaSet ``web-2`` and its pod ``web-2-0`` are made."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 500)
    sim.disconnect_watches()
    rs2 = new_rs(sim, dep, "web-2")
    sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    return source


async def test_gets_failing_too_fall_back_and_retry(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The ReplicaSet failing whole (its GETs too): the pods go on at once as before (the
    ReplicaSet their workload), and the GET is retried with a backoff; once it answers,
    the pods move to the Deployment while the watch still fails."""
    source = await failing_replicasets_and_a_new_pod(sim, make_source)
    await eventually(lambda: web(source, "web-2-0") == ("ReplicaSet", "web-2"))
    await eventually(lambda: fetches(source, "failed") >= 2)
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)  # GETs served again
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"), timeout=15)
    assert fetches(source, "fetched") == 1
    n = gets(sim, "web-2")
    await asyncio.sleep(1.0)
    assert gets(sim, "web-2") == n  # fetched: no more retries


async def test_an_owner_gone_is_not_retried(sim: KubeSim, make_source: SourceFactory) -> None:
    """404 (no object of that name, or another uid under it): the owner is gone; the old
    behaviour stands, with one GET."""
    deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    phantom = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
               "metadata": {"name": "web-9", "namespace": NS, "uid": str(uuid.uuid4())}}
    sim.create(pod("web-9-0", NS, owner_obj=phantom))
    await eventually(lambda: web(source, "web-9-0") == ("ReplicaSet", "web-9"))
    assert fetches(source, "gone") == 1
    sim.create(pod("web-9-1", NS, owner_obj=phantom))
    await eventually(lambda: web(source, "web-9-1") == ("ReplicaSet", "web-9"))
    await asyncio.sleep(0.5)
    assert gets(sim, "web-9") == 1


async def test_an_owner_given_up_on_is_forgotten_after_its_time(
        sim: KubeSim, make_source: SourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner whose GET found it gone is kept ``FORGET_SECONDS`` (not fetched again
    meanwhile), then forgotten, whatever the table holds: only a full table (1,000
    owners) forgot it before, so under churn the table grew with time (a soak: 2, 4 ...
    14 entries over six cycles with 5 live pods). Fetched again after its time: one GET
    more."""
    monkeypatch.setattr(owner_fetch, "FORGET_SECONDS", 0.5)
    deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    fetcher = source.owner_fetcher
    assert fetcher is not None
    phantom = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
               "metadata": {"name": "web-9", "namespace": NS, "uid": str(uuid.uuid4())}}
    sim.create(pod("web-9-0", NS, owner_obj=phantom))
    await eventually(lambda: fetches(source, "gone") == 1)
    assert len(fetcher._owners) == 1  # kept: not fetched again for its time
    await eventually(lambda: not fetcher._owners, timeout=5)
    sim.create(pod("web-9-1", NS, owner_obj=phantom))
    await eventually(lambda: fetches(source, "gone") == 2)
    assert gets(sim, "web-9") == 2


async def test_a_get_forbidden_warns_once_and_stops_for_the_kind(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 403)  # the binding lost: its GETs refused too
    sim.disconnect_watches()
    with caplog.at_level(logging.WARNING, "proxy.kube.owner_fetch"):
        for rev in ("2", "3"):
            rs = new_rs(sim, dep, f"web-{rev}")
            sim.create(pod(f"web-{rev}-0", NS, owner_obj=rs))
            await eventually(lambda rev=rev: web(source, f"web-{rev}-0")  # type: ignore[misc]
                             == ("ReplicaSet", f"web-{rev}"))
    assert fetches(source, "forbidden") == 1
    assert gets(sim, "web-2") == 1 and gets(sim, "web-3") == 0
    lines = [r.getMessage() for r in caplog.records if "get replicasets.apps" in r.getMessage()]
    assert len(lines) == 1 and "config/rbac/" in lines[0], lines


async def test_over_the_bounds_nothing_is_parked(
        sim: KubeSim, make_source: SourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound on owners tracked, a pod goes on at once (the old behaviour) and
    the fetch not made is counted."""
    monkeypatch.setattr(owner_fetch, "MAX_OWNERS", 1)
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 500)  # GETs fail: the first owner stays tracked
    sim.disconnect_watches()
    rs2, rs3 = new_rs(sim, dep, "web-2"), new_rs(sim, dep, "web-3")
    sim.create(pod("web-2-0", NS, owner_obj=rs2))
    await eventually(lambda: fetches(source, "failed") >= 1)
    sim.create(pod("web-3-0", NS, owner_obj=rs3))
    await eventually(lambda: web(source, "web-3-0") == ("ReplicaSet", "web-3"))
    assert fetches(source, "skipped") == 1
    assert gets(sim, "web-3") == 0


async def test_an_older_event_of_a_parked_copy_neither_drops_it_nor_loops(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The audit's shape: Deployment ``api`` -> ReplicaSet ``api-1`` -> pod, both owner
    kinds' lists and watches failing, their GETs served, the Deployment's slow. The
    ReplicaSet is fetched and parked behind its Deployment's GET; the lagging ReplicaSet
    watch then delivers its creation, older than the copy. That event dropped the parked
    copy: the pod waited for good, and a pod update then started 1,984 GETs of the
    ReplicaSet in 2 s (the copy taken for superseded, what waited parked again)."""
    deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    fetcher = source.owner_fetcher
    assert fetcher is not None
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)
    sim.fail_resource(DEPLOYMENT, 500, collections_only=True)
    sim.disconnect_watches()
    await asyncio.sleep(0.3)
    sim.delay_resource(DEPLOYMENT, 1.0)
    dep = sim.create({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "api", "namespace": NS},
                      "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "api"}}}})
    created = sim.create({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                          "metadata": {"name": "api-1", "namespace": NS,
                                       "labels": {"app": "api"}, "ownerReferences": owner(dep)},
                          "spec": {"replicas": 1}})
    status = copy.deepcopy(created)
    status["status"] = {"replicas": 1}
    sim.update(status)  # the copy fetched is newer than the creation
    p = sim.create(pod("api-1-0", NS, owner_obj=created, labels={"app": "api"}))
    rs_uid, pod_uid = created["metadata"]["uid"], p["metadata"]["uid"]
    await eventually(lambda: rs_uid in fetcher._parked)
    (watcher,) = source.watchers[GroupKind("apps", "ReplicaSet")][1]
    watcher.held[rs_uid] = f"{NS}/api-1"  # as the watch holds what it delivers
    source.handle(watcher, [("ADDED", copy.deepcopy(created))])
    assert rs_uid in fetcher._parked and pod_uid in fetcher._parked
    await eventually(lambda: labels(source, NS, "api-1-0") is not None, timeout=5)
    assert web(source, "api-1-0") == ("Deployment", "api")
    assert fetcher.parked == 0
    n = gets(sim, "api-1")
    assert n == 1
    moved = copy.deepcopy(sim.get("v1", "Pod", "api-1-0", NS))
    moved["metadata"]["labels"]["x"] = "1"
    sim.update(moved)
    await asyncio.sleep(1.5)
    assert gets(sim, "api-1") == n
    assert fetches(source, "superseded") == 0
    assert web(source, "api-1-0") == ("Deployment", "api")


async def test_gets_of_one_owner_are_spaced(sim: KubeSim, make_source: SourceFactory) -> None:
    """Whatever sends what waits back to a GET, one owner's GETs are REFETCH_SECONDS apart
    at least: here the retries of a failing GET, whose backoff starts at 0.2 s (five GETs
    in 1.6 s before)."""
    source = await failing_replicasets_and_a_new_pod(sim, make_source)
    await eventually(lambda: gets(sim, "web-2") >= 1)
    await asyncio.sleep(1.8)
    assert gets(sim, "web-2") <= 1 + int(1.8 / owner_fetch.REFETCH_SECONDS)
    assert fetches(source, "failed") == gets(sim, "web-2")


async def test_a_get_refused_for_load_waits_what_the_server_asked(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """API Priority and Fairness sheds load with a 429 and a ``Retry-After`` (text/plain,
    the header its only word of how long): the next GET of the owner waits that long.
    The backoff alone (1 s apart at least, ``REFETCH_SECONDS``) sent three GETs in the 3
    s a server asked for."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 429, retry_after=3, plain=True)
    sim.disconnect_watches()
    rs2 = new_rs(sim, dep, "web-2")
    sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: gets(sim, "web-2") >= 1)
    await asyncio.sleep(2.5)
    assert gets(sim, "web-2") == 1
    sim.fail_resource(REPLICA_SET, None)
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"), timeout=5)
    # placed by the GET after the wait, or by the ReplicaSet watch's relist once the 429s
    # end, whichever comes first (a loaded clean-clone run saw the relist win: one GET)
    assert gets(sim, "web-2") in (1, 2)


async def test_a_pod_waits_no_longer_than_its_deadline(
        sim: KubeSim, make_source: SourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait is bounded from the moment a pod is parked, the queue for a GET included:
    one GET at a time, two owners whose GETs take 3 s each; the second pod waited 6 s.
    Past the deadline a pod is placed as before; the GET's answer moves it."""
    monkeypatch.setattr(owner_fetch, "CONCURRENCY", 1)
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    seen = record(source)
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)
    sim.delay_resource(REPLICA_SET, 3.0)
    sim.disconnect_watches()
    await asyncio.sleep(0.3)
    for rev in ("2", "3"):
        rs = new_rs(sim, dep, f"web-{rev}")
        sim.create(pod(f"web-{rev}-0", NS, owner_obj=rs, labels={"app": "web"}))
    took = await eventually(lambda: labels(source, NS, "web-2-0") is not None
                            and labels(source, NS, "web-3-0") is not None, timeout=10)
    assert took < owner_fetch.PARK_SECONDS + 1.0, took
    await eventually(lambda: all(web(source, f"web-{rev}-0") == ("Deployment", "web")
                                 for rev in ("2", "3")), timeout=15)
    assert ("ReplicaSet", "web-3") in seen  # placed as before meanwhile
    assert fetches(source, "fetched") == 2


async def test_an_event_after_the_fetcher_stopped_starts_no_task_and_goes_on_at_once(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The source stopping: an event a watcher still delivers after the fetcher stopped
    is not parked and starts no GET and no reaper (nothing would cancel them: they ran on
    over a client being closed); it goes on at once, as before owners were fetched."""
    source = await make_source()
    fetcher = source.owner_fetcher
    assert fetcher is not None
    await fetcher.stop()
    absent = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
              "metadata": {"name": "web-9", "uid": str(uuid.uuid4())}}
    late = sim.create(pod("web-9-0", NS, owner_obj=absent))
    (pods,) = [ws for gk, (_, ws) in source.watchers.items() if gk.kind == "Pod"]
    before = asyncio.all_tasks()
    source.handle(pods[0], [("ADDED", copy.deepcopy(late))])
    assert [t.get_name() for t in asyncio.all_tasks() - before] == []
    assert fetcher.parked == 0
    assert web(source, "web-9-0") == ("ReplicaSet", "web-9")  # placed as before


class _Relist:
    """A relist of the ReplicaSet watcher whose snapshot is older than a copy fetched."""

    def __init__(self, source: KubeSource, watcher: ResourceWatcher, rs_uid: str,
                 seen: list[tuple[str, str]]) -> None:
        self.source, self.watcher, self.rs_uid, self.seen = source, watcher, rs_uid, seen

    def relist_deleted(self) -> float:
        return metric(self.source, "karta_proxy_watch_events_total",
                      {"resource": self.watcher.name, "type": "RELIST_DELETED"})

    def kept(self) -> None:
        """The copy stayed through the relist: the pod never left the Deployment."""
        assert ("ReplicaSet", "web-2") not in self.seen, self.seen
        assert web(self.source, "web-2-0") == ("Deployment", "web")
        assert self.rs_uid in self.watcher.held
        assert self.relist_deleted() == 0


def replicaset_queries(sim: KubeSim) -> list[dict[str, str]]:
    return [q for method, path, q, _ in sim.requests
            if method == "GET" and path.endswith("/replicasets")]


def paging(sim: KubeSim) -> bool:
    """A ReplicaSet list asked for a page after its first."""
    return any("continue" in q for q in replicaset_queries(sim))


def relisted(sim: KubeSim) -> bool:
    """A ReplicaSet watch was asked for after the last such page: that list ended (its
    watcher asks for nothing else meanwhile)."""
    qs = replicaset_queries(sim)
    pages = [i for i, q in enumerate(qs) if "continue" in q]
    return bool(pages) and any(q.get("watch") == "1" for q in qs[pages[-1] + 1:])


async def a_relist_older_than_a_fetched_copy(
        sim: KubeSim, make_source: SourceFactory, *, engine: Engine | None = None,
        watches_fail: bool = False) -> _Relist:
    """The ReplicaSet watcher relists (a 410) in pages of one ReplicaSet, those after the
    first slow (a list of many that takes seconds); while it reads them, a new
    ReplicaSet ``web-2`` and its pod are made: the pod's watch delivers it, ``web-2`` is
    fetched, and the list, one snapshot at its first page's resourceVersion, ends
    without it. ``watches_fail``: the ReplicaSet watches fail (500) from the list on,
    so that no watch event of ``web-2`` comes."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    deployment(sim, "api", NS, replicas=1, rev="1")
    source = await make_source(engine=engine)
    seen = record(source)
    (watcher,) = source.watchers[GroupKind("apps", "ReplicaSet")][1]
    assert isinstance(watcher, ResourceWatcher)
    watcher.page_size = 1  # pages without 500 ReplicaSets
    sim.delay_resource(REPLICA_SET, 2.0, continued=True)
    # its watch is open (not between two of its 2 s watches)
    await eventually(lambda: sim.hold_watches(REPLICA_SET) == 1)
    listed_at = sim.resource_version
    sim.flush_watches(error=Gone("too old resource version"))
    await eventually(lambda: paging(sim))  # its first page is read
    if watches_fail:
        sim.fail_resource(REPLICA_SET, 500, watch_only=True)
    rs2 = new_rs(sim, dep, "web-2")
    sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"))
    assert fetches(source, "fetched") == 1
    assert int(rs2["metadata"]["resourceVersion"]) > listed_at
    assert not relisted(sim)  # fetched while it still lists
    # the list ends (at listed_at, without web-2); the watch from there replays its ADDED
    await eventually(lambda: relisted(sim))
    assert replicaset_queries(sim)[-1].get("resourceVersion") == str(listed_at)
    await asyncio.sleep(0.5)
    sim.delay_resource(REPLICA_SET, None)
    return _Relist(source, watcher, rs2["metadata"]["uid"], seen)


async def test_a_relist_older_than_a_fetched_copy_keeps_it(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The relist did not find ``web-2`` (created after its snapshot) and retracted the
    copy fetched: with no ghost to walk through (``karta.tombstone_seconds: 0``, or past
    the ghosts' bound) the pod moved to the made-up ``ReplicaSet/web-2`` until the
    watch's ADDED moved it back, two label sets of one series. Kept: the watch from the
    list's version delivers it, and its deletion, which retracts it as ever."""
    r = await a_relist_older_than_a_fetched_copy(sim, make_source,
                                                 engine=Engine(ghost_seconds=0))
    r.kept()
    sim.delete(sim.get("apps/v1", "ReplicaSet", "web-2", NS), cascade=False)
    await eventually(lambda: web(r.source, "web-2-0") == ("ReplicaSet", "web-2"))
    assert r.rs_uid not in r.watcher.held
    assert r.relist_deleted() == 0  # by the watch's DELETED


async def test_a_copy_kept_by_an_older_relist_goes_at_the_next_relist_past_it(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """No watch event of ``web-2`` comes (its watches fail), and it is deleted: the next
    relist, at a version past the copy's, retracts it (its pod below its ghost). The
    relist older than the copy had retracted it at once (counted as a deletion)."""
    r = await a_relist_older_than_a_fetched_copy(sim, make_source, watches_fail=True)
    r.kept()
    sim.delete(sim.get("apps/v1", "ReplicaSet", "web-2", NS), cascade=False)
    sim.compact()  # the watch from the old list's version: 410, a relist
    sim.fail_resource(REPLICA_SET, None)
    await eventually(lambda: r.rs_uid not in r.watcher.held)
    assert r.relist_deleted() == 1
    assert r.source.engine.holds(r.rs_uid) and r.rs_uid not in r.source.index.workloads


async def test_a_relist_on_a_store_gone_back_retracts_a_newer_copy(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The API server back on an etcd restored from a backup, without ``web-2``: the
    relist's version is below the copy's, which is of the old history and says nothing
    of the new one (where no watch event of ``web-2`` will ever come). It is retracted,
    as what the list does not find always was; kept, it stayed until a list passed the
    old history's version."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)
    sim.disconnect_watches()
    rs2 = new_rs(sim, dep, "web-2")
    sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"))
    rs_uid = rs2["metadata"]["uid"]
    (watcher,) = source.watchers[GroupKind("apps", "ReplicaSet")][1]
    assert rs_uid in watcher.held
    await sim.stop()
    sim.fail_resource(REPLICA_SET, None)
    sim.reset_store(resource_version=1)
    await sim.start()
    await eventually(lambda: rs_uid not in watcher.held, timeout=15)
    assert not watcher.held  # the restored store is empty


async def test_a_store_gone_back_forgets_the_versions_of_copies_fetched(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """The API server back on an etcd restored from a backup that holds ``web-2`` (the
    same uid) from before the Deployment adopted it: the restored object, at a version
    below the copy's old-history one, is applied. The versions of copies fetched were
    kept, and every event and list item of the new history below them was skipped as
    older than the copy: the pod stayed in the Deployment the copy named."""
    dep, _, _ = deployment(sim, "web", NS, replicas=1, rev="1")
    for i in range(10):  # every watcher's version past what the restored store reaches
        dep["metadata"].setdefault("annotations", {})["n"] = str(i)
        dep = sim.update(dep)
    source = await make_source()
    sim.fail_resource(REPLICA_SET, 500, collections_only=True)
    sim.disconnect_watches()
    rs2 = new_rs(sim, dep, "web-2")
    web20 = sim.create(pod("web-2-0", NS, owner_obj=rs2, labels={"app": "web"}))
    await eventually(lambda: web(source, "web-2-0") == ("Deployment", "web"))
    rs_uid = rs2["metadata"]["uid"]
    copy_rv = int(rs2["metadata"]["resourceVersion"])
    await sim.stop()
    sim.fail_resource(REPLICA_SET, None)
    sim.reset_store(resource_version=1)
    for obj in (dep, {**rs2, "metadata": {k: v for k, v in rs2["metadata"].items()
                                          if k not in ("ownerReferences", "resourceVersion")}},
                web20):
        restored = copy.deepcopy(obj)
        restored["metadata"].pop("resourceVersion", None)
        sim.create(restored)
    assert sim.resource_version < copy_rv
    await sim.start()
    await eventually(lambda: web(source, "web-2-0") == ("ReplicaSet", "web-2"), timeout=15)
    (watcher,) = source.watchers[GroupKind("apps", "ReplicaSet")][1]
    # web-1 not in the backup: retracted once the relist's pages are through, a loop turn
    # or more after web-2's page moved the pod (waited for, not looked at once)
    await eventually(lambda: set(watcher.held) == {rs_uid}, timeout=5)


def _phantom(name: str) -> dict:
    """A ReplicaSet no API server holds: its GET answers 404 (the owner given up on)."""
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4())}}


async def test_a_stopped_source_leaves_no_timer_of_its_fetcher(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """An owner given up on is forgotten by a timer ``FORGET_SECONDS`` (60 s) later; the
    source stopped, the timer was left on the loop, holding the fetcher (and through its
    callbacks the source and its index) for up to a minute. ``stop`` cancels it."""
    deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    fetcher = source.owner_fetcher
    assert fetcher is not None
    sim.create(pod("web-9-0", NS, owner_obj=_phantom("web-9")))
    await eventually(lambda: fetches(source, "gone") == 1)
    loop = asyncio.get_running_loop()

    def timers() -> list[asyncio.TimerHandle]:
        return [h for h in loop._scheduled  # type: ignore[attr-defined]
                if not h.cancelled() and getattr(h._callback, "__self__", None) is fetcher]

    assert len(timers()) == 1  # the given-up owner's
    await source.stop()
    assert timers() == []


async def test_owners_given_up_on_stay_within_the_bound_and_leave_at_their_time(
        sim: KubeSim, make_source: SourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """More absent owners given up on (404) than the table holds, within their
    ``FORGET_SECONDS``: the table stays at ``MAX_OWNERS`` (the rest skipped, counted
    once each), and every entry leaves at its time by its own timer, so an owner named
    afterwards is fetched again. What ``_prune`` did (forget, on a full table, entries
    whose time was over) the timers do at that time: it was removed."""
    monkeypatch.setattr(owner_fetch, "MAX_OWNERS", 3)
    monkeypatch.setattr(owner_fetch, "FORGET_SECONDS", 1.0)
    deployment(sim, "web", NS, replicas=1, rev="1")
    source = await make_source()
    fetcher = source.owner_fetcher
    assert fetcher is not None
    most = 0
    for i in range(5):
        sim.create(pod(f"lost-{i}-0", NS, owner_obj=_phantom(f"lost-{i}")))
        await eventually(lambda i=i: web(source, f"lost-{i}-0")  # type: ignore[misc]
                         == ("ReplicaSet", f"lost-{i}"))
        most = max(most, len(fetcher._owners))
    assert most == 3 and fetches(source, "gone") == 3 and fetches(source, "skipped") == 2
    await eventually(lambda: not fetcher._owners, timeout=5)
    sim.create(pod("lost-5-0", NS, owner_obj=_phantom("lost-5")))
    await eventually(lambda: fetches(source, "gone") == 4)
    assert len(fetcher._owners) == 1


async def test_every_outcome_is_served_at_0_from_the_start(
        sim: KubeSim, make_source: SourceFactory) -> None:
    """A rate over an outcome not counted yet reads 0, not absent (metric() reads an
    absent sample as 0: the registry is asked directly)."""
    source = await make_source()
    assert source.owner_fetcher is not None
    for outcome in owner_fetch.OUTCOMES:
        assert source.registry.get_sample_value(
            contract.OP_OWNER_FETCHES, {"outcome": outcome}) == 0.0, outcome
