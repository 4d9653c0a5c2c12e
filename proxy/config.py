"""Every setting of the proxy, declared once: type, choices, bounds, default, one-line help.

The declaration is a tree of msgspec ``Struct``s. From it come the YAML decoder and its
errors (``load_settings``), the flags (``proxy.cli``), the commented example
``config/karta-proxy.yaml`` and the settings tables of ``docs/configuration.md``
(``proxy.config_docs``; tests/test_config.py fails when they drift). What one value cannot
say about itself (pairs set together, files that must be readable, a URL's placeholder)
is checked by the small ``validate`` at the end.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import math
import os
import re
import ssl
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, get_args, get_origin, get_type_hints
from urllib.parse import unquote, urlsplit

import msgspec
import yaml
from msgspec import Meta, Struct, field
from msgspec import inspect as mi

from proxy import contract
from proxy.egress_proxy import EgressRoutes, parse_egress
from proxy.karta.yamltext import DuplicateKey, refusal, yaml_error
from proxy.shown import shown_url, without_userinfo
from proxy.tls_files import (
    HEADER_VALUE_FORBIDDEN,
    VERIFY_MODES,
    CredentialError,
    Loading,
    Part,
    client_context,
    read_credential,
    server_context,
)
from proxy.upstream_url import TENANT_PLACEHOLDER, own_extra_label, tenant_url
from proxy.wire.plan import MAX_LABEL_NAMES

log = logging.getLogger("karta.config")

#: a VictoriaMetrics cluster tenant: ``accountID`` or ``accountID:projectID`` (uint32s)
TENANT = re.compile(r"[0-9]{1,10}(:[0-9]{1,10})?")  # ASCII digits: \d takes any script's

MiB = 1024 * 1024
#: upper bounds of the integer settings that reach C code or C-sized values (the native
#: splice's Py_ssize_t, a snappy header's 32-bit length): a value past them was taken,
#: then failed as an OverflowError at start (a traceback, exit 1) or halfway through a
#: reload; each is far past any real use
MAX_BODY_BYTES = 1 << 32
MAX_INFLIGHT_BYTES = 1 << 40
MAX_LABELS_PER_SERIES = 1 << 16


class ConfigError(ValueError):
    """A setting is invalid; the message names the key and why."""


class Flag(NamedTuple):
    """How a setting is reached from the command line; ``proxy.cli`` builds the parser."""

    #: the flag and its aliases (``--web.listen-address``: Prometheus' name)
    names: tuple[str, ...]
    #: the ``--help`` section it is listed in
    group: str
    metavar: str | None = None
    #: overrides the setting's help (a ``--no-*`` switch says what switching off does)
    help: str = ""
    #: a list setting: "replace" the file's list with the repeated flag's values, or
    #: "extend" it
    repeat: Literal["", "replace", "extend"] = ""
    #: an environment variable that stands in for the absent flag
    env: str = ""
    #: whether ``env`` beats the YAML file (as the flag would) or only the default
    env_over_file: bool = True


def setting(help: str, *, flag: Flag | None = None, example: Any = None,
            default_doc: str = "", **bounds: Any) -> Meta:
    """The metadata of one setting: its help and flag ride in ``Meta.extra``.

    ``example`` is the value config/karta-proxy.yaml shows instead of the default (a
    required URL); ``default_doc`` replaces the rendered default in docs/configuration.md.
    A choice (a ``Literal``) is matched without regard to case, in the file and on the
    command line, and taken as declared (``log_level: INFO``, ``encoding: ZSTD``).
    """
    extra: dict[str, Any] = {"help": help}
    if flag is not None:
        extra["flag"] = flag
    if example is not None:
        extra["example"] = example
    if default_doc:
        extra["default_doc"] = default_doc
    return Meta(description=help, extra=extra, **bounds)


class Section(Struct, forbid_unknown_fields=True):
    """A group of settings (a YAML mapping); strict, so a typo is an error."""


LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["auto", "json", "text"]
#: ``server.tls_client_auth_type`` values (Prometheus web-config names); "" picks by the CA
ClientAuthType = Literal["", "NoClientCert", "VerifyClientCertIfGiven",
                         "RequireAndVerifyClientCert"]
UpstreamProtocol = Literal["auto", "v1", "passthrough"]
Encoding = Literal["snappy", "zstd", "same"]
ConflictPolicy = Literal["replace", "keep"]
SenderKartaLabels = Literal["drop", "keep"]

#: a (namespace label, pod label) pair; YAML ``[ns, pod]`` or ``{namespace: ns, pod: pod}``
LabelPair = tuple[str, str]

SERVING, UPSTREAM, SOURCE, DESCRIPTIONS, FACTS = (
    "serving", "upstream", "index source", "descriptions", "facts")


class ServerSettings(Section):
    """Where and how remote write is served, and the bounds that keep the proxy up."""

    listen_address: Annotated[str, setting(
        "HOST:PORT of remote write, /metrics, /-/healthy and /-/ready; :PORT or [::]:PORT: "
        "every interface, IPv4 and IPv6; 0.0.0.0:PORT: IPv4 only; an IPv6 address in "
        "brackets, [fd00::5]:9091",
        flag=Flag(("--listen-address", "--web.listen-address"), SERVING, "HOST:PORT"))
    ] = ":9091"
    max_body_bytes: Annotated[int, setting(
        "compressed request body limit in bytes; larger requests get 413; at most 4 GiB",
        ge=1, le=MAX_BODY_BYTES)] = 16 * MiB
    max_decoded_bytes: Annotated[int, setting(
        "decoded size limit, read from the snappy/zstd header before decompressing; "
        "larger bodies get 413; at most 4 GiB (a snappy body's length is 32 bits)",
        ge=1, le=MAX_BODY_BYTES)] = 64 * MiB
    max_concurrent_requests: Annotated[int, setting(
        "requests processed at once; past it a request waits up to admission_wait_seconds "
        "for a slot (three per slot may wait), then 503 + Retry-After; at most 65536",
        ge=1, le=65536)] = 64
    admission_wait_seconds: Annotated[float, setting(
        "how long a request that finds every slot taken waits for one, in arrival order, "
        "with its body unread; 0: 503 at once", ge=0, le=30)] = 2.0
    max_inflight_bytes: Annotated[int, setting(
        "bytes of requests held at once (compressed body, twice the decoded size until "
        "spliced, more as the splice grows past it, then the outgoing body); past it 503 + "
        "Retry-After, but a request alone in flight is always taken; at least "
        "max_body_bytes, at most 1 TiB", ge=1, le=MAX_INFLIGHT_BYTES)] = 512 * MiB
    enable_lifecycle: Annotated[bool, setting(
        "serve POST /-/reload, as Prometheus' --web.enable-lifecycle does; off: it answers "
        "403, and SIGHUP reloads (the endpoint is served to whoever reaches the port)",
        flag=Flag(("--web.enable-lifecycle",), SERVING))] = False
    forward_before_ready: Annotated[bool, setting(
        "until the index is loaded, forward requests unenriched (and report ready) instead "
        "of answering 503 (the sender's karta_* labels are dropped as ever)",
        flag=Flag(("--forward-before-ready",), SERVING))] = False
    worker_threads: Annotated[int, setting(
        "threads that decompress, splice and compress requests; 0: one per usable core",
        ge=0, le=256)] = 0
    max_connections: Annotated[int, setting(
        "client connections open at once (TLS handshakes included); past it a new one is "
        "closed at once, and the sender reconnects and retries. 4096: a fleet of hundreds "
        "of Prometheus/vmagent senders with their keep-alive pools (one per shard or queue) "
        "fits, while the work is bounded by max_concurrent_requests anyway; it bounds "
        "what connections hold before their requests are handled (docs/operations.md); "
        "at most 1048576", ge=1, le=1 << 20)] = 4096
    max_header_bytes: Annotated[int, setting(
        "request line and headers of one request, in all (one line at most 8190 bytes, at "
        "most 64 headers); larger gets 431 and the connection closed. Remote-write senders "
        "send ~10 headers under 2 KiB; a bearer token of a few KiB fits",
        ge=1024, le=1 << 20)] = 16 * 1024
    header_read_timeout_seconds: Annotated[float, setting(
        "a request's line and headers must arrive within this (from their first byte), "
        "else 408 and close; with TLS, also the handshake's deadline", gt=0)] = 10.0
    body_read_timeout_seconds: Annotated[float, setting(
        "a request's whole body must arrive within this (from the end of its headers), "
        "else 503 (the sender sends it again)", gt=0)] = 30.0
    min_body_bytes_per_second: Annotated[int, setting(
        "and never slower than this on average (after its first second), else 503; at "
        "most 4 GiB/s", ge=1, le=MAX_BODY_BYTES)] = 16384
    send_timeout_seconds: Annotated[float, setting(
        "an answer the client does not take: once the proxy holds bytes of it the kernel "
        "could not send (the client not reading), they must all be sent within this, else "
        "the connection is aborted and its answer's memory released", gt=0)] = 30.0
    keepalive_timeout_seconds: Annotated[float, setting(
        "an idle keep-alive connection (no request since its last answer) is closed after "
        "this; at server.max_connections the longest idle one is closed at once to make room "
        "for a new connection. Remote-write senders post every few seconds on theirs",
        gt=0)] = 75.0
    tls_cert_file: Annotated[str, setting(
        "serve HTTPS with this certificate (PEM, chain after the leaf), re-read when it "
        "changes; needs tls_key_file",
        flag=Flag(("--tls-cert-file",), SERVING, "PATH"))] = ""
    tls_key_file: Annotated[str, setting(
        "the certificate's private key (PEM)",
        flag=Flag(("--tls-key-file",), SERVING, "PATH"))] = ""
    tls_client_ca_file: Annotated[str, setting(
        "mutual TLS: CA bundle (PEM) that client certificates must chain to; each "
        "certificate in it is a trust anchor, an intermediate alone too",
        flag=Flag(("--tls-client-ca-file",), SERVING, "PATH"))] = ""
    tls_client_auth_type: Annotated[ClientAuthType, setting(
        "client certificate policy, as Prometheus' web config; empty: "
        "RequireAndVerifyClientCert with a client CA, else NoClientCert",
        flag=Flag(("--tls-client-auth-type",), SERVING))] = ""


def _default_forward_headers() -> list[str]:
    # not X-Prometheus-Remote-Write-Version (listed before 1.10.0): never forwarded, the
    # proxy sets its own (NEVER_FORWARDED)
    return ["Authorization", "X-Scope-OrgID", "THANOS-TENANT", "User-Agent"]


#: headers the proxy sets itself or that only mean something on one hop, as senders spell
#: them (Go's canonical form): never forwarded, whatever ``upstream.forward_headers`` lists
NEVER_FORWARDED = frozenset((
    "Host", "Content-Length", "Content-Type", "Content-Encoding", "Connection",
    "Keep-Alive", "Transfer-Encoding", "TE", "Trailer", "Upgrade", "Proxy-Authorization",
    "Proxy-Connection", "Accept-Encoding", "X-Prometheus-Remote-Write-Version",
    # the proxy appends its own entry to the sender's (proxy.via)
    "Via",
))
#: the same, in lower case: what a name in any spelling is compared with
NEVER_FORWARDED_LOWER = frozenset(h.lower() for h in NEVER_FORWARDED)


def never_forwarded(names: Iterable[str]) -> list[str]:
    """The names of ``upstream.forward_headers`` that are never forwarded (``NEVER_FORWARDED``),
    as written: listed, they are ignored."""
    return [n for n in names if n.lower() in NEVER_FORWARDED_LOWER]


def unforwarded_headers(u: UpstreamSettings) -> str:
    """The warning of a start whose ``upstream.forward_headers`` lists a header that is never
    forwarded, else "". Not an error: the default list before 1.10.0 held one
    (X-Prometheus-Remote-Write-Version), and config/karta-proxy.yaml copied it to files."""
    names = never_forwarded(u.forward_headers)
    if not names:
        return ""
    return (f"upstream.forward_headers lists {', '.join(names)}: never forwarded, whatever "
            "the list says (the proxy sets the body's headers and the remote-write version "
            "itself, and Host and the hop-by-hop headers are one connection's): remove them")


class OAuth2Settings(Section):
    """The OAuth 2.0 client credentials grant, as Prometheus' remote_write oauth2: any key
    set turns it on, and the token fetched is the proxy's Authorization."""

    client_id: Annotated[str, setting(
        "the OAuth 2.0 client's id; required with oauth2")] = ""
    client_secret_file: Annotated[str, setting(
        "the client's secret, in a file (whitespace around it trimmed), re-read when it "
        "changes: a new secret drops the token held and fetches one with it; required "
        "with oauth2")] = ""
    scopes: Annotated[list[str], setting(
        "scopes asked for (the token request's scope, space-separated)")
    ] = field(default_factory=list)
    token_url: Annotated[str, setting(
        "the token endpoint, http:// or https://; required with oauth2. The token it "
        "answers is every upstream request's Authorization, the fact writes' and the "
        "start's check's too, fetched again 10 s before it expires")] = ""
    endpoint_params: Annotated[dict[str, str], setting(
        "more form parameters of the token request (e.g. audience: ...)")
    ] = field(default_factory=dict)
    tls_ca_file: Annotated[str, setting(
        "CA bundle to verify an https:// token endpoint (default: the system's)")] = ""
    tls_cert_file: Annotated[str, setting(
        "client certificate toward the token endpoint; with tls_key_file")] = ""
    tls_key_file: Annotated[str, setting("its key")] = ""
    tls_insecure_skip_verify: Annotated[bool, setting(
        "do not verify the token endpoint's certificate")] = False
    proxy_url: Annotated[str, setting(
        "a proxy the token endpoint is reached through (http://host:port, https:// "
        "spoken to over TLS with these tls_* settings, or socks5://host:port; not "
        "upstream.proxy_url's, as in Prometheus)")] = ""


def oauth2_on(u: UpstreamSettings) -> bool:
    """Whether ``upstream.oauth2`` is set: any of its keys (then every required one must
    be), as Prometheus takes an ``oauth2:`` block."""
    return u.oauth2 != OAuth2Settings()


class UpstreamSettings(Section):
    """The one TSDB the enriched series are written to."""

    url: Annotated[str, setting(
        "remote-write URL of the TSDB, e.g. http://prometheus:9090/api/v1/write; required; "
        "the one placeholder is {tenant}; a user:password@ in it is sent as the proxy's "
        "Basic auth",
        flag=Flag(("--upstream-url",), UPSTREAM, "URL"),
        example="http://127.0.0.1:9090/api/v1/write", default_doc="(required)")] = ""
    timeout_seconds: Annotated[float, setting(
        "the time one sender's request gets upstream, every upstream request made for it "
        "together (a probe, an RW 2.0 post and its converted resend, the parts of a "
        "request sent in parts); the sender then gets 504. Keep it under the senders' "
        "own timeouts (Prometheus' remote_timeout, 30 s): the default leaves 5 s for "
        "reading and splicing the request, so the 504 reaches a sender still waiting. At "
        "most 600 (no sender waits longer: vmagent's -remoteWrite.sendTimeout is 1 min; "
        "25000 was milliseconds meant, and held each request's memory for 7 hours)",
        flag=Flag(("--upstream-timeout",), UPSTREAM, "SECONDS"), gt=0, le=600)] = 25.0
    connect_timeout_seconds: Annotated[float, setting(
        "timeout of the TCP/TLS connect phase", gt=0)] = 5.0
    max_connections: Annotated[int, setting(
        "pooled keep-alive connections to the upstream; at most 65536", ge=1,
        le=65536)] = 64
    idle_connection_seconds: Annotated[float, setting(
        "a pooled upstream connection idle this long is closed, not used again: keep it "
        "under the idle timeout of the upstream and of anything in front of it (HAProxy's "
        "timeout http-keep-alive, Node's keepAliveTimeout of 5 s), or a request sent as "
        "that side closes the connection meets the close on the wire: a 502 for a request "
        "nothing stored, which the sender sends again. The default is under VictoriaMetrics' "
        "and AWS ALB's 60 s, nginx's 75 s, Mimir's 120 s", ge=0.5, le=3600)] = 30.0
    follow_redirects: Annotated[bool, setting(
        "follow an upstream's 307 or 308 to its Location with the same body, as Prometheus' "
        "remote_write does (its follow_redirects, on by default; at most 10 requests, as "
        "Go's client): a round trip more per request, logged; set url to the target. "
        "301, 302 and 303 are never followed (a client makes the POST a GET without its "
        "body); off, a 307 / 308 is answered 503 as a wrong url")] = True
    protocol: Annotated[UpstreamProtocol, setting(
        "RW 2.0 toward the upstream: auto converts to RW 1.0 after a 415 or a 2xx without "
        "Written headers and remembers, v1 "
        "always converts, passthrough never",
        flag=Flag(("--upstream-protocol",), UPSTREAM))] = "auto"
    tls_ca_file: Annotated[str, setting(
        "CA bundle to verify an https:// upstream, re-read when it changes")] = ""
    tls_cert_file: Annotated[str, setting(
        "client certificate toward the upstream (mTLS); with tls_key_file; re-read when "
        "it changes")] = ""
    tls_key_file: Annotated[str, setting("the client certificate's key")] = ""
    tls_insecure_skip_verify: Annotated[bool, setting(
        "do not verify the upstream's certificate")] = False
    tls_server_name: Annotated[str, setting(
        "server name for SNI and verification when it differs from the URL's host")] = ""
    proxy_url: Annotated[str, setting(
        "a proxy the upstream is reached through, as Prometheus' remote_write "
        "proxy_url: http://host:port, a user:password@ in it sent as Proxy-Authorization "
        "(Basic), an https:// upstream through a CONNECT tunnel; https://host:port: the "
        "same spoken to over TLS, verified with the upstream's tls_* settings as Go "
        "does; or a SOCKS5 proxy, "
        "socks5://host:port (default port 1080), the upstream's name resolved by the "
        "proxy, a user:password@ in it as RFC 1929's. Every upstream request, unless "
        "no_proxy names its host",
        flag=Flag(("--upstream-proxy-url",), UPSTREAM, "URL"))] = ""
    no_proxy: Annotated[str, setting(
        "with proxy_url: the upstream hosts reached directly, comma-separated, as Go reads "
        "NO_PROXY: a name (and its subdomains), .name (its subdomains only), an IP "
        "address, a CIDR range, each optionally with :port, or * (every host); localhost "
        "and loopback addresses are then reached directly too")] = ""
    proxy_from_environment: Annotated[bool, setting(
        "reach the upstream through the proxy of the environment, as Prometheus' "
        "proxy_from_environment: HTTP_PROXY for an http:// upstream, HTTPS_PROXY for an "
        "https:// one, NO_PROXY (each upper or lower case), read at start; instead of "
        "proxy_url")] = False
    proxy_connect_header: Annotated[dict[str, list[str]], setting(
        "headers sent to the HTTP proxy with the CONNECT of an https:// upstream, as "
        "Prometheus' proxy_connect_header (a name: [values]; a proxy's own credentials "
        "of another kind than Basic); never with anything else, as Go sends them")
    ] = field(default_factory=dict)
    bearer_token_file: Annotated[str, setting(
        "bearer token for the upstream, re-read when the file changes",
        flag=Flag(("--upstream-bearer-token-file",), UPSTREAM, "PATH"))] = ""
    basic_auth_username: Annotated[str, setting(
        "basic auth user; with basic_auth_password_file")] = ""
    basic_auth_password_file: Annotated[str, setting(
        "basic auth password file, re-read when it changes")] = ""
    forward_headers: Annotated[list[str], setting(
        "request headers passed from the sender to the upstream unchanged, every value in "
        "order (case-insensitive; never one the sender's Connection header names)")
    ] = field(default_factory=_default_forward_headers)
    headers: Annotated[dict[str, str], setting(
        "headers set on every upstream request (e.g. X-Scope-OrgID: team-a); each replaces "
        "every value of its name a sender sent, whatever the spelling")
    ] = field(default_factory=dict)
    pass_through_429: Annotated[bool, setting(
        "answer 429 when the upstream answers 429 (off: 503 + Retry-After, which senders "
        "retry)")] = False
    encoding: Annotated[Encoding, setting(
        "body encoding toward the upstream: snappy (every receiver takes it), zstd, or same "
        "(as the sender's)")] = "snappy"
    rw1_confirms_histograms: Annotated[bool, setting(
        "an RW 2.0 request converted for a 1.0-only upstream: its 2xx is taken to mean the "
        "native histograms were stored (Histograms-Written); off: 0 is claimed, since "
        "VictoriaMetrics drops them and still answers 2xx. On for Prometheus, Mimir or "
        "Thanos with native histograms on")] = False
    rw1_confirms_exemplars: Annotated[bool, setting(
        "the same for exemplars (Exemplars-Written); off: 0 is claimed, since Prometheus "
        "and VictoriaMetrics drop exemplars and still answer 2xx. Keep it off for "
        "Prometheus, exemplar storage on or not: it never refuses a request for an exemplar "
        "it drops (out of order, labels over 128 characters, on a new histogram series)")
    ] = False
    max_labels_per_series: Annotated[int, setting(
        "the TSDB's limit of labels per series (0: none); the default is VictoriaMetrics' "
        "-maxLabelsPerTimeseries and Mimir's max_label_names_per_series. A series the stamp "
        "would push past it is forwarded unstamped (series_unattributed reason "
        "label_limit), where VictoriaMetrics would drop the labels that sort last (series "
        "merge, samples lost behind a 204) and Mimir refuse the whole request; so is one "
        "the sender sent past it; at most 65536", ge=0, le=MAX_LABELS_PER_SERIES)] = 30
    default_tenant: Annotated[str, setting(
        "the tenant put in a {tenant} of url for requests whose path names none, and for the "
        "fact series (accountID or accountID:projectID); another than 0 with no {tenant} in "
        "url is a settings error")] = "0"
    oauth2: OAuth2Settings = field(default_factory=OAuth2Settings)


class PodLabelPair(Struct, forbid_unknown_fields=True):
    """A (namespace label, pod label) pair with labels that disqualify it."""

    namespace: Annotated[str, Meta(min_length=1)]
    pod: Annotated[str, Meta(min_length=1)]
    #: label -> regular expression (anchored at both ends, like a PromQL ``=~``): the pair
    #: is not used when the series' value of that label (a missing label reads "") matches
    unless: dict[str, str] = field(default_factory=dict)


#: the exporter's own container names: a DCGM series whose plain (namespace, pod) comes
#: with one of these (or with no container at all) names the exporter, not a GPU's pod
DCGM_EXPORTER_CONTAINERS = "|nvidia-dcgm-exporter|dcgm-exporter|exporter"


class PodLabelRule(Struct, forbid_unknown_fields=True):
    """Which labels name the pod for metrics whose name starts with ``metric_prefix``."""

    metric_prefix: Annotated[str, Meta(min_length=1)]
    #: ordered like ``enrich.pod_label_pairs``; the first usable pair wins
    pod_label_pairs: Annotated[list[PodLabelPair], Meta(min_length=1)]


def _default_pod_label_pairs() -> list[LabelPair]:
    # No exported_* pair here: under honor_labels false Prometheus renames a target's own
    # namespace/pod labels exported_*, so any scraped application could name another
    # namespace's pod there and have its series charged to that pod's workload. The
    # exporters that report on other pods get the exported pair per metric prefix
    # (_default_pod_label_rules), where it trusts only who can emit that prefix.
    return [("namespace", "pod"), ("pod_namespace", "pod_name")]


def _default_pod_label_rules() -> list[PodLabelRule]:
    # DCGM: under honor_labels false the GPU's pod is exported_*, and the plain pair is
    # always the exporter's (its container label, a target label, is the exporter's). Under
    # honor_labels true the plain pair + container are the GPU's pod. An idle GPU has only
    # the target's pair: without a container, or with the exporter's.
    # kube-state-metrics: under honor_labels false the object's pod is exported_* (the
    # plain pair is KSM's own pod); under honor_labels true it is the plain pair.
    return [
        PodLabelRule(
            metric_prefix="DCGM_",
            pod_label_pairs=[
                PodLabelPair("exported_namespace", "exported_pod"),
                PodLabelPair("pod_namespace", "pod_name"),
                PodLabelPair("namespace", "pod", {"container": DCGM_EXPORTER_CONTAINERS}),
            ],
        ),
        PodLabelRule(
            metric_prefix="kube_",
            pod_label_pairs=[
                PodLabelPair("exported_namespace", "exported_pod"),
                PodLabelPair("namespace", "pod"),
            ],
        ),
    ]


class EnrichSettings(Section):
    """Which labels name a series' pod, and what happens to the sender's karta_* labels."""

    pod_label_pairs: Annotated[list[LabelPair], setting(
        "ordered (namespace label, pod label) pairs; the first pair present in a series "
        "names its pod", min_length=1)] = field(default_factory=_default_pod_label_pairs)
    pod_label_rules: Annotated[list[PodLabelRule], setting(
        "pod label pairs per metric-name prefix, instead of pod_label_pairs (the first "
        "matching prefix wins); a pair may carry unless: {label: regex}")
    ] = field(default_factory=_default_pod_label_rules)
    conflict_policy: Annotated[ConflictPolicy, setting(
        "a karta_* label the sender sent: replace (stamped labels win) or keep (a series "
        "that carries karta_workload passes unchanged)")] = "replace"
    sender_karta_labels: Annotated[SenderKartaLabels, setting(
        "other karta_* labels of the sender: drop (from every series) or keep (only the "
        "stamped names, from stamped series)")] = "drop"
    cluster_label: Annotated[str, setting(
        "the label that names a series' cluster: a series whose value of it is not "
        "empty and differs from this proxy's (facts.external_labels' value of the same "
        "label) is forwarded unstamped (series_unattributed reason other_cluster), since "
        "the pod index is this cluster's only; a series without it is stamped. A request "
        "whose URL as forwarded sets it to another value (VictoriaMetrics' extra_label) "
        "is forwarded unstamped whole; an upstream.url whose own does (upstream.default_tenant "
        "in a {tenant}) is a settings error. Off when facts.external_labels has no such "
        "label; \"\": off")] = "cluster"


class KartaSettings(Section):
    """The descriptions that attribute pods to workloads, components and instances."""

    description_paths: Annotated[list[str], setting(
        "files or folders of Karta / ResourceInterface descriptions (YAML or JSON)",
        flag=Flag(("--description",), DESCRIPTIONS, "PATH", repeat="extend"))
    ] = field(default_factory=list)
    builtins: Annotated[bool, setting(
        "the project's descriptions of core kinds (Deployment, StatefulSet, Job, ...)",
        flag=Flag(("--no-builtin-descriptions",), DESCRIPTIONS,
                  help="switch off the built-in descriptions of core kinds"))] = True
    max_owner_hops: Annotated[int, setting(
        "bound on owner-reference walks; at most 100", ge=1, le=100)] = 6
    tombstone_seconds: Annotated[float, setting(
        "how long a deleted pod keeps its labels (longer than Prometheus' 5 m lookback)",
        ge=0)] = 600.0
    jq_sandbox: Annotated[bool, setting(
        "evaluate the descriptions' jq expressions in a child process bounded in time and "
        "memory (off: in the proxy's own process, where libjq can be neither interrupted "
        "nor bounded, and aborts the process when it runs out of memory)")] = True
    jq_timeout_seconds: Annotated[float, setting(
        "the time one jq evaluation may take in the sandbox; past it the child is killed "
        "and restarted and the evaluation is a jq error", gt=0, le=60)] = 1.0
    jq_memory_limit_bytes: Annotated[int, setting(
        "the sandbox child's address-space limit (RLIMIT_AS); an evaluation that needs "
        "more takes the child down and is a jq error. The child's memory counts toward "
        "the pod's memory limit; at least 64 MiB", ge=64 * MiB, le=1 << 40)
    ] = 256 * MiB


class KubeSettings(Section):
    """The cluster the index is watched from (unless snapshot is set)."""

    kubeconfig: Annotated[str, setting(
        "kubeconfig of the cluster to watch (of a path list, as kubectl takes, the first "
        "file); empty: $KUBECONFIG, else the in-cluster service account, else "
        "~/.kube/config",
        flag=Flag(("--kubeconfig",), SOURCE, "PATH", env="KUBECONFIG",
                  env_over_file=False))] = ""
    namespaces: Annotated[list[str], setting(
        "namespaces to watch; empty: all",
        flag=Flag(("--namespace",), SOURCE, "NS", repeat="replace"))
    ] = field(default_factory=list)
    node_name: Annotated[str, setting(
        "node-scoped mode: watch only this node's pods (spec.nodeName); default $NODE_NAME",
        flag=Flag(("--node-name",), SOURCE, "NODE", env="NODE_NAME"))] = ""
    watch_descriptions: Annotated[bool, setting(
        "watch Karta / ResourceInterface objects in the cluster")] = True
    resync_backoff_max_seconds: Annotated[float, setting(
        "upper bound of the reconnect backoff", gt=0)] = 30.0


class FactSettings(Section):
    """The fact series (phase, replicas, freshness, info) the proxy writes upstream."""

    enabled: Annotated[bool, setting(
        "write fact series upstream",
        flag=Flag(("--no-facts",), FACTS, help="do not write fact series upstream"))] = True
    interval_seconds: Annotated[float, setting(
        "write interval; below 0.05 s the writer uses 0.05 s", gt=0)] = 15.0
    leader_election: Annotated[bool, setting(
        "elect one writer among replicas through a coordination.k8s.io Lease")] = False
    lease_name: Annotated[str, setting("the Lease's name")] = "karta-proxy-facts"
    lease_namespace: Annotated[str, setting(
        "the Lease's namespace; empty: the proxy's own ($POD_NAMESPACE, else the service "
        "account's)")] = ""
    lease_duration_seconds: Annotated[float, setting(
        "lease duration (the Lease's leaseDurationSeconds, an int32: at most 2147483647)",
        gt=0, le=2**31 - 1)] = 15.0
    identity: Annotated[str, setting(
        "identity in the lease, one per replica; empty: $POD_NAME (else the hostname) and a "
        "random suffix")
    ] = ""
    external_labels: Annotated[dict[str, str], setting(
        "labels added to every fact series (e.g. cluster: prod-1)")
    ] = field(default_factory=dict)
    headers: Annotated[dict[str, str], setting(
        "headers sent with every fact write and the upstream check's empty writes (never "
        "with a sender's request), e.g. X-Scope-OrgID: ops "
        "for Mimir or THANOS-TENANT: ops for Thanos Receive, whose tenant is a header: "
        "without one a multi-tenant Mimir answers 401 (no tenant gets the facts), a "
        "single-tenant one (-auth.enabled=false) and, by its docs, Thanos Receive store "
        "them in their default tenant. The facts go to this one tenant only, whatever "
        "tenants senders name. A name upstream.headers or the upstream credentials set too "
        "(they replace it) is a settings error. A VictoriaMetrics cluster's tenant is "
        "upstream.default_tenant")
    ] = field(default_factory=dict)
    metrics_pod_facts: Annotated[bool, setting(
        "serve the per-pod facts (karta_pod_info, ...) on /metrics too; off: at ~100k pods "
        "they make a scrape take 5-13 s")] = False
    max_clock_offset_seconds: Annotated[float, setting(
        "hold fact writes while this host's clock is more than this many seconds off the "
        "upstream's (the Date header of its answers; "
        "karta_proxy_upstream_clock_offset_seconds): fact samples stamped an hour ahead "
        "make a Prometheus refuse every writer's current samples for an hour, and Mimir "
        "refuses samples 10 min ahead; 0: no check", ge=0)] = 60.0
    allow_in_node_mode: Annotated[bool, setting(
        "write facts in node mode (kube.node_name) too, where a replica sees one node's "
        "pods only and its pod facts are partial; needs facts.leader_election (one "
        "writer among the node replicas)")] = False


class Settings(Section):
    """The whole configuration: the sections and a few top-level keys."""

    server: ServerSettings = field(default_factory=ServerSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    enrich: EnrichSettings = field(default_factory=EnrichSettings)
    karta: KartaSettings = field(default_factory=KartaSettings)
    kube: KubeSettings = field(default_factory=KubeSettings)
    facts: FactSettings = field(default_factory=FactSettings)
    snapshot: Annotated[str, setting(
        "file or folder of Kubernetes objects to build the index from; when set, no live "
        "cluster is used", flag=Flag(("--snapshot",), SOURCE, "PATH"))] = ""
    snapshot_reload_seconds: Annotated[float, setting(
        "poll the snapshot's files this often and apply what changed: a change is "
        "applied one poll after it is seen (two polls in a row must find the files "
        "unchanged, or holding the same bytes), so one to two intervals after the last "
        "write; 0 loads once",
        flag=Flag(("--snapshot-reload-seconds",), SOURCE, "SECONDS"), ge=0)] = 30.0
    log_level: Annotated[LogLevel, setting(
        "log level", flag=Flag(("--log-level",), SERVING))] = "info"
    log_format: Annotated[LogFormat, setting(
        "log format: auto (text when stderr is a terminal, else JSON), json or text",
        flag=Flag(("--log-format",), SERVING))] = "auto"


# -- the declaration, walked ----------------------------------------------------------------


class SettingInfo(NamedTuple):
    """One leaf setting of the declaration, as the CLI and the generated files see it."""

    #: dotted YAML key, e.g. ``server.max_body_bytes``
    key: str
    #: its section (``server``, ...); "" at the top level
    section: str
    #: msgspec's view of the type, constraints and all (``Metadata`` unwrapped)
    type: mi.Type
    default: Any
    help: str
    flag: Flag | None
    #: what config/karta-proxy.yaml shows (the default, or the declared example)
    example: Any
    #: the default column of docs/configuration.md when the rendered default is not it
    default_doc: str
    #: a ``Literal`` setting's values in declaration order, the empty "choose for me" left out
    #: (matched without regard to case: ``canonical_choice``)
    choices: tuple[str, ...]


def _unwrap(t: mi.Type) -> tuple[mi.Type, dict[str, Any]]:
    if isinstance(t, mi.Metadata):
        return t.type, dict(t.extra or {})
    return t, {}


def _default(f: mi.Field) -> Any:
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return f.default


def _literal_values(hint: Any) -> tuple[str, ...]:
    """A Literal's values as written (msgspec's view sorts them)."""
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    return tuple(str(v) for v in get_args(hint) if v) if get_origin(hint) is Literal else ()


def _walk(cls: type, prefix: str) -> Iterator[SettingInfo]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    hints = get_type_hints(cls, include_extras=True)
    for f in info.fields:
        t, extra = _unwrap(f.type)
        key = f"{prefix}{f.name}"
        if isinstance(t, mi.StructType) and issubclass(t.cls, Section):
            yield from _walk(t.cls, key + ".")
            continue
        default = _default(f)
        yield SettingInfo(key, prefix.rstrip("."), t, default, extra.get("help", ""),
                          extra.get("flag"), extra.get("example", default),
                          extra.get("default_doc", ""), _literal_values(hints[f.name]))


def schema() -> list[SettingInfo]:
    """Every leaf setting in declaration order (the order of the YAML file and the docs)."""
    return list(_walk(Settings, ""))


@functools.cache
def _choices_by_key() -> dict[str, tuple[str, ...]]:
    return {i.key: i.choices for i in schema() if i.choices}


# -- loading --------------------------------------------------------------------------------


def load_settings(path: str | os.PathLike[str], *, empty_ok: bool = True) -> Settings:
    """Read a YAML file into ``Settings``; unknown keys and wrong types are errors.

    Every message names the file and the dotted key, so a typo in a ConfigMap is found
    from the log line alone instead of being silently ignored. A file with no document
    (empty, only comments, ``null``) is every default; without ``empty_ok`` (a reload) it
    is refused: more likely caught mid-save than meant, and read as all defaults it reset
    enrich.*, the description paths and log_level with a 200. ``{}`` is all defaults.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: {yaml_error(e)}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    if data is None:
        if not empty_ok:
            raise ConfigError(f"{p}: the file holds no settings (empty, only comments, or "
                              "null): most likely caught mid-save; the configuration in "
                              "force stays (write {} for every default)")
        # said at start too: a file that should have held settings (a ConfigMap key
        # rendered empty, a file truncated) started on every default without a word
        log.warning("the config file holds no settings (empty, only comments, or null): "
                    "every setting is its flag's or its default; write {} to mean that",
                    extra={"file": str(p)})
        data = {}
    try:
        return settings_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that keeps the node whose value its tag could not build
    (``failed``), for a message that says where it is rather than quoting it."""

    failed: yaml.Node | None = None

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError):
            if self.failed is None:  # the innermost: the first to see it
                self.failed = node
            raise


def _load_yaml(text: str) -> Any:
    """The file's one document as PyYAML's safe loader builds it, a key written twice in
    one mapping refused first (``proxy.karta.yamltext.refusal``, the check Kubernetes
    documents get): YAML leaves duplicate keys to the application and PyYAML keeps the
    last, so a key given twice (two ``listen_address`` lines in one section, the second
    one forgotten) changed the setting silently. Aliases and merge keys are the
    operator's to use here, and a key of the mapping's own overriding a merged one is no
    duplicate. Checked on the composed nodes, before a merge is built into them."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        found = refusal(node, loader, aliases=True)
        if isinstance(found, DuplicateKey):
            raise ConfigError(f"{found.mapping or 'top level'}: key '{found.node.value}' is "
                              f"given more than once (again at line "
                              f"{found.node.start_mark.line + 1}); keep one")
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as e:
            # an explicit tag on a value it cannot be (``!!int abc``): PyYAML's
            # constructors raise plain Python errors, which escaped as a traceback. Said by
            # where it is and its type, not its text: ``int()``'s quotes the value, which
            # may be a credential (a tagged upstream.headers value)
            at = loader.failed
            where = (f"line {at.start_mark.line + 1}, column {at.start_mark.column + 1}: "
                     f"{at.tag.replace('tag:yaml.org,2002:', '!!')}: " if at is not None
                     else "")
            raise ConfigError(f"{where}a value its YAML tag cannot build ({type(e).__name__}; "
                              "the value is not shown: it may be a credential)") from None
    finally:
        loader.dispose()


def settings_from_dict(data: Any) -> Settings:
    """Build ``Settings`` from plain data (a parsed YAML document). A removed setting is
    said once the rest has been read: a file refused for another key printed the
    warning before its one error line."""
    removed: list[str] = []
    settings = _decode(_shape(mi.type_info(Settings), data, "", removed))
    for dotted in removed:
        log.warning("ignoring a removed setting",
                    extra={"key": dotted, "reason": _REMOVED[dotted]})
    return settings


def _decode(data: Any) -> Settings:
    try:
        settings = msgspec.convert(data, Settings)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e), data)) from None
    _refuse_non_finite(settings)
    return settings


@functools.cache
def _float_keys() -> tuple[str, ...]:
    return tuple(i.key for i in schema() if isinstance(i.type, mi.FloatType))


def _refuse_non_finite(settings: Settings) -> None:
    """A bound like ``gt=0`` lets ``.inf`` through (nan fails every comparison): an
    infinite timeout or interval starts fine, then fails every request it bounds (aiohttp
    cannot turn it into a deadline), so it is refused here for every float setting."""
    for key in _float_keys():
        value: Any = settings
        for part in key.split("."):
            value = getattr(value, part)
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")


#: settings of earlier versions that are now ignored (with a warning), and why
_REMOVED = {
    "enrich.cache_size": "the splice keeps no per-series state since 0.2.0 (docs/wire.md)",
}


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


def _shape(t: mi.Type, value: Any, key: str, removed: list[str]) -> Any:
    """What YAML allows beyond the declared shape, brought to it before msgspec decodes.

    Dashes for underscores, removed keys (a warning), unknown keys (with the known ones
    listed), and a pair written as ``[ns, pod]`` or as a mapping.
    """
    t, _ = _unwrap(t)
    if isinstance(t, mi.LiteralType) and isinstance(value, str):
        return canonical_choice(value, tuple(map(str, t.values)))
    if isinstance(t, mi.TupleType):
        return list(_pair(value, key))
    if isinstance(t, mi.ListType) and isinstance(value, list):
        return [_shape(t.item_type, v, f"{key}[{i}]", removed) for i, v in enumerate(value)]
    if isinstance(t, mi.DictType) and isinstance(t.value_type, mi.ListType) and \
            isinstance(value, dict):
        # one value written without its list (``X-Auth: token``), as a list of one
        return {k: [v] if isinstance(v, str) else v for k, v in value.items()}
    if not isinstance(t, mi.StructType):
        return value
    if t.cls is PodLabelPair:
        return _pod_label_pair(value, key)
    if not isinstance(value, dict):
        # ``server:`` with every key under it commented out holds null ("got null None")
        got = _NULL if value is None else f"{_type_name(value)} {_short(value)}"
        raise ConfigError(f"{key or 'top level'}: expected a mapping, got {got}")
    known = {f.name: f for f in t.fields}
    out: dict[str, Any] = {}
    written: dict[str, str] = {}  # name -> the key as written, to catch a name given twice
    for raw_key, v in value.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{key or 'top level'}: keys must be strings, got {raw_key!r}")
        name = raw_key.replace("-", "_")
        dotted = f"{key}.{name}" if key else name
        if name in written:
            raise ConfigError(f"{key or 'top level'}: '{written[name]}' and '{raw_key}' are the "
                              f"same key ({dotted}): keep one")
        written[name] = raw_key
        if dotted in _REMOVED:
            removed.append(dotted)
            continue
        if name not in known:
            raise ConfigError(f"unknown key '{key + '.' if key else ''}{raw_key}'"
                              f"{_did_you_mean(name, known, key)} (known keys here: "
                              f"{', '.join(sorted(known))})")
        out[name] = _shape(known[name].type, v, dotted, removed)
    return out


def _did_you_mean(name: str, known: Iterable[str], section: str) -> str:
    """The known key a misspelt one most likely meant (a letter swapped, dropped or
    doubled), or the one section that has the key: said first, as the list of known keys
    after it runs to 20 names in a section."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    if close:
        return f": did you mean '{section + '.' if section else ''}{close[0]}'?"
    # a key of another section written here (``url`` at the top, ``max_body_bytes`` under
    # upstream): said where it goes
    elsewhere = [i.key for i in schema() if i.key.rpartition(".")[2] == name]
    return f": did you mean '{elsewhere[0]}'?" if len(elsewhere) == 1 else ""


def canonical_choice(value: str, choices: tuple[str, ...]) -> str:
    """A choice as declared when ``value`` is one but for case (``INFO``, ``Json``,
    ``noclientcert``); else ``value`` unchanged, for the check to refuse. Every choice
    setting is matched so, where log_level alone was (``log_format: JSON`` refused)."""
    folded = value.casefold()
    return next((c for c in choices if c.casefold() == folded), value)


def _short(value: Any, most: int = 60) -> str:
    """``repr(value)``, cut to about ``most`` characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


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


def _pod_label_pair(value: Any, key: str) -> dict[str, Any]:
    """``[ns, pod]``, or ``{namespace: .., pod: .., unless: {label: regex}}``."""
    rest = {k: v for k, v in value.items() if k != "unless"} if isinstance(value, dict) else value
    ns, pod = _pair(rest, key)
    out: dict[str, Any] = {"namespace": ns, "pod": pod}
    if isinstance(value, dict) and "unless" in value:
        out["unless"] = value["unless"]
    return out


_AT = re.compile(r"^(?P<what>.*) - at (?P<keyin>`key` in )?`\$(?P<path>[^`]*)`$", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")


def _explain(message: str, data: Any) -> str:
    """msgspec's error, said as before: the dotted key, what it takes, the value it got.

    Only msgspec's path is used: the expectation is read from the declaration itself, so
    the wording does not depend on msgspec's.
    """
    m = _AT.match(message)
    if not m:  # pragma: no cover - msgspec always names the path
        return message
    t: mi.Type = mi.type_info(Settings)
    value, key = data, ""
    for name, index in _STEP.findall(m["path"]):
        t, _ = _unwrap(t)
        if name and isinstance(t, mi.StructType):
            t = next(f.type for f in t.fields if f.name == name)
            value, key = value[name], f"{key}.{name}" if key else name
        elif index.isdigit() and isinstance(t, mi.ListType | mi.TupleType):
            t = t.item_type if isinstance(t, mi.ListType) else t.item_types[int(index)]
            value, key = value[int(index)], f"{key}[{index}]"
        else:  # a mapping's entry: say which
            break
    missing = re.match(r"Object missing required field `(\w+)`", m["what"])
    if missing:
        return f"{key or 'top level'}: missing key '{missing[1]}'"
    allowed = _choices_by_key().get(key, ())
    t = _unwrap(t)[0]
    if key in _SECRET_VALUES and isinstance(t, mi.DictType) and isinstance(value, dict):
        return _secret_entry(key, value, listed=isinstance(t.value_type, mi.ListType))
    if key in _SECRET_VALUES | _SECRET_TEXT and isinstance(value, str | list | dict):
        # not the type asked for (``headers: ["Authorization: Bearer ..."]``, a URL in a
        # list): the message quoted the value, credential and all
        what = "a mapping" if isinstance(t, mi.DictType) else "a string"
        return (f"{key}: expected {what}, got {_type_name(value)} (not shown: it may hold a "
                "credential)")
    return f"{key or 'top level'}: {_expected(t, value, allowed)}"


#: mappings whose values may be credentials (an ``Authorization`` header): a message
#: names the entry and its type, never the value, since it reaches stderr, the log and
#: a reload's answer
_SECRET_VALUES = frozenset({"upstream.headers", "facts.headers",
                            "upstream.proxy_connect_header"})
#: settings whose text may hold a credential (upstream.url's ``user:password@``): a value
#: of another type is named by its type alone
_SECRET_TEXT = frozenset({"upstream.url"})


def _secret_entry(key: str, value: dict[Any, Any], *, listed: bool = False) -> str:
    """The first entry of ``key`` that is not ``string: string`` (``listed``: ``string:
    [string, ...]``), named without its value."""
    def fits(v: Any) -> bool:
        return isinstance(v, str) if not listed else \
            isinstance(v, list) and all(isinstance(x, str) for x in v)

    k, v = next((k, v) for k, v in value.items() if not isinstance(k, str) or not fits(v))
    shape = "string: [string, ...]" if listed else "string: string"
    if not isinstance(k, str):
        return (f"{key}: entries must be {shape}, got the name {_short(k)}"
                f"{_quote_hint(k)}")
    if listed and isinstance(v, list):  # the first value that is not a string
        v = next(x for x in v if not isinstance(x, str))
    hint = _quote_hint(v).strip()[1:-1]  # " (quote it: ...)" -> "quote it: ..."
    what = "a list of strings" if listed else "a string"
    return (f"{key}.{k}: expected {what}, got {_type_name(v)} (not shown: a header may be "
            f"a credential){'; ' + hint if hint else ''}")


#: what a key written with nothing after it (``url:``) holds: YAML reads it as null
_NULL = "null (nothing after the key: give a value, or remove the key for its default)"

#: YAML 1.1 (PyYAML) reads these unquoted as booleans, not strings
_YAML_BOOLEANS = "yes, no, on, off, true and false"


def _number_hint(value: Any, integer: bool) -> str:
    """A number YAML 1.1 read as a string: ``1e3`` (no dot, or no sign in the exponent)."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number) or value.strip().lower().lstrip("+-") in ("inf", "nan"):
        return ""
    whole = f"{number:.0f}" if number.is_integer() and abs(number) < 1e18 else ""
    if integer:
        return f" (YAML 1.1 reads it as a string: write {whole})" if whole else ""
    return (" (YAML 1.1 reads it as a string: write a dot and a signed exponent, "
            f"{number:.1e}" + (f", or {whole}" if whole else "") + ")")


def _quote_hint(value: Any) -> str:
    """A string setting given a boolean or a number: YAML read it so; quoted, it is text."""
    if isinstance(value, bool):
        return f" (YAML reads {_YAML_BOOLEANS} unquoted as booleans: quote it)"
    if isinstance(value, int | float):
        return " (quote it: unquoted, YAML reads a number)"
    return ""


def _expected(t: mi.Type, value: Any, allowed: tuple[str, ...]) -> str:
    got = f"got {_type_name(value)} {_short(value)}" if value is not None else f"got {_NULL}"
    if value is None and isinstance(t, mi.LiteralType):
        return f"expected one of {', '.join(allowed)}; got {_NULL}"
    if isinstance(t, mi.BoolType):
        return f"expected true or false, {got}"
    if isinstance(t, mi.IntType) and (isinstance(value, bool) or not isinstance(value, int)):
        return f"expected an integer, {got}{_number_hint(value, True)}"
    if isinstance(t, mi.FloatType) and (isinstance(value, bool)
                                        or not isinstance(value, int | float)):
        return f"expected a number, {got}{_number_hint(value, False)}"
    if isinstance(t, mi.IntType | mi.FloatType):
        low = (f"{t.ge}" if t.ge is not None else
               f"more than {t.gt}" if t.gt is not None else "")
        if low and t.le is not None:
            return (f"must be {low} to {t.le}, got {value!r}" if t.ge is not None
                    else f"must be {low} and at most {t.le}, got {value!r}")
        if t.le is not None:
            return f"must be at most {t.le}, got {value!r}"
        if t.gt is not None:
            return f"must be greater than {t.gt}, got {value!r}"
        return f"must be {t.ge} or more, got {value!r}"
    if isinstance(t, mi.LiteralType):
        return (f"expected one of {', '.join(allowed)}; got {_short(value)}"
                f"{_quote_hint(value)}")
    if isinstance(t, mi.StrType):
        return (f"expected a string, {got}{_quote_hint(value)}" if not isinstance(value, str)
                else "must not be empty")
    if isinstance(t, mi.ListType):
        if not isinstance(value, list):
            return f"expected a list, {got}"
        return "must have at least one entry, got []"
    if isinstance(t, mi.DictType | mi.StructType) and not isinstance(value, dict):
        return f"expected a mapping, {got}"
    if isinstance(t, mi.DictType):
        k, v = next((k, v) for k, v in value.items()
                    if not isinstance(k, str) or not isinstance(v, str))
        return (f"entries must be string: string, got {_short(k)}: {_short(v)}"
                f"{_quote_hint(v) or _quote_hint(k)}")
    return f"invalid value {value!r}"  # pragma: no cover - every declared type is above


# -- validation: what one value cannot say about itself ---------------------------------------


def parse_host_port(address: str, key: str = "server.listen_address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port).

    An empty host and ``[::]`` give "": every interface of both families (asyncio binds
    ``0.0.0.0`` and ``::``), as Go's listeners (Prometheus') take ``:PORT`` and
    ``[::]:PORT``; asyncio's ``::`` alone is IPv6 only, so an IPv4 client was refused.
    ``0.0.0.0`` stays IPv4 only. An IPv6 address without brackets is refused, as Go's
    ``SplitHostPort`` refuses it: ``fd00::1:9091`` was bound as host ``fd00::1``, port
    9091, and ``::1`` as host ``:``, port 1.
    """
    if "/" in address:
        # "http://0.0.0.0:9091" was told to put an IPv6 address in brackets
        raise ConfigError(f"{key}: expected HOST:PORT, not a URL (no scheme, no path: "
                          f"e.g. :9091), got {address!r}")
    host, sep, port_s = address.rpartition(":")
    if not sep or not (port_s.isascii() and port_s.isdigit()):  # "\u00b2": not for int
        raise ConfigError(f"{key}: expected HOST:PORT, got {address!r}")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} out of range 0-65535")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if "[" in host or "]" in host:  # '[::1:0': else found only by the bind, as a bad host
        raise ConfigError(f"{key}: expected HOST:PORT ([v6]:PORT), got {address!r}")
    if ":" in host and not bracketed:
        raise ConfigError(f"{key}: an IPv6 address goes in brackets, [v6]:PORT (e.g. "
                          f"[::1]:9091), got {address!r}")
    return ("" if host == "::" else host), port


def join_host_port(host: str, port: int) -> str:
    """``parse_host_port``'s inverse, an IPv6 host in brackets: ``::1:9091`` names no port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _relative(path: str) -> str:
    """What a message about a path that is not there adds when the path is relative: it
    is read from the working directory (a container's WORKDIR), not from the config
    file's folder as Prometheus reads its rule files; the message named the path alone."""
    if os.path.isabs(path):
        return ""
    if path.startswith("~"):  # a shell's, not a program's: read as a folder named "~"
        return " (a '~' is not expanded here: write the path out in full)"
    return (f" (a relative path, read from the working directory {os.getcwd()}, not from "
            "the config file's folder)")


def _readable(path: str, key: str) -> None:
    """A folder passes ``os.access``, then fails each read (a token file read per request
    sent writes without credentials): a regular file is required."""
    if path and not os.access(path, os.R_OK):
        raise ConfigError(f"{key}: file {path!r} does not exist or is not readable"
                          f"{_relative(path)}")
    if path and not os.path.isfile(path):
        raise ConfigError(f"{key}: {path!r} is not a regular file")


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
    server_context(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file, VERIFY_MODES[mode],
                   loading=_naming({
                       "cert": f"server.tls_cert_file / server.tls_key_file: cannot load "
                               f"{s.tls_cert_file!r} with {s.tls_key_file!r}",
                       "ca": f"server.tls_client_ca_file: cannot load "
                             f"{s.tls_client_ca_file!r}"}))


def _naming(what: dict[Part, str]) -> Loading:
    """A ``loading`` for the TLS builders (proxy/tls_files.py) that turns a file's failed
    load into a ConfigError: ``what`` it was (the setting and the file), then the ssl
    module's words. Validation builds the very context the proxy serves with."""

    @contextlib.contextmanager
    def loading(part: Part) -> Iterator[None]:
        try:
            yield
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"{what[part]}: {e}") from None

    return loading


def sets_authorization(u: UpstreamSettings) -> bool:
    """Whether the upstream settings give the proxy an ``Authorization`` of its own (a
    bearer token file, basic auth, the userinfo of upstream.url, an OAuth 2.0 token),
    which replaces any other on every upstream request."""
    return bool(u.bearer_token_file or u.basic_auth_username
                or url_credentials(u.url) is not None or oauth2_on(u))


def url_credentials(url: str) -> tuple[str, str] | None:
    """The user and password of ``url``'s userinfo, percent-decoded; None when it has no
    ``@`` in its authority. The proxy sends them as its own Basic credentials (as Go's
    client, and Prometheus, send a URL's userinfo), and requests the URL without them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" not in parts.netloc:
        return None
    userinfo = parts.netloc.rpartition("@")[0]
    user, _, password = userinfo.partition(":")
    return unquote(user), unquote(password)


def _url_detail(shown: str) -> str:
    """urlsplit's words on ``shown`` (a URL its userinfo was taken from), or "" when it
    finds nothing wrong there: what was wrong was in the part left out."""
    try:
        _ = urlsplit(shown).port
    except ValueError as e:
        return f" ({e})"
    return ""


#: what no URL holds written out: whitespace (Unicode's too) and control characters
_URL_SPACE = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")


def _validate_upstream(u: UpstreamSettings, require_upstream: bool) -> None:
    if require_upstream and not u.url:
        raise ConfigError("upstream.url: required: the TSDB's remote-write URL, e.g. "
                          "--upstream-url http://prometheus:9090/api/v1/write")
    if u.url:
        # the password stays out of the message: it reaches logs, stderr and reload answers
        shown = shown_url(u.url)
        try:
            parsed = urlsplit(u.url)
            _ = parsed.port  # a ValueError for a port out of range or not a number
        except ValueError as e:
            # urlsplit's own words quote the "port", a piece of a password with a "/" in it:
            # with a userinfo, its words on the URL without it (``Port out of range``)
            detail = f" ({e})" if "@" not in u.url else _url_detail(
                shown_url(u.url, broken=True))
            raise ConfigError(f"upstream.url: not a valid URL{detail}: "
                              f"{shown_url(u.url, broken=True)!r}") from None
        if _URL_SPACE.search(u.url):
            # urlsplit drops a leading space and tabs or line breaks anywhere, and the
            # client sends a trailing space as %20: every write went to a path the TSDB
            # does not serve (a 404 at each request), from a quoted value or a variable
            # with a line break at its end
            raise ConfigError(f"upstream.url: holds whitespace or a control character "
                              f"(a URL has none; a space is written %20): "
                              f"{shown_url(u.url, broken=True)!r}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"upstream.url: expected an http:// or https:// URL, got "
                              f"{shown_url(u.url, broken=True)!r}")
        if "#" in u.url:
            # a fragment is never sent (Go's client, Prometheus, this proxy): the URL's
            # ``?api_key=ab#cd`` sent ``ab``, refused with a 401 at every write, and the
            # log showed ``#cd``, the rest of the key, in the clear
            raise ConfigError(f"upstream.url: holds a '#': what follows it is a fragment, "
                              f"never sent, so a query value or a password with a '#' in "
                              f"it was cut there; write it %23: "
                              f"{shown_url(u.url.partition('#')[0], broken=True)}#(hidden)")
        placeholders = u.url.count(TENANT_PLACEHOLDER)
        if u.url.count("{") != placeholders or u.url.count("}") != placeholders:
            raise ConfigError(f"upstream.url: the only placeholder is {TENANT_PLACEHOLDER}, "
                              f"got {shown!r}")
    if not TENANT.fullmatch(u.default_tenant):
        raise ConfigError("upstream.default_tenant: a VictoriaMetrics tenant: accountID or "
                          f"accountID:projectID (numbers), got {u.default_tenant!r}")
    if u.url and u.default_tenant != "0" and TENANT_PLACEHOLDER not in u.url:
        # it fills a {tenant} and nothing else: with none, the facts went to the URL's own
        # tenant (.../insert/0/...) while this said another
        raise ConfigError(
            f"upstream.default_tenant: {u.default_tenant} goes in a {TENANT_PLACEHOLDER} of "
            f"upstream.url, which has no {TENANT_PLACEHOLDER}: the fact series and requests "
            "naming no tenant would go where the URL says; write the URL with "
            f"{TENANT_PLACEHOLDER} (.../insert/{TENANT_PLACEHOLDER}/prometheus/api/v1/write) "
            "or leave upstream.default_tenant unset")
    if bool(u.tls_cert_file) != bool(u.tls_key_file):
        raise ConfigError("upstream.tls_cert_file and upstream.tls_key_file: set both or neither")
    _validate_upstream_proxy(u)
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file", "bearer_token_file",
                 "basic_auth_password_file"):
        _readable(getattr(u, name), f"upstream.{name}")
    for name, header in (("bearer_token_file", True), ("basic_auth_password_file", False)):
        path = getattr(u, name)
        try:
            if path:
                read_credential(path, header=header)
        except (CredentialError, OSError) as e:
            raise ConfigError(f"upstream.{name}: {e}") from None
    if u.bearer_token_file and (u.basic_auth_username or u.basic_auth_password_file):
        raise ConfigError(
            "upstream.bearer_token_file and upstream.basic_auth_*: choose one kind of auth"
        )
    if url_credentials(u.url) is not None and (
            u.bearer_token_file or u.basic_auth_username or u.basic_auth_password_file
            or any(name.lower() == "authorization" for name in u.headers)):
        # each is an Authorization header, and which one should win is not for the proxy to
        # guess (aiohttp refused every request with both a URL userinfo and the header)
        raise ConfigError(
            "upstream.url carries user:password@ (the proxy's Basic credentials), and "
            "upstream.bearer_token_file, basic_auth_* or an Authorization in "
            "upstream.headers is set too: choose one kind of auth"
        )
    if bool(u.basic_auth_username) != bool(u.basic_auth_password_file):
        raise ConfigError(
            "upstream.basic_auth_username and upstream.basic_auth_password_file: set both"
        )
    if oauth2_on(u):
        _validate_oauth2(u)
    for i, h in enumerate(u.forward_headers):
        if not _HEADER_NAME.fullmatch(h):
            raise ConfigError(f"upstream.forward_headers[{i}]: not a header name: {h!r}")
    _validate_headers(u.headers)
    for name in u.headers:
        if name.lower() in _BODY_HEADERS:
            raise ConfigError(f"upstream.headers.{name}: never sent, the proxy sets it for "
                              "the body it sends on every upstream request: remove it")
        if name.lower() == "authorization" and (u.bearer_token_file or u.basic_auth_username
                                                 or oauth2_on(u)):
            # the URL's userinfo with it is refused above; these replaced it as silently
            raise ConfigError(f"upstream.headers.{name}: never sent, the proxy's credentials "
                              "(upstream.bearer_token_file, basic_auth_* or oauth2) replace "
                              "it on every upstream request: choose one kind of auth")
    _validate_upstream_tls(u)


#: an HTTP header name (RFC 9110 token)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: the headers of a write's body, always the proxy's own on every upstream request (set
#: after ``upstream.headers`` and ``facts.headers``, replacing them)
_BODY_HEADERS = frozenset({"content-type", "content-encoding",
                           "x-prometheus-remote-write-version"})
#: the body's framing, the HTTP client's own: set in the settings it went out as set, a
#: Content-Length beside the client's (each body cut to its length, the rest read as the
#: next request) or a Transfer-Encoding instead of it (every request refused with a 400)
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})


def _validate_headers(headers: Mapping[str, str | list[str]], key: str = "upstream.headers"
                      ) -> None:
    """Sent on every request: a bad name gets the upstream's 400 for every batch (which
    Prometheus drops), a control character in a value makes aiohttp raise on every one.
    Names are case-insensitive: two spellings of one would each claim to be its value. A
    header of several values (``proxy_connect_header``'s) is a list, each value a line."""
    seen: dict[str, str] = {}
    for name, values in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ConfigError(f"{key}.{name}: {name!r} is not a header name")
        first = seen.setdefault(name.lower(), name)
        if first != name:
            raise ConfigError(f"{key}: {first!r} and {name!r} are one header "
                              "(names are case-insensitive): set it once")
        if name.lower() in _FRAMING_HEADERS:
            raise ConfigError(f"{key}.{name}: the body's framing is the HTTP client's own: "
                              "set here it went out beside (or instead of) the one the body "
                              "needs, and cut every request short or had it refused; remove "
                              "it")
        listed = isinstance(values, list)
        if listed and not values:
            raise ConfigError(f"{key}.{name}: no value (a list of one or more): give one, "
                              "or remove the header")
        for i, value in enumerate(values if isinstance(values, list) else [values]):
            bad = HEADER_VALUE_FORBIDDEN.search(value)
            if bad:
                # not quoted: a header set here is often a credential (Authorization)
                where = f"{key}.{name}[{i}]" if listed else f"{key}.{name}"
                raise ConfigError(f"{where}: the value holds a control character "
                                  f"(CR, LF, ...), {bad.group()!r} at position {bad.start()} "
                                  "(the value is not shown: it may be a credential); a "
                                  "header value is one line")


def _validate_fact_headers(headers: dict[str, str], u: UpstreamSettings) -> None:
    """A fact header that ``upstream.headers``, the proxy's credentials or the body's own
    headers replace on every request is never sent: ``facts.headers: {X-Scope-OrgID:
    ops}`` beside ``upstream.headers: {X-Scope-OrgID: team-a}`` wrote the facts into
    team-a, silently."""
    own = {name.lower(): f"upstream.headers.{name} replaces it" for name in u.headers}
    if sets_authorization(u):
        own["authorization"] = ("the proxy's credentials (upstream.bearer_token_file, "
                                "basic_auth_*, oauth2 or the userinfo of upstream.url) "
                                "replace it")
    for name in headers:
        why = own.get(name.lower()) or (
            "the proxy sets it for the body it sends" if name.lower() in _BODY_HEADERS
            else "")
        if why:
            raise ConfigError(f"facts.headers.{name}: never sent, {why} on every upstream "
                              "request, the fact writes included: remove one of them (a "
                              "tenant set in upstream.headers is every request's, the "
                              "facts' too)")


#: the token request's own form parameters, which ``upstream.oauth2.endpoint_params`` may
#: not set: the client's credentials are its settings (x/oauth2 sends the params' beside
#: its Basic header, or puts its own over them), and ``scope`` is ``scopes``' (x/oauth2
#: refuses to overwrite it: every token request of Prometheus failed). ``grant_type`` may
#: be set, as x/oauth2 lets it be, for token endpoints that want another
_OAUTH2_OWN_PARAMS = {"client_id": "upstream.oauth2.client_id",
                      "client_secret": "upstream.oauth2.client_secret_file"}


def _validate_oauth2(u: UpstreamSettings) -> None:
    """``upstream.oauth2`` as Prometheus 2.x checks its ``oauth2`` (client_id, token_url
    and a client secret required; at most one of basic_auth, oauth2, bearer_token_file),
    and what it found only at each token request (a token URL that is no URL, a
    ``scope`` parameter beside ``scopes``), said at start here. The secret file is read
    as the client will read it; its text is never in a message."""
    o, key = u.oauth2, "upstream.oauth2"
    if not o.token_url:
        raise ConfigError(f"{key}.token_url: required with {key} (the token endpoint, e.g. "
                          "https://keycloak/realms/x/protocol/openid-connect/token)")
    _check_token_url(o.token_url)
    if not o.client_id:
        raise ConfigError(f"{key}.client_id: required with {key}")
    if not o.client_secret_file:
        raise ConfigError(f"{key}.client_secret_file: required with {key} (the client's "
                          "secret, in a file: as every credential of the proxy, it is not "
                          "written in the settings)")
    _readable(o.client_secret_file, f"{key}.client_secret_file")
    try:
        read_credential(o.client_secret_file, header=False)
    except (CredentialError, OSError) as e:
        raise ConfigError(f"{key}.client_secret_file: {e}") from None
    for name in o.endpoint_params:
        if name in _OAUTH2_OWN_PARAMS:
            raise ConfigError(f"{key}.endpoint_params.{name}: the client's credentials are "
                              f"{_OAUTH2_OWN_PARAMS[name]}: set it there")
        if name == "scope" and o.scopes:
            raise ConfigError(f"{key}.endpoint_params.scope: {key}.scopes sets the scope; "
                              "set one of them (Prometheus' every token request failed: "
                              "cannot overwrite parameter \"scope\")")
    other = ("upstream.bearer_token_file" if u.bearer_token_file else
             "upstream.basic_auth_*" if u.basic_auth_username or u.basic_auth_password_file
             else "the user:password@ of upstream.url" if url_credentials(u.url) is not None
             else "")
    if other:
        raise ConfigError(f"{key} and {other}: choose one kind of auth (the token is the "
                          "proxy's Authorization; Prometheus takes at most one of "
                          "basic_auth, oauth2, bearer_token_file)")
    if bool(o.tls_cert_file) != bool(o.tls_key_file):
        raise ConfigError(f"{key}.tls_cert_file and {key}.tls_key_file: set both or neither")
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        _readable(getattr(o, name), f"{key}.{name}")
    client_context(o.tls_ca_file, o.tls_cert_file, o.tls_key_file, o.tls_insecure_skip_verify,
                   loading=_naming({
                       "ca": f"{key}.tls_ca_file: cannot load {o.tls_ca_file!r}",
                       "cert": f"{key}.tls_cert_file / {key}.tls_key_file: cannot load "
                               f"{o.tls_cert_file!r} with {o.tls_key_file!r}"}))
    if o.proxy_url:
        if _URL_SPACE.search(o.proxy_url.strip()):
            raise ConfigError(f"{key}.proxy_url: holds whitespace or a control character: "
                              f"{shown_url(o.proxy_url, broken=True)!r}")
        try:
            parse_egress(o.proxy_url)
        except ValueError as e:
            raise ConfigError(f"{key}.proxy_url: {e}") from None


def _check_token_url(url: str) -> None:
    """The token endpoint: an http(s) URL the client can request as written. Its
    userinfo is refused rather than sent (the client's credentials are client_id and
    client_secret_file), and so is a fragment (never sent, as upstream.url's)."""
    key = "upstream.oauth2.token_url"
    shown = shown_url(url, broken=True)
    try:
        parsed = urlsplit(url)
        _ = parsed.port
    except ValueError:
        raise ConfigError(f"{key}: not a valid URL: {shown!r}") from None
    if _URL_SPACE.search(url):
        raise ConfigError(f"{key}: holds whitespace or a control character (a URL has "
                          f"none; a space is written %20): {shown!r}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{key}: expected an http:// or https:// URL, got {shown!r}")
    if "@" in parsed.netloc:
        raise ConfigError(f"{key}: holds user:password@; the client's credentials are "
                          f"upstream.oauth2.client_id and client_secret_file: {shown!r}")
    if "#" in url:
        raise ConfigError(f"{key}: holds a '#': what follows it is a fragment, never sent; "
                          "write it %23")


def _validate_upstream_proxy(u: UpstreamSettings) -> None:
    """The HTTP proxy settings, checked as Prometheus checks its own (one way to name the
    proxy; no_proxy only beside proxy_url) and read as the client will read them."""
    if u.proxy_url and u.proxy_from_environment:
        raise ConfigError("upstream.proxy_url and upstream.proxy_from_environment: set one "
                          "or the other (the environment's HTTP_PROXY / HTTPS_PROXY, or "
                          "this URL)")
    if u.no_proxy.strip() and not u.proxy_url:
        raise ConfigError("upstream.no_proxy: set, but upstream.proxy_url is not (with "
                          "upstream.proxy_from_environment, NO_PROXY of the environment "
                          "says it)")
    if _URL_SPACE.search(u.proxy_url.strip()):
        raise ConfigError(f"upstream.proxy_url: holds whitespace or a control character: "
                          f"{shown_url(u.proxy_url, broken=True)!r}")
    try:
        routes = EgressRoutes.from_settings(u.proxy_url, u.no_proxy,
                                            u.proxy_from_environment)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _validate_proxy_connect_header(u, routes)


#: the ``CONNECT``'s own headers, which Go writes itself and leaves out of
#: ``ProxyConnectHeader`` (``Request.Write``'s excluded headers; a ``User-Agent`` there
#: is sent, in place of Go's own): set there they were silently not sent
_CONNECT_OWN = frozenset({"host", "content-length", "transfer-encoding"})


def _validate_proxy_connect_header(u: UpstreamSettings, routes: EgressRoutes | None) -> None:
    """``proxy_connect_header`` goes with a ``CONNECT`` and with nothing else: set where
    no ``CONNECT`` is ever sent, or with a header the ``CONNECT`` writes itself, it would
    silently not be sent (Prometheus takes it, and sends nothing)."""
    key = "upstream.proxy_connect_header"
    headers = u.proxy_connect_header
    if not headers:
        return
    if not (u.proxy_url or u.proxy_from_environment):
        raise ConfigError(f"{key}: set, but upstream.proxy_url and "
                          "upstream.proxy_from_environment are not: it goes to the HTTP "
                          "proxy, and there is none (Prometheus refuses it so too)")
    if urlsplit(u.url).scheme.lower() != "https":
        raise ConfigError(f"{key}: never sent: only an https:// upstream is reached through "
                          "a CONNECT tunnel, and these headers go with the CONNECT alone "
                          "(an http:// upstream's requests go to the proxy as they are, "
                          "with the user:password of the proxy's URL as "
                          "Proxy-Authorization), as Go's client does")
    if routes is not None and routes.https is not None and routes.https.socks:
        raise ConfigError(f"{key}: never sent: the https:// upstream is reached through a "
                          f"SOCKS5 proxy ({routes.https.shown}), which takes no headers "
                          "(Go's client sends none either)")
    for name in headers:
        if name.lower() in _CONNECT_OWN:
            raise ConfigError(f"{key}.{name}: never sent, the CONNECT writes its own: "
                              "remove it")
    _validate_headers(headers, key)
    for name in headers:
        if name.lower() == "proxy-authorization" and routes is not None and any(
                e is not None and e.authorization for e in (routes.http, routes.https)):
            raise ConfigError(f"{key}.{name}: the proxy's URL carries user:password, sent "
                              "as Proxy-Authorization and replacing this one (as Go "
                              "replaces it): choose one")


def _validate_upstream_tls(u: UpstreamSettings) -> None:
    """Built as the upstream's client context is built (the same builder), so a file that
    is not PEM (or a key that does not match) is a ConfigError naming it, not a start
    failure."""
    client_context(u.tls_ca_file, u.tls_cert_file, u.tls_key_file, u.tls_insecure_skip_verify,
                   loading=_naming({
                       "ca": f"upstream.tls_ca_file: cannot load {u.tls_ca_file!r}",
                       "cert": f"upstream.tls_cert_file / upstream.tls_key_file: cannot load "
                               f"{u.tls_cert_file!r} with {u.tls_key_file!r}"}))


def _validate_enrich(e: EnrichSettings) -> None:
    name = e.cluster_label
    if name and (not _LABEL_NAME.fullmatch(name) or name.startswith("__")):
        raise ConfigError(f"enrich.cluster_label: {name!r} is not a label name "
                          "([a-zA-Z_][a-zA-Z0-9_]*, not starting with __); \"\" turns the "
                          "check off")
    if name.startswith("karta_"):
        # a sender's karta_* labels are the proxy's own, dropped: never a cluster's name
        raise ConfigError(f"enrich.cluster_label: {name!r} is a karta_* label, the proxy's "
                          "own; name the label the agents' external_labels carry, e.g. "
                          "cluster")
    for i, rule in enumerate(e.pod_label_rules):
        for j, pair in enumerate(rule.pod_label_pairs):
            for label, pattern in pair.unless.items():
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(
                        f"enrich.pod_label_rules[{i}].pod_label_pairs[{j}].unless.{label}: "
                        f"invalid regular expression {pattern!r}: {exc}"
                    ) from None
    names = {n for pair in e.pod_label_pairs for n in pair} | {
        n for rule in e.pod_label_rules for p in rule.pod_label_pairs
        for n in (p.namespace, p.pod, *p.unless)}
    if "" in names:
        raise ConfigError("enrich: a label name of pod_label_pairs or pod_label_rules is empty")
    karta = sorted(n for n in names if n.startswith("karta_"))
    if karta:
        # the sender's karta_* labels are dropped: one that named the pod would leave a
        # series stamped for a pod it no longer names, the pod chosen by the sender
        raise ConfigError(f"enrich: pod_label_pairs and pod_label_rules may not read "
                          f"karta_* labels (the proxy's own): {', '.join(karta)}")
    for i, rule in enumerate(e.pod_label_rules):
        if rule.metric_prefix.startswith("karta_"):
            raise ConfigError(f"enrich.pod_label_rules[{i}].metric_prefix: "
                              f"{rule.metric_prefix!r} is under karta_, the proxy's own "
                              "metric names, whose series name no pod")
    if len(names) > MAX_LABEL_NAMES - 10:
        raise ConfigError(f"enrich: pod_label_pairs and pod_label_rules name {len(names)} "
                          f"distinct labels; at most {MAX_LABEL_NAMES - 10}")


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _validate_external_labels(labels: dict[str, str]) -> None:
    """Every fact carries these: a name that is no label name is refused by the TSDB for
    every fact request; one of the facts' own names (or ``karta_*``) would be written onto
    each fact that lacks it, e.g. ``karta_workload`` on an unattributed pod's series."""
    for name, value in labels.items():
        where = f"facts.external_labels.{name}"
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ConfigError(f"{where}: {name!r} is not a label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                              "not starting with __)")
        if name.startswith("karta_") or name in contract.ALL_FACT_LABELS:
            raise ConfigError(f"{where}: {name!r} is a label of the fact series themselves "
                              "(docs/metrics.md); choose another name, e.g. cluster")
        if not value:
            raise ConfigError(f"{where}: the value is empty (an empty label is no label)")


def cluster_check(settings: Settings) -> tuple[str, str] | None:
    """(``enrich.cluster_label``, this proxy's value of it in ``facts.external_labels``):
    what the splice checks a relayed series' cluster against; None when the label is
    "" or the external labels have no such label (the check is off)."""
    name = settings.enrich.cluster_label
    value = settings.facts.external_labels.get(name, "") if name else ""
    return (name, value) if value else None


def cluster_check_off(settings: Settings) -> str:
    """The info line of a start (or a reload of ``enrich.cluster_label``) whose cluster check
    is off because ``facts.external_labels`` has no value of the label, else "" (on, or off
    by ``enrich.cluster_label: ""``, which says so itself). Not a warning: a proxy that
    writes no facts, or one cluster's TSDB, has no cluster to name."""
    name = settings.enrich.cluster_label
    if not name or cluster_check(settings) is not None:
        return ""
    return (f"relayed series' {name} label is not checked: facts.external_labels has no "
            f"{name} (this proxy's cluster), so a series labelled with another cluster's "
            f"{name} is stamped with this cluster's pods; set facts.external_labels.{name} "
            "to the value this cluster's agents send (enrich.cluster_label names another "
            "label, \"\" turns this line off)")


#: the ``cluster`` of the shipped ConfigMaps (config/kubernetes/*/configmap.yaml), to be
#: changed in every cluster
PLACEHOLDER_CLUSTER = "my-cluster"


def placeholder_cluster(settings: Settings) -> str:
    """The warning of a start (or a reload) whose cluster is still the shipped ConfigMaps'
    placeholder, else "". Two clusters left at it merge into one in a shared TSDB, and
    since the cluster check (1.10.0) an agent that sends its real cluster name has every
    series forwarded unstamped: an upgrade that kept the ConfigMap lost all attribution,
    said only by a counter and an alert minutes later."""
    check = cluster_check(settings)
    if check is None or check[1] != PLACEHOLDER_CLUSTER:
        return ""
    name = check[0]
    return (f"facts.external_labels.{name} is {PLACEHOLDER_CLUSTER!r}, the shipped "
            "ConfigMap's placeholder: set it to this cluster's name, the value its agents "
            f"send as {name}; meanwhile relayed series of any other {name} are forwarded "
            "unstamped (other_cluster), and two clusters left at it merge into one in a "
            "shared TSDB")


def check_stored_cluster(settings: Settings) -> None:
    """Refuse an ``upstream.url`` whose ``extra_label`` sets the cluster label to another
    value than this proxy's (``cluster_check``).

    VictoriaMetrics sets an ``extra_label`` on every series it stores, over the series'
    own (of several of a name, the last non-empty one), so the handler would relay every
    request to such a URL unstamped (``other_cluster``) and the facts would be stored in
    that cluster: a configuration error, otherwise found a request at a time (a warning
    an interval, a counter). Read on the URL where requests naming no tenant and the
    facts go (``upstream.default_tenant`` in a ``{tenant}``); a ``{tenant}`` in the
    label's value makes the other tenants' URLs differ, and the handler checks those as
    requests name them. Also called by a reload on the settings it would run with: it
    keeps the running ``upstream.url`` and ``facts.external_labels`` (restart keys)
    under a new ``enrich.cluster_label``."""
    check = cluster_check(settings)
    u = settings.upstream
    if check is None or not u.url:
        return
    name, ours = check
    url = without_userinfo(u.url)
    stored = own_extra_label(tenant_url(url, None, u.default_tenant) or url, name.encode())
    if stored is None or stored == ours.encode():
        return
    theirs = stored.decode("utf-8", "replace")[:200]
    where, what = "upstream.url", "every relayed series"
    if TENANT_PLACEHOLDER in urlsplit(url).query:
        where += (f" (its {TENANT_PLACEHOLDER} as upstream.default_tenant {u.default_tenant}:"
                  " where requests naming no tenant and the fact series go)")
        what = "every series of a request naming no tenant"
    facts = f", the fact series stored under {name}={theirs}" if settings.facts.enabled else ""
    raise ConfigError(
        f"{where}: its extra_label sets {name}={theirs} on every series VictoriaMetrics "
        f"stores through it, but this proxy's cluster is {name}={ours} "
        f"(facts.external_labels.{name}, checked by enrich.cluster_label): {what} would "
        f"be forwarded unstamped (other_cluster){facts}; make the extra_label "
        f"{name}={ours} (or remove it), or set facts.external_labels.{name}: {theirs} if "
        f"this proxy is that cluster's; enrich.cluster_label: \"\" turns the check off")


def first_kubeconfig(paths: str) -> str:
    """The file the client reads of a kubeconfig path list (``$KUBECONFIG`` as kubectl
    takes it): the first non-empty entry (``:/path`` is ``/path``); ``paths`` itself when
    it has none."""
    return next((p for p in paths.split(os.pathsep) if p), paths)


#: RFC 1123 DNS label: a namespace's name (Kubernetes' IsDNS1123Label)
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(_DNS_LABEL)
#: RFC 1123 DNS subdomain: a node's or a Lease's name (IsDNS1123Subdomain)
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")


def check_dns_name(value: str, key: str, what: str, *, subdomain: bool) -> None:
    """A Kubernetes object name: a namespace is a DNS label (at most 63 characters), a
    node or a Lease a DNS subdomain (at most 253): lower-case letters, digits, '-' (and
    '.' in a subdomain), a letter or digit at each end. Another never names an object:
    a filter by it selects nothing, a Lease by it cannot be written."""
    if value != value.strip():
        raise ConfigError(f"{key}: {value!r} has whitespace around it; not a {what}")
    most = 253 if subdomain else 63
    pattern = _DNS_SUBDOMAIN_RE if subdomain else _DNS_LABEL_RE
    if len(value) > most or not pattern.fullmatch(value):
        kind = "DNS subdomain" if subdomain else "DNS label"
        chars = "'-' and '.'" if subdomain else "'-'"
        raise ConfigError(f"{key}: {_short(value)} is not a valid {what} (an RFC 1123 "
                          f"{kind}: at most {most} lower-case letters, digits and {chars}, "
                          "a letter or digit at each end)")


def _validate_lease(f: FactSettings) -> None:
    """The fact writer's Lease: an empty name reads as the collection (every write a 405,
    no writer ever elected), a name or namespace no object can have is refused by the API
    at every round."""
    if not f.lease_name:
        raise ConfigError("facts.lease_name: empty; name the Lease (default "
                          "karta-proxy-facts)")
    check_dns_name(f.lease_name, "facts.lease_name", "Lease name", subdomain=True)
    if f.lease_namespace:
        check_dns_name(f.lease_namespace, "facts.lease_namespace", "namespace", subdomain=False)
    if f.identity and (not f.identity.strip() or f.identity != f.identity.strip()):
        raise ConfigError(f"facts.identity: {f.identity!r} is blank or has whitespace around "
                          "it; set an identity, or leave it empty for $POD_NAME and a suffix")


def _validate_node_mode_facts(s: Settings) -> None:
    """Facts from node mode need one writer. Every node's replica holds every workload
    (owners are watched cluster-wide) but counts only its own node's pods, and the fact
    series carry no label of the writer: without an election each replica wrote every
    workload's series under the same labels, the TSDB keeping whichever came last (an
    audit, two node replicas, a Deployment's 3 pods on one node and 1 on the other:
    its karta_component_observed_pods read 3 and 1 by turns, at every 0.5 s step). A
    snapshot ignores kube.node_name, so it writes facts as a cluster-mode proxy does."""
    f = s.facts
    if s.kube.node_name and not s.snapshot and f.enabled and f.allow_in_node_mode \
            and not f.leader_election:
        raise ConfigError(
            "facts.allow_in_node_mode: true needs facts.leader_election: true: without "
            "it every node's replica (kube.node_name) writes every workload's fact series "
            "under the same labels, each counting its own node's pods, and the TSDB keeps "
            "whichever wrote last (karta_component_observed_pods changing at nearly every "
            "write); set facts.leader_election: true (one replica writes; it needs the "
            "Lease's Role, config/rbac/fact-lease.yaml), or write the facts from a "
            "cluster-mode replica and leave facts.allow_in_node_mode false")


def validate(settings: Settings, *, require_upstream: bool = True) -> None:
    """The declaration's checks again (flags and code set values too), then the rest.

    Raises ``ConfigError`` naming the first bad key; the CLI turns it into one line and
    exit code 2, so a bad setting never turns into a half-started proxy.
    """
    s = settings
    _decode(msgspec.to_builtins(s))
    parse_host_port(s.server.listen_address)
    if s.server.max_inflight_bytes < s.server.max_body_bytes:
        raise ConfigError(
            "server.max_inflight_bytes: must be at least server.max_body_bytes "
            f"({s.server.max_body_bytes}), got {s.server.max_inflight_bytes}"
        )
    _validate_server_tls(s.server)
    _validate_upstream(s.upstream, require_upstream)
    _validate_enrich(s.enrich)
    _validate_external_labels(s.facts.external_labels)
    check_stored_cluster(s)
    _validate_headers(s.facts.headers, "facts.headers")
    _validate_fact_headers(s.facts.headers, s.upstream)
    for i, p in enumerate(s.karta.description_paths):
        if not os.path.exists(p):
            raise ConfigError(f"karta.description_paths[{i}]: {p!r} does not exist"
                              f"{_relative(p)}")
    for i, ns in enumerate(s.kube.namespaces):
        if not ns:  # the client reads "" as every namespace: the opposite of a list of some
            raise ConfigError(f"kube.namespaces[{i}]: empty; name a namespace (an empty "
                              "list, no --namespace, watches all)")
        # a name no namespace can have watches nothing, and the proxy reported ready with
        # no pod known (the API answers an empty list for a namespace that does not exist)
        check_dns_name(ns, f"kube.namespaces[{i}]", "namespace", subdomain=False)
    if s.kube.node_name:
        check_dns_name(s.kube.node_name, "kube.node_name", "node name", subdomain=True)
    _validate_node_mode_facts(s)
    _validate_lease(s.facts)
    # the cluster connection is made for the source, and, with a snapshot too, for the
    # fact writer's Lease (a file that does not exist is a setting's error: exit 2)
    lease = s.facts.enabled and s.facts.leader_election
    if s.kube.kubeconfig and (not s.snapshot or lease):
        _readable(first_kubeconfig(s.kube.kubeconfig), "kube.kubeconfig")
    if s.snapshot and not os.path.exists(s.snapshot):
        raise ConfigError(f"snapshot: {s.snapshot!r} does not exist{_relative(s.snapshot)}")
