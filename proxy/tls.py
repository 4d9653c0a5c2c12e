"""TLS on the listening side: the server's ``SSLContext``, kept current with its files.

One context serves every connection (asyncio captures it when the listener starts), so a
rotated certificate is loaded *into that context*: ``load_cert_chain`` on a live context
takes effect for the next handshake (OpenSSL copies the certificate into each connection
when it is created), and connections already open keep the one they negotiated. A load
that fails would leave the context half changed, so each is tried on a scratch context
first (``ServerTLS._load``). A new
client CA bundle is added the same way (``load_verify_locations``). What one context cannot
do is forget: a CA removed from the bundle stays trusted until a restart, and so do the
file paths and the client-auth mode read at start (docs/operations.md, "TLS").

Files are checked with a stat every ``check_interval`` seconds (inode, mtime, size: a
Kubernetes Secret volume swaps a symlink, which changes the inode). A certificate caught
half-written (its key not yet matching) is not loaded; the old one keeps serving and the
next check retries. Each distinct failure is logged once.

A handshake the context refuses is counted and logged by ``refusals``
(proxy/tls_handshake.py), which the listener reports to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from proxy.config import ServerSettings, client_auth_type
from proxy.tasks import cancel_and_wait
from proxy.tls_handshake import Refusals

log = logging.getLogger("karta.tls")

#: how often the certificate, key and client CA files are stat'ed
CHECK_INTERVAL_SECONDS = 5.0

#: ``server.tls_client_auth_type`` -> what the ssl module checks
VERIFY_MODES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


@dataclass(frozen=True)
class FileStamp:
    """What a stat says of one file; a different stamp means the file changed."""

    inode: int
    mtime_ns: int
    size: int


def _stamp(path: str) -> FileStamp | None:
    if not path:
        return None
    st = os.stat(path)
    return FileStamp(st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class Stamps:
    """The stamps of the three files, compared as one."""

    cert: FileStamp | None
    key: FileStamp | None
    client_ca: FileStamp | None


class ServerTLS:
    """The listening side's ``SSLContext`` and the watcher that keeps it current."""

    def __init__(
        self, settings: ServerSettings, *, check_interval: float = CHECK_INTERVAL_SECONDS,
        on_reload: Callable[[bool], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        """Loads the files now: a bad certificate fails the start, not the first handshake.
        ``on_refused`` counts a failed handshake by its reason (proxy/tls_handshake.py)."""
        self.cert_file = settings.tls_cert_file
        self.key_file = settings.tls_key_file
        self.client_ca_file = settings.tls_client_ca_file
        self.client_auth_type = client_auth_type(settings)
        self.check_interval = check_interval
        self._on_reload = on_reload
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.verify_mode = VERIFY_MODES[self.client_auth_type]
        self._stamps = self._read_stamps()
        self._load()
        #: the last failure logged (the files' stamps and why), so each is logged once
        self._failed: tuple[Stamps | None, str] | None = None
        self._task: asyncio.Task[None] | None = None
        #: failed handshakes, counted and logged; the listener (TLSSite) reports to it
        self.refusals = Refusals(on_refused)

    def _read_stamps(self) -> Stamps:
        return Stamps(_stamp(self.cert_file), _stamp(self.key_file), _stamp(self.client_ca_file))

    def _load(self) -> None:
        """Load the files into the live context, all or nothing.

        A failed ``load_cert_chain`` leaves an OpenSSL context half changed (the new
        certificate with the old key: every later handshake fails), so the files are read
        once, tried on a scratch context, and only then loaded into the live one, from the
        same bytes (a private copy: ``load_cert_chain`` takes paths only), so a file
        rewritten in between cannot make the second load differ from the first.
        """
        with open(self.cert_file, "rb") as f:
            cert = f.read()
        with open(self.key_file, "rb") as f:
            key = f.read()
        ca = ""
        if self.client_ca_file:
            with open(self.client_ca_file, encoding="ascii", errors="replace") as f:
                ca = f.read()
        try:
            tmp = tempfile.TemporaryDirectory(prefix="karta-tls-")  # mode 0700
        except OSError:  # no writable temp dir (read-only root): the files themselves
            self._load_from(self.cert_file, self.key_file, ca)
            return
        with tmp:
            cert_path, key_path = os.path.join(tmp.name, "tls.crt"), os.path.join(tmp.name,
                                                                                  "tls.key")
            for path, data in ((cert_path, cert), (key_path, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            self._load_from(cert_path, key_path, ca)

    def _load_from(self, cert_path: str, key_path: str, ca: str) -> None:
        scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        scratch.load_cert_chain(cert_path, key_path)
        if ca:
            scratch.load_verify_locations(cadata=ca)
        self.context.load_cert_chain(cert_path, key_path)
        if ca:
            self.context.load_verify_locations(cadata=ca)

    def check(self, *, force: bool = False) -> bool:
        """Load the files again if they changed (always with ``force``, as on a reload).

        Returns whether they were loaded. A failure keeps what is loaded and is logged
        (once per distinct state of the files); the next check tries again.
        """
        try:
            stamps = self._read_stamps()
        except OSError as e:
            self._fail(None, f"cannot stat: {e}")
            return False
        if not force and stamps == self._stamps:
            return False
        try:
            self._load()
        except (ssl.SSLError, OSError) as e:
            self._fail(stamps, str(e))
            return False
        self._stamps, self._failed = stamps, None
        log.info("TLS certificate loaded", extra={
            "cert_file": self.cert_file, "key_file": self.key_file,
            "client_ca_file": self.client_ca_file, "forced": force})
        if self._on_reload is not None:
            self._on_reload(True)
        return True

    def _fail(self, stamps: Stamps | None, why: str) -> None:
        if (stamps, why) == self._failed:
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
