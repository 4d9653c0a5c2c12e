"""The native splice under threads: splices of big requests in a pool while the table
changes under them, and a splice that runs while another thread holds the GIL.

Every result must be internally consistent: the body reads with the generated classes,
each stamped series carries exactly one of the stamps its pod had at some point, every
series of one pod in one request got the same answer (a splice reads the table under its
read lock for the whole request), and the counts add up. No timing is asserted: parallel
speed is the benchmarks' business.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from proxy import contract
from proxy.config import PodLabelPair, PodLabelRule
from proxy.enrichment import build_plan
from proxy.pb.io.prometheus.write.v2 import types_pb2 as pb2
from proxy.pb.prometheus import remote_pb2, types_pb2
from proxy.wire.native import Splicer, native_available
from proxy.wire.plan import SplicePlan, SpliceResult

if not native_available():
    pytest.skip("the native splice is not built", allow_module_level=True)

SERIES = 2000
THREADS = 4
SECONDS = 3.0
#: splices per worker at most (the time bound usually ends the run first)
MAX_SPLICES = 400
NAMESPACES = [b"ml", b"web", b"ns-\xc3\xbc"]
PODS = [(NAMESPACES[i % 3], f"pod-{i}".encode()) for i in range(60)]
GHOST = (b"ml", b"ghost")  # never in the table
REASONS = ["no_described_owner", "tombstone"]
KARTA = contract.STAMPED_PREFIX


def variants(i: int) -> list[tuple[tuple[str, str], ...]]:
    """The stamps pod i takes turns at: of 1, 3 and all 7 labels, so sizes change too."""
    names = list(contract.STAMPED_LABELS)
    out = []
    for k, n in enumerate((1, 3, len(names))):
        out.append(tuple((name, f"{name[len(KARTA):]}-{i}-{k}-{'ü' * k}") for name in names[:n]))
    return out


VARIANTS = {pod: variants(i) for i, pod in enumerate(PODS)}
#: what each variant looks like in an output: its labels as sorted (name, value) str pairs
STAMPS = {pod: {tuple(sorted(v)) for v in vs} for pod, vs in VARIANTS.items()}

DEFAULT_PLAN = build_plan([("exported_namespace", "exported_pod"), ("namespace", "pod")], None,
                          "replace")
#: a DCGM rule whose unless is a regex: the native splice calls back into Python for it
REGEX_PLAN = build_plan([("namespace", "pod")], [PodLabelRule("DCGM_", [
    PodLabelPair("namespace", "pod", {"container": "exp.*"}),
])], "replace")


def series_labels(i: int) -> tuple[tuple[bytes, bytes], dict[str, str]]:
    """Series i: its pod and its labels (some DCGM ones: the exporter's are skipped by
    the rule's unless, the others name their pod)."""
    pod = GHOST if i % 10 == 9 else PODS[(i * 7) % len(PODS)]
    labels = {"namespace": pod[0].decode(), "pod": pod[1].decode(), "instance": f"i{i % 13}"}
    if i % 5 == 0:
        labels["__name__"] = "DCGM_FI_DEV_FB_USED"
        labels["container"] = "exporter" if i % 3 == 0 else "main"
    else:
        labels["__name__"] = f"metric_{i % 17}"
    return pod, labels


def skipped_by_unless(labels: dict[str, str]) -> bool:
    return labels["__name__"].startswith("DCGM_") and labels.get("container", "") in (
        "exporter", "nvidia-dcgm-exporter", "dcgm-exporter", "")


def request_v1() -> bytes:
    req = remote_pb2.WriteRequest()
    for i in range(SERIES):
        _, labels = series_labels(i)
        ts = req.timeseries.add()
        for k in sorted(labels):
            ts.labels.add(name=k, value=labels[k])
        ts.samples.add(value=float(i), timestamp=1_767_000_000_000 + i)
        if i % 50 == 0:
            ts.exemplars.add(value=1.0, timestamp=5).labels.add(name="trace_id", value="t")
    out: bytes = req.SerializeToString()
    return out


def request_v2() -> bytes:
    req = pb2.Request()
    syms = [""]
    where = {"": 0}

    def ref(s: str) -> int:
        if s not in where:
            where[s] = len(syms)
            syms.append(s)
        return where[s]

    for i in range(SERIES):
        _, labels = series_labels(i)
        ts = req.timeseries.add()
        for k in sorted(labels):
            ts.labels_refs.extend([ref(k), ref(labels[k])])
        ts.samples.add(value=float(i), timestamp=1_767_000_000_000 + i)
        if i % 50 == 0:
            ts.histograms.add(count_float=1.0, schema=0, timestamp=3)
    req.symbols.extend(syms)
    out: bytes = req.SerializeToString()
    return out


RAW_V1 = request_v1()
RAW_V2 = request_v2()


def _labels_v1(body: bytes) -> list[list[tuple[str, str]]]:
    req = remote_pb2.WriteRequest.FromString(body)
    return [[(lb.name, lb.value) for lb in ts.labels] for ts in req.timeseries]


def _labels_v2(body: bytes) -> list[list[tuple[str, str]]]:
    req = pb2.Request.FromString(body)
    out = []
    for ts in req.timeseries:
        r = list(ts.labels_refs)
        out.append([(req.symbols[r[i]], req.symbols[r[i + 1]]) for i in range(0, len(r), 2)])
    return out


def check_result(res: SpliceResult, version: int) -> None:
    """One splice's result is consistent with some snapshot of the table."""
    assert res.counts.series == SERIES
    assert res.counts.samples == SERIES
    if version == 1:
        assert (res.counts.exemplars, res.counts.histograms) == (SERIES // 50, 0)
    else:
        assert (res.counts.exemplars, res.counts.histograms) == (0, SERIES // 50)
    out = _labels_v1(res.body) if version == 1 else _labels_v2(res.body)
    assert len(out) == SERIES
    seen: dict[tuple[bytes, bytes], tuple[tuple[str, str], ...] | None] = {}
    stamped = 0
    for i, labels in enumerate(out):
        pod, sent = series_labels(i)
        names = [n.encode() for n, _ in labels]
        assert names == sorted(names), f"series {i}: labels out of order"
        karta = tuple(sorted((n, v) for n, v in labels if n.startswith(KARTA)))
        assert sorted((n, v) for n, v in labels if not n.startswith(KARTA)) == sorted(
            sent.items()), f"series {i}: its own labels changed"
        if karta:
            stamped += 1
            assert pod != GHOST
            assert karta in STAMPS[pod], f"series {i}: {karta} was never a stamp of {pod}"
            assert not skipped_by_unless(sent), f"series {i}: the unless did not hold"
        # a request reads one snapshot: every series of a pod got the same answer
        # (the exporter's DCGM series never look the pod up)
        if not skipped_by_unless(sent):
            assert seen.setdefault(pod, karta or None) == (karta or None), (
                f"series {i}: pod {pod} answered two ways in one request")
    assert res.attributed == stamped
    assert sum(res.unattributed.values()) == SERIES - stamped
    assert set(res.unattributed) <= {"pod_unknown", "no_pod_label", *REASONS}
    assert res.unattributed.get("pod_unknown", 0) >= SERIES // 10  # the ghost's series


def mutate_table(table: Any, rnd: random.Random) -> None:
    """One change of the kinds the index makes: a stamp changes, a pod turns
    unattributed, goes away, or many change at once."""
    pod = rnd.choice(PODS)
    roll = rnd.random()
    if roll < 0.4:
        table.set(*pod, rnd.choice(VARIANTS[pod]))
    elif roll < 0.55:
        table.set(*pod, rnd.choice(REASONS))
    elif roll < 0.7:
        table.delete(*pod)
    else:
        changes = []
        for p in rnd.sample(PODS, 20):
            r = rnd.random()
            answer = (rnd.choice(VARIANTS[p]) if r < 0.6 else rnd.choice(REASONS) if r < 0.8
                      else None)
            changes.append((p[0], p[1], answer))
        table.update(changes)


def splice_until(sp: Splicer, stop: threading.Event, k: int,
                 progress: list[int] | None = None) -> int:
    """One thread's splices, RW 1.0 and 2.0 in turn (worker ``k`` starts on its own one),
    each checked, until ``stop`` or MAX_SPLICES; how many it made (also kept in
    ``progress[k]`` as it goes, for the test to see where its changes fell)."""
    done = 0
    while not stop.is_set() and done < MAX_SPLICES:
        version = 1 + (done + k) % 2
        res = sp.splice_v1(RAW_V1) if version == 1 else sp.splice_v2(RAW_V2)
        check_result(res, version)
        done += 1
        if progress is not None:
            progress[k] = done
    return done


@pytest.mark.parametrize("plan", [DEFAULT_PLAN, REGEX_PLAN], ids=["literal-unless", "regex-unless"])
def test_splices_in_threads_while_the_table_changes(plan: SplicePlan) -> None:
    sp = Splicer(plan, "native")
    rnd = random.Random(5)
    sp.table.update([(ns, pod, rnd.choice(VARIANTS[(ns, pod)])) for ns, pod in PODS])
    stop = threading.Event()

    changes = 0
    progress = [0] * THREADS
    #: how many splices had ended when each change was made
    points: set[int] = set()
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(splice_until, sp, stop, k, progress) for k in range(THREADS)]
        deadline = time.monotonic() + SECONDS
        try:
            # changes while the workers run, 100 or more if they come within a hard bound
            # of time (each waits for the write lock, i.e. for the splices in flight)
            hard = deadline + 30
            while ((time.monotonic() < deadline or changes < 100) and time.monotonic() < hard
                   and not all(f.done() for f in futures)):
                mutate_table(sp.table, rnd)
                changes += 1
                points.add(sum(progress))
                if changes % 64 == 0:
                    time.sleep(0.001)  # let the workers' Python (the checks) run too
        finally:
            stop.set()
        splices = [f.result() for f in futures]  # re-raises a worker's failure
    assert all(n > 0 for n in splices), splices
    # the changes fell among the splices, not all before or after them: made while the
    # workers ran, at two or more points of their progress. How many is the box's
    # business: on the sanitized build a splice can take a second (3 each in 3 s, 1,011
    # changes at 8 points), and changes wait for the splices in flight (77 in 33 s)
    assert (changes >= THREADS and len(points) >= 2) or any(
        n == MAX_SPLICES for n in splices), (changes, sorted(points), splices)
    # the table is still whole: every pod answers one of its stamps, a reason, or None
    for pod in PODS:
        got = sp.table.get(*pod)
        assert got is None or got in REASONS or tuple(
            (n.decode(), v.decode()) for n, v in got) in {tuple(sorted(v)) for v in VARIANTS[pod]}


def test_table_updates_from_threads_while_splicing() -> None:
    """Writers in threads too (the write lock is taken with the GIL released): no
    deadlock, no torn entry."""
    sp = Splicer(REGEX_PLAN, "native")
    stop = threading.Event()

    def writer(seed: int) -> int:
        rnd = random.Random(seed)
        n = 0
        while not stop.is_set() and n < 20_000:
            mutate_table(sp.table, rnd)
            n += 1
        return n

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(writer, 1), pool.submit(writer, 2),
                   pool.submit(splice_until, sp, stop, 0), pool.submit(splice_until, sp, stop, 1)]
        time.sleep(SECONDS / 2)
        stop.set()
        counts = [f.result(timeout=60) for f in futures]
    assert all(n > 0 for n in counts), counts


# -- the GIL ----------------------------------------------------------------------------


def _big_unattributed_v1(series: int) -> bytes:
    """A request none of whose pods the table knows: the splice walks it all and hands
    the input back, without taking the GIL in between."""
    out = []
    for i in range(series):
        ts = types_pb2.TimeSeries()
        ts.labels.add(name="__name__", value="m")
        ts.labels.add(name="namespace", value="ns")
        ts.labels.add(name="pod", value=f"p{i % 1000}")
        ts.samples.add(value=1.0, timestamp=1)
        out.append(ts.SerializeToString())
    one = b"".join(b"\x0a" + bytes([len(s)]) + s for s in out)
    return one * 4


def _cpu_advance_while_holding_the_gil(call: Callable[[], object], budget: float
                                       ) -> tuple[float, bool]:
    """Run ``call`` in a thread, take the GIL back as soon as that thread lets go of it,
    then, without ever releasing the GIL, watch that thread's CPU clock. Returns the CPU
    seconds it used meanwhile and whether it had already finished when we looked.

    With a huge switch interval, neither thread is made to hand the GIL over: the main
    thread gets it back only when the other releases it by itself (inside the splice, or
    at its end), and keeps it until it is done watching. A splice that held the GIL
    throughout would be over (``done``) by then and use no CPU while watched."""
    state: dict[str, bool] = {}
    clocks: list[int] = []
    started = threading.Event()

    def run() -> None:
        clocks.append(time.pthread_getcpuclockid(threading.get_ident()))
        started.set()
        call()
        state["done"] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        t = threading.Thread(target=run)
        t.start()
        started.wait()
        # here the GIL is ours: the other thread released it (or finished); it cannot
        # finish while we hold it, so its clock stays valid
        finished_first = state.get("done", False)
        advance = 0.0
        if not finished_first:
            c0 = time.clock_gettime(clocks[0])
            until = time.monotonic() + budget
            # (another thread's CPU clock may move in scheduler ticks of a few ms)
            while time.monotonic() < until:
                advance = time.clock_gettime(clocks[0]) - c0
                if advance >= 0.001:
                    break
    finally:
        sys.setswitchinterval(old)
    t.join()
    return advance, finished_first


def test_a_splice_runs_while_another_thread_holds_the_gil() -> None:
    sp = Splicer(DEFAULT_PLAN, "native")
    raw = _big_unattributed_v1(100_000)
    t0 = time.perf_counter()
    assert sp.splice_v1(raw).body is raw
    one = time.perf_counter() - t0
    tries = []
    for _ in range(5):  # a main thread scheduled late may look only after the walk
        advance, finished_first = _cpu_advance_while_holding_the_gil(
            lambda: sp.splice_v1(raw), budget=0.5 + 5 * one)
        tries.append((round(advance * 1e3, 3), finished_first))
        if advance >= 0.001 and not finished_first:
            return
    pytest.fail(f"the splice never ran while this thread held the GIL: (CPU ms, finished "
                f"before we looked) per try: {tries}")


def test_an_update_owns_its_keys_while_it_waits_for_the_write_lock() -> None:
    """``PodTable.update(a_list)`` kept borrowed pointers into the list's tuples and read
    them with the GIL released, waiting for the write lock behind a splice: a thread that
    cleared the list meanwhile freed them, and the update hashed whatever the memory held
    then (a ThreadSanitizer audit: heap-use-after-free; a delete then removed another pod
    or none). Here the splice holds the read lock in its ``grow`` call while the list of
    deletes is cleared and its memory reused."""
    sp = Splicer(DEFAULT_PLAN, "native")
    table = sp.table
    table.update([(ns, pod, VARIANTS[(ns, pod)][2]) for ns, pod in PODS])  # grows its input
    keys = [(b"ns-uaf", b"pod-uaf-%06d" % i) for i in range(2000)]
    table.update([(ns, pod, (("karta_workload", "w"),)) for ns, pod in keys])
    deletes = [(bytes(bytearray(ns)), bytes(bytearray(pod)), None)  # the list's own bytes
               for ns, pod in keys]
    in_grow, go = threading.Event(), threading.Event()

    def grow(need: int) -> int:  # called with the table's read lock held
        in_grow.set()
        go.wait(10)
        return need * 2

    splicing = threading.Thread(target=lambda: sp.splice_v1(request_v1(), 1, grow))
    splicing.start()
    assert in_grow.wait(10)
    updating = threading.Thread(target=table.update, args=(deletes,))
    updating.start()
    time.sleep(0.3)  # it has read the list and waits for the write lock, GIL released
    assert updating.is_alive()  # behind the splice's read lock
    deletes.clear()  # the only references to the keys' bytes
    reuse = [bytes(bytearray(b"zzz-zzz-%06d" % i)) for i in range(4000)]  # the same sizes
    go.set()
    splicing.join(10)
    updating.join(10)
    assert not splicing.is_alive() and not updating.is_alive()
    kept = [k for k in keys if table.get(*k) is not None]
    assert kept == [], f"{len(kept)} of {len(keys)} deleted keys still in the table"
    assert len(reuse) == 4000
