"""Assembly of a running proxy: settings -> engine, index, source, enricher, upstream,
fact writer, server; and an orderly shutdown on SIGTERM / SIGINT.

Start order puts the HTTP server up before the index source, so liveness answers while
the cluster state loads and readiness turns green when it is in. Stop order is the
reverse: stop taking requests, let in-flight ones finish, then stop the sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from proxy import __version__
from proxy.config import Settings, parse_host_port
from proxy.contract import CONTRACT_VERSION
from proxy.handler import RemoteWriteHandler
from proxy.index import PodIndex
from proxy.metrics import ProxyMetrics
from proxy.server import build_app, start_site
from proxy.upstream import Upstream
from proxy.wire.native import warn_if_python

log = logging.getLogger("karta.runtime")

#: how often tombstones past their time are dropped from the index
EXPIRE_INTERVAL_SECONDS = 30.0


#: families the kube source registers that ``ProxyMetrics`` already serves from the index
#: (served twice, a scrape would see duplicate families)
SHARED_INDEX_FAMILIES = frozenset({"karta_proxy_index_pods", "karta_proxy_index_stale"})


class RegistryView(Collector):
    """Another registry's families on /metrics, leaving out names served elsewhere."""

    def __init__(self, registry: CollectorRegistry, skip: frozenset[str]) -> None:
        self._registry = registry
        self._skip = skip

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name not in self._skip:
                yield family


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Proxy:
    """One proxy process worth of parts, startable and stoppable (tests run it in-process)."""

    def __init__(self, settings: Settings) -> None:
        from proxy.attribution import Enricher
        from proxy.karta.engine import Engine

        self.settings = settings
        self.metrics = ProxyMetrics()
        self.index = PodIndex(tombstone_seconds=settings.karta.tombstone_seconds)
        self.metrics.watch_index(self.index)
        self.engine = Engine(
            builtins=settings.karta.builtins, max_owner_hops=settings.karta.max_owner_hops
        )
        self.enricher = Enricher(
            self.index,
            [(ns, pod) for ns, pod in settings.enrich.pod_label_pairs],
            conflict_policy=settings.enrich.conflict_policy,
            pod_label_rules=settings.enrich.pod_label_rules,
        )
        self.upstream = Upstream(settings.upstream, self.metrics)
        self.handler = RemoteWriteHandler(
            settings.server, self.index, self.enricher, self.upstream, self.metrics
        )
        self.source: Service | None = None
        self.source_name = ""
        self.facts: Service | None = None
        #: whether this process writes fact series (facts.enabled, unless node mode)
        self.writes_facts = self._decide_fact_writing()
        self._elector: Any = None
        #: where the fact writer's Lease is (resolved at start when election is on)
        self.lease_namespace = ""
        self._elector_task: asyncio.Task[None] | None = None
        self._kube_client: Any = None
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._expire_task: asyncio.Task[None] | None = None

    # -- parts ----------------------------------------------------------------------------

    def _load_description_files(self) -> None:
        paths = self.settings.karta.description_paths
        if not paths:
            return
        from proxy.karta.description import load_description_paths

        descs, errors = load_description_paths(paths)
        for err in errors:
            log.error("invalid Karta description skipped", extra={"error": str(err)})
        self.index.apply(self.engine.add_descriptions(descs))
        log.info("descriptions loaded from files",
                 extra={"descriptions": len(descs), "errors": len(errors)})

    def _make_source(self) -> Service:
        s = self.settings
        if s.snapshot:
            from proxy.snapshot import SnapshotSource

            self.source_name = f"snapshot {s.snapshot}"
            return SnapshotSource(s.snapshot, self.engine, self.index,
                                  reload_seconds=s.snapshot_reload_seconds or None)
        from proxy.kube.source import KubeSource

        self.source_name = "kubernetes" + (f" (node {s.kube.node_name})" if s.kube.node_name
                                           else "")
        kube_registry = CollectorRegistry()
        self.metrics.registry.register(RegistryView(kube_registry, SHARED_INDEX_FAMILIES))
        return KubeSource(s.kube, self.engine, self.index, metrics_registry=kube_registry)

    def _decide_fact_writing(self) -> bool:
        """Fact series describe the whole cluster; a node-mode replica sees one node's pods,
        so its observed-pod counts and pod facts would be partial (and every replica of the
        DaemonSet would write the same series). Off there unless explicitly allowed."""
        s = self.settings
        if not s.facts.enabled:
            return False
        if s.kube.node_name and not s.snapshot and not s.facts.allow_in_node_mode:
            log.info("fact series not written in node mode: this replica sees only node %s's "
                     "pods, so its facts would be partial; run one cluster-mode replica for "
                     "facts, or set facts.allow_in_node_mode", s.kube.node_name,
                     extra={"node_name": s.kube.node_name})
            return False
        return True

    def _make_facts(self) -> Service | None:
        from proxy.facts import FactsCollector, FactWriter, FactWriterCollector

        self.metrics.registry.register(
            FactsCollector(self.index, pod_facts=self.settings.facts.metrics_pod_facts))
        if not self.writes_facts:
            return None
        writer = FactWriter(self.settings.facts, self.index, self.upstream.send_v1,
                            elector=self._elector)
        self.metrics.registry.register(FactWriterCollector(writer))
        return writer

    async def _start_elector(self) -> None:
        """One fact writer among replicas: a Lease, through the same cluster connection."""
        f = self.settings.facts
        if not (self.writes_facts and f.leader_election):
            return
        from proxy.kube.client import KubeClient, default_namespace
        from proxy.lease import LeaseElector

        self.lease_namespace = f.lease_namespace or default_namespace()
        log.info("fact writer election", extra={
            "lease": f"{self.lease_namespace}/{f.lease_name}",
            "namespace_from": "setting" if f.lease_namespace else "own namespace"})
        self._kube_client = await KubeClient.connect(self.settings.kube)
        self._elector = LeaseElector(self._kube_client.api, self.lease_namespace, f.lease_name,
                                     f.identity, f.lease_duration_seconds)
        self._elector_task = asyncio.create_task(self._elector.run(), name="fact-lease")

    async def _stop_elector(self) -> None:
        if self._elector is not None:
            await self._elector.stop()
        if self._elector_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._elector_task
        if self._kube_client is not None:
            await self._kube_client.close()

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        log.info("starting karta-proxy", extra={
            "version": __version__, "contract_version": CONTRACT_VERSION,
            "upstream_url": s.upstream.url, "listen_address": s.server.listen_address,
            "splice": self.enricher.implementation, "worker_threads": self.handler.workers,
        })
        warn_if_python()
        await self.upstream.start(check=True)
        self._load_description_files()
        self.source = self._make_source()
        await self._start_elector()
        self.facts = self._make_facts()
        app = build_app(self.handler, self.index, self.metrics,
                        upstream_url=s.upstream.url, source=self.source_name)
        host, port = parse_host_port(s.server.listen_address)
        self._runner, self.port = await start_site(app, host, port)
        await self.source.start()
        if self.facts is not None:
            await self.facts.start()
        self._expire_task = asyncio.create_task(self._expire_loop())
        log.info("karta-proxy started", extra={
            "port": self.port, "source": self.source_name, "pods": len(self.index),
            "ready": self.index.ready,
        })

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_SECONDS)
            try:
                self.index.expire()
            except Exception:  # never let housekeeping end the process
                log.exception("tombstone expiry failed")

    async def stop(self) -> None:
        """Stop taking requests, finish those in flight, then stop the sources."""
        log.info("stopping karta-proxy")
        if self._expire_task is not None:
            self._expire_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expire_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for part in (self.facts, self.source):
            if part is not None:
                try:
                    await part.stop()
                except Exception:
                    log.exception("error while stopping", extra={"part": type(part).__name__})
        await self._stop_elector()
        await self.upstream.close()
        await asyncio.to_thread(self.handler.close)
        log.info("karta-proxy stopped")


async def serve(settings: Settings, *, ready: asyncio.Event | None = None) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    proxy = Proxy(settings)
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
        log.error("cannot start", extra={"error": f"{type(error).__name__}: {error}"})
        await _quietly(proxy.stop())
        return 1
    if ready is not None:
        ready.set()
    await stopping
    await proxy.stop()
    return 0


async def _quietly(aw: Any) -> None:
    with contextlib.suppress(Exception):
        await aw
