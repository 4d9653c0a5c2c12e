"""Connection to the API server: configuration, the ApiClient, raw JSON requests.

kubernetes-asyncio is used unpatched for what it does well (kubeconfig / in-cluster
config, auth, TLS, the aiohttp session); responses are read raw
(``_preload_content=False``) and parsed with ``json`` because building its model
objects for 100k pods costs more than the whole index.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import datetime
import email.utils
import json
import logging
import math
import os
import re
import ssl
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from yarl import URL

from proxy.config import KubeSettings, first_kubeconfig
from proxy.egress_proxy import Egress, environment_route, parse_egress
from proxy.karta.yamltext import yaml_error
from proxy.kube.lean import ApiException, incluster_config
from proxy.kube.lean import client as k8s_client
from proxy.kube.lean import config as k8s_config
from proxy.kube.lean import rest as k8s_rest
from proxy.kube.socks5_connector import tunnel_through
from proxy.shown import one_line
from proxy.tls_files import FileStamp, stamp, verify_as_go

log = logging.getLogger(__name__)


class _SaidByTheCaller(logging.Filter):
    """Drops the library's error line for an exec plugin's failure that it raises on: the
    caller's ``KubeconfigError`` (at start) or renewal warning says it, with the file, so
    each failure was logged twice. Its other lines (a plugin's output missing a field,
    which it does not raise on) pass. Keyed on the library's function name, so that no
    line of another function is ever dropped: a rename in a new release lets the line
    through twice, never loses one, and
    ``tests/kube/test_client.py::test_an_exec_plugins_failure_is_logged_once`` says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        raised = sys.exc_info()[1]  # the exception the library's except clause handles
        return not (record.funcName == "load_from_exec_plugin" and raised is not None
                    and record.getMessage() == str(raised))


logging.getLogger("kubernetes_asyncio.config.kube_config").addFilter(_SaidByTheCaller())

ACCEPT_JSON = "application/json"
ACCEPT_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
#: watches must ask for the object form: a List form makes a real server end the stream
ACCEPT_METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


#: mounted into every pod with a service account token (the in-cluster config reads the
#: token and CA beside it)
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace(
    env: Mapping[str, str] | None = None,
    sa_namespace_file: Path = SERVICE_ACCOUNT_NAMESPACE_FILE,
) -> str:
    """The namespace this process runs in: ``POD_NAMESPACE`` (downward API), else the
    service account's namespace file, else ``default`` (outside a cluster).

    Objects the proxy itself writes (the fact writer's Lease) belong there: it is where
    the shipped RBAC (config/rbac/) grants them, beside the ServiceAccount, so a
    deployment never has to name its namespace twice.
    """
    env = os.environ if env is None else env
    ns = env.get("POD_NAMESPACE", "").strip()
    if ns:
        return ns
    try:
        ns = sa_namespace_file.read_text(encoding="utf-8").strip()
    except OSError:
        ns = ""
    return ns or "default"


class KubeApiError(Exception):
    """A non-2xx answer, with the API's Status reason, message and the reasons of its
    ``details.causes`` when it sent them: a cause is what tells a watch from a
    resourceVersion the server has not reached (a restored etcd) from any other 504."""

    def __init__(self, status: int, reason: str = "", message: str = "",
                 causes: tuple[str, ...] = (), retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes
        #: seconds the server asked to wait (its ``Retry-After`` header, else the Status'
        #: ``details.retryAfterSeconds``), None when it did not say
        self.retry_after = retry_after

    @classmethod
    def from_status(cls, status: int, doc: Mapping[str, Any]) -> KubeApiError:
        """From a Status object: an error answer's body, or a watch's ``ERROR`` event."""
        details = doc.get("details")
        causes = details.get("causes") if isinstance(details, dict) else None
        reasons = (tuple(str(c.get("reason", "")) for c in causes if isinstance(c, dict))
                   if isinstance(causes, list) else ())
        after = details.get("retryAfterSeconds") if isinstance(details, dict) else None
        return cls(status, str(doc.get("reason", "")), str(doc.get("message", "")), reasons,
                   float(after) if isinstance(after, int | float) and after > 0 else None)

    @property
    def resource_version_too_large(self) -> bool:
        """The server has not reached the resourceVersion asked for: its store went back
        (an etcd restored from a backup, a fresh one), and only a relist gets the
        watcher in step again, as client-go's reflector does (kubernetes#92537). The
        message is the fallback for servers before 1.18.6, which sent no cause
        (kubernetes#94316)."""
        if "ResourceVersionTooLarge" in self.causes:
            return True
        return ((self.status == 504 or self.reason == "Timeout")
                and "Too large resource version" in self.message)


class KubeconfigError(Exception):
    """A kubeconfig file that does not load; the message is one line naming the file and
    what is wrong with it (the client's own errors span lines: PyYAML's name the line
    and column on a line of their own). ``fix``: what the operator does about it."""

    def __init__(self, message: str, fix: str = "fix the file, or set --kubeconfig") -> None:
        super().__init__(message)
        self.fix = fix


def _check_kubeconfig(path: str) -> dict[str, Any]:
    """What the client would stumble over with a message of no use (a TypeError for an
    empty file or a list) or of three lines (invalid YAML), said as one; returns the
    file's document."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise KubeconfigError(f"kubeconfig {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise KubeconfigError(f"kubeconfig {path}: not UTF-8 text (byte {e.start})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KubeconfigError(f"kubeconfig {path}: {yaml_error(e)}") from None
    if not isinstance(doc, dict):
        got = "an empty file" if doc is None else f"a YAML {type(doc).__name__}"
        raise KubeconfigError(f"kubeconfig {path}: not a kubeconfig: expected a mapping "
                              f"(clusters, users, contexts, current-context), got {got}")
    return doc


def _named(doc: Mapping[str, Any], section: str, name: object) -> Mapping[str, Any] | None:
    """The entry of ``doc[section]`` (a list of ``{name: ..., <kind>: ...}``) named
    ``name``; None when there is none (or the section is no list)."""
    entries = doc.get(section)
    if not isinstance(entries, list):
        return None
    return next((e for e in entries if isinstance(e, dict) and e.get("name") == name), None)


@dataclass(frozen=True)
class _Current:
    """What the file's ``current-context`` names, as far as the file has it: the checks
    below read the user and the cluster the client is about to use."""

    context: object
    #: the context's user's name (None: the context has none, or there is no context)
    user_name: object
    #: whether ``users`` has an entry of that name
    user_found: bool
    #: that entry's ``user`` mapping ({} when absent or not a mapping)
    user: Mapping[str, Any]
    cluster_name: object
    #: the context's cluster's ``cluster`` mapping ({} when absent or not a mapping)
    cluster: Mapping[str, Any]

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> _Current:
        context = doc.get("current-context")
        entry = _named(doc, "contexts", context)
        body = entry.get("context") if entry else None
        body = body if isinstance(body, dict) else {}
        user_name, cluster_name = body.get("user"), body.get("cluster")
        user_entry = _named(doc, "users", user_name) if user_name else None
        cluster_entry = _named(doc, "clusters", cluster_name) if cluster_name else None
        user = user_entry.get("user") if user_entry else None
        cluster = cluster_entry.get("cluster") if cluster_entry else None
        return cls(context, user_name, user_entry is not None,
                   user if isinstance(user, dict) else {}, cluster_name,
                   cluster if isinstance(cluster, dict) else {})


#: auth-provider plugins client-go removed in 1.26, and what kubectl says instead
REMOVED_AUTH_PROVIDERS = {
    "gcp": 'use the "gke-gcloud-auth-plugin" exec plugin instead (gcloud container '
           "clusters get-credentials writes such a kubeconfig; "
           "https://cloud.google.com/blog/products/containers-kubernetes/kubectl-auth-changes-in-gke)",
    "azure": "use the kubelogin exec plugin instead (kubelogin convert-kubeconfig; "
             "https://github.com/Azure/kubelogin)",
}


def _check_user(path: str, current: _Current) -> None:
    """What of the current context's user the client takes silently, or misreads, said
    at start: a user the context names but the file lacks (the client went on with no
    credentials, every request refused 401), an ``auth-provider`` client-go removed
    (``azure`` was ignored the same way; ``gcp`` asked for a ``cmd-path``), an exec
    plugin that must prompt (``interactiveMode: Always``: the proxy runs it with no
    terminal, at start and at every renewal)."""
    name, user = current.user_name, current.user
    if not name:
        return  # no context (the client's message names it), or no user: anonymous
    if not current.user_found:
        raise KubeconfigError(
            f"kubeconfig {path}: context {current.context!r} names user {name!r}, which "
            "is not in its users (kubectl would go on unauthenticated)",
            fix="name a user of the file in the context, or add the user")
    provider = user.get("auth-provider")
    provider_name = provider.get("name") if isinstance(provider, dict) else None
    if provider_name in REMOVED_AUTH_PROVIDERS:
        raise KubeconfigError(
            f"kubeconfig {path}: user {name!r}: the {provider_name} auth-provider was "
            "removed from kubectl and client-go in 1.26, and is not supported",
            fix=REMOVED_AUTH_PROVIDERS[provider_name])
    plugin = user.get("exec")
    if isinstance(plugin, dict) and plugin.get("interactiveMode") == "Always":
        raise KubeconfigError(
            f"kubeconfig {path}: user {name!r}: its exec plugin has interactiveMode: Always "
            "(it must prompt), and karta-proxy runs it without a terminal, at start and at "
            "every renewal", fix="use a plugin mode or a credential that needs no prompt "
                                 "(interactiveMode: Never or IfAvailable)")


def _check_cluster(path: str, current: _Current) -> None:
    """The current context's cluster's ``insecure-skip-tls-verify`` when it is not a
    boolean: the client took ``not value``, so a quoted ``"false"`` (a template's
    ``| quote``) turned verification off, silently; kubectl refuses the file."""
    name, cluster = current.cluster_name, current.cluster
    if "insecure-skip-tls-verify" not in cluster:
        return
    value = cluster["insecure-skip-tls-verify"]
    if not isinstance(value, bool):
        raise KubeconfigError(
            f"kubeconfig {path}: cluster {name!r}: insecure-skip-tls-verify must "
            f"be true or false, not {value!r} (a {type(value).__name__})",
            fix="write it unquoted: insecure-skip-tls-verify: false")


def _exec_command_missing(path: str, current: _Current, e: OSError) -> KubeconfigError | None:
    """The error for ``e`` when it is the current user's exec plugin command not found or
    not runnable (``aws`` or ``gke-gcloud-auth-plugin`` left out of an image): one line
    with the plugin's ``installHint``, as kubectl prints it. None for any other ``e``."""
    plugin = current.user.get("exec")
    if not isinstance(plugin, dict) or e.filename != str(plugin.get("command")):
        return None
    what = ("is not installed (not found on PATH)" if isinstance(e, FileNotFoundError)
            else f"cannot be run ({e.strerror or e})")
    hint = plugin.get("installHint")
    hint_text = f": {one_line(hint)}" if isinstance(hint, str) and hint.strip() else ""
    return KubeconfigError(
        f"kubeconfig {path}: the exec plugin's command {e.filename!r} {what}{hint_text}",
        fix="install the plugin where karta-proxy runs (in its image), or give a kubeconfig "
            "with a credential that needs none")


def _redacted(message: str, path: str, doc: Mapping[str, Any]) -> str:
    """``message`` without the entries it quotes whole. The client names a kubeconfig
    entry by its Python repr (``Expected key client-secret in /k/{'name': 'u', 'user':
    {... 'refresh-token': ...}}/user/auth-provider/config``), so a message about a user
    printed its tokens and keys in the log; here the entry is named by its section and
    name, and anything else shaped like a repr is cut."""
    where = os.path.expanduser(path)
    for section in ("clusters", "contexts", "users"):
        entries = doc.get(section)
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, dict):
                message = message.replace(f"{where}/{entry}",
                                          f"{path}/{section}[name={entry.get('name')}]")
    return re.sub(r"\{'.*\}", "{...}", message)


async def _load_kubeconfig_file(path: str, cfg: k8s_client.Configuration) -> Any:
    """Load ``path`` into ``cfg``; returns the client's loader (what the file's user is)."""
    doc = _check_kubeconfig(path)
    # parsed again by the client's loader, which must read the file itself: it resolves a
    # relative certificate path from the file's directory
    current = _Current.of(doc)
    _check_user(path, current)
    _check_cluster(path, current)
    try:
        loader = await k8s_config.load_kube_config(
            config_file=path, client_configuration=cfg, persist_config=False)
    except OSError as e:  # the client writes inline *-data to a temporary file
        if not _in_tempfile(e):
            missing = _exec_command_missing(path, current, e)
            if missing is not None:
                raise missing from e
            raise KubeconfigError(f"kubeconfig {path}: does not load: "
                                  f"{one_line(str(e)) or type(e).__name__}") from e
        where = tempfile.tempdir or os.environ.get("TMPDIR") or "/tmp"
        raise KubeconfigError(
            f"kubeconfig {path}: its inline certificate or key (certificate-authority-data, "
            f"client-certificate-data, client-key-data) could not be written to a temporary "
            f"file (the temporary directory: {where}, $TMPDIR): {type(e).__name__}: "
            f"{one_line(str(e))}",
            fix="make the temporary directory writable (an emptyDir on /tmp, or set "
                "TMPDIR), or use file paths in the kubeconfig instead of *-data") from e
    except Exception as e:  # ConfigException, base64 and key errors, an exec plugin's
        detail = _redacted(one_line(str(e)), path, doc) or type(e).__name__
        raise KubeconfigError(f"kubeconfig {path}: does not load: {detail}") from e
    _proxy_url(path, current, cfg)
    return loader


def _proxy_url(path: str, current: _Current, cfg: k8s_client.Configuration) -> None:
    """The current cluster's ``proxy-url`` into ``cfg``, read as client-go reads it
    (``http://``, ``https://`` or ``socks5://``, a ``user:password@`` in it the proxy's
    login). Read here, not left to kubernetes-asyncio, which reads it only from 34.3.3 on
    (before, the API server was reached directly, the proxy-url ignored). One that does not
    parse, or of another scheme, is said at start, naming the file (aiohttp spoke HTTP to
    any port, and every list and watch failed with a ``Cannot connect``)."""
    proxy = current.cluster.get("proxy-url")
    if proxy is not None and not isinstance(proxy, str):
        raise KubeconfigError(f"kubeconfig {path}: cluster {current.cluster_name!r}: "
                              f"proxy-url must be a string, not a {type(proxy).__name__}",
                              fix="write it as a URL: proxy-url: http://host:port")
    cfg.proxy = proxy or None
    try:
        kubeconfig_egress(cfg)
    except ValueError as e:
        raise KubeconfigError(f"kubeconfig {path}: the cluster's proxy-url: {e}",
                              fix="give an http://, https:// or socks5:// proxy-url, or "
                                  "remove it") from None


#: where a kubeconfig's proxy is written, for a login refused or asked for
KUBECONFIG_PROXY = "the kubeconfig cluster's proxy-url"


def kubeconfig_egress(cfg: k8s_client.Configuration) -> Egress | None:
    """The proxy a kubeconfig cluster's ``proxy-url`` names, or None; ValueError when
    it names none the client can speak to."""
    proxy = getattr(cfg, "proxy", None)
    return parse_egress(str(proxy), source=KUBECONFIG_PROXY) if proxy else None


def _in_tempfile(e: BaseException) -> bool:
    """Whether ``e`` was raised by the ``tempfile`` module (no usable temporary directory,
    a read-only or full one), not by what else a kubeconfig load does (an exec plugin)."""
    return any(frame.f_code.co_filename == tempfile.__file__
               for frame, _ in traceback.walk_tb(e.__traceback__))


def kubeconfig_path(settings: KubeSettings) -> str:
    """The kubeconfig file the connection comes from: the setting or ``KUBECONFIG`` (its
    first non-empty entry, as kubectl reads ``:/path``); else none in a pod (the
    in-cluster service account); else ``~/.kube/config`` when it exists; "" for none."""
    path = settings.kubeconfig or os.environ.get("KUBECONFIG", "")
    if path:
        return first_kubeconfig(path)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return ""
    default = Path("~/.kube/config").expanduser()
    return str(default) if default.exists() else ""


async def load_configuration(settings: KubeSettings) -> k8s_client.Configuration:
    """kubeconfig from the setting or ``KUBECONFIG``; else the in-cluster service
    account when running in a pod; else ``~/.kube/config``. A kubeconfig file that exists
    but does not load raises ``KubeconfigError`` (one line naming the file). Loaded once:
    ``KubeClient.connect`` keeps its credentials current instead (``KeptCredentials``);
    this is for tests, which need a configuration and no kept credentials."""
    cfg = k8s_client.Configuration()
    path = kubeconfig_path(settings)
    if path:
        await _load_kubeconfig_file(path, cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        # the client's loader re-reads the token file every 60 s (its own hook)
        k8s_config.load_incluster_config(client_configuration=cfg)
    else:  # the client's own words: no cluster configured at all
        await k8s_config.load_kube_config(client_configuration=cfg, persist_config=False)
    return cfg


#: an exec plugin's credential is renewed this long before its expirationTimestamp, or a
#: fifth of its lifetime before when that is shorter (a 20 s token 4 s before)
EXEC_RENEW_BEFORE = 300.0
#: a kubeconfig that failed to load again (a file half written, a plugin failing) is not
#: tried again before this long: not once per request
RELOAD_RETRY_SECONDS = 5.0
#: a refusal (401, a refused TLS handshake) loads the kubeconfig again at most this
#: often: a credential refused for good must not run the exec plugin on every retry of
#: every watcher
REFUSAL_RELOAD_SECONDS = 10.0
#: a connection pool replaced by a renewal of the TLS files is closed this long after:
#: the watches still streaming on it end by then (timeoutSeconds <= 480 + 30)
RETIRED_POOL_SECONDS = 600.0
#: the Configuration fields a kubeconfig load sets, besides the token; those that make
#: the connection pool's SSL context
_TLS_FIELDS = ("ssl_ca_cert", "cert_file", "key_file", "verify_ssl", "tls_server_name")
_FIELDS = ("host", "proxy", *_TLS_FIELDS)


def _stamp(path: str) -> FileStamp | None:
    """The file's stamp (``proxy.tls_files``: its inode too, for a Secret's swapped
    symlink), None for a file gone."""
    try:
        return stamp(path)
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Loaded:
    """One load of the credentials: the files they were read from (a kubeconfig, its
    token file, client certificate, key and CA files; a service account's token and CA)
    with their stamps then, and when an exec plugin's credential is to be renewed
    (``time.time()``; None: never before it is refused)."""

    files: Mapping[str, FileStamp | None]
    renew_at: float | None
    tls: Mapping[str, FileStamp | None]


@dataclass(frozen=True, slots=True)
class Reading:
    """The credentials as just read, not yet adopted: a load compares them with those in
    use, so that only what changed is renewed (a new connection pool only for new TLS
    files, say)."""

    cfg: k8s_client.Configuration
    #: the files read besides the TLS files, stamped before they were read
    files: Mapping[str, FileStamp | None]
    renew_at: float | None


class KeptCredentials(abc.ABC):
    """Credentials kept current in one ``Configuration``, whatever they come from.

    The client loads its configuration once: a token file or a client certificate renewed
    on disk, or an exec plugin's token expired (EKS and GKE tokens last 15-60 min), and
    every request was refused (401) until a restart, the index stale while ready stayed
    200. So before each request (``current``, called by ``CheckedApiClient`` once per
    call) the files they were read from are looked at (a ``stat`` each) and an exec
    credential's expiry checked: a change, or one about to expire, loads them again. A
    request refused all the same (``renew_refused``) loads them again once and is
    retried if that renewed anything. A load that renews the TLS files calls ``on_tls``
    (the client's new connection pool). A subclass says where the credentials come from
    (``read``) and what to call them in the log (``name``)."""

    def __init__(self, cfg: k8s_client.Configuration) -> None:
        self.cfg = cfg
        #: bumped by every load that renewed something: a refused request sent before
        #: one is retried without loading again
        self.generation = 0
        #: builds the connection pool for a load's TLS files (raises when they do not load)
        self.on_tls: Callable[[k8s_client.Configuration], Awaitable[None]] | None = None
        self._loaded = Loaded({}, None, {})
        self._lock = asyncio.Lock()
        self._retry_at = -math.inf
        self._refusal_reload_at = -math.inf

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """What the log lines call these credentials."""

    @abc.abstractmethod
    async def read(self) -> Reading:
        """Read the credentials afresh. Raises ``KubeconfigError`` or ``ConfigException``
        (a file gone, empty or invalid)."""

    async def load(self) -> list[str]:
        """Read the credentials and adopt them into ``cfg``; returns what was renewed
        (``the token``, ..., empty when nothing). Raises as ``read``, or
        ``KubeconfigError`` for TLS files that do not load."""
        reading = await self.read()
        fresh = reading.cfg
        tls = {p: _stamp(p) for p in (fresh.cert_file, fresh.key_file, fresh.ssl_ca_cert)
               if isinstance(p, str) and p}
        renewed: list[str] = []
        tls_changed = tls != self._loaded.tls or any(
            getattr(fresh, f) != getattr(self.cfg, f) for f in _TLS_FIELDS)
        if tls_changed and self.on_tls is not None:
            # before anything is adopted: a certificate renewed without its key yet (a
            # rename at a time) does not load, and the credentials in use stay
            try:
                await self.on_tls(fresh)
            except (ssl.SSLError, OSError) as e:
                raise KubeconfigError(f"{self.name}: its TLS files do not load: "
                                      f"{one_line(str(e))}") from e
            renewed.append("the TLS files (client certificate, key, CA)")
        if fresh.host != self.cfg.host and self._loaded.files:
            renewed.append("the server address")
        token = fresh.api_key.get("BearerToken")
        if token != self.cfg.api_key.get("BearerToken"):
            renewed.append("the token")
            if token is None:
                self.cfg.api_key.pop("BearerToken", None)
            else:
                self.cfg.api_key["BearerToken"] = token
        for f in _FIELDS:
            setattr(self.cfg, f, getattr(fresh, f))
        self._loaded = Loaded({**reading.files, **tls}, reading.renew_at, tls)
        if renewed:
            self.generation += 1
        return renewed

    def _changed(self) -> str:
        """A file the credentials were read from that changed since ("": none)."""
        for path, then in self._loaded.files.items():
            if _stamp(path) != then:
                return path
        return ""

    def _expiring(self) -> bool:
        """The exec plugin's credential is about to expire."""
        renew_at = self._loaded.renew_at
        return renew_at is not None and time.time() >= renew_at

    async def current(self) -> None:
        """Load the credentials again when a file they were read from changed (logged) or
        an exec credential is about to expire (at debug level: every 15 min on EKS). A
        load that fails keeps the credentials in use, and is tried again after
        ``RELOAD_RETRY_SECONDS``."""
        if time.monotonic() < self._retry_at or not (self._changed() or self._expiring()):
            return
        async with self._lock:
            if time.monotonic() < self._retry_at:
                return
            if changed := self._changed():
                await self._reload(f"{changed} changed", logging.INFO)
            elif self._expiring():
                await self._reload("the exec plugin's credential expires", logging.DEBUG)
                if self._expiring():  # a plugin answering an expired credential: not again
                    self._retry_at = time.monotonic() + RELOAD_RETRY_SECONDS  # each request

    async def renew_refused(self, generation: int, why: str) -> bool:
        """A request sent with the credentials of ``generation`` was refused (``why``):
        whether to send it again. Yes when a load since then renewed them; else they are
        loaded again (at most every ``REFUSAL_RELOAD_SECONDS``), and yes when that
        renewed anything."""
        async with self._lock:
            if generation != self.generation:
                return True
            now = time.monotonic()
            if now < self._refusal_reload_at:
                return False
            self._refusal_reload_at = now + REFUSAL_RELOAD_SECONDS
            return await self._reload(f"the API server refused its credentials ({why})",
                                      logging.WARNING)

    async def _reload(self, why: str, level: int) -> bool:
        """Load again, logging what was renewed at ``level``; whether anything was."""
        try:
            renewed = await self.load()
        except (KubeconfigError, k8s_config.ConfigException, OSError) as e:
            self._retry_at = time.monotonic() + RELOAD_RETRY_SECONDS
            log.warning("%s: %s; loading it again failed (the credentials in use stay, "
                        "tried again in %g s): %s", self.name, why, RELOAD_RETRY_SECONDS,
                        one_line(str(e)) or type(e).__name__)
            return False
        self._retry_at = -math.inf
        if renewed:
            log.log(level, "%s: %s; loaded it again: renewed %s", self.name, why,
                    ", ".join(renewed))
        else:
            log.debug("%s: %s; loaded it again: nothing renewed", self.name, why)
        return bool(renewed)


class Kubeconfig(KeptCredentials):
    """A kubeconfig file's credentials: the kubeconfig itself, its user's ``tokenFile``,
    client certificate and key, its cluster's CA, and an exec plugin's token."""

    def __init__(self, path: str, cfg: k8s_client.Configuration) -> None:
        super().__init__(cfg)
        self.path = path

    @property
    def name(self) -> str:
        return f"kubeconfig {self.path}"

    async def read(self) -> Reading:
        fresh = k8s_client.Configuration()
        # stamped before it is read (an exec plugin may take seconds): a rewrite meanwhile
        # shows as a change at the next look, not as the content loaded
        files = {self.path: _stamp(self.path)}
        loader = await _load_kubeconfig_file(self.path, fresh)
        user: Mapping[str, Any] = getattr(getattr(loader, "_user", None), "value", None) or {}
        token_file = user.get("tokenFile")
        if isinstance(token_file, str) and token_file and not user.get("token"):
            path = os.path.join(os.path.dirname(os.path.abspath(self.path)), token_file)
            files[path] = _stamp(path)
        return Reading(fresh, files, _renew_at(loader))


class InCluster(KeptCredentials):
    """The pod's service account: its token file (a projected token, which the kubelet
    rewrites at 80% of its lifetime, about hourly) and CA, the server from
    ``KUBERNETES_SERVICE_HOST`` / ``_PORT``.

    kubernetes-asyncio's own loader re-reads the token only once its copy is 60 s old
    (its ``refresh_api_key_hook``) and never on a 401: once the API server stopped taking
    the old token (expired, revoked) every call was refused for up to a minute, and a
    refused call was not sent again. Here the file is looked at before each call, as a
    kubeconfig's are, and read again once on a 401."""

    def __init__(self, cfg: k8s_client.Configuration, token_file: str, ca_file: str,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(cfg)
        self.token_file = token_file
        self.ca_file = ca_file
        self.environ = os.environ if environ is None else environ

    @classmethod
    def from_pod(cls, cfg: k8s_client.Configuration) -> InCluster:
        """Where the kubelet mounts them; the paths are the client's own (read when
        called, so a test can point them at its files)."""
        return cls(cfg, incluster_config.SERVICE_TOKEN_FILENAME,
                   incluster_config.SERVICE_CERT_FILENAME)

    @property
    def name(self) -> str:
        return f"service account token {self.token_file}"

    async def read(self) -> Reading:
        fresh = k8s_client.Configuration()
        files = {self.token_file: _stamp(self.token_file)}  # before it is read, as above
        # no hook of its own: ``current`` looks at the file before every request
        incluster_config.InClusterConfigLoader(
            self.token_file, self.ca_file, try_refresh_token=False,
            environ=dict(self.environ)).load_and_set(fresh)
        return Reading(fresh, files, None)


def _renew_at(loader: Any) -> float | None:
    """When the exec plugin's credential of ``loader`` is to be renewed (unix time):
    ``EXEC_RENEW_BEFORE`` before it expires, or a fifth of its lifetime when shorter.
    None without an exec plugin or an expirationTimestamp (renewed when refused, as
    client-go does)."""
    expiry = getattr(loader, "exec_plugin_expiry", None)
    if not isinstance(expiry, datetime.datetime):
        return None
    if expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=datetime.UTC)
    end = expiry.timestamp()
    return end - min(EXEC_RENEW_BEFORE, max(end - time.time(), 0.0) / 5)


@dataclass(frozen=True, slots=True)
class RetiredPool:
    """A connection pool replaced by a renewal of the TLS files, and when."""

    pool: Any
    at: float


def _tls_refusal(e: Exception) -> bool:
    """What a refused TLS handshake looks like: a failed handshake (TLS 1.2, or a server
    certificate its renewed CA no longer verifies), or, in TLS 1.3, where the server
    checks the client certificate after the client finished, a connection closed before
    any answer. Not a connection refused: the server is away, no credential helps."""
    if isinstance(e, aiohttp.ClientSSLError):
        return True
    return (isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            and not isinstance(e, aiohttp.ClientConnectorError))


def as_client_go(pool: Any, cfg: k8s_client.Configuration) -> Any:
    """``pool`` (a kubernetes-asyncio ``RESTClientObject``) verifying and choosing its
    proxy as client-go does; returned.

    TLS: its SSL context verifies as the upstream's does, as kubectl does
    (``proxy.tls_files.verify_as_go``). The library makes that context inside the pool's
    constructor with ``ssl.create_default_context``, strict from Python 3.13 (an API
    server certificate without an Authority Key Identifier refused), and hands it to the
    pool's connector: no seam but that connector's context, which it reads at each new
    connection, so it is changed there, in place, before any connection.
    (``disable_strict_ssl_verification``, a ``Configuration`` field of recent releases
    only, clears strict alone.)

    The proxy: the kubeconfig's ``proxy-url`` (the library's own), else the environment's
    ``HTTPS_PROXY`` / ``HTTP_PROXY`` read by Go's rules (``environment_route``). The
    library's session read the environment by Python's (``trust_env``): a ``NO_PROXY`` of
    CIDR ranges (``10.96.0.0/12``, the Service range an in-cluster API server sits in)
    matched nothing, nor did a loopback API server (kind, ``kubectl proxy``) go direct,
    so its every request went to a proxy that could not reach it. ``KubeconfigError``
    when the variable that applies names no proxy that can be spoken to. An HTTP(S)
    proxy is aiohttp's; a SOCKS5 one is opened by the pool's connector
    (``proxy.kube.socks5_connector``).
    """
    verify_as_go(pool_context(pool))
    session = pool.pool_manager
    if not hasattr(session, "_trust_env"):
        raise TypeError("kubernetes-asyncio's session has no _trust_env: the aiohttp it "
                        "runs on reads the environment's proxy elsewhere")
    session._trust_env = False
    egress = api_server_egress(cfg)
    pool.proxy, pool.proxy_headers = None, None
    if egress is not None and egress.socks:
        tunnel_through(session.connector, egress)
    elif egress is not None:
        pool.proxy = _with_login(egress)
    return pool


def _with_login(egress: Egress) -> str:
    """The HTTP(S) proxy's URL as aiohttp takes it: its login in it, which aiohttp sends
    as ``Proxy-Authorization`` with the ``CONNECT`` of an https:// API server and with
    each request to an http:// one (a ``Proxy-Authorization`` in the pool's
    ``proxy_headers`` went with the ``CONNECT`` alone, so an http:// API server's proxy
    answered every request 407)."""
    if not egress.authorization:
        return egress.url
    login = base64.b64decode(egress.authorization.removeprefix("Basic ")).decode()
    user, _, password = login.partition(":")
    return str(URL(egress.url).with_user(user).with_password(password))


def api_server_egress(cfg: k8s_client.Configuration) -> Egress | None:
    """The proxy the API server is reached through: the kubeconfig's ``proxy-url``, else
    the environment's by Go's rules; None: directly. ``KubeconfigError`` when the
    variable that applies names no proxy that can be spoken to."""
    egress = kubeconfig_egress(cfg)
    if egress is not None:
        return egress
    server = urlsplit(str(cfg.host))
    scheme = server.scheme.lower()
    port = server.port or (443 if scheme == "https" else 80)
    try:
        route = environment_route(scheme, server.hostname or "", port)
    except ValueError as e:
        raise KubeconfigError(
            f"the API server {cfg.host}: the environment's {e}",
            fix="give an http://, https:// or socks5:// proxy, name the API server in "
                "NO_PROXY, or set the kubeconfig cluster's proxy-url") from None
    return None if route is None else route.egress


def pool_context(pool: Any) -> ssl.SSLContext:
    """The SSL context a kubernetes-asyncio pool makes its connections with (its aiohttp
    connector's); TypeError from a kubernetes-asyncio or aiohttp that keeps it elsewhere."""
    ctx = pool.pool_manager.connector._ssl
    if not isinstance(ctx, ssl.SSLContext):
        raise TypeError(f"kubernetes-asyncio's connection pool holds no SSLContext: {ctx!r}")
    return ctx


class CheckedApiClient(k8s_client.ApiClient):
    """kubernetes-asyncio's ApiClient, every call of which goes through the kept
    credentials: ``call_api`` is the one seam that the source's raw requests (lists,
    watches, discovery) and the generated typed clients (the Lease's
    ``CoordinationV1Api``) share, and the only one before the auth header is made.

    The credentials were checked in the client's ``refresh_api_key_hook`` and again in
    ``KubeClient.open``: twice per request for the source's, and never for a client
    certificate (the hook runs only for a bearer token), so a Lease-only client (the
    fact writer beside ``--snapshot``) never followed a renewed certificate, and a Lease
    call refused with 401 was not retried with an exec plugin's new token. Here each
    call checks them once (``KeptCredentials.current``) and, when refused (a 401; with a
    client certificate, a refused TLS handshake), has them loaded again once and is sent
    once more if that renewed anything."""

    def __init__(self, configuration: k8s_client.Configuration,
                 credentials: KeptCredentials | None = None) -> None:
        super().__init__(configuration=configuration)
        as_client_go(self.rest_client, configuration)
        #: None: a configuration not kept current (the client's own default loader)
        self.credentials = credentials

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        """As the client's (an awaitable; the generated methods return it unawaited)."""
        if self.credentials is None or kwargs.get("async_req"):
            return super().call_api(*args, **kwargs)
        return self._checked(self.credentials, args, kwargs)

    async def _checked(self, creds: KeptCredentials, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        await creds.current()
        generation = creds.generation
        try:
            answer = await super().call_api(*args, **kwargs)
        except ApiException as e:  # a non-2xx answer of a call that reads its body
            if e.status != 401 or not await creds.renew_refused(
                    generation, f"{e.status} {e.reason or ''}".strip()):
                raise
        except aiohttp.ClientError as e:
            if not (creds.cfg.cert_file and _tls_refusal(e) and await creds.renew_refused(
                    generation, f"TLS: {type(e).__name__}: {e}")):
                raise
        else:
            # a call left to read its own body (``_preload_content=False``) gets its 401
            # as an answer, which the caller reads when nothing was renewed
            if not (isinstance(answer, aiohttp.ClientResponse) and answer.status == 401
                    and await creds.renew_refused(generation,
                                                  f"401 {answer.reason or ''}".strip())):
                return answer
            answer.release()
        return await super().call_api(*args, **kwargs)


class KubeClient:
    """Raw JSON over kubernetes-asyncio's ApiClient (its auth, TLS and session)."""

    def __init__(self, api: CheckedApiClient) -> None:
        self.api = api
        #: what the connection's credentials are kept current from (None: the client's
        #: own default configuration)
        self.credentials = api.credentials
        self._retired: list[RetiredPool] = []
        if self.credentials is not None:
            self.credentials.on_tls = self._new_pool

    @classmethod
    async def connect(cls, settings: KubeSettings) -> KubeClient:
        """A client on the kubeconfig (kept current, ``Kubeconfig``), else the in-cluster
        service account (kept current, ``InCluster``), else the client's own default."""
        path = kubeconfig_path(settings)
        credentials: KeptCredentials | None = None
        if path:
            credentials = Kubeconfig(path, k8s_client.Configuration())
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            credentials = InCluster.from_pod(k8s_client.Configuration())
        if credentials is None:
            # said plainly: the client's default loader read an empty config and answered
            # "Invalid kube-config file. Expected key current-context", of no file at all
            raise KubeconfigError(
                "no kubeconfig (--kubeconfig and KUBECONFIG unset, no ~/.kube/config) and "
                "not in a pod (KUBERNETES_SERVICE_HOST unset)", fix="set --kubeconfig")
        await credentials.load()
        cfg = credentials.cfg
        api = CheckedApiClient(cfg, credentials)
        api.user_agent = "karta-proxy"
        egress = api_server_egress(cfg)
        if egress is not None:
            log.info("the Kubernetes API server %s is reached through the %s %s",
                     cfg.host, egress.kind, egress.shown)
        return cls(api)

    async def _new_pool(self, cfg: k8s_client.Configuration) -> None:
        """A new connection pool (its SSL context) for renewed TLS files: the ApiClient's,
        so the Lease's typed client gets it too. The old one is closed once the watches
        streaming on it have ended (``RETIRED_POOL_SECONDS``): closing it at once cut
        them all."""
        # raises when the files do not load
        pool = as_client_go(k8s_rest.RESTClientObject(cfg), cfg)
        now = time.monotonic()
        self._retired.append(RetiredPool(self.api.rest_client, now))
        self.api.rest_client = pool
        keep = []
        for r in self._retired:
            if now - r.at >= RETIRED_POOL_SECONDS:
                await r.pool.close()
            else:
                keep.append(r)
        self._retired = keep

    async def close(self) -> None:
        for r in self._retired:
            await r.pool.close()
        self._retired.clear()
        await self.api.close()

    async def open(
        self, path: str, *, query: Mapping[str, str] | None = None, accept: str = ACCEPT_JSON,
        timeout: aiohttp.ClientTimeout | float | None = None,
    ) -> aiohttp.ClientResponse:
        """GET ``path`` and return the open response; non-2xx raises KubeApiError. Only
        GET: the source lists, watches and discovers (the Lease has its typed client).
        The credentials are checked, and a refusal renewed, by ``CheckedApiClient``."""
        params: Sequence[tuple[str, str]] = list((query or {}).items())
        resp: aiohttp.ClientResponse = await self.api.call_api(
            path,
            "GET",
            query_params=params,
            header_params={"Accept": accept, "Content-Type": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )
        if not 200 <= resp.status <= 299:
            raw = await resp.read()
            resp.release()
            raise _error(resp.status, raw, resp.headers.get("Retry-After"))
        return resp

    async def request_bytes(
        self, path: str, *, query: Mapping[str, str] | None = None, accept: str = ACCEPT_JSON,
        timeout: float | None = 60.0,
    ) -> bytes:
        """GET ``path`` and read the whole answer (``open`` for a stream)."""
        resp = await self.open(path, query=query, accept=accept, timeout=timeout)
        try:
            return await resp.read()
        finally:
            resp.release()

    async def request_json(
        self, path: str, *, query: Mapping[str, str] | None = None, accept: str = ACCEPT_JSON,
        timeout: float | None = 60.0,
    ) -> Any:
        """GET ``path`` and decode the whole answer."""
        return json.loads(await self.request_bytes(path, query=query, accept=accept,
                                                   timeout=timeout))


def _error(status: int, raw: bytes, retry_after: str | None = None,
           now: Callable[[], float] = time.time) -> KubeApiError:
    """The error of a non-2xx answer; its ``Retry-After`` header wins over the body's
    ``retryAfterSeconds``: delay-seconds (what kube-apiserver sends), or an HTTP-date
    (RFC 9110 allows it, and a proxy or gateway in front of the API server may send
    one), as seconds from ``now``; a date already past reads as none."""
    err: KubeApiError | None = None
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict):
            err = KubeApiError.from_status(status, doc)
    except ValueError:
        pass
    if err is None:
        err = KubeApiError(status, "", raw[:200].decode("utf-8", "replace"))
    asked = _retry_after_seconds(retry_after, now) if retry_after is not None else None
    if asked:
        err.retry_after = asked
    return err


def _retry_after_seconds(value: str, now: Callable[[], float]) -> float | None:
    """A ``Retry-After`` value in seconds: delay-seconds, or an HTTP-date less ``now``;
    None for anything else."""
    value = value.strip()
    if value.isascii() and value.isdigit():  # "\u00b2" is a digit to isdigit, not to float
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 850 / asctime forms carry no zone: GMT by definition
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - now())
