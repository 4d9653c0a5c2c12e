"""Assembly of a running proxy: settings -> engine, index, source, enricher, upstream,
fact writer, server; an orderly shutdown on SIGTERM / SIGINT; a reload on SIGHUP or
``POST /-/reload`` (what it applies: ``proxy.reload``).

Start order puts the HTTP server up before the Kubernetes source lists, so liveness
answers while the cluster state loads and readiness turns green when it is in. What can
only be fixed by the operator is found before the server says "listening": the cluster
connection is configured first, and a snapshot (read in a moment, and either loadable or
not) is loaded first. Such a failure is a ``StartError`` whose message names what to fix;
``serve`` prints it as one plain line and returns ``EXIT_START``. Stop order is the
reverse: stop taking requests and let in-flight ones finish while the fact writer ends its
own series and hands its lease back, then stop the sources; all of it within
``proxy.server.STOP_SECONDS`` of the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from proxy import __version__, server, via
from proxy.config import (
    ConfigError,
    Settings,
    check_dns_name,
    check_stored_cluster,
    cluster_check,
    cluster_check_off,
    oauth2_on,
    parse_host_port,
    placeholder_cluster,
    unforwarded_headers,
)
from proxy.connection_guard import http_parser
from proxy.contract import CONTRACT_VERSION
from proxy.cpus import usable_cpus
from proxy.fd_limit import AcceptGuard, check_nofile, guard_accepts
from proxy.handler import RemoteWriteHandler
from proxy.index import PodIndex
from proxy.karta.batches import alone_if_failing
from proxy.karta.explain import Explanation
from proxy.karta.model import Description
from proxy.karta.results import ChangeSet, PartialBatch
from proxy.log import error_line
from proxy.memory_limit import check_memory
from proxy.metrics import ProxyMetrics, present_at_zero
from proxy.reload import JQ_LIMIT_KEYS, ReloadOutcome, is_plan_key, merge, with_keys
from proxy.server import build_app, start_site
from proxy.shown import shown_url
from proxy.tasks import cancel_and_wait
from proxy.thread_names import named_pool
from proxy.tls import ServerTLS
from proxy.tls_handshake import REASONS
from proxy.upstream import Upstream, conversion_limit, fact_tenant_hint, short_pool
from proxy.wire.native import warn_if_python
from proxy.yielding import LOOP_RUN_SECONDS, RELOAD_DEFER_SECONDS, Pacer, Slices, in_runs

if TYPE_CHECKING:
    from proxy.facts import FactWriter
    from proxy.karta.description import DescriptionFiles
    from proxy.karta.jq_sandbox import JqSandbox
    from proxy.kube.cluster_identity import ClusterIdentity
    from proxy.kube.source import KubeSource

log = logging.getLogger("karta.runtime")

#: exit code of a start that failed (port, snapshot, cluster connection, ...); settings
#: errors are 2 (proxy/cli.py), a clean stop 0
EXIT_START = 1


class StartError(Exception):
    """A start that cannot succeed until the operator changes something; the message says
    what failed and what to fix, in one line."""


def _listen_error(address: str, e: OSError) -> StartError:
    # asyncio's own strerror repeats the address ("error while attempting to bind on
    # address ('h', p): address already in use"): the plain words of the errno instead
    # a gaierror's errno is a negative EAI_* code, which os.strerror calls "Unknown error"
    if isinstance(e, socket.gaierror):
        why = e.strerror or str(e)
    else:
        why = os.strerror(e.errno) if e.errno else (e.strerror or str(e))
    if isinstance(e, socket.gaierror):
        fix = "the host does not resolve to an address: fix --listen-address"
    elif e.errno == errno.EADDRINUSE:
        fix = ("another process holds the port: stop it, or set --listen-address "
               "(server.listen_address) to a free one")
    elif e.errno == errno.EACCES:
        fix = "ports below 1024 need privileges: use a higher port in --listen-address"
    elif e.errno == errno.EADDRNOTAVAIL:
        fix = "the host is not an address of this machine: fix --listen-address"
    else:
        fix = "fix --listen-address (server.listen_address)"
    return StartError(f"cannot listen on {address}: {why}; {fix}")

#: how often a replica that will campaign for the fact lease looks whether it may yet
CAMPAIGN_WAIT_SECONDS = 0.1
#: how often tombstones past their time are dropped from the index
EXPIRE_INTERVAL_SECONDS = 30.0
#: how long the fact writer's start waits for the cluster identity's first read at most
#: (it runs from the connection on, beside the index's load, so as a rule it is over)
IDENTITY_WAIT_SECONDS = 5.0
#: how often the jq sandbox's idle child is looked at (reaped if it died), and the
#: re-evaluations owed after jq failures that may pass are made (``Engine.retry_due``)
JQ_HOUSEKEEPING_SECONDS = 1.0
#: re-evaluations in one run of the loop (each may take one jq time limit, and the loop
#: gets its turn after each run, however short the run) and runs in one housekeeping turn
#: (the rest at the next: a sandbox that could not start owes every object one)
RETRY_RUN_OBJECTS = 32
RETRY_RUNS_PER_TURN = 16
#: threads of asyncio's default pool beyond one a usable core, and its largest size:
#: ThreadPoolExecutor's own rule (``min(32, cpus + 4)``: the pool's work is mostly waiting,
#: a file read, a request body's preparation), with the cores this process may use
AUX_EXTRA_THREADS = 4
AUX_MAX_THREADS = 32


def aux_threads(cpus: int) -> int:
    """The size of the ``karta-aux`` pool for ``cpus`` usable cores (at least 5).

    ThreadPoolExecutor sizes itself from ``os.cpu_count()``, the host's cores: a pod
    limited to 2 CPUs on a 64-core node had 32 threads for what 6 serve."""
    return min(AUX_MAX_THREADS, max(1, cpus) + AUX_EXTRA_THREADS)


def _log_description_files(read: DescriptionFiles, previous: DescriptionFiles | None) -> None:
    """What the log says of the description paths as read, each once (not at every
    reload while it stays so):

    - a warning for each description file found empty that the read before did not find
      so, and a line when one holds something again: an empty file is more likely caught
      mid-save than meant, so what it held stays in force (``read_description_paths``),
      and the log is where that shows;
    - a warning for a folder's files not read for their names (no ``.yaml``, ``.yml``,
      ``.json``): a ConfigMap key named ``raycluster`` was passed over without a word,
      its kind undescribed."""
    before = previous.empty if previous is not None else {}
    for path, kept in read.empty.items():
        if path in before:
            continue
        if kept:
            log.warning("description file is empty; the %d description(s) it held stay in "
                        "force until it holds some again (remove the file, or leave a "
                        "comment in it, to drop them)", kept, extra={"file": path})
        else:
            log.warning("description file is empty; it describes nothing",
                        extra={"file": path})
    for path in before:
        if path not in read.empty and path in read.by_file:
            log.info("description file is no longer empty", extra={"file": path})
    # likewise once: the files of a folder that are not read for their names
    unread_before = previous.unread if previous is not None else {}
    for folder, files in read.unread.items():
        if unread_before.get(folder) != files:
            log.warning("description folder holds files that are not read: only *.yaml, "
                        "*.yml and *.json are (a mounted ConfigMap's key is the file's "
                        "name: give it one of those suffixes)",
                        extra={"folder": folder, "files": files[:10], "count": len(files)})


def enrich_arguments(settings: Settings) -> dict[str, Any]:
    """The settings of the splice plan (``enrich``, ``upstream.max_labels_per_series``) as
    ``Enricher`` / ``build_plan`` keywords: one place, so the plan at start and the plan of
    a reload cannot differ."""
    e = settings.enrich
    return {
        "pod_label_pairs": [(ns, pod) for ns, pod in e.pod_label_pairs],
        "conflict_policy": e.conflict_policy,
        "pod_label_rules": e.pod_label_rules,
        "sender_karta_labels": e.sender_karta_labels,
        "max_labels_per_series": settings.upstream.max_labels_per_series,
        # facts.external_labels is not live: a reload keeps the running value, so a new
        # enrich.cluster_label is checked against the cluster the process started as
        "cluster_check": cluster_check(settings),
    }


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Proxy:
    """One proxy process worth of parts, startable and stoppable (tests run it in-process)."""

    def __init__(
        self, settings: Settings, *, loader: Callable[[], Settings] | None = None,
        tls_check_interval: float | None = None,
    ) -> None:
        """``loader`` reads the configuration again for a reload (the CLI's: the file and
        the flags); without one a reload re-reads the description files and the TLS files
        with the settings as they are."""
        from proxy.enrichment import Enricher
        from proxy.karta.engine import Engine

        self.settings = settings
        self._loader = loader
        self._reload_lock = asyncio.Lock()
        self._tls_check_interval = tls_check_interval
        self.tls: ServerTLS | None = None
        self.metrics = ProxyMetrics()
        # the configuration this process was given is its first successful load
        self.metrics.config_reload_successful.set(1)
        self.metrics.config_reload_timestamp.set(time.time())
        self.metrics.config_restart_required.set(0)
        self.index = PodIndex(tombstone_seconds=settings.karta.tombstone_seconds)
        self.metrics.watch_index(self.index)
        self.engine = Engine(
            builtins=settings.karta.builtins, max_owner_hops=settings.karta.max_owner_hops,
            # a removed owner's ghost is walked through as long as a deleted pod's
            # tombstone keeps its labels
            ghost_seconds=settings.karta.tombstone_seconds,
        )
        self.metrics.watch_engine(self.engine)
        self.enricher = Enricher(self.index, **enrich_arguments(settings))
        self.upstream = Upstream(settings.upstream, self.metrics,
                                 max_converted_bytes=conversion_limit(
                                     settings.server.max_decoded_bytes,
                                     settings.server.max_inflight_bytes),
                                 own_headers=settings.facts.headers)
        self.handler = RemoteWriteHandler(
            settings.server, self.index, self.enricher, self.upstream, self.metrics
        )
        self.source: Service | None = None
        self.source_name = ""
        self.facts: FactWriter | None = None
        #: whether this process writes fact series (facts.enabled, unless node mode)
        self.writes_facts = self._decide_fact_writing()
        self._elector: Any = None
        #: where the fact writer's Lease is (resolved at start when election is on)
        self.lease_namespace = ""
        self._elector_task: asyncio.Task[None] | None = None
        self._kube_client: Any = None
        #: the uid of the cluster's kube-system Namespace, read for the fact writer in
        #: Kubernetes mode (proxy/kube/cluster_identity.py; None: snapshot mode, no facts)
        self.cluster_identity: ClusterIdentity | None = None
        #: the description files as last applied: a reload that finds one empty keeps
        #: what it held (``read_description_paths``)
        self._description_files: DescriptionFiles | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._expire_task: asyncio.Task[None] | None = None
        self._jq_task: asyncio.Task[None] | None = None
        #: the loop's listeners at the descriptor limit (counted in accept_errors_total)
        self._accept_guard: AcceptGuard | None = None
        #: the jq sandbox the engine's expressions run in (karta.jq_sandbox), from the start
        #: to the stop
        self.jq_sandbox: JqSandbox | None = None

    # -- parts ----------------------------------------------------------------------------

    def _load_description_files(self) -> None:
        paths = self.settings.karta.description_paths
        if not paths:
            return
        from proxy.karta.description import read_description_paths

        read = read_description_paths(paths)
        descs, errors = read.descriptions(), read.errors
        for err in errors:
            log.error("invalid Karta description skipped", extra={"error": str(err)})
        _log_description_files(read, None)
        self._description_files = read
        # with the errors: the kind of an invalid one reads description_error, as from a
        # snapshot or an API object (its nested kinds are not workloads of their own)
        self.index.apply(self.engine.add_descriptions(descs, errors=errors))
        # a description another wins over is logged by the engine, once (not in force)
        log.info("descriptions loaded from files",
                 extra={"descriptions": len(descs), "errors": len(errors),
                        "not_in_force": len(self.engine.selection_losers())})

    def _make_source(self) -> Service:
        s = self.settings
        if s.snapshot:
            from proxy.snapshot import SnapshotSource

            self.source_name = f"snapshot {s.snapshot}"
            return SnapshotSource(s.snapshot, self.engine, self.index,
                                  reload_seconds=s.snapshot_reload_seconds or None,
                                  busy=self.handler.relaying,
                                  metrics_registry=self.metrics.registry)
        from proxy.kube.source import KubeSource

        self.source_name = "kubernetes" + (f" (node {s.kube.node_name})" if s.kube.node_name
                                           else "")
        # heavy objects' facts off the loop: only a sandbox's child frees it meanwhile
        return KubeSource(s.kube, self.engine, self.index, metrics_registry=self.metrics.registry,
                          client=self._kube_client, defer_heavy=self.jq_sandbox is not None)

    async def _connect_cluster(self) -> Any:
        """The one cluster connection (source and Lease share it). Only the configuration
        is loaded here: an API server that does not answer yet is waited for (the process
        serves, not ready), but no kubeconfig or service account at all cannot get better."""
        if self._kube_client is None:
            from proxy.kube.client import KubeClient, KubeconfigError

            s = self.settings.kube
            try:
                self._kube_client = await KubeClient.connect(s)
            except Exception as e:
                if isinstance(e, KubeconfigError):  # names the file and what is wrong
                    why, fix = f": {e}", e.fix
                else:
                    where = (f"kubeconfig {s.kubeconfig}" if s.kubeconfig
                             else "no kubeconfig, no in-cluster service account")
                    why = f" ({where}): {type(e).__name__}: {' '.join(str(e).split())}"
                    fix = "set --kubeconfig"
                if self.settings.snapshot:
                    # only the Lease wants the cluster here: "use --snapshot" would mislead
                    raise StartError(
                        f"facts.leader_election needs a Kubernetes cluster for its Lease, "
                        f"also with --snapshot{why}; {fix} (kube.kubeconfig, KUBECONFIG), "
                        "run in a pod with a service account, or set "
                        "facts.leader_election: false") from e
                raise StartError(
                    f"no Kubernetes cluster to watch{why}; {fix} (kube.kubeconfig, "
                    "KUBECONFIG), run in a pod with a service account, or use --snapshot"
                ) from e
        return self._kube_client

    async def _load_snapshot(self) -> None:
        from proxy.object_files import SnapshotError

        assert self.source is not None
        try:
            await self.source.start()
        except SnapshotError as e:
            raise StartError(f"{e}; fix the file or point --snapshot (snapshot) at another"
                             ) from e

    @property
    def partial_facts(self) -> bool:
        """This replica sees one node's pods (node mode) and was not told facts from such a
        view are wanted (``facts.allow_in_node_mode``)."""
        s = self.settings
        return bool(s.kube.node_name) and not s.snapshot and not s.facts.allow_in_node_mode

    def _decide_fact_writing(self) -> bool:
        """Fact series describe the whole cluster; a node-mode replica sees one node's pods,
        so its observed-pod counts and pod facts would be partial (and every replica of the
        DaemonSet would write the same series). Off there unless explicitly allowed."""
        s = self.settings
        if not s.facts.enabled:
            return False
        if self.partial_facts:
            log.info("fact series not written in node mode: this replica sees only node %s's "
                     "pods, so its facts would be partial; run one cluster-mode replica for "
                     "facts, or set facts.allow_in_node_mode with facts.leader_election",
                     s.kube.node_name,
                     extra={"node_name": s.kube.node_name})
            return False
        return True

    def _make_facts(self) -> FactWriter | None:
        from proxy.facts import FactsCollector, FactWriter, FactWriterCollector

        if not self.partial_facts:
            # in node mode every workload's facts on /metrics read one node's pods: an
            # audit found 4,687 karta_component_observed_pods series adding up to 8 (each
            # workload "0 observed" beside its desired count), a 58 MB page at 150k pods,
            # and the shipped rules skewed wherever the DaemonSet was scraped
            self.metrics.registry.register(
                FactsCollector(self.index, pod_facts=self.settings.facts.metrics_pod_facts,
                               cluster_uid=self._cluster_uid))
        if not self.writes_facts:
            return None
        writer = FactWriter(self.settings.facts, self.index,
                            functools.partial(self.upstream.send_v1,
                                              headers=self.settings.facts.headers),
                            elector=self._elector, busy=self.handler.relaying,
                            upstream_clock=self.upstream.clock,
                            cluster_uid=self._cluster_uid)
        self.metrics.registry.register(FactWriterCollector(writer))
        return writer

    def _cluster_uid(self) -> str:
        """The cluster's uid as known now, for karta_contract_info ("": unknown)."""
        return self.cluster_identity.uid if self.cluster_identity is not None else ""

    def _start_cluster_identity(self, client: Any) -> None:
        """Read the cluster's identity for the fact writer (a task of its own: the facts
        never wait for it but at the start, ``IDENTITY_WAIT_SECONDS`` at most). In
        snapshot mode there is none to read: the snapshot's objects may come from any
        cluster, and the API server the Lease lives on need not be theirs."""
        if not self.writes_facts:
            return
        if self.settings.snapshot:
            log.info("cluster identity: none in snapshot mode (no API server of the "
                     "snapshot's cluster to read the kube-system Namespace's uid from): "
                     "karta_contract_info carries no karta_cluster_uid, so "
                     "KartaClusterNameShared cannot tell this cluster's facts from another's "
                     "written under the same cluster name")
            return
        from proxy.kube.cluster_identity import ClusterIdentity

        self.cluster_identity = ClusterIdentity(client)
        self.cluster_identity.start()

    async def _start_elector(self) -> None:
        """One fact writer among replicas: a Lease, through the same cluster connection."""
        f = self.settings.facts
        if not (self.writes_facts and f.leader_election):
            return
        from proxy.kube.client import default_namespace
        from proxy.lease import LeaseElector

        self.lease_namespace = f.lease_namespace or default_namespace()
        if not f.lease_namespace:
            # $POD_NAMESPACE is set by hand where the downward API is not used: a name no
            # namespace can have is refused by the API at every round, no writer elected
            try:
                check_dns_name(self.lease_namespace, "the proxy's own namespace "
                               "($POD_NAMESPACE, else the service account's)", "namespace",
                               subdomain=False)
            except ConfigError as e:
                raise StartError(f"{e}; the fact writer's Lease goes there: fix "
                                 "$POD_NAMESPACE or set facts.lease_namespace") from None
        log.info("fact writer election", extra={
            "lease": f"{self.lease_namespace}/{f.lease_name}",
            "namespace_from": "setting" if f.lease_namespace else "own namespace"})
        client = await self._connect_cluster()
        self._elector = LeaseElector(client.api, self.lease_namespace, f.lease_name,
                                     f.identity, f.lease_duration_seconds)
        self._elector_task = asyncio.create_task(self._campaign(self._elector),
                                                 name="fact-lease")

    async def _campaign(self, elector: Any) -> None:
        """Campaign for the lease once the index is loaded and the fact writer has walked
        it standing by: a replica still syncing (its API reads failing, say) that won the
        lease wrote nothing for as long, while its gauge said it was the writer, and its
        first write knew nothing to end."""
        from proxy.facts import FactWriter

        while not self.index.ready:
            await asyncio.sleep(CAMPAIGN_WAIT_SECONDS)
        writer = self.facts
        if isinstance(writer, FactWriter):
            walks = writer.standby_walks
            while writer.standby_walks == walks:
                await asyncio.sleep(CAMPAIGN_WAIT_SECONDS)
        await elector.run()

    async def _stop_facts(self, by: float) -> None:
        """The fact writer's part of a stop, beside the drain and done by ``by`` (the
        loop's clock): its own series ended first (their stale markers, at most
        ``END_TIMEOUT_SECONDS``), and only then the lease handed back, so a standby
        cannot write before those markers; the release gets what is left. Run after the
        drain, the two took up to 5 s + the Lease call under way (2/3 of the lease) + two
        release calls (a third each): 26.5 s of SIGTERM with a slow upstream and API."""
        from proxy.facts.writer import END_TIMEOUT_SECONDS

        loop = asyncio.get_running_loop()
        if self.facts is not None:
            try:
                await self.facts.stop(min(END_TIMEOUT_SECONDS, by - loop.time()))
            except Exception:
                log.exception("error while stopping", extra={"part": "FactWriter"})
        if self._elector is not None:
            await self._elector.stop(timeout=by - loop.time())
        if self._elector_task is not None:
            # cancelled, not waited for: a campaign still waiting for the index or the
            # writer's walk never reaches run() once the writer is stopped, and a stop
            # within the first interval after start hung for good
            with contextlib.suppress(Exception):
                await cancel_and_wait(self._elector_task)

    async def _drain(self) -> None:
        """Stop taking requests; those in flight get ``DRAIN_SECONDS`` to finish, and are
        ended then (``proxy.connection_guard``)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.tls is not None:
            await self.tls.stop()

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        log.info("starting karta-proxy", extra={
            "version": __version__, "contract_version": CONTRACT_VERSION,
            "upstream_url": shown_url(s.upstream.url),
            "listen_address": s.server.listen_address,
            "splice": self.enricher.implementation, "worker_threads": self.handler.workers,
            "http_parser": http_parser(),
            # this process's name in the Via of what it forwards: a 508 loop names it
            "via": via.PSEUDONYM,
            **({"upstream_proxy": self.upstream.egress.describe()}
               if self.upstream.egress is not None else {}),
            **({"upstream_oauth2_token_url": shown_url(s.upstream.oauth2.token_url)}
               if oauth2_on(s.upstream) else {}),
        })
        warn_if_python()
        check_nofile(s.server.max_connections, s.upstream.max_connections)
        if short := short_pool(s.server.max_concurrent_requests, s.upstream.max_connections):
            log.warning(short, extra={"kind": "upstream_pool"})
        if unforwarded := unforwarded_headers(s.upstream):
            log.warning(unforwarded, extra={"setting": "upstream.forward_headers"})
        check_memory(s.server.max_inflight_bytes, s.karta.jq_sandbox)
        self._accept_guard = guard_accepts(asyncio.get_running_loop())
        if self._accept_guard is not None:
            self._accept_guard.on_failure.append(self._accept_failed)
        self._start_jq_sandbox()
        await self.upstream.start(check=True)
        self._load_description_files()
        if not s.snapshot:
            self._start_cluster_identity(await self._connect_cluster())
        else:
            self._start_cluster_identity(None)
        self.source = self._make_source()
        if s.snapshot:
            # a configuration reload (SIGHUP) waits for the load: its descriptions must
            # not land between two of the load's runs (SnapshotSource._apply_first)
            async with self._reload_lock:
                await self._load_snapshot()
        await self._start_elector()
        self.facts = self._make_facts()
        if self.facts is not None:
            hint = fact_tenant_hint(s.upstream, s.facts.headers)
            if hint:
                log.info(hint, extra={"upstream_url": shown_url(s.upstream.url)})
        self._say_cluster_check(s)
        app = build_app(self.handler, self.index, self.metrics,
                        upstream_url=shown_url(s.upstream.url), source=self.source_name,
                        reload=self.reload, lifecycle=s.server.enable_lifecycle,
                        explain=self._explain, descriptions=self._descriptions_text)
        host, port = parse_host_port(s.server.listen_address)
        if s.server.tls_cert_file:
            self.tls = self._make_tls()
        try:
            self._runner, self.port = await start_site(
                app, host, port, ssl_context=self.tls.current if self.tls is not None else None,
                refusals=self.tls.refusals if self.tls is not None else None,
                connections=self.tls.connections if self.tls is not None else None)
        except OSError as e:
            raise _listen_error(s.server.listen_address, e) from e
        if self.tls is not None:
            self.tls.start()
        if not s.snapshot:
            await self.source.start()
        if self.facts is not None:
            if self.cluster_identity is not None:
                # read beside the index's load, as a rule long done: the first write then
                # carries it, where a write before it wrote the series without and ended
                # it at the next
                await self.cluster_identity.wait_first(IDENTITY_WAIT_SECONDS)
            await self.facts.start()
        self._expire_task = asyncio.create_task(self._expire_loop())
        if self.jq_sandbox is not None:
            self._jq_task = asyncio.create_task(self._jq_loop(self.jq_sandbox))
        log.info("karta-proxy started", extra={
            "port": self.port, "source": self.source_name, "pods": len(self.index),
            "ready": self.index.ready,
        })

    def _accept_failed(self, reason: str) -> None:
        self.metrics.accept_errors.labels(reason).inc()

    def _start_jq_sandbox(self) -> None:
        """Every description's jq expression evaluated in the sandbox child from now on
        (``proxy.karta.jq_sandbox``; the child itself starts at the first evaluation)."""
        k = self.settings.karta
        if not k.jq_sandbox or self.jq_sandbox is not None:
            return
        from proxy.karta.jq_sandbox import JqSandbox
        from proxy.karta.jqexpr import install_runner

        self.jq_sandbox = JqSandbox(timeout_seconds=k.jq_timeout_seconds,
                                    memory_limit_bytes=k.jq_memory_limit_bytes)
        install_runner(self.jq_sandbox)
        self.metrics.watch_jq_sandbox(self.jq_sandbox)

    def _stop_jq_sandbox(self) -> None:
        """Back to in-process evaluation (or another proxy's sandbox in a test), the child
        killed and reaped."""
        if self.jq_sandbox is None:
            return
        from proxy.karta.jqexpr import remove_runner

        remove_runner(self.jq_sandbox)
        self.jq_sandbox.close()

    @staticmethod
    def _say_cluster_check(s: Settings) -> None:
        """At a start, or a reload of ``enrich.cluster_label``: a check that is off for
        want of this proxy's cluster (info), or that runs against the shipped ConfigMaps'
        placeholder (a warning: agents naming their real cluster lose every stamp)."""
        off = cluster_check_off(s)
        if off:
            log.info(off, extra={"setting": "enrich.cluster_label"})
        placeholder = placeholder_cluster(s)
        if placeholder:
            log.warning(placeholder, extra={"setting": "facts.external_labels"})

    def _descriptions_text(self) -> str:
        """The landing page's row on the descriptions: how many are in force, from where,
        and how many were not taken, by why (``karta_proxy_description_errors``). An
        operator opening the page after an edit sees there that it was not taken, where
        before only a log line said so."""
        from proxy.karta.results import (
            DESCRIPTION_HELD_LAST_VALID,
            DESCRIPTION_INVALID,
            DESCRIPTION_NOT_IN_FORCE,
        )

        def origin(desc: Description) -> str:
            if desc.builtin:
                return "built in"
            # a snapshot's are read from its files, as karta.description_paths' are
            return "from Karta objects" if desc.source.startswith("api:") else "from files"

        descs = self.engine.descriptions().values()
        origins = Counter(origin(d) for d in descs)
        text = f"{len(descs)} in force"
        if origins:
            text += " (" + ", ".join(f"{n} {o}" for o, n in sorted(origins.items())) + ")"
        problems = self.engine.description_problems()
        said = [f"{problems[DESCRIPTION_INVALID]} invalid",
                f"{problems[DESCRIPTION_HELD_LAST_VALID]} held at their last valid version",
                f"{problems[DESCRIPTION_NOT_IN_FORCE]} another description won over"]
        if any(problems.values()):
            return f"{text}; not taken: {', '.join(said)} (the log names each)"
        return f"{text}; none not taken"

    def _explain(self, namespace: str, pod: str) -> Explanation | None:
        """The engine's explanation of a pod, found by the uid the index knows it by (the
        engine alone scans every pod for the name: ~18 ms p50 added to the relayed
        writes with 4 clients viewing one pod in a loop at 45k pods)."""
        return self.engine.explain(namespace, pod, uid=self.index.uid_of(namespace, pod))

    def _make_tls(self) -> ServerTLS:
        def count(ok: bool) -> None:
            self.metrics.tls_reloads.labels("success" if ok else "failure").inc()

        present_at_zero(self.metrics.tls_reloads, ("success", "failure"))
        failures = present_at_zero(self.metrics.tls_handshake_failures,
                                   (r.value for r in REASONS))
        expiry = self.metrics.tls_certificate_expiry
        self.metrics.registry.register(expiry)
        kwargs: dict[str, Any] = {
            "on_reload": count, "on_refused": lambda reason: failures.labels(reason).inc(),
            "on_expiry": expiry.set}
        if self._tls_check_interval is not None:
            kwargs["check_interval"] = self._tls_check_interval
        tls = ServerTLS(self.settings.server, **kwargs)
        log.info("serving HTTPS", extra={
            "cert_file": tls.cert_file, "client_auth_type": tls.client_auth_type,
            "client_ca_file": tls.client_ca_file, "check_interval_s": tls.check_interval})
        return tls

    # -- reload ---------------------------------------------------------------------------

    async def reload(self, *, begun: Callable[[], None] | None = None) -> ReloadOutcome:
        """Read the configuration again and apply what can change live; never raises.

        Everything that can fail (reading and validating the file, the descriptions, the
        new plan) happens before anything is applied: a failed reload leaves the proxy as
        it was, says why in the log, and sets ``config_last_reload_successful`` to 0.
        ``begun`` is called when this reload's turn comes, before it reads anything.
        """
        async with self._reload_lock:
            if begun is not None:
                begun()
            try:
                outcome = await self._reload()
            except Exception as e:  # a reload must not end the process
                log.exception("reload failed")
                outcome = ReloadOutcome(False, f"{type(e).__name__}: {e}")
        m = self.metrics
        if outcome.ok:
            m.config_reload_successful.set(1)
            m.config_reload_timestamp.set(time.time())
            m.config_restart_required.set(1 if outcome.restart_required else 0)
        else:
            m.config_reload_successful.set(0)
            log.error("reload failed; the configuration in force stays",
                      extra={"error": outcome.error})
        return outcome

    async def _describe(self, descs: list[Description] | None, source: str) -> None:
        """Set (``None``: remove) one source's descriptions; what that changes is
        re-attributed in runs that give way to the requests being relayed, each applied
        to the index at once (in one go, three described kinds held the loop 2.5-3.4 s
        at 37.5k pods). Descriptions read again unchanged change nothing."""
        change = self.engine.change_descriptions(descs, source=source)
        self.index.apply(change.changes)
        owed = change.owed
        kube = self._kube_source()
        if kube is not None:  # heavy objects re-evaluated off the loop
            owed = kube.owe_heavy(owed)

        # an engine bug on one owed object costs that object (and what lies below it) its
        # new attribution, never the rest of the reload's runs; logged once per reload
        failures: list[tuple[str, Exception]] = []
        await in_runs(len(owed), lambda i, j: self.index.apply(alone_if_failing(
                          owed[i:j], self.engine.reattribute,
                          lambda uid, error: failures.append((uid, error)))),
                      Slices(LOOP_RUN_SECONDS, first=16),
                      Pacer(self.handler.relaying, RELOAD_DEFER_SECONDS))
        if failures:
            error = failures[0][1]
            log.error("engine failed on the re-attribution of %d of %d objects; they keep "
                      "their attribution: %s", len(failures), len(owed),
                      ", ".join(u for u, _ in failures[:5]), exc_info=error)

    async def _follow_kinds(self) -> None:
        """A snapshot source feeds again the objects of kinds the new descriptions made
        the engine keep whole; the kube source's follower is woken to start or switch
        the watches (relisting them whole) now, not at its next recheck (30 s)."""
        from proxy.snapshot import SnapshotSource

        if isinstance(self.source, SnapshotSource):
            await self.source.follow_kinds()
        elif (kube := self._kube_source()) is not None:
            kube.wake()

    def _kube_source(self) -> KubeSource | None:
        """The source when it is the cluster's (imported only then: snapshot mode loads
        nothing of the Kubernetes client)."""
        if self.source is None or self.settings.snapshot:
            return None
        from proxy.kube.source import KubeSource

        return self.source if isinstance(self.source, KubeSource) else None

    async def _reload(self) -> ReloadOutcome:
        from proxy.enrichment import build_plan
        from proxy.karta.description import DescriptionFiles, read_description_paths

        log.info("reloading the configuration")
        try:
            loaded = (await asyncio.to_thread(self._loader) if self._loader is not None
                      else self.settings)
        except ConfigError as e:
            return ReloadOutcome(False, str(e))
        merged = merge(self.settings, loaded)
        new = merged.settings
        if "enrich.cluster_label" in merged.applied:
            # the file passed the same check with its own upstream.url and external labels;
            # the running ones stay (restart keys), and a new label meets those
            try:
                check_stored_cluster(new)
            except ConfigError as e:
                return ReloadOutcome(False, f"{e} (a reload keeps the running upstream.url "
                                     "and facts.external_labels: they take a restart)")
        paths = new.karta.description_paths
        read = (await asyncio.to_thread(read_description_paths, paths,
                                        self._description_files) if paths
                else DescriptionFiles())
        descs, errors = read.descriptions(), read.errors
        if errors:
            for err in errors:
                log.error("invalid Karta description", extra={"error": str(err)})
            return ReloadOutcome(False, f"{len(errors)} invalid description(s), the first: "
                                 f"{errors[0]}")
        replan = any(is_plan_key(k) for k in merged.applied)
        try:
            # compiled here, for the splice in use: the native plan takes C sizes (an
            # OverflowError there, once the apply below began, left the built-in switch
            # applied behind a 500 that no later reload undid)
            splicer = (self.enricher.prepare(build_plan(**enrich_arguments(new))) if replan
                       else None)
        except (ValueError, OverflowError) as e:
            return ReloadOutcome(False, f"enrich: {e}")
        builtins: list[Description] | None = None
        if "karta.builtins" in merged.applied and new.karta.builtins:
            from proxy.karta.builtin import builtin_descriptions

            builtins = builtin_descriptions()
        # the TLS files are tried too before anything is applied: a reload whose files do
        # not load changes nothing (it applied the new enrich plan, then answered 500)
        tls = None
        if self.tls is not None:
            try:
                tls = self.tls.trial()
            except Exception as e:
                return ReloadOutcome(False, f"TLS files (server.tls_*): {self.tls.named(e)}")
        try:
            upstream_tls = self.upstream.tls_trial()
        except Exception as e:
            return ReloadOutcome(False, f"upstream TLS files (upstream.tls_*): {e}")

        # -- apply: the swaps first (none can fail), then the engine's runs ----------------
        # What is applied is recorded in self.settings as it is: were a run to fail (an
        # engine bug) or the reload be cancelled (a stop), the settings in force say what
        # is in force, and the next reload compares with that, not with the file's.
        done: list[str] = []
        try:
            if splicer is not None:
                self.enricher.replan(splicer)
                done += [k for k in merged.applied if is_plan_key(k)]
                if "enrich.cluster_label" in done:
                    self._say_cluster_check(new)
            if "log_level" in merged.applied:
                logging.getLogger().setLevel(new.log_level.upper())
                done.append("log_level")
            jq_limits = [k for k in merged.applied if k in JQ_LIMIT_KEYS]
            if jq_limits:
                if self.jq_sandbox is not None:
                    self.jq_sandbox.configure(
                        timeout_seconds=new.karta.jq_timeout_seconds,
                        memory_limit_bytes=new.karta.jq_memory_limit_bytes)
                done += jq_limits
            if self.tls is not None and tls is not None:
                self.tls.adopt(tls, forced=True)
            self.upstream.tls_adopt(upstream_tls)
            if "karta.builtins" in merged.applied:
                await self._describe(builtins, "builtin")
                done.append("karta.builtins")
            await self._describe(descs if paths else None, "files")
            _log_description_files(read, self._description_files)
            self._description_files = read if paths else None
            done.append("karta.description_paths")
            await self._follow_kinds()
        except BaseException as e:
            self.settings = with_keys(self.settings, new, done)
            if not isinstance(e, Exception):
                raise
            log.exception("reload failed while applying")
            return ReloadOutcome(False, f"{type(e).__name__}: {e} (while applying; in force "
                                 f"from the new configuration: {', '.join(done) or 'nothing'})")
        self.settings = new
        if merged.restart_required:
            log.warning("configuration changes that take a restart; the running values stay",
                        extra={"keys": list(merged.restart_required)})
        log.info("configuration reloaded", extra={
            "applied": list(merged.applied), "descriptions": len(descs),
            "descriptions_kept_from_empty_files": read.kept(),
            "restart_required": list(merged.restart_required)})
        return ReloadOutcome(True, applied=merged.applied,
                             restart_required=merged.restart_required,
                             kept_empty_files=tuple(read.kept()))

    async def _expire_loop(self) -> None:
        """Tombstone expiry, for every source (the one place it runs: the snapshot and the
        kube source only add tombstones), the expiry of the engine's ghosts of removed
        owners (the pods that still walked through one placed again), and the engine's
        description changes held back from the log."""
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_SECONDS)
            try:
                self.index.expire()
            except Exception:  # never let housekeeping end the process
                log.exception("tombstone expiry failed")
            if not self._housekeep("owner ghost expiry", self.engine.expire_ghosts):
                continue
            try:
                self.engine.log_held_changes()
            except Exception:
                log.exception("logging held description changes failed")

    async def _jq_loop(self, sandbox: JqSandbox) -> None:
        """The jq sandbox's housekeeping: an idle child that died (killed from outside,
        the OOM killer) is reaped within a second, counted and logged once, not left a
        zombie until the next evaluation (a quiet cluster may make none for hours); and
        the objects whose evaluation failed for a reason that may pass (the child held up,
        killed, unable to start; a quarantine over) are evaluated again once their backoff
        is over, not left ``Undefined`` / ``jq_error`` until their next event."""
        while True:
            await asyncio.sleep(JQ_HOUSEKEEPING_SECONDS)
            try:
                sandbox.reap_idle()
            except Exception:  # never let housekeeping end the process
                log.exception("jq sandbox housekeeping failed")
            for run in range(RETRY_RUNS_PER_TURN):
                if run:
                    await asyncio.sleep(0)  # the loop's turn between runs
                if not self.engine.retries_due() or not self._housekeep(
                        "jq re-evaluation",
                        lambda: self.engine.retry_due(RETRY_RUN_OBJECTS, LOOP_RUN_SECONDS)):
                    break

    def _housekeep(self, what: str, step: Callable[[], ChangeSet]) -> bool:
        """One engine housekeeping step, what it changed applied to the index: a step that
        failed half-way (``PartialBatch``) has its part applied, since the engine holds
        it already. False: it failed (logged), never raised: housekeeping must not end the
        process."""
        try:
            cs = step()
        except PartialBatch as e:
            log.exception("%s failed", what)
            cs = e.changes if e.changes is not None else ChangeSet()
        except Exception:
            log.exception("%s failed", what)
            return False
        if cs:
            self.index.apply(cs)
        return True

    async def stop(self) -> None:
        """Stop taking requests and finish those in flight while the fact writer ends its
        series and releases its lease, then stop the sources: within ``STOP_SECONDS``
        (``DRAIN_SECONDS`` for the first two, side by side; the requests still in flight
        then are ended; what is left of the stop is closing). The jq sandbox's child is
        ended last, whatever failed before."""
        try:
            await self._stop_parts()
        finally:
            self._stop_jq_sandbox()
            if self._accept_guard is not None and \
                    self._accept_failed in self._accept_guard.on_failure:
                self._accept_guard.on_failure.remove(self._accept_failed)

    async def _stop_parts(self) -> None:
        log.info("stopping karta-proxy")
        by = asyncio.get_running_loop().time() + server.DRAIN_SECONDS
        await cancel_and_wait(self._expire_task)
        await cancel_and_wait(self._jq_task)
        drained = await asyncio.gather(self._drain(), self._stop_facts(by),
                                       return_exceptions=True)
        for outcome in drained:  # both ended first: neither left running unawaited
            if isinstance(outcome, BaseException):
                raise outcome
        if self.source is not None:
            try:
                await self.source.stop()
            except Exception:
                log.exception("error while stopping",
                              extra={"part": type(self.source).__name__})
        if self.cluster_identity is not None:
            await self.cluster_identity.stop()
        if self._kube_client is not None:  # the source's and the Lease's connection
            await self._kube_client.close()
        await self.upstream.close()
        self.handler.flush_logs()
        await asyncio.to_thread(self.handler.close)
        log.info("karta-proxy stopped")


async def serve(
    settings: Settings, *, ready: asyncio.Event | None = None,
    loader: Callable[[], Settings] | None = None,
    early_reload: Callable[[], bool] | None = None,
) -> int:
    """Run until SIGTERM or SIGINT, reloading on SIGHUP; returns the process exit code.
    ``early_reload``: whether a SIGHUP came before this loop handled them (``cli``), then
    reloaded for once its handler is in place."""
    loop = asyncio.get_running_loop()
    # asyncio's own default pool (``to_thread``: snapshot reads, forwarding's prepare),
    # its threads named for the OS too (proxy.thread_names), sized from the cores this
    # process may use (its affinity, its cgroup's quota: proxy.cpus), not the host's
    loop.set_default_executor(named_pool("karta-aux", aux_threads(usable_cpus())))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    proxy = Proxy(settings, loader=loader)
    reloads: set[asyncio.Task[ReloadOutcome]] = set()
    #: a SIGHUP's reload waits for its turn (it reads the files after every signal so far)
    waiting = False

    def begun() -> None:
        nonlocal waiting
        waiting = False

    def on_sighup() -> None:
        # SIGHUP's default action ends the process; handled, it reloads (as Prometheus).
        # One waiting reload stands for every SIGHUP that comes before its turn: a burst
        # (a reloader sidecar firing per file of a ConfigMap) ran a whole reload for each
        nonlocal waiting
        if waiting:
            log.debug("SIGHUP while a reload waits for its turn: that one reads the files")
            return
        waiting = True
        task = loop.create_task(proxy.reload(begun=begun), name="reload")
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    if early_reload is not None and early_reload():  # after: none falls between the two
        log.info("SIGHUP received while starting: reloading")
        on_sighup()
    # The start waits for the initial sync, which lasts as long as the API server is away:
    # a SIGTERM meanwhile must still end the process (cleanly, exit 0).
    starting = asyncio.create_task(proxy.start(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stop requested before the index was loaded")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await proxy.stop()
        return 0
    error = starting.exception()
    if error is not None:
        stopping.cancel()
        await _quietly(proxy.stop())
        # after the stop's own log lines: the last line on stderr says what to fix
        error_line(str(error) if isinstance(error, StartError)
                   else f"cannot start: {type(error).__name__}: {error}")
        return EXIT_START
    if ready is not None:
        ready.set()
    await stopping
    await proxy.stop()
    return 0


async def _quietly(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw
