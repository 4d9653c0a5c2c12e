"""Connection to the API server: configuration, the ApiClient, raw JSON requests.

kubernetes-asyncio is used unpatched for what it does well (kubeconfig / in-cluster
config, auth, TLS, the aiohttp session); responses are read raw
(``_preload_content=False``) and parsed with ``json`` because building its model
objects for 100k pods costs more than the whole index.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from proxy.config import KubeSettings
from proxy.karta.yamltext import yaml_error

log = logging.getLogger(__name__)

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
                 causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.causes = causes

    @classmethod
    def from_status(cls, status: int, doc: Mapping[str, Any]) -> KubeApiError:
        """From a Status object: an error answer's body, or a watch's ``ERROR`` event."""
        details = doc.get("details")
        causes = details.get("causes") if isinstance(details, dict) else None
        reasons = (tuple(str(c.get("reason", "")) for c in causes if isinstance(c, dict))
                   if isinstance(causes, list) else ())
        return cls(status, str(doc.get("reason", "")), str(doc.get("message", "")), reasons)

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
    and column on a line of their own)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _check_kubeconfig(path: str) -> None:
    """What the client would stumble over with a message of no use (a TypeError for an
    empty file or a list) or of three lines (invalid YAML), said as one."""
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


async def _load_kubeconfig_file(path: str, cfg: k8s_client.Configuration) -> None:
    _check_kubeconfig(path)
    try:
        await k8s_config.load_kube_config(config_file=path, client_configuration=cfg,
                                          persist_config=False)
    except Exception as e:  # ConfigException, base64 and key errors, an exec plugin's
        detail = _one_line(str(e)) or type(e).__name__
        raise KubeconfigError(f"kubeconfig {path}: does not load: {detail}") from e


async def load_configuration(settings: KubeSettings) -> k8s_client.Configuration:
    """kubeconfig from the setting or ``KUBECONFIG``; else the in-cluster service
    account when running in a pod; else ``~/.kube/config``. A kubeconfig file that exists
    but does not load raises ``KubeconfigError`` (one line naming the file)."""
    cfg = k8s_client.Configuration()
    path = settings.kubeconfig or os.environ.get("KUBECONFIG", "")
    if path:
        await _load_kubeconfig_file(path.split(os.pathsep)[0] or path, cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=cfg)
    elif (default := Path("~/.kube/config").expanduser()).exists():
        await _load_kubeconfig_file(str(default), cfg)
    else:  # the client's own words: no cluster configured at all
        await k8s_config.load_kube_config(client_configuration=cfg, persist_config=False)
    return cfg


class KubeClient:
    """Raw JSON over kubernetes-asyncio's ApiClient (its auth, TLS and session)."""

    def __init__(self, api: k8s_client.ApiClient) -> None:
        self.api = api

    @classmethod
    async def connect(cls, settings: KubeSettings) -> KubeClient:
        cfg = await load_configuration(settings)
        api = k8s_client.ApiClient(configuration=cfg)
        api.user_agent = "karta-proxy"
        return cls(api)

    async def close(self) -> None:
        await self.api.close()

    async def open(
        self, path: str, *, query: Mapping[str, str] | None = None, accept: str = ACCEPT_JSON,
        timeout: aiohttp.ClientTimeout | float | None = None,
    ) -> aiohttp.ClientResponse:
        """GET ``path`` and return the open response; non-2xx raises KubeApiError. Only
        GET: the source lists, watches and discovers (the Lease has its typed client)."""
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
            raise _error(resp.status, raw)
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


def _error(status: int, raw: bytes) -> KubeApiError:
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict):
            return KubeApiError.from_status(status, doc)
    except ValueError:
        pass
    return KubeApiError(status, "", raw[:200].decode("utf-8", "replace"))
