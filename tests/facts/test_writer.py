"""The fact writer (proxy.facts.writer): how series end (stale markers), the cache and
the written set, leader and standby, the loop and its pauses, refused requests. Then its
requests posted to a real Prometheus (``--web.enable-remote-write-receiver``) and asked
with PromQL."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import snappy
from prometheus_client import CollectorRegistry

from proxy import contract, yielding
from proxy.config import FactSettings
from proxy.facts import FactWriter, WriterState, iter_facts
from proxy.facts.collectors import sample_value
from proxy.facts.writer import COVERAGE_KEY, PROCESS_KEY
from proxy.index import PodIndex
from proxy.karta.model import GENERIC_PHASES
from proxy.karta.results import ChangeSet, PodAttribution, ReplicaFact, WorkloadFacts, WorkloadRef
from proxy.upstream import (
    OWN_WRITES_NEED_A_TENANT,
    OWN_WRITES_NEED_CREDENTIALS,
    Answer,
    UpstreamFailure,
)
from tests.facts.helpers import (
    DEP,
    PODS,
    RAY,
    WRITER,
    Series,
    by_name,
    coverage,
    decode,
    dep_facts,
    is_stale,
    nosend,
    owner_refs,
    ray_facts,
    remote_pb2,
    small_index,
    stale_and_live,
    writer,
)
from tests.peers.conftest import free_port, wait_until

# -- ending series -----------------------------------------------------------------------------


def test_gone_workload_and_pod_end_with_stale_markers_once() -> None:
    index = small_index()
    w = writer(index)
    first = decode(w.build_request(1000))
    w.commit()
    index.apply(ChangeSet(pods={"p-api": None}, workloads={"w-dep": None}))
    second = decode(w.build_request(2000))
    w.commit()
    stale = {labels for labels, samples in second.items() if is_stale(samples[0][0])}
    live = {labels for labels, samples in second.items() if not is_stale(samples[0][0])}
    gone = set(first) - live
    assert stale == gone
    names = {dict(labels)["__name__"] for labels in stale}
    assert contract.FACT_POD_INFO in names and contract.FACT_WORKLOAD_PHASE in names
    assert all(dict(labels).get("karta_workload") == "api" for labels in stale)
    # 1 pod + info + 9 phases + 9 statuses + transition + reason + 2 replica facts
    assert len(stale) == 1 + 1 + 9 + 9 + 1 + 1 + 2
    assert all(samples == [(samples[0][0], 2000)] for samples in second.values())
    third = decode(w.build_request(3000))
    assert not any(is_stale(s[0][0]) for s in third.values())
    assert set(third) == live


def test_a_resource_no_longer_watched_ends_its_freshness_series() -> None:
    """The kube source drops a kind's freshness entry when it stops watching it: its
    ``karta_source_last_current_timestamp_seconds`` series ends with a stale marker."""
    index = small_index()
    w = writer(index)
    w.build_request(1000)
    w.commit()
    del index.freshness["rayjobs.ray.io"]
    series = decode(w.build_request(2000))
    w.commit()
    stale = [labels for labels, s in series.items() if is_stale(s[0][0])]
    assert stale == [(("__name__", contract.FACT_SOURCE_LAST_CURRENT), WRITER,
                      ("resource", "rayjobs.ray.io"))]
    pods = (WRITER, ("resource", "pods"))
    assert by_name(series, contract.FACT_SOURCE_LAST_CURRENT)[pods] == 1_700_000_500.0
    third = decode(w.build_request(3000))
    assert set(by_name(third, contract.FACT_SOURCE_LAST_CURRENT)) == {pods}


def test_a_fact_that_stops_applying_ends_too() -> None:
    """Not only deletions: a desired-replica path that stops answering, a phase leaving
    Undefined (its reason series), a pod losing its attribution."""
    index = small_index()
    w = writer(index)
    w.build_request(1000)
    w.commit()
    index.apply(
        ChangeSet(
            pods={"p-head": replace(PODS["p-head"], workload=None, component="",
                                    reason="no_described_owner")},
            workloads={
                "w-ray": ray_facts(replicas=(ReplicaFact("head", "", None, None, None, 1),)),
                "w-dep": dep_facts(phase="Running", statuses=("Running",), phase_reason=""),
            },
        )
    )
    series = decode(w.build_request(2000))
    stale_names = sorted(
        dict(labels)["__name__"] for labels, s in series.items() if is_stale(s[0][0])
    )
    assert stale_names == sorted(
        [
            contract.FACT_POD_INFO,  # p-head lost its attribution
            contract.FACT_COMPONENT_DESIRED_REPLICAS,  # head desired no longer known
            contract.FACT_COMPONENT_DESIRED_REPLICAS,  # workers instance gone
            contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN,
            contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX,
            contract.FACT_COMPONENT_OBSERVED_PODS,  # workers instance gone
            contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO,
        ]
    )
    assert any(
        dict(k).get("pod") == "train-head"
        for k in by_name(series, contract.FACT_POD_UNATTRIBUTED_INFO)
    )


async def test_failed_send_keeps_the_stale_markers_for_the_next_write() -> None:
    index = small_index()
    sent: list[bytes] = []
    fail = True

    async def send(body: bytes) -> None:
        if fail:
            raise ConnectionError("upstream down")
        sent.append(body)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0)
    fail = False
    assert await w.write_once()
    first = w.stale_markers_total  # the first write's: each workload's other `source`
    index.apply(ChangeSet(workloads={"w-dep": None}, pods={"p-api": None}))
    fail = True
    assert not await w.write_once()
    assert w.writes_failed == 1
    fail = False
    assert await w.write_once()
    stale = [k for k, s in decode(sent[-1]).items() if is_stale(s[0][0])]
    assert len(stale) == 24
    assert w.stale_markers_total - first == 24


def test_unchanged_objects_are_not_re_encoded() -> None:
    index = small_index()
    w = writer(index)
    a = w.build_request(1000)
    calls = 0
    orig = w._encode

    def counting(facts: Any) -> Any:
        nonlocal calls
        calls += 1
        return orig(facts)

    w._encode = counting  # type: ignore[method-assign]
    b = w.build_request(1000)
    assert a == b
    assert calls == 2  # only the few, uncached ones: coverage and the process facts
    index.apply(ChangeSet(workloads={"w-ray": ray_facts(phase="Failed")}))
    w.build_request(1000)
    assert calls == 5  # the changed workload + coverage + process facts


# -- the writer's cache: a workload's series share its identity labels ------------------------


def test_a_recreated_workload_continues_its_series_and_ends_only_the_old_uid() -> None:
    """A Deployment deleted and created again under its name (a new uid) is the same
    identity: its ~20 shared-identity series continue without a marker, and only the info
    series of the old uid ends, with the very labels it was written with (external labels
    in the shared run too). While pods of the old one remain, the old workload is known
    from their references alone (``workload_object_missing``) and the new one, whose object
    is present, is the one described: one series per label set, the live object's phase."""
    index = small_index()
    w = writer(index, external_labels={"cluster": "c1", "zone": "z"})
    first = decode(w.build_request(1000))
    w.commit()
    again = replace(DEP, uid="w-dep-2")
    index.apply(ChangeSet(workloads={
        "w-dep": dep_facts(phase_reason="workload_object_missing"),  # deleted, pods remain
        "w-dep-2": dep_facts(ref=again, phase="Initializing", statuses=("Initializing",),
                             phase_reason=""),
    }))
    body = w.build_request(2000)
    w.commit()
    series = decode(body)
    stale, live = stale_and_live(body)
    assert all(len(samples) == 1 for samples in series.values())  # no label set twice
    (gone,) = (k for k in stale if dict(k)["__name__"] == contract.FACT_WORKLOAD_INFO)
    assert dict(gone)["workload_uid"] == "w-dep" and gone in first
    assert ("cluster", "c1") in gone and ("zone", "z") in gone
    (info,) = by_name(live, contract.FACT_WORKLOAD_INFO).keys() - by_name(
        first, contract.FACT_WORKLOAD_INFO).keys()
    assert dict(info)["workload_uid"] == "w-dep-2"
    phase = {dict(k)["phase"]: v for k, v in by_name(live, contract.FACT_WORKLOAD_PHASE).items()
             if dict(k)["karta_workload"] == "api"}
    assert phase["Initializing"] == 1.0 and phase["Undefined"] == 0.0
    # every other series of the identity continues: no marker but the old info series and
    # the reason of an Undefined phase the new object does not have
    assert {dict(k)["__name__"] for k in stale} == {
        contract.FACT_WORKLOAD_INFO, contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO}
    index.apply(ChangeSet(workloads={"w-dep": None}))  # the old pods go too
    stale, again_live = stale_and_live(w.build_request(3000))
    w.commit()
    assert not stale and set(again_live) == set(live)


def test_a_failed_write_owes_markers_for_every_version_it_may_have_left() -> None:
    """Write 1 lands with instance a; write 2 (instance b) fails half-way; write 3 has
    instance c: both a and b may be in the TSDB, so both end."""
    index = PodIndex()
    w = writer(index)

    def workers(inst: str) -> None:
        index.apply(ChangeSet(workloads={"w-ray": ray_facts(
            replicas=(ReplicaFact("workers", inst, 4, None, None, 3),))}))

    workers("a")
    w.build_request(1000)
    w.commit()
    workers("b")
    w.build_request(2000)
    w.commit_partial()
    workers("c")
    stale, live = stale_and_live(w.build_request(3000))
    w.commit()
    desired = contract.FACT_COMPONENT_DESIRED_REPLICAS
    assert {dict(k)["karta_instance"] for k in by_name(stale, desired)} == {"a", "b"}
    assert {dict(k)["karta_instance"] for k in by_name(live, desired)} == {"c"}
    stale, _ = stale_and_live(w.build_request(4000))
    assert not stale  # owed once


class _Elector:
    """The lease's seams the writer reads: ``is_leader``, and ``lease_duration`` and
    ``record_seen_ago`` (when the holder last renewed: never seen here) on takeover."""

    def __init__(self) -> None:
        self.is_leader = False
        self.lease_duration = 15.0
        self.record_seen_ago = math.inf


async def test_a_takeover_ends_what_changed_or_went_while_standing_by() -> None:
    """A standby remembers every version of every group it saw in the last
    STANDBY_MEMORY seconds: an instance gone from a live workload and a deleted
    workload both end at takeover; what it saw longer ago than that is forgotten."""
    from proxy.facts import STANDBY_MEMORY

    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    now = [1000.0]
    index = small_index()
    elector = _Elector()
    w = FactWriter(FactSettings(), index, send, elector=elector,  # type: ignore[arg-type]
                   clock=lambda: now[0], monotonic=lambda: now[0])
    old = PodIndex()
    old.apply(ChangeSet(workloads={"w-old": replace(ray_facts(), ref=replace(RAY, name="o"))}))
    w._index = old  # a workload seen once, long before the takeover
    assert not await w.write_once()
    w._index = index
    now[0] += STANDBY_MEMORY + 1
    assert not await w.write_once()
    index.apply(ChangeSet(workloads={"w-ray": ray_facts(replicas=ray_facts().replicas[:1])}))
    now[0] += 10
    assert not await w.write_once()  # group-a gone from RAY: remembered
    index.apply(ChangeSet(workloads={"w-dep": None}))
    now[0] += 10
    elector.is_leader = True
    assert await w.write_once() and w.state is WriterState.LEADER
    stale, _ = stale_and_live(b"".join(sent))
    ended = {(dict(k)["__name__"], dict(k).get("karta_workload"), dict(k).get("karta_instance"))
             for k in stale}
    assert ("karta_component_desired_replicas", "train", "group-a") in ended
    assert {w for _, w, _ in ended} == {"train", "api"}  # not "o": forgotten
    assert not any(i == "" and w == "train" for _, w, i in ended)  # the head continues


async def test_a_leader_that_stood_by_a_moment_still_ends_what_it_wrote() -> None:
    # the lease lost for a renewal and got back: the written set was forgotten at once,
    # so a pod deleted in between was never ended (its series lingered 5 minutes)
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    index = small_index()
    elector = _Elector()
    elector.is_leader = True
    w = FactWriter(FactSettings(), index, send, elector=elector,  # type: ignore[arg-type]
                   clock=lambda: 1000.0)
    assert await w.write_once()
    elector.is_leader = False
    index.apply(ChangeSet(pods={"p-api": None}))
    assert not await w.write_once()  # stands by: its walk no longer sees the pod
    elector.is_leader = True
    sent.clear()
    assert await w.write_once()
    stale, _ = stale_and_live(b"".join(sent))
    assert any(dict(k)["__name__"] == contract.FACT_POD_INFO for k in stale)


class _Holder:
    """A lease as one replica sees it: ``is_leader`` for this one, and when it last saw
    the record change (the holder's renewals, on the shared fake clock)."""

    def __init__(self, now: list[float], leading: bool) -> None:
        self._now = now
        self.is_leader = leading
        self.lease_duration = 15.0
        self.renewed = now[0]

    @property
    def record_seen_ago(self) -> float:
        return self._now[0] - self.renewed


def _ended(bodies: list[bytes]) -> set[tuple[str, str]]:
    """(name, pod or coverage state) of the series the bodies end (transition series of
    the other ``source`` left out)."""
    return {(d["__name__"], d.get("pod") or d.get("state", ""))
            for body in bodies for d in map(dict, stale_and_live(body)[0])
            if d["__name__"] != contract.FACT_WORKLOAD_PHASE_TRANSITION}


async def test_a_takeover_owes_markers_only_for_what_the_old_leader_may_have_left() -> None:
    """The audit: under pod churn the new leader's first write re-sent (and counted)
    markers for every series it had seen go in the last 5 minutes, 11,578 of them already
    ended by the old leader. Now: what vanished more than ``takeover_window`` before the
    old leader's last renewal is not sent again (nor kept standing by); what vanished
    within it but more than an interval before is sent, not counted; what vanished after
    the old leader's last write is sent and counted."""
    now = [1000.0]
    index = small_index()
    sink: dict[str, list[bytes]] = {"a": [], "b": []}

    def recording(name: str) -> Callable[[bytes], Any]:
        async def send(body: bytes) -> None:
            sink[name].append(body)
        return send

    lease_a, lease_b = _Holder(now, True), _Holder(now, False)
    a = FactWriter(FactSettings(), index, recording("a"), elector=lease_a,  # type: ignore[arg-type]
                   clock=lambda: now[0], monotonic=lambda: now[0])
    b = FactWriter(FactSettings(), index, recording("b"), elector=lease_b,  # type: ignore[arg-type]
                   clock=lambda: now[0], monotonic=lambda: now[0])
    assert b.takeover_window == 15 + 30 + 45  # lease, its step-down, three intervals

    deletions = {1010.0: "p-head", 1150.0: "p-lost", 1205.0: "p-api"}
    while now[0] < 1230:  # every 5 s: deletions, the holder's renewals; writes every 15 s
        gone = deletions.get(now[0])
        if gone:
            index.apply(ChangeSet(pods={gone: None}))
        if now[0] <= 1205:  # the holder renews until it dies, at 1207
            lease_b.renewed = now[0]
        if now[0] % 15 == 10:  # (1000 + 15k)
            if now[0] <= 1200:
                assert await a.write_once()
            assert not await b.write_once()
        now[0] += 5
    head = (contract.FACT_POD_INFO, "train-head")
    loner = {(contract.FACT_POD_UNATTRIBUTED_INFO, "loner"),
             (contract.FACT_NAMESPACE_PODS, "unattributed")}  # web's last unattributed pod
    api = {(contract.FACT_POD_INFO, "api-7d9-x"),
           (contract.FACT_NAMESPACE_PODS, "attributed")}  # web's last pod
    assert _ended(sink["a"]) == {head, *loner}  # what the old leader ended
    # standing by, b keeps what a takeover could owe only: p-head went long before
    assert "p-head" not in b._standby
    assert "p-api" in b._standby and "p-lost" in b._standby

    now[0] = 1240.0  # the lease expired (1205 + 15), b's next round took it, then its tick
    lease_a.is_leader, lease_b.is_leader = False, True
    assert await b.write_once() and b.state is WriterState.LEADER
    # train-head: ended at 1015, more than the window before a's last renewal (1205 - 90):
    # not again. loner: ended by a at 1155, within the window: sent for safety, not
    # counted. api-7d9-x: gone at 1205, after a's last write (1200): sent and counted
    assert _ended(sink["b"]) == {*loner, *api}
    assert b.stale_markers_total == len(api)
    assert b.last_uncounted_markers == len(loner)


async def test_a_takeover_after_a_lease_outage_still_ends_what_went_meanwhile() -> None:
    """No renewal seen for minutes (the Lease API down, nobody leading): the standby keeps
    what it saw since the holder's last sign of life, so a pod gone meanwhile still ends
    at the takeover."""
    now = [1000.0]
    index = small_index()
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    lease = _Holder(now, False)
    w = FactWriter(FactSettings(), index, send, elector=lease,  # type: ignore[arg-type]
                   clock=lambda: now[0], monotonic=lambda: now[0])
    for _ in range(14):  # 1000..1195: the holder's last renewal at 1000
        assert not await w.write_once()
        now[0] += 15
    index.apply(ChangeSet(pods={"p-api": None}))
    now[0] += 15
    assert not await w.write_once()
    lease.is_leader = True
    now[0] += 15
    assert await w.write_once()
    assert _ended(sent) == {(contract.FACT_POD_INFO, "api-7d9-x")}
    assert w.stale_markers_total == 1  # gone after the holder's last sign of life


def test_a_marker_carries_the_written_labels_after_the_cache_let_go() -> None:
    """The writer keeps a gone series' labels in its written set, not in the cache: a
    workload deleted while the upstream is down loses its cache entry at once, and the
    markers two writes later are still byte for byte the series first written."""
    index = small_index()
    w = writer(index)
    first = w.build_request(1000)
    w.commit()
    index.apply(ChangeSet(workloads={"w-ray": None}, pods={"p-head": None, "p-w0": None}))
    w.build_request(2000)
    w.commit_partial()  # that write failed
    assert "w-ray" not in w._workload_cache and "p-head" not in w._pod_cache
    w.build_request(3000)
    w.commit_partial()  # and the next one
    stale, _ = stale_and_live(w.build_request(4000))
    w.commit()
    written = decode(first)
    assert stale and set(stale) <= set(written)
    ended = [k for k in stale if dict(k)["__name__"] != contract.FACT_NAMESPACE_PODS]
    assert {dict(k).get("karta_workload") for k in ended} == {"train"}
    assert len(ended) == 2 + 1 + 9 + 9 + 1 + 2 + 4  # pods, info, phases, statuses,
    # transition, replica rows (the head has no min/max: desired and observed; workers 4)
    assert not stale_and_live(w.build_request(5000))[0]  # ended once


def test_stale_markers_are_in_label_order_whatever_the_pieces() -> None:
    """The markers of one write come sorted by their bytes (the TimeSeries field, whose
    samples are all the one stale marker), as when each series was one bytes object:
    the wire does not change with the cache's layout."""
    from proxy.wire.primitives import len_field

    index = small_index()
    w = writer(index, external_labels={"a": "first", "zz": "last"})
    w.build_request(1000)
    w.commit()
    index.apply(ChangeSet(workloads={"w-ray": None, "w-dep": None}, pods=dict.fromkeys(PODS)))
    req = remote_pb2.WriteRequest()
    req.ParseFromString(w.build_request(2000))
    stale = [len_field(1, ts.SerializeToString())
             for ts in req.timeseries if is_stale(ts.samples[0].value)]
    assert len(stale) > 40 and stale == sorted(stale)


# -- the loop ----------------------------------------------------------------------------------


async def test_writer_loop_writes_at_the_interval_and_stops() -> None:
    index = small_index()
    bodies: list[bytes] = []
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []

    async def send(body: bytes) -> None:
        bodies.append(body)
        sent_at.append(loop.time())

    w = FactWriter(FactSettings(interval_seconds=0.1), index, send)
    started = loop.time()
    await w.start()

    async def written() -> bool:
        return len(bodies) >= 5

    # counted, not timed: how many writes a fixed sleep sees depends on the machine's load
    # (a loaded CI box saw 2 in 0.55 s)
    await wait_until(written, timeout=30, what="five fact writes")
    await w.stop()
    n = len(bodies) - 1  # the last: the writer's own series ended
    assert n >= 5
    # one at start, then every 0.1 s, never sooner: the k-th write is not before k
    # intervals from the start (a late write is followed by the next on the schedule,
    # never by a burst)
    for k, at in enumerate(sent_at[:n]):
        assert at - started >= k * 0.1 - 0.005, (k, at - started)
    await asyncio.sleep(0.25)
    assert len(bodies) == n + 1
    assert w.writes_ok == n
    ended = decode(bodies[-1])
    assert sorted(dict(k)["__name__"] for k in ended) == [
        contract.FACT_BUILD_INFO, contract.FACT_CONTRACT_INFO]
    assert all(is_stale(v[0][0]) for v in ended.values())


async def test_a_stopping_writer_ends_only_the_series_that_name_its_process() -> None:
    # after an upgrade the old version's karta_build_info{version} and
    # karta_contract_info{version} lingered for the 5-minute lookback beside the new
    # ones; the cluster's facts go on under the next writer and are not ended
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    w = FactWriter(FactSettings(external_labels={"cluster": "c1"}), small_index(), send,
                   build_version="9.9.9")
    assert await w.write_once()
    written = decode(sent[0])
    first = w.stale_markers_total  # the first write's: each workload's other `source`
    assert await w.end_own_series()
    ended = decode(sent[1])
    own = {k for k in written if dict(k)["__name__"] in (
        contract.FACT_BUILD_INFO, contract.FACT_CONTRACT_INFO)}
    assert set(ended) == own and len(own) == 2  # as written, external labels included
    build = next(k for k in own if ("__name__", contract.FACT_BUILD_INFO) in k)
    assert ("version", "9.9.9") in build
    assert all(is_stale(v[0][0]) for v in ended.values())
    assert w.stale_markers_total - first == 2
    assert not await w.end_own_series()  # once


def test_the_cluster_uid_is_on_contract_info_and_its_arrival_ends_the_series_without() -> None:
    """``karta_cluster_uid`` (the kube-system Namespace's uid, read beside the writer) is
    on ``karta_contract_info`` only, from the first write that knows it: the series
    written without it (the read refused, then granted) ends with a stale marker then,
    rather than standing beside the labelled one for the lookback."""
    uid = ""
    w = FactWriter(FactSettings(external_labels={"cluster": "c1"}), small_index(), nosend,
                   cluster_uid=lambda: uid)
    first = decode(w.build_request(1000))
    w.commit()
    bare = (("__name__", contract.FACT_CONTRACT_INFO), ("cluster", "c1"), WRITER,
            ("version", contract.CONTRACT_VERSION))
    assert bare in first
    assert not any(contract.FACT_LABEL_CLUSTER_UID in dict(k) for k in first)
    uid = "0b8d-kube-system"
    stale, live = stale_and_live(w.build_request(2000))
    w.commit()
    assert list(stale) == [bare]
    labelled = (("__name__", contract.FACT_CONTRACT_INFO), ("cluster", "c1"),
                (contract.FACT_LABEL_CLUSTER_UID, uid), WRITER,
                ("version", contract.CONTRACT_VERSION))
    assert labelled in live
    assert [k for k in live if contract.FACT_LABEL_CLUSTER_UID in dict(k)] == [labelled]
    stale, live = stale_and_live(w.build_request(3000))
    assert not stale and labelled in live


async def test_a_stopping_writer_ends_its_contract_info_with_the_cluster_uid() -> None:
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    w = FactWriter(FactSettings(), small_index(), send, cluster_uid=lambda: "u-1")
    assert await w.write_once()
    assert await w.end_own_series()
    ended = decode(sent[1])
    contract_info = [k for k in ended if dict(k)["__name__"] == contract.FACT_CONTRACT_INFO]
    assert [dict(k)[contract.FACT_LABEL_CLUSTER_UID] for k in contract_info] == ["u-1"]
    assert all(is_stale(v[0][0]) for v in ended.values())


async def test_a_writer_that_does_not_write_ends_nothing_at_stop() -> None:
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    elector = _Elector()
    w = FactWriter(FactSettings(), small_index(), send, elector=elector,  # type: ignore[arg-type]
                   clock=lambda: 1_700_000_000.0)
    assert not await w.write_once()  # standing by
    assert not await w.end_own_series() and sent == []
    elector.is_leader = True
    assert await w.write_once()
    elector.is_leader = False  # lost the lease: the next writer's series now
    assert not await w.end_own_series() and len(sent) == 1


async def test_a_failed_end_at_stop_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def send(body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ConnectionError("upstream gone")

    w = FactWriter(FactSettings(), small_index(), send)
    assert await w.write_once()
    assert not await w.end_own_series()
    assert "could not end its own series" in caplog.text


async def test_an_end_at_stop_that_gets_no_answer_says_so_within_its_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # an upstream that does not answer: the stop waited its 5 s and logged "could not end
    # its own series at stop: " with nothing after it (a TimeoutError's text is empty).
    # The stop now gives the markers what is left of its deadline, and the line says why
    calls = 0

    async def send(body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls > 1:
            await asyncio.sleep(60)

    w = FactWriter(FactSettings(), small_index(), send)
    assert await w.write_once()
    began = time.monotonic()
    assert not await w.end_own_series(0.2)
    assert time.monotonic() - began < 1.0
    assert ("fact writer: could not end its own series at stop: no answer within 0.2 s"
            in caplog.messages), caplog.messages


async def test_writer_without_election_starts_standby_and_leads_from_its_first_write(
) -> None:
    """The state machine's entry: STANDBY until the first interval asks, then LEADER for
    good when no election is configured (step() is idempotent in a state)."""
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    w = FactWriter(FactSettings(), small_index(), send)
    assert w.state is WriterState.STANDBY
    assert w.step() is WriterState.LEADER and w.step() is WriterState.LEADER
    assert await w.write_once()
    assert w.state is WriterState.LEADER and len(sent) == 1


async def test_disabled_writer_does_not_start() -> None:
    w = FactWriter(FactSettings(enabled=False), small_index(), nosend)
    await w.start()
    await asyncio.sleep(0.05)
    await w.stop()
    assert w.writes_ok == 0


# -- against a real Prometheus -----------------------------------------------------------------


class Prometheus:
    """A real Prometheus with the remote-write receiver, on 127.0.0.1."""

    def __init__(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("prometheus binary not installed")
        self.dir = tempfile.TemporaryDirectory(prefix="karta-facts-prom-")
        cfg = Path(self.dir.name) / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1h\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.dir.name}/data",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-remote-write-receiver",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(Path(self.dir.name) / "log", "wb"),  # noqa: SIM115
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.close()
        pytest.fail("prometheus did not become ready: " + self.log())

    def log(self) -> str:
        return (Path(self.dir.name) / "log").read_text(errors="replace")[-2000:]

    def write(self, body: bytes) -> None:
        req = urllib.request.Request(
            self.url + "/api/v1/write",
            data=snappy.compress(body),
            headers={
                "Content-Encoding": "snappy",
                "Content-Type": "application/x-protobuf",
                "X-Prometheus-Remote-Write-Version": "0.1.0",
            },
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204, r.status

    def query(self, promql: str, at: float) -> dict[tuple[tuple[str, str], ...], float]:
        qs = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as r:
            import json

            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return {
            tuple(sorted(item["metric"].items())): float(item["value"][1])
            for item in doc["data"]["result"]
        }

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.dir.cleanup()


@pytest.fixture(scope="module")
def prom() -> Iterator[Prometheus]:
    p = Prometheus()
    yield p
    p.close()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _ident(name: str) -> str:
    return f'karta_namespace="tsdb",karta_workload="{name}"'


def _wl(name: str, uid: str) -> WorkloadRef:
    return WorkloadRef("tsdb", "ray.io", "RayJob", name, uid)


@pytest.mark.peers
def test_tsdb_phase_changes_transition_time_in_phase_and_stale_end(prom: Prometheus) -> None:
    """A workload goes Initializing -> Running -> Failed, then is deleted. PromQL sees the
    state set, the transition time, `time() - ...` as time in phase, and no series after the
    deletion (a stale marker, not a 5-minute ghost). A control workload whose facts merely
    stop (no marker) is still there, so the check can tell the two apart."""
    t0 = float(int(time.time()) - 1800)
    clock = Clock(t0)
    index = PodIndex()
    w = FactWriter(FactSettings(external_labels={"cluster": "c1"}), index, nosend, clock=clock)
    ref, ctl = _wl("phased", "u-phased"), _wl("control", "u-ctl")

    def wf(ref: WorkloadRef, phase: str, since: float) -> WorkloadFacts:
        return WorkloadFacts(ref, "rayjob", False, phase, (phase,), "", since)

    index.apply(ChangeSet(workloads={"u-phased": wf(ref, "Initializing", t0)}))
    # the control workload is written by a writer that just stops (as if it died)
    ctl_index = PodIndex()
    ctl_index.apply(ChangeSet(workloads={"u-ctl": wf(ctl, "Running", t0)}))
    wc = FactWriter(FactSettings(), ctl_index, nosend, clock=clock)
    timeline = {0: "Initializing", 60: "Running", 300: "Failed"}
    phase = "Initializing"
    since = t0
    for step in range(0, 420, 15):  # every 15 s for 7 minutes
        clock.t = t0 + step
        if step in timeline and timeline[step] != phase:
            phase, since = timeline[step], clock.t
            index.apply(ChangeSet(workloads={"u-phased": wf(ref, phase, since)}))
        prom.write(w.build_request(int(clock.t * 1000)))
        w.commit()
        prom.write(wc.build_request(int(clock.t * 1000)))
        wc.commit()
    t_del = t0 + 420
    clock.t = t_del
    index.apply(ChangeSet(workloads={"u-phased": None}))
    prom.write(w.build_request(int(t_del * 1000)))
    w.commit()

    current = f"karta_workload_phase{{{_ident('phased')}}} == 1"
    assert [dict(k)["phase"] for k in prom.query(current, t0 + 30)] == ["Initializing"]
    assert [dict(k)["phase"] for k in prom.query(current, t0 + 200)] == ["Running"]
    assert [dict(k)["phase"] for k in prom.query(current, t0 + 400)] == ["Failed"]
    # one series per generic phase, each 0 or 1, and exactly one 1
    allp = prom.query(f"karta_workload_phase{{{_ident('phased')}}}", t0 + 200)
    assert {dict(k)["phase"] for k in allp} == set(GENERIC_PHASES)
    assert sum(allp.values()) == 1
    assert all(dict(k)["cluster"] == "c1" for k in allp)
    # time in phase, one generic query
    tip = f"time() - karta_workload_phase_transition_timestamp_seconds{{{_ident('phased')}}}"
    for at, expected in ((t0 + 45, 45), (t0 + 200, 140), (t0 + 400, 100)):
        (value,) = prom.query(tip, at).values()
        assert abs(value - expected) < 0.01, (at - t0, value)
    # transitions visible as changes of the timestamp series
    (changes,) = prom.query(
        f"changes(karta_workload_phase_transition_timestamp_seconds{{{_ident('phased')}}}[10m])",
        t0 + 410,
    ).values()
    assert changes == 2
    # deleted: gone right after the stale marker
    assert prom.query(f"karta_workload_phase{{{_ident('phased')}}}", t_del - 1)
    assert prom.query(f"karta_workload_phase{{{_ident('phased')}}}", t_del + 1) == {}
    assert prom.query(f"karta_workload_info{{{_ident('phased')}}}", t_del + 60) == {}
    # control: no stale marker, still answered within the 5-minute lookback (a ghost)
    assert prom.query(f"karta_workload_info{{{_ident('control')}}}", t_del + 60)


@pytest.mark.peers
async def test_tsdb_an_upgrade_shows_one_build_at_a_time(prom: Prometheus) -> None:
    """A rolling upgrade: the old version's writer stops, the new one takes over. Its
    build and contract series end with it; the cluster's facts go on unended."""
    t0 = float(int(time.time()) - 900)
    clock = Clock(t0)
    index = small_index()
    settings = FactSettings(external_labels={"cluster": "upgrade"})

    async def send(body: bytes) -> None:
        prom.write(body)

    old = FactWriter(settings, index, send, clock=clock, build_version="0.1.0")
    for step in range(0, 60, 15):
        clock.t = t0 + step
        assert await old.write_once()
    clock.t = t0 + 50
    assert await old.end_own_series()
    new = FactWriter(settings, index, send, clock=clock, build_version="0.2.0")
    clock.t = t0 + 60
    assert await new.write_once()

    def versions(at: float) -> list[str]:
        got = prom.query('karta_build_info{cluster="upgrade"}', at)
        return sorted(dict(k)["version"] for k in got)

    assert versions(t0 + 40) == ["0.1.0"]
    assert versions(t0 + 55) == []  # nobody writing
    assert versions(t0 + 70) == ["0.2.0"]  # not two builds for the lookback
    assert len(prom.query('karta_contract_info{cluster="upgrade"}', t0 + 70)) == 1
    assert prom.query('karta_workload_info{cluster="upgrade"}', t0 + 55)  # goes on


@pytest.mark.peers
async def test_tsdb_a_process_fact_written_ahead_by_another_stops_no_other_fact(
    prom: Prometheus,
) -> None:
    """karta_contract_info with the writer's very labels 10 minutes ahead, written to the
    TSDB by someone else (a second writer configured alike; not through the proxy, which
    drops a sender's karta_writer): Prometheus 2.42 rolls back a whole request for one
    out-of-order sample (400), so every fact request that held the writer's copy was
    refused, every write: every fact stopped, stale markers too. Now only that series is
    left out (counted), the rest lands."""
    t0 = float(int(time.time()) - 600)
    clock = Clock(t0)
    index = small_index()
    settings = FactSettings(external_labels={"cluster": "forged"})
    version = ("version", contract.CONTRACT_VERSION)
    forged = remote_pb2.WriteRequest()
    ts = forged.timeseries.add()
    for k, v in (("__name__", contract.FACT_CONTRACT_INFO), ("cluster", "forged"), WRITER,
                 version):
        ts.labels.add(name=k, value=v)
    ts.samples.add(value=1.0, timestamp=int((t0 + 600) * 1000))
    prom.write(forged.SerializeToString())
    answers: list[int] = []

    async def send(body: bytes) -> None:
        try:
            prom.write(body)
        except urllib.error.HTTPError as e:
            answers.append(e.code)
            raise _Refused(e.code) from e
        answers.append(204)

    w = FactWriter(settings, index, send, clock=clock)
    assert await w.write_once()
    # the whole refused, then one half of each level (~60 series: 6 levels)
    assert 2 <= answers.count(400) <= 1 + math.ceil(math.log2(w.last_series))
    answers.clear()
    for step in range(15, 60, 15):
        clock.t = t0 + step
        assert await w.write_once()
    assert answers == [400, 204] * 3  # then the series alone first, no bisection
    assert sample_value(w.metrics.series_refused) == 4  # the forged series, each write
    assert w.writes_ok == 4
    at = t0 + 50
    assert prom.query('karta_workload_info{cluster="forged"}', at)
    assert prom.query('karta_build_info{cluster="forged"}', at)
    assert prom.query('karta_namespace_pods{cluster="forged"}', at)
    # a gone workload still ends at once (its stale marker no longer refused with it)
    index.apply(ChangeSet(workloads={"w-ray": None}))
    clock.t = t0 + 60
    assert await w.write_once()
    assert prom.query('karta_workload_info{cluster="forged",karta_kind="RayJob"}', t0 + 61) == {}
    assert prom.query('karta_workload_info{cluster="forged",karta_kind="Deployment"}', t0 + 61)


@pytest.mark.peers
async def test_tsdb_a_restart_shows_one_transition_series_per_workload(
    prom: Prometheus,
) -> None:
    """The process before a restart (or the old leader) dated a Deployment's Running by
    the rollout it saw end (source=observed); the next one reads the object's Available
    time (source=object). The old series lingered for the 5-minute lookback: two rows
    of time in phase for one workload. The first write after a start or a takeover now
    ends the other source's series."""
    t0 = float(int(time.time()) - 300)
    clock = Clock(t0)
    settings = FactSettings(external_labels={"cluster": "restart"})
    ref = _wl("rolled", "u-rolled")

    async def send(body: bytes) -> None:
        prom.write(body)

    def index_of(source: str, since: float) -> PodIndex:
        index = PodIndex()
        index.apply(ChangeSet(workloads={"u-rolled": WorkloadFacts(
            ref, "rayjob", False, "Running", ("Running",), "", since, (), source)}))
        return index

    before = FactWriter(settings, index_of("observed", t0 - 60), send, clock=clock)
    for step in range(0, 60, 15):
        clock.t = t0 + step
        assert await before.write_once()
    # a restart: the new process reads the object's time, 14 days ago
    after = FactWriter(settings, index_of("object", t0 - 14 * 86400), send, clock=clock)
    clock.t = t0 + 60
    assert await after.write_once()
    name = contract.FACT_WORKLOAD_PHASE_TRANSITION
    sel = f'{name}{{cluster="restart",{_ident("rolled")}}}'
    assert [dict(k)["source"] for k in prom.query(sel, t0 + 50)] == ["observed"]
    assert [dict(k)["source"] for k in prom.query(sel, t0 + 61)] == ["object"]
    assert [dict(k)["source"] for k in prom.query(sel, t0 + 200)] == ["object"]


async def test_the_first_write_after_a_takeover_ends_the_other_source_once() -> None:
    index = small_index()
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    leading = [True]

    class Elector:
        lease_duration = 15.0
        record_seen_ago = math.inf

        @property
        def is_leader(self) -> bool:
            return leading[0]

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0,
                   elector=Elector())  # type: ignore[arg-type]

    def ended() -> list[tuple[str, str]]:
        stale, _ = stale_and_live(b"".join(sent))
        return sorted((dict(k)["karta_workload"], dict(k)["source"]) for k in stale
                      if dict(k)["__name__"] == contract.FACT_WORKLOAD_PHASE_TRANSITION)

    live = {(dict(k)["karta_workload"], dict(k)["source"])
            for k in _live(writer(small_index()).build_requests(1))
            if dict(k)["__name__"] == contract.FACT_WORKLOAD_PHASE_TRANSITION}
    other = {"object": "observed", "observed": "object"}
    assert await w.write_once()  # the first after the start
    assert ended() == sorted((name, other[src]) for name, src in live)
    sent.clear()
    assert await w.write_once()
    assert ended() == []  # once
    leading[0] = False
    assert not await w.write_once()  # stands by
    leading[0] = True
    sent.clear()
    assert await w.write_once()  # takes over again
    assert ended() == sorted((name, other[src]) for name, src in live)


@pytest.mark.peers
def test_tsdb_desired_vs_observed_follow_a_scale_up(prom: Prometheus) -> None:
    t0 = float(int(time.time()) - 1200)
    clock = Clock(t0)
    index = PodIndex()
    w = FactWriter(FactSettings(), index, nosend, clock=clock)
    ref = _wl("scaled", "u-scaled")

    def state(desired: int, observed: int) -> ChangeSet:
        pods: dict[str, PodAttribution | None] = {
            f"sp{i}": PodAttribution("tsdb", f"scaled-w{i}", f"sp{i}", ref, "workers", "g")
            for i in range(observed)
        }
        for i in range(observed, 6):
            pods[f"sp{i}"] = None
        return ChangeSet(
            pods=pods,
            workloads={
                "u-scaled": WorkloadFacts(
                    ref, "rayjob", False, "Running", ("Running",), "", t0,
                    (ReplicaFact("workers", "g", desired, 1, 6, observed),),
                )
            },
        )

    plan = {0: (2, 2), 60: (5, 2), 75: (5, 3), 90: (5, 5)}
    for step in range(0, 150, 15):
        clock.t = t0 + step
        if step in plan:
            index.apply(state(*plan[step]))
        prom.write(w.build_request(int(clock.t * 1000)))
        w.commit()

    sel = f'{{{_ident("scaled")},karta_component="workers",karta_instance="g"}}'

    def at(step: int) -> tuple[float, float]:
        (d,) = prom.query(f"karta_component_desired_replicas{sel}", t0 + step).values()
        (o,) = prom.query(f"karta_component_observed_pods{sel}", t0 + step).values()
        return d, o

    assert at(30) == (2, 2)
    assert at(65) == (5, 2)
    assert at(80) == (5, 3)
    assert at(120) == (5, 5)
    # the pod facts follow the pods: 5 pod series at the end, 2 at the start
    count = f'count(karta_pod_info{{{_ident("scaled")}}})'
    assert list(prom.query(count, t0 + 30).values()) == [2]
    assert list(prom.query(count, t0 + 120).values()) == [5]
    assert prom.query(f"karta_component_desired_replicas_max{sel}", t0 + 120)


@pytest.mark.peers
def test_tsdb_coverage_share_per_namespace_without_a_join(prom: Prometheus) -> None:
    """Pods of namespace `cov` lose their attribution one by one: the share attributed,
    read from karta_namespace_pods alone, goes 1 -> 0.5 -> 0 (a 0, not a gap), the
    reasons appear, and the namespace ends at once when its pods go."""
    t0 = float(int(time.time()) - 900)
    clock = Clock(t0)
    index = PodIndex()
    w = FactWriter(FactSettings(external_labels={"cluster": "cov"}), index, nosend, clock=clock)
    ref = WorkloadRef("cov", "apps", "Deployment", "api", "u-cov")

    def pods(attributed: int) -> ChangeSet:
        return ChangeSet(pods={
            f"c{i}": PodAttribution("cov", f"api-{i}", f"c{i}", ref if i < attributed else None,
                                    reason="" if i < attributed else "owner_missing")
            for i in range(4)
        })

    plan: dict[int, ChangeSet] = {0: pods(4), 60: pods(2), 120: pods(0),
                                  180: ChangeSet(pods={f"c{i}": None for i in range(4)})}
    for step in range(0, 195, 15):
        clock.t = t0 + step
        if step in plan:
            index.apply(plan[step])
        prom.write(w.build_request(int(clock.t * 1000)))
        w.commit()

    sel = 'cluster="cov"'
    share = (f'sum by (karta_namespace) (karta_namespace_pods{{{sel},state="attributed"}})'
             f' / sum by (karta_namespace) (karta_namespace_pods{{{sel}}})')
    assert prom.query(share, t0 + 30) == {(("karta_namespace", "cov"),): 1.0}
    assert prom.query(share, t0 + 90) == {(("karta_namespace", "cov"),): 0.5}
    assert prom.query(share, t0 + 150) == {(("karta_namespace", "cov"),): 0.0}
    unattributed = f'karta_namespace_pods{{{sel},state="unattributed"}}'
    assert list(prom.query(unattributed, t0 + 150).values()) == [4.0]
    assert prom.query(share, t0 + 181) == {}
    assert prom.query(f"karta_namespace_pods{{{sel}}}", t0 + 181) == {}


@pytest.mark.peers
async def test_three_replicas_write_each_fact_once_and_survive_the_leader_dying(
    prom: Prometheus,
) -> None:
    """Three FactWriters with LeaseElectors against the API simulator, all posting to the
    same Prometheus. Only the leader's sends happen; when it dies (elector stopped without
    releasing) another takes over within about the lease duration, continuing the same
    series (no replica label), so the TSDB holds exactly one sample per write."""
    from kubernetes_asyncio import client as k8s

    from proxy.config import KubeSettings
    from proxy.kube.client import load_configuration
    from proxy.lease import LeaseElector
    from tests.kubesim.server import KubeSim

    duration, interval = 1.5, 0.25
    ref = _wl("replicated", "u-rep")
    index = PodIndex()
    index.apply(
        ChangeSet(
            workloads={"u-rep": WorkloadFacts(ref, "rayjob", False, "Running", ("Running",), "",
                                              time.time())}
        )
    )
    sends: list[tuple[str, float]] = []
    inflight: set[asyncio.Future[None]] = set()
    async with KubeSim() as sim, aiohttp.ClientSession() as http:
        cfg = await load_configuration(KubeSettings(kubeconfig=str(sim.write_kubeconfig())))
        apis = [k8s.ApiClient(configuration=cfg) for _ in range(3)]
        electors = [
            LeaseElector(api, "karta", "facts", f"proxy-{i}", duration)
            for i, api in enumerate(apis)
        ]

        def sender(identity: str) -> Callable[[bytes], Any]:
            async def post(body: bytes, started: float) -> None:
                async with http.post(
                    prom.url + "/api/v1/write",
                    data=snappy.compress(body),
                    headers={"Content-Encoding": "snappy",
                             "Content-Type": "application/x-protobuf"},
                ) as r:
                    assert r.status == 204, await r.text()
                sends.append((identity, started))

            async def send(body: bytes) -> None:
                # shielded: a writer stopped mid-send still completes (and records) the
                # post, so the count of sends matches what reached the TSDB exactly
                task = asyncio.ensure_future(post(body, time.time()))
                inflight.add(task)
                await asyncio.shield(task)

            return send

        writers = [
            FactWriter(FactSettings(interval_seconds=interval), index,
                       sender(e.identity), elector=e)
            for e in electors
        ]
        tasks = [asyncio.create_task(e.run()) for e in electors]
        for w in writers:
            await w.start()
        t_start = time.time()
        try:
            await asyncio.sleep(3.0)
            leaders = [e for e in electors if e.is_leader]
            assert len(leaders) == 1
            first = leaders[0]
            i = electors.index(first)
            died = time.time()
            # dies: no release and, no longer leading, no ending of its own series
            await first.stop(release=False)
            await writers[i].stop()
            await asyncio.sleep(duration * 2 + 1.5)
        finally:
            for e in electors:  # first: every send counted below is a fact write
                await e.stop(release=False)
            for w in writers:
                await w.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for api in apis:
                await api.close()
            await asyncio.gather(*inflight, return_exceptions=True)
        t_end = time.time()

    senders = [s for s, _ in sends]
    # one writer at a time: the sequence switches leader exactly once
    runs = [s for j, s in enumerate(senders) if j == 0 or senders[j - 1] != s]
    assert len(runs) == 2 and runs[0] == first.identity, runs
    before = [t for s, t in sends if s == first.identity]
    after = [t for s, t in sends if s != first.identity]
    assert max(before) <= died
    gap = min(after) - died
    assert duration * 0.9 <= gap <= duration * 2 + interval + 0.5, gap
    # no sends overlapped in time while both were around: strictly increasing times
    assert [t for _, t in sends] == sorted(t for _, t in sends)
    # every write landed once: samples in the TSDB == writes made (not 3x)
    window = int(t_end - t_start) + 5
    q = f"count_over_time(karta_workload_info{{{_ident('replicated')}}}[{window}s])"
    (stored,) = (await asyncio.to_thread(prom.query, q, t_end + 1)).values()
    assert stored == len(sends)
    # and the series carries no per-replica label: one series across the handover
    assert len(await asyncio.to_thread(
        prom.query, f"karta_workload_info{{{_ident('replicated')}}}", t_end)) == 1
    assert not math.isnan(stored)


def test_large_writes_are_split_into_bounded_requests() -> None:
    index = small_index()
    w = FactWriter(FactSettings(), index, nosend, max_series_per_request=7)
    whole = decode(w.build_request(1000))
    w.commit()
    index.apply(ChangeSet(workloads={"w-dep": None}, pods={"p-api": None}))
    bodies = w.build_requests(2000)
    assert len(bodies) > 3
    merged: Series = {}
    for body in bodies:
        part = decode(body)
        assert len(part) <= 7
        merged.update(part)
    assert set(merged) == set(whole)  # the live ones and the stale-marked ones
    assert sum(is_stale(s[0][0]) for s in merged.values()) == 24


async def test_a_write_failing_halfway_still_owes_every_stale_marker() -> None:
    index = small_index()
    sent: list[bytes] = []
    budget = 100

    async def send(body: bytes) -> None:
        nonlocal budget
        if budget <= 0:
            raise ConnectionError("upstream down")
        budget -= 1
        sent.append(body)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0, max_series_per_request=5)
    assert await w.write_once()
    index.apply(ChangeSet(workloads={"w-dep": None}, pods={"p-api": None}))
    budget = 2  # the next write delivers two requests, then fails
    assert not await w.write_once()
    budget = 100
    sent.clear()
    assert await w.write_once()
    stale = {k for body in sent for k, s in decode(body).items() if is_stale(s[0][0])}
    assert len(stale) == 24


class _Refused(Exception):
    """What ``Upstream.send_v1`` raises, as the writer reads it: the status a sender gets."""

    def __init__(self, status: int) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status


async def test_a_fact_write_refused_for_want_of_credentials_says_which_to_set(
        caplog: pytest.LogCaptureFixture) -> None:
    """A TSDB that requires credentials refuses every fact write (401) when the proxy has
    none of its own, while the senders' writes, carrying theirs, are stored: the warning
    names the settings, not only the status."""
    caplog.set_level(logging.WARNING)

    async def send(body: bytes) -> None:
        raise _Refused(401)

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0)
    assert not await w.write_once()
    assert any("refused for good" in r.getMessage()
               and r.__dict__.get("hint") == OWN_WRITES_NEED_CREDENTIALS
               for r in caplog.records), caplog.messages


async def test_a_fact_write_refused_for_want_of_a_tenant_says_to_name_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """Mimir's 401 "no org id" is no question of credentials: the warning said to set
    some, where facts.headers' tenant header is what the fact writes lack."""
    caplog.set_level(logging.WARNING)

    async def send(body: bytes) -> None:
        raise UpstreamFailure(Answer(401, b"no org id\n", upstream="401"))

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0)
    assert not await w.write_once()
    assert any("refused for good" in r.getMessage()
               and r.__dict__.get("hint") == OWN_WRITES_NEED_A_TENANT
               for r in caplog.records), caplog.messages


async def test_a_request_refused_for_good_does_not_stop_the_others() -> None:
    # a 4xx to one request (a tenant's limit) stopped every later request of every write:
    # 5 pods of 7, the workloads, the coverage and every stale marker were never written
    # again. A 4xx other than 400 refuses the request, not a series: dropped whole
    index = small_index()
    sent: list[bytes] = []
    refusing = [True]

    async def send(body: bytes) -> None:
        if refusing[0] and len(sent) == 1:
            refusing[0] = False
            raise _Refused(403)
        sent.append(body)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0, max_series_per_request=5)
    whole = writer(small_index()).build_requests(10_000)
    assert not await w.write_once()  # reported: one request did not land
    assert w.writes_failed == 1
    assert len(_live(sent)) == len(_live(whole)) - 5
    assert sample_value(w.metrics.series_refused) == 5
    # and a 5xx still stops the write there (the upstream, not the request)
    sent.clear()

    async def down(body: bytes) -> None:
        if sent:
            raise _Refused(503)
        sent.append(body)

    w._send = down
    assert not await w.write_once()
    assert len(sent) == 1 and w.writes_failed == 2


#: a series of the writer's very labels written ahead in time (through no proxy: one
#: writes a sender's karta_writer away): one out-of-order sample makes Prometheus refuse
#: the whole request that holds the writer's sample of it (400)
_POISON = (("__name__", contract.FACT_CONTRACT_INFO), WRITER,
           ("version", contract.CONTRACT_VERSION))


def _live(bodies: list[bytes]) -> set[tuple[tuple[str, str], ...]]:
    """The series of ``bodies`` that are not stale markers (a first write also ends each
    workload's transition series of the other ``source``)."""
    return {k for b in bodies for k, s in decode(b).items() if not is_stale(s[0][0])}


def _poisoned(body: bytes) -> bool:
    return _POISON in decode(body)


async def test_a_400_is_bisected_down_to_the_series_it_refuses_then_that_goes_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One refused series stopped every fact request that held it, every write (a 400
    refused the request whole): the pods, workloads, coverage and stale markers beside it
    too. Now the halves go again down to that series, which alone is left out, counted,
    logged by name, and sent in a request of its own by the next writes."""
    index = small_index()
    sent: list[bytes] = []
    tries: list[bytes] = []

    async def send(body: bytes) -> None:
        tries.append(body)
        if _poisoned(body):
            raise _Refused(400)
        sent.append(body)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0, max_series_per_request=100)
    whole = writer(small_index()).build_requests(10_000)
    everything = {k for b in whole for k in decode(b)}
    assert len(whole) == 1 and len(everything) > 30
    with caplog.at_level("WARNING", logger="proxy.facts.writer"):
        assert await w.write_once()  # what could land, landed
    assert _live(sent) == everything - {_POISON}
    assert sample_value(w.metrics.series_refused) == 1
    assert w.writes_ok == 1 and w.writes_failed == 0
    bisecting = len(tries)
    assert 2 < bisecting <= 2 + 2 * math.ceil(math.log2(len(everything)))
    line = next(r for r in caplog.records if "refused" in r.getMessage())
    version = contract.CONTRACT_VERSION
    assert line.__dict__["series"] == (
        f'karta_contract_info{{karta_writer="karta-proxy", version="{version}"}}')
    # the next write: the refused series first in a request of its own, no bisection
    tries.clear()
    sent.clear()
    assert await w.write_once()
    assert len(tries) == 2
    assert [decode(t).keys() == {_POISON} for t in tries].count(True) == 1
    assert {k for b in sent for k in decode(b)} == everything - {_POISON}
    assert sample_value(w.metrics.series_refused) == 2
    # accepted again (the forged sample's time has passed): forgotten, one request again
    tries.clear()
    w._send = lambda body: _nosend_ok(tries, body)
    assert await w.write_once()
    assert len(tries) == 2  # the one of its own, accepted: then forgotten
    tries.clear()
    assert await w.write_once()
    assert len(tries) == 1


async def test_a_refused_own_series_does_not_keep_the_other_from_ending_at_stop() -> None:
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        if _poisoned(body):
            raise _Refused(400)
        sent.append(body)

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0)
    assert await w.write_once()
    sent.clear()
    markers = w.stale_markers_total
    assert await w.end_own_series()
    ended = {dict(k)["__name__"] for k in stale_and_live(b"".join(sent))[0]}
    assert ended == {contract.FACT_BUILD_INFO}  # before: neither (one request, refused)
    assert w.stale_markers_total == markers + 1
    assert sample_value(w.metrics.series_refused) == 2  # the write's and the stop's


async def _nosend_ok(tries: list[bytes], body: bytes) -> None:
    tries.append(body)


async def test_the_requests_a_bisection_takes_are_bounded() -> None:
    """An upstream that answers 400 to anything (not a series: a body it cannot read)
    costs a write at most MAX_EXTRA_REQUESTS more requests, not one per series."""
    from proxy.facts.writer import MAX_EXTRA_REQUESTS, MAX_REFUSED_REMEMBERED

    index = small_index()
    tries: list[bytes] = []

    async def send(body: bytes) -> None:
        tries.append(body)
        raise _Refused(400)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0, max_series_per_request=5)
    own = len(FactWriter(FactSettings(), small_index(), nosend,
                         max_series_per_request=5).build_requests(10_000))
    assert not await w.write_once()
    assert own < len(tries) <= own + MAX_EXTRA_REQUESTS
    assert w.writes_failed == 1
    # the series it found refused alone are remembered, at most MAX_REFUSED_REMEMBERED,
    # each then a request of its own: a later write is bounded by both
    tries.clear()
    assert not await w.write_once()
    assert len(tries) <= own + MAX_REFUSED_REMEMBERED + MAX_EXTRA_REQUESTS


async def test_a_stale_marker_refused_on_its_own_stays_owed() -> None:
    index = small_index()
    refusing = [False]

    async def send(body: bytes) -> None:
        if refusing[0] and any(("pod", "loner") in k for k in decode(body)):
            raise _Refused(400)

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0)
    assert await w.write_once()
    index.apply(ChangeSet(pods={"p-lost": None}))
    refusing[0] = True
    before = w.stale_markers_total
    assert await w.write_once()
    refused = sample_value(w.metrics.series_refused)
    assert refused >= 1
    # the markers that landed counted, once (the refused ones not): counted twice before
    assert w.stale_markers_total - before == w.last_stale_markers - refused > 0
    refusing[0] = False
    stale, _ = stale_and_live(w.build_request(30_000))
    assert any(("pod", "loner") in k for k in stale)  # still owed


async def test_a_write_makes_each_request_after_sending_the_one_before() -> None:
    """One body alive at a time: a 37.5k-pod write is ~60 MB of bodies."""
    index = small_index()
    made: list[int] = []
    sent: list[int] = []
    w = FactWriter(FactSettings(), index, nosend, clock=lambda: 10.0, max_series_per_request=5)
    real = w.iter_requests

    def counting(now_ms: int) -> Iterator[bytes]:
        for body in real(now_ms):
            if body:  # an empty body is a pause (one comes after PAUSE_AFTER_SECONDS of
                # building: on a loaded machine, anywhere), not a request
                made.append(len(made))
                assert len(sent) == len(made) - 1  # the one before was sent first
            yield body

    async def send(body: bytes) -> None:
        sent.append(len(sent))

    w.iter_requests = counting  # type: ignore[method-assign]
    w._send = send
    assert await w.write_once()
    assert len(made) > 3 and sent == made
    assert w.last_series == len(decode(b"".join(writer(small_index()).build_requests(1))))


async def test_a_failed_write_reports_and_owes_the_whole_write() -> None:
    index = small_index()
    whole = writer(small_index()).build_requests(10_000)

    async def send(body: bytes) -> None:
        raise ConnectionError("upstream down")

    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0, max_series_per_request=5)
    assert not await w.write_once()
    assert w.last_series == sum(len(decode(b)) for b in whole)
    assert w.writes_failed == 1
    # every series of the failed write is owed a marker once it goes away
    index.apply(ChangeSet(workloads={"w-dep": None, "w-ray": None},
                          pods={uid: None for uid in PODS}))
    bodies = w.build_requests(20_000)
    stale = {k for body in bodies for k, s in decode(body).items() if is_stale(s[0][0])}
    assert stale == {k for body in whole for k in decode(body)} - {
        k for body in bodies for k, s in decode(body).items() if not is_stale(s[0][0])}


def test_coverage_follows_attribution_and_ends_with_stale_markers() -> None:
    index = small_index()
    w = writer(index)
    w.build_request(1000)
    w.commit()
    # the stray pod gets attributed; the api pod loses its workload's description
    index.apply(ChangeSet(pods={
        "p-lost": replace(PODS["p-lost"], workload=DEP, reason=""),
        "p-api": replace(PODS["p-api"], workload=None, reason="owner_missing"),
    }))
    series = decode(w.build_request(2000))
    w.commit()
    cov = coverage(series)
    assert cov[("web", "attributed", "")] == 1
    assert cov[("web", "unattributed", "owner_missing")] == 1
    assert is_stale(cov[("web", "unattributed", "no_described_owner")])
    # the last pods of a namespace go: its series end, nothing lingers at 0
    index.apply(ChangeSet(pods={"p-lost": None, "p-api": None}))
    cov = coverage(decode(w.build_request(3000)))
    w.commit()
    assert is_stale(cov[("web", "attributed", "")])
    assert is_stale(cov[("web", "unattributed", "owner_missing")])
    assert cov[("ml", "attributed", "")] == 2
    assert set(coverage(decode(w.build_request(4000)))) == {("ml", "attributed", "")}


# -- end to end: API simulator -> watches -> engine -> index -> facts -> Prometheus -----------


def _pod(name: str, ns: str, rs: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "web"},
                     "ownerReferences": owner_refs(rs)},
        "spec": {"nodeName": "n1", "containers": [{"name": "main", "image": "img"}]},
        "status": {"phase": "Running"},
    }


@pytest.mark.peers
async def test_end_to_end_deployment_phase_scale_up_and_deletion(prom: Prometheus) -> None:
    """A Deployment in the API simulator, watched through kubernetes-asyncio, interpreted
    by the built-in description, written as facts into a real Prometheus: its phase
    changes show as state-set and transition series, desired vs observed pods follow a
    scale-up, and its facts end with stale markers when it is deleted."""
    from proxy.config import KubeSettings
    from proxy.karta.engine import Engine
    from proxy.kube.source import KubeSource
    from tests.kubesim.server import KubeSim

    ns = "e2e"
    async with KubeSim(bookmark_interval=0.2) as sim, aiohttp.ClientSession() as http:
        kube = KubeSettings(kubeconfig=str(sim.write_kubeconfig()),
                            resync_backoff_max_seconds=0.5)
        index = PodIndex()
        source = KubeSource(kube, Engine(), index, metrics_registry=CollectorRegistry(),
                            watch_timeout=2, recheck_interval=0.5)

        async def send(body: bytes) -> None:
            async with http.post(prom.url + "/api/v1/write", data=snappy.compress(body),
                                 headers={"Content-Encoding": "snappy",
                                          "Content-Type": "application/x-protobuf"}) as r:
                assert r.status == 204, await r.text()

        w = FactWriter(FactSettings(interval_seconds=0.3), index, send)
        dep = sim.create({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}}},
        })
        rs = sim.create({
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": "web-1", "namespace": ns, "ownerReferences": owner_refs(dep)},
            "spec": {"replicas": 2},
        })
        for i in range(2):
            sim.create(_pod(f"web-1-{i}", ns, rs))
        await asyncio.wait_for(source.start(), 10)
        await w.start()

        def facts_of(name: str) -> list[Any]:
            return [f for f in iter_facts(index) if f.name == name
                    and dict(f.labels).get("karta_workload") == "web"]

        def phase() -> str:
            return next((dict(f.labels)["phase"] for f in facts_of(contract.FACT_WORKLOAD_PHASE)
                         if f.value == 1.0), "")

        def replicas() -> tuple[float, float]:
            d = [f.value for f in facts_of(contract.FACT_COMPONENT_DESIRED_REPLICAS)]
            o = [f.value for f in facts_of(contract.FACT_COMPONENT_OBSERVED_PODS)]
            return (d[0] if d else -1, o[0] if o else -1)

        async def settle(cond: Callable[[], bool]) -> float:
            """Wait until the index shows it and two more writes went out; a query time."""
            deadline = time.monotonic() + 5
            while not cond():
                assert time.monotonic() < deadline, (phase(), replicas())
                await asyncio.sleep(0.02)
            n = w.writes_ok
            while w.writes_ok < n + 2:
                assert time.monotonic() < deadline + 5
                await asyncio.sleep(0.02)
            return time.time()

        def set_status(obj: dict[str, Any], n: int) -> None:
            cur = sim.get("apps/v1", "Deployment", "web", ns)
            cur["status"] = {"observedGeneration": cur["metadata"]["generation"],
                             "replicas": n, "updatedReplicas": n, "readyReplicas": n,
                             "availableReplicas": n}
            sim.update(cur)

        try:
            t_init = await settle(lambda: phase() == "Initializing" and replicas() == (2, 2))
            set_status(dep, 2)
            t_run_seen = time.time()
            t_run = await settle(lambda: phase() == "Running")
            # scale up: spec changes (generation 2), the rollout is not done yet
            cur = sim.get("apps/v1", "Deployment", "web", ns)
            cur["spec"]["replicas"] = 4
            sim.update(cur)
            t_scaling = await settle(lambda: replicas() == (4, 2))
            rs_now = sim.get("apps/v1", "ReplicaSet", "web-1", ns)
            for i in range(2, 4):
                sim.create(_pod(f"web-1-{i}", ns, rs_now))
            t_pods = await settle(lambda: replicas() == (4, 4))
            set_status(dep, 4)
            t_scaled = await settle(lambda: phase() == "Running")
            sim.delete(sim.get("apps/v1", "Deployment", "web", ns))
            t_deleted = await settle(lambda: not facts_of(contract.FACT_WORKLOAD_INFO))
        finally:
            await w.stop()
            await source.stop()

    sel = 'karta_namespace="e2e",karta_kind="Deployment",karta_group="apps",karta_workload="web"'

    def q(expr: str, at: float) -> dict[tuple[tuple[str, str], ...], float]:
        return prom.query(expr, at)

    def current(at: float) -> list[str]:
        return [dict(k)["phase"] for k in q(f"karta_workload_phase{{{sel}}} == 1", at)]

    assert await asyncio.to_thread(current, t_init) == ["Initializing"]
    assert await asyncio.to_thread(current, t_run) == ["Running"]
    assert await asyncio.to_thread(current, t_scaling) == ["Initializing"]
    assert await asyncio.to_thread(current, t_scaled) == ["Running"]
    # time in phase at t_run: since the Running status was observed, not since the write
    (tip,) = (await asyncio.to_thread(
        q, f"time() - karta_workload_phase_transition_timestamp_seconds{{{sel}}}", t_run
    )).values()
    assert 0 <= tip <= t_run - t_run_seen + 0.5, tip
    # desired vs observed follow the scale-up
    for at, expected in ((t_init, (2, 2)), (t_scaling, (4, 2)), (t_pods, (4, 4))):
        d = await asyncio.to_thread(q, f"karta_component_desired_replicas{{{sel}}}", at)
        o = await asyncio.to_thread(q, f"karta_component_observed_pods{{{sel}}}", at)
        assert (list(d.values()), list(o.values())) == ([expected[0]], [expected[1]]), at
    pods = await asyncio.to_thread(q, f"count(karta_pod_info{{{sel}}})", t_pods)
    assert list(pods.values()) == [4]
    # deleted: stale markers end every fact series of the workload at once
    assert await asyncio.to_thread(q, f"{{__name__=~'karta_.+',{sel}}}", t_scaled)
    assert await asyncio.to_thread(q, f"{{__name__=~'karta_.+',{sel}}}", t_deleted) == {}


async def test_takeover_ends_what_vanished_while_the_old_leader_was_dying() -> None:
    """Two writers with LeaseElectors against the API simulator. The leader stops writing
    (it is dying), a workload is deleted, the lease expires, the standby takes over: its
    first write carries stale markers for the deleted workload's facts, although it never
    wrote them itself."""
    from kubernetes_asyncio import client as k8s

    from proxy.config import KubeSettings
    from proxy.kube.client import load_configuration
    from proxy.lease import LeaseElector
    from proxy.sender import decode_v1
    from tests.kubesim.server import KubeSim

    duration, interval = 1.0, 0.2
    index = PodIndex()
    for name in ("kept", "deleted"):
        ref = _wl(name, f"u-{name}")
        index.apply(ChangeSet(workloads={ref.uid: WorkloadFacts(
            ref, "rayjob", False, "Running", ("Running",), "", time.time())}))
    sends: dict[str, list[bytes]] = {"a": [], "b": []}

    def sender(identity: str) -> Callable[[bytes], Any]:
        async def send(body: bytes) -> None:
            sends[identity].append(body)
        return send

    async with KubeSim() as sim:
        cfg = await load_configuration(KubeSettings(kubeconfig=str(sim.write_kubeconfig())))
        apis = [k8s.ApiClient(configuration=cfg) for _ in range(2)]
        electors = [LeaseElector(api, "karta", "facts", ident, duration)
                    for api, ident in zip(apis, ("a", "b"), strict=True)]
        writers = {e.identity: FactWriter(FactSettings(interval_seconds=interval), index,
                                          sender(e.identity), elector=e) for e in electors}
        tasks = [asyncio.create_task(e.run()) for e in electors]
        try:
            for w in writers.values():
                await w.start()
            deadline = time.monotonic() + 10
            while not any(sends.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            leader = next(e for e in electors if e.is_leader)
            standby = next(e for e in electors if e is not leader)

            def walked(n: int) -> Callable[[], Any]:
                async def check() -> bool:
                    return writers[standby.identity].standby_walks >= n
                return check

            # the standby has looked around (counted, not slept for: a loaded machine
            # may not give it a walk in a few intervals, and then it never saw "deleted")
            await wait_until(walked(1), timeout=15, what="the standby's walk")
            assert writers[leader.identity].state is WriterState.LEADER
            assert writers[standby.identity].state is WriterState.STANDBY
            await writers[leader.identity].stop()  # dying: writes no more
            index.apply(ChangeSet(workloads={"u-deleted": None}))
            # the standby notices (a whole walk after the deletion), but does not write
            await wait_until(walked(writers[standby.identity].standby_walks + 2),
                             timeout=15, what="the standby's walk after the deletion")
            assert not sends[standby.identity]
            assert writers[standby.identity].state is WriterState.STANDBY
            await leader.stop(release=False)
            deadline = time.monotonic() + 10
            while not sends[standby.identity] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert writers[standby.identity].state is WriterState.LEADER
        finally:
            for w in writers.values():
                await w.stop()
            for e in electors:
                await e.stop(release=False)
            await asyncio.gather(*tasks, return_exceptions=True)
            for api in apis:
                await api.close()

    first = [s for body in sends[standby.identity][:1] for s in decode_v1(body)]
    info = {s.labels["karta_workload"]: s for s in first
            if s.labels["__name__"] == "karta_workload_info"}
    assert not is_stale(info["kept"].samples[0][1])
    assert is_stale(info["deleted"].samples[0][1]), "the takeover ends the deleted workload"


async def test_what_a_write_remembers_is_the_caches_groups_out_of_the_collectors_view(
) -> None:
    """The written set costs a table entry per pod and workload, not per series (290k at
    37.5k pods): it holds the cache's own groups, and a write leaves them, with the
    cache, out of every later full collection (``memory.freeze_survivors``)."""
    import gc

    async def send(body: bytes) -> None:
        pass

    index = small_index()
    w = writer(index, send)
    try:
        assert await w.write_once()
        assert len(w._written) == len(index.pods) + len(index.workloads) + 2
        cached = [c.group for c in w._pod_cache.values()]
        cached += [c.group for c in w._workload_cache.values()]
        assert all(any(g is c for c in cached) for k, g in w._written.items()
                   if k not in (COVERAGE_KEY, PROCESS_KEY))
        assert w.last_series > len(w._written)
        assert not any(o is w._written for o in gc.get_objects())  # frozen
    finally:
        gc.unfreeze()


async def test_a_standby_walk_leaves_what_it_keeps_out_of_the_collectors_view() -> None:
    """A standby replica keeps the same cache (and the groups it saw): left tracked,
    every full collection its relaying triggers walked them (~80 ms at 37.5k pods)."""
    import gc

    async def send(body: bytes) -> None:
        raise AssertionError("a standby sends nothing")

    w = FactWriter(FactSettings(), small_index(), send, elector=_Elector())  # type: ignore[arg-type]
    try:
        assert not await w.write_once()
        assert w._standby and w._pod_cache
        held = [w._standby, w._pod_cache, *w._standby.values()]
        assert not any(o is h for o in gc.get_objects() for h in held)  # frozen
    finally:
        gc.unfreeze()


def test_a_big_write_pauses_between_its_requests_and_in_its_stale_scan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Building yields an empty body (a pause) after each group (a pod's or a workload's
    series) that takes the series made past a multiple of PAUSE_EVERY_SERIES, and every
    PAUSE_EVERY_SERIES groups checked for stale markers, so a write at 37.5k pods never
    holds the event loop for a whole request or a whole scan of the written set; the
    requests are what they were."""
    import proxy.facts.writer as fw

    index = small_index()
    groups = len(index.pods) + len(index.workloads) + 2  # and the coverage, the process
    whole = writer(index).build_requests(10_000)
    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 1)
    w = writer(index)
    first = list(w.iter_requests(10_000))
    assert first.count(b"") == groups
    assert [b for b in first if b] == whole
    w.commit()
    # the second write scans the first's written set: pauses there too, and none of the
    # series is gone
    again = list(w.iter_requests(20_000))
    assert again.count(b"") == 2 * groups
    assert w.last_stale_markers == 0


def test_a_slow_stretch_pauses_before_its_thousand_series(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stretch that has held the loop PAUSE_AFTER_SECONDS pauses early (checked after
    each group): a cold write encodes a series in ~20 us, so 1,000 of them were 20 ms."""
    import proxy.facts.writer as fw

    index = PodIndex()
    index.apply(ChangeSet(pods={f"p{i}": PodAttribution("ns", f"pod-{i}", f"p{i}")
                                for i in range(64)}))
    whole = writer(index).build_requests(10_000)
    monkeypatch.setattr(fw, "PAUSE_AFTER_SECONDS", 0.0)
    made = list(writer(index).iter_requests(10_000))
    assert made.count(b"") == 64 + 2  # every pod, the coverage, the process
    assert [b for b in made if b] == whole


def test_the_index_may_change_during_a_writes_pauses() -> None:
    """A write describes the index as it was at its start, whatever is applied while it
    is paused, and the next write sees the change."""
    index = small_index()
    w = FactWriter(FactSettings(), index, nosend, max_series_per_request=3)
    bodies = w.iter_requests(1000)
    first = [next(bodies)]
    index.apply(ChangeSet(workloads={"w-ray": None}, pods={"p-new": PodAttribution(
        "web", "api-9", "p-new", DEP, description="deployment")}))
    first.extend(bodies)
    w.commit()
    written = decode(b"".join(first))
    assert not any(is_stale(v[0][0]) for v in written.values())
    assert ("karta_workload", "train") in {kv for k in written for kv in k}
    assert not any(("pod", "api-9") in k for k in written)
    stale, live = stale_and_live(w.build_request(2000))
    assert {dict(k).get("karta_workload") for k in stale} >= {"train"}
    assert any(("pod", "api-9") in k for k in live)


async def _loop_turns_during(w: FactWriter, calls: list[bytes]) -> tuple[bool, list[int]]:
    """write_once's result, and for each turn the event loop got meanwhile how many
    bodies had reached ``send`` by then."""
    ticks: list[int] = []

    async def ticker() -> None:
        while True:
            ticks.append(len(calls))
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        return await w.write_once(), ticks
    finally:
        task.cancel()


async def test_a_write_lets_the_loop_run_at_its_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.facts.writer as fw

    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 2)
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        assert body  # a pause is never sent
        sent.append(body)

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0)
    ok, ticks = await _loop_turns_during(w, sent)
    assert ok
    assert len(sent) == 1  # one request (fewer series than a request holds)
    assert ticks.count(0) > 3  # the loop ran while that request was being built


@pytest.mark.parametrize("told", [False, True])
async def test_a_pause_lets_the_loop_run(monkeypatch: pytest.MonkeyPatch, told: bool) -> None:
    """A relayed request needs many turns of the loop; one turn per pause made requests
    relayed during a big write 4-8x slower. Not told whether requests are relayed, a
    pause lasts PAUSE_SECONDS and the loop turns many times in each; told that none is, a
    pause is ARRIVAL_TURNS turns (a request that arrived during the stretch takes its
    slot in them) and no real time: between requests a write goes at its own pace."""
    import proxy.facts.writer as fw

    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 1)  # a pause after every group
    # told: a pause of real time made 30 s, so "no real time" needs no tight bound on how
    # fast a loaded machine makes the write (0.5 s were asked of it)
    monkeypatch.setattr(yielding, "PAUSE_SECONDS", 30.0 if told else 0.005)
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    index = small_index()
    pauses = len(index.pods) + len(index.workloads) + 2
    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0,
                   busy=(lambda: False) if told else None)
    started = time.monotonic()
    ok, ticks = await asyncio.wait_for(_loop_turns_during(w, sent), 60)
    assert ok and len(sent) == 1
    if told:
        assert time.monotonic() - started < 10.0
        assert ticks.count(0) >= yielding.ARRIVAL_TURNS * pauses
    else:
        assert ticks.count(0) >= 3 * pauses


async def test_a_write_waits_at_its_pauses_while_requests_are_relayed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Background work yields to requests: while ``busy`` says a request is being relayed,
    a write makes no progress past its next pause, and it goes on once none is."""
    import proxy.facts.writer as fw

    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 1)
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    relaying = True
    asked = 0

    def busy() -> bool:
        nonlocal asked
        asked += 1
        return relaying

    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    w = FactWriter(FactSettings(interval_seconds=600), small_index(), send,
                   clock=lambda: 10.0, busy=busy)
    task = asyncio.create_task(w.write_once())

    def asked_past(n: int) -> Callable[[], Any]:
        async def check() -> bool:
            return asked > n
        return check

    # counted, not slept for: how often a loaded machine lets the pause ask in 0.1 s
    # is not for the test to know
    await wait_until(asked_past(10), timeout=15, what="the pause asking again and again",
                     interval=0.01)
    assert not task.done() and not sent  # asked again and again, not once
    waited = asked
    await wait_until(asked_past(waited), timeout=15, what="the pause asking on",
                     interval=0.01)
    assert not task.done() and not sent  # still waiting: the first pause never ended
    relaying = False
    assert await asyncio.wait_for(task, 5.0)
    assert len(sent) == 1


async def test_a_write_waits_for_requests_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy always busy still writes its facts: a pause waits at most
    DEFER_MAX_SECONDS, and a write defers for at most DEFER_SHARE of the interval in all."""
    import proxy.facts.writer as fw

    monkeypatch.setattr(fw, "PAUSE_EVERY_SERIES", 1)
    index = small_index()
    pauses = len(index.pods) + len(index.workloads) + 2

    async def send(body: bytes) -> None:
        pass

    # per pause: a few ms each
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 0.005)
    w = FactWriter(FactSettings(interval_seconds=600), index, send, clock=lambda: 10.0,
                   busy=lambda: True)
    started = time.monotonic()
    assert await asyncio.wait_for(w.write_once(), 5.0)
    assert time.monotonic() - started >= pauses * 0.005
    # in all: a share of a 0.4 s interval, however long a pause may wait
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)
    w = FactWriter(FactSettings(interval_seconds=0.4), index, send, clock=lambda: 10.0,
                   busy=lambda: True)
    started = time.monotonic()
    assert await asyncio.wait_for(w.write_once(), 5.0)
    assert time.monotonic() - started < 0.4 * fw.DEFER_SHARE + 1.0


async def test_a_standby_walk_lets_the_loop_run_and_yields_to_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby replica relays requests too: its walk of the groups (a cold build the
    first time) is made in stretches, with the loop let in and requests waited for."""
    import proxy.facts.writer as fw

    monkeypatch.setattr(fw, "PAUSE_AFTER_SECONDS", 0.0)  # a pause after every group
    monkeypatch.setattr(yielding, "DEFER_MAX_SECONDS", 30.0)

    async def send(body: bytes) -> None:
        raise AssertionError("a standby sends nothing")

    index = small_index()
    groups = len(index.pods) + len(index.workloads) + 2
    w = FactWriter(FactSettings(interval_seconds=600), index, send,
                   elector=_Elector(), busy=lambda: False)  # type: ignore[arg-type]
    ok, ticks = await _loop_turns_during(w, [])
    assert not ok and w.state is WriterState.STANDBY
    assert len(ticks) >= yielding.ARRIVAL_TURNS * groups
    assert len(w._standby) == groups  # and the walk saw every key
    relaying = True
    w = FactWriter(FactSettings(interval_seconds=600), index, send,
                   elector=_Elector(), busy=lambda: relaying)  # type: ignore[arg-type]
    task = asyncio.create_task(w.write_once())
    await asyncio.sleep(0.05)
    assert not task.done()  # waiting for the request at its first pause
    relaying = False
    assert not await asyncio.wait_for(task, 5.0)
    assert len(w._standby) == groups


async def test_a_failed_write_lets_the_loop_run_while_it_finishes() -> None:
    """After a refused request the rest of the write is still made (what it owes is the
    whole write's), with the loop let in between: not one stretch of the loop's time."""
    failed: list[bytes] = []

    async def send(body: bytes) -> None:
        failed.append(body)
        raise ConnectionError("upstream refuses")

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0,
                   max_series_per_request=2)
    ok, ticks = await _loop_turns_during(w, failed)
    assert not ok
    assert len(failed) == 1
    assert ticks.count(1) > 3  # the loop ran while the rest of the write was made
    assert w.last_series == len(decode(b"".join(writer(small_index()).build_requests(1))))


async def test_a_write_the_lease_leaves_midway_stops_and_counts_no_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write still under way when the lease passed (a slow upstream): its request,
    sent while leading, reached the upstream after the new leader's newer samples and
    was refused as out of order (400); the old writer then sent its halves, 66 more
    requests 5-17 s after it stopped leading (two writers at once), and counted and
    logged every fact family as refused by the upstream (an audit with three replicas
    against Prometheus 2.42). It now stops at the first request after the lease passed,
    sends nothing more and counts no refusal."""
    elector = _Elector()
    elector.is_leader = True
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)
        elector.is_leader = False  # the lease passed while this request was on its way
        raise _Refused(400)  # the new leader's samples are newer

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0,
                   elector=elector, max_series_per_request=10)  # type: ignore[arg-type]
    twin = FactWriter(FactSettings(), small_index(), nosend, max_series_per_request=10)
    assert len(twin.build_requests(10_000)) > 1  # the write is more than one request
    with caplog.at_level("INFO", logger="proxy.facts.writer"):
        assert not await w.write_once()
    assert len(sent) == 1  # no halves, no further request
    assert sample_value(w.metrics.series_refused) == 0 and not w._refused
    assert w.writes_failed == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("lease passed" in r.getMessage() for r in caplog.records)
    assert w.step() is WriterState.STANDBY  # and the next interval stands by

    # the lease lost between two requests: the second is never sent
    elector.is_leader = True
    sent.clear()

    async def send_ok(body: bytes) -> None:
        sent.append(body)
        elector.is_leader = False

    w2 = FactWriter(FactSettings(), small_index(), send_ok, clock=lambda: 10.0,
                    elector=elector, max_series_per_request=10)  # type: ignore[arg-type]
    assert not await w2.write_once()
    assert len(sent) == 1 and w2.writes_failed == 0 and w2.writes_ok == 0


@pytest.mark.parametrize("leading", [True, False])
async def test_garbage_of_the_interval_is_not_frozen_for_good(leading: bool) -> None:
    """A write (or a standby walk) freezes what is alive at its end, process-wide: a
    reference cycle already garbage then (a broken watch stream's exception and
    traceback) was frozen with it, never to be collected. A 90-minute soak under churn
    found ~14,000 Python blocks an hour so kept in every replica."""
    from tests.garbage import collections_off, cycle

    async def send(body: bytes) -> None:
        pass

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0)
    if not leading:
        w.step = lambda: WriterState.STANDBY  # type: ignore[method-assign]
    with collections_off():
        gone = cycle()
        await w.write_once()  # the write's end freezes whatever is alive
        alive = gone() is not None
    assert not alive, "the cycle was frozen with the write's survivors"


async def test_a_takeovers_markers_for_the_other_source_are_not_counted_as_series_gone(
) -> None:
    # the first write after a start or a takeover ends each workload's transition series
    # under the other `source` (most never existed): counted, they added one per workload
    # at every takeover to a counter said to count fact series that went away
    sent: list[bytes] = []

    async def send(body: bytes) -> None:
        sent.append(body)

    index = small_index()
    w = FactWriter(FactSettings(), index, send, clock=lambda: 10.0)
    assert await w.write_once()
    others = [k for k, s in decode(sent[-1]).items() if is_stale(s[0][0])]
    assert others and all(
        dict(k)["__name__"] == contract.FACT_WORKLOAD_PHASE_TRANSITION for k in others)
    assert w.stale_markers_total == 0
    assert "transition series" in w.metrics.stale_markers._documentation
    index.apply(ChangeSet(workloads={"w-dep": None}, pods={"p-api": None}))
    assert await w.write_once()
    gone = [k for k, s in decode(sent[-1]).items() if is_stale(s[0][0])]
    assert w.stale_markers_total == len(gone) > 0


@pytest.mark.parametrize("status", [503, 400])
async def test_writes_that_fail_the_same_way_say_so_once_then_in_a_summary(
        caplog: pytest.LogCaptureFixture, status: int) -> None:
    """An upstream down, or refusing every fact series (a 400), for hours: each write's
    lines were written again at every write (every 15 s, longer than the 10 s throttle),
    49 lines a minute for the 400. Now the first of each kind at once, the same again in
    one summary per ``FACT_LINE_SECONDS`` (at the stop here), the count in it."""
    caplog.set_level(logging.WARNING, logger="proxy.facts.writer")
    now = [0.0]

    async def send(body: bytes) -> None:
        raise UpstreamFailure(Answer(status, b"refused\n", upstream=str(status)))

    w = FactWriter(FactSettings(), small_index(), send, clock=lambda: 10.0,
                   monotonic=lambda: now[0])
    for _ in range(20):  # 20 writes at the default interval, within FACT_LINE_SECONDS
        assert not await w.write_once()
        now[0] += 14.0
    per_write = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("fact write")]
    assert len(per_write) == (1 if status == 503 else 2), per_write
    await w.stop()  # what waits for its summary is written at the stop
    summaries = [r.__dict__["count"] for r in caplog.records
                 if r.getMessage().startswith("fact writes")]
    assert summaries == [19] if status == 503 else 0 < len(summaries) <= 2, summaries
