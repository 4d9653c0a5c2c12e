"""File stamps and the TLS context builders (proxy/tls_files.py), which serve and validate
alike."""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.tls_files import (
    VERIFY_MODES,
    Part,
    client_context,
    failure_text,
    pem_certificates,
    server_context,
    stamp,
)
from tests.tls_certs import Authority, self_signed_client


def test_stamp_changes_with_the_file(tmp_path: Path) -> None:
    assert stamp("") is None
    path = tmp_path / "f"
    path.write_text("one")
    first = stamp(str(path))
    assert first == stamp(str(path))
    swapped = tmp_path / "g"
    swapped.write_text("one")
    os.replace(swapped, path)  # a Secret volume's swap: same size, a new inode
    assert stamp(str(path)) != first
    path.unlink()
    with pytest.raises(OSError):
        stamp(str(path))


def test_builders(tmp_path: Path) -> None:
    ca = Authority(tmp_path / "ca")
    served = ca.issue("server", server=True)
    client = ca.issue("client", server=False)
    assert client_context("", "", "", False) is None
    ctx = client_context(str(ca.ca_file), str(client.cert), str(client.key), False)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    server = server_context(str(served.cert), str(served.key), str(ca.ca_file),
                            VERIFY_MODES["VerifyClientCertIfGiven"])
    assert server.verify_mode == ssl.CERT_OPTIONAL
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2


def test_pem_certificates_are_every_certificate_a_bundle_trusts(tmp_path: Path) -> None:
    """``get_ca_certs`` leaves out a pinned self-signed leaf that OpenSSL trusts all the
    same: a bundle's trust is read from its certificate blocks instead."""
    ca = Authority(tmp_path / "ca")
    pinned = self_signed_client(tmp_path / "pinned", "pinned", ca=False)
    bare = self_signed_client(tmp_path / "bare", "bare", ca=None)
    data = ("# Issuer: CN=Zürich\n".encode() + ca.ca_file.read_bytes()
            + pinned.cert.read_bytes() + b"trailing words\n" + bare.cert.read_bytes())
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(data)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_verify_locations(cafile=str(bundle))
    assert len(ctx.get_ca_certs()) == 1  # what the check read before: the CA only
    der = {ssl.PEM_cert_to_DER_cert(p.read_text())
           for p in (ca.ca_file, pinned.cert, bare.cert)}
    assert pem_certificates(data) == der
    assert pem_certificates(b"no certificate here\n") == frozenset()
    with pytest.raises(ValueError):
        pem_certificates(b"-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n")


def test_loading_is_told_which_file_failed(tmp_path: Path) -> None:
    """What the settings' validation names a failed file by."""
    ca = Authority(tmp_path / "ca")
    served = ca.issue("server", server=True)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    failed: list[Part] = []

    @contextlib.contextmanager
    def loading(part: Part) -> Iterator[None]:
        try:
            yield
        except ssl.SSLError:
            failed.append(part)
            raise

    for build in (
        lambda: server_context(str(served.cert), str(served.key), str(garbage),
                               ssl.CERT_REQUIRED, loading=loading),
        lambda: server_context(str(garbage), str(served.key), "", ssl.CERT_NONE,
                               loading=loading),
        lambda: client_context(str(garbage), "", "", False, loading=loading),
        lambda: client_context("", str(served.cert), str(ca.ca_file), False, loading=loading),
    ):
        with pytest.raises(ssl.SSLError):
            build()
    assert failed == ["ca", "cert", "ca", "cert"]


def test_failure_text() -> None:
    assert failure_text(OSError("gone")) == "gone"
    assert failure_text(ValueError("bad")) == "ValueError: bad"
