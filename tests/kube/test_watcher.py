"""One ResourceWatcher on its own, against the simulator, with a recording sink; plus
its pure parts (backoff, slice sizing, deletion stubs)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from proxy.kube.client import KubeApiError, KubeClient
from proxy.kube.discovery import ApiResource
from proxy.kube.watcher import (
    FIRST_PAGE,
    MAX_SLICE,
    PAGE_BYTES,
    Backoff,
    ClientWatchers,
    Refusal,
    ResourceWatcher,
    Watcher,
    WatchEvent,
    WatchMetrics,
    deletion_stub,
)
from tests.kube.conftest import eventually, pod
from tests.kubesim import ApiError, Gone, KubeSim, TooLargeResourceVersion
from tests.kubesim.resources import POD

PODS = ApiResource("", "v1", "Pod", "pods", True)
KARTAS = ApiResource("run.ai", "v1alpha1", "Karta", "kartas", False)


class RecordingSink:
    """A WatchSink that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.slices: list[int] = []
        self.times_current = 0
        self.healthy: list[bool] = []
        self.refused: list[int] = []
        #: what ``unserved`` answers: the watcher stays and retries on its own
        self.stays = False
        self.new_histories = 0
        self.relists = 0
        #: ``answered`` calls: how many health changes had been told by then, each time
        self.answered_at: list[int] = []

    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        self.events.extend(events)
        self.slices.append(len(events))

    def current(self, watcher: Watcher) -> None:
        self.times_current += 1

    def relisted(self, watcher: Watcher) -> None:
        self.relists += 1

    def health(self, watcher: Watcher, healthy: bool) -> None:
        self.healthy.append(healthy)

    def answered(self, watcher: Watcher) -> None:
        self.answered_at.append(len(self.healthy))

    def unserved(self, watcher: Watcher, error: KubeApiError) -> Refusal:
        self.refused.append(error.status)
        watcher.synced.set()
        return Refusal.RETRACT if self.stays else Refusal.DROP

    def fetched_after(self, watcher: Watcher, uid: str, version: str) -> bool:
        return False  # no owner fetch here: the watcher alone

    def new_history(self, watcher: Watcher) -> bool:
        self.new_histories += 1
        return True  # the watcher alone: always the first to see a restore


    def names(self, etype: str) -> list[str]:
        return [o["metadata"]["name"] for t, o in self.events if t == etype]


Make = Callable[..., ResourceWatcher]


@pytest.fixture
async def make(client: KubeClient) -> AsyncIterator[Make]:
    made: list[ResourceWatcher] = []
    metrics = WatchMetrics(CollectorRegistry())

    def build(sink: RecordingSink, resource: ApiResource = PODS,
              **kwargs: object) -> ResourceWatcher:
        kwargs.setdefault("watch_timeout", lambda: 2)
        kwargs.setdefault("idle_timeout", 1.5)
        kwargs.setdefault("backoff_max", 0.3)
        w = ResourceWatcher(client, resource, sink, metrics, **kwargs)  # type: ignore[arg-type]
        made.append(w)
        return w

    yield build
    for w in made:
        await w.stop()


async def started(make: Make, sink: RecordingSink, **kwargs: object) -> ResourceWatcher:
    """A watcher started and past its initial list (or told its resource is not served)."""
    w = make(sink, **kwargs)
    w.start()
    await asyncio.wait_for(w.synced.wait(), 5)
    return w


# -- pure parts ----------------------------------------------------------------------------


def test_backoff_grows_with_full_jitter_up_to_the_cap() -> None:
    b = Backoff(base=0.2, cap=1.0)
    delays = [b.next() for _ in range(40)]
    assert all(0.1 <= d <= 1.0 for d in delays)
    assert delays[0] <= 0.2  # first attempt: at most the base
    assert b.attempt == 30  # the exponent stops growing (no float overflow)
    b.reset()
    assert b.attempt == 0 and b.next() <= 0.2


def test_slices_are_sized_by_the_watchers_budget() -> None:
    sink = RecordingSink()
    w = ResourceWatcher(None, PODS, sink, WatchMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                        slice_budget=0.004)
    assert w.slices.budget == 0.004 and w.slices.most == MAX_SLICE


def test_deletion_stub_and_name() -> None:
    assert deletion_stub(PODS, "u1", "ml/web-0") == {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "uid": "u1", "namespace": "ml"}}
    assert deletion_stub(KARTAS, "u2", "/rayjob") == {
        "apiVersion": "run.ai/v1alpha1", "kind": "Karta",
        "metadata": {"name": "rayjob", "uid": "u2"}}
    w = ResourceWatcher(None, PODS, RecordingSink(),  # type: ignore[arg-type]
                        WatchMetrics(CollectorRegistry()), namespace="ml",
                        held={"u1": "ml/web-0"})
    assert w.name == "ml/pods" and w.stub("u1") == deletion_stub(PODS, "u1", "ml/web-0")
    cluster_wide = ResourceWatcher(None, KARTAS, RecordingSink(),  # type: ignore[arg-type]
                                   WatchMetrics(CollectorRegistry()), namespace="ml")
    assert cluster_wide.namespace is None and cluster_wide.name == "kartas.run.ai"


async def test_client_watchers_builds_configured_resource_watchers(
        client: KubeClient) -> None:
    factory = ClientWatchers(client, WatchMetrics(CollectorRegistry()), backoff_max=2.0,
                             idle_timeout=5.0, watch_timeout=7)
    held = {"u": "ml/a"}
    w = factory(PODS, RecordingSink(), metadata_only=True, namespace="ml",
                field_selector="spec.nodeName=n1", held=held)
    assert isinstance(w, ResourceWatcher)
    assert (w.metadata_only, w.namespace, w.field_selector) == (True, "ml", "spec.nodeName=n1")
    assert w.held is held and w.backoff.cap == 2.0 and w.idle_timeout == 5.0
    assert w.watch_timeout() == 7
    default = ClientWatchers(client, WatchMetrics(CollectorRegistry()))(
        PODS, RecordingSink(), metadata_only=False, namespace=None, field_selector="",
        held={})
    assert 240 <= default.watch_timeout() <= 480  # jittered, as a real client does


# -- against the simulator -----------------------------------------------------------------


async def test_paginated_list_then_watch(sim: KubeSim, make: Make) -> None:
    for i in range(5):
        sim.create(pod(f"p{i}"))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2)
    assert sorted(sink.names("ADDED")) == [f"p{i}" for i in range(5)]
    assert all(o["apiVersion"] == "v1" and o["kind"] == "Pod" for _, o in sink.events)
    assert len(w.held) == 5 and w.resource_version
    lists = [q for _, path, q, _ in sim.requests if path == "/api/v1/pods" and "watch" not in q]
    assert [q.get("limit") for q in lists] == ["2", "2", "2"]
    assert sum("continue" in q for q in lists) == 2
    assert sink.healthy == [] and sink.times_current >= 1  # healthy from the start: no change
    # then the watch: a creation, a deletion, and a deletion of something never seen
    p5 = sim.create(pod("p5"))
    await eventually(lambda: "p5" in sink.names("ADDED"))
    sim.delete(p5)
    await eventually(lambda: "p5" in sink.names("DELETED"))
    assert p5["metadata"]["uid"] not in w.held
    watches = [q for _, path, q, _ in sim.requests if "watch" in q]
    assert watches and watches[0]["allowWatchBookmarks"] == "true"
    assert watches[0]["timeoutSeconds"] == "2"


def heavy_pod(name: str) -> dict[str, object]:
    """A pod of 1.2 MB of JSON: the size of an Argo Workflow whose ``status.nodes`` holds
    thousands of steps (a pod here, so the test needs no CRD)."""
    obj = pod(name)
    obj["metadata"]["annotations"] = {"example.com/nodes": "x" * 1_200_000}
    return obj


async def test_slices_of_heavy_objects_hold_one_each(sim: KubeSim, make: Make) -> None:
    """A slice is weighed by its bytes, not only counted: a list's first slice was 64
    items and a watcher's grew on cheap events and bookmarks up to 4,096, so a list or a
    burst of 1-2 MB objects (Argo Workflows, each ~160 ms through the engine) went to the
    sink in one slice and held the event loop for seconds (1.8 s for 10 Workflows)."""
    for i in range(4):
        sim.create(heavy_pod(f"h{i}"))
    sink = RecordingSink()
    w = await started(make, sink)
    assert sink.slices == [1, 1, 1, 1]  # the list: one at a time, not [4]
    w.slices.size = 64  # as grown on bookmarks and cheap events
    sim.hold_watches()
    for i in range(4, 7):
        sim.create(heavy_pod(f"h{i}"))
    sim.flush_watches()  # the three events reach the watcher in one chunk
    await eventually(lambda: len(sink.events) == 7)
    assert sink.slices[4:] == [1, 1, 1]


async def test_list_pages_are_sized_by_their_bytes(sim: KubeSim, make: Make) -> None:
    """A page's ``limit`` comes from the last page's bytes per item: the API server pages
    by count, so a list of 200 Argo Workflows of 1.7 MB was one answer of 331 MB, read
    and decoded on the event loop in one piece (0.75-0.9 s). Small items keep the
    ``page_size``; the first page of a watcher is ``FIRST_PAGE`` items."""
    for i in range(60):
        obj = pod(f"b{i}")
        obj["metadata"]["annotations"] = {"example.com/blob": "x" * 300_000}
        sim.create(obj)
    sink = RecordingSink()
    w = await started(make, sink)
    limits = [q.get("limit", "") for _, path, q, _ in sim.requests
              if path == "/api/v1/pods" and "watch" not in q]
    per_page = PAGE_BYTES // 300_000  # ~27 pods of ~300 KB in 8 MiB
    assert limits[0] == str(FIRST_PAGE)
    assert int(limits[1]) in range(per_page - 2, per_page + 1)  # as served: ~300.3 KB
    assert len(sink.events) == 60 and len(w.held) == 60


async def test_a_listed_object_carries_the_uid_string_its_watcher_holds_it_by(
    sim: KubeSim, make: Make
) -> None:
    """The engine keeps a pod's uid for its life, and so does the watcher (``held``'s
    key): one string for both, not two equal copies (~4.7 MB at 37.5k pods)."""
    for i in range(3):
        sim.create(pod(f"p{i}"))
    sink = RecordingSink()
    w = await started(make, sink)
    keys = {k: k for k in w.held}
    assert len(sink.events) == 3
    for _, obj in sink.events:
        uid = obj["metadata"]["uid"]
        assert uid is keys[uid]


async def test_relist_after_410_delivers_only_what_changed(sim: KubeSim, make: Make) -> None:
    """A relist after 410 decodes and delivers only the items whose resourceVersion is
    not what this watcher delivered: at 37.5k pods the rest was 2.5 s of decoding and
    engine work on the event loop (docs/performance.md, "Ninth pass")."""
    made = {f"p{i}": sim.create(pod(f"p{i}")) for i in range(4)}
    sink = RecordingSink()
    w = await started(make, sink, page_size=2)
    assert sink.relists == 0  # the first list is no relist
    seen_by_watch = dict(made["p1"], metadata={**made["p1"]["metadata"], "labels": {"a": "1"}})
    sim.update(seen_by_watch)
    await eventually(lambda: sink.names("MODIFIED") == ["p1"])
    await sim.stop()
    changed = sim.update(dict(made["p2"], metadata={**made["p2"]["metadata"],
                                                     "labels": {"b": "2"}}))
    sim.delete(made["p3"])
    sim.create(pod("p4"))
    sim.compact()  # the watcher's resourceVersion is gone: it must list again
    before = len(sink.events)
    await sim.start()
    await eventually(lambda: "p3" in sink.names("DELETED") and "p4" in sink.names("ADDED"),
                     timeout=5)
    after = sorted((t, o["metadata"]["name"]) for t, o in sink.events[before:])
    assert after == [("ADDED", "p2"), ("ADDED", "p4"), ("DELETED", "p3")]
    [p2] = [o for t, o in sink.events[before:] if o["metadata"]["name"] == "p2"]
    assert p2["metadata"]["labels"] == {"b": "2"} and p2["kind"] == "Pod"
    uid2 = changed["metadata"]["uid"]
    assert w.versions[uid2] == changed["metadata"]["resourceVersion"]
    assert set(w.versions) == set(w.held) and len(w.held) == 4  # p0, p1, p2, p4
    # told once the list is through: after the retraction's slice and its loop turn, so a
    # turn after p3's DELETED (looked at once, it was still 0 when the wait above ended
    # in that turn): waited for, then counted
    await eventually(lambda: sink.relists >= 1, timeout=5)
    assert sink.relists == 1  # told, for the heap's trim (KubeSource.relisted)


async def test_held_objects_handed_on_are_delivered_again(sim: KubeSim, make: Make) -> None:
    """A mode switch hands the old watcher's ``held`` on for the relist diff; what it
    held came in the other mode, so the new watcher's list delivers all of it."""
    p0 = sim.create(pod("p0"))
    sink = RecordingSink()
    w = await started(make, sink, held={p0["metadata"]["uid"]: "default/p0",
                                        "gone-uid": "default/gone"})
    assert sink.names("ADDED") == ["p0"] and sink.names("DELETED") == ["gone"]
    assert set(w.versions) == {p0["metadata"]["uid"]}


@pytest.mark.parametrize("body", [b"not json", b'{"items": [null]}', b'{"items": {}}',
                                  b'{"metadata": {"resourceVersion": 7}, "items": []}',
                                  b'{"items": [{"metadata": {"uid": 1}}]}'])
async def test_malformed_list_page_is_listed_again(sim: KubeSim, make: Make,
                                                   body: bytes) -> None:
    """A list answer that is not a valid list (broken JSON, a null item, a wrong type
    where the watcher reads) is logged and listed again after a backoff; the watcher
    lives on and delivers the real list."""
    sim.create(pod("p0"))
    sim.garbled_lists.append(body)
    sink = RecordingSink()
    await started(make, sink)
    assert sink.names("ADDED") == ["p0"] and not sim.garbled_lists
    errors = [q for _, path, q, _ in sim.requests if path == "/api/v1/pods"
              and "watch" not in q]
    assert len(errors) == 2  # the garbled answer and the real one


async def test_metadata_only_and_field_selector(sim: KubeSim, make: Make) -> None:
    sim.create(pod("here", node="n1"))
    sim.create(pod("there", node="n2"))
    sink = RecordingSink()
    await started(make, sink, metadata_only=True, field_selector="spec.nodeName=n1",
                  namespace="default")
    assert sink.names("ADDED") == ["here"]
    [(_, obj)] = sink.events
    assert "spec" not in obj and obj["kind"] == "Pod" and obj["apiVersion"] == "v1"
    asked = [(q, a) for _, path, q, a in sim.requests
             if path == "/api/v1/namespaces/default/pods"]
    assert asked and all(q["fieldSelector"] == "spec.nodeName=n1" for q, _ in asked)
    assert all("PartialObjectMetadata" in a for _, a in asked)


async def test_stopped_watcher_delivers_nothing_more(sim: KubeSim, make: Make) -> None:
    sink = RecordingSink()
    w = await started(make, sink)
    await w.stop()
    sim.create(pod("late"))
    await asyncio.sleep(0.3)  # a stopped watcher must stay silent: nothing to wait for
    assert "late" not in sink.names("ADDED")
    await w.stop()  # idempotent


async def test_unreachable_then_back(sim: KubeSim, make: Make) -> None:
    sink = RecordingSink()
    w = await started(make, sink)
    await sim.stop()
    await eventually(lambda: sink.healthy[-1:] == [False], timeout=5)
    assert not w.healthy
    sim.create(pod("meanwhile"))
    await sim.start()
    await eventually(lambda: "meanwhile" in sink.names("ADDED"), timeout=5)
    assert sink.healthy[-1] is True and w.healthy


@pytest.mark.parametrize(("status", "plain"), [(429, False), (429, True), (503, False)])
async def test_a_retry_after_is_waited_out(sim: KubeSim, make: Make, status: int,
                                           plain: bool) -> None:
    """A list answered 429 (or 503) with Retry-After: 1 is retried no sooner than that,
    though the backoff (capped at 0.3 s here) would allow it, and a watcher answering
    again (``retry_now``) does not cut it short. It was ignored: 53 of the audit's 71
    requests came within the 10 s the server asked for. ``plain``: the 429 of API
    priority and fairness, a text/plain body, the header alone saying how long."""
    sim.fail_resource(POD, status, retry_after=1, plain=plain)
    sink = RecordingSink()
    w = make(sink)
    w.start()

    def asked() -> int:
        return sum(1 for _, path, _, _ in sim.requests if path == "/api/v1/pods")

    await eventually(lambda: asked() >= 1, timeout=5)
    started_at = time.monotonic()
    await asyncio.sleep(0.3)
    w.retry_now()  # another watcher is back: not a reason to ask before the 1 s
    await asyncio.sleep(2.2)
    n = asked()
    elapsed = time.monotonic() - started_at
    assert n <= elapsed / 1.0 + 1, (n, elapsed)  # one a second at most; was ~1 per 0.15 s
    assert n >= 2  # retried all the same
    sim.fail_resource(POD, None)
    await asyncio.wait_for(w.synced.wait(), 5)


async def test_unserved_resource_is_reported(sim: KubeSim, make: Make) -> None:
    sink = RecordingSink()
    await started(make, sink,
                  resource=ApiResource("nothing.example", "v1", "Thing", "things", True))
    assert sink.refused[:1] == [404]  # not served: reported, no events, synced anyway
    assert sink.events == []


@pytest.mark.parametrize("tail", ["error500", "malformed"])
async def test_events_before_a_watch_error_reach_the_sink(sim: KubeSim, make: Make,
                                                          tail: str) -> None:
    """Events that arrive in one chunk with an ERROR (not 410) or a malformed line after
    them are handed on before the watcher gives the stream up: they used to be recorded
    as delivered (``held``, ``versions``) and then dropped with the slice, so a deleted
    pod stayed live and a new one was never indexed (neither a resumed watch nor a
    relist delivers what ``versions`` already records)."""
    p0 = sim.create(pod("p0"))
    sim.create(pod("p1"))
    sink = RecordingSink()
    w = await started(make, sink)
    assert sorted(sink.names("ADDED")) == ["p0", "p1"]
    await eventually(lambda: sim.watch_count(POD) == 1)
    assert sim.hold_watches() == 1
    sim.delete(p0)
    p2 = sim.create(pod("p2"))
    if tail == "error500":
        sim.flush_watches(error=ApiError(500, "InternalError", "etcd watch channel closed"))
    else:
        sim.flush_watches(raw=b'{"type": "MODIFIED", "object": {broken\n')
    await eventually(lambda: "p0" in sink.names("DELETED") and "p2" in sink.names("ADDED"),
                     timeout=5)
    assert sink.names("DELETED") == ["p0"]
    assert set(w.held) == {o["metadata"]["uid"] for o in sim.objects(POD)}
    assert w.versions[p2["metadata"]["uid"]] == p2["metadata"]["resourceVersion"]
    assert w.metrics.restarts.labels(w.name, "error")._value.get() >= 1
    # still watching: what comes next arrives as before
    sim.create(pod("p3"))
    await eventually(lambda: "p3" in sink.names("ADDED"), timeout=5)


@pytest.mark.parametrize("cut", ["disconnect", "idle", "error500"])
async def test_a_broken_watch_resumes_from_the_newest_version_seen(sim: KubeSim, make: Make,
                                                                   cut: str) -> None:
    """After a broken stream, an idle one or an ERROR, the watch resumes from the last
    resourceVersion it saw (event or bookmark), not the one it started from: nothing is
    replayed, and an etcd compaction in between costs no relist."""
    sim.create(pod("p0"))
    sink = RecordingSink()
    w = await started(make, sink)
    await eventually(lambda: sim.watch_count(POD) == 1)
    for i in range(1, 6):
        sim.create(pod(f"p{i}"))
    await eventually(lambda: len(sink.names("ADDED")) == 6
                     and w.resource_version == str(sim.resource_version))
    sim.compact()  # the watch's first resourceVersion is gone; the newest one is not

    def watches() -> list[dict[str, str]]:
        return [q for _, path, q, _ in sim.requests if path == "/api/v1/pods" and "watch" in q]

    def lists() -> int:  # relists: an idle stream's one-item probe is none
        return _pod_lists(sim)

    n_watches, n_lists = len(watches()), lists()
    if cut == "disconnect":
        sim.disconnect_watches()
    elif cut == "idle":
        sim.hang_watches()
    else:
        sim.hold_watches()
        sim.flush_watches(error=ApiError(500, "InternalError", "etcd watch channel closed"))
    await eventually(lambda: len(watches()) > n_watches, timeout=5)
    assert watches()[n_watches]["resourceVersion"] == str(sim.resource_version)
    sim.create(pod("p6"))
    await eventually(lambda: "p6" in sink.names("ADDED"), timeout=5)
    assert sorted(sink.names("ADDED")) == [f"p{i}" for i in range(7)]  # none twice
    assert lists() == n_lists
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 0


async def _pod_watches_once_cut(sim: KubeSim, cut: str) -> int:
    """Pod watches opened over 2 s once the simulator cuts every watch (``cut``: its
    ``empty_watches`` or ``short_watches``) and the open ones are dropped; checked against
    the backoff's pace over the time that passed (2 s, or more on a loaded machine)."""
    def watches() -> int:
        return sum(1 for _, path, q, _ in sim.requests if path == "/api/v1/pods" and "watch" in q)

    setattr(sim, cut, True)
    sim.disconnect_watches()
    await asyncio.sleep(0.3)
    n0 = watches()
    since = time.monotonic()
    await asyncio.sleep(2.0)
    n = watches() - n0
    assert 2 <= n <= _at_backoff_pace(time.monotonic() - since), n
    return n


def _at_backoff_pace(elapsed: float) -> float:
    """The most retries a backoff (0.1-0.3 s apart) allows in ``elapsed`` seconds, with
    room: 25 in 2 s; without the backoff it was several hundred."""
    return elapsed / 0.1 + 5

async def test_a_watch_ended_at_once_with_nothing_is_retried_after_a_backoff(
        sim: KubeSim, make: Make) -> None:
    """A watch that the server (or a proxy in between) ends cleanly at once with no
    event is watched again after a jittered, growing backoff, not at once: that was a
    tight loop of ~150 watch requests a second. What happened meanwhile arrives once
    watches are served again."""
    sink = RecordingSink()
    w = await started(make, sink)  # backoff cap 0.3 s
    await eventually(lambda: sim.watch_count(POD) == 1)

    n = await _pod_watches_once_cut(sim, "empty_watches")  # 0.1-0.3 s apart
    assert w.metrics.restarts.labels(w.name, "empty")._value.get() >= n - 1
    sim.create(pod("meanwhile"))
    sim.empty_watches = False
    await eventually(lambda: "meanwhile" in sink.names("ADDED"), timeout=5)
    assert w.healthy


@pytest.mark.parametrize("line", [
    b"null\n", b"[1]\n", b'"ADDED"\n',
    b'{"type": "ADDED", "object": {"kind": "Pod"}}\n',  # no metadata
    b'{"type": "MODIFIED", "object": [1]}\n',
    b'{"type": "ADDED", "object": {"metadata": {"name": "x", "uid": 7}}}\n',
    b'{"type": "ADDED", "object": {"metadata": 3}}\n',
    b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": 9}}}\n',
    b'{"type": ["ADDED"], "object": {}}\n',
    b'{"type": "ERROR", "object": {"code": "teapot"}}\n',
])
async def test_a_watch_line_of_the_wrong_shape_is_relisted_not_fatal(
        sim: KubeSim, make: Make, line: bytes) -> None:
    """Valid JSON that is not a watch event the watcher can use is a malformed line:
    logged and relisted after the backoff, as broken JSON is. It used to raise
    AttributeError / KeyError out of the task: the resource's index froze for good, and
    stopping the source raised the dead task's exception."""
    sim.create(pod("p0"))
    sink = RecordingSink()
    w = await started(make, sink)
    await eventually(lambda: sim.watch_count(POD) == 1)

    def lists() -> int:
        return sum(1 for _, path, q, _ in sim.requests
                   if path == "/api/v1/pods" and "watch" not in q)

    n_lists = lists()
    assert sim.hold_watches() == 1
    sim.flush_watches(raw=line)
    errors = w.metrics.restarts.labels(w.name, "error")
    await eventually(lambda: errors._value.get() >= 1
                     or (w._task is not None and w._task.done()), timeout=5)
    assert w._task is not None and not w._task.done()
    if not line.startswith(b'{"type": "ERROR"'):  # an ERROR event only resumes the watch
        await eventually(lambda: lists() > n_lists, timeout=5)
    sim.create(pod("p1"))
    await eventually(lambda: "p1" in sink.names("ADDED"), timeout=5)


class FailingSink(RecordingSink):
    """Fails once, on the first slice after the initial list: a bug past every check."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("a bug in the sink")
        super().handle(watcher, events)


async def test_an_unexpected_failure_relists_instead_of_ending_the_task(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever the loop did not foresee is logged with its traceback and the watcher
    relists after the backoff; it used to end the task, silently."""
    sink = FailingSink()
    w = await started(make, sink)
    await eventually(lambda: sim.watch_count(POD) == 1)
    sink.armed = True
    sim.create(pod("p0"))
    # the failed slice's p0 is recorded as delivered; the relist after it hands on what
    # it does not hold at that version, so p1 (and the watch after it) arrive
    await eventually(lambda: not sink.armed, timeout=5)
    sim.create(pod("p1"))
    await eventually(lambda: "p1" in sink.names("ADDED"), timeout=5)
    assert w._task is not None and not w._task.done()
    hits = [r for r in caplog.records if "unexpected failure" in r.getMessage()]
    assert len(hits) == 1 and hits[0].exc_info is not None


async def test_stopping_a_watcher_whose_task_died_does_not_raise(sim: KubeSim,
                                                                   make: Make) -> None:
    w = await started(make, RecordingSink())
    assert w._task is not None
    await w.stop()

    async def died() -> None:
        raise RuntimeError("dead")

    w._task = asyncio.create_task(died())
    await asyncio.sleep(0)
    await w.stop()  # raised RuntimeError before
    assert w._task is None


async def test_a_410_right_after_every_relist_is_relisted_after_a_backoff(
        sim: KubeSim, make: Make) -> None:
    """A server that answers 410 to every watch (a watch cache behind the list that a load
    balancer sent to another API server) made a list of every object and a watch in a
    loop with no pause. The first 410 is still relisted at once (compaction, the usual
    case); the next ones, each right after its relist, after a growing backoff."""
    sink = RecordingSink()
    w = await started(make, sink)  # backoff cap 0.3 s
    await eventually(lambda: sim.watch_count(POD) == 1)

    def lists() -> int:
        return sum(1 for _, path, q, _ in sim.requests
                   if path == "/api/v1/pods" and "watch" not in q)

    sim.gone_watches = True
    sim.disconnect_watches()
    await asyncio.sleep(0.3)
    n0 = lists()
    since = time.monotonic()
    await asyncio.sleep(2.0)
    n = lists() - n0
    # 0.1-0.3 s apart (over 2 s, or more on a loaded machine)
    assert 2 <= n <= _at_backoff_pace(time.monotonic() - since), n
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() >= n - 1
    sim.gone_watches = False
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)


async def test_a_watch_cut_after_its_first_bytes_is_retried_after_a_backoff(
        sim: KubeSim, make: Make) -> None:
    """A watch that ends cleanly right after a bookmark, well before its timeoutSeconds,
    is no server timeout: watched again after the growing backoff, which only a stream
    that lived long enough resets. The bookmark reset it, and the watch was opened again
    at once: a hot loop (hundreds a second per watcher). A stream that lives its
    timeoutSeconds is still watched again at once (below)."""
    sink = RecordingSink()
    w = await started(make, sink)  # backoff cap 0.3 s, timeoutSeconds 2
    await eventually(lambda: sim.watch_count(POD) == 1)

    n = await _pod_watches_once_cut(sim, "short_watches")  # 0.1-0.3 s apart
    assert w.metrics.restarts.labels(w.name, "short")._value.get() >= n - 1
    sim.create(pod("meanwhile"))
    await eventually(lambda: "meanwhile" in sink.names("ADDED"), timeout=5)  # replayed
    sim.short_watches = False
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=10)
    # the normal case: the stream lives its 2 s, ends, and is watched again at once
    timeouts = w.metrics.restarts.labels(w.name, "timeout")
    t0 = timeouts._value.get()
    await eventually(lambda: timeouts._value.get() > t0, timeout=10)
    assert w.backoff.attempt == 0
    # at once, no backoff: watched again with no backoff taken (one would count an
    # attempt), however long a loaded machine takes to open it
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=10)
    assert w.backoff.attempt == 0


def _pod_lists(sim: KubeSim) -> int:
    """Pod lists a relist made (not the one-item probes of an idle watch)."""
    return sum(1 for _, path, q, _ in sim.requests
               if path == "/api/v1/pods" and "watch" not in q and q.get("limit") != "1")


def _probes(sim: KubeSim) -> int:
    return sum(1 for _, path, q, _ in sim.requests
               if path == "/api/v1/pods" and "watch" not in q and q.get("limit") == "1")


def _history(sim: KubeSim, pods: int, updates: int) -> list[dict[str, object]]:
    """``pods`` pods, then ``updates`` changes to the first: the old cluster's
    resourceVersion well above what a restored store starts from."""
    made = [sim.create(pod(f"old{i}")) for i in range(pods)]
    first = made[0]
    for i in range(updates):
        first = sim.update(dict(first, metadata={**first["metadata"], "labels": {"n": str(i)},
                                                 "resourceVersion": ""}))
    return made


@pytest.mark.parametrize("keep_watches", [False, True])
async def test_a_store_gone_back_is_found_when_the_watch_goes_idle(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture,
        keep_watches: bool) -> None:
    """The API server on an older store (an etcd restored from a backup, a fresh one):
    kube-apiserver accepts a watch from the watcher's newer resourceVersion and sends it
    nothing, bookmarks included, until the store passes that version; an open watch
    goes as silent. When the stream goes idle, a list of one item (no resourceVersion:
    a consistent read) shows the store's version below the held one: the watcher
    relists. It resumed the silent watch from its version at every idle timeout,
    forever, holding the old store's pods (its 504 and went-back checks never fire
    against a real server)."""
    _history(sim, 3, 30)
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=1.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    held = int(w.resource_version)
    n_lists = _pod_lists(sim)
    # broken: the watch resumes from a version the new store has not reached
    sim.reset_store(resource_version=2, keep_watches=keep_watches)
    new = {sim.create(pod(f"new{i}"))["metadata"]["uid"] for i in range(2)}
    await eventually(lambda: set(w.held) == new, timeout=10)
    assert _pod_lists(sim) == n_lists + 1 and _probes(sim) == 1 and w.healthy
    assert sorted(sink.names("DELETED")) == ["old0", "old1", "old2"]
    [line] = [r.getMessage() for r in caplog.records if "restored or replaced" in r.getMessage()]
    assert f"at resourceVersion 4, below the {held} this watch holds" in line
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 1
    sim.create(pod("after"))  # and it watches the new store
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)


async def test_a_store_gone_back_while_the_server_was_down_is_found_on_its_return(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """The API server down, then back on an etcd restored from a backup (as a restore is
    done: API servers stopped, etcd restored, API servers started): the watcher's first
    request after the outage asks the store's version, below the held one, and it
    relists at once. It resumed the watch from its version, silent on the restored store
    until the idle timeout (150 s by default, 30 s here), and a store written on
    meanwhile past that version would never have been seen to go back."""
    _history(sim, 3, 30)
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    held = int(w.resource_version)
    await sim.stop()
    await eventually(lambda: not w.healthy, timeout=5)
    sim.reset_store(resource_version=2)
    new = {sim.create(pod(f"new{i}"))["metadata"]["uid"] for i in range(2)}
    await sim.start()
    await eventually(lambda: set(w.held) == new, timeout=5)
    assert w.healthy and sink.new_histories == 1
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 1
    [line] = [r.getMessage() for r in caplog.records if "restored or replaced" in r.getMessage()]
    assert f"back after unreachable, the API server's store is at resourceVersion 4, " \
        f"below the {held} this watch holds" in line, line
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)


async def test_an_idle_watch_of_a_store_not_gone_back_resumes(
        sim: KubeSim, make: Make) -> None:
    """A stream gone silent (a half-open connection) while the store is where it was:
    the probe shows nothing older, the watch resumes from its version, no relist."""
    _history(sim, 2, 3)
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=1.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    n_lists = _pod_lists(sim)
    assert sim.hang_watches() == 1
    idle = w.metrics.restarts.labels(w.name, "idle")
    await eventually(lambda: idle._value.get() == 1, timeout=5)
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)
    assert _pod_lists(sim) == n_lists and _probes(sim) == 1
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 0


async def test_a_quiet_kind_sent_no_bookmarks_warns_of_its_idle_watch_once(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """kube-apiserver sends a watch a bookmark only once its watch cache's version passed
    the one the watch started from (``cacheWatcher.process``), and that version moves
    with the kind's own changes and etcd's progress notifications alone: every 10 min
    at etcd's default (5 s as kubeadm, GKE and OpenShift set it). A watch of a kind
    that does not change, from a list at the store's version, gets no byte at all, and
    goes idle at every idle timeout while the server is fine: resumed each time (from
    its version: no relist, nothing missed), warned of once. It warned each time: a
    warning every 150 s for every quiet kind, for as long as the proxy ran. The
    simulator's ``progress_notify = False``; by default it bookmarks quiet watches."""
    sim.progress_notify = False
    sim.create(pod("a"))
    sim.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}})
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=0.5)
    idle = w.metrics.restarts.labels(w.name, "idle")
    await eventually(lambda: idle._value.get() >= 3, timeout=8)
    assert w.metrics.events.labels(w.name, "BOOKMARK")._value.get() == 0
    said = [r for r in caplog.records
            if "no data for" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(said) == 1 and "quiet kind" in said[0].getMessage(), said
    assert _pod_lists(sim) == 1 and w.healthy and sink.names("ADDED") == ["a"]
    sim.create(pod("b"))
    await eventually(lambda: "b" in sink.names("ADDED"), timeout=5)


async def test_a_watch_drained_by_an_api_server_shutting_down_resumes_without_a_warning(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """kube-apiserver with ``--shutdown-watch-termination-grace-period`` (OpenShift sets
    25 s) ends its watches cleanly when it shuts down (the handler returns: the chunked
    terminator), early: every rollout ends every watch once. One such end is told at
    info and watched again from the version held (no relist); a second in a row
    (something in between cutting streams) is warned of. It was a warning from every
    watcher at every API server restart. The simulator's ``drain_watches``; its
    ``stop`` cuts them, as an API server exiting without that grace period does."""
    caplog.set_level(logging.INFO, logger="proxy.kube.watcher")
    sim.create(pod("a"))
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    n_lists = _pod_lists(sim)

    def early() -> float:
        return sum(w.metrics.restarts.labels(w.name, r)._value.get()
                   for r in ("short", "empty"))

    def said(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if "ended the watch early" in r.getMessage() and r.levelno == level]

    assert sim.drain_watches() == 1
    await eventually(lambda: early() == 1, timeout=5)
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    sim.create(pod("b"))
    await eventually(lambda: "b" in sink.names("ADDED"), timeout=5)
    assert said(logging.WARNING) == [] and len(said(logging.INFO)) == 1
    assert sim.drain_watches() == 1  # again, at once: warned of
    await eventually(lambda: early() == 2, timeout=5)
    assert len(said(logging.WARNING)) == 1
    assert _pod_lists(sim) == n_lists and w.healthy


async def test_told_of_a_restore_it_cuts_its_watch_and_delivers_everything_again(
        sim: KubeSim, make: Make) -> None:
    """Another watcher of the API server saw its store go back (``relist_history``): a
    healthy open watch (60 s timeout, bookmarks flowing) is cut at once and the watcher
    relists, every object delivered again, unchanged versions included (they are of the
    old history), then watches from the new list. A watcher whose version the restored
    store had passed had no way to learn it, and watched on with its old objects."""
    for i in range(3):
        sim.create(pod(f"p{i}"))
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    n_lists = _pod_lists(sim)
    assert sorted(sink.names("ADDED")) == ["p0", "p1", "p2"]
    w.relist_history()
    assert w.history_pending
    await eventually(lambda: len(sink.names("ADDED")) == 6 and not w.history_pending,
                     timeout=2)
    assert _pod_lists(sim) == n_lists + 1 and w.healthy
    assert w.metrics.restarts.labels(w.name, "restored")._value.get() == 1
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 0
    assert sink.new_histories == 0  # told, not found: nobody else is told by it
    sim.create(pod("after"))  # the cut watch's task goes on: watching the new list
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)
    await eventually(lambda: sim.watch_count(POD) == 1)


@pytest.mark.parametrize("when", ["watching", "in a backoff"])
async def test_a_stop_right_after_a_restore_was_told_ends_the_watcher(
        sim: KubeSim, make: Make, when: str) -> None:
    """``relist_history`` cuts the loop's task with a cancel that ``run`` takes back; a
    ``stop`` in the same turn cancels it too, and must end it, not be taken back as
    well (the process would wait for the watcher at shutdown for good)."""
    sim.create(pod("p0"))
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0,
                      backoff_max=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    if when == "in a backoff":
        await sim.stop()
        await eventually(lambda: not w.healthy, timeout=5)
    task = w._task
    assert task is not None
    w.relist_history()
    await asyncio.wait_for(w.stop(), 5)
    assert task.done() and task.cancelled()
    if when == "in a backoff":
        await sim.start()


@pytest.mark.parametrize("found_by", ["idle", "bookmark", "504", "410"])
async def test_a_relist_after_the_store_went_back_redelivers_what_it_holds(
        sim: KubeSim, make: Make, found_by: str) -> None:
    """A restored object modified since the backup can reach the very resourceVersion
    the watcher holds it at, with other data: two histories, one version. The relist
    skipped objects still at their held version, and kept the old data for good; after
    the store went back (however found) it delivers every object again."""
    first = sim.create(pod("a0"))
    sim.create(pod("a1"))
    sim.create(pod("a2"))
    restored = sim.create(pod("p", labels={"v": "old"}))  # rv 4
    for i in range(30):
        first = sim.update(dict(first, metadata={**first["metadata"], "labels": {"n": str(i)},
                                                 "resourceVersion": ""}))
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60,
                      idle_timeout=1.0 if found_by == "idle" else 30.0)
    uid = restored["metadata"]["uid"]
    assert w.versions[uid] == "4"
    await eventually(lambda: sim.watch_count(POD) == 1)
    if found_by != "idle":
        assert sim.hold_watches() == 1
    sim.reset_store(resource_version=3, keep_watches=True)  # backed up before p
    again = sim.create({**pod("p", labels={"v": "new"}),
                        "metadata": {"name": "p", "namespace": "default", "uid": uid,
                                     "labels": {"v": "new"}}})
    assert again["metadata"]["resourceVersion"] == "4"
    if found_by == "bookmark":
        bookmark = {"type": "BOOKMARK", "object": {
            "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "4"}}}
        assert sim.flush_watches(raw=json.dumps(bookmark).encode() + b"\n") == 1
    elif found_by == "504":
        assert sim.flush_watches(error=TooLargeResourceVersion(34, 4)) == 1
    elif found_by == "410":  # the relist's list, at 4, says it: was taken for compaction
        assert sim.flush_watches(error=Gone("too old resource version: 34 (4)")) == 1
    await eventually(lambda: set(w.held) == {uid}, timeout=10)
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 1
    assert sink.new_histories == 1
    last = [o for _, o in sink.events if o["metadata"]["uid"] == uid][-1]
    assert last["metadata"]["labels"] == {"v": "new"}


@pytest.mark.parametrize("seen", ["bookmark", "event", "504"])
async def test_a_stream_telling_of_an_older_store_is_relisted(
        sim: KubeSim, make: Make, seen: str) -> None:
    """What kube-apiserver's watch cache does not send but a server in front of
    another store might (an older API server, a proxy, an aggregated server): a
    bookmark or an event older than what the watcher holds, or an ERROR 504 "Too large
    resource version". No history the watcher can go on from: it relists at once, and
    delivers every object again (the versions it held are of the other history)."""
    _history(sim, 3, 30)
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1)
    n_lists = _pod_lists(sim)
    assert sim.hold_watches() == 1
    sim.reset_store(resource_version=2, keep_watches=True)
    made = [sim.create(pod(f"new{i}")) for i in range(2)]
    lines = {
        "bookmark": {"type": "BOOKMARK", "object": {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"resourceVersion": str(sim.resource_version)}}},
        "event": {"type": "ADDED", "object": made[0]},
    }
    if seen == "504":
        assert sim.flush_watches(error=TooLargeResourceVersion(33, 4)) == 1
    else:
        assert sim.flush_watches(raw=json.dumps(lines[seen]).encode() + b"\n") == 1
    await eventually(lambda: set(w.held) == {m["metadata"]["uid"] for m in made}, timeout=5)
    assert _pod_lists(sim) == n_lists + 1
    assert sorted(sink.names("DELETED")) == ["old0", "old1", "old2"]
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 1
    assert set(w.versions) == {m["metadata"]["uid"] for m in made}


async def test_a_410_long_after_a_relist_is_relisted_at_once(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """A 410 to a watch that had made progress since the last relist (a bookmark or an
    event) is the usual compaction: relisted at once. Only a stream that lived half its
    timeoutSeconds used to end the run of 410s, so a 410 minutes after the last one
    still waited out the "410 again right after a relist" backoff: relists 3-26 s late."""
    sink = RecordingSink()
    w = await started(make, sink, watch_timeout=lambda: 60, idle_timeout=30.0)
    # a backoff, if taken, shows in the timing: 2-4 s before the relist
    w._gone_backoff = Backoff(base=4.0, cap=8.0)

    async def gone_then_relisted() -> float:
        await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
        n = _pod_lists(sim)
        assert sim.hold_watches() == 1
        sim.flush_watches(error=Gone("too old resource version: 1 (2)"))
        return await eventually(lambda: _pod_lists(sim) > n, timeout=10)

    await gone_then_relisted()
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    current = sink.times_current
    await eventually(lambda: sink.times_current >= current + 2, timeout=5)  # bookmarks
    assert await gone_then_relisted() < 1.5
    assert w.metrics.restarts.labels(w.name, "gone")._value.get() == 2
    assert not any("410 again" in r.getMessage() for r in caplog.records)
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)


async def test_a_cancel_in_the_turn_of_retry_now_ends_the_backoff_wait(make: Make) -> None:
    """A watcher waiting out its backoff, cancelled (``stop``) in the very turn another
    watcher's ``retry_now`` wakes it: the wait ends cancelled. Python 3.11's
    ``asyncio.wait_for`` returned the wake-up and swallowed the cancel: the loop ran on,
    and ``stop`` (with the source's, and the fixture teardown) waited for it for good."""
    w = make(RecordingSink())
    pausing = asyncio.create_task(w._pause(30.0))
    await asyncio.sleep(0.05)  # in the wait
    w.retry_now()
    pausing.cancel()
    await asyncio.wait({pausing}, timeout=2)
    try:
        assert pausing.cancelled()
    finally:
        pausing.cancel()
