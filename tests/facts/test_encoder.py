"""The facts as RW 1.0 bytes (proxy.facts.encoder): valid requests with sorted, unique
labels and metadata, external labels under the facts' own, one series per label set."""

from __future__ import annotations

from dataclasses import replace

from proxy import contract
from proxy.facts import workload_facts
from proxy.index import PodIndex
from proxy.karta.results import ChangeSet, PodAttribution, ReplicaFact, WorkloadFacts, WorkloadRef
from tests.facts.helpers import (
    DEP,
    by_name,
    decode,
    dep_facts,
    ray_facts,
    remote_pb2,
    small_index,
    types_pb2,
    writer,
)


def test_request_is_valid_rw1_sorted_unique_labels_one_sample_each() -> None:
    body = writer(small_index()).build_request(1_700_000_600_123)
    req = remote_pb2.WriteRequest()
    req.ParseFromString(body)
    assert len(req.timeseries) > 0
    keys = set()
    for ts in req.timeseries:
        names = [lb.name for lb in ts.labels]
        assert names == sorted(names) and len(names) == len(set(names))
        assert all(lb.value for lb in ts.labels)
        assert "__name__" in names
        assert [(s.timestamp) for s in ts.samples] == [1_700_000_600_123]
        key = tuple((lb.name, lb.value) for lb in ts.labels)
        assert key not in keys
        keys.add(key)
    # metadata for every fact family, as gauges with help
    meta = {m.metric_family_name: m for m in req.metadata}
    assert set(meta) == set(contract.FACT_SERIES)
    assert all(m.type == types_pb2.MetricMetadata.GAUGE and m.help for m in meta.values())
    # every byte accounted for: protobuf re-encodes to the same length, less the 9-byte
    # `value = 0.0` fields it leaves out as proto3 defaults (the hand encoder writes them)
    zeros = sum(1 for ts in req.timeseries for s in ts.samples if s.value == 0.0)
    assert len(req.SerializeToString()) == len(body) - 9 * zeros


def test_external_labels_added_but_never_override_fact_labels() -> None:
    w = writer(small_index(), external_labels={"cluster": "eu-1", "namespace": "WRONG"})
    series = decode(w.build_request(1_700_000_600_000))
    for labels in series:
        d = dict(labels)
        assert d["cluster"] == "eu-1"
        if d["__name__"] == contract.FACT_POD_INFO:
            assert d["namespace"] in ("ml", "web")
        if d["__name__"] == contract.FACT_CONTRACT_INFO:
            assert d["namespace"] == "WRONG"  # no own namespace label: the external one


def test_unicode_and_long_values_encode() -> None:
    index = PodIndex()
    long_name = "x" * 300  # a label longer than 127 bytes needs a two-byte length
    wl = WorkloadRef("ns-é", "", "Pod", long_name, "u")
    index.apply(
        ChangeSet(
            pods={"u": PodAttribution("ns-é", long_name, "u", wl, description="pod")},
            workloads={
                "u": WorkloadFacts(wl, "pod", True, "Running", ("Running",), "", 1.0)
            },
        )
    )
    series = decode(writer(index).build_request(1))
    info = by_name(series, contract.FACT_POD_INFO)
    assert len(info) == 1
    d = dict(next(iter(info)))
    assert d["pod"] == long_name and d["namespace"] == "ns-é"
    assert "karta_group" not in d  # core group: empty, left out


def test_an_instance_listed_twice_is_written_once_with_its_first_value() -> None:
    """An object's instance ids can repeat (a path that lists one twice): its series would
    be two samples of one series at one timestamp, which a TSDB refuses."""
    index = PodIndex()
    twice = (ReplicaFact("workers", "g", 4, None, None, 3),
             ReplicaFact("workers", "g", 9, None, None, 3))
    index.apply(ChangeSet(workloads={"w-ray": ray_facts(replicas=twice)}))
    series = decode(writer(index).build_request(1000))
    desired = by_name(series, contract.FACT_COMPONENT_DESIRED_REPLICAS)
    assert list(desired.values()) == [4.0]
    assert all(len(samples) == 1 for samples in series.values())


def test_series_of_one_label_set_are_one_tuple_whoever_makes_them() -> None:
    """Equal label sets make equal cached series (the written set compares them): two
    workload objects of one identity, encoded separately, agree on every shared series."""
    from proxy.facts.encoder import encode_facts

    a = encode_facts(workload_facts(dep_facts()), (("cluster", "c1"),), 11)
    b = encode_facts(workload_facts(dep_facts(ref=replace(DEP, uid="other"))),
                     (("cluster", "c1"),), 11)
    series = list(a.series())
    shared = set(series) & set(b.series())
    assert len(shared) == len(series) - 1  # all but the info series (workload_uid)
    runs = [p for s in series for p in s if b"\x0ekarta_workload\x12" in p]
    assert len(runs) == len(series)  # every series has its identity in a shared run,
    assert len({id(p) for p in runs}) == len(set(runs)) <= 4  # held once per shape
    assert a.shape is b.shape  # and the groups' shapes are one object


def test_pods_of_a_component_share_the_pieces_of_their_series_that_are_not_their_own() -> None:
    """A pod's series holds its namespace, name and uid alone; its family's name, stamp
    and the external labels are one object for every pod that has them (the writer's
    cache held a copy per pod: 3.4 MB at 37.5k pods). The bytes are what one piece made."""
    from proxy.facts.encoder import _label_field, encode_facts, merged_pairs
    from proxy.facts.model import pod_facts
    from proxy.shared_values import SharedValues

    ext = (("cluster", "c1"),)
    runs: SharedValues[bytes] = SharedValues(1024)
    groups = []
    for i in range(3):
        att = PodAttribution("shop", f"api-{i}", f"u-{i}", DEP, "api", "", "", "d")
        (fact,) = pod_facts(att)
        g = encode_facts([fact], ext, 11, runs)
        (series,) = g.series()
        whole = b"".join(_label_field(k, v) for k, v in merged_pairs(fact.name, fact.labels, ext))
        assert b"".join(series[1:]) == whole
        groups.append(series)
    a, b, c = groups
    assert len(a) == 3  # the header, the run of shared labels, the pod's own labels
    assert a[1] is b[1] is c[1] and b"karta_workload" in a[1]
    assert b"api-0" in a[2] and b"api-1" in b[2]
    # made again without the writer's table: the same tuple (the written set compares)
    att = PodAttribution("shop", "api-0", "u-0", DEP, "api", "", "", "d")
    assert list(encode_facts(pod_facts(att), ext, 11).series()) == [a]
    # an unattributed pod: its reason is shared too, its names are its own
    lone = PodAttribution("shop", "x", "u-x", None, "", "", "", "", "owner_missing")
    (series,) = encode_facts(pod_facts(lone), ext, 11, runs).series()
    (reason,) = (p for p in series[1:] if b"owner_missing" in p)
    assert runs(reason) is reason and b"x" not in reason and b"u-x" not in reason
