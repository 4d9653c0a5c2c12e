"""karta-proxy: a Prometheus remote-write proxy that stamps Karta workload attribution.

The data path reads top to bottom: ``wire`` (wire format, the splice) -> ``enrichment``
(plan and pod table) -> ``upstream`` (forwarding), fed by ``index``, which is fed by ``snapshot``
or ``kube`` watches through the ``karta`` engine.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    #: one place for the version: pyproject.toml, as installed
    __version__ = version("karta-proxy")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"
