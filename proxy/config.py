"""Every setting of the proxy, with its default; the YAML file and the flags fill these.

One dataclass per concern. ``load_settings`` (YAML) and ``proxy.cli`` (flags, which win)
produce a ``Settings``; ``docs/configuration.md`` documents every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class EnrichSettings:
    #: ordered (namespace label, pod label) pairs; the first pair present in a series wins
    pod_label_pairs: list[tuple[str, str]] = field(
        default_factory=lambda: [
            ("exported_namespace", "exported_pod"),
            ("namespace", "pod"),
            ("pod_namespace", "pod_name"),
        ]
    )
    #: "replace": stamped labels replace same-named labels a sender sent;
    #: "keep": a series that already carries karta_workload passes through unchanged
    conflict_policy: str = "replace"
    #: entries of the per-series cache keyed by label bytes
    cache_size: int = 500_000


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
    lease_namespace: str = "default"
    lease_duration_seconds: float = 15.0
    #: identity in the lease; defaults to the hostname
    identity: str = ""
    #: labels added to every fact series (e.g. cluster)
    external_labels: dict[str, str] = field(default_factory=dict)


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
    log_level: str = "info"
    #: "json" or "text"
    log_format: str = "json"
