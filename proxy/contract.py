"""The versioned public contract: every label the proxy stamps and every series it emits.

Names here are an API. Renaming or removing one is a breaking change and bumps
``CONTRACT_VERSION`` (semver major); adding one bumps the minor. ``docs/metrics.md``
documents the same names and a test keeps the two in step.
"""

from __future__ import annotations

CONTRACT_VERSION = "1.10.0"

# Stamped labels. All share the ``karta_`` prefix, so in a sorted label set they form one
# contiguous block: the wire-level splice inserts a single pre-encoded run of bytes.
LABEL_COMPONENT = "karta_component"
LABEL_GROUP = "karta_group"
LABEL_INSTANCE = "karta_instance"
LABEL_KIND = "karta_kind"
LABEL_NAMESPACE = "karta_namespace"
LABEL_REPLICA = "karta_replica"
LABEL_WORKLOAD = "karta_workload"

#: Every stamped label, in sorted (wire) order.
STAMPED_LABELS: tuple[str, ...] = (
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_INSTANCE,
    LABEL_KIND,
    LABEL_NAMESPACE,
    LABEL_REPLICA,
    LABEL_WORKLOAD,
)
STAMPED_PREFIX = "karta_"

#: Prefix of every series the proxy emits itself (facts and operational metrics). A
#: series a sender writes under it names no pod (``no_pod_label``): it is never stamped,
#: so a forged fact (``karta_workload_phase{phase="Failed", exported_namespace=...,
#: exported_pod=<a victim's pod>}``) cannot borrow a real workload's identity.
METRIC_PREFIX = "karta_"

# -- Fact series (proxy/facts/model.py) ---------------------------------------------------
# Facts only: what the cluster and the index say, never a measurement, an aggregate or a
# threshold. Written into the remote-write stream by one elected replica and served on
# /metrics by every replica. docs/metrics.md documents each name, type, label and meaning.

#: one series per known pod that is attributed: the join key for consumers that join
FACT_POD_INFO = "karta_pod_info"
#: one series per known pod the engine could not attribute, with the reason
FACT_POD_UNATTRIBUTED_INFO = "karta_pod_unattributed_info"
#: one series per workload: identity, the description that describes it, built-in or not
FACT_WORKLOAD_INFO = "karta_workload_info"
#: state set: one series per generic phase, 1 for the current phase, 0 for the others
FACT_WORKLOAD_PHASE = "karta_workload_phase"
#: unix time the current phase began (time in phase = time() - this), with ``source``
FACT_WORKLOAD_PHASE_TRANSITION = "karta_workload_phase_transition_timestamp_seconds"
#: one series per generic status, 1 for every status whose matchers match, 0 otherwise
FACT_WORKLOAD_STATUS = "karta_workload_status"
#: present while the phase is Undefined for a known reason (jq error, nothing matched)
FACT_WORKLOAD_UNDEFINED_REASON_INFO = "karta_workload_phase_undefined_reason_info"
#: per component instance, from the description's scaleDefinition
FACT_COMPONENT_DESIRED_REPLICAS = "karta_component_desired_replicas"
FACT_COMPONENT_DESIRED_REPLICAS_MIN = "karta_component_desired_replicas_min"
FACT_COMPONENT_DESIRED_REPLICAS_MAX = "karta_component_desired_replicas_max"
#: per component instance: pods the index knows (live, not tombstones)
FACT_COMPONENT_OBSERVED_PODS = "karta_component_observed_pods"
#: per namespace: pods the index knows, by attribution state (and reason when unattributed)
FACT_NAMESPACE_PODS = "karta_namespace_pods"
#: per watched resource: unix time it was last known current (list, event or bookmark)
FACT_SOURCE_LAST_CURRENT = "karta_source_last_current_timestamp_seconds"
#: the contract version (this module's CONTRACT_VERSION) as a label
FACT_CONTRACT_INFO = "karta_contract_info"
#: the proxy's version as a label
FACT_BUILD_INFO = "karta_build_info"

#: every fact series name, sorted
FACT_SERIES: tuple[str, ...] = tuple(
    sorted(
        (
            FACT_POD_INFO,
            FACT_POD_UNATTRIBUTED_INFO,
            FACT_WORKLOAD_INFO,
            FACT_WORKLOAD_PHASE,
            FACT_WORKLOAD_PHASE_TRANSITION,
            FACT_WORKLOAD_STATUS,
            FACT_WORKLOAD_UNDEFINED_REASON_INFO,
            FACT_COMPONENT_DESIRED_REPLICAS,
            FACT_COMPONENT_DESIRED_REPLICAS_MIN,
            FACT_COMPONENT_DESIRED_REPLICAS_MAX,
            FACT_COMPONENT_OBSERVED_PODS,
            FACT_NAMESPACE_PODS,
            FACT_SOURCE_LAST_CURRENT,
            FACT_CONTRACT_INFO,
            FACT_BUILD_INFO,
        )
    )
)

# Labels of fact series besides the stamped ones (the stamped names carry the workload
# identity, so facts join with enriched series on the same labels).
FACT_LABEL_NAMESPACE = "namespace"  # the pod's namespace (pod facts)
FACT_LABEL_POD = "pod"  # the pod's name (pod facts)
FACT_LABEL_UID = "uid"  # the pod's uid (pod facts)
FACT_LABEL_WORKLOAD_UID = "workload_uid"  # the workload object's uid
FACT_LABEL_DESCRIPTION = "description"  # name of the Karta description in effect
FACT_LABEL_BUILTIN = "builtin"  # "true" when the description is one of the project's
FACT_LABEL_REASON = "reason"  # why: snake_case, a closed-ish set documented in metrics.md
FACT_LABEL_STATE = "state"  # attribution state of pods: "attributed" or "unattributed"
FACT_LABEL_PHASE = "phase"  # a generic phase (GENERIC_PHASES)
FACT_LABEL_STATUS = "status"  # a generic status (GENERIC_PHASES)
FACT_LABEL_RESOURCE = "resource"  # a watched resource, e.g. "pods", "jobs.batch"
FACT_LABEL_VERSION = "version"  # contract or build version
FACT_LABEL_SPLICE = "splice"  # which splice runs: "native", or "python" (the fallback)
#: on every fact series that names no workload (the process facts, an unattributed pod's):
#: the relay drops every ``karta_*`` label a sender writes, so with it no series a sender
#: writes through the proxy can take such a fact's exact label set (whose sample ahead in
#: time would make the writer's own out of order, refused: a forged freshness or contract)
FACT_LABEL_WRITER = "karta_writer"
#: its one value
WRITTEN_BY = "karta-proxy"
#: on ``karta_contract_info``: the uid of the cluster's ``kube-system`` Namespace (made by
#: the cluster, never configured: proxy/kube/cluster_identity.py), so one ``cluster`` name
#: written by two clusters shows as two uids (``KartaClusterNameShared``); absent in
#: snapshot mode and until it was read
FACT_LABEL_CLUSTER_UID = "karta_cluster_uid"
#: where a phase transition time comes from: "object" (the object's conditions'
#: lastTransitionTime) or "observed" (when this proxy saw the phase change)
FACT_LABEL_SOURCE = "source"

#: every label name a fact series may carry besides the stamped ones:
#: ``facts.external_labels`` may not use them (nor ``karta_*``), or a fact written without
#: one would carry the configured value as if it were a fact
ALL_FACT_LABELS: tuple[str, ...] = (
    FACT_LABEL_NAMESPACE, FACT_LABEL_POD, FACT_LABEL_UID, FACT_LABEL_WORKLOAD_UID,
    FACT_LABEL_DESCRIPTION, FACT_LABEL_BUILTIN, FACT_LABEL_REASON, FACT_LABEL_STATE,
    FACT_LABEL_PHASE, FACT_LABEL_STATUS, FACT_LABEL_RESOURCE, FACT_LABEL_VERSION,
    FACT_LABEL_SPLICE, FACT_LABEL_SOURCE, FACT_LABEL_WRITER, FACT_LABEL_CLUSTER_UID,
)

#: values of FACT_LABEL_STATE
STATE_ATTRIBUTED = "attributed"
STATE_UNATTRIBUTED = "unattributed"

#: The identity of a workload in fact series: the stamped labels that name it.
WORKLOAD_IDENTITY_LABELS: tuple[str, ...] = (
    LABEL_GROUP,
    LABEL_KIND,
    LABEL_NAMESPACE,
    LABEL_WORKLOAD,
)

# -- Operational metrics of the fact writer (on /metrics only, every replica) --------------
OP_FACT_WRITER_LEADER = "karta_proxy_fact_writer_leader"
OP_FACT_WRITES = "karta_proxy_fact_writes_total"
OP_FACT_STALE_MARKERS = "karta_proxy_fact_stale_markers_total"
OP_FACT_SERIES = "karta_proxy_fact_series"
OP_FACT_LAST_WRITE = "karta_proxy_fact_last_write_timestamp_seconds"
OP_FACT_SERIES_REFUSED = "karta_proxy_fact_series_refused_total"
OP_FACT_WRITER_STEPDOWNS = "karta_proxy_fact_writer_stepdowns_total"
OP_FACT_LEASE_FAILURES = "karta_proxy_fact_lease_failures_total"
#: this host's wall clock less the upstream's, by the Date of its answers (since 1.10.0)
OP_UPSTREAM_CLOCK_OFFSET = "karta_proxy_upstream_clock_offset_seconds"
#: ``reason`` of OP_FACT_WRITER_STEPDOWNS: every fact write failed for long enough
#: (``writes_failing``), or was held for long enough, this host's clock being off the
#: upstream's (``clock_offset``, since 1.10.0)
STEPDOWN_REASONS: tuple[str, ...] = ("writes_failing", "clock_offset")
#: ``reason`` of OP_FACT_LEASE_FAILURES: no answer in time, an error status, no connection
LEASE_FAILURE_REASONS: tuple[str, ...] = ("timeout", "status", "connection")
FACT_WRITER_METRICS: tuple[str, ...] = (
    OP_FACT_LAST_WRITE,
    OP_FACT_LEASE_FAILURES,
    OP_FACT_SERIES,
    OP_FACT_SERIES_REFUSED,
    OP_FACT_STALE_MARKERS,
    OP_FACT_WRITER_LEADER,
    OP_FACT_WRITER_STEPDOWNS,
    OP_FACT_WRITES,
    OP_UPSTREAM_CLOCK_OFFSET,
)
#: the index's state, operational on every replica's /metrics (since 1.8.0): the shipped
#: ``KartaIndexNotReady`` alert reads the first, so both are named here, not only in
#: proxy/metrics.py
OP_INDEX_READY = "karta_proxy_index_ready"
OP_INDEX_STALE = "karta_proxy_index_stale"
INDEX_METRICS: tuple[str, ...] = (OP_INDEX_READY, OP_INDEX_STALE)
#: a kind the index needs that RBAC forbids (since 1.9.0), served by the watch source
#: (``proxy.kube.source``) in Kubernetes mode: the shipped ``KartaKindForbidden`` reads it
OP_WATCH_FORBIDDEN = "karta_proxy_watch_forbidden"
#: GETs of owners the watch had not delivered yet, by outcome (since 1.10.0; the watch
#: source's ``proxy.kube.owner_fetch``)
OP_OWNER_FETCHES = "karta_proxy_owner_fetches_total"
#: updates of heavy described objects whose facts were evaluated off the event loop, by
#: outcome (since 1.10.0; the watch source's ``proxy.kube.heavy_objects``)
OP_DEFERRED_OBJECT_UPDATES = "karta_proxy_deferred_object_updates_total"
WATCH_METRICS: tuple[str, ...] = (OP_WATCH_FORBIDDEN, OP_OWNER_FETCHES,
                                  OP_DEFERRED_OBJECT_UPDATES)
#: the jq sandbox the descriptions' expressions run in (since 1.10.0), on every replica's
#: /metrics (proxy/metrics.py): its child's restarts by reason (every reason present at 0)
#: the expressions it quarantined, the seconds the proxy waited for it, and the
#: re-evaluations made after its failures that were not the expressions' own
OP_JQ_SANDBOX_RESTARTS = "karta_proxy_jq_sandbox_restarts_total"
OP_JQ_QUARANTINED = "karta_proxy_jq_quarantined_expressions"
OP_JQ_SANDBOX_SECONDS = "karta_proxy_jq_sandbox_seconds_total"
OP_JQ_RETRIES = "karta_proxy_jq_retries_total"
JQ_SANDBOX_METRICS: tuple[str, ...] = (OP_JQ_SANDBOX_RESTARTS, OP_JQ_QUARANTINED,
                                       OP_JQ_SANDBOX_SECONDS, OP_JQ_RETRIES)
#: the relay's, the configuration's and the certificates' operational metrics (since
#: 1.10.0; served before, unlisted), on every replica's /metrics (proxy/metrics.py): the
#: shipped ``karta-proxy-operational`` alerts read them (with the index, fact writer and
#: jq sandbox metrics above), so their names, types and labels are named here
OP_REQUESTS = "karta_proxy_requests_total"
OP_REQUESTS_REJECTED = "karta_proxy_requests_rejected_total"
#: ``reason`` of OP_REQUESTS_REJECTED, every one present at 0 from the start (since
#: 1.10.0): a counter made by its first increment shows no ``increase()`` for it, so a
#: first refusal, or a burst, would never reach an alert's rate
REJECT_REASONS: tuple[str, ...] = (
    "overload", "too_large", "not_ready", "unsupported_media_type", "method",
    "invalid_tenant", "invalid_header", "karta_extra_label", "header_timeout",
    "body_timeout", "body_too_slow", "expectation", "client_closed", "bad_http",
    "header_too_large", "send_timeout", "thread_limit", "out_of_memory", "loop")
OP_UPSTREAM_RESPONSES = "karta_proxy_upstream_responses_total"
OP_UPSTREAM_MISCONFIGURED = "karta_proxy_upstream_misconfigured_total"
OP_UPSTREAM_INFO = "karta_proxy_upstream_info"
OP_CONFIG_RELOAD_SUCCESSFUL = "karta_proxy_config_last_reload_successful"
OP_JQ_ERRORS = "karta_proxy_jq_errors_total"
#: descriptions not in force, by ``reason`` (``invalid``, ``held_last_valid``,
#: ``not_in_force``; every one present at 0): ``KartaProxyDescriptionInvalid`` reads the
#: first two (since 1.10.0)
OP_DESCRIPTION_ERRORS = "karta_proxy_description_errors"
OP_TLS_CERTIFICATE_EXPIRY = "karta_proxy_tls_certificate_expiry_timestamp_seconds"
OP_TLS_CERTIFICATE_RELOADS = "karta_proxy_tls_certificate_reloads_total"
OP_UPSTREAM_TLS_CERTIFICATE_EXPIRY = "karta_proxy_upstream_tls_certificate_expiry_timestamp_seconds"
OP_UPSTREAM_TLS_CERTIFICATE_RELOADS = "karta_proxy_upstream_tls_certificate_reloads_total"
#: series forwarded unstamped, by ``reason``: ``KartaProxyOtherClusterSeries`` reads
#: ``other_cluster``
OP_SERIES_UNATTRIBUTED = "karta_proxy_series_unattributed_total"
OPERATIONAL_ALERT_METRICS: tuple[str, ...] = (
    OP_CONFIG_RELOAD_SUCCESSFUL,
    OP_DESCRIPTION_ERRORS,
    OP_JQ_ERRORS,
    OP_REQUESTS,
    OP_REQUESTS_REJECTED,
    OP_SERIES_UNATTRIBUTED,
    OP_TLS_CERTIFICATE_EXPIRY,
    OP_TLS_CERTIFICATE_RELOADS,
    OP_UPSTREAM_INFO,
    OP_UPSTREAM_MISCONFIGURED,
    OP_UPSTREAM_RESPONSES,
    OP_UPSTREAM_TLS_CERTIFICATE_EXPIRY,
    OP_UPSTREAM_TLS_CERTIFICATE_RELOADS,
)
#: ``check`` values of OP_UPSTREAM_INFO that say the configuration is wrong (every write
#: answered 503 until it is fixed): ``KartaProxyUpstreamMisconfigured`` reads them
UPSTREAM_CHECKS_MISCONFIGURED: tuple[str, ...] = ("not_write_endpoint", "credentials_refused")
