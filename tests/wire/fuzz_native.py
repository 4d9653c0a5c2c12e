"""Mutation fuzzer for the native splice (``proxy/wire/_splice.c``), and the request
generator the wire tests share.

Run standalone (``tests/wire/test_native_fuzz.py`` runs it in a subprocess, so a crash
kills this process and never the test run)::

    python tests/wire/fuzz_native.py --seconds 60 --seed 1

It builds a seed corpus of valid RW 1.0 and 2.0 requests (wire-level, with everything
the splices must cope with: unsorted and duplicated labels, labels after samples,
unknown fields, non-minimal varints, unpacked refs, long and multi-byte strings), then
mutates them at random (bit flips, interesting bytes, inserts, deletes, duplicated
spans, crossovers, corrupted varints, edited length fields, wrong wire types) and
splices each mutant natively under several plans; every few iterations the pure-Python
reference splices the same input and the two must agree (same body, counts and
reasons, or the same ``DecodeError`` kind and status). Every RW 2.0 input is converted to
RW 1.0 natively too (``_convert.c``: the size, then the bytes at that size), and every few
iterations held equal to ``proxy/wire/convert.py`` (or left to it, where it refuses).
Then a fixed-input loop checks that memory (RSS) and reference counts do not grow.

Exit status: 0 all good, 1 a disagreement or a leak (the reproducer is printed), 2 the
native splice is not built; a crash is death by a signal. Before every native call the
input is written to ``--crash-file`` (an mmap'd file, so it survives a segfault): the
parent reports it, and ``--replay FILE`` re-runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import mmap
import os
import random
import struct
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cramjam
import snappy

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # run as a script: make ``proxy`` importable from the tree
    sys.path.insert(0, str(_ROOT))

from proxy import contract  # noqa: E402
from proxy.compression import DecodeError  # noqa: E402
from proxy.config import PodLabelPair, PodLabelRule  # noqa: E402
from proxy.enrichment import build_plan  # noqa: E402
from proxy.handler import splice_in_parts  # noqa: E402
from proxy.pb.io.prometheus.write.v2 import types_pb2 as pb2  # noqa: E402
from proxy.pb.prometheus import types_pb2 as pb1  # noqa: E402
from proxy.wire.native import Splicer, native_available, split_v1  # noqa: E402
from proxy.wire.plan import LabelLimited, OverLimit, SplicePlan, SpliceResult  # noqa: E402
from proxy.wire.primitives import Protocol, encode_uvarint  # noqa: E402
from tests.wire.snappy_blocks import random_block  # noqa: E402

# -- wire encoding ------------------------------------------------------------------------


#: the proxy's own minimal encoder: what it writes is what a sender writes
varint = encode_uvarint


def varint_padded(n: int, size: int) -> bytes:
    """``n`` as a varint of exactly ``size`` bytes (non-minimal when longer than needed;
    more than 10 bytes is over-long, which every protobuf reader refuses)."""
    out = bytearray()
    for i in range(size):
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if i < size - 1 else 0))
    return bytes(out)


def min_varint_len(n: int) -> int:
    return len(varint(n))


def key(num: int, wt: int) -> bytes:
    return varint(num << 3 | wt)


@dataclass
class Node:
    """One protobuf field: a wire-level tree the generator builds and the poisons edit."""

    num: int
    wt: int
    #: wt 0: the varint's bytes; wt 1 / 5: the fixed bytes; wt 2: bytes or a submessage
    payload: bytes | list[Node]
    #: what the field is, for the poisons: "series", "label", "name", "value", "symbol",
    #: "refs", "data", "unknown", "metadata"
    kind: str = "unknown"
    #: the tag's bytes when not the minimal encoding
    tag: bytes | None = None
    #: the length's bytes (wt 2) when not the minimal encoding of the payload's length
    length: bytes | None = None
    #: the refs of a "refs" node (RW 2.0), for the poisons
    refs: list[int] = field(default_factory=list)


def encode(nodes: Sequence[Node]) -> bytes:
    out = bytearray()
    for n in nodes:
        out += n.tag if n.tag is not None else key(n.num, n.wt)
        if n.wt == 2:
            body = encode(n.payload) if isinstance(n.payload, list) else n.payload
            out += n.length if n.length is not None else varint(len(body))
            out += body
        else:
            assert isinstance(n.payload, bytes)
            out += n.payload
    return bytes(out)


def len_node(num: int, payload: bytes | list[Node], kind: str = "unknown") -> Node:
    return Node(num, 2, payload, kind)


# -- what the requests name ---------------------------------------------------------------

STAMPED = list(contract.STAMPED_LABELS)
PAIR_LABELS = [("exported_namespace", "exported_pod"), ("namespace", "pod"),
               ("pod_namespace", "pod_name")]
#: pairs of long label names: the native splice's name lookup special-cases names of
#: 64 bytes and more
LONG_PAIRS = [("n" * 63, "p" * 64), ("q" * 65, "ü" * 40)]
LONG_1 = "l" * 200  # a length of two varint bytes
LONG_2 = "m" * 17_000  # three varint bytes
UTF8 = ["ü", "日本語", "😀", "\u0800", "\U0010ffff", "\x7f", "a\x00b", "\x0a\x12\x22\x2a"]
NAMESPACES = ["ml", "web", "kube-system", "ns-ü"]
POD_NAMES = ["train-head", "shop-abc", "lonely", "ghost", "gpu-0", "pod-日本", LONG_1[:150]]
PODS = [(ns, pod) for ns in NAMESPACES for pod in POD_NAMES]
CONTAINERS = ["", "main", "nvidia-dcgm-exporter", "dcgm-exporter", "exporter", "exp",
              "exporter2", "xexp", "Exporter"]
OTHER_KARTA = ["karta_", "karta_zzz", "karta_a", "karta_workloadx", "karta_pod_info"]
NAMES = ["__name__", "job", "instance", "a", "zz", "le", "container", "ü名", LONG_1,
         "n" * 62, "p" * 63, "n" * 64, "q" * 66,
         *[n for pair in PAIR_LABELS for n in pair], *STAMPED, *OTHER_KARTA, *UTF8]
METRICS = ["up", "DCGM_FI_DEV_FB_USED", "DCGM_", "DCGM", "dcgm_x", "karta_pod_info",
           "http_requests_total", ""]
VALUES = ["", "x", "0", "ml", "web", "train-head", "ghost", LONG_1, "wl", *UTF8, *METRICS,
          *CONTAINERS, *NAMESPACES, *POD_NAMES]
STAMP_VALUES = ["train", "shop", "head", "RayJob", "ray.io", "0", "1", "ü-wl", "日本", "",
                LONG_1, "x" * 130, "\U0010ffff"]
REASONS = ["no_described_owner", "tombstone", "pod_unknown", "no_pod_label", "r-ü", "x"]
#: the cluster check's labels (``enrich.cluster_label``): the usual one, one a pair or
#: ``unless`` reads too, one shared with generated names, a long one (the name lookup's
#: special case), and values: the plan's, others, a prefix and an extension of it
CLUSTER_LABELS = ["cluster", "namespace", "job", "container", "c" * 70]
CLUSTER_VALUES = ["c1", "c2", "c", "c11", "ü-c", "ml", LONG_1]
#: regexes that are not literal alternations (the native splice calls back into Python)
REGEXES = ["exp.*", "(nvidia-)?dcgm-exporter|exporter|", ".*ü.*", "[a-z]+", "main|"]
#: literal alternations (matched natively)
LITERALS = ["|nvidia-dcgm-exporter|dcgm-exporter|exporter", "main", "|main", "exporter"]
#: byte strings that are not UTF-8: overlong, surrogate, past U+10FFFF, F5+, truncated
BAD_UTF8 = [b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xe0\x9f\xbf", b"\xed\xa0\x80",
            b"\xed\xbf\xbf", b"\xf0\x80\x80\xaf", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80",
            b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xff", b"\xfe", b"\x80", b"\xbf",
            b"\xc2", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc2\x41", b"\xe2\x28\xa1"]


def _samples_v1() -> list[bytes]:
    out = [pb1.Sample(value=v, timestamp=t).SerializeToString()
           for v, t in [(1.5, 1_767_000_000_000), (0.0, 0), (float("nan"), -1), (-2.0, 2**62)]]
    return out


def _exemplars_v1() -> list[bytes]:
    ex = pb1.Exemplar(value=1.0, timestamp=5)
    ex.labels.add(name="trace_id", value="abc")
    return [ex.SerializeToString(), pb1.Exemplar().SerializeToString()]


#: a histogram's repeated fields one value per field (unpacked: legal, and refused by
#: nothing), and an unknown field
UNPACKED_HISTOGRAM = (b"\x08\x01\x48\x04\x48\x01\x51" + bytes(8) + b"\x69" + bytes(8)
                      + b"\x82\x01\x08" + bytes(8) + b"\xa8\x1f\x01")


def _histograms_v1() -> list[bytes]:
    h = pb1.Histogram(count_int=10, sum=3.5, schema=3, zero_threshold=1e-128, zero_count_int=1,
                      timestamp=7)
    h.positive_spans.add(offset=-2, length=2)
    h.positive_deltas.extend([4, -1])
    g = pb1.Histogram(count_float=2.0, schema=-4, reset_hint=pb1.Histogram.GAUGE)
    g.negative_spans.add(offset=1, length=1)
    g.negative_counts.append(2.0)
    g.custom_values.extend([0.5, 1.0])
    return [h.SerializeToString(), g.SerializeToString(), UNPACKED_HISTOGRAM]


def _metadata_v1() -> list[bytes]:
    return [pb1.MetricMetadata(type=pb1.MetricMetadata.COUNTER, metric_family_name="x_total",
                               help="help", unit="s").SerializeToString(),
            pb1.MetricMetadata(metric_family_name="日本").SerializeToString()]


def _samples_v2() -> list[bytes]:
    return [pb2.Sample(value=2.5, timestamp=1_767_000_000_000,
                       start_timestamp=1).SerializeToString(),
            pb2.Sample(value=float("inf")).SerializeToString()]


def _histograms_v2() -> list[bytes]:
    h = pb2.Histogram(count_float=2.0, sum=1.0, schema=0, timestamp=3, start_timestamp=1)
    h.positive_spans.add(offset=0, length=1)
    h.positive_counts.append(2.0)
    return [h.SerializeToString(), UNPACKED_HISTOGRAM]


def _exemplars_v2() -> list[bytes]:
    return [pb2.Exemplar(labels_refs=[0, 0], value=1.0, timestamp=3).SerializeToString()]


def _metadata_v2() -> list[bytes]:
    return [pb2.Metadata(type=pb2.Metadata.METRIC_TYPE_GAUGE, help_ref=0,
                         unit_ref=0).SerializeToString()]


SAMPLES_V1, EXEMPLARS_V1, HISTOGRAMS_V1, METADATA_V1 = (
    _samples_v1(), _exemplars_v1(), _histograms_v1(), _metadata_v1())
SAMPLES_V2, HISTOGRAMS_V2, EXEMPLARS_V2, METADATA_V2 = (
    _samples_v2(), _histograms_v2(), _exemplars_v2(), _metadata_v2())


# -- plans and tables ---------------------------------------------------------------------

Answer = tuple[tuple[str, str], ...] | str


@dataclass
class Setup:
    """A plan and the table contents both implementations get."""

    name: str
    plan: SplicePlan
    answers: list[tuple[bytes, bytes, Answer]]


def random_plan(rnd: random.Random) -> tuple[str, SplicePlan]:
    """A plan as ``build_plan`` makes them: random pairs, rules and conflict policy."""
    pairs = list(PAIR_LABELS)
    rnd.shuffle(pairs)
    pairs = pairs[: rnd.randint(1, 3)]
    if rnd.random() < 0.1:
        pairs.append(("namespace", "pod_name"))
    if rnd.random() < 0.15:
        pairs.insert(rnd.randint(0, len(pairs)), rnd.choice(LONG_PAIRS))
    policy = rnd.choice(["replace", "keep"])
    which = rnd.choice(["default", "none", "regex", "literal", "multi"])
    rules: list[PodLabelRule] | None
    if which == "default":
        rules = None
    elif which == "none":
        rules = []
    else:
        def unless() -> dict[str, str]:
            pool = REGEXES if which == "regex" else LITERALS
            out = {"container": rnd.choice(pool)}
            if which == "multi":
                out[rnd.choice(["job", "a", "ü名", "karta_workload"])] = rnd.choice(
                    REGEXES + LITERALS)
            return out

        rules = [
            PodLabelRule(rnd.choice(["DCGM_", "DCGM", "", "up", "dcgm"]), [
                PodLabelPair("exported_namespace", "exported_pod"),
                PodLabelPair("namespace", "pod", unless()),
            ]),
            PodLabelRule("http", [PodLabelPair("pod_namespace", "pod_name", unless())]),
        ]
    # the TSDB's label limit: mostly none, else small enough for the generated series
    # (a few labels, a pair, a stamp of up to 8) to land at it, under it and past it
    limit = 0 if rnd.random() < 0.6 else rnd.randint(3, 10)
    # the cluster check (enrich.cluster_label against facts.external_labels): on in half
    cluster = ((rnd.choice(CLUSTER_LABELS), rnd.choice(CLUSTER_VALUES))
               if rnd.random() < 0.5 else None)
    name = (f"{policy}/{which}/{'+'.join(p for p, _ in pairs)}/max{limit}"
            f"/{'='.join(cluster or ('nocluster',))[:80]}")
    return name, build_plan(pairs, rules, policy, max_labels_per_series=limit,
                            cluster_check=cluster)


def random_stamp(rnd: random.Random, suffix: str = "") -> tuple[tuple[str, str], ...]:
    """A pod's stamp; ``suffix`` makes its values the pod's own."""
    if rnd.random() < 0.05:
        return ()
    names = rnd.sample(STAMPED, rnd.randint(1, len(STAMPED)))
    if rnd.random() < 0.1:  # a name outside the stamped set: kept next to a sender's
        names.append(rnd.choice(["karta_extra", "a", "job"]))
    if rnd.random() < 0.05:  # a name twice
        names.append(names[0])
    return tuple((n, rnd.choice(STAMP_VALUES) + suffix) for n in names)


def random_answers(rnd: random.Random, pods: Sequence[tuple[str, str]] = PODS, *,
                   unique: bool = False) -> list[tuple[bytes, bytes, Answer]]:
    """Stamps for about half the pods, reasons for a quarter; ``unique``: every pod's
    stamp values and reasons its own (many symbols to add, many reasons to count)."""
    out: list[tuple[bytes, bytes, Answer]] = []
    for i, (ns, pod) in enumerate(pods):
        roll = rnd.random()
        if roll < 0.5:
            out.append((ns.encode(), pod.encode(), random_stamp(rnd, f"-{i}" if unique else "")))
        elif roll < 0.75:
            reason = f"reason-{i}" if unique else rnd.choice(REASONS)
            out.append((ns.encode(), pod.encode(), reason))
    return out


def random_setup(rnd: random.Random, pods: Sequence[tuple[str, str]] = PODS, *,
                 unique: bool = False) -> Setup:
    name, plan = random_plan(rnd)
    return Setup(name, plan, random_answers(rnd, pods, unique=unique))


#: many pods, for requests with many series of distinct stamps
WIDE_PODS = [(f"ns{i % 7}", f"pod-{i}") for i in range(300)]


def splicers(setup: Setup) -> tuple[Splicer, Splicer]:
    """(native, python) splicers of the setup, their tables filled alike."""
    native = Splicer(setup.plan, "native")
    python = Splicer(setup.plan, "python")
    for s in (native, python):
        s.table.update(list(setup.answers))
    return native, python


# -- outcomes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a splice answered: a result, or an error (kind, status)."""

    ok: bool
    body: bytes = b""
    same_object: bool = False
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)
    attributed: int = 0
    unattributed: tuple[tuple[str, int], ...] = ()
    error: tuple[str, Any] = ("", 0)
    #: series that lost a sender's karta_* label
    stripped: int = 0
    #: the first series the stamp would have pushed past the label limit
    label_limited: LabelLimited | None = None
    #: the cluster label's value of the first series of another cluster
    other_cluster: bytes | None = None
    #: a refusal's text, where both splices word it alike (:data:`WORDED`)
    message: str = ""

    def describe(self) -> str:
        if not self.ok:
            return f"error {self.error} {self.message}"
        return (f"ok body={self.body.hex()} same_object={self.same_object} "
                f"counts={self.counts} attributed={self.attributed} "
                f"unattributed={dict(self.unattributed)} stripped={self.stripped} "
                f"label_limited={self.label_limited} other_cluster={self.other_cluster!r}")


#: the refusals both splices word alike, the text compared too: those of a series' labels
#: (naming the series) and of a string that is not UTF-8 (showing it)
WORDED = ("invalid_labels", "invalid_utf8")
#: and a symbol reference past the table (of a series, an exemplar, a metadata: the
#: largest of them named)
WORDED_TEXT = "past the table of"


def worded(exc: DecodeError) -> str:
    """The refusal's text where both splices word it alike (:data:`WORDED`), else ""."""
    return exc.message if exc.kind in WORDED or WORDED_TEXT in exc.message else ""


def outcome(fn: Callable[[bytes], SpliceResult], raw: bytes) -> Outcome:
    """Call a splice; a DecodeError is an outcome, any other exception one too (by type,
    so that it shows up as a disagreement with the other implementation)."""
    try:
        res = fn(raw)
    except DecodeError as exc:
        return Outcome(False, error=(exc.kind, exc.status), message=worded(exc))
    except Exception as exc:  # a bug either way: reported as a disagreement
        return Outcome(False, error=(f"{type(exc).__name__}: {exc}", "not a DecodeError"))
    c = res.counts
    return Outcome(True, res.body, res.body is raw, (c.series, c.samples, c.histograms,
                                                     c.exemplars),
                   res.attributed, tuple(sorted(res.unattributed.items())),
                   stripped=res.stripped, label_limited=res.label_limited,
                   other_cluster=res.other_cluster)


def both(native: Splicer, python: Splicer, version: int, raw: bytes) -> tuple[Outcome, Outcome]:
    if version == 1:
        return outcome(native.splice_v1, raw), outcome(python.splice_v1, raw)
    return outcome(native.splice_v2, raw), outcome(python.splice_v2, raw)


# -- valid requests -----------------------------------------------------------------------


class Gen:
    """Valid RW 1.0 / 2.0 requests as :class:`Node` trees, driven by a ``random.Random``
    (hypothesis' ``st.randoms()`` in the property tests, a seeded one in the fuzzer)."""

    def __init__(self, rnd: random.Random, *, huge: bool = True,
                 pods: Sequence[tuple[str, str]] = PODS,
                 series: tuple[int, int] | None = None) -> None:
        self.r = rnd
        #: allow the 17,000-byte strings (three-byte lengths)
        self.huge = huge
        #: the pods the series name
        self.pods = pods
        #: (least, most) series per request; None: a few (0 to 8)
        self.series = series

    def n_series(self) -> int:
        if self.series is not None:
            return self.r.randint(*self.series)
        return self.r.choice([0, 1, 1, 2, 3, 4, 6, 8])

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def text(self, pool: Sequence[str]) -> str:
        r = self.r
        if self.huge and self.chance(0.01):
            return LONG_2
        if self.chance(0.05):
            return "".join(r.choice([*UTF8, "a", "b", "_"]) for _ in range(r.randint(1, 6)))
        return r.choice(pool)

    def label_set(self) -> list[tuple[bytes, bytes]]:
        """Labels as a sender may send them: mostly naming a pod of the table through one
        of the pairs, sometimes DCGM, sometimes with karta_ labels of its own; unsorted
        and duplicated names now and then."""
        r = self.r
        labels: list[tuple[str, str]] = []
        for _ in range(r.randint(0, 4)):
            labels.append((self.text(NAMES), self.text(VALUES)))
        if self.chance(0.8):
            ns_label, pod_label = r.choice(PAIR_LABELS if self.chance(0.9) else LONG_PAIRS)
            ns, pod = r.choice(self.pods)
            if self.chance(0.05):
                ns, pod = r.choice([("", pod), (ns, ""), ("ml", "nope")])
            labels += [(ns_label, ns), (pod_label, pod)]
            if self.chance(0.2):  # a second pair, maybe of another pod
                ns_label, pod_label = r.choice(PAIR_LABELS)
                ns, pod = r.choice(self.pods)
                labels += [(ns_label, ns), (pod_label, pod)]
        if self.chance(0.3):
            labels.append(("__name__", r.choice(METRICS)))
        if self.chance(0.3):
            labels.append(("container", r.choice(CONTAINERS)))
        if self.chance(0.4):  # an agent's cluster label: the plan's value, another, empty
            labels.append((r.choice(CLUSTER_LABELS), r.choice(["", *CLUSTER_VALUES])))
        if self.chance(0.3):
            for n in r.sample(STAMPED + OTHER_KARTA, r.randint(1, 3)):
                labels.append((n, r.choice(["", "forged", "train", *STAMP_VALUES])))
        # unique names unless a duplicate is asked for: the last one of a name wins
        by_name = dict(labels)
        if all(n.startswith("karta_") or not v for n, v in by_name.items()):
            # none, or only karta_* and empty values, that sender_karta_labels: drop would
            # leave with no label of a value: the poisons no_labels and empty_after_drop
            # make those; here a label with a value (empty values stay next to it)
            by_name[self.text(["a", "job", "instance"])] = self.text(VALUES) or "x"
        out = [(n.encode(), v.encode()) for n, v in by_name.items()]
        roll = r.random()
        if roll < 0.8:
            out.sort()
        elif roll < 0.9:
            r.shuffle(out)
        else:
            out.sort(reverse=True)
        return out  # a repeated or an empty name is invalid: the poisons make those

    def sized_len(self, payload_len: int) -> bytes | None:
        """A non-minimal length now and then, of at most 5 bytes (valid protobuf: the
        generated classes refuse longer ones, the splices take up to 10)."""
        size = min_varint_len(payload_len)
        if size < 5 and self.chance(0.03):
            return varint_padded(payload_len, min(5, size + self.r.randint(1, 3)))
        return None

    def sized_tag(self, num: int, wt: int) -> bytes | None:
        """A non-minimal tag now and then, of at most 5 bytes (a tag is a uint32: the
        generated classes refuse a longer one, the splices take up to 10)."""
        k = num << 3 | wt
        if min_varint_len(k) < 5 and self.chance(0.03):
            return varint_padded(k, min(5, min_varint_len(k) + self.r.randint(1, 2)))
        return None

    def unknown(self, avoid: Sequence[int]) -> Node:
        r = self.r
        num = r.choice([n for n in (1, 2, 3, 4, 5, 6, 7, 15, 16, 100, 2047, 2**29 - 1)
                        if n not in avoid])
        wt = r.choice([0, 1, 2, 5])
        payload: bytes
        if wt == 0:
            payload = varint(r.choice([0, 1, 127, 128, 2**63, 2**64 - 1]))
        elif wt == 1:
            payload = bytes(r.randrange(256) for _ in range(8))
        elif wt == 5:
            payload = bytes(r.randrange(256) for _ in range(4))
        else:
            payload = bytes(r.randrange(256) for _ in range(r.randint(0, 6)))
        return Node(num, wt, payload, "unknown", tag=self.sized_tag(num, wt))

    def finish(self, n: Node) -> Node:
        """Non-minimal tag / length encodings, now and then."""
        if n.tag is None:
            n.tag = self.sized_tag(n.num, n.wt)
        if n.wt == 2 and n.length is None:
            body = encode(n.payload) if isinstance(n.payload, list) else n.payload
            n.length = self.sized_len(len(body))
        return n

    def mix(self, first: list[Node], then: list[Node]) -> list[Node]:
        """``first`` before ``then`` mostly; interleaved sometimes (still valid)."""
        if not self.chance(0.15):
            return first + then
        out = first + then
        self.r.shuffle(out)
        return out

    # RW 1.0

    def label_v1(self, name: bytes, value: bytes) -> Node:
        r = self.r
        fields: list[Node] = [self.finish(len_node(1, name, "name"))]
        if value or self.chance(0.2):
            fields.append(self.finish(len_node(2, value, "value")))
        if self.chance(0.1):
            fields.reverse()
        if self.chance(0.05):  # a decoy name / value first: the last one wins
            fields.insert(0, len_node(r.choice([1, 2]), r.choice(VALUES).encode(), "decoy"))
        if self.chance(0.08):
            fields.insert(r.randint(0, len(fields)), self.unknown((1, 2)))
        return self.finish(len_node(1, fields, "label"))

    def series_v1(self) -> Node:
        r = self.r
        labels = [self.label_v1(n, v) for n, v in self.label_set()]
        data: list[Node] = []
        for _ in range(r.choice([0, 1, 1, 1, 2, 3])):
            data.append(len_node(2, r.choice(SAMPLES_V1), "data"))
        for _ in range(r.choice([0, 0, 0, 1, 2])):
            data.append(len_node(3, r.choice(EXEMPLARS_V1), "data"))
        for _ in range(r.choice([0, 0, 0, 1])):
            data.append(len_node(4, r.choice(HISTOGRAMS_V1), "data"))
        for _ in range(r.choice([0, 0, 0, 0, 1, 2])):
            data.append(self.unknown((1, 2, 3, 4)))
        return self.finish(len_node(1, self.mix(labels, data), "series"))

    def request_v1(self) -> list[Node]:
        r = self.r
        nodes = [self.series_v1() for _ in range(self.n_series())]
        for _ in range(r.choice([0, 0, 1, 2])):
            nodes.insert(r.randint(0, len(nodes)), len_node(3, r.choice(METADATA_V1),
                                                            "metadata"))
        for _ in range(r.choice([0, 0, 0, 1])):
            # (4, 5: RW 2.0's fields, refused as protocol_mismatch)
            nodes.insert(r.randint(0, len(nodes)), self.unknown((1, 3, 4, 5)))
        return nodes

    # RW 2.0

    def request_v2(self) -> list[Node]:
        r = self.r
        sets = [self.label_set() for _ in range(self.n_series())]
        strings = sorted({s for ls in sets for nv in ls for s in nv} - {b""})
        r.shuffle(strings)
        if not strings and self.chance(0.5):
            symbols: list[bytes] = []  # an empty table (only the label-less series use it)
        else:
            symbols = [b""]
            for s in strings:
                symbols.append(s)
                if self.chance(0.1):  # the string again, maybe referenced by either copy
                    symbols.append(s)
            if self.chance(0.15):  # refs above 127 (two-byte varints)
                pad = [f"f{i}".encode() for i in range(r.randint(120, 300))]
                at = r.randint(1, len(symbols))
                symbols[at:at] = pad
            if self.chance(0.1):
                symbols.append(b"")  # "" again
        where: dict[bytes, list[int]] = {}
        for i, s in enumerate(symbols):
            where.setdefault(s, []).append(i)

        series = [self.series_v2(ls, where) for ls in sets]
        syms = [len_node(4, s, "symbol") for s in symbols]
        # mostly: symbols first; sometimes some symbols after the series
        nodes: list[Node]
        if self.chance(0.2):
            nodes = syms + series
            r.shuffle(nodes)
            # a symbol's place among symbols is its ref: keep their relative order
            it = iter(syms)
            nodes = [next(it) if n.kind == "symbol" else n for n in nodes]
        else:
            nodes = syms + series
        for _ in range(r.choice([0, 0, 0, 1, 2])):
            # (1, 3: RW 1.0's fields, refused as protocol_mismatch)
            nodes.insert(r.randint(0, len(nodes)), self.unknown((1, 3, 4, 5)))
        return nodes

    def refs_nodes(self, refs: list[int]) -> list[Node]:
        r = self.r
        roll = r.random()
        if not refs:
            return [Node(1, 2, b"", "refs")] if roll < 0.2 else []
        if roll < 0.75:
            parts = [refs]
        elif roll < 0.9:  # split over two packed fields
            k = r.randint(0, len(refs))
            parts = [refs[:k], refs[k:]]
        else:  # unpacked: one varint field per ref (wire type 0, legal)
            return [Node(1, 0, varint(x), "refs", refs=[x]) for x in refs]
        out = []
        for part in parts:
            enc = b"".join(
                varint_padded(x, min_varint_len(x) + 1) if self.chance(0.03) else varint(x)
                for x in part)
            out.append(self.finish(Node(1, 2, enc, "refs", refs=list(part))))
        return out

    def series_v2(self, labels: list[tuple[bytes, bytes]], where: dict[bytes, list[int]]
                  ) -> Node:
        r = self.r
        refs: list[int] = []
        for n, v in labels:
            refs += [r.choice(where[n]), r.choice(where[v])]
        data: list[Node] = []
        for _ in range(r.choice([0, 1, 1, 2])):
            data.append(len_node(2, r.choice(SAMPLES_V2), "data"))
        for _ in range(r.choice([0, 0, 1])):
            data.append(len_node(3, r.choice(HISTOGRAMS_V2), "data"))
        nsym = sum(len(v) for v in where.values())
        for _ in range(r.choice([0, 0, 1])):
            ex = r.choice(EXEMPLARS_V2) if nsym else pb2.Exemplar(value=1.0).SerializeToString()
            if nsym and self.chance(0.5):  # refs anywhere in the table
                ex = pb2.Exemplar(labels_refs=[r.randrange(nsym) for _ in range(2)],
                                  timestamp=9).SerializeToString()
            data.append(len_node(4, ex, "data"))
        if self.chance(0.3):
            md = r.choice(METADATA_V2)
            if nsym and self.chance(0.5):
                md = pb2.Metadata(type=pb2.Metadata.METRIC_TYPE_COUNTER,
                                  help_ref=r.randrange(nsym),
                                  unit_ref=r.randrange(nsym)).SerializeToString()
            data.append(len_node(5, md, "data"))
        if self.chance(0.1):
            data.append(Node(6, 0, varint(r.choice([0, 1_767_000_000_000])), "data"))
        for _ in range(r.choice([0, 0, 0, 1])):
            data.append(self.unknown((1, 2, 3, 4, 5)))
        refs_nodes = self.refs_nodes(refs)
        fields = self.mix(refs_nodes, data)
        # the refs fields in their order (they are one list: swapped, they pair up wrong)
        it = iter(refs_nodes)
        fields = [next(it) if n.kind == "refs" else n for n in fields]
        return self.finish(len_node(5, fields, "series"))


# -- RW 2.0 requests for the conversion to RW 1.0 ----------------------------------------

#: metric names whose family a metadata type strips (convert.family_name), in every order
#: of the suffixes, some a suffix only, one of each suffix twice
FAMILY_NAMES = ["rpc_seconds_bucket", "rpc_seconds_count", "rpc_seconds_sum", "q_gcount",
                "q_gsum", "q_created", "_bucket", "_sum", "x_gsum_bucket", "x_sum_sum",
                "up", "a_total", "日本_count", "", "rpc_seconds"]
HELPS = ["", "", "latency of an rpc", "ü help", LONG_1, "seconds"]
#: RW 2.0 metric types (0-7) and some no enum has
METRIC_TYPES = [0, 1, 2, 3, 3, 4, 5, 5, 6, 7, 8, 127, 128, 2**32, 2**64 - 1]
#: a histogram's sum as Prometheus' staleness marker (``STALE_NAN_BITS``)
STALE_SUM = struct.pack("<Q", 0x7FF0000000000002)


#: bucket bounds of every shape format_le must write: Go's shortest 'g', exponents past
#: 1e+06 and below 1e-04, negative, zeros, infinities, NaN, subnormals, the largest
NICE_BOUNDS = [0.005, 0.01, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 100.0, 123456.0,
               1e6, 1234567.0, 1e-4, 1e-5, 2.5e-7, 1e21, 0.1 + 0.2, -1.0, -0.0, 0.0,
               float("inf"), float("-inf"), float("nan"), 5e-324, 2.2250738585072014e-308,
               1.7976931348623157e308, 2.0 ** -1000, 2.0 ** 100]


def _bound(r: random.Random) -> float:
    x = r.random()
    if x < 0.5:
        return r.choice(NICE_BOUNDS)
    if x < 0.8:
        return r.uniform(0, 10)
    return float(struct.unpack("<d", struct.pack("<Q", r.getrandbits(64)))[0])


def _custom_buckets(h: Any, r: random.Random) -> None:
    """``h`` as a custom-bucket histogram: bounds of every shape (``_bound``), mostly
    sorted; its buckets mostly inside the bounds (spans of gaps, an absolute first offset,
    empty spans, more or fewer values than the spans hold), else as ``histogram_v2``
    made them (often past the bounds: refused); integer or float counts, now and then
    both (the integer ones count)."""
    h.schema = -53
    bounds = [_bound(r) for _ in range(r.choice([0, 1, 2, 3, 5, 10]))]
    if r.random() < 0.8:
        bounds.sort(key=lambda b: (b != b, b))
    h.custom_values.extend(bounds)
    if r.random() < 0.2:
        return
    for name in ("positive_spans", "positive_deltas", "positive_counts"):
        h.ClearField(name)
    idx = r.randint(0, len(bounds))
    n = 0
    for i in range(r.choice([0, 1, 1, 2, 3])):
        if i:
            gap = r.choice([0, 0, 1, 2])
            if idx + gap > len(bounds):
                break
            idx += gap
        length = r.randint(0, len(bounds) + 1 - idx)
        h.positive_spans.add(offset=idx if i == 0 else gap, length=length)
        idx += length
        n += length
    n = max(0, n + r.choice([0, 0, 0, -1, 1]))
    ints = r.random() < 0.5
    if ints or r.random() < 0.1:
        h.positive_deltas.extend(r.choice([-3, -1, 0, 1, 2, 5, 2**40]) for _ in range(n))
    if not ints or r.random() < 0.1:
        h.positive_counts.extend(r.choice([0.0, 0.5, 2.0, 1e300, -1.0, float("nan")])
                                 for _ in range(n))


#: the ``special`` histograms ``histogram_v2`` makes: custom-bucket data, and staleness
#: markers of every kind (``STALE_KINDS``)
SPECIAL_KINDS = ("custom", "stale", "marker", "custom_stale", "nhcb_marker")
STALE_KINDS = ("stale", "marker", "custom_stale", "nhcb_marker")


def histogram_v2(rnd: random.Random, *, special: str = "") -> bytes:
    """An RW 2.0 Histogram: exponential of any shape (integer or float counts, spans,
    negative buckets, zero bucket, reset hint, start_timestamp, fields repeated or
    unpacked, an unknown field); ``special``: ``custom`` (schema -53, custom_values), or a
    staleness marker (sum the stale NaN, the last sum field): ``stale`` (an exponential
    histogram of any shape so marked), ``marker`` (Prometheus' own: schema 0, no buckets,
    a timestamp, now and then a start_timestamp), ``custom_stale`` (a custom-bucket one,
    its bounds, and buckets that say nothing, past them or not) or ``nhcb_marker`` (schema
    -53, no bounds: it takes those of the data before it in its series)."""
    r = rnd
    if special in ("marker", "nhcb_marker"):
        raw = (b"\x20\x69" if special == "nhcb_marker" else b"") + b"\x19" + STALE_SUM
        raw += b"\x78" + varint(r.choice([0, 7, 1_767_000_000_000, -3]) & (2**64 - 1))
        if r.random() < 0.2:
            raw += b"\x88\x01" + varint(1_766_999_000_000)  # start_timestamp: dropped
        if r.random() < 0.1:  # a packed bounds field with nothing in it: no bounds
            raw += b"\x82\x01\x00"
        return raw
    h = pb2.Histogram(schema=r.choice([-4, -1, 0, 1, 3, 8]), timestamp=r.choice([0, 7, -3]))
    if r.random() < 0.5:
        h.count_int = r.choice([0, 1, 10, 2**40])
        h.positive_deltas.extend(r.choice([-3, 0, 1, 4]) for _ in range(r.randint(0, 4)))
        h.negative_deltas.extend(r.choice([-1, 2]) for _ in range(r.randint(0, 2)))
    else:
        h.count_float = r.choice([0.0, 2.0, 1e300, float("nan")])
        h.positive_counts.extend(r.choice([0.5, 2.0]) for _ in range(r.randint(0, 4)))
        h.negative_counts.extend(r.choice([1.0]) for _ in range(r.randint(0, 2)))
    if r.random() < 0.7:
        h.sum = r.choice([0.0, 1.5, float("nan"), -1e-9, float("inf")])
    if r.random() < 0.3:
        h.zero_threshold = 1e-128
        h.zero_count_int = r.randint(0, 5)
    for _ in range(r.randint(0, 2)):
        h.positive_spans.add(offset=r.randint(-3, 3), length=r.randint(0, 4))
    if r.random() < 0.3:
        h.negative_spans.add(offset=1, length=2)
    h.reset_hint = r.choice([0, 0, 1, 2, 3])
    if r.random() < 0.5:
        h.start_timestamp = r.choice([1, 1_767_000_000_000, -1])
    if special in ("custom", "custom_stale"):
        _custom_buckets(h, r)
    raw = h.SerializeToString()
    if special in ("custom", "custom_stale") and r.random() < 0.15:  # an unpacked bound
        raw += b"\x81\x01" + struct.pack("<d", _bound(r))
    if special in ("stale", "custom_stale"):
        h.ClearField("sum")  # the last sum counts: the marker's, here or after the rest
        raw = h.SerializeToString()
        raw = b"\x19" + STALE_SUM + raw if r.random() < 0.5 else raw + b"\x19" + STALE_SUM
    if r.random() < 0.1:
        raw += r.choice([UNPACKED_HISTOGRAM, b"\xa8\x1f\x01", b"\x88\x01\x05"])
    return raw


def conversion_v2(rnd: random.Random, *, special: bool = False, huge: bool = False,
                  series: tuple[int, int] | None = None,
                  kinds: Sequence[str] = SPECIAL_KINDS) -> list[Node]:
    """A valid RW 2.0 request as the conversion to RW 1.0 sees them: ``Gen.request_v2``'s
    (unpacked / split refs, repeated symbols, unknown fields, created_timestamp, samples
    with start_timestamp, exemplars) with, per series, more: a metric name of a family
    suffix (an extra refs field first or last, so the pairs stay pairs), metadata of every
    type (help and unit empty or not, refs to repeated symbols of equal contents, several
    per series), exponential histograms of every shape. ``special``: some series also get
    custom-bucket histograms or staleness markers (``kinds``: which, of ``SPECIAL_KINDS``;
    at least one in the request; one to four in a series, so markers come before, after
    and between data of their own series), and some of those an ``le`` label of their own
    (the classic series drop it)."""
    r = rnd
    nodes = Gen(r, huge=huge, series=series).request_v2()
    placed = False
    targets = [n for n in nodes if n.kind == "series"]
    if special and not targets:
        targets = _ensure_series(nodes, 2)
    for ser in targets:
        assert isinstance(ser.payload, list)
        ser.length = None
        fields = ser.payload
        if r.random() < 0.6:
            pair = [_add_symbol(nodes, b"__name__"),
                    _add_symbol(nodes, r.choice(FAMILY_NAMES).encode())]
            node = Node(1, 2, b"".join(varint(x) for x in pair), "refs", refs=pair)
            if r.random() < 0.7:
                fields.insert(0, node)
            else:
                fields.append(node)
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            refs = [_add_symbol(nodes, r.choice(HELPS).encode()) for _ in range(2)]
            md = b""
            if r.random() < 0.9:
                md += b"\x08" + varint(r.choice(METRIC_TYPES))
            if r.random() < 0.8:
                md += b"\x18" + varint(refs[0])
            if r.random() < 0.6:
                md += b"\x20" + varint(refs[1])
            if r.random() < 0.1:  # field 2 (no meaning), an unknown field, a type again
                md += r.choice([b"\x12\x01x", b"\x30\x01", b"\x08\x02"])
            fields.insert(r.randint(0, len(fields)), len_node(5, md, "data"))
        for _ in range(r.choice([0, 0, 1, 2])):
            fields.insert(r.randint(0, len(fields)), len_node(3, histogram_v2(r), "data"))
        if special and (not placed or r.random() < 0.3):
            for _ in range(r.choice([1, 1, 2, 3, 4])):
                kind = r.choice(list(kinds))
                fields.insert(r.randint(0, len(fields)),
                              len_node(3, histogram_v2(r, special=kind), "data"))
            if r.random() < 0.2:
                pair = [_add_symbol(nodes, b"le"), _add_symbol(nodes, b"0.5")]
                fields.insert(r.randint(0, len(fields)),
                              Node(1, 2, b"".join(varint(x) for x in pair), "refs",
                                   refs=pair))
            placed = True
    return nodes


# -- invalid requests: poisons (certainly refused) and byte mutations ---------------------

POISONS_COMMON = ["field_number_0", "field_number_big", "group", "wire_type_6_7",
                  "overlong_tag", "overlong_length", "length_past_end", "wrong_wire_type",
                  "bad_utf8", "truncated_tag"]
#: payloads the splice copies, each certainly refused: an 11-byte varint, a varint past
#: 64 bits, a field number past 2^29 - 1, a known field of the wrong wire type, a group
BAD_SAMPLES = [
    bytes.fromhex("09000000000000f03f10") + b"\x80" * 10 + b"\x00",
    bytes.fromhex("09000000000000f03f10") + b"\xff" * 9 + b"\x02",
    bytes.fromhex("09000000000000f03f") + key(2**29, 0) + b"\x01",
    b"\x08\x01",  # the value as a varint
    bytes.fromhex("09000000000000f03f") + b"\x11" + bytes(8),  # the timestamp as fixed64
    b"\x1b",  # a group
]
BAD_HISTOGRAMS = [b"\x08" + b"\x80" * 10 + b"\x00", key(2**30, 0) + b"\x00", b"\x00\x00",
                  b"\x08", b"\x18\x01", b"\x58\x01", b"\x42\x03\x08\x01\x13",
                  b"\x4a\x02\x01\x80", b"\x62\x0b" + b"\x80" * 10 + b"\x00",
                  b"\x6a\x03\x00\x00\x00", b"\x61" + bytes(8), b"\x0d" + bytes(4)]
#: the poisons of the splice's label checks (400 invalid_labels), none a conversion's
LABEL_POISONS = ("dup_name", "empty_name", "no_labels", "empty_after_drop")
POISONS_COMMON += ["bad_sample", "bad_histogram", "bad_exemplar", *LABEL_POISONS]
POISONS_V1 = [*POISONS_COMMON, "bad_exemplar_utf8"]
POISONS_V2 = [*POISONS_COMMON, "odd_refs", "ref_past_table", "symbol_0_not_empty",
              "exemplar_ref_past_table", "exemplar_odd_refs", "metadata_ref_past_table"]


def expected_kind(what: str) -> str:
    """The error kind a poison gets."""
    if what in ("bad_utf8", "bad_exemplar_utf8"):
        return "invalid_utf8"
    if what in LABEL_POISONS:
        return "invalid_labels"
    return "protobuf_invalid"


def _nsym(nodes: list[Node]) -> int:
    return sum(1 for n in nodes if n.kind == "symbol")


def _add_symbol(nodes: list[Node], s: bytes) -> int:
    """Append a symbol after the last one (so no ref moves); its ref."""
    syms = [i for i, n in enumerate(nodes) if n.kind == "symbol"]
    if not syms:
        nodes.insert(0, len_node(4, b"", "symbol"))
        syms = [0]
        if s == b"":
            return 0
    nodes.insert(syms[-1] + 1, len_node(4, s, "symbol"))
    return len(syms)


def _containers(nodes: list[Node], version: int) -> list[tuple[str, list[Node]]]:
    """Every message the splice parses: the request, its series, (1.0) their labels."""
    out: list[tuple[str, list[Node]]] = [("request", nodes)]
    for n in nodes:
        if n.kind == "series" and isinstance(n.payload, list):
            out.append(("series", n.payload))
            if version == 1:
                for lab in n.payload:
                    if lab.kind == "label" and isinstance(lab.payload, list):
                        out.append(("label", lab.payload))
    return out


#: known fields and the wire types they must have, per message
_KNOWN = {
    1: {"request": (1,), "series": (1, 2, 3, 4), "label": (1, 2)},
    2: {"request": (4, 5), "series": (2, 3, 4, 5)},
}


def _ensure_series(nodes: list[Node], version: int) -> list[Node]:
    series = [n for n in nodes if n.kind == "series"]
    if series:
        return series
    n = len_node(1 if version == 1 else 5, [], "series")
    nodes.append(n)
    return [n]


def poison(nodes: list[Node], version: int, what: str, rnd: random.Random) -> None:
    """Make the request certainly invalid, in the way ``what`` names (in place)."""
    r = rnd
    conts = _containers(nodes, version)
    ctx, cont = r.choice(conts)
    at = r.randint(0, len(cont))
    if what == "field_number_0":
        cont.insert(at, Node(0, 0, b"\x01", tag=varint(r.choice([0, 1, 2, 5]))))
    elif what == "field_number_big":
        num = r.choice([2**29, 2**29 + 1, 2**32, 2**61 - 1])
        cont.insert(at, Node(num, 0, b"\x01"))
    elif what == "group":
        cont.insert(at, Node(r.choice([1, 2, 5, 9]), r.choice([3, 4]), b""))
    elif what == "wire_type_6_7":
        cont.insert(at, Node(r.choice([1, 3, 9]), r.choice([6, 7]), b""))
    elif what == "overlong_tag":
        n = Node(r.choice([1, 2, 9]), 0, b"\x00")
        n.tag = r.choice([b"\x80" * 10 + b"\x00",  # 11 bytes
                          b"\xff" * 9 + b"\x02",  # 10 bytes, past 64 bits
                          b"\x8a" + b"\x80" * 9 + b"\x00"])
        cont.insert(at, n)
    elif what == "overlong_length":
        n = len_node(r.choice([1, 9, 15]), b"ab")
        n.length = r.choice([b"\x82" + b"\x80" * 9 + b"\x00", b"\xff" * 9 + b"\x7f"])
        cont.insert(at, n)
    elif what == "length_past_end":
        n = len_node(r.choice([1, 2, 9]), b"abc")
        n.length = varint(3 + r.choice([1, 2, 100, 2**31, 2**63]))
        cont.append(n)  # the last field of its message: nothing follows to absorb it
    elif what == "truncated_tag":
        cont.append(Node(0, 0, b"", tag=r.choice([b"\x80", b"\xff\xff", b"\x8a"])))
    elif what == "wrong_wire_type":
        num = r.choice(_KNOWN[version].get(ctx, (1,)) if ctx in _KNOWN[version]
                       else (1,))
        if ctx not in _KNOWN[version]:
            ctx, cont = conts[0]
            num = r.choice(_KNOWN[version]["request"])
        if version == 2 and ctx == "series" and num == 1:
            wt = r.choice([1, 5])  # labels_refs may be wire type 0 (unpacked)
        else:
            wt = r.choice([0, 1, 5])
        payload = {0: b"\x01", 1: b"\x00" * 8, 5: b"\x00" * 4}[wt]
        cont.insert(r.randint(0, len(cont)), Node(num, wt, payload))
    elif what == "bad_utf8":
        bad = r.choice(BAD_UTF8)
        good = r.choice(["", "a", "ü", "pod-"])
        s = r.choice([bad + good.encode(), good.encode() + bad, b"abc" + bad + b"def"])
        if version == 1:
            series = r.choice(_ensure_series(nodes, 1))
            assert isinstance(series.payload, list)
            if r.random() < 0.5:
                lab = [len_node(1, s, "name"), len_node(2, b"v", "value")]
            else:
                lab = [len_node(1, b"n", "name"), len_node(2, s, "value")]
            series.length = None
            series.payload.insert(r.randint(0, len(series.payload)), len_node(1, lab, "label"))
        else:
            syms = [i for i, n in enumerate(nodes) if n.kind == "symbol"]
            if syms:  # anywhere but first (a bad first symbol is reported either way)
                nodes.insert(r.randint(syms[0] + 1, len(nodes)), len_node(4, s, "symbol"))
            else:
                nodes[0:0] = [len_node(4, b"", "symbol"), len_node(4, s, "symbol")]
    elif what in ("odd_refs", "ref_past_table"):
        nsym = sum(1 for n in nodes if n.kind == "symbol")
        series = r.choice(_ensure_series(nodes, 2))
        assert isinstance(series.payload, list)
        series.length = None
        if what == "odd_refs":
            ref = r.randrange(nsym) if nsym else 0
            series.payload.insert(r.randint(0, len(series.payload)),
                                  Node(1, 0, varint(ref), "refs", refs=[ref]))
            if not nsym:  # an odd count is checked before the table
                pass
        else:
            bad_ref = nsym + r.choice([0, 1, 127, 2**32, 2**63])
            ok = r.randrange(nsym) if nsym else bad_ref
            pair = [bad_ref, ok] if r.random() < 0.5 else [ok, bad_ref]
            series.payload.insert(r.randint(0, len(series.payload)),
                                  Node(1, 2, b"".join(varint(x) for x in pair), "refs",
                                       refs=pair))
    elif what in ("bad_sample", "bad_histogram", "bad_exemplar", "bad_exemplar_utf8",
                  "exemplar_ref_past_table", "exemplar_odd_refs", "metadata_ref_past_table"):
        series = r.choice(_ensure_series(nodes, version))
        assert isinstance(series.payload, list)
        nsym = _nsym(nodes) if version == 2 else 0
        if what == "bad_sample":
            num, payload = 2, r.choice(BAD_SAMPLES)
        elif what == "bad_histogram":
            num, payload = (4 if version == 1 else 3), r.choice(BAD_HISTOGRAMS)
        elif what == "bad_exemplar":  # its value as a varint, or bad framing inside
            num, payload = (3 if version == 1 else 4), r.choice(
                [b"\x10\x01", b"\x18" + b"\x80" * 10 + b"\x00", key(2**29, 2) + b"\x00"])
        elif what == "bad_exemplar_utf8":
            bad = r.choice(BAD_UTF8)
            ex_label = [len_node(1, bad, "name"), len_node(2, b"v", "value")]
            if r.random() < 0.5:
                ex_label = [len_node(1, b"trace_id", "name"), len_node(2, b"x" + bad, "value")]
            num, payload = 3, encode([len_node(1, ex_label, "label")]) + b"\x11" + bytes(8)
        elif what == "exemplar_ref_past_table":
            bad_ref = nsym + r.choice([0, 1, 300, 2**32])
            refs = [bad_ref, 0] if r.random() < 0.5 else [0, bad_ref]
            packed = b"".join(varint(x) for x in refs)
            num, payload = 4, key(1, 2) + varint(len(packed)) + packed
        elif what == "exemplar_odd_refs":
            if not nsym:
                _add_symbol(nodes, b"")
            num, payload = 4, key(1, 2) + b"\x01\x00"
        else:
            which = r.choice([3, 4])
            num, payload = 5, key(which, 0) + varint(nsym + r.choice([0, 1, 2**31]))
        series.length = None
        series.payload.insert(r.randint(0, len(series.payload)), len_node(num, payload, "data"))
    elif what == "no_labels":
        # a series with no label at all (the TSDB answers 500, retried forever): 400
        nodes.insert(r.randint(0, len(nodes)), len_node(1 if version == 1 else 5, [], "series"))
    elif what == "empty_after_drop":
        # karta_* labels and labels of empty values only: once the drop took the karta_*
        # ones, the TSDB reads an empty label set (500, retried forever): 400. Not
        # karta_workload with a value, which conflict_policy: keep lets pass
        karta = sorted({(n.encode(), r.choice([b"x", b"forged", "日本".encode()]))
                        for n in r.sample([*STAMPED, *OTHER_KARTA], r.randint(1, 3))
                        if n != "karta_workload"} | {(b"karta_workload", b"")})
        empty = [(n.encode(), b"") for n in r.sample(["__name__", "a", "zz", "pod", "ü名"],
                                                     r.randint(1, 3))]
        labels = sorted([*karta, *empty]) if r.random() < 0.9 else [*karta, *empty]
        fields: list[Node]
        if version == 1:
            fields = [Node(1, 2, [len_node(1, n, "name"),
                                  *([len_node(2, v, "value")] if v or r.random() < 0.5 else [])],
                           "label") for n, v in labels]
        else:
            refs = [k for n, v in labels for k in (_add_symbol(nodes, n), _add_symbol(nodes, v))]
            fields = [Node(1, 2, b"".join(varint(x) for x in refs), "refs", refs=refs)]
        fields.append(len_node(2, r.choice(SAMPLES_V1 if version == 1 else SAMPLES_V2), "data"))
        series_nodes = [i for i, n in enumerate(nodes) if n.kind == "series"]
        at = r.choice(series_nodes) + r.randint(0, 1) if series_nodes else len(nodes)
        nodes.insert(at, len_node(1 if version == 1 else 5, fields, "series"))
    elif what in ("dup_name", "empty_name"):
        series = r.choice(_ensure_series(nodes, version))
        assert isinstance(series.payload, list)
        series.length = None
        name = b"" if what == "empty_name" else r.choice([b"a", b"pod", b"karta_workload"])
        copies = 1 if what == "empty_name" else 2
        if version == 1:
            for _ in range(copies):
                dup = Node(1, 2, [len_node(1, name, "name"), len_node(2, b"v", "value")],
                           "label")
                series.payload.insert(r.randint(0, len(series.payload)), dup)
        else:
            k = _add_symbol(nodes, name)
            refs = [k, k] * copies
            series.payload.insert(r.randint(0, len(series.payload)),
                                  Node(1, 2, b"".join(varint(x) for x in refs), "refs",
                                       refs=refs))
    elif what == "symbol_0_not_empty":
        first = next((i for i, n in enumerate(nodes) if n.kind == "symbol"), None)
        if first is not None:
            nodes[first] = len_node(4, r.choice([b"x", b"\x00", LONG_1.encode()]), "symbol")
        else:
            nodes.insert(r.randint(0, len(nodes)), len_node(4, b"x", "symbol"))
    else:  # pragma: no cover
        raise ValueError(what)
    # the lengths of the containers around the poison are recomputed by encode()
    for top in nodes:
        if top.kind == "series":
            top.length = None
            if isinstance(top.payload, list):
                for child in top.payload:
                    if child.kind == "label":
                        child.length = None


#: byte mutations a fuzzer applies
MUTATIONS = ["flip_bit", "set_byte", "insert_bytes", "delete_span", "duplicate_span",
             "truncate", "overlong_varint", "huge_varint", "length_edit", "wrong_wire_type",
             "swap_spans", "bad_utf8"]
INTERESTING = [0x00, 0x01, 0x02, 0x05, 0x07, 0x08, 0x0A, 0x12, 0x1A, 0x22, 0x2A, 0x7F, 0x80,
               0x81, 0xC0, 0xED, 0xF5, 0xFF]


def _length_positions(raw: bytes) -> list[tuple[int, int, int]]:
    """(position of the length varint, its size, its value) of every length-delimited
    field found by a lenient walk that descends into every payload that parses."""
    out: list[tuple[int, int, int]] = []

    def walk(p: int, end: int, depth: int) -> bool:
        while p < end:
            k, q = _rd(raw, p, end)
            if k is None:
                return False
            wt = k & 7
            if wt == 2:
                ln, s = _rd(raw, q, end)
                if ln is None or s + ln > end:
                    return False
                out.append((q, s - q, ln))
                if depth < 3:
                    walk(s, s + ln, depth + 1)
                p = s + ln
            elif wt == 0:
                _, q2 = _rd(raw, q, end)
                if _ is None:
                    return False
                p = q2
            elif wt in (1, 5):
                p = q + (8 if wt == 1 else 4)
            else:
                return False
        return p == end

    walk(0, len(raw), 0)
    return out


def _rd(buf: bytes, p: int, end: int) -> tuple[int | None, int]:
    v = 0
    for i in range(10):
        if p >= end:
            return None, p
        b = buf[p]
        p += 1
        v |= (b & 0x7F) << (7 * i)
        if b < 0x80:
            return v, p
    return None, p


def mutate(raw: bytes, rnd: random.Random, corpus: Sequence[bytes] = ()) -> bytes:
    """One random byte-level mutation."""
    r = rnd
    b = bytearray(raw)
    n = len(b)
    what = r.choice(MUTATIONS)
    pos = r.randint(0, n)
    if what == "flip_bit" and n:
        b[pos % n] ^= 1 << r.randrange(8)
    elif what == "set_byte" and n:
        b[pos % n] = r.choice(INTERESTING) if r.random() < 0.7 else r.randrange(256)
    elif what == "insert_bytes":
        b[pos:pos] = bytes(r.choice(INTERESTING) if r.random() < 0.5 else r.randrange(256)
                           for _ in range(r.randint(1, 4)))
    elif what == "delete_span" and n:
        b[pos:pos + r.randint(1, 8)] = b""
    elif what == "duplicate_span" and n:
        a = r.randrange(n)
        span = b[a:a + r.randint(1, 32)]
        b[pos:pos] = span
    elif what == "swap_spans" and corpus:
        other = r.choice(corpus)
        a = r.randint(0, len(other))
        b[pos:pos + r.randint(0, 16)] = other[a:a + r.randint(1, 64)]
    elif what == "truncate":
        del b[pos:]
    elif what == "overlong_varint":
        b[pos:pos] = b"\x80" * r.choice([9, 10, 11]) + b"\x00"
    elif what == "huge_varint":
        b[pos:pos] = r.choice([b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x7f",
                               varint(2**29 << 3), varint(2**32 - 1), varint(2**31)])
    elif what == "length_edit":
        lens = _length_positions(raw)
        if lens:
            at, size, ln = r.choice(lens)
            new = max(0, ln + r.choice([-3, -2, -1, 1, 2, 3, 127, 128, 2**14, 2**31]))
            enc = varint(new) if r.random() < 0.8 else varint_padded(new, r.randint(
                min_varint_len(new), 11))
            b[at:at + size] = enc
    elif what == "wrong_wire_type":
        b[pos:pos] = key(r.choice([1, 2, 3, 4, 5]), r.choice([0, 1, 3, 4, 5, 6, 7]))
    elif what == "bad_utf8":
        b[pos:pos] = r.choice(BAD_UTF8)
    return bytes(b)


# -- the fuzzer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """The input a crash file holds: a request, and the sender's block when the call was
    the output as a snappy block made from it (``splice_snappy``)."""

    version: int
    setup: int
    raw: bytes
    block: bytes | None


class CrashFile:
    """The input about to be spliced, in an mmap'd file: it survives a segfault."""

    HEAD = struct.Struct("<IIQQ")  # protocol, setup index, request length, block length + 1
    SIZE = 1 << 23

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.SIZE)
            self.map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)

    def record(self, version: int, setup: int, raw: bytes, block: bytes | None = None
               ) -> None:
        room = (self.SIZE - self.HEAD.size) // 2
        n = min(len(raw), room)
        m = min(len(block), room) if block is not None else -1
        self.HEAD.pack_into(self.map, 0, version, setup, n, m + 1)
        self.map[self.HEAD.size:self.HEAD.size + n] = raw[:n]
        if block is not None:
            at = self.HEAD.size + n
            self.map[at:at + m] = block[:m]

    def remove(self) -> None:
        """A run that ends on its own has nothing to leave behind."""
        self.map.close()
        self.path.unlink(missing_ok=True)

    @classmethod
    def read(cls, path: Path) -> Recorded | None:
        data = path.read_bytes()
        if len(data) < cls.HEAD.size:
            return None
        version, setup, n, m = cls.HEAD.unpack_from(data, 0)
        if version == 0:
            return None
        at = cls.HEAD.size + n
        return Recorded(version, setup, data[cls.HEAD.size:at],
                        data[at:at + m - 1] if m else None)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: the series of a "many" seed: past 12, the fill of _splice.c's RW 1.0 pipeline (3 x
#: LEAD series in flight), where its steady state starts (stage B's second probe, stage C
#: and the limit check inside the walk); and past 32 metadata strings, where the RW 2.0
#: conversion's tables first grow. With 0-8 series a seed, a fuzz run never got there
#: (gcov: those lines never ran in a 100 s run)
MANY_SERIES = (13, 48)


def build_corpus(rnd: random.Random, size: int) -> list[tuple[int, bytes]]:
    """(protocol, request) seeds: generated valid requests of both protocols (one in ten
    of many series), plus a few fixed edge cases."""
    few = Gen(rnd, huge=False)
    many = Gen(rnd, huge=False, series=MANY_SERIES)
    out: list[tuple[int, bytes]] = [(1, b""), (2, b""), (1, b"\x0a\x00"), (2, b"\x2a\x00"),
                                    (2, b"\x22\x00\x2a\x00")]
    while len(out) < size:
        gen = many if rnd.random() < 0.1 else few
        roll = rnd.random()
        if roll < 0.45:
            out.append((1, encode(gen.request_v1())))
        elif roll < 0.8:
            out.append((2, encode(gen.request_v2())))
        else:  # what the conversion to RW 1.0 must get right (and leave to the reference)
            out.append((2, encode(conversion_v2(rnd, special=rnd.random() < 0.2,
                                                series=gen.series))))
    return out


#: the crash file's protocol of an input being converted to RW 1.0 (not spliced)
CONVERTING = 4


def conversion_mismatch(raw: bytes, compare: bool) -> str | None:
    """The native RW 2.0 -> 1.0 conversion of ``raw``: its size, then its bytes at that
    size; with ``compare``, held to the reference (the same size, counts and bytes, or
    left to it: always where the reference refuses). What went wrong, or None."""
    from proxy.wire import _splice
    from proxy.wire.convert import v1_form, v2_to_v1

    size = _splice.convert_v2(raw)
    if size is not None and not isinstance(size, int):
        return f"a count of {size!r}: input {raw.hex()}"
    out = None if size is None else _splice.convert_v2(raw, size)
    if size is not None and (not isinstance(out, bytes) or len(out) != size):
        return f"counted {size} bytes, made {out!r}: input {raw.hex()}"
    if not compare:
        return None
    try:
        ref, form = v2_to_v1(raw), v1_form(raw)
    except DecodeError as e:
        if size is not None:
            return f"converted what the reference refuses ({e.kind}): input {raw.hex()}"
        return None
    if size is not None and (out != ref or size != form.size):
        return (f"native {size} bytes {out!r}, reference {form.size} bytes {ref!r}: "
                f"input {raw.hex()}")
    counted = _splice.convert_v2_form(raw)
    if size is not None and counted != (form.size, form.histograms, form.samples):
        return f"native counts {counted!r}, reference {form!r}: input {raw.hex()}"
    return None


def fixed_setups(seed: int) -> list[Setup]:
    """Plans and tables the fuzzer cycles through: the product's default plan under both
    policies, no rules, a regex unless (the Python callback), a label limit the generated
    series reach, the cluster check under both policies, and random ones."""
    rnd = random.Random(seed ^ 0x5EED)
    answers = random_answers(rnd)
    default_replace = build_plan(PAIR_LABELS, None, "replace")
    default_keep = build_plan(PAIR_LABELS, None, "keep")
    no_rules = build_plan(PAIR_LABELS, [], "replace")
    regex = build_plan(PAIR_LABELS, [PodLabelRule("DCGM_", [
        PodLabelPair("exported_namespace", "exported_pod"),
        PodLabelPair("namespace", "pod", {"container": "exp.*"}),
    ])], "replace")
    limited = build_plan(PAIR_LABELS, None, "replace", max_labels_per_series=6)
    cluster = build_plan(PAIR_LABELS, None, "replace", max_labels_per_series=6,
                         cluster_check=("cluster", "c1"))
    cluster_keep = build_plan(PAIR_LABELS, None, "keep", cluster_check=("cluster", "c1"))
    out = [Setup("default/replace", default_replace, answers),
           Setup("default/keep", default_keep, answers),
           Setup("no-rules", no_rules, random_answers(rnd)),
           Setup("regex-unless", regex, answers),
           Setup("label-limit-6", limited, answers),
           Setup("cluster-c1", cluster, answers),
           Setup("cluster-c1/keep", cluster_keep, answers)]
    for _ in range(4):
        out.append(random_setup(rnd))
    return out


def report_disagreement(version: int, setup: Setup, raw: bytes, nat: Outcome, py: Outcome
                        ) -> None:
    print("DISAGREEMENT", file=sys.stderr)
    print(f"  protocol: RW {'1.0' if version == 1 else '2.0'}", file=sys.stderr)
    print(f"  setup: {setup.name}", file=sys.stderr)
    print(f"  input ({len(raw)} bytes): {raw.hex()}", file=sys.stderr)
    print(f"  native: {nat.describe()}", file=sys.stderr)
    print(f"  python: {py.describe()}", file=sys.stderr)


def _splice_all(splicers_: list[Splicer], inputs: list[tuple[int, bytes]], rounds: int
                ) -> None:
    """Every input through every splicer, ``rounds`` times (no reference kept)."""
    for _ in range(rounds):
        for sp in splicers_:
            for version, raw in inputs:
                with contextlib.suppress(DecodeError):
                    (sp.splice_v1 if version == 1 else sp.splice_v2)(raw)


#: a reference count that says "an interpreter-wide singleton", not one of our inputs
SHARED_REFCOUNT = 1_000_000


def leak_check(setups: list[Setup], corpus: list[tuple[int, bytes]], rnd: random.Random,
               calls: int, limit_mb: float) -> bool:
    """A fixed set of inputs (valid, mutated, errors; both protocols; all setups), each
    call on a fresh bytes object; RSS after a warm-up vs at the end, and the reference
    counts of the inputs, plans, tables and reason strings."""
    pairs = [splicers(s)[0] for s in setups]
    inputs: list[tuple[int, bytes]] = []
    for version, raw in corpus[:200]:
        inputs.append((version, raw))
        inputs.append((version, mutate(raw, rnd)))
    ok = True
    # reference counts: the same objects spliced many times. Not the interpreter's shared
    # bytes (b"" and the one-byte singletons, a refcount in the billions): anything else
    # in the process that drops a reference to them moves their count, which once failed
    # this check (1000008032 -> 1000008031) with no leak in the splice
    probed = [(v, raw) for v, raw in inputs[:50] if sys.getrefcount(raw) < SHARED_REFCOUNT]
    probe = [raw for _, raw in probed]
    before = [sys.getrefcount(x) for x in probe]
    reason_objs = []
    for s, sp in zip(setups, pairs, strict=True):
        for ns, pod, ans in s.answers:
            if isinstance(ans, str):
                reason_objs.append(sp.table.get(ns, pod))
                break
    reasons_before = [sys.getrefcount(x) for x in reason_objs]
    tables_before = [sys.getrefcount(sp.table) for sp in pairs]
    _splice_all(pairs, probed, 20)
    after = [sys.getrefcount(x) for x in probe]
    if after != before:
        print(f"LEAK: input reference counts grew: {before} -> {after}", file=sys.stderr)
        ok = False
    reasons_after = [sys.getrefcount(x) for x in reason_objs]
    if reasons_after != reasons_before:
        print(f"LEAK: reason reference counts grew: {reasons_before} -> {reasons_after}",
              file=sys.stderr)
        ok = False
    if [sys.getrefcount(sp.table) for sp in pairs] != tables_before:
        print("LEAK: table reference counts grew", file=sys.stderr)
        ok = False

    blocks = [bytes(cramjam.snappy.compress_raw(raw)) for _, raw in inputs]

    def run(n: int) -> None:
        k = 0
        while k < n:
            for sp in pairs:
                for (version, raw), block in zip(inputs, blocks, strict=True):
                    fresh = bytes(bytearray(raw))
                    if version == 2 and k % 3 == 0:
                        conversion_mismatch(fresh, False)
                    fn = sp.splice_v1 if version == 1 else sp.splice_v2
                    with contextlib.suppress(DecodeError):
                        if k % 2:
                            fn(fresh)
                        else:  # the output as a snappy block made from the sender's
                            sp.splice_snappy(Protocol.V1 if version == 1 else Protocol.V2,
                                             fresh, block)
                    k += 1
                    if k >= n:
                        return

    run(min(calls // 5, 50_000))  # warm-up: allocator pools and caches settle
    gc.collect()
    rss0 = rss_bytes()
    run(calls)
    gc.collect()
    rss1 = rss_bytes()
    growth = (rss1 - rss0) / 2**20
    print(f"leak check: {calls} calls, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MB "
          f"({growth:+.2f} MB, limit {limit_mb} MB)")
    if growth > limit_mb:
        print(f"LEAK: RSS grew by {growth:.1f} MB over {calls} calls", file=sys.stderr)
        ok = False
    return ok


def sender_block(raw: bytes, rnd: random.Random) -> bytes:
    """A block that decodes to ``raw`` as a sender might write it: cramjam's encoder
    (python-snappy, Rust senders), or elements of any shape (``snappy_blocks``: long
    literal tags, copy-4, overlapping and 1-3 byte copies, offsets far back)."""
    if rnd.random() < 0.5:
        return bytes(cramjam.snappy.compress_raw(raw))
    return random_block(raw, rnd)


def _decodes_to(block: bytes, raw: bytes) -> bool:
    try:
        return bool(snappy.uncompress(block) == raw)
    except Exception:  # any refusal: not a block of raw
        return False


def edit_mismatch(native: Splicer, version: int, raw: bytes, body: bytes,
                  rnd: random.Random, *, pieces: int = 0, block: bytes | None = None,
                  record: Callable[[bytes], None] | None = None) -> str | None:
    """The output as a snappy block made from the sender's (``_snappy_edit.c``): a block
    that decodes to ``raw`` must give one that decodes to ``body``, whole and, for RW 1.0
    with ``pieces``, in that many parts at their offsets joined as the handler joins them;
    a damaged block must never crash (it is used or not). ``block``: this one (a replay),
    checked as a true block when it decodes to ``raw``; ``record`` is told the block
    before the native calls. What went wrong, or None."""
    protocol = Protocol.V1 if version == 1 else Protocol.V2
    if block is None:
        true_block = sender_block(raw, rnd)
        block = mutate(true_block, rnd) if rnd.random() < 0.3 else true_block
    else:
        true_block = block if _decodes_to(block, raw) else b""
    if record is not None:
        record(block)
    try:
        edited = native.splice_snappy(protocol, raw, block)
    except DecodeError as e:
        return f"refused ({e.kind}): input {raw.hex()}, block {block.hex()}"
    if block != true_block:
        return None
    if snappy.uncompress(edited.body) != body:
        return f"whole: input {raw.hex()}, block {block.hex()}"
    cuts = split_v1(raw, pieces) if version == 1 and pieces > 1 else []
    if cuts:
        # the handler's own way: the first part here, the others on a thread, joined
        _, joined = splice_in_parts(
            raw, block, cuts, functools.partial(native.splice_snappy, protocol), _PARTS)
        if snappy.uncompress(joined) != body:
            return f"in parts at {cuts}: input {raw.hex()}, block {block.hex()}"
    return None


def limit_mismatch(native: Splicer, version: int, raw: bytes, whole: Outcome,
                   rnd: random.Random) -> str | None:
    """The splice under a limit (``Splicer.splice_v1``'s ``limit`` and ``grow``): stopped
    at any point of its walk, granted more or refused it at random, it must answer the
    same as without a limit or ``OverLimit``, never anything else. What went wrong, or
    None."""
    limit = rnd.choice([0, 1, 64, rnd.randrange(1, 4 * len(raw) + 2)])

    def grow(need: int) -> int:
        return need + rnd.randrange(0, need + 1) if rnd.random() < 0.7 else 0

    splice = native.splice_v1 if version == 1 else native.splice_v2
    got = outcome(lambda r: splice(r, limit, grow), raw)
    if not got.ok and str(got.error[0]).startswith(f"{OverLimit.__name__}:"):
        return None
    if got != whole:
        return f"limit {limit}: {got.describe()} against {whole.describe()}, input {raw.hex()}"
    return None


#: the thread the parts of an edit after the first run on, as in the handler's part pool
_PARTS = ThreadPoolExecutor(1, thread_name_prefix="fuzz-part")


def fuzz(args: argparse.Namespace) -> int:
    rnd = random.Random(args.seed)
    setups = fixed_setups(args.seed)
    pairs = [splicers(s) for s in setups]
    corpus = build_corpus(rnd, args.corpus)
    crash = CrashFile(Path(args.crash_file))
    seeds = [raw for _, raw in corpus]
    print(f"fuzz: seed {args.seed}, {len(corpus)} seeds, {len(setups)} setups, "
          f"{args.seconds:g} s, crash file {args.crash_file}", flush=True)

    start = time.monotonic()
    deadline = start + args.seconds
    iterations = compared = errors = changed = edits = converted = 0
    rss_warm: int | None = None
    warm_at = max(1000, min(20_000, args.max_iterations // 10))
    kinds: dict[str, int] = {}
    while iterations < args.max_iterations:
        if iterations % 256 == 0 and time.monotonic() > deadline:
            break
        version, base = corpus[rnd.randrange(len(corpus))]
        raw = base
        for _ in range(rnd.choice([0, 1, 1, 1, 1, 2, 3, 5])):
            raw = mutate(raw, rnd, seeds)
        if rnd.random() < 0.05:  # the other protocol's parser on these bytes
            version = 3 - version
        si = rnd.randrange(len(setups))
        native, python = pairs[si]
        crash.record(version, si, raw)
        nat = outcome(native.splice_v1 if version == 1 else native.splice_v2, raw)
        iterations += 1
        if not nat.ok:
            errors += 1
            kinds[str(nat.error[0])] = kinds.get(str(nat.error[0]), 0) + 1
            if nat.error[1] == "not a DecodeError":
                report_disagreement(version, setups[si], raw, nat, Outcome(False))
                return 1
        elif not nat.same_object:
            changed += 1
        if nat.ok and iterations % args.edit_every == 0:
            edits += 1
            wrong = edit_mismatch(native, version, raw, nat.body, rnd,
                                  pieces=rnd.randint(2, 4) if rnd.random() < 0.25 else 0,
                                  record=functools.partial(crash.record, version, si, raw))
            if wrong is not None:
                print(f"EDIT MISMATCH: RW {version}.0, setup {setups[si].name}, {wrong}",
                      file=sys.stderr)
                return 1
        if nat.ok and rnd.random() < 0.05:
            wrong = limit_mismatch(native, version, raw, nat, rnd)
            if wrong is not None:
                print(f"LIMIT MISMATCH: RW {version}.0, setup {setups[si].name}, {wrong}",
                      file=sys.stderr)
                return 1
        if version == 2:
            crash.record(CONVERTING, si, raw)
            wrong = conversion_mismatch(raw, iterations % args.compare_every == 0)
            converted += 1
            if wrong is not None:
                print(f"CONVERSION MISMATCH: {wrong}", file=sys.stderr)
                return 1
        if iterations % args.compare_every == 0 or (nat.ok and rnd.random() < 0.02):
            py = outcome(python.splice_v1 if version == 1 else python.splice_v2, raw)
            compared += 1
            if py != nat:
                report_disagreement(version, setups[si], raw, nat, py)
                return 1
        # valid mutants grow the corpus (bounded; replaced at random once full)
        if nat.ok and len(raw) <= 4096 and rnd.random() < 0.05:
            if len(corpus) < args.corpus * 4:
                corpus.append((version, raw))
            else:
                corpus[rnd.randrange(args.corpus, len(corpus))] = (version, raw)
        if iterations == warm_at:
            gc.collect()
            rss_warm = rss_bytes()
    crash.remove()
    elapsed = time.monotonic() - start
    gc.collect()
    rss_end = rss_bytes()
    print(f"fuzz: {iterations} iterations in {elapsed:.1f} s ({iterations / elapsed:,.0f}/s), "
          f"{compared} compared with the Python splice, {edits} as snappy blocks, "
          f"{converted} converted to RW 1.0, "
          f"{changed} changed bodies, "
          f"{errors} refused: {dict(sorted(kinds.items()))}", flush=True)
    ok = True
    if rss_warm is not None:
        growth = (rss_end - rss_warm) / 2**20
        print(f"fuzz: RSS after warm-up {rss_warm / 2**20:.1f} MB, at the end "
              f"{rss_end / 2**20:.1f} MB ({growth:+.2f} MB)")
        if growth > args.rss_limit_mb:
            print(f"LEAK: RSS grew by {growth:.1f} MB during the fuzz run", file=sys.stderr)
            ok = False
    if args.leak_calls:
        ok = leak_check(setups, corpus, rnd, args.leak_calls, args.leak_limit_mb) and ok
    print("fuzz: OK" if ok else "fuzz: FAILED", flush=True)
    return 0 if ok else 1


def replay(args: argparse.Namespace) -> int:
    got = CrashFile.read(Path(args.replay))
    if got is None:
        print("replay: the file holds no input")
        return 0
    version, raw = got.version, got.raw
    if version == CONVERTING:
        print(f"replay: RW 2.0 -> 1.0, input {raw.hex()}", flush=True)
        wrong = conversion_mismatch(raw, True)
        print(f"conversion: {wrong or 'OK'}", flush=True)
        return 1 if wrong else 0
    setups = fixed_setups(args.seed)
    native, python = splicers(setups[got.setup])
    print(f"replay: RW {version}.0, setup {setups[got.setup].name}, input {raw.hex()}",
          flush=True)
    py = outcome(python.splice_v1 if version == 1 else python.splice_v2, raw)
    print(f"python: {py.describe()}", flush=True)
    nat = outcome(native.splice_v1 if version == 1 else native.splice_v2, raw)
    print(f"native: {nat.describe()}", flush=True)
    if nat != py:
        return 1
    if got.block is not None and nat.ok:
        print(f"replay: the edit of block {got.block.hex()}", flush=True)
        for pieces in (0, 2, 3, 4):  # whole, and in parts as the run may have cut it
            wrong = edit_mismatch(native, version, raw, nat.body, random.Random(args.seed),
                                  pieces=pieces, block=got.block)
            if wrong:
                print(f"edit: {wrong}", flush=True)
                return 1
        print("edit: OK", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0,
                   help="time budget of the fuzz loop (the leak check runs after it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-iterations", type=int, default=50_000_000)
    p.add_argument("--corpus", type=int, default=400, help="generated seed requests")
    p.add_argument("--compare-every", type=int, default=8,
                   help="splice every n-th input with the Python reference too")
    p.add_argument("--edit-every", type=int, default=4,
                   help="splice every n-th valid input to a snappy block too (_snappy_edit.c)")
    p.add_argument("--rss-limit-mb", type=float, default=20.0,
                   help="RSS growth allowed from the warm-up to the end of the fuzz loop")
    p.add_argument("--leak-calls", type=int, default=200_000,
                   help="calls of the fixed-input leak check (0: skip it)")
    p.add_argument("--leak-limit-mb", type=float, default=8.0,
                   help="RSS growth allowed over the leak check")
    p.add_argument("--crash-file", default=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"karta-fuzz-native-{os.getpid()}.bin"))
    p.add_argument("--replay", help="re-run the input a crash file holds")
    args = p.parse_args(argv)
    if not native_available():
        print("the native splice is not built", file=sys.stderr)
        return 2
    if args.replay:
        return replay(args)
    return fuzz(args)


if __name__ == "__main__":
    sys.exit(main())
