"""Connection helpers of proxy/kube/client.py that need no server."""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from proxy.config import KubeSettings
from proxy.egress_proxy import parse_egress
from proxy.kube.client import (
    KubeconfigError,
    _error,
    as_client_go,
    default_namespace,
    load_configuration,
)
from proxy.kube.lean import client as k8s_client
from proxy.kube.lean import rest as k8s_rest
from proxy.kube.socks5_connector import Socks5Connector


def test_default_namespace_prefers_pod_namespace(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("from-sa\n")
    assert default_namespace({"POD_NAMESPACE": " karta-proxy "}, sa) == "karta-proxy"


def test_default_namespace_from_service_account_file(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("karta-proxy\n")
    assert default_namespace({}, sa) == "karta-proxy"
    assert default_namespace({"POD_NAMESPACE": ""}, sa) == "karta-proxy"


def test_default_namespace_outside_a_cluster(tmp_path: Path) -> None:
    assert default_namespace({}, tmp_path / "absent") == "default"
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    assert default_namespace({}, empty) == "default"


@pytest.mark.parametrize(
    ("text", "what"),
    [
        # PyYAML's own message spans three lines (the position on a line of its own)
        ("garbage: [\n", "invalid YAML: line 2, column 1: expected the node content"),
        # the client raised TypeError: 'NoneType' object does not support item assignment
        ("", "not a kubeconfig: expected a mapping (clusters, users, contexts, "
             "current-context), got an empty file"),
        ("- a\n- b\n", "not a kubeconfig: expected a mapping"),
        ("apiVersion: v1\nkind: Config\n", "does not load: Invalid kube-config file. "
                                            "Expected key current-context"),
    ],
)
async def test_a_broken_kubeconfig_is_one_line_naming_the_file(
        tmp_path: Path, text: str, what: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(Exception) as info:  # any kind: the old code raised PyYAML's, ...
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"kubeconfig {path}: {what}"), message


@pytest.mark.parametrize(("proxy_url", "said"), [
    ("socks4://u:hunter2@127.0.0.1:1080", "only http://, https:// and socks5:// proxies"),
    ("ftp://u:hunter2@proxy:3128", "only http://, https:// and socks5:// proxies"),
    ("http://u:hunter2@proxy:99999", "not a valid proxy URL"),
    ("socks5://:hunter2@proxy", "a SOCKS5 proxy's user must be 1 to 255 bytes")])
async def test_a_proxy_url_no_client_speaks_is_said_at_start(
        tmp_path: Path, proxy_url: str, said: str) -> None:
    """aiohttp spoke HTTP to any proxy's port: every list and watch failed with 'Cannot
    connect', the start went on. Now one line at start, the password hidden. (http://,
    https:// and socks5:// proxy-urls followed: tests/peers/test_e2e_egress_proxy.py.)"""
    path = _kubeconfig(tmp_path / "kubeconfig", {"token": "t"},
                       cluster={"proxy-url": proxy_url})
    with pytest.raises(KubeconfigError, match=said) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert str(info.value).startswith(f"kubeconfig {path}: the cluster's proxy-url: ")
    assert "hunter2" not in str(info.value)


def test_too_large_resource_version_is_told_by_its_cause_or_its_message() -> None:
    """What makes a watcher relist rather than retry a watch its server's store went
    back under: the cause kube-apiserver sets since 1.18.6, else its message."""
    cause = {"details": {"causes": [{"reason": "ResourceVersionTooLarge",
                                     "message": "Too large resource version"}]}}
    message = "Too large resource version: 310, current: 4"
    now = _error(504, json.dumps({"reason": "Timeout", "message": message, **cause}).encode())
    assert now.causes == ("ResourceVersionTooLarge",) and now.resource_version_too_large
    before_1_18_6 = _error(504, json.dumps({"reason": "Timeout", "message": message}).encode())
    assert before_1_18_6.resource_version_too_large
    other = _error(504, json.dumps({"reason": "Timeout", "message": "etcd slow",
                                    "details": {"causes": "nonsense"}}).encode())
    assert not other.resource_version_too_large and other.causes == ()
    assert not _error(504, b"<html>gateway timeout</html>").resource_version_too_large


def test_an_error_carries_the_retry_after_the_server_asked_for() -> None:
    """The header wins over the Status' details.retryAfterSeconds; neither: None."""
    body = json.dumps({"kind": "Status", "code": 429, "reason": "TooManyRequests",
                       "message": "slow down", "details": {"retryAfterSeconds": 3}}).encode()
    assert _error(429, body).retry_after == 3.0
    assert _error(429, body, "10").retry_after == 10.0
    # an HTTP-date: seconds from now (a gateway in front of the API server may send
    # one); past, or not a date: the body's
    at = datetime.datetime(2015, 10, 21, 7, 28, tzinfo=datetime.UTC).timestamp()
    assert _error(429, body, "Wed, 21 Oct 2015 07:28:00 GMT",
                  now=lambda: at - 12).retry_after == 12.0
    assert _error(429, body, "Wednesday, 21-Oct-15 07:28:00 GMT",
                  now=lambda: at - 7).retry_after == 7.0
    assert _error(429, body, "Wed, 21 Oct 2015 07:28:00 GMT").retry_after == 3.0  # past
    assert _error(429, body, "soon").retry_after == 3.0
    assert _error(429, body, "-5").retry_after == 3.0
    # digits to str.isdigit() that float() refuses: a ValueError out of the error itself
    assert _error(429, body, "\u00b2").retry_after == 3.0
    assert _error(503, b"upstream connect error", "5").retry_after == 5.0
    assert _error(500, b'{"kind": "Status", "code": 500}').retry_after is None


INLINE_CA_KUBECONFIG = """\
apiVersion: v1
kind: Config
current-context: c
contexts: [{name: c, context: {cluster: k, user: u}}]
clusters: [{name: k, cluster: {server: "https://127.0.0.1:9", certificate-authority-data: %s}}]
users: [{name: u, user: {token: t}}]
"""


async def test_an_inline_ca_with_no_writable_temporary_directory_names_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the client writes certificate-authority-data to a temporary file: on a read-only
    # root the message said "does not load ...; fix the file", and the file was fine
    import base64
    import tempfile

    from proxy.kube.client import KubeconfigError

    path = tmp_path / "kubeconfig"
    path.write_text(INLINE_CA_KUBECONFIG % base64.b64encode(b"not a real CA").decode())
    gone = tmp_path / "no-such-dir"
    monkeypatch.setattr(tempfile, "tempdir", str(gone))
    with pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"kubeconfig {path}: its inline certificate or key"), message
    assert f"the temporary directory: {gone}" in message
    assert "FileNotFoundError" in message
    assert "temporary directory writable" in info.value.fix


def _kubeconfig(path: Path, user: dict[str, object], user_name: str = "u",
                cluster: dict[str, object] | None = None) -> Path:
    """A kubeconfig of one context ``c``: user ``u`` (the entry named ``user_name``) on
    cluster ``k`` (``cluster``'s fields beside its server)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:9",
                                               **(cluster or {})}}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


async def test_an_exec_plugin_not_installed_is_one_line_with_its_install_hint(
        tmp_path: Path) -> None:
    """An EKS or GKE kubeconfig in an image without aws / gke-gcloud-auth-plugin: the
    message was '[Errno 2] No such file or directory: ...' (read as a file of the
    kubeconfig), without the hint kubectl prints."""
    path = _kubeconfig(tmp_path / "kubeconfig", {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": "karta-no-such-auth-plugin", "args": ["token"],
        "installHint": "Install it with\n  apt-get install karta-auth\n"}})
    with pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert str(info.value) == (
        f"kubeconfig {path}: the exec plugin's command 'karta-no-such-auth-plugin' is not "
        "installed (not found on PATH): Install it with apt-get install karta-auth")
    assert "install the plugin" in info.value.fix


async def test_an_exec_plugins_failure_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The library logged the failure at error level, then raised it, and the start's
    error (or a renewal's warning) said it again: two lines for one failure."""
    path = _kubeconfig(tmp_path / "kubeconfig", {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": "sh",
        "args": ["-c", "echo token expired, run aws sso login >&2; exit 3"]}})
    with caplog.at_level(logging.DEBUG), pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert str(info.value) == (f"kubeconfig {path}: does not load: exec: process returned 3. "
                               "token expired, run aws sso login")
    assert "token expired" not in caplog.text, caplog.text


@pytest.mark.parametrize(
    ("user", "user_name", "what"),
    [
        # the client went on without credentials: every request refused 401
        ({"token": "t"}, "other", "context 'c' names user 'u', which is not in its users"),
        ({"auth-provider": {"name": "azure", "config": {"access-token": "x"}}}, "u",
         "user 'u': the azure auth-provider was removed from kubectl and client-go in 1.26"),
        # the client asked for a cmd-path ("GoogleAuth via gcloud is supported! ...")
        ({"auth-provider": {"name": "gcp", "config": {}}}, "u",
         "user 'u': the gcp auth-provider was removed from kubectl and client-go in 1.26"),
        # run with no terminal, at every renewal: a plugin that must prompt cannot
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true",
                   "interactiveMode": "Always"}}, "u",
         "user 'u': its exec plugin has interactiveMode: Always"),
    ],
)
async def test_a_user_the_client_would_take_silently_or_misread_is_said_at_start(
        tmp_path: Path, user: dict[str, object], user_name: str, what: str) -> None:
    path = _kubeconfig(tmp_path / "kubeconfig", user, user_name)
    with pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"kubeconfig {path}: {what}"), str(info.value)


async def test_a_kubeconfig_error_does_not_print_the_users_credentials(tmp_path: Path) -> None:
    """The client names an entry by its Python repr: an oidc user without a client-secret
    printed its id-token and refresh-token in the start's error line."""
    path = _kubeconfig(tmp_path / "kubeconfig", {"auth-provider": {"name": "oidc", "config": {
        "client-id": "karta", "idp-issuer-url": "https://idp.example",
        "id-token": "a.eyJleHAiOjF9.c", "refresh-token": "SECRET-REFRESH"}}})
    with pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert "SECRET-REFRESH" not in str(info.value) and "eyJleHAiOjF9" not in str(info.value)
    assert str(info.value) == (
        f"kubeconfig {path}: does not load: Invalid kube-config file. Expected key "
        f"client-secret in {path}/users[name=u]/user/auth-provider/config")


@pytest.mark.parametrize("value", ["false", "true", 0])
async def test_insecure_skip_tls_verify_not_a_boolean_is_refused(
        tmp_path: Path, value: object) -> None:
    """The client took ``not value``: a quoted "false" turned TLS verification off
    (kubectl refuses the file: a string is no bool)."""
    path = _kubeconfig(tmp_path / "kubeconfig", {"token": "t"},
                       cluster={"insecure-skip-tls-verify": value})
    with pytest.raises(KubeconfigError) as info:
        await load_configuration(KubeSettings(kubeconfig=str(path)))
    assert str(info.value).startswith(
        f"kubeconfig {path}: cluster 'k': insecure-skip-tls-verify must be true or false, "
        f"not {value!r}"), str(info.value)


#: every variable that names a proxy, cleared before each case sets its own
PROXY_ENV = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy")


async def _pool_for(host: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                    proxy_url: str | None = None) -> Any:
    for name in PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = k8s_client.Configuration()
    cfg.host = host
    cfg.proxy = proxy_url
    pool = k8s_rest.RESTClientObject(cfg)
    try:
        return as_client_go(pool, cfg)
    except BaseException:
        await pool.close()
        raise


@pytest.mark.parametrize(("host", "env", "chosen"), [
    # in a pod: the API server's Service IP, through the proxy unless NO_PROXY names it
    ("https://10.96.0.1:443", {"HTTPS_PROXY": "http://corp:3128"}, "http://corp:3128"),
    # a CIDR range, as NO_PROXY is written for a cluster: Python's rules matched nothing
    ("https://10.96.0.1", {"HTTPS_PROXY": "http://corp:3128",
                           "NO_PROXY": ".svc,10.96.0.0/12"}, None),
    # kind, kubectl proxy: loopback and localhost always direct (Python sent them on)
    ("https://127.0.0.1:6443", {"HTTPS_PROXY": "http://corp:3128"}, None),
    ("http://localhost:8001", {"HTTP_PROXY": "corp:3128"}, None),
    ("https://[::1]:6443", {"HTTPS_PROXY": "http://corp:3128"}, None),
    # the scheme's own variable, lower case too; the other one does not matter
    ("https://api.example:6443", {"https_proxy": "corp:3128",
                                  "HTTP_PROXY": "socks5://x:1080"}, "http://corp:3128"),
    ("https://api.example:6443", {"HTTP_PROXY": "http://corp:3128"}, None),
    ("https://api.example:6443", {"HTTPS_PROXY": "http://corp:3128",
                                  "no_proxy": "example"}, None),
    ("https://api.example:6443", {"HTTPS_PROXY": "http://[fd00::1]:3128"},
     "http://[fd00::1]:3128"),
    ("https://api.example:6443", {}, None),
])
async def test_the_api_servers_proxy_comes_from_the_environment_by_gos_rules(
        monkeypatch: pytest.MonkeyPatch, host: str, env: dict[str, str],
        chosen: str | None) -> None:
    """client-go's ``http.ProxyFromEnvironment``, for a kubeconfig (or a pod) with no
    ``proxy-url``. The library's session read the environment by Python's rules
    (``trust_env``): no CIDR ranges, loopback sent to the proxy; it reads none now."""
    pool = await _pool_for(host, monkeypatch, env)
    try:
        assert pool.proxy == chosen
        assert pool.proxy_headers is None
        assert pool.pool_manager.trust_env is False
    finally:
        await pool.close()


async def test_the_environments_proxy_credentials_go_as_proxy_authorization(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In the proxy's URL, as aiohttp takes them: it sends them with the ``CONNECT`` of an
    https:// API server and with every request to an http:// one. (In ``proxy_headers``
    they went with the ``CONNECT`` alone: an http:// API server's proxy answered 407.)"""
    for host in ("https://10.96.0.1", "http://10.96.0.1"):
        pool = await _pool_for(host, monkeypatch,
                               {"HTTPS_PROXY": "http://karta:p%40ss@corp:3128",
                                "HTTP_PROXY": "http://karta:p%40ss@corp:3128"})
        try:
            assert str(pool.proxy) == "http://karta:p%40ss@corp:3128"
            assert (URL(pool.proxy).user, URL(pool.proxy).password) == ("karta", "p@ss")
            assert pool.proxy_headers is None
        finally:
            await pool.close()


async def test_an_https_or_socks5_proxy_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTPS proxy is aiohttp's to speak to; a SOCKS5 one makes the pool's connector
    open every connection through it (proxy/kube/socks5_connector.py), no HTTP proxy
    left for aiohttp."""
    pool = await _pool_for("https://10.96.0.1", monkeypatch,
                           {"HTTPS_PROXY": "https://corp:3129"})
    try:
        assert str(pool.proxy) == "https://corp:3129"
        assert type(pool.pool_manager.connector) is aiohttp.TCPConnector
    finally:
        await pool.close()
    pool = await _pool_for("https://10.96.0.1", monkeypatch,
                           {"HTTPS_PROXY": "socks5h://u:p@corp"})
    try:
        assert pool.proxy is None and pool.proxy_headers is None
        connector = pool.pool_manager.connector
        assert isinstance(connector, Socks5Connector)
        assert connector._karta_egress == parse_egress("socks5h://u:p@corp")
        assert connector._karta_egress.port == 1080
    finally:
        await pool.close()


async def test_a_kubeconfigs_proxy_url_wins_over_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = await _pool_for("https://10.96.0.1", monkeypatch,
                           {"HTTPS_PROXY": "http://corp:3128"}, "http://other:8080")
    try:
        assert pool.proxy == "http://other:8080"
        assert pool.pool_manager.trust_env is False
    finally:
        await pool.close()


async def test_an_environment_proxy_no_client_speaks_is_said_at_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As a kubeconfig's ``proxy-url`` of a scheme no client speaks: aiohttp would speak
    HTTP to its port, and every list and watch fail with ``Cannot connect``."""
    with pytest.raises(KubeconfigError) as info:
        await _pool_for("https://10.96.0.1", monkeypatch,
                        {"HTTPS_PROXY": "socks4://u:hunter2@corp:1080"})
    message = str(info.value)
    assert message.startswith("the API server https://10.96.0.1: the environment's "
                              "HTTPS_PROXY: only http://, https:// and socks5:// proxies "
                              "are supported"), message
    assert "hunter2" not in message and "NO_PROXY" in info.value.fix
