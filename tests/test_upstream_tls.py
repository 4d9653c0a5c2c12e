"""The upstream's credential and TLS files (proxy/upstream_tls.py): read again when they
change, the context in use kept when they do not load."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from proxy.config import UpstreamSettings
from proxy.upstream_tls import ClientTLS, FileSecret, build_ssl_context
from tests.tls_certs import Authority


def test_file_secret_rereads_on_change(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    secret = FileSecret(str(path), clock=lambda: now[0])
    assert secret.get() == "one"
    path.write_text("two-longer")
    assert secret.get() == "one"  # not checked again within the interval
    now[0] += 1.5
    assert secret.get() == "two-longer"
    path.unlink()
    now[0] += 1.5
    assert secret.get() == "two-longer"  # a vanished file keeps the last value


def test_no_tls_setting_leaves_aiohttps_defaults() -> None:
    assert build_ssl_context(UpstreamSettings(url="https://tsdb/api/v1/write")) is None
    insecure = build_ssl_context(UpstreamSettings(url="https://tsdb/api/v1/write",
                                                  tls_insecure_skip_verify=True))
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE


def test_client_tls_builds_again_when_a_file_changes(tmp_path: Path) -> None:
    """A changed CA file is a new context at the next check; one that no longer loads
    keeps the context in use, and a reload's ``build`` raises the ssl module's error."""
    first, second = Authority(tmp_path / "a", "a-ca"), Authority(tmp_path / "b", "b-ca")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(first.ca_file.read_bytes())
    now = [0.0]
    tls = ClientTLS(UpstreamSettings(url="https://tsdb/api/v1/write", tls_ca_file=str(ca_file)),
                    clock=lambda: now[0])
    old = tls.get()
    assert tls.get() is old  # unchanged files: the same context
    ca_file.write_bytes(second.ca_file.read_bytes() + b"\n")
    assert tls.get() is old  # within the interval: not looked at
    now[0] += 1.5
    new = tls.get()
    assert new is not old
    ca_file.write_text("not a certificate\n")
    now[0] += 1.5
    assert tls.get() is new
    with pytest.raises(ssl.SSLError):
        tls.build()
