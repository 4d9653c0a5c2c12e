"""The project's own remote-write client: build RW 1.0 / 2.0 bodies, send them, read them back.

The demo and the tests need a sender that the Debian peers cannot be:
one that speaks RW 2.0, sends zstd, and sets tenant and auth headers (Debian's
Prometheus 2.42 ignores ``remote_write.headers``). It builds bodies with the generated
protobuf modules (``proxy/pb``), never with the proxy's own wire code, so a test that
sends with it and reads with it checks the proxy's splice against an independent encoder.

``series_from_exposition`` turns Prometheus text into the series a scraper would send,
with Prometheus' conventions: empty label values dropped, explicit timestamps kept, the
scrape time for the rest. ``decode_v1`` / ``decode_v2`` read bodies back into ``Series``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy import __version__
from proxy.compression import compress
from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2pb
from proxy.pb.prometheus import remote_pb2
from proxy.wire.primitives import Protocol

USER_AGENT = f"karta-proxy-sender/{__version__}"

#: exposition family type -> (RW 1.0 MetricMetadata.MetricType, RW 2.0 Metadata.MetricType)
_TYPES: dict[str, tuple[int, int]] = {
    "unknown": (0, 0),
    "counter": (1, 1),
    "gauge": (2, 2),
    "histogram": (3, 3),
    "gaugehistogram": (4, 4),
    "summary": (5, 5),
    "info": (6, 6),
    "stateset": (7, 7),
}
_TYPE_NAMES_V1 = {v[0]: k for k, v in _TYPES.items()}


@dataclass
class Series:
    """One series as a sender sees it: labels (``__name__`` included) and samples."""

    labels: dict[str, str]
    #: (timestamp in ms, value)
    samples: list[tuple[int, float]] = field(default_factory=list)
    #: (labels, timestamp in ms, value)
    exemplars: list[tuple[dict[str, str], int, float]] = field(default_factory=list)
    #: exposition type ("counter", "gauge", ...); "" for none (no metadata sent)
    metric_type: str = ""
    help: str = ""
    unit: str = ""

    @property
    def name(self) -> str:
        return self.labels.get("__name__", "")

    def sorted_labels(self) -> list[tuple[str, str]]:
        """Labels in wire order: sorted by name, empty values left out (as the spec says)."""
        return sorted((k, v) for k, v in self.labels.items() if v != "")


# -- building bodies ---------------------------------------------------------------------------


def build_v1(series: Iterable[Series], *, metadata: bool = True) -> bytes:
    """A ``prometheus.WriteRequest`` (uncompressed) with one metadata entry per family."""
    req = remote_pb2.WriteRequest()
    families: dict[str, Series] = {}
    for s in series:
        ts = req.timeseries.add()
        for k, v in s.sorted_labels():
            ts.labels.add(name=k, value=v)
        for t, val in s.samples:
            ts.samples.add(value=val, timestamp=t)
        for el, t, val in s.exemplars:
            ex = ts.exemplars.add(value=val, timestamp=t)
            for k, lv in sorted(el.items()):
                ex.labels.add(name=k, value=lv)
        if metadata and s.metric_type:
            families.setdefault(_family_name(s), s)
    for fam, s in families.items():
        req.metadata.add(
            type=_TYPES.get(s.metric_type, (0, 0))[0],
            metric_family_name=fam,
            help=s.help,
            unit=s.unit,
        )
    out: bytes = req.SerializeToString()
    return out


def build_v2(series: Iterable[Series]) -> bytes:
    """An ``io.prometheus.write.v2.Request`` (uncompressed); symbols interned in order seen."""
    req = v2pb.Request()
    symbols: dict[str, int] = {"": 0}

    def ref(s: str) -> int:
        i = symbols.get(s)
        if i is None:
            i = symbols[s] = len(symbols)
        return i

    for s in series:
        ts = req.timeseries.add()
        for k, v in s.sorted_labels():
            ts.labels_refs.extend((ref(k), ref(v)))
        for t, val in s.samples:
            ts.samples.add(value=val, timestamp=t)
        for el, t, val in s.exemplars:
            ex = ts.exemplars.add(value=val, timestamp=t)
            for k, lv in sorted(el.items()):
                ex.labels_refs.extend((ref(k), ref(lv)))
        if s.metric_type:
            ts.metadata.type = _TYPES.get(s.metric_type, (0, 0))[1]
            if s.help:
                ts.metadata.help_ref = ref(s.help)
            if s.unit:
                ts.metadata.unit_ref = ref(s.unit)
    req.symbols.extend(symbols)  # dicts keep insertion order: index == position
    out: bytes = req.SerializeToString()
    return out


def build(series: Iterable[Series], protocol: Protocol | str) -> bytes:
    return build_v2(series) if _protocol(protocol) is Protocol.V2 else build_v1(series)


def _family_name(s: Series) -> str:
    name = s.name
    if s.metric_type in ("histogram", "gaugehistogram", "summary"):
        for suffix in ("_bucket", "_count", "_sum", "_gcount", "_gsum", "_created"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
    return name


def _protocol(protocol: Protocol | str) -> Protocol:
    if isinstance(protocol, Protocol):
        return protocol
    p = protocol.strip().lower()
    if p in ("v1", "1", "1.0", "0.1.0", Protocol.V1.value.lower()):
        return Protocol.V1
    if p in ("v2", "2", "2.0", "2.0.0", Protocol.V2.value.lower()):
        return Protocol.V2
    raise ValueError(f"unknown remote-write protocol {protocol!r} (v1 or v2)")


# -- reading bodies back -----------------------------------------------------------------------


def decode_v1(data: bytes) -> list[Series]:
    """An uncompressed 1.0 body as ``Series`` (metadata matched to series by family)."""
    req = remote_pb2.WriteRequest()
    req.ParseFromString(data)
    meta = {m.metric_family_name: m for m in req.metadata}
    out = []
    for ts in req.timeseries:
        s = Series(
            labels={lb.name: lb.value for lb in ts.labels},
            samples=[(smp.timestamp, smp.value) for smp in ts.samples],
            exemplars=[
                ({lb.name: lb.value for lb in ex.labels}, ex.timestamp, ex.value)
                for ex in ts.exemplars
            ],
        )
        m = meta.get(s.name)
        if m is not None:
            s.metric_type = _TYPE_NAMES_V1.get(m.type, "unknown")
            s.help, s.unit = m.help, m.unit
        out.append(s)
    return out


def decode_v2(data: bytes) -> list[Series]:
    """An uncompressed 2.0 body as ``Series``; raises ValueError on a bad symbol ref."""
    req = v2pb.Request()
    req.ParseFromString(data)
    sym = list(req.symbols)

    def pairs(refs: Sequence[int]) -> dict[str, str]:
        if len(refs) % 2:
            raise ValueError("odd number of label refs")
        try:
            return {sym[refs[i]]: sym[refs[i + 1]] for i in range(0, len(refs), 2)}
        except IndexError:
            raise ValueError(f"label ref out of range (symbols: {len(sym)})") from None

    out = []
    for ts in req.timeseries:
        s = Series(
            labels=pairs(ts.labels_refs),
            samples=[(smp.timestamp, smp.value) for smp in ts.samples],
            exemplars=[(pairs(ex.labels_refs), ex.timestamp, ex.value) for ex in ts.exemplars],
        )
        if ts.HasField("metadata") and ts.metadata.type:
            s.metric_type = _TYPE_NAMES_V1.get(int(ts.metadata.type), "unknown")
            s.help = sym[ts.metadata.help_ref] if ts.metadata.help_ref < len(sym) else ""
            s.unit = sym[ts.metadata.unit_ref] if ts.metadata.unit_ref < len(sym) else ""
        out.append(s)
    return out


def decode(data: bytes, protocol: Protocol | str) -> list[Series]:
    return decode_v2(data) if _protocol(protocol) is Protocol.V2 else decode_v1(data)


# -- exposition text -> series -----------------------------------------------------------------


def series_from_exposition(
    text: str, timestamp_ms: int, *, extra_labels: Mapping[str, str] | None = None
) -> list[Series]:
    """Prometheus text exposition as the series a scrape produces (raises ValueError).

    Samples without a timestamp get ``timestamp_ms``; repeated lines of one series (a
    recorded batch of several scrapes) become several samples of one ``Series``, in order.
    ``extra_labels`` play the target labels (they win over the exposed ones, as with
    ``honor_labels: false``, except that the exposed ones are dropped, not renamed).
    """
    by_key: dict[tuple[tuple[str, str], ...], Series] = {}
    # prometheus_client's parser names a counter's samples <family>_total even where the
    # text has no _total (DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION); a scraper keeps the name
    # as written, so the names of the text win
    written = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
               if line and not line.startswith("#")}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            labels = {k: v for k, v in smp.labels.items() if v != ""}
            if extra_labels:
                labels.update(extra_labels)
            name = smp.name
            if name not in written and name.endswith("_total") and name[:-6] in written:
                name = name[:-6]
            labels["__name__"] = name
            key = tuple(sorted(labels.items()))
            s = by_key.get(key)
            if s is None:
                s = by_key[key] = Series(
                    labels=labels, metric_type=fam.type, help=fam.documentation or ""
                )
            s.samples.append((_ts_ms(smp.timestamp, timestamp_ms), float(smp.value)))
    out = list(by_key.values())
    for s in out:
        s.samples.sort(key=lambda tv: tv[0])
    return out


def _ts_ms(ts: Any, default: int) -> int:
    if ts is None:
        return default
    if hasattr(ts, "sec"):  # prometheus_client's Timestamp (OpenMetrics parser)
        return int(ts.sec) * 1000 + int(ts.nsec) // 1_000_000
    return round(float(ts) * 1000)


# -- sending -----------------------------------------------------------------------------------


def request_headers(
    protocol: Protocol | str, encoding: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    p = _protocol(protocol)
    h = {
        "Content-Type": p.content_type,
        "Content-Encoding": encoding,
        "X-Prometheus-Remote-Write-Version": p.version_header,
        "User-Agent": USER_AGENT,
    }
    if extra:
        h.update(extra)
    return h


async def send(
    url: str,
    body: bytes,
    *,
    protocol: Protocol | str,
    encoding: str = "snappy",
    headers: Mapping[str, str] | None = None,
    session: aiohttp.ClientSession | None = None,
    timeout: float = 30.0,
    compressed: bool = False,
) -> tuple[int, dict[str, str], str]:
    """POST one remote-write body; returns (status, response headers, response text).

    ``body`` is the uncompressed protobuf unless ``compressed`` is set (then it is sent as
    is, which is how tests send garbage). Transport errors raise ``aiohttp.ClientError``.
    """
    data = body if compressed else compress(body, encoding)
    hdrs = request_headers(protocol, encoding, headers)
    own = session is None
    sess = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), auto_decompress=False
    )
    try:
        async with sess.post(url, data=data, headers=hdrs) as resp:
            text = await resp.text(errors="replace")
            return resp.status, dict(resp.headers), text
    finally:
        if own:
            await sess.close()


async def send_series(
    url: str,
    series: Sequence[Series],
    *,
    protocol: Protocol | str = Protocol.V1,
    encoding: str = "snappy",
    headers: Mapping[str, str] | None = None,
    session: aiohttp.ClientSession | None = None,
    timeout: float = 30.0,
) -> tuple[int, dict[str, str], str]:
    """``build`` + ``send`` in one call."""
    return await send(
        url,
        build(series, protocol),
        protocol=protocol,
        encoding=encoding,
        headers=headers,
        session=session,
        timeout=timeout,
    )
