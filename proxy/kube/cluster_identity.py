"""The cluster's identity: the uid of its ``kube-system`` Namespace.

Each cluster's fact writer labels its facts with ``facts.external_labels`` alone, so two
clusters given the same ``cluster`` name (the shipped ``my-cluster`` left in both) write
the same label sets into one TSDB: their facts flap between the two, samples are refused
as out of order, and nothing says why. A name is configuration; the ``kube-system``
Namespace's uid is made by the cluster itself, once, at its creation, and never changes
(OpenTelemetry's ``k8s.cluster.uid`` is the same uid). The fact writer publishes it on
``karta_contract_info`` (``karta_cluster_uid``), so one ``cluster`` value with two uids
in the TSDB is a name shared by two clusters: the shipped ``KartaClusterNameShared``
alert reads that.

The read never holds the facts back: they are written without the label until it is
known. A refusal (RBAC: the ``get`` on ``namespaces`` / ``kube-system`` that
``config/rbac/`` grants), an error or an answer without a uid is logged once per streak
of failures as a warning, and tried again every ``RETRY_SECONDS``. Once known it is read
again every ``REFRESH_SECONDS``: the credentials are reloaded in place
(:class:`proxy.kube.client.KeptCredentials`), the server address with them, so the API
server answering may become another cluster's without the process starting again; a
re-read that fails keeps the uid last read (a cluster does not change identity because a
grant went away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from proxy.kube.client import KubeApiError
from proxy.log import failure_line
from proxy.tasks import cancel_and_wait

log = logging.getLogger(__name__)

#: the Namespace every cluster has from its creation, whose uid names the cluster
NAMESPACE = "kube-system"
PATH = f"/api/v1/namespaces/{NAMESPACE}"
#: after a failed read: a grant added later is picked up within this
RETRY_SECONDS = 60.0
#: after a successful one (a few hundred bytes a replica every 10 minutes)
REFRESH_SECONDS = 600.0
#: one read's limit: a slow API server delays the next try, never a fact write
READ_TIMEOUT_SECONDS = 10.0
#: a uid longer than this, or holding a control character, is no uid (a label value
#: the upstream may refuse, and with it the whole write of the process facts)
MAX_UID_LENGTH = 128

#: what the warning names when RBAC refuses the read
PERMISSION = (f"get on namespaces (resourceNames: [{NAMESPACE}]), config/rbac/ "
              "(ClusterRole karta-proxy-cluster-identity)")


class JsonGetter(Protocol):
    """What the identity needs of :class:`proxy.kube.client.KubeClient`."""

    async def request_json(self, path: str, *, timeout: float | None = ...) -> Any: ...


def uid_of(doc: Any) -> str:
    """The ``metadata.uid`` of a Namespace as the API answered it; raises ``ValueError``
    for anything else (a proxy in between answering HTML, a uid that cannot be a label
    value)."""
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    uid = meta.get("uid") if isinstance(meta, dict) else None
    if not isinstance(uid, str) or not uid:
        raise ValueError("the answer holds no metadata.uid")
    if len(uid) > MAX_UID_LENGTH or any(ord(c) < 0x20 or ord(c) == 0x7F for c in uid):
        raise ValueError(f"metadata.uid is not a uid ({len(uid)} characters)")
    return uid


class ClusterIdentity:
    """The uid of the cluster the proxy's API server belongs to, "" while unknown.

    ``start`` reads it in a task of its own and keeps it current; ``uid`` is what the
    fact writer's next write labels ``karta_contract_info`` with. ``first_read`` is set
    once the first attempt is over, whatever its outcome.
    """

    def __init__(self, client: JsonGetter, *, retry_seconds: float = RETRY_SECONDS,
                 refresh_seconds: float = REFRESH_SECONDS,
                 timeout: float = READ_TIMEOUT_SECONDS) -> None:
        self._client = client
        self._retry = retry_seconds
        self._refresh = refresh_seconds
        self._timeout = timeout
        self.uid = ""
        self.first_read = asyncio.Event()
        #: failed reads in a row (the first of a streak is warned of, the rest at debug)
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def read(self) -> bool:
        """One read; whether it gave a uid. Never raises but for cancellation."""
        try:
            # not wait_for: it swallows a cancel that comes as the answer does (3.11),
            # and stop() then waited for this loop for good
            async with asyncio.timeout(self._timeout):
                doc = await self._client.request_json(PATH, timeout=self._timeout)
            uid = uid_of(doc)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # KubeApiError, OSError, aiohttp errors, a timeout, ValueError
            self._failed(e)
            return False
        if self.failures:
            log.info("cluster identity read after %d failed reads: the %s Namespace's uid "
                     "%s", self.failures, NAMESPACE, uid, extra={"cluster_uid": uid})
        elif self.uid and uid != self.uid:
            log.warning("cluster identity changed: the %s Namespace's uid was %s, is %s (the "
                        "API server now answering is another cluster's; the kubeconfig "
                        "reloaded?)", NAMESPACE, self.uid, uid,
                        extra={"cluster_uid": uid, "previous_cluster_uid": self.uid})
        elif not self.uid:
            log.info("cluster identity: the %s Namespace's uid %s", NAMESPACE, uid,
                     extra={"cluster_uid": uid})
        self.failures = 0
        self.uid = uid
        return True

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        kept = (f"the uid last read ({self.uid}) is kept" if self.uid
                else "facts are written without karta_cluster_uid")
        if isinstance(e, KubeApiError) and e.status == 403:
            why = f"forbidden ({e.status}): the proxy's service account needs {PERMISSION}"
        else:
            why = failure_line(e, self._timeout)
        log.log(level, "cluster identity: reading the %s Namespace failed: %s; %s, tried "
                "again every %g s", NAMESPACE, why, kept, self._retry,
                extra={"failures": self.failures})

    async def run(self) -> None:
        """Read now, then again after ``retry_seconds`` (failed) or ``refresh_seconds``."""
        while True:
            ok = await self.read()
            self.first_read.set()
            await asyncio.sleep(self._refresh if ok else self._retry)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="cluster identity")

    async def wait_first(self, timeout: float) -> bool:
        """Wait for the first read to be over, ``timeout`` seconds at most; whether a uid
        is known then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.first_read.wait()
        return bool(self.uid)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
