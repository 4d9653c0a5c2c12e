"""Elect the one replica that writes the fact series, with a coordination.k8s.io/v1 Lease.

Several proxy replicas see the same cluster; if each wrote the fact series, every fact
would land once per replica. The replicas compete for one Lease the way client-go's
leader election does:

* the holder renews every ``lease_duration / 3`` (get, then replace carrying the
  ``resourceVersion`` it read: a concurrent writer gets 409 Conflict, so two candidates
  can never both win one round);
* a candidate takes the lease over when the holder has not renewed it for
  ``lease_duration``, measured on the candidate's *own* monotonic clock from the moment it
  last saw the record change, so clock skew between nodes cannot shorten the wait;
* a holder that cannot renew for ``2/3 * lease_duration`` stops calling itself leader
  before any candidate may take over, so two writers never overlap (absent a stalled
  process, which the API's optimistic concurrency still catches at its next renewal);
* ``stop(release=True)`` hands the lease back (empty holder) so a successor starts at once;
  a crashed replica simply stops renewing and is replaced after ``lease_duration``;
* a record under this replica's identity whose renewTime it did not write was written by
  another process configured with the same ``facts.identity``: client-go would let both
  lead (each renews "its" lease), and every fact would land twice. It counts as another
  holder's, with an error logged, so the two settle on one writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)


def micro_time(dt: datetime) -> Any:
    """A Kubernetes MicroTime: always six fractional digits (``isoformat`` drops them when
    the microseconds are 0, which the API server's RFC3339Micro parser refuses). Typed Any:
    the client's models annotate datetime, but serialize a string unchanged."""
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    """``<pod or host name>_<random>``: unique even when two processes share a hostname
    (hostNetwork pods, tests), like client-go's ``hostname + "_" + uuid``."""
    host = os.environ.get("POD_NAME") or socket.gethostname() or "karta-proxy"
    return f"{host}_{uuid.uuid4().hex[:8]}"


def _stamp(value: object) -> str:
    """A renewTime as written, whether the client read it back as a datetime or a string."""
    if isinstance(value, datetime):
        return micro_time(value)
    return str(value) if value is not None else ""


class LeaseElector:
    """Campaigns for one Lease; ``is_leader`` says whether this replica holds it now."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_seconds: float,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_duration_seconds <= 0:
            raise ValueError("lease_duration_seconds must be positive")
        self._api = k8s.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.lease_duration = float(lease_duration_seconds)
        self.retry_period = self.lease_duration / 3
        self.renew_deadline = self.lease_duration * 2 / 3
        self._mono = monotonic
        self._leader = False
        self._renewed_at = -math.inf
        #: (holder, renewTime, resourceVersion) last seen, and when (own clock)
        self._observed: tuple[str, str, str] | None = None
        #: the lease duration the record says its holder renews within (a holder of an
        #: older configuration may take longer than this replica's own duration)
        self._observed_duration = 0.0
        self._observed_at = -math.inf
        self._stop = asyncio.Event()
        self._done: asyncio.Event | None = None
        self._release = True
        #: the renewTimes of this process' last two writes (see :meth:`_twin`): two, as a
        #: write that failed (409, a timeout that landed after all) leaves either its own
        #: or the previous one in the record
        self._wrote: tuple[str, ...] = ()
        #: the first foreign renewTime seen under this identity ("" while none)
        self._twin_seen = ""
        self._twin_logged = False
        #: how many times this replica became leader
        self.acquisitions = 0
        #: rounds that found the lease renewed by another process under this identity
        self.twin_rounds = 0
        self.last_error = ""

    # -- state ---------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while holding the lease and last renewed within the renew deadline."""
        return self._leader and self._mono() - self._renewed_at < self.renew_deadline

    @property
    def observed_version(self) -> str:
        """resourceVersion of the lease record last seen ("" before the first read): its
        expiry is measured from when that record was first seen."""
        return self._observed[2] if self._observed is not None else ""

    def _set_leader(self, leader: bool) -> None:
        if leader and not self._leader:
            self.acquisitions += 1
            log.info("lease %s/%s acquired by %s", self.namespace, self.name, self.identity)
        elif self._leader and not leader:
            log.info("lease %s/%s lost by %s", self.namespace, self.name, self.identity)
        self._leader = leader

    def _observe(self, lease: k8s.V1Lease) -> str:
        """Remember the record; returns its holder ("" when free)."""
        spec = lease.spec or k8s.V1LeaseSpec()
        holder = spec.holder_identity or ""
        record = (holder, str(spec.renew_time), str(lease.metadata.resource_version))
        if record != self._observed:
            self._observed = record
            self._observed_at = self._mono()
            self._observed_duration = float(spec.lease_duration_seconds or 0)
        return holder

    def _twin(self, spec: k8s.V1LeaseSpec | None) -> bool:
        """The record names this identity but carries a renewTime this process never wrote:
        this replica's previous run (crashed, so it never released the lease; waited out as
        any other holder would be) or, once such a record is renewed again, another process
        sharing the identity (a templated ``facts.identity``)."""
        if spec is None or spec.holder_identity != self.identity:
            return False
        stamp = _stamp(spec.renew_time)
        if stamp in self._wrote:
            self._twin_seen = ""
            return False
        self.twin_rounds += 1
        if not self._twin_seen:
            self._twin_seen = stamp
            log.info("lease %s/%s: held as %r by an earlier run; waiting for it to expire",
                     self.namespace, self.name, self.identity)
        elif stamp != self._twin_seen and not self._twin_logged:
            self._twin_logged = True
            self.last_error = f"lease renewed by another process as {self.identity!r}"
            log.error("lease %s/%s: renewed by another process under this replica's "
                      "identity %r; give each replica its own facts.identity, or leave it "
                      "empty (a unique one is made). This one stands by",
                      self.namespace, self.name, self.identity)
        return True

    def _expired(self) -> bool:
        """The holder missed its renewals: as client-go reads it, by the longer of this
        replica's duration and the record's own (during a rolling change of the setting,
        a new replica with a shorter one took a healthy holder's lease, both writing)."""
        duration = max(self.lease_duration, self._observed_duration)
        return self._mono() - self._observed_at > duration

    # -- one round -----------------------------------------------------------------------

    def _spec(self, now: datetime, old: k8s.V1LeaseSpec | None, mine: bool) -> k8s.V1LeaseSpec:
        """The record this replica writes now; its renewTime remembered (:meth:`_twin`)."""
        transitions = (old.lease_transitions or 0) if old is not None else 0
        renew = micro_time(now)
        self._wrote = (*self._wrote[-1:], renew)
        return k8s.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, math.ceil(self.lease_duration)),
            acquire_time=micro_time(old.acquire_time if mine and old is not None
                                    and old.acquire_time else now),
            renew_time=renew,
            lease_transitions=transitions if mine or old is None else transitions + 1,
        )

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the lease afterwards, False when another
        does (or won the race). API failures raise: the caller cannot tell who holds it."""
        now = datetime.now(UTC)
        timeout = max(0.5, self.retry_period)
        try:
            lease = await self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=timeout
            )
        except ApiException as e:
            if e.status != 404:
                raise
            body = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(now, None, mine=False),
            )
            try:
                created = await self._api.create_namespaced_lease(
                    self.namespace, body, _request_timeout=timeout
                )
            except ApiException as ce:
                if ce.status == 409:  # another candidate created it first
                    return False
                raise
            self._observe(created)
            return True
        holder = self._observe(lease)
        twin = self._twin(lease.spec)
        if holder and (twin or holder != self.identity) and not self._expired():
            return False
        lease.spec = self._spec(now, lease.spec, mine=holder == self.identity and not twin)
        try:
            updated = await self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=timeout
            )
        except ApiException as e:
            if e.status == 409:  # someone renewed or took it since our read
                return False
            raise
        self._observe(updated)
        return True

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign and renew until :meth:`stop`."""
        self._done = asyncio.Event()
        try:
            while not self._stop.is_set():
                try:
                    held = await self.try_acquire_or_renew()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # unknown: keep leading until the renew deadline
                    self.last_error = str(exc) or type(exc).__name__
                    log.warning("lease %s/%s: %s", self.namespace, self.name, self.last_error)
                    if self._leader and self._mono() - self._renewed_at >= self.renew_deadline:
                        self._set_leader(False)
                else:
                    if held:
                        self._renewed_at = self._mono()
                    self._set_leader(held)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.retry_period)
            if self._release and self._leader:
                await self._release_lease()
        finally:
            self._set_leader(False)
            self._done.set()

    async def _release_lease(self) -> None:
        """Hand the lease back: an empty holder lets a successor take it at once."""
        try:
            lease = await self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=max(0.5, self.retry_period)
            )
            if (lease.spec is None or lease.spec.holder_identity != self.identity
                    or self._twin(lease.spec)):
                return
            now = datetime.now(UTC)
            lease.spec = k8s.V1LeaseSpec(
                holder_identity=None,
                lease_duration_seconds=1,
                acquire_time=micro_time(now),
                renew_time=micro_time(now),
                lease_transitions=lease.spec.lease_transitions,
            )
            await self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=max(0.5, self.retry_period)
            )
            log.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)
        except Exception as exc:  # the lease then simply expires
            log.warning("lease %s/%s: release failed: %s", self.namespace, self.name, exc)

    async def stop(self, *, release: bool = True) -> None:
        """End :meth:`run`; ``release=False`` leaves the lease to expire (as a crash would)."""
        self._release = release
        if not release:
            self._leader = False  # a dead replica writes nothing, whatever the lease says
        self._stop.set()
        if self._done is not None:
            await self._done.wait()
