"""The versioned public contract: every label the proxy stamps and every series it emits.

Names here are an API. Renaming or removing one is a breaking change and bumps
``CONTRACT_VERSION`` (semver major); adding one bumps the minor. ``docs/metrics.md``
documents the same names and a test keeps the two in step.
"""

from __future__ import annotations

CONTRACT_VERSION = "1.0.0"

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

#: Prefix of every series the proxy emits itself (facts and operational metrics).
METRIC_PREFIX = "karta_"
