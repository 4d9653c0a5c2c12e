"""karta-proxy: a Prometheus remote-write proxy that stamps Karta workload attribution.

The data path reads top to bottom: ``wire`` (wire format, the splice) -> ``attribution``
(plan and pod table) -> ``upstream`` (forwarding), fed by ``index``, which is fed by ``snapshot``
or ``kube`` watches through the ``karta`` engine.
"""

__version__ = "0.1.0"
