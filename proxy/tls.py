"""TLS on the listening side: the server's ``SSLContext``, kept current with its files.

Each load builds a *fresh* context from the files, and the listener's protocol factory
asks for the current one on each new connection (``ServerTLS.current``,
proxy/tls_handshake.py): a new handshake gets the new context, connections already open
keep the one they negotiated, unless the new client CA bundle leaves out a certificate the
old one trusted (a CA, or a client's self-signed certificate pinned there, which
``get_ca_certs`` does not list: the bundle's PEM blocks are compared) while client
certificates are verified: then every connection made with an older context is closed
after the answer to its request in flight (at once when idle), so a client of a removed
CA cannot go on writing on a keep-alive connection it opened before (it did, for as long
as it liked).
A load that fails builds nothing the listener sees: the old context keeps serving.
Loading into the live context instead (as before) could add but not take away: OpenSSL
keeps one certificate per key type, so an ECDSA -> RSA rotation kept serving the old
ECDSA certificate to every client that offers ECDSA (most), and a CA removed from the
client CA bundle stayed trusted until a restart.

The context is built by ``proxy.tls_files.server_context``, the builder the settings'
validation builds with, so files the validation took (a client CA bundle with a
``# Issuer: CN=Zürich`` comment, any non-ASCII byte outside the PEM blocks) load here too.

Files are checked with a stat every ``check_interval`` seconds (inode, mtime, size: a
Kubernetes Secret volume swaps a symlink, which changes the inode). A certificate caught
half-written (its key not yet matching) is not loaded; the old one keeps serving and the
next check retries. A check logs and counts each distinct failure once; a reload, each of
its failures.

A serving certificate out of its validity period (expired, or not yet valid) is loaded
(the files are the operator's to fix; refusing them would not serve the old one either
after a restart) but logged as an error at each load, and its end of validity is
``karta_proxy_tls_certificate_expiry_timestamp_seconds``.

A handshake the context refuses is counted and logged by ``refusals``
(proxy/tls_handshake.py), which the listener reports to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from proxy.config import ServerSettings, client_auth_type
from proxy.tasks import cancel_and_wait
from proxy.tls_files import (
    VERIFY_MODES,
    FileStamp,
    Part,
    certificate_validity,
    failure_text,
    pem_certificates,
    server_context,
    stamp,
)
from proxy.tls_handshake import Refusals, TLSConnections

log = logging.getLogger("karta.tls")

#: how often the certificate, key and client CA files are stat'ed
CHECK_INTERVAL_SECONDS = 5.0

@dataclass(frozen=True)
class Stamps:
    """The stamps of the three files, compared as one."""

    cert: FileStamp | None
    key: FileStamp | None
    client_ca: FileStamp | None


@dataclass(frozen=True)
class Loaded:
    """A context built from the files, not yet serving, and what it was built from."""

    context: ssl.SSLContext
    stamps: Stamps
    #: the serving certificate's validity (unix seconds); None when it could not be read
    not_before: float | None
    not_after: float | None
    #: the certificates (DER) a client's may chain to: every one in the client CA
    #: bundle, none when client certificates are not verified (they let no one in)
    client_cas: frozenset[bytes] = frozenset()
    #: how many loads had been adopted when it was built (``ServerTLS.adopt``)
    generation: int = 0


class ServerTLS:
    """The listening side's current ``SSLContext`` and the watcher that keeps it current."""

    def __init__(
        self, settings: ServerSettings, *, check_interval: float = CHECK_INTERVAL_SECONDS,
        on_reload: Callable[[bool], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_expiry: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Loads the files now: a bad certificate fails the start, not the first handshake.
        ``on_refused`` counts a failed handshake by its reason (proxy/tls_handshake.py);
        ``on_expiry`` is told the serving certificate's notAfter at each load."""
        self.cert_file = settings.tls_cert_file
        self.key_file = settings.tls_key_file
        self.client_ca_file = settings.tls_client_ca_file
        self.client_auth_type = client_auth_type(settings)
        self.check_interval = check_interval
        self._on_reload = on_reload
        self._on_expiry = on_expiry
        self._clock = clock
        #: the last failure logged (the files' stamps and why), so each is logged once
        self._failed: tuple[Stamps | None, str] | None = None
        #: the file (or certificate and key) the last ``build`` failed to load, "" if none
        self._failing = ""
        #: loads adopted so far: a reload's, built before it awaited, is stale if a check
        #: adopted newer files meanwhile
        self._generation = 0
        loaded = self.build()
        self.context = loaded.context
        self._stamps = loaded.stamps
        #: what the context in use trusts of client certificates (``Loaded.client_cas``)
        self._client_cas = loaded.client_cas
        self._validity(loaded)
        self._task: asyncio.Task[None] | None = None
        #: failed handshakes, counted and logged; the listener (TLSSite) reports to it
        self.refusals = Refusals(on_refused)
        #: the connections open now, listed by the listener (TLSSite)
        self.connections = TLSConnections()

    def current(self) -> ssl.SSLContext:
        """The context a new connection is served with (the listener asks each time)."""
        return self.context

    def _read_stamps(self) -> Stamps:
        return Stamps(stamp(self.cert_file), stamp(self.key_file), stamp(self.client_ca_file))

    def build(self) -> Loaded:
        """A fresh context from the files, or an exception; nothing in use is touched.

        The stamps are read before the files, so a file changed during the build is seen
        changed at the next check and loaded again.
        """
        stamps = self._read_stamps()
        self._failing = ""
        mode = VERIFY_MODES[self.client_auth_type]
        verified = mode != ssl.CERT_NONE and bool(self.client_ca_file)
        before = self._client_ca_bytes() if verified else b""
        ctx = server_context(self.cert_file, self.key_file, self.client_ca_file, mode,
                             loading=self._loading)
        cas: frozenset[bytes] = frozenset()
        if verified:
            # a rotation between the two reads leaves OpenSSL with either file, so both
            # count as trusted; the stamps, read first, see the change and the next check
            # loads the file again
            with self._loading("ca"):
                cas = pem_certificates(before) | pem_certificates(self._client_ca_bytes())
        return Loaded(ctx, stamps, *certificate_validity(self.cert_file), client_cas=cas,
                      generation=self._generation)

    def _client_ca_bytes(self) -> bytes:
        with self._loading("ca"), open(self.client_ca_file, "rb") as f:
            return f.read()

    @contextlib.contextmanager
    def _loading(self, part: Part) -> Iterator[None]:
        """Remember which file a failed ``build`` was loading: the ssl module's words
        ("PEM lib", "No such file or directory") name none, and the line named all three."""
        try:
            yield
        except Exception:
            self._failing = (f"{self.cert_file!r} with {self.key_file!r}" if part == "cert"
                             else repr(self.client_ca_file))
            raise

    def named(self, e: Exception) -> str:
        """Why the last ``build`` failed, with the file it was loading."""
        why = failure_text(e)
        return f"cannot load {self._failing}: {why}" if self._failing else why

    def trial(self) -> Loaded:
        """``build``, then raised if it failed: a reload tries the files before it applies
        anything, and fails whole. A failure is counted and logged at every reload, even
        the same as the last check's (an operator who sent SIGHUP looks for its line and
        its count), and the checks after it do not count it again."""
        try:
            return self.build()
        except Exception as e:
            stamps = None
            with contextlib.suppress(OSError):
                stamps = self._read_stamps()
            self._fail(stamps, self.named(e), reload=True)
            raise

    def adopt(self, loaded: Loaded, *, forced: bool = False) -> None:
        """Serve new connections with ``loaded`` (a ``build`` that succeeded); when it
        trusts fewer client CAs, close the connections made under the old ones.

        A reload builds, awaits the rest of its work, then adopts: a check that adopted
        meanwhile read the files later, so the reload's older context is not put back over
        it (the load is counted, it succeeded)."""
        if loaded.generation != self._generation:
            log.info("TLS files reloaded; a check loaded them since, and what it loaded "
                     "stays", extra={"cert_file": self.cert_file,
                                     "client_ca_file": self.client_ca_file})
            if self._on_reload is not None:
                self._on_reload(True)
            return
        self._generation += 1
        old = self._client_cas
        self.context, self._stamps, self._failed = loaded.context, loaded.stamps, None
        self._client_cas = loaded.client_cas
        log.info("TLS certificate loaded", extra={
            "cert_file": self.cert_file, "key_file": self.key_file,
            "client_ca_file": self.client_ca_file, "forced": forced})
        removed = old - loaded.client_cas
        if removed:
            closing = self.connections.retire(loaded.context)
            log.warning("client CAs removed from the bundle: connections made under the old "
                        "one close after their request in flight", extra={
                            "client_ca_file": self.client_ca_file,
                            "removed_cas": len(removed), "connections": closing})
        self._validity(loaded)
        if self._on_reload is not None:
            self._on_reload(True)

    def _validity(self, loaded: Loaded) -> None:
        """Say when the serving certificate is out of its validity period, and publish
        its end."""
        if loaded.not_after is None:
            return
        if self._on_expiry is not None:
            self._on_expiry(loaded.not_after)
        now = self._clock()
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(loaded.not_after))
        if now >= loaded.not_after:
            log.error("TLS certificate has expired: clients that verify it refuse every "
                      "connection; replace it", extra={
                          "cert_file": self.cert_file, "not_after": until})
        elif loaded.not_before is not None and now < loaded.not_before:
            log.error("TLS certificate is not valid yet: clients that verify it refuse every "
                      "connection until then (or the clock is wrong)", extra={
                          "cert_file": self.cert_file, "not_before": time.strftime(
                              "%Y-%m-%dT%H:%M:%SZ", time.gmtime(loaded.not_before))})

    def check(self, *, force: bool = False) -> bool:
        """Load the files again if they changed (always with ``force``, as on a reload).

        Returns whether they were loaded. A failure of any kind keeps what is loaded and
        is logged (once per distinct state of the files); the next check tries again.
        """
        try:
            stamps = self._read_stamps()
        except OSError as e:
            self._fail(None, f"cannot stat: {e}")
            return False
        if not force and stamps == self._stamps:
            return False
        try:
            loaded = self.build()
        except Exception as e:  # ssl.SSLError, OSError, or anything a file could cause
            self._fail(stamps, self.named(e))
            return False
        self.adopt(loaded, forced=force)
        return True

    def _fail(self, stamps: Stamps | None, why: str, *, reload: bool = False) -> None:
        """Count and log a failed load: each reload's, a check's once per state of the
        files and error (files that stay broken are not counted every check)."""
        if not reload and (stamps, why) == self._failed:
            return
        self._failed = (stamps, why)
        log.error("TLS files not loaded; the certificate in use stays", extra={
            "cert_file": self.cert_file, "key_file": self.key_file,
            "client_ca_file": self.client_ca_file, "error": why})
        if self._on_reload is not None:
            self._on_reload(False)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                self.check()
            except Exception:  # never let the watcher end
                log.exception("TLS file check failed")

    def start(self) -> None:
        if self._task is None and self.check_interval > 0:
            self._task = asyncio.create_task(self._watch(), name="tls-files")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.refusals.close()
