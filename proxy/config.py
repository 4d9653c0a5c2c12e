"""Every setting of the proxy, with its default; the YAML file and the flags fill these.

One dataclass per concern. ``load_settings`` (YAML) and ``proxy.cli`` (flags, which win)
produce a ``Settings``; ``docs/configuration.md`` documents every key.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from proxy.wire.plan import MAX_LABEL_NAMES

log = logging.getLogger("karta.config")


#: a VictoriaMetrics cluster tenant: ``accountID`` or ``accountID:projectID`` (uint32s)
TENANT = re.compile(r"\d{1,10}(:\d{1,10})?")


class ConfigError(ValueError):
    """A setting is invalid; the message names the key and why."""


@dataclass
class ServerSettings:
    listen_address: str = "0.0.0.0:9091"
    #: compressed request body limit (bytes) -> 413 beyond
    max_body_bytes: int = 16 * 1024 * 1024
    #: decoded (uncompressed) limit, read from the snappy header before decompressing
    max_decoded_bytes: int = 64 * 1024 * 1024
    #: requests processed at once; past it (or past the memory bound) answer 503
    max_concurrent_requests: int = 64
    #: bytes of request bodies held at once (compressed + decoded) before answering 503
    max_inflight_bytes: int = 512 * 1024 * 1024
    #: forward unenriched before the index is ready instead of answering 503
    forward_before_ready: bool = False
    #: threads that decompress, splice and compress requests; 0: one per usable core
    worker_threads: int = 0
    #: a request's line and headers must arrive within this (from their first byte), or
    #: the connection gets 408 and is closed
    header_read_timeout_seconds: float = 10.0
    #: a request's whole body must arrive within this (from the end of its headers) -> 408
    body_read_timeout_seconds: float = 30.0
    #: and never slower than this on average (after its first second) -> 408
    min_body_bytes_per_second: int = 16384
    #: serve HTTPS with this certificate (PEM, chain after the leaf) and key; both or neither.
    #: The files are re-read when they change (checked every few seconds) and on reload
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: CA bundle (PEM) that client certificates must chain to (mTLS)
    tls_client_ca_file: str = ""
    #: as Prometheus' web config: "NoClientCert", "VerifyClientCertIfGiven" or
    #: "RequireAndVerifyClientCert"; empty: RequireAndVerifyClientCert with a client CA,
    #: NoClientCert without
    tls_client_auth_type: str = ""


@dataclass
class UpstreamSettings:
    url: str = ""
    timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 5.0
    max_connections: int = 64
    #: "auto" (RW 2.0 passes through; on 415 convert to 1.0 and remember), "v1" (always
    #: convert 2.0 to 1.0), "passthrough" (never convert)
    protocol: str = "auto"
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_insecure_skip_verify: bool = False
    tls_server_name: str = ""
    bearer_token_file: str = ""
    basic_auth_username: str = ""
    basic_auth_password_file: str = ""
    #: request headers forwarded end to end (case-insensitive)
    forward_headers: list[str] = field(
        default_factory=lambda: [
            "Authorization",
            "X-Scope-OrgID",
            "THANOS-TENANT",
            "X-Prometheus-Remote-Write-Version",
            "User-Agent",
        ]
    )
    #: extra headers set on every upstream request
    headers: dict[str, str] = field(default_factory=dict)
    #: answer 429 of our own when the upstream says 429 (off: map to 503 so senders retry)
    pass_through_429: bool = False
    #: body encoding toward the upstream: "snappy" (every receiver takes it), "zstd", or
    #: "same" (whatever the sender used)
    encoding: str = "snappy"
    #: the tenant put in a ``{tenant}`` of ``url`` for requests whose path names none
    #: (and for the proxy's own fact series)
    default_tenant: str = "0"


@dataclass
class PodLabelPair:
    """A (namespace label, pod label) pair with labels that disqualify it."""

    namespace: str
    pod: str
    #: label -> regular expression (anchored at both ends, like a PromQL ``=~``): the pair
    #: is not used when the series' value of that label (a missing label reads "") matches
    unless: dict[str, str] = field(default_factory=dict)


#: the exporter's own container names: a DCGM series whose plain (namespace, pod) comes
#: with one of these (or with no container at all) names the exporter, not a GPU's pod
DCGM_EXPORTER_CONTAINERS = "|nvidia-dcgm-exporter|dcgm-exporter|exporter"


@dataclass
class PodLabelRule:
    """Which labels name the pod for metrics whose name starts with ``metric_prefix``."""

    metric_prefix: str
    #: ordered like ``enrich.pod_label_pairs``; the first usable pair wins
    pod_label_pairs: list[PodLabelPair]


def _default_pod_label_rules() -> list[PodLabelRule]:
    # DCGM: under honor_labels false the GPU's pod is exported_*, and the plain pair is
    # always the exporter's (its container label, a target label, is the exporter's). Under
    # honor_labels true the plain pair + container are the GPU's pod. An idle GPU has only
    # the target's pair: without a container, or with the exporter's.
    return [
        PodLabelRule(
            metric_prefix="DCGM_",
            pod_label_pairs=[
                PodLabelPair("exported_namespace", "exported_pod"),
                PodLabelPair("pod_namespace", "pod_name"),
                PodLabelPair("namespace", "pod", {"container": DCGM_EXPORTER_CONTAINERS}),
            ],
        )
    ]


@dataclass
class EnrichSettings:
    #: ordered (namespace label, pod label) pairs; the first pair present in a series wins
    #: (metrics a ``pod_label_rules`` entry matches use that entry's pairs instead)
    pod_label_pairs: list[tuple[str, str]] = field(
        default_factory=lambda: [
            ("exported_namespace", "exported_pod"),
            ("namespace", "pod"),
            ("pod_namespace", "pod_name"),
        ]
    )
    #: per metric-name prefix pairs; the first rule whose prefix matches ``__name__`` wins
    pod_label_rules: list[PodLabelRule] = field(default_factory=_default_pod_label_rules)
    #: "replace": stamped labels replace same-named labels a sender sent;
    #: "keep": a series that already carries karta_workload passes through unchanged
    conflict_policy: str = "replace"
    #: "drop": every karta_* label a sender sent is removed from every series, stamped or
    #: not (no sender can charge its usage to a workload); "keep": only the stamped names,
    #: and only from series the proxy stamps (before issue 9). A series conflict_policy
    #: "keep" lets pass keeps its labels either way
    sender_karta_labels: str = "drop"


@dataclass
class KartaSettings:
    #: files or folders of Karta / ResourceInterface descriptions (YAML or JSON)
    description_paths: list[str] = field(default_factory=list)
    #: the project's descriptions of core kinds (Deployment, StatefulSet, Job, ...)
    builtins: bool = True
    max_owner_hops: int = 6
    #: how long a deleted pod keeps its labels (longer than Prometheus' 5 m lookback)
    tombstone_seconds: float = 600.0


@dataclass
class KubeSettings:
    kubeconfig: str = ""
    #: empty: all namespaces
    namespaces: list[str] = field(default_factory=list)
    #: node-scoped mode: only this node's pods (field selector spec.nodeName)
    node_name: str = ""
    #: watch Karta / ResourceInterface objects from the API
    watch_descriptions: bool = True
    resync_backoff_max_seconds: float = 30.0


@dataclass
class FactSettings:
    enabled: bool = True
    interval_seconds: float = 15.0
    #: elect one writer among replicas through a coordination.k8s.io Lease
    leader_election: bool = False
    lease_name: str = "karta-proxy-facts"
    #: empty: the proxy's own namespace (POD_NAMESPACE, else the service account's)
    lease_namespace: str = ""
    lease_duration_seconds: float = 15.0
    #: identity in the lease; defaults to the hostname
    identity: str = ""
    #: labels added to every fact series (e.g. cluster)
    external_labels: dict[str, str] = field(default_factory=dict)
    #: serve the per-pod facts (karta_pod_info, ...) on /metrics too. Off by default: at
    #: ~100k pods they make a scrape take 5-13 s (prometheus_client renders ~10-40 us a
    #: sample); the remote-write stream always carries them, /metrics keeps the rest
    metrics_pod_facts: bool = False
    #: write facts even in node mode (kube.node_name), where a replica sees one node's pods
    #: only and its pod facts and observed-pod counts are partial; off: node mode writes none
    allow_in_node_mode: bool = False


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    enrich: EnrichSettings = field(default_factory=EnrichSettings)
    karta: KartaSettings = field(default_factory=KartaSettings)
    kube: KubeSettings = field(default_factory=KubeSettings)
    facts: FactSettings = field(default_factory=FactSettings)
    #: file or folder of Kubernetes objects; when set, no live cluster is used
    snapshot: str = ""
    #: poll the snapshot's files this often and apply what changed (0: load once). On by
    #: default: a poll is a few stat calls, it lets a ConfigMap-mounted snapshot follow its
    #: updates, and it keeps the snapshot's freshness fact current while the files are
    snapshot_reload_seconds: float = 30.0
    log_level: str = "info"
    #: "auto" (text when stderr is a terminal, else JSON), "json" or "text": a person at a
    #: terminal reads lines, a log pipeline (kubectl logs, journald, a file) parses objects
    log_format: str = "auto"


# -- loading ------------------------------------------------------------------------------

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_LOG_FORMATS = ("auto", "json", "text")
_PROTOCOLS = ("auto", "v1", "passthrough")
_ENCODINGS = ("snappy", "zstd", "same")
_CONFLICT_POLICIES = ("replace", "keep")
_SENDER_KARTA_LABELS = ("drop", "keep")


def load_settings(path: str | os.PathLike[str]) -> Settings:
    """Read a YAML file into ``Settings``; unknown keys and wrong types are errors.

    Every message names the file and the dotted key, so a typo in a ConfigMap is found
    from the log line alone instead of being silently ignored.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{p}: invalid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    try:
        return settings_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def settings_from_dict(data: Any) -> Settings:
    """Build ``Settings`` from plain data (a parsed YAML document)."""
    result = _build(Settings, data, "")
    assert isinstance(result, Settings)
    return result


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return type(value).__name__


#: settings of earlier versions that are now ignored (with a warning), and why
_REMOVED = {
    "enrich.cache_size": "the splice keeps no per-series state since 0.2 (docs/wire.md)",
}


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "top level"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{where}: keys must be strings, got {raw_key!r}")
        key = raw_key.replace("-", "_")
        if _key(prefix, key) in _REMOVED:
            log.warning("ignoring a removed setting", extra={
                "key": _key(prefix, key), "reason": _REMOVED[_key(prefix, key)]})
            continue
        if key not in known:
            raise ConfigError(
                f"unknown key '{_key(prefix, raw_key)}' (known keys here: "
                f"{', '.join(sorted(known))})"
            )
        kwargs[key] = _convert(hints[key], value, _key(prefix, key))
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str) -> Any:
    if tp is PodLabelPair:
        return _pod_label_pair(value, key)
    if is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value, key)
    origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_type_name(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_type_name(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {_type_name(value)} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_type_name(value)} {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_type_name(value)} {value!r}")
        return [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_type_name(value)} {value!r}")
        out: dict[str, str] = {}
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"{key}: entries must be string: string, got {k!r}: {v!r}")
            out[k] = v
        return out
    if origin is tuple:
        return _pair(value, key)
    raise ConfigError(f"{key}: unsupported setting type {tp!r}")  # pragma: no cover


def _pair(value: Any, key: str) -> tuple[str, str]:
    """A (namespace label, pod label) pair: ``[ns, pod]`` or ``{namespace: .., pod: ..}``."""
    if isinstance(value, dict):
        if set(value) != {"namespace", "pod"}:
            raise ConfigError(
                f"{key}: expected keys 'namespace' and 'pod', got {sorted(map(str, value))}"
            )
        value = [value["namespace"], value["pod"]]
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ConfigError(
            f"{key}: expected a pair [namespace_label, pod_label] of non-empty strings, "
            f"got {value!r}"
        )
    return (value[0], value[1])


def _pod_label_pair(value: Any, key: str) -> PodLabelPair:
    """``[ns, pod]``, or ``{namespace: .., pod: .., unless: {label: regex}}``."""
    if isinstance(value, dict) and "unless" in value:
        rest = {k: v for k, v in value.items() if k != "unless"}
        ns, pod = _pair(rest, key)
        unless = _convert(dict[str, str], value["unless"], f"{key}.unless")
        return PodLabelPair(ns, pod, unless)
    ns, pod = _pair(value, key)
    return PodLabelPair(ns, pod)


# -- validation -----------------------------------------------------------------------------


def parse_host_port(address: str, key: str = "server.listen_address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); an empty host means all interfaces."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ConfigError(f"{key}: expected HOST:PORT, got {address!r}")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} out of range 0-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", port


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}; got {value!r}")


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be greater than 0, got {value!r}")


def _readable(path: str, key: str) -> None:
    if path and not os.access(path, os.R_OK):
        raise ConfigError(f"{key}: file {path!r} does not exist or is not readable")


#: ``server.tls_client_auth_type`` values (Prometheus web-config names)
CLIENT_AUTH_TYPES = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


def client_auth_type(s: ServerSettings) -> str:
    """The client-certificate policy in force: the setting, or its default for the CA."""
    if s.tls_client_auth_type:
        return s.tls_client_auth_type
    return "RequireAndVerifyClientCert" if s.tls_client_ca_file else "NoClientCert"


def _validate_server_tls(s: ServerSettings) -> None:
    """The listening side's TLS: pairs set together, files readable and loadable.

    The certificate and key are loaded here, so a key that does not match its certificate
    (or a file that is not PEM) is a ConfigError at start, and a failed reload, rather than
    a handshake error on every connection.
    """
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        raise ConfigError("server.tls_cert_file and server.tls_key_file: set both or neither")
    if s.tls_client_auth_type:
        _one_of(s.tls_client_auth_type, CLIENT_AUTH_TYPES, "server.tls_client_auth_type")
    if not s.tls_cert_file:
        if s.tls_client_ca_file or s.tls_client_auth_type:
            raise ConfigError("server.tls_client_ca_file / server.tls_client_auth_type: need "
                              "server.tls_cert_file and server.tls_key_file (TLS is off)")
        return
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        _readable(getattr(s, name), f"server.{name}")
    mode = client_auth_type(s)
    if mode != "NoClientCert" and not s.tls_client_ca_file:
        raise ConfigError(f"server.tls_client_auth_type: {mode} needs server.tls_client_ca_file "
                          "(the CA that client certificates must chain to)")
    if mode == "NoClientCert" and s.tls_client_ca_file:
        raise ConfigError("server.tls_client_ca_file: set, but server.tls_client_auth_type is "
                          "NoClientCert, so no client certificate would be checked")
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        probe.load_cert_chain(s.tls_cert_file, s.tls_key_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"server.tls_cert_file / server.tls_key_file: cannot load "
                          f"{s.tls_cert_file!r} with {s.tls_key_file!r}: {e}") from None
    if s.tls_client_ca_file:
        try:
            probe.load_verify_locations(cafile=s.tls_client_ca_file)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"server.tls_client_ca_file: cannot load "
                              f"{s.tls_client_ca_file!r}: {e}") from None


def validate(settings: Settings, *, require_upstream: bool = True) -> None:
    """Check what the types cannot: ranges, choices, URLs, files that must exist.

    Raises ``ConfigError`` naming the first bad key; the CLI turns it into one line and
    exit code 2, so a bad setting never turns into a half-started proxy.
    """
    s = settings
    parse_host_port(s.server.listen_address)
    _positive(s.server.max_body_bytes, "server.max_body_bytes")
    _positive(s.server.max_decoded_bytes, "server.max_decoded_bytes")
    _positive(s.server.max_concurrent_requests, "server.max_concurrent_requests")
    if not 0 <= s.server.worker_threads <= 256:
        raise ConfigError(
            f"server.worker_threads: must be 0 (one per core) to 256, got {s.server.worker_threads}"
        )
    _positive(s.server.max_inflight_bytes, "server.max_inflight_bytes")
    _positive(s.server.header_read_timeout_seconds, "server.header_read_timeout_seconds")
    _positive(s.server.body_read_timeout_seconds, "server.body_read_timeout_seconds")
    _positive(s.server.min_body_bytes_per_second, "server.min_body_bytes_per_second")
    if s.server.max_inflight_bytes < s.server.max_body_bytes:
        raise ConfigError(
            "server.max_inflight_bytes: must be at least server.max_body_bytes "
            f"({s.server.max_body_bytes}), got {s.server.max_inflight_bytes}"
        )
    _validate_server_tls(s.server)

    u = s.upstream
    if require_upstream and not u.url:
        raise ConfigError("upstream.url: required: the TSDB's remote-write URL, e.g. "
                          "--upstream-url http://prometheus:9090/api/v1/write")
    if u.url:
        parsed = urlsplit(u.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"upstream.url: expected an http:// or https:// URL, got {u.url!r}")
        if u.url.count("{") != u.url.count("{tenant}") or u.url.count("}") != u.url.count(
                "{tenant}"):
            raise ConfigError(f"upstream.url: the only placeholder is {{tenant}}, got {u.url!r}")
    if not TENANT.fullmatch(u.default_tenant):
        raise ConfigError("upstream.default_tenant: a VictoriaMetrics tenant: accountID or "
                          f"accountID:projectID (numbers), got {u.default_tenant!r}")
    _positive(u.timeout_seconds, "upstream.timeout_seconds")
    _positive(u.connect_timeout_seconds, "upstream.connect_timeout_seconds")
    _positive(u.max_connections, "upstream.max_connections")
    _one_of(u.protocol, _PROTOCOLS, "upstream.protocol")
    _one_of(u.encoding, _ENCODINGS, "upstream.encoding")
    if bool(u.tls_cert_file) != bool(u.tls_key_file):
        raise ConfigError("upstream.tls_cert_file and upstream.tls_key_file: set both or neither")
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file", "bearer_token_file",
                 "basic_auth_password_file"):
        _readable(getattr(u, name), f"upstream.{name}")
    if u.bearer_token_file and (u.basic_auth_username or u.basic_auth_password_file):
        raise ConfigError(
            "upstream.bearer_token_file and upstream.basic_auth_*: choose one kind of auth"
        )
    if bool(u.basic_auth_username) != bool(u.basic_auth_password_file):
        raise ConfigError(
            "upstream.basic_auth_username and upstream.basic_auth_password_file: set both"
        )
    for i, h in enumerate(u.forward_headers):
        if not h or any(c in h for c in " :\r\n"):
            raise ConfigError(f"upstream.forward_headers[{i}]: not a header name: {h!r}")

    e = s.enrich
    if not e.pod_label_pairs:
        raise ConfigError("enrich.pod_label_pairs: at least one (namespace, pod) pair")
    for i, rule in enumerate(e.pod_label_rules):
        where = f"enrich.pod_label_rules[{i}]"
        if not rule.metric_prefix:
            raise ConfigError(f"{where}.metric_prefix: must not be empty")
        if not rule.pod_label_pairs:
            raise ConfigError(f"{where}.pod_label_pairs: at least one (namespace, pod) pair")
        for j, pair in enumerate(rule.pod_label_pairs):
            for label, pattern in pair.unless.items():
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(
                        f"{where}.pod_label_pairs[{j}].unless.{label}: invalid regular "
                        f"expression {pattern!r}: {exc}"
                    ) from None
    _one_of(e.conflict_policy, _CONFLICT_POLICIES, "enrich.conflict_policy")
    _one_of(e.sender_karta_labels, _SENDER_KARTA_LABELS, "enrich.sender_karta_labels")
    names = {n for pair in e.pod_label_pairs for n in pair} | {
        n for rule in e.pod_label_rules for p in rule.pod_label_pairs
        for n in (p.namespace, p.pod, *p.unless)}
    if "" in names:
        raise ConfigError("enrich: a label name of pod_label_pairs or pod_label_rules is empty")
    if len(names) > MAX_LABEL_NAMES - 10:
        raise ConfigError(f"enrich: pod_label_pairs and pod_label_rules name {len(names)} "
                          f"distinct labels; at most {MAX_LABEL_NAMES - 10}")

    k = s.karta
    for i, p in enumerate(k.description_paths):
        if not os.path.exists(p):
            raise ConfigError(f"karta.description_paths[{i}]: {p!r} does not exist")
    if k.max_owner_hops < 1:
        raise ConfigError(f"karta.max_owner_hops: must be 1 or more, got {k.max_owner_hops}")
    if k.tombstone_seconds < 0:
        raise ConfigError(f"karta.tombstone_seconds: must be 0 or more, got {k.tombstone_seconds}")

    if s.kube.kubeconfig and not s.snapshot:
        _readable(s.kube.kubeconfig, "kube.kubeconfig")
    _positive(s.kube.resync_backoff_max_seconds, "kube.resync_backoff_max_seconds")

    f = s.facts
    _positive(f.interval_seconds, "facts.interval_seconds")
    _positive(f.lease_duration_seconds, "facts.lease_duration_seconds")

    if s.snapshot and not os.path.exists(s.snapshot):
        raise ConfigError(f"snapshot: {s.snapshot!r} does not exist")
    if s.snapshot_reload_seconds < 0:
        raise ConfigError(
            f"snapshot_reload_seconds: must be 0 (off) or more, got {s.snapshot_reload_seconds}"
        )
    _one_of(s.log_level.lower(), _LOG_LEVELS, "log_level")
    _one_of(s.log_format, _LOG_FORMATS, "log_format")
