"""The upstream's client TLS and credential files, each re-read when it changes.

Rotated tokens, passwords, CA bundles and client certificates are files that change under
a running proxy (a Kubernetes Secret volume swaps a symlink). Each is stat'ed at most once
per ``check_interval`` seconds, from the request path, so a request pays one clock read in
the common case; a change is seen by its stamp (``proxy.tls_files.FileStamp``) and read
again. The client context is built by ``proxy.tls_files.client_context``, the builder the
settings' validation builds with.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.config import UpstreamSettings
from proxy.tls_files import (
    CredentialError,
    FileStamp,
    certificate_validity,
    client_context,
    failure_text,
    read_credential,
    stamp,
)

log = logging.getLogger("karta.upstream")


class FileSecret:
    """A credential read from a file and re-read when the file changes (rotated tokens).

    The file is stat'ed at most once per ``check_interval`` seconds, so the request path
    pays one clock read in the common case. A file that vanishes keeps the last value;
    each distinct error is logged once until the file reads again, which is logged once
    too (a warning per check was ~3,600 lines an hour of one missing file, and a path
    alternating between two errors, as a Secret volume's swap can, was still one a
    check when only a change of error was logged). ``on_change`` is told of a new value
    read (not of the first): a credential refused may be right now.
    """

    def __init__(
        self, path: str, *, header: bool, check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        #: the text is sent in a header as it is (a bearer token): one line
        #: (``read_credential``); a rewrite that is not keeps the last value, as a file
        #: that cannot be read does
        self._header = header
        self._interval = check_interval
        self._clock = clock
        self._on_change = on_change
        self._next_check = 0.0
        self._stamp: FileStamp | None = None
        self._value = ""
        #: the errors logged since the file last read, empty while it reads
        self._errors: set[str] = set()
        self.get()

    def get(self) -> str:
        now = self._clock()
        if now < self._next_check:
            return self._value
        self._next_check = now + self._interval
        try:
            current = stamp(self.path)
            if current != self._stamp:
                value = read_credential(self.path, header=self._header)
                changed = self._stamp is not None and value != self._value
                self._value, self._stamp = value, current
                if changed and self._on_change is not None:
                    self._on_change()
        except (OSError, CredentialError) as e:
            if str(e) not in self._errors:
                self._errors.add(str(e))
                # read but not sendable (CredentialError) is not "cannot read": the
                # operator looks at the file's content, not its permissions
                what = "cannot use" if isinstance(e, CredentialError) else "cannot read"
                log.warning(f"{what} credential file, keeping the last value",
                            extra={"path": self.path, "error": str(e)})
            return self._value
        if self._errors:
            self._errors.clear()
            log.info("credential file read again", extra={"path": self.path})
        return self._value


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def build_ssl_context(s: UpstreamSettings) -> ssl.SSLContext | None:
    """TLS settings -> an SSLContext, or None when the client's defaults do
    (``proxy.upstream_http.default_tls_context``)."""
    return client_context(s.tls_ca_file, s.tls_cert_file, s.tls_key_file,
                          s.tls_insecure_skip_verify)


@dataclass(frozen=True)
class ClientStamps:
    """The stamps of the upstream's TLS files, compared as one (None: a file not set)."""

    ca: FileStamp | None
    cert: FileStamp | None
    key: FileStamp | None


def _tls_stamps(s: UpstreamSettings) -> ClientStamps:
    """The stamps of the upstream TLS files; OSError for one set and gone."""
    return ClientStamps(stamp(s.tls_ca_file), stamp(s.tls_cert_file), stamp(s.tls_key_file))


@dataclass(frozen=True)
class ClientTLSLoad:
    """A client context built from the files, not yet used, and their stamps."""

    context: ssl.SSLContext
    stamps: ClientStamps
    #: how many loads had been adopted when it was built (``ClientTLS.adopt``)
    generation: int = 0


class ClientTLS:
    """The upstream's client ``SSLContext``, built again when its files change.

    As the credential files (``FileSecret``): the CA, client certificate and key are
    stat'ed at most once per ``check_interval`` seconds, from the request path, and on a
    reload (``build`` / ``adopt``); a change builds a new context, which new connections
    are made with (the client keeps its pool's connections apart by context, so
    keep-alive connections of the old one are not reused for it). A build that fails
    keeps the context in use; checks
    count and log each distinct failure once, a reload each of its own. Built once at
    start before, an upstream CA fixed
    on disk took a restart: every write 502 meanwhile, SIGHUP or not.
    """

    def __init__(self, settings: UpstreamSettings, *, check_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_reload: Callable[[bool], None] | None = None,
                 on_expiry: Callable[[float], None] | None = None) -> None:
        """``on_reload`` is told each load after the first (True) or failed one (False);
        ``on_expiry`` the client certificate's notAfter at each load."""
        self.settings = settings
        self._interval = check_interval
        self._clock = clock
        self._on_reload = on_reload
        self._on_expiry = on_expiry
        self._next_check = clock() + check_interval
        self._stamps = _tls_stamps(settings)
        ctx = build_ssl_context(settings)
        assert ctx is not None, "ClientTLS is made for an upstream with TLS settings"
        self.context = ctx
        #: the last failure counted and logged (the files' stamps, why), None since a load
        self._failed: tuple[ClientStamps | None, str] | None = None
        #: loads adopted so far: a reload's, built before it awaited, is stale if a
        #: request's check adopted newer files meanwhile
        self._generation = 0
        self._validity()

    def build(self) -> ClientTLSLoad:
        """A new context from the files, or the exception; nothing in use changes."""
        stamps = _tls_stamps(self.settings)
        ctx = build_ssl_context(self.settings)
        assert ctx is not None
        return ClientTLSLoad(ctx, stamps, self._generation)

    def trial(self) -> ClientTLSLoad:
        """``build``, then raised if it failed (a reload). A failure is counted and logged
        at every reload, and remembered as a check's is: the checks after it on the same
        files do not count it again (one broken file was counted by the reload, then
        again by the next request's check)."""
        try:
            return self.build()
        except Exception as e:
            stamps = None
            with contextlib.suppress(OSError):
                stamps = _tls_stamps(self.settings)
            self._fail(stamps, failure_text(e), reload=True)
            raise

    def adopt(self, loaded: ClientTLSLoad) -> None:
        """Make new connections with ``loaded``; not when a request's check adopted newer
        files since it was built (a reload awaits between the two), which stay."""
        if loaded.generation != self._generation:
            log.info("upstream TLS files reloaded; a check loaded them since, and what it "
                     "loaded stays", extra={"ca_file": self.settings.tls_ca_file,
                                            "cert_file": self.settings.tls_cert_file})
            if self._on_reload is not None:
                self._on_reload(True)
            return
        self._generation += 1
        changed = loaded.stamps != self._stamps
        self.context, self._stamps, self._failed = loaded.context, loaded.stamps, None
        log.info("upstream TLS files loaded", extra={
            "ca_file": self.settings.tls_ca_file, "cert_file": self.settings.tls_cert_file,
            "changed": changed})
        self._validity()
        if self._on_reload is not None:
            self._on_reload(True)

    def _fail(self, stamps: ClientStamps | None, why: str, *, reload: bool = False) -> None:
        """Count and log a failed load: each reload's, a check's once per state of the
        files and error (a file that stays broken is not counted every second)."""
        if not reload and (stamps, why) == self._failed:
            return
        self._failed = (stamps, why)
        if self._on_reload is not None:
            self._on_reload(False)
        log.error("upstream TLS files not loaded; the context in use stays", extra={
            "ca_file": self.settings.tls_ca_file,
            "cert_file": self.settings.tls_cert_file, "error": why})

    def _validity(self) -> None:
        """An expired (or not yet valid) client certificate loads, and the upstream then
        refuses every connection with a TLS error that names no date: say so at the load,
        and publish its end."""
        cert_file = self.settings.tls_cert_file
        if not cert_file:
            return
        not_before, not_after = certificate_validity(cert_file)
        if not_after is None:
            return
        if self._on_expiry is not None:
            self._on_expiry(not_after)
        now = time.time()
        if now >= not_after:
            log.error("upstream TLS client certificate has expired: an upstream that "
                      "verifies it refuses every connection; replace it", extra={
                          "cert_file": cert_file, "not_after": _utc(not_after)})
        elif not_before is not None and now < not_before:
            log.error("upstream TLS client certificate is not valid yet: an upstream that "
                      "verifies it refuses every connection until then (or the clock is "
                      "wrong)", extra={"cert_file": cert_file, "not_before": _utc(not_before)})

    def get(self) -> ssl.SSLContext:
        """The context for the next request: the files checked if it is time."""
        now = self._clock()
        if now < self._next_check:
            return self.context
        self._next_check = now + self._interval
        stamps = None
        try:
            stamps = _tls_stamps(self.settings)
            if stamps != self._stamps:
                self.adopt(self.build())
        except Exception as e:  # a file gone, half written, not PEM: keep the one in use
            self._fail(stamps, failure_text(e))
        return self.context
