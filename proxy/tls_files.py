"""TLS and credential files, read the one way every user of them reads them.

Three ideas, each written once here: what says that a file changed (``FileStamp``, from a
stat), how the files become an ``SSLContext`` (``client_context`` for the upstream,
``server_context`` for the listener), and how every context of the proxy verifies its
peer's certificate, a server's or a sender's (``verify_as_go``, ``go_client_context``).
The settings' validation (proxy/config.py) builds its contexts with the same two builders
that serve: a file the validation takes is a file the proxy loads, and the other way round
(the upstream's was checked on a context made another way than the one used, with no
system CAs and none of the defaults ``create_default_context`` sets).

A leaf: it imports nothing of the project, so the settings (``proxy.config``), the
listener's TLS (``proxy.tls``, which imports the settings) and the upstream's
(``proxy.upstream_tls``) can all build on it without a cycle.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

#: ``server.tls_client_auth_type`` -> what the ssl module checks
VERIFY_MODES = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


@dataclass(frozen=True)
class FileStamp:
    """What a stat says of one file; a different stamp means the file changed.

    The inode is in it because a Kubernetes Secret volume swaps a symlink: the new file
    may have the old one's size and even its mtime."""

    inode: int
    mtime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        """The stamp of a stat already made (of a path, or ``fstat`` of an open file)."""
        return cls(st.st_ino, st.st_mtime_ns, st.st_size)


def stamp(path: str) -> FileStamp | None:
    """The file's stamp; None for a file not set (""). OSError for one that is gone."""
    if not path:
        return None
    return FileStamp.of(os.stat(path))


class CredentialError(ValueError):
    """A credential file read, but its text cannot be sent; the message says why and
    where, never the text."""


#: what the upstream client refuses in a header value (``proxy.upstream_http``, as aiohttp's
#: did: it raises on every request): controls but HTAB
HEADER_VALUE_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def read_credential(path: str, *, header: bool) -> str:
    """A credential file's text, whitespace around it trimmed, as the upstream client
    sends it. ``header``: the text goes into a header as it is (a bearer token), so a
    line break or other control character inside it is refused: aiohttp refused every
    request with a ``ValueError`` naming neither the file nor the header, answered 502
    to every sender. Text that is not UTF-8 is refused too: it escaped the start as a
    ``UnicodeDecodeError`` traceback. OSError when the file cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CredentialError(f"{path!r} is not UTF-8 text (byte {e.start}; the content is "
                              "not shown)") from None
    bad = HEADER_VALUE_FORBIDDEN.search(text) if header else None
    if bad:
        lines = text.count("\n") + 1
        what = f"{lines} lines" if lines > 1 else f"a control character ({bad.group()!r})"
        raise CredentialError(f"{path!r} holds {what} after trimming (the content is not "
                              "shown); a token is sent as one header line: keep only it")
    return text


#: which file a builder is loading: the CA bundle, or the certificate with its key
Part = Literal["ca", "cert"]
#: wraps each file's load, told which: the settings' validation turns a failure into an
#: error naming the setting; the default lets the ssl module's own exception through
Loading = Callable[[Part], AbstractContextManager[None]]


def _as_is(part: Part) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def verify_as_go(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """``ctx`` made to verify its peer's certificate as Go's ``crypto/x509`` does, the
    verifier of the proxy's peers (Prometheus, vmagent, kubectl, and Prometheus' web
    config for client certificates), on every Python; returned. A client context, or
    the listener's, of client certificates.

    ``ssl.create_default_context`` sets ``VERIFY_X509_STRICT`` and
    ``VERIFY_X509_PARTIAL_CHAIN`` from Python 3.13, neither before. Strict refuses a
    certificate a CA issued without an Authority Key Identifier (common in internal PKIs
    and certificates of older openssl or hand-made scripts), which Go accepts: the same
    proxy image refused an upstream or API server on 3.13 that it and Prometheus took on
    3.12. Partial chain trusts every certificate of the CA file as an anchor (an
    intermediate alone in it, too), as Go's root pool does. So: strict cleared, partial
    chain set, whatever the Python."""
    ctx.verify_flags = ((ctx.verify_flags & ~ssl.VERIFY_X509_STRICT)
                        | ssl.VERIFY_X509_PARTIAL_CHAIN)
    return ctx


def go_client_context(cafile: str | None = None) -> ssl.SSLContext:
    """Python's default client context (``cafile``, else the system's CAs) verifying as Go
    does (:func:`verify_as_go`): what every client context of the proxy starts from."""
    return verify_as_go(ssl.create_default_context(cafile=cafile))


def client_context(
    ca: str, cert: str, key: str, insecure_skip_verify: bool, *, loading: Loading = _as_is,
) -> ssl.SSLContext | None:
    """The upstream's client context, or None when nothing is set and the client's defaults
    do (the system CAs, verified)."""
    if not (ca or cert or insecure_skip_verify):
        return None
    with loading("ca"):
        ctx = go_client_context(ca or None)
    if cert:
        with loading("cert"):
            ctx.load_cert_chain(cert, key or None)
    if insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def server_context(
    cert: str, key: str, client_ca: str, verify_mode: ssl.VerifyMode, *,
    loading: Loading = _as_is,
) -> ssl.SSLContext:
    """The listener's context: TLS 1.2 at least, the certificate and key, and the CA that
    client certificates must chain to (as ``cafile=``: a bundle with a non-ASCII comment
    outside its PEM blocks loads), verified as Go does (:func:`verify_as_go`): the
    senders' web config names the same bundle for Prometheus' own listener, which takes
    a client certificate chaining to an intermediate alone in it; OpenSSL's default
    refused that certificate (``unable to get issuer certificate``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = verify_mode
    with loading("cert"):
        ctx.load_cert_chain(cert, key)
    if client_ca:
        with loading("ca"):
            ctx.load_verify_locations(cafile=client_ca)
    return verify_as_go(ctx)


#: a PEM certificate block, as OpenSSL reads one from a CA file (``TRUSTED CERTIFICATE``
#: is OpenSSL's with trust settings appended: a trust anchor all the same)
_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN (TRUSTED )?CERTIFICATE-----(.*?)-----END (TRUSTED )?CERTIFICATE-----",
    re.DOTALL)


def pem_certificates(data: bytes) -> frozenset[bytes]:
    """The DER of every certificate block in a PEM bundle, CA or not.

    ``SSLContext.get_ca_certs`` lists only what passes OpenSSL's ``X509_check_ca``, but a
    bundle also trusts a self-signed leaf pinned in it (CA:FALSE, or no
    basicConstraints): what the bundle trusts is every certificate block in it. A block
    that is no base64 raises ``ValueError`` (OpenSSL refused the file anyway)."""
    found = set()
    for m in _PEM_CERTIFICATE.finditer(data):
        body = m.group(2).decode("ascii")  # raises UnicodeDecodeError, a ValueError
        found.add(ssl.PEM_cert_to_DER_cert(
            f"{ssl.PEM_HEADER}\n{body.strip()}\n{ssl.PEM_FOOTER}\n"))
    return frozenset(found)


def certificate_validity(cert_file: str) -> tuple[float | None, float | None]:
    """(notBefore, notAfter) of the first certificate in ``cert_file``, unix seconds.

    ``ssl`` has no public reader of a certificate file; its test helper is the one
    parser in the standard library (``cryptography`` is a test dependency only). A
    Python without it, or a file it cannot read, gives (None, None): no warning, no metric.
    """
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None, None
    try:
        info = decode(cert_file)
        return (ssl.cert_time_to_seconds(info["notBefore"]),
                ssl.cert_time_to_seconds(info["notAfter"]))
    except Exception:  # a parse failure here must not fail a load OpenSSL accepted
        return None, None


def failure_text(e: Exception) -> str:
    """Why a load failed, for a log line: the ssl module's or the OS's own words, else
    the exception's type too (whatever a file could make a load raise is a failed load)."""
    return str(e) if isinstance(e, ssl.SSLError | OSError) else f"{type(e).__name__}: {e}"
