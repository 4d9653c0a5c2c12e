"""The proxy's own operational metrics, on a registry of its own (served on ``/metrics``).

A private ``CollectorRegistry`` per proxy keeps tests and in-process peers from sharing
counters; other parts (kube source, facts) register their collectors on ``registry``. The
standard ``process_*`` / ``python_*`` collectors are registered here too, since the private
registry does not get the default registry's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy import contract
from proxy.index import PodIndex
from proxy.karta.jq_sandbox import RESTART_REASONS, JqSandbox
from proxy.loop_metrics import LoopCounter, LoopHistogram
from proxy.loop_workers import LoopWorkers
from proxy.upstream_redirect import RESULTS as REDIRECT_RESULTS

if TYPE_CHECKING:
    from proxy.karta.engine import Engine

_P = "karta_proxy_"

# No ``*_created`` series beside every counter and histogram (prometheus_client's default
# in the text format): each is one more series per labelled child in every TSDB that
# scrapes the proxy, and the creation time of a process-lifetime counter says nothing
# ``process_start_time_seconds`` does not. The switch is process-wide; the proxy owns
# its process.
disable_created_metrics()

#: upstream latency buckets: remote-write round trips run from ~1 ms (local) to the timeout
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


S = TypeVar("S")


class _AtScrape(Collector, Generic[S]):
    """Families read from an object at scrape time (nothing on the request path); none
    until the object is there."""

    def __init__(self, getter: Callable[[], S | None],
                 families: Callable[[S], Iterator[Metric]]) -> None:
        self._get = getter
        self._families = families

    def collect(self) -> Iterator[Metric]:
        obj = self._get()
        if obj is not None:
            yield from self._families(obj)


def _index_families(index: PodIndex) -> Iterator[Metric]:
    """The index's size and state."""
    yield _gauge("index_pods", "Pods with stamped labels in the index (tombstones "
                 "included).", len(index))
    yield _gauge("index_tombstones", "Deleted pods still kept for late samples.",
                 index.tombstones())
    yield _gauge("index_workloads", "Workloads known to the index.", len(index.workloads))
    # contract names: an alert reads them (proxy/contract.py, INDEX_METRICS)
    yield GaugeMetricFamily(contract.OP_INDEX_READY, "1 once every source delivered its "
                            "initial state.", value=1.0 if index.ready else 0.0)
    yield GaugeMetricFamily(contract.OP_INDEX_STALE, "1 while a source knows it is cut "
                            "off.", value=1.0 if index.stale else 0.0)


def _worker_families(workers: LoopWorkers) -> Iterator[Metric]:
    """The splice workers' use: busy seconds over threads is their utilization, 1 a proxy
    at capacity (requests queue for a worker)."""
    yield _gauge("worker_threads", "Threads that decompress, splice and compress "
                 "requests (server.worker_threads).", workers.threads)
    yield CounterMetricFamily(
        _P + "worker_busy_seconds", "Time the worker threads spent on requests, summed "
        "over threads; its rate over worker_threads is their utilization.",
        value=workers.busy_seconds())
    yield _gauge("worker_queued_requests", "Requests waiting for a free worker thread.",
                 workers.queued())


def _engine_families(engine: Engine) -> Iterator[Metric]:
    """What the Karta engine counted: the jq runtime errors (each logged once per
    workload and expression) by where and description, every ``where`` of every
    description in force present from the start (a description no longer in force keeps
    what it counted); and the descriptions not in force now, by why, every reason
    present from the start. No label names a description there: a cluster can hold any
    number of Karta objects (the log lines name them); three series, whatever it holds."""
    from proxy.karta.results import JQ_ERROR_WHERE

    problems = GaugeMetricFamily(
        contract.OP_DESCRIPTION_ERRORS, "Karta descriptions not in force now, by reason: "
        "invalid (does not parse or validate, nothing of it in force: a file of "
        "karta.description_paths read at the start, a snapshot's, a Karta or "
        "ResourceInterface object the proxy never saw valid; its kind's pods read "
        "description_error unless another description covers it), held_last_valid (a "
        "Karta or ResourceInterface object edited invalid: its last valid version stays "
        "in force, until a restart, after which it is invalid and its kind's pods all go "
        "to description_error), not_in_force (valid, but another description of its kind "
        "wins: the same one after a restart). Each is named in the log: '... description ... "
        "skipped' (invalid), 'description ... not taken, its last valid version stays in "
        "force' (held_last_valid), 'description not in force' (not_in_force).",
        labels=["reason"])
    for reason, count in engine.description_problems().items():
        problems.add_metric([reason], count)
    yield problems

    family = CounterMetricFamily(
        _P + "jq_errors", "jq runtime errors of the descriptions' expressions, by where: "
        "selector (a pod selector: the pod's component, instance or replica not given), "
        "workload (instance ids, scale paths), status (the phase: Undefined, jq_error); "
        "and by the name of the description whose expression failed.",
        labels=["where", "description"])
    counted = dict(engine.jq_errors)
    for desc in engine.descriptions().values():
        for where in JQ_ERROR_WHERE:
            counted.setdefault((where, desc.name), 0)
    for (where, name), value in sorted(counted.items()):
        family.add_metric([where, name], value)
    yield family


def _jq_sandbox_families(sandbox: JqSandbox | None, engine: Engine | None
                         ) -> Iterator[Metric]:
    """The jq sandbox's restarts, quarantined expressions and seconds waited, and the
    engine's re-evaluations after its failures: present at 0 without a sandbox
    (karta.jq_sandbox off, or before the start), every reason from the start."""
    from proxy.karta.results import STAT_JQ_RETRY

    family = CounterMetricFamily(
        contract.OP_JQ_SANDBOX_RESTARTS.removesuffix("_total"),
        "Restarts of the jq sandbox's child, by reason: timeout (an object's evaluations "
        "took longer than karta.jq_timeout_seconds: killed), died (it ended, during an "
        "evaluation: libjq's "
        "abort at karta.jq_memory_limit_bytes, or between two), start_failed (a child "
        "could not start).", labels=["reason"])
    for reason in RESTART_REASONS:
        family.add_metric([reason], sandbox.restarts[reason] if sandbox is not None else 0)
    yield family
    yield GaugeMetricFamily(
        contract.OP_JQ_QUARANTINED, "jq expressions quarantined: they exceeded the time "
        "limit or took the sandbox's child down 3 times within an hour, and are jq errors "
        "without evaluation for an hour (or until their text changes).",
        value=sandbox.quarantined() if sandbox is not None else 0)
    yield CounterMetricFamily(
        contract.OP_JQ_SANDBOX_SECONDS.removesuffix("_total"),
        "Seconds the proxy waited for the jq sandbox's evaluations (the event loop held).",
        value=sandbox.seconds_total if sandbox is not None else 0)
    yield CounterMetricFamily(
        contract.OP_JQ_RETRIES.removesuffix("_total"),
        "Re-evaluations of a workload object or a pod made without an object event, "
        "after a jq failure that was not the expression's own (the sandbox's child held "
        "up, killed, unable to start, the object's time limit spent by another "
        "expression) or a quarantine that ended.",
        value=engine.stats[STAT_JQ_RETRY] if engine is not None else 0)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_P + name, documentation, value=value)


def present_at_zero(counter: Counter, values: Iterable[str]) -> Counter:
    """``counter`` (of one label) with each of ``values`` present from the start, at 0: a
    rate over one never seen reads 0, not absent (an alert on it would never fire), and
    its first count is not lost to a series that begins with it."""
    for value in values:
        counter.labels(value)
    return counter


def _by_result(name: str, documentation: str, results: tuple[str, ...],
               registry: CollectorRegistry) -> Counter:
    """A counter by ``result``, every result present from the start, at 0."""
    return present_at_zero(Counter(_P + name, documentation, ["result"], registry=registry),
                           results)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._add_request_metrics(r)
        self._add_upstream_metrics(r)
        # process_* (CPU, RSS, open fds, start time), python_info and python_gc_*: what
        # stock dashboards and alerts read from any Python target. The build-info series is
        # the contract's karta_build_info (proxy/facts/model.py), registered with the facts.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._add_config_metrics(r)
        self._index: PodIndex | None = None
        r.register(_AtScrape(lambda: self._index, _index_families))
        self._workers: LoopWorkers | None = None
        r.register(_AtScrape(lambda: self._workers, _worker_families))
        self._engine: Engine | None = None
        r.register(_AtScrape(lambda: self._engine, _engine_families))
        self._jq_sandbox: JqSandbox | None = None
        r.register(_AtScrape(lambda: self, lambda m: _jq_sandbox_families(m._jq_sandbox,
                                                                       m._engine)))

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """What came in and what became of it: the request side's own counters."""
        # counted by the event loop thread alone, per request: plain numbers
        # (proxy.loop_metrics), no prometheus_client update on the request path
        self.requests = LoopCounter(
            _P + "requests", "Remote-write requests answered, by path, protocol and status code.",
            ["path", "protocol", "code"], registry=r,
        )
        self.series = LoopCounter(
            _P + "series", "Series received (in), and forwarded and accepted upstream (out: "
            "counted once the upstream answered 2xx to them; a request sent in parts, each "
            "part that got one).", ["direction"], registry=r,
        )
        self.samples = LoopCounter(_P + "samples", "Float samples received.", registry=r)
        self.histograms = LoopCounter(_P + "histograms", "Native histogram samples received.",
                                      registry=r)
        self.exemplars = LoopCounter(_P + "exemplars", "Exemplars received.", registry=r)
        self.attributed = LoopCounter(
            _P + "series_attributed", "Series that received stamped labels.", registry=r,
        )
        self.unattributed = LoopCounter(
            _P + "series_unattributed", "Series forwarded without stamped labels, by reason.",
            ["reason"], registry=r,
        )
        self.sender_karta_dropped = LoopCounter(
            _P + "series_sender_karta_labels_dropped", "Series that lost a karta_* label the "
            "sender put on them (enrich.sender_karta_labels: drop, or a stamped name the "
            "stamp replaced with another value).", registry=r,
        )
        self.decode_errors = Counter(
            _P + "decode_errors",
            "Requests refused because the body could not be decoded, by kind.",
            ["kind"], registry=r,
        )
        self.rejected = present_at_zero(Counter(
            _P + "requests_rejected",
            "Requests the proxy refused itself (not the upstream), by reason "
            "(overload, too_large, not_ready, unsupported_media_type, method, "
            "invalid_tenant, invalid_header, karta_extra_label, header_timeout, body_timeout, "
            "body_too_slow, expectation, client_closed, bad_http, header_too_large, "
            "send_timeout, thread_limit: no worker thread could start, out_of_memory: an "
            "allocation failed, loop: the request came through this proxy before, its Via "
            "says).",
            ["reason"], registry=r,
        ), contract.REJECT_REASONS)
        self.connections_refused = Counter(
            _P + "connections_refused", "Client connections closed as soon as they were "
            "made, by reason (max_connections: server.max_connections were open).",
            ["reason"], registry=r,
        )
        self.accept_errors = Counter(
            _P + "accept_errors", "Accepts of client connections that failed for want of a "
            "resource, each followed by a one-second pause of the listener, by reason "
            "(fd_limit: the file descriptor limit, EMFILE or ENFILE; no_memory: ENOBUFS or "
            "ENOMEM).",
            ["reason"], registry=r,
        )
        self.accept_errors.labels("fd_limit")  # present from the start, at 0
        self.connections_closed = Counter(
            _P + "connections_closed", "Idle client connections closed by the proxy, by "
            "reason (idle_at_limit: aborted to make room for a new connection at "
            "server.max_connections; unused: sent no byte within "
            "server.header_read_timeout_seconds of its start).",
            ["reason"], registry=r,
        )
        self.open_connections = Gauge(
            _P + "open_connections", "Client connections open now (TLS handshakes "
            "included), at most server.max_connections.", registry=r,
        )
        self.request_duration = LoopHistogram(
            _P + "request_duration_seconds", "Time from request start to answer, by protocol.",
            ["protocol"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.inflight = Gauge(_P + "inflight_requests", "Remote-write requests being processed.",
                              registry=r)
        self.splice_limits = _by_result(
            "splice_limits", "Splices that held past what was reserved for them beside "
            "the decoded body (series small beside their stamps, RW 2.0 series), by result: "
            "grown (took more from the byte budget and went on: a request may count more "
            "than once), overload (no room in the byte budget: 503), too_large (more than "
            "one request may hold: 413).",
            ("grown", "overload", "too_large"), r,
        )
        self.symbol_index_floods = Counter(
            _P + "symbol_index_floods", "RW 2.0 requests whose symbol index went over its "
            "probe budget (symbols made to collide in its hash: a hash flood) and was rebuilt "
            "with a keyed hash; spliced and forwarded as any other.", registry=r,
        )
        self.inflight_bytes = Gauge(
            _P + "inflight_bytes", "Request bytes charged to server.max_inflight_bytes "
            "now (body, decoded and output until spliced, then the outgoing body).",
            registry=r,
        )

    def _add_upstream_metrics(self, r: CollectorRegistry) -> None:
        """The forwarding side: how the upstream answered and what protocol it was sent."""
        # counted on the event loop thread alone, per request (proxy.loop_metrics)
        self.upstream_duration = LoopHistogram(
            _P + "upstream_request_duration_seconds", "Round trip of one upstream request.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.upstream_responses = LoopCounter(
            _P + "upstream_responses", "Upstream answers by status code (timeout, "
            "connect_error, error when none came).", ["code"], registry=r,
        )
        self.upstream_conversions = Counter(
            _P + "upstream_v2_to_v1_conversions", "RW 2.0 requests converted to RW 1.0 for "
            "the upstream.", registry=r,
        )
        self.upstream_rw2_fallbacks = Counter(
            _P + "upstream_rw2_fallbacks", "RW 2.0 requests the upstream did not take "
            "(415, or a 2xx without Written headers), resent as RW 1.0, by reason.",
            ["reason"], registry=r,
        )
        self.upstream_histograms_not_stored = Counter(
            _P + "upstream_histograms_not_stored", "Native histogram samples of RW 2.0 "
            "requests converted to RW 1.0 that were left out because the upstream answered "
            "500 'native histograms are disabled' (Prometheus without "
            "--enable-feature=native-histograms): the rest of the request stored, the "
            "sender told Histograms-Written without them.", registry=r,
        )
        self.upstream_misconfigured = Counter(
            _P + "upstream_misconfigured", "Upstream answers that are the proxy's "
            "configuration's fault (not_write_endpoint, credentials_refused, "
            "no_tenant_place), answered 503.",
            ["url", "reason", "code"], registry=r,
        )
        self.upstream_splits = _by_result(
            "upstream_split_requests", "Requests the upstream refused as too large "
            "(413), sent again in parts cut at series boundaries, by result: stored (every "
            "part 2xx), failed (a part failed otherwise), too_large (one series, or a part "
            "at 16 parts, still too large: the 413 reaches the sender), overload (no room "
            "in the byte budget to cut it: 503), timeout (not done within "
            "upstream.timeout_seconds: 504), sender_gone (the sender closed its connection: "
            "the rest not sent).",
            ("stored", "failed", "too_large", "overload", "timeout", "sender_gone"), r,
        )
        self.upstream_split_parts = Counter(
            _P + "upstream_split_parts", "Parts sent for requests the upstream refused as "
            "too large (413) and answered (a part refused again and cut is not counted).",
            registry=r,
        )
        self.upstream_split_records_evicted = Counter(
            _P + "upstream_split_records_evicted", "Requests sent in parts whose record of "
            "the parts stored was dropped for room before its 5 minutes (too many such "
            "requests for its 16 MiB): a resend of one sends its stored parts again.",
            registry=r,
        )
        self.upstream_redirects = _by_result(
            "upstream_redirects", "Redirect answers to upstream requests, by result: "
            "followed (a 307 or 308 followed to its Location: one round trip more), "
            "not_followed (a 301, 302, 303, or a 307 / 308 with upstream.follow_redirects "
            "off: answered 503 as a misconfiguration), and the ones that end the request "
            "with a 502: no_location, bad_location (does not parse, not http/https), loop "
            "(a Location the request went to before), too_many (the 10th redirect).",
            REDIRECT_RESULTS, r,
        )
        self.upstream_info = Gauge(
            _P + "upstream_info", "The upstream, the protocol learned for it (rw1, "
            "as_received, unknown) and the outcome of its last check.",
            ["url", "protocol", "check"], registry=r,
        )

    def _add_config_metrics(self, r: CollectorRegistry) -> None:
        """Configuration and certificate reloads: named after Prometheus' own so that the
        same alerts work (prometheus_config_last_reload_*)."""
        self.config_reload_successful = Gauge(
            _P + "config_last_reload_successful", "1 when the last configuration load (the "
            "start, SIGHUP or POST /-/reload) succeeded, 0 when it failed and the previous "
            "configuration stayed in force.", registry=r,
        )
        self.config_reload_timestamp = Gauge(
            _P + "config_last_reload_success_timestamp_seconds", "When the configuration was "
            "last loaded successfully (unix seconds).", registry=r,
        )
        self.config_restart_required = Gauge(
            _P + "config_restart_required", "1 when the configuration file changes keys that "
            "only a restart applies (listen address, worker threads, upstream, ...); the "
            "running values stay until then.", registry=r,
        )
        self.tls_reloads = Counter(
            _P + "tls_certificate_reloads", "Loads of the listening side's certificate, key "
            "and client CA, by result (success, failure): each reload once, a check's load "
            "of changed files, a check's failure once per state of the files.",
            ["result"], registry=r,
        )
        self.tls_handshake_failures = Counter(
            _P + "tls_handshake_failures", "TLS handshakes on the listening side that failed, "
            "by reason (no_client_certificate, untrusted_certificate, "
            "server_certificate_rejected, client_closed, not_tls, protocol, timeout, other).",
            ["reason"], registry=r,
        )
        #: registered by the runtime when TLS is on (no serving certificate, no series)
        self.tls_certificate_expiry = Gauge(
            _P + "tls_certificate_expiry_timestamp_seconds", "When the serving certificate "
            "loaded last expires (its notAfter), unix seconds.", registry=None,
        )
        #: the upstream's side (``upstream.tls_*``): registered by the upstream when its TLS
        #: files are set, the expiry when a client certificate is
        self.upstream_tls_reloads = Counter(
            _P + "upstream_tls_certificate_reloads", "Loads of the upstream's TLS files (CA, "
            "client certificate and key), by result (success, failure): each reload once, a "
            "check's load of changed files, a check's failure once per state of the files.",
            ["result"], registry=None,
        )
        #: registered by the upstream with ``upstream.oauth2`` set
        self.upstream_oauth2_token_fetches = Counter(
            _P + "upstream_oauth2_token_fetches", "Fetches of the upstream's OAuth 2.0 token "
            "(upstream.oauth2), by result (success; refused: the token endpoint refused the "
            "client; unavailable: no answer, a timeout, a 5xx; invalid_answer: a 2xx with "
            "no usable token).", ["result"], registry=None,
        )
        self.upstream_tls_certificate_expiry = Gauge(
            _P + "upstream_tls_certificate_expiry_timestamp_seconds", "When the client "
            "certificate presented to the upstream, loaded last, expires (its notAfter), "
            "unix seconds.", registry=None,
        )

    def watch_index(self, index: PodIndex) -> None:
        self._index = index

    def watch_workers(self, workers: LoopWorkers) -> None:
        self._workers = workers

    def watch_engine(self, engine: Engine) -> None:
        self._engine = engine

    def watch_jq_sandbox(self, sandbox: JqSandbox) -> None:
        self._jq_sandbox = sandbox
