"""The upstream's credential and TLS files (proxy/upstream_tls.py): read again when they
change, the context in use kept when they do not load."""

from __future__ import annotations

import datetime
import logging
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.config import UpstreamSettings
from proxy.metrics import ProxyMetrics
from proxy.upstream import Upstream
from proxy.upstream_tls import ClientTLS, FileSecret, build_ssl_context
from tests.tls_certs import Authority


def test_file_secret_rereads_on_change(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    secret = FileSecret(str(path), header=True, clock=lambda: now[0])
    assert secret.get() == "one"
    path.write_text("two-longer")
    assert secret.get() == "one"  # not checked again within the interval
    now[0] += 1.5
    assert secret.get() == "two-longer"
    path.unlink()
    now[0] += 1.5
    assert secret.get() == "two-longer"  # a vanished file keeps the last value


def test_file_secret_tells_of_a_new_value_not_of_the_first_or_the_same(
        tmp_path: Path) -> None:
    now = [0.0]
    told: list[str] = []
    path = tmp_path / "token"
    path.write_text("one")
    secret = FileSecret(str(path), header=True, clock=lambda: now[0],
                        on_change=lambda: told.append(secret.get()))
    assert told == []  # the first read is no change
    path.write_text("one")  # rewritten as it was: a new stamp, the same value
    now[0] += 1.5
    assert secret.get() == "one" and told == []
    path.write_text("two")
    now[0] += 1.5
    assert secret.get() == "two" and told == ["two"]  # told once the value is taken
    path.unlink()
    now[0] += 1.5
    assert secret.get() == "two" and told == ["two"]  # a vanished file changes nothing


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


def test_an_expired_client_certificate_is_said_at_load_and_its_end_published(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """It loads (OpenSSL does not look at the dates), and then every upstream connection
    failed with a handshake error naming no date, and nothing at the load said why."""
    ca = Authority(tmp_path / "ca", "up-ca")
    expired = ca.issue("proxy", server=False,
                       valid=(datetime.timedelta(days=-2), datetime.timedelta(days=-1)))
    ends: list[float] = []
    caplog.set_level(logging.INFO, logger="karta.upstream")
    ClientTLS(UpstreamSettings(url="https://tsdb/api/v1/write", tls_ca_file=str(ca.ca_file),
                               tls_cert_file=str(expired.cert), tls_key_file=str(expired.key)),
              on_expiry=ends.append)
    (line,) = [r for r in caplog.records if "has expired" in r.getMessage()]
    assert line.levelno == logging.ERROR and line.__dict__["cert_file"] == str(expired.cert)
    (end,) = ends
    assert time.time() - 2 * 86400 < end < time.time() - 86400 + 60

    caplog.clear()
    later = ca.issue("proxy-2", server=False,
                     valid=(datetime.timedelta(days=1), datetime.timedelta(days=2)))
    ClientTLS(UpstreamSettings(url="https://tsdb/api/v1/write", tls_ca_file=str(ca.ca_file),
                               tls_cert_file=str(later.cert), tls_key_file=str(later.key)))
    assert [r for r in caplog.records if "not valid yet" in r.getMessage()]


@dataclass
class Counted:
    """A ClientTLS on one CA file, its clock moved by hand and its loads' results listed
    (``on_reload``)."""

    ca_file: Path
    tls: ClientTLS
    now: list[float] = field(default_factory=lambda: [0.0])
    loads: list[bool] = field(default_factory=list)


def counted(tmp_path: Path, ca: Authority) -> Counted:
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.ca_file.read_bytes())
    now = [0.0]
    loads: list[bool] = []
    tls = ClientTLS(UpstreamSettings(url="https://tsdb/api/v1/write", tls_ca_file=str(ca_file)),
                    clock=lambda: now[0], on_reload=loads.append)
    return Counted(ca_file, tls, now, loads)


def test_loads_of_the_upstream_tls_files_are_counted(tmp_path: Path) -> None:
    ca, other = Authority(tmp_path / "a", "a-ca"), Authority(tmp_path / "b", "b-ca")
    c = counted(tmp_path, ca)
    ca_file, tls, now, loads = c.ca_file, c.tls, c.now, c.loads
    assert loads == []  # the first load is the start's, as on the listening side
    ca_file.write_bytes(other.ca_file.read_bytes())
    now[0] += 1.5
    tls.get()
    ca_file.write_text("not a certificate\n")
    for _ in range(2):  # one failure, however often it is seen
        now[0] += 1.5
        tls.get()
    with pytest.raises(ssl.SSLError):
        tls.trial()
    assert loads == [True, False, False]


def test_a_failed_reload_is_counted_each_time_and_not_again_by_the_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A reload's failure set nothing the checks compare with: one broken CA file was
    counted by the SIGHUP, then again by the next request's check."""
    c = counted(tmp_path, Authority(tmp_path / "a", "a-ca"))
    ca_file, tls, now, loads = c.ca_file, c.tls, c.now, c.loads
    ca_file.write_text("not a certificate\n")
    caplog.clear()
    for _ in range(2):  # each reload: counted and logged
        with pytest.raises(ssl.SSLError):
            tls.trial()
    for _ in range(3):  # the same files at the requests' checks: counted already
        now[0] += 1.5
        tls.get()
    assert loads == [False, False]
    lines = [r for r in caplog.records if r.getMessage().startswith("upstream TLS files not")]
    assert len(lines) == 2, lines
    ca_file.write_text("broken another way\n")  # a new state of the file: counted once
    for _ in range(2):
        now[0] += 1.5
        tls.get()
    assert loads == [False, False, False]


def test_a_reload_does_not_put_back_files_older_than_a_check_loaded_meanwhile(
    tmp_path: Path,
) -> None:
    """A reload builds, awaits the rest of its work, then adopts: a request's check that
    loaded newer files in between was overwritten by the reload's older context."""
    first, second = Authority(tmp_path / "a", "a-ca"), Authority(tmp_path / "b", "b-ca")
    c = counted(tmp_path, first)
    ca_file, tls, now, loads = c.ca_file, c.tls, c.now, c.loads
    reload = tls.trial()
    ca_file.write_bytes(second.ca_file.read_bytes())
    now[0] += 1.5
    newer = tls.get()
    assert newer is not reload.context
    tls.adopt(reload)
    assert tls.get() is newer
    assert loads == [True, True]
    now[0] += 1.5
    assert tls.get() is newer  # and no check takes the files as changed again


async def test_the_upstream_tls_series_are_served_from_the_start(tmp_path: Path) -> None:
    ca = Authority(tmp_path / "ca", "up-ca")
    client = ca.issue("proxy", server=False)
    metrics = ProxyMetrics()
    u = Upstream(UpstreamSettings(url="https://tsdb/api/v1/write", tls_ca_file=str(ca.ca_file),
                                  tls_cert_file=str(client.cert), tls_key_file=str(client.key)),
                 metrics)
    try:
        for result in ("success", "failure"):
            assert metrics.registry.get_sample_value(
                "karta_proxy_upstream_tls_certificate_reloads_total", {"result": result}) == 0
        end = metrics.registry.get_sample_value(
            "karta_proxy_upstream_tls_certificate_expiry_timestamp_seconds")
        assert end is not None and time.time() < end < time.time() + 86400 + 60
    finally:
        await u.close()


def token_gone(tmp_path: Path, caplog: pytest.LogCaptureFixture
               ) -> tuple[FileSecret, Path, list[float]]:
    """A FileSecret that read "one" from its file, the file then removed; its clock is
    the list returned, moved by hand; its lines at info and above captured."""
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    caplog.set_level(logging.INFO, logger="karta.upstream")
    secret = FileSecret(str(path), header=True, clock=lambda: now[0])
    path.unlink()
    return secret, path, now


def test_a_missing_credential_file_is_logged_once_and_its_return_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Checked every second, a missing token file was a warning a second (~3,600 lines an
    hour); now one per distinct error, and one line when it reads again."""
    secret, path, now = token_gone(tmp_path, caplog)
    for _ in range(5):
        now[0] += 1.5
        assert secret.get() == "one"
    path.write_text("two")
    for _ in range(3):
        now[0] += 1.5
        assert secret.get() == "two"
    path.unlink()
    now[0] += 1.5
    secret.get()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "cannot read credential file, keeping the last value"),
        (logging.INFO, "credential file read again"),
        (logging.WARNING, "cannot read credential file, keeping the last value"),
    ]


def test_a_credential_file_alternating_between_two_errors_is_two_warnings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Only a change of error was logged, so a path that is missing at one check and a
    directory at the next warned at every check; each error is now logged once until
    the file reads again, and then again in the next outage."""
    secret, path, now = token_gone(tmp_path, caplog)
    for i in range(10):  # missing, a directory, missing, ...: one state per check
        if i % 2:
            path.mkdir()
        elif path.exists():
            path.rmdir()
        now[0] += 1.5
        assert secret.get() == "one"

    def warnings_() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.WARNING]

    assert len(warnings_()) == 2, [r.__dict__["error"] for r in warnings_()]
    path.rmdir()
    path.write_text("two")
    for _ in range(2):
        now[0] += 1.5
        assert secret.get() == "two"
    assert len([r for r in caplog.records
                if r.getMessage() == "credential file read again"]) == 1
    path.unlink()  # a new outage: its error said again
    now[0] += 1.5
    secret.get()
    assert len(warnings_()) == 3


@pytest.mark.parametrize(("header", "text", "kept", "said"), [
    # a token file rewritten with a second line: sent as it was, aiohttp refused every
    # request (a 502 to every sender naming neither the file nor the header)
    (True, b"secret-a\nsecret-b\n", "one", "holds 2 lines"),
    (True, b"secret\x07token", "one", "a control character"),
    # not UTF-8: a UnicodeDecodeError out of the request path
    (True, b"secret\xfftoken", "one", "is not UTF-8 text (byte 6"),
    (False, b"pass\xffword", "one", "is not UTF-8 text (byte 4"),
    # a password goes base64-encoded into its header: a line break in it is its own
    (False, b"pass\nword", "pass\nword", ""),
])
def test_a_credential_rewritten_unsendable_keeps_the_last_value_and_says_so_unquoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, header: bool, text: bytes, kept: str,
    said: str,
) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    caplog.set_level(logging.INFO, logger="karta.upstream")
    secret = FileSecret(str(path), header=header, clock=lambda: now[0])
    path.write_bytes(text)
    now[0] += 1.5
    assert secret.get() == kept
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    if not said:
        assert warned == []
        return
    assert [r.getMessage() for r in warned] == [
        "cannot use credential file, keeping the last value"]
    error = warned[0].__dict__["error"]
    assert said in error and str(path) in error, error
    assert "secret" not in error and "pass" not in error, error
