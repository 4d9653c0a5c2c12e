"""Generated remote-write requests, valid and broken, for the fuzz run against a real proxy.

Each case is one HTTP request: a body (already compressed, or deliberately not), its
headers, and what is known of it: ``valid`` cases must be stored (2xx and every series
forwarded); the rest may be refused, but only with a 4xx. Cases come from a seeded
``random.Random``, so a failure names a seed and a case number that reproduce it.

Families: compression (snappy, zstd, truncated, flipped, mislabelled, bombs), protobuf
framing (flipped and truncated fields, over-long varints, huge field numbers, wrong wire
types), label semantics (unsorted, duplicated, empty, invalid UTF-8, sender ``karta_*``
labels, pod labels twice), RW 2.0 refs (past the table, odd, a non-empty first symbol,
exemplar and metadata refs) and the two protocols' bodies under each other's Content-Type.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import cramjam
import snappy

from proxy.wire.primitives import encode_uvarint, len_field

CT_V1 = "application/x-protobuf"
CT_V2 = "application/x-protobuf;proto=io.prometheus.write.v2.Request"
#: the value of every ``karta_*`` label a case forges: it must never reach the upstream
FORGED = "forged-by-sender"


@dataclass(slots=True)
class Case:
    family: str
    body: bytes
    headers: dict[str, str]
    #: a well-formed request: must be answered 2xx with all its series forwarded
    valid: bool = False
    #: series and samples in a valid request
    series: int = 0
    samples: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SeriesSpec:
    """One series as generated: labels in wire order (maybe unsorted), samples."""

    labels: list[tuple[str, str]]
    samples: list[tuple[int, float]]
    exemplar: list[tuple[str, str]] | None = None


class Generator:
    def __init__(self, seed: int, pods: list[tuple[str, str]], now_ms: int) -> None:
        self.r = random.Random(seed)
        self.pods = pods
        self.now_ms = now_ms

    # -- series ---------------------------------------------------------------------------

    def _name(self) -> str:
        return self.r.choice(["container_cpu_usage_seconds_total",
                              "container_memory_working_set_bytes", "DCGM_FI_DEV_GPU_UTIL",
                              "kube_pod_info", "up", "node_load1"])

    def good_series(self) -> SeriesSpec:
        r = self.r
        labels = {"__name__": self._name(), "job": r.choice(["kubelet", "dcgm", "node"])}
        roll = r.random()
        if roll < 0.6:
            ns, pod = r.choice(self.pods)
            labels.update(namespace=ns, pod=pod, container=r.choice(["app", "POD", "sidecar"]))
        elif roll < 0.75:
            labels.update(namespace="ghost", pod=f"gone-{r.randrange(1000)}")
        elif roll < 0.85:
            ns, pod = r.choice(self.pods)
            labels.update(exported_namespace=ns, exported_pod=pod, namespace="monitoring",
                          pod="dcgm-exporter-abcde", container="dcgm-exporter")
        if r.random() < 0.2:
            # a sender's own karta_* labels: forged, whatever the series is
            labels[r.choice(["karta_workload", "karta_kind", "karta_component",
                             "karta_zzz_extra", "karta_namespace"])] = FORGED
        if r.random() < 0.3:
            labels["instance"] = f"10.0.{r.randrange(256)}.{r.randrange(256)}:10250"
        n = r.choice([1, 1, 1, 2, 5])
        samples = [(self.now_ms - 60_000 + i * 1000, r.uniform(-1e6, 1e6)) for i in range(n)]
        exemplar = [("trace_id", f"{r.getrandbits(64):016x}")] if r.random() < 0.1 else None
        return SeriesSpec(sorted(labels.items()), samples, exemplar)

    def bad_labels(self, spec: SeriesSpec) -> tuple[SeriesSpec, str]:
        r = self.r
        labels = list(spec.labels)
        how = r.choice(["unsorted", "duplicate", "empty_name", "empty_value", "bad_utf8_value",
                        "bad_utf8_name", "pod_twice", "no_name", "many"])
        if how == "unsorted" and len(labels) > 2:
            labels.reverse()
        elif how == "duplicate":
            labels.append(labels[-1])
            labels.sort()
        elif how == "empty_name":
            labels.insert(0, ("", "x"))
        elif how == "empty_value":
            labels.append(("zz_empty", ""))
        elif how in ("bad_utf8_value", "bad_utf8_name"):
            i = r.randrange(len(labels))
            k, v = labels[i]
            labels[i] = (k + "\udcff", v) if how == "bad_utf8_name" else (k, v + "\udcff")
        elif how == "pod_twice":
            _, pod = r.choice(self.pods)
            labels += [("pod", pod), ("pod", pod + "-x")]
            labels.sort(key=lambda kv: kv[0])
        elif how == "no_name":
            labels = [kv for kv in labels if kv[0] != "__name__"]
        elif how == "many":
            labels += [(f"l{i:04d}", "v") for i in range(r.choice([50, 1200]))]
            labels.sort()
        return SeriesSpec(labels, spec.samples, spec.exemplar), how

    # -- bodies ---------------------------------------------------------------------------

    @staticmethod
    def _s(text: str) -> bytes:
        return text.encode("utf-8", "surrogateescape")

    def body_v1(self, specs: list[SeriesSpec]) -> bytes:
        out = bytearray()
        for spec in specs:
            ts = bytearray()
            for k, v in spec.labels:
                kb, vb = self._s(k), self._s(v)
                lab = len_field(1, kb) + len_field(2, vb)
                ts += len_field(1, lab)
            for t, val in spec.samples:
                ts += len_field(2, _sample(val, t))
            if spec.exemplar:
                ex = bytearray()
                for k, v in spec.exemplar:
                    ex += len_field(1, len_field(1, self._s(k)) + len_field(2, self._s(v)))
                ex += b"\x11" + bytes(8) + b"\x18\x01"  # value 0.0, timestamp 1
                ts += len_field(3, bytes(ex))
            out += len_field(1, bytes(ts))
        return bytes(out)

    def body_v2(self, specs: list[SeriesSpec], *, break_refs: str = "") -> bytes:
        symbols: list[bytes] = [b""]
        index: dict[bytes, int] = {b"": 0}

        def ref(s: str) -> int:
            b = self._s(s)
            if b not in index:
                index[b] = len(symbols)
                symbols.append(b)
            return index[b]

        series = bytearray()
        for spec in specs:
            refs = [ref(x) for kv in spec.labels for x in kv]
            ex_refs = [ref(x) for kv in spec.exemplar for x in kv] if spec.exemplar else []
            meta = [ref("help text"), ref("")]
            if break_refs == "past_table":
                refs[self.r.randrange(len(refs))] = 10_000 + self.r.randrange(10)
            elif break_refs == "odd":
                refs = refs[:-1]
            elif break_refs == "exemplar_past" and ex_refs:
                ex_refs[0] = 99_999
            elif break_refs == "exemplar_odd" and ex_refs:
                ex_refs = ex_refs[:-1]
            elif break_refs == "metadata_past":
                meta[0] = 77_777
            ts = bytearray(len_field(1, b"".join(encode_uvarint(x) for x in refs)))
            for t, val in spec.samples:
                ts += len_field(2, _sample(val, t))
            if spec.exemplar:
                ex = len_field(1, b"".join(encode_uvarint(x) for x in ex_refs)) + b"\x11" + bytes(8)
                ts += len_field(4, ex)
            md = b"\x08\x01" + b"\x18" + encode_uvarint(meta[0]) + b"\x20" + encode_uvarint(meta[1])
            ts += len_field(5, md)
            series += len_field(5, bytes(ts))
        syms = list(symbols)
        if break_refs == "first_symbol":
            syms[0] = b"notempty"
        head = b"".join(len_field(4, s) for s in syms)
        return head + bytes(series)

    # -- mutations ------------------------------------------------------------------------

    def mutate_protobuf(self, raw: bytes) -> tuple[bytes, str]:
        r = self.r
        how = r.choice(["flip", "truncate", "long_varint", "big_field", "wire_type", "insert",
                        "len_past_end"])
        b = bytearray(raw)
        if how == "flip" and b:
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        elif how == "truncate" and len(b) > 1:
            del b[r.randrange(1, len(b)):]
        elif how == "long_varint":
            b += b"\x10" + b"\xff" * 10 + b"\x01"  # an 11-byte varint
        elif how == "big_field":
            b += encode_uvarint((1 << 29) << 3 | 0) + b"\x01"
        elif how == "wire_type":
            b += bytes([(1 << 3) | r.choice([3, 4, 6, 7])]) + b"\x00"
        elif how == "insert":
            at = r.randrange(len(b) + 1)
            b[at:at] = r.randbytes(r.randint(1, 8))
        elif how == "len_past_end":
            b += b"\x0a" + encode_uvarint(len(b) + 1000) + b"\x00"
        return bytes(b), how

    def compress(self, raw: bytes, encoding: str) -> bytes:
        if encoding == "zstd":
            return bytes(cramjam.zstd.compress(raw))
        return bytes(snappy.compress(raw))

    # -- the cases ------------------------------------------------------------------------

    def _specs(self) -> list[SeriesSpec]:
        return [self.good_series() for _ in range(self.r.choice([1, 3, 10, 40]))]

    def valid(self) -> Case:
        r = self.r
        specs = self._specs()
        v2 = r.random() < 0.4
        raw = self.body_v2(specs) if v2 else self.body_v1(specs)
        enc = r.choice(["snappy", "snappy", "zstd"])
        headers = {"Content-Type": CT_V2 if v2 else CT_V1, "Content-Encoding": enc}
        if not v2 and enc == "snappy" and r.random() < 0.1:
            headers.pop(r.choice(["Content-Type", "Content-Encoding"]))
        return Case("valid", self.compress(raw, enc), headers, valid=True, series=len(specs),
                    samples=sum(len(s.samples) for s in specs))

    def compression(self) -> Case:
        r = self.r
        raw = self.body_v1(self._specs())
        enc = r.choice(["snappy", "zstd"])
        body = self.compress(raw, enc)
        how = r.choice(["truncate", "flip", "garbage", "mislabelled", "bomb", "uncompressed"])
        if how == "truncate":
            body = body[: r.randrange(max(1, len(body)))]
        elif how == "flip":
            b = bytearray(body)
            b[r.randrange(len(b))] ^= 0xFF
            body = bytes(b)
        elif how == "garbage":
            body = r.randbytes(r.randint(1, 300))
        elif how == "mislabelled":
            enc = "zstd" if enc == "snappy" else "snappy"
        elif how == "bomb":
            body = (bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + b"\x00" * 16 if enc == "snappy"
                    else b"\x28\xb5\x2f\xfd\xa4\x00\x00\x00\x40\x00\x00" + b"\x00" * 8)
        elif how == "uncompressed":
            body = raw
        return Case("compression", body, {"Content-Type": CT_V1, "Content-Encoding": enc},
                    notes=[how])

    def framing(self) -> Case:
        v2 = self.r.random() < 0.5
        specs = self._specs()
        raw = self.body_v2(specs) if v2 else self.body_v1(specs)
        raw, how = self.mutate_protobuf(raw)
        return Case("framing", self.compress(raw, "snappy"),
                    {"Content-Type": CT_V2 if v2 else CT_V1, "Content-Encoding": "snappy"},
                    notes=[how])

    def labels(self) -> Case:
        v2 = self.r.random() < 0.5
        specs = self._specs()
        i = self.r.randrange(len(specs))
        specs[i], how = self.bad_labels(specs[i])
        raw = self.body_v2(specs) if v2 else self.body_v1(specs)
        return Case("labels", self.compress(raw, "snappy"),
                    {"Content-Type": CT_V2 if v2 else CT_V1, "Content-Encoding": "snappy"},
                    notes=[how])

    def refs(self) -> Case:
        how = self.r.choice(["past_table", "odd", "exemplar_past", "exemplar_odd",
                             "metadata_past", "first_symbol"])
        specs = self._specs()
        if how.startswith("exemplar"):
            specs[0].exemplar = [("trace_id", "abc")]
        raw = self.body_v2(specs, break_refs=how)
        return Case("refs", self.compress(raw, "snappy"),
                    {"Content-Type": CT_V2, "Content-Encoding": "snappy"}, notes=[how])

    def crossed(self) -> Case:
        """A body of one protocol under the other's Content-Type: never a 2xx that stored
        nothing."""
        specs = self._specs()
        v2_body = self.r.random() < 0.5
        raw = self.body_v2(specs) if v2_body else self.body_v1(specs)
        return Case("crossed", self.compress(raw, "snappy"),
                    {"Content-Type": CT_V1 if v2_body else CT_V2, "Content-Encoding": "snappy"},
                    series=len(specs), samples=sum(len(s.samples) for s in specs),
                    notes=["v2 body as v1" if v2_body else "v1 body as v2"])

    def cases(self, n: int) -> Iterator[Case]:
        makers: list[tuple[float, Callable[[], Case]]] = [
            (0.30, self.valid), (0.15, self.compression), (0.20, self.framing),
            (0.20, self.labels), (0.10, self.refs), (0.05, self.crossed),
        ]
        weights = [w for w, _ in makers]
        for _ in range(n):
            (_, make), = self.r.choices(makers, weights)
            yield make()


def _sample(value: float, timestamp_ms: int) -> bytes:
    """A Sample (the same fields in both versions): value = 1 (double), timestamp = 2."""
    return b"\x09" + struct.pack("<d", value) + b"\x10" + encode_uvarint(timestamp_ms)
