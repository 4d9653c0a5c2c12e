"""Elect the one replica that writes the fact series, with a coordination.k8s.io/v1 Lease.

Several proxy replicas see the same cluster; if each wrote the fact series, every fact
would land once per replica. The replicas compete for one Lease the way client-go's
leader election does:

* a round starts every ``lease_duration / 3`` from the previous round's *start* (a slow
  API does not stretch the cadence); the holder renews with one replace of the record it
  wrote last (its ``resourceVersion``: a concurrent writer gets 409 Conflict, so two
  candidates can never both win one round), and reads the record only when that fails;
  each call may take up to the renew deadline (``2/3 * lease_duration``: a later answer
  could not keep a leader anyway), so a takeover succeeds on an API slower than a third of
  the lease;
* a candidate takes the lease over when the holder has not renewed it for
  ``lease_duration``, measured on the candidate's *own* monotonic clock from the moment it
  last saw the record change, so clock skew between nodes cannot shorten the wait; that
  clock is Linux' ``CLOCK_BOOTTIME`` (:func:`boot_clock`), which counts the time a
  suspended machine slept, where ``CLOCK_MONOTONIC`` does not: a leader resumed after a
  suspend longer than its lease knows at once that it no longer leads, where it wrote
  beside the new leader until its next renewal failed;
* a holder leads only until ``2/3 * lease_duration`` from the moment it *sent* its last
  successful renewal, so it stops calling itself leader before any candidate may take
  over (which counts from when it saw that renewal applied), and two writers never
  overlap (absent a stalled process, which the API's optimistic concurrency still catches
  at its next renewal, or a Lease object deleted or replaced while held: docs/metrics.md);
* ``step_down`` gives the lease up as a stop does and keeps this replica from campaigning
  for a while (the fact writer, when all its writes fail: another replica may write);
* ``stop(release=True)`` hands the lease back (empty holder) so a successor starts at once,
  in the time the caller gives it (a call under way is cancelled, not waited for); a
  crashed replica, or a release that does not land in time, simply stops renewing and is
  replaced after ``lease_duration``;
* a record under this replica's identity that it did not write (neither the acquireTime of
  one of its acquisitions, which its renewals keep, nor the renewTime of a write of its
  own not known to have failed) was written by an earlier run (waited out) or by another
  process configured with the same ``facts.identity``: client-go would let both lead
  (each renews "its" lease), and every fact would land twice. It counts as another
  holder's, with an error logged, so the two settle on one writer;
* a failing round is logged in one line (status, reason, message), throttled
  (:class:`proxy.log.Throttled`), and counted through ``on_failure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from proxy.kube.lean import ApiException
from proxy.kube.lean import client as k8s
from proxy.log import Throttled, failure_line

log = logging.getLogger(__name__)

#: how many of its own acquireTimes and unsettled renewTimes a replica remembers
#: (:meth:`LeaseElector._twin`): a handful is plenty, as a success settles them
REMEMBERED_STAMPS = 16


def failure_of(exc: BaseException, timeout: float) -> tuple[str, str]:
    """(reason, one line) for a failed Lease call: the API's status, reason and message,
    not the client's whole exception text (its HTTP headers and body, newlines and all:
    ~600 bytes a failing round)."""
    if isinstance(exc, ApiException):
        message = ""
        with contextlib.suppress(Exception):
            message = str(json.loads(exc.body or b"{}").get("message") or "")
        line = f"{exc.status} {exc.reason or ''}".strip()
        if message:
            line += f": {message}"
        return "status", " ".join(line.split())[:300]
    return ("timeout" if isinstance(exc, TimeoutError) else "connection",
            failure_line(exc, timeout))


#: the clock a suspend does not stop (Linux); ``time.monotonic`` elsewhere
_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def boot_clock() -> float:
    """Seconds on a monotonic clock that counts a suspend: a replica's own lease timing
    (a VM paused by its hypervisor stops this one too, and that is documented)."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


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
        monotonic: Callable[[], float] = boot_clock,
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
        #: each API call's timeout: the renew deadline. An answer later than that cannot
        #: keep or make a leader (it leads only until the deadline from the call's start),
        #: and a shorter one (it was L/3) made every takeover fail on an API answering in
        #: more than L/3, although its writes were applied: nobody led
        self.call_timeout = max(0.5, self.renew_deadline)
        #: each call of a release (at a stop or a step-down)
        self.release_timeout = max(0.5, self.retry_period)
        self._mono = monotonic
        self._leader = False
        #: own clock when the last successful renewal (or acquisition) was *sent*
        self._renewed_at = -math.inf
        #: own clock when the request of the round under way was sent
        self._sent_at = -math.inf
        #: the record as this replica wrote it last (a renewal replaces it directly);
        #: None when the last round did not end with a write of ours
        self._last: k8s.V1Lease | None = None
        #: (holder, renewTime, resourceVersion) last seen, and when (own clock)
        self._observed: tuple[str, str, str] | None = None
        #: the lease duration the record says its holder renews within (a holder of an
        #: older configuration may take longer than this replica's own duration)
        self._observed_duration = 0.0
        self._observed_at = -math.inf
        self._stop = asyncio.Event()
        #: set to start the next round at once (a step-down to carry out)
        self._wake = asyncio.Event()
        self._done: asyncio.Event | None = None
        self._release = True
        #: the loop's clock by which a stop's release must be done (``stop(timeout=)``)
        self._release_by: float | None = None
        #: the round (or step-down release) under way, which a stop cancels
        self._call: asyncio.Task[None] | None = None
        #: a stop cut a call under way: a write of it may have landed
        self._cut = False
        #: what tells this process' own record (see :meth:`_twin`): the acquireTimes it
        #: wrote acquiring the lease (its renewals keep it), and the renewTimes of its
        #: writes not known to have failed (a timed-out write may have landed). The
        #: renewTimes of the last two writes were all it knew: after two timed-out
        #: writes in a row it took its own lease for an earlier run's, waited it out and
        #: took it again as a new holder
        self._acquired: deque[str] = deque(maxlen=REMEMBERED_STAMPS)
        self._unsettled: deque[str] = deque(maxlen=REMEMBERED_STAMPS)
        #: the first foreign renewTime seen under this identity ("" while none)
        self._twin_seen = ""
        self._twin_logged = False
        #: own clock until which this replica does not campaign (after ``step_down``)
        self._cooldown_until = -math.inf
        #: a step-down's release still to be done by the loop
        self._release_owed = False
        #: how many times this replica became leader
        self.acquisitions = 0
        #: rounds that found the lease renewed by another process under this identity
        self.twin_rounds = 0
        self.last_error = ""
        #: called with a reason of ``proxy.contract.LEASE_FAILURE_REASONS`` for every
        #: failed round (metrics)
        self.on_failure: Callable[[str], None] | None = None
        self._failure_lines = Throttled(
            log, "fact writer lease: round failed", "fact writer lease: rounds failed",
            peer_field=None)

    # -- state ---------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while holding the lease and last renewed within the renew deadline."""
        return self._leader and self._mono() - self._renewed_at < self.renew_deadline

    @property
    def record_seen_ago(self) -> float:
        """Seconds since this replica last saw the lease record change (a renewal, a
        release, another holder), on its own clock; inf before it saw one. A standby's fact
        writer reads it: the holder was alive then (``FactWriter.takeover_window``)."""
        return self._mono() - self._observed_at

    @property
    def observed_version(self) -> str:
        """resourceVersion of the lease record last seen ("" before the first read): its
        expiry is measured from when that record was first seen."""
        return self._observed[2] if self._observed is not None else ""

    @property
    def cooling_down(self) -> bool:
        """After :meth:`step_down`, until its cooldown has passed: no campaign."""
        return self._mono() < self._cooldown_until

    def _set_leader(self, leader: bool) -> None:
        if leader and not self._leader:
            self.acquisitions += 1
            log.info("lease %s/%s acquired by %s", self.namespace, self.name, self.identity)
        elif self._leader and not leader:
            log.info("lease %s/%s lost by %s", self.namespace, self.name, self.identity)
        self._leader = leader

    def step_down(self, cooldown: float) -> None:
        """Stop leading now, give the lease back (an empty holder, as a stop does: another
        replica takes it at its next round) and campaign again only after ``cooldown``
        seconds, so that another replica gets it. Without another, this one takes it
        again then."""
        self._cooldown_until = self._mono() + max(0.0, cooldown)
        if self._leader:
            self._release_owed = True
            self._leader = False
            log.info("lease %s/%s: %s steps down for %g s", self.namespace, self.name,
                     self.identity, cooldown)
        self._wake.set()

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

    def _own(self, spec: k8s.V1LeaseSpec) -> bool:
        """The record is one this process wrote: its acquisition (the acquireTime, kept by
        every renewal), or a renewal whose fate it does not know."""
        acquired = _stamp(spec.acquire_time)
        return ((bool(acquired) and acquired in self._acquired)
                or _stamp(spec.renew_time) in self._unsettled)

    def _twin(self, spec: k8s.V1LeaseSpec | None) -> bool:
        """The record names this identity but this process never wrote it: this replica's
        previous run (crashed, so it never released the lease; waited out as any other
        holder would be) or, once such a record is renewed again, another process sharing
        the identity (a templated ``facts.identity``)."""
        if spec is None or spec.holder_identity != self.identity:
            return False
        if self._own(spec):
            self._twin_seen = ""
            return False
        stamp = _stamp(spec.renew_time)
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
        """The record this replica writes now; its stamps remembered (:meth:`_twin`)."""
        transitions = (old.lease_transitions or 0) if old is not None else 0
        renew = micro_time(now)
        kept = _stamp(old.acquire_time) if mine and old is not None else ""
        acquire: Any = kept or renew  # a string: the client serializes it as it is
        if not kept:
            self._acquired.append(acquire)
        self._unsettled.append(renew)
        return k8s.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, math.ceil(self.lease_duration)),
            acquire_time=acquire,
            renew_time=renew,
            lease_transitions=transitions if mine or old is None else transitions + 1,
        )

    def _settled(self, written: k8s.V1Lease) -> None:
        """A write of ours landed: the record is this one; no earlier write can land now
        (each carried an older resourceVersion), so only its renewTime stays unsettled."""
        self._observe(written)
        self._last = written
        self._renewed_at = self._sent_at
        self._unsettled.clear()
        self._unsettled.append(_stamp(written.spec.renew_time if written.spec else None))

    def _refused(self) -> None:
        """The write just sent was refused (409, 404): it never landed."""
        if self._unsettled:
            self._unsettled.pop()

    async def _replace(self, lease: k8s.V1Lease, mine: bool) -> bool:
        """Write ``lease`` with this replica as holder (``mine``: renewing its own record);
        False on a conflict (someone wrote since it was read)."""
        old = lease.spec
        self._sent_at = self._mono()
        lease.spec = self._spec(datetime.now(UTC), old, mine)
        try:
            updated = await self._api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self.call_timeout
            )
        except ApiException as e:
            if e.status == 409:  # someone renewed or took it since our read
                self._refused()
                return False
            raise
        self._settled(updated)
        return True

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the lease afterwards, False when another
        does (or won the race). API failures raise: the caller cannot tell who holds it.

        Renewing, one call: the record this replica wrote last, replaced as it is (one GET
        and one PUT a round made a slow API twice as slow). Only when that is refused (or
        after a round that did not end with a write of ours) is the record read."""
        last, self._last = self._last, None
        if last is not None:
            try:
                if await self._replace(last, mine=True):
                    return True
            except ApiException as e:
                if e.status != 404:  # deleted meanwhile: read (and create) as anyone
                    raise
                self._refused()
        try:
            lease = await self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.call_timeout
            )
        except ApiException as e:
            if e.status != 404:
                raise
            self._sent_at = self._mono()
            body = k8s.V1Lease(
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(datetime.now(UTC), None, mine=False),
            )
            try:
                created = await self._api.create_namespaced_lease(
                    self.namespace, body, _request_timeout=self.call_timeout
                )
            except ApiException as ce:
                if ce.status == 409:  # another candidate created it first
                    self._refused()
                    return False
                raise
            self._settled(created)
            return True
        holder = self._observe(lease)
        twin = self._twin(lease.spec)
        if holder and (twin or holder != self.identity) and not self._expired():
            return False
        return await self._replace(lease, mine=holder == self.identity and not twin)

    # -- the loop ------------------------------------------------------------------------

    def _failed(self, exc: Exception) -> None:
        """A round that raised: one line (throttled), counted; the leader keeps leading
        until its renew deadline, as it cannot tell who holds the lease."""
        reason, line = failure_of(exc, self.call_timeout)
        self.last_error = line
        self._failure_lines.event("lease", {"lease": f"{self.namespace}/{self.name}",
                                            "error": line, "reason": reason})
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure(reason)
        if self._leader and self._mono() - self._renewed_at >= self.renew_deadline:
            self._set_leader(False)

    async def run(self) -> None:
        """Campaign and renew until :meth:`stop`: a round every ``retry_period`` from the
        previous round's start (one that took longer is followed at once)."""
        self._done = asyncio.Event()
        clock = asyncio.get_running_loop().time
        try:
            while not self._stop.is_set():
                started = clock()
                self._wake.clear()
                if self._release_owed:
                    self._release_owed = False
                    await self._cancellable(self._release_lease())
                elif not self.cooling_down:
                    await self._cancellable(self._round())
                delay = started + self.retry_period - clock()
                if delay > 0 and not self._stop.is_set():
                    stop, wake = (asyncio.ensure_future(self._stop.wait()),
                                  asyncio.ensure_future(self._wake.wait()))
                    try:
                        await asyncio.wait({stop, wake}, timeout=delay,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        stop.cancel()
                        wake.cancel()
            if self._release and (self._leader or self._cut):
                await self._release_lease(self._release_by)
        finally:
            self._set_leader(False)
            self._failure_lines.close()
            self._done.set()

    async def _cancellable(self, calls: Coroutine[Any, Any, None]) -> None:
        """Run a round's (or a release's) API calls as a task of their own, which
        :meth:`stop` cancels: each call may take up to the renew deadline (2/3 of the
        lease, 10 s at 15), and a stop waited for it before its release, past a pod's
        grace period with the drain (26.5 s for 10 documented). A cancellation of the
        loop itself goes on as one."""
        task = asyncio.ensure_future(calls)
        self._call = task
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            self._cut = True
        finally:
            self._call = None

    async def _round(self) -> None:
        try:
            held = await self.try_acquire_or_renew()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unknown: keep leading until the renew deadline
            self._failed(exc)
            return
        if held and self.cooling_down:  # stepped down while the round was under way
            self._release_owed = True
            self._wake.set()
            held = False
        self._set_leader(held)

    async def _release_lease(self, by: float | None = None) -> None:
        """Hand the lease back: an empty holder lets a successor take it at once. Its calls
        get a third of the lease each, not the renew deadline, and at a stop no more than
        what is left until ``by`` (the loop's clock): a stop waits for them within its
        deadline, and a release that does not land in time only leaves the lease to
        expire, as a crash would. One call when the record this replica wrote last is
        still the lease (replaced as it is, as a renewal does); read first otherwise."""
        timeout = self.release_timeout
        if by is not None:
            timeout = min(timeout, by - asyncio.get_running_loop().time())
        last, self._last = self._last, None
        if timeout <= 0:
            log.warning("lease %s/%s: not released, the stop's time is up; it expires "
                        "within %g s", self.namespace, self.name, self.lease_duration)
            return
        try:
            async with asyncio.timeout_at(by):
                if not await self._released(last, timeout):
                    return
            log.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)
        except Exception as exc:  # the lease then simply expires
            # the time it had to a tenth: what the stop left it (0.995 s) is noise
            log.warning("lease %s/%s: release failed: %s; it expires within %g s",
                        self.namespace, self.name, failure_of(exc, round(timeout, 1))[1],
                        self.lease_duration)

    async def _released(self, last: k8s.V1Lease | None, timeout: float) -> bool:
        """The lease written with an empty holder: ``last`` (this replica's last write)
        replaced as it is, or, when another write came since (409) or there is none, the
        record read first and replaced if this replica holds it. False when it holds
        nothing to release."""
        if last is not None:
            try:
                await self._replace_released(last, timeout)
                return True
            except ApiException as e:
                if e.status == 404:  # deleted: nobody holds it
                    return False
                if e.status != 409:
                    raise
        lease = await self._api.read_namespaced_lease(
            self.name, self.namespace, _request_timeout=timeout
        )
        if (lease.spec is None or lease.spec.holder_identity != self.identity
                or self._twin(lease.spec)):
            return False
        await self._replace_released(lease, timeout)
        return True

    async def _replace_released(self, lease: k8s.V1Lease, timeout: float) -> None:
        now = datetime.now(UTC)
        old = lease.spec or k8s.V1LeaseSpec()
        lease.spec = k8s.V1LeaseSpec(
            holder_identity=None,
            lease_duration_seconds=1,
            acquire_time=micro_time(now),
            renew_time=micro_time(now),
            lease_transitions=old.lease_transitions,
        )
        await self._api.replace_namespaced_lease(
            self.name, self.namespace, lease, _request_timeout=timeout
        )

    async def stop(self, *, release: bool = True, timeout: float | None = None) -> None:
        """End :meth:`run`, cancelling a Lease call under way rather than waiting for it;
        ``release=False`` leaves the lease to expire (as a crash would); ``timeout``: how
        long from now the release may take in all (the stop's deadline; each of its calls
        gets a third of the lease at most either way)."""
        self._release = release
        if timeout is not None:
            self._release_by = asyncio.get_running_loop().time() + timeout
        if not release:
            self._leader = False  # a dead replica writes nothing, whatever the lease says
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._done is not None:
            await self._done.wait()
