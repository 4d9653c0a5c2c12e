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
    server_context,
    stamp,
)
from tests.tls_certs import Authority


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
