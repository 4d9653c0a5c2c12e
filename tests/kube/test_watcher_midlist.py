"""A relist cut part-way through its pages, in each way a real API server cuts one: a
page answered 5xx, a connection reset, a page that never comes, a continue token
expired (410), a restore told meanwhile (``relist_history``), a ``stop``. What must hold
each time: what the watcher held stays until a whole list replaces it (nothing is
retracted from a part of a list), what was deleted meanwhile goes with the next whole
list, the watcher lists again from the start and ends watching at that list's version,
health and the stale flag move once, and no task or connection is left behind."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from proxy.kube.client import KubeClient
from proxy.kube.watcher import ResourceWatcher, Watcher, WatchEvent
from tests.kube import test_watcher
from tests.kube.conftest import SourceFactory, eventually, labels, pod
from tests.kube.test_watcher import Make, RecordingSink, started
from tests.kubesim import Gone, KubeSim
from tests.kubesim.resources import POD

#: the watchers of test_watcher.py, stopped at the end of each test
make = test_watcher.make

#: 7 pods in pages of 2: the list is 4 pages, cut at the second
PODS = [f"p{i}" for i in range(7)]


def _lists(sim: KubeSim) -> list[dict[str, str]]:
    """The queries of the pod list requests so far (not the watches)."""
    return [q for _, path, q, _ in sim.requests if path == "/api/v1/pods" and "watch" not in q]


def _watches(sim: KubeSim) -> list[dict[str, str]]:
    return [q for _, path, q, _ in sim.requests if path == "/api/v1/pods" and "watch" in q]


def _first_pages(sim: KubeSim) -> int:
    return sum(1 for q in _lists(sim) if "continue" not in q)


def _acquired(client: KubeClient) -> int:
    """Connections of the client's pool in use (a list page or a watch under way)."""
    connector = client.api.rest_client.pool_manager.connector
    assert connector is not None
    return len(connector._acquired)


async def _relisting(sim: KubeSim, w: ResourceWatcher) -> int:
    """Have the watcher's open watch end in 410 (its version compacted): it relists.
    Returns the number of first pages asked before."""
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    n = _first_pages(sim)
    assert sim.hold_watches(POD) == 1
    sim.flush_watches(error=Gone("too old resource version: 1 (2)"))
    return n


async def _meanwhile(sim: KubeSim, w: ResourceWatcher, sink: RecordingSink,
                     n: int) -> tuple[str, str]:
    """Once the relist was cut at least twice: nothing was retracted, every pod held is
    still held; then a pod deleted and one created while the lists keep being cut.
    Returns the uids of both."""
    held = dict(w.held)
    await eventually(lambda: _first_pages(sim) >= n + 2, timeout=8)
    assert sink.names("DELETED") == [] and w.held == held
    gone = sim.get("v1", "Pod", "p5", "default")
    sim.delete(gone)
    new = sim.create(pod("p7"))
    await eventually(lambda: _first_pages(sim) >= n + 3, timeout=8)
    assert sink.names("DELETED") == [] and w.held == held
    return gone["metadata"]["uid"], new["metadata"]["uid"]


async def _whole_again(sim: KubeSim, w: ResourceWatcher, sink: RecordingSink,
                       gone: str, new: str) -> None:
    """Lists served whole again: the next one retracts what was deleted meanwhile (once),
    delivers what was created, and the watch that follows starts at its version."""
    store = {o["metadata"]["uid"] for o in sim.objects(POD)}
    await eventually(lambda: set(w.held) == store, timeout=8)
    assert gone not in w.held and new in w.held
    assert sink.names("DELETED") == ["p5"]
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    assert _watches(sim)[-1]["resourceVersion"] == w.resource_version
    assert w.resource_version == str(sim.resource_version)
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)


@pytest.mark.parametrize("cut", [500, "reset", "timeout"])
async def test_a_relist_cut_by_a_failing_page_keeps_what_it_held_and_is_stale_once(
        sim: KubeSim, make: Make, client: KubeClient, cut: int | str) -> None:
    """A relist whose second page fails (a 500, the connection reset, no answer within
    the page's timeout), retried after the backoff and cut again: the pods held stay
    held (a part of a list retracts nothing), the watcher is unhealthy once until a list
    goes through, then the pod deleted meanwhile is retracted, the one created
    delivered, and the watch starts at the whole list's version. The first page of every
    retry set the watcher healthy and its cut unhealthy again: the stale flag and the
    outage's warning came and went with every retry."""
    for name in PODS:
        sim.create(pod(name))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2, page_timeout=0.5,
                      watch_timeout=lambda: 60, idle_timeout=30.0)
    if cut == "timeout":
        sim.delay_resource(POD, 2.0, continued=True)
    else:
        sim.cut_lists(POD, cut)
    n = await _relisting(sim, w)
    gone, new = await _meanwhile(sim, w, sink, n)
    assert sink.healthy == [False] and not w.healthy
    assert w.last_error_kind == ("API error 500" if cut == 500 else "unreachable")
    # each retry after the backoff (0.1-0.3 s here), not at once
    since = time.monotonic()
    tried = _first_pages(sim)
    await asyncio.sleep(1.0)
    assert _first_pages(sim) - tried <= (time.monotonic() - since) / 0.1 + 2
    sim.delay_resource(POD, None)
    sim.cut_lists(POD, None)
    await _whole_again(sim, w, sink, gone, new)
    assert sink.healthy == [False, True] and w.healthy
    assert sink.relists == 1  # the heap's trim told once: for the whole list alone
    await w.stop()
    await eventually(lambda: _acquired(client) == 0, timeout=3)


async def test_a_first_list_cut_part_way_is_not_synced_until_one_goes_through(
        sim: KubeSim, make: Make) -> None:
    """The first list cut at its second page, again and again: the watcher is not synced
    (readiness waits for it), unhealthy once, and synced with every pod once a list goes
    through whole, healthy again once."""
    for name in PODS:
        sim.create(pod(name))
    sim.cut_lists(POD, 503)
    sink = RecordingSink()
    w = make(sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    w.start()
    await eventually(lambda: _first_pages(sim) >= 3, timeout=8)
    assert not w.synced.is_set() and sink.healthy == [False]
    sim.cut_lists(POD, None)
    await asyncio.wait_for(w.synced.wait(), 5)
    assert sorted(set(sink.names("ADDED"))) == PODS and len(w.held) == len(PODS)
    assert sink.healthy == [False, True] and sink.names("DELETED") == []


async def test_a_relist_whose_continue_token_expires_lists_again_from_the_start(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """A continue token expired part-way (410 Expired: its resourceVersion compacted
    while the list was paged through) is a 410 like a watch's: the watcher lists again
    from the first page (not retrying the dead token, nor using the inconsistent one its
    410 offers), at once the first time, then after the 410s' own backoff; it stays
    healthy (the server answers), retracts nothing until a list goes through whole, and
    then watches from that list's version."""
    caplog.set_level(logging.INFO, logger="proxy.kube.watcher")
    for name in PODS:
        sim.create(pod(name))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    sim.cut_lists(POD, "expire")
    n = await _relisting(sim, w)
    gone, new = await _meanwhile(sim, w, sink, n)
    assert sink.healthy == [] and w.healthy
    tokens = [q["continue"] for q in _lists(sim) if "continue" in q]
    assert len(set(tokens)) == len(tokens)  # a token expired is never asked again
    # nor the one its 410 offers: the rest at the store's version now, an inconsistent
    # list, whose version no watch could start from and whose diff could retract wrongly
    assert sim.inconsistent_tokens and not set(tokens) & set(sim.inconsistent_tokens)
    assert any("continue token expired (410)" in r.getMessage() for r in caplog.records)
    assert any("410 again right after a relist" in r.getMessage() for r in caplog.records)
    since = time.monotonic()
    tried = _first_pages(sim)
    await asyncio.sleep(1.0)
    assert _first_pages(sim) - tried <= (time.monotonic() - since) / 0.1 + 2
    sim.cut_lists(POD, None)
    await _whole_again(sim, w, sink, gone, new)
    assert sink.healthy == [] and sink.relists == 1


async def test_a_restore_told_half_way_through_a_relist_lists_again_from_the_start(
        sim: KubeSim, make: Make, client: KubeClient) -> None:
    """``relist_history`` while a relist is paging through (told of a restore, then of
    another): the list under way is given up, its page request cancelled, and a list
    from the first page delivers every pod again; nothing is retracted but what a whole
    list does not find (a pod deleted meanwhile), and the watch starts at its version."""
    for name in PODS:
        sim.create(pod(name))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    sim.delay_resource(POD, 0.4, continued=True)
    n = _first_pages(sim)
    before = len(sink.events)
    w.relist_history()
    # the first page delivered again (a new history: every item), the second asked
    await eventually(lambda: len(sink.events) >= before + 2, timeout=5)
    await eventually(lambda: len(_lists(sim)) >= n + 2, timeout=5)
    deleted = sim.get("v1", "Pod", "p5", "default")
    sim.delete(deleted)
    w.relist_history()  # half-way: a second page is under way
    await eventually(lambda: _first_pages(sim) == n + 2, timeout=5)
    assert sink.names("DELETED") == []
    store = {o["metadata"]["uid"] for o in sim.objects(POD)}
    await eventually(lambda: set(w.held) == store, timeout=8)
    assert sink.names("DELETED") == ["p5"]
    # the new history is the watcher's once the list is through: a loop turn after the
    # slice that retracted p5 (waited for, not looked at once)
    await eventually(lambda: not w.history_pending, timeout=5)
    # the second list delivered every pod again, not only those the cut one had not
    second = [o["metadata"]["name"] for _, o in sink.events[before:] if _ == "ADDED"]
    assert sorted(second[-6:]) == sorted(set(PODS) - {"p5"})
    assert w.metrics.restarts.labels(w.name, "restored")._value.get() == 2
    assert sink.healthy == []
    sim.delay_resource(POD, None)
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    assert _watches(sim)[-1]["resourceVersion"] == w.resource_version
    sim.create(pod("after"))
    await eventually(lambda: "after" in sink.names("ADDED"), timeout=5)
    await w.stop()
    await eventually(lambda: _acquired(client) == 0, timeout=3)


async def test_a_stop_half_way_through_a_list_ends_it_and_its_page_request(
        sim: KubeSim, make: Make, client: KubeClient) -> None:
    """``stop`` while a relist waits for its next page: the watcher's task ends, the
    page request with it (no task, no connection left), and what it held is kept."""
    for name in PODS:
        sim.create(pod(name))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    held = dict(w.held)
    tasks = asyncio.all_tasks()
    sim.delay_resource(POD, 5.0, continued=True)
    n = await _relisting(sim, w)
    await eventually(lambda: _first_pages(sim) == n + 1 and len(_lists(sim)) >= n + 2 + 1,
                     timeout=5)
    task = w._task
    assert task is not None
    await asyncio.wait_for(w.stop(), 2)
    assert task.done() and task.cancelled()
    left = [t for t in asyncio.all_tasks() - tasks  # the simulator's delayed answer aside
            if getattr(t.get_coro(), "__qualname__", "") != "RequestHandler._handle_request"]
    assert left == []
    assert _acquired(client) == 0
    assert w.held == held and sink.names("DELETED") == []


class _StoppedWhileFailing(RecordingSink):
    """A sink whose hand-over of the relist's first page fails (a bug) while ``stop`` is
    under way: the page after it is being fetched."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.stopping: asyncio.Task[None] | None = None

    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        if self.armed:
            self.armed = False
            assert isinstance(watcher, ResourceWatcher)
            self.stopping = asyncio.ensure_future(watcher.stop())
            raise RuntimeError("a bug in the sink")
        super().handle(watcher, events)


async def test_a_stop_while_a_failed_list_gives_up_its_next_page_ends_the_watcher(
        sim: KubeSim, make: Make) -> None:
    """A list failing (here the sink raising) while its next page is being fetched
    cancels that fetch and waits for it; a ``stop`` landing in that wait was swallowed
    with the fetch's cancel, the failure went on to a backoff and the next round, and
    ``stop`` waited for the watcher for good."""
    for name in PODS:
        sim.create(pod(name))
    sink = _StoppedWhileFailing()
    w = await started(make, sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    task = w._task
    assert task is not None
    sim.delay_resource(POD, 1.0, continued=True)
    w.versions.clear()  # the relist's first page is handed over, not skipped
    sink.armed = True
    await _relisting(sim, w)
    await eventually(lambda: sink.stopping is not None, timeout=5)
    assert sink.stopping is not None
    await asyncio.wait_for(sink.stopping, 3)
    assert task.done() and task.cancelled()


async def test_a_source_keeps_every_pod_stamped_and_stale_once_through_a_cut_relist(
        sim: KubeSim, make_source: SourceFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The whole source through a relist whose pages keep failing: every pod that exists
    stays stamped, the index is stale from the first cut until a list goes through (one
    warning, one line back), and then the pod deleted meanwhile is gone."""
    for i in range(7):
        sim.create(pod(f"p{i}"))
    source = await make_source()
    watchers = [w for _, ws in source.watchers.values() for w in ws if w.name == "pods"]
    [w] = watchers
    assert isinstance(w, ResourceWatcher)
    w.page_size = 2
    caplog.set_level(logging.INFO)
    sim.cut_lists(POD, 500)
    n = await _relisting(sim, w)
    await eventually(lambda: source.index.stale, timeout=5)
    gone = sim.delete(sim.get("v1", "Pod", "p5", "default"))["metadata"]["uid"]
    await eventually(lambda: _first_pages(sim) >= n + 3, timeout=8)
    assert source.index.stale and gone in w.held
    assert all(labels(source, "default", f"p{i}") for i in range(7))
    sim.cut_lists(POD, None)
    await eventually(lambda: not source.index.stale and gone not in w.held, timeout=8)
    assert all(labels(source, "default", f"p{i}") for i in range(7) if i != 5)
    said = [r.getMessage() for r in caplog.records]
    assert sum("cluster index STALE" in m for m in said) == 1, said
    assert sum("cluster index current again" in m for m in said) == 1, said


class _SlowSink(RecordingSink):
    """A sink whose hand-over costs time per object, on the event loop as the engine's
    does: a list that takes longer to go through than its continue tokens live."""

    def __init__(self, per_object: float) -> None:
        super().__init__()
        self.per_object = per_object

    def handle(self, watcher: Watcher, events: list[WatchEvent]) -> None:
        time.sleep(self.per_object * len(events))
        super().handle(watcher, events)


async def test_a_list_slower_than_its_tokens_live_goes_through_in_a_few_tries(
        sim: KubeSim, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    """A list that takes longer than its continue tokens live (etcd compacts every 5
    minutes; a CPU-starved proxy or a huge cluster pages for longer): each try gets 410
    Expired part-way, but what it delivered is skipped by version on the next, so each
    try goes further and the list goes through in a few, every pod delivered once. The
    410 is said for what it is: the list's token, with how far the try got."""
    caplog.set_level(logging.INFO, logger="proxy.kube.watcher")
    names = [f"p{i:02d}" for i in range(16)]
    for name in names:
        sim.create(pod(name))
    sim.list_token_ttl = 0.3
    sink = _SlowSink(0.05)  # pages of 2: ~0.1 s each, ~3 pages a try
    w = make(sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    w.start()
    await asyncio.wait_for(w.synced.wait(), 10)
    assert sorted(sink.names("ADDED")) == names  # each once: nothing delivered twice
    tries = _first_pages(sim)
    assert 2 <= tries <= 8, tries
    said = [r for r in caplog.records if "continue token expired (410)" in r.getMessage()]
    assert len(said) == tries - 1
    assert [r.levelno for r in said] == [logging.WARNING] + [logging.INFO] * (tries - 2)
    assert [r.getMessage() for r in caplog.records if "went through whole" in r.getMessage()
            ] == [f"watch pods: the list went through whole after {tries - 1} tries cut by "
                  "an expired continue token"]
    # each try delivered something new: no 410 loop's backoff between them
    assert not any("410 again" in r.getMessage() for r in caplog.records)
    assert sink.names("DELETED") == [] and sink.healthy == [] and w.healthy
    await eventually(lambda: sim.watch_count(POD) == 1, timeout=5)
    assert _watches(sim)[-1]["resourceVersion"] == w.resource_version


async def test_an_unhealthy_watchers_next_list_says_the_server_answers_at_its_first_page(
        sim: KubeSim, make: Make) -> None:
    """A watcher unhealthy (a list cut by a 503) tells the sink at the first page of its
    next list that the API server answers (``answered``: the source wakes the others
    then), before that list goes through and sets it healthy; a healthy watcher's lists
    say nothing. Stop 46 moved the wake-up to the list's end with health: the others
    then waited out a 37.5k-pod list's seconds."""
    for name in PODS:
        sim.create(pod(name))
    sink = RecordingSink()
    w = await started(make, sink, page_size=2, watch_timeout=lambda: 60, idle_timeout=30.0)
    assert sink.answered_at == []
    sim.cut_lists(POD, 503)
    n = await _relisting(sim, w)
    # each retry's first page (the second list's: the sim counts it as it is asked,
    # the watcher tells the sink once its answer is read), unhealthy since the first cut
    await eventually(lambda: _first_pages(sim) >= n + 2 and sink.answered_at, timeout=8)
    assert not w.healthy and set(sink.answered_at) == {1}
    sim.cut_lists(POD, None)
    await eventually(lambda: w.healthy, timeout=8)
    # the list that went through said so at its first page, before its health
    assert sink.healthy == [False, True] and set(sink.answered_at) == {1}
    told, relists = len(sink.answered_at), sink.relists
    await _relisting(sim, w)  # a healthy watcher's relist says nothing
    await eventually(lambda: sink.relists > relists, timeout=5)
    assert len(sink.answered_at) == told
