"""The aiohttp application: remote-write routes, ``/metrics``, health, readiness, landing page.

aiohttp would decompress request bodies itself (and fail on zstd); the runner is built
with ``auto_decompress=False`` so the handler sees the raw bytes and applies its limits.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Awaitable, Callable, Container, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy import __version__, exposition
from proxy.attribution_page import Explainer, add_routes, pods_text
from proxy.config import join_host_port
from proxy.connection_guard import LINGER_SECONDS, SERVER_HEADER, ConnectionLimit, GuardedRunner
from proxy.contract import CONTRACT_VERSION, FACT_BUILD_INFO, FACT_CONTRACT_INFO, FACT_SERIES
from proxy.handler import TENANT_WRITE_PATHS, WRITE_PATHS, RemoteWriteHandler
from proxy.index import PodIndex
from proxy.metrics import ProxyMetrics
from proxy.reload import ReloadOutcome
from proxy.tls_handshake import ContextSource, Refusals, TLSConnections, TLSSite
from proxy.wire.native import DEFAULT as SPLICE
from proxy.yielding import Pacer

log = logging.getLogger("karta.server")

#: the fact families ``/metrics?facts=false`` leaves out: every fact but the two that are
#: one series per replica (its own build and contract), which only a scrape shows
SCRAPED_FACTS = frozenset(FACT_SERIES) - {FACT_BUILD_INFO, FACT_CONTRACT_INFO}

#: the app's remote-write handler, for ``start_site`` (its header deadline and counter)
REMOTE_WRITE = web.AppKey("remote_write", RemoteWriteHandler)
#: a ``/metrics`` page waits for the requests being relayed (``proxy.yielding``) for at
#: most this share of the scraper's timeout (Prometheus sends it in
#: ``X-Prometheus-Scrape-Timeout-Seconds``), so that it still ends in time ...
PAGE_DEFER_SHARE = 0.25
#: ... or this long when the scraper does not say (a quarter of Prometheus' default 10 s)
PAGE_DEFER_SECONDS = 2.5
#: the whole stop, from SIGTERM to the exit, as docs/operations.md ("Shutdown") promises;
#: the shipped manifests' terminationGracePeriodSeconds (30) must stay well past it, or
#: the kubelet's SIGKILL cuts the stop short (tests/test_manifests.py)
STOP_SECONDS = 10.0
#: at stop, the time requests in flight get to finish before they are ended (their
#: connections closed), and the time the fact writer's stale markers and lease release get,
#: beside them: with ``CANCEL_GRACE_SECONDS`` and the rest of the stop (closing the
#: sources and connections), the process exits within ``STOP_SECONDS``
DRAIN_SECONDS = 9.0


def page_defer_budget(headers: Mapping[str, str]) -> float:
    """How long one ``/metrics`` page may wait for requests in all."""
    try:
        timeout = float(headers.get("X-Prometheus-Scrape-Timeout-Seconds", ""))
    except ValueError:
        return PAGE_DEFER_SECONDS
    return PAGE_DEFER_SHARE * timeout if 0 < timeout < float("inf") else PAGE_DEFER_SECONDS


def build_app(
    handler: RemoteWriteHandler,
    index: PodIndex,
    metrics: ProxyMetrics,
    *,
    upstream_url: str = "",
    source: str = "",
    reload: Callable[[], Awaitable[ReloadOutcome]] | None = None,
    lifecycle: bool = True,
    explain: Explainer | None = None,
    descriptions: Callable[[], str] | None = None,
) -> web.Application:
    """Routes of the proxy. ``source`` names where the index comes from (landing page);
    ``reload`` serves ``POST /-/reload`` (absent: no such route), when ``lifecycle``
    allows it (else 403, as Prometheus without ``--web.enable-lifecycle``); ``explain``
    gives the attribution page its owner chains (absent: the page shows the index's
    answers only); ``descriptions`` says on the landing page which descriptions are in
    force and how many were not taken (absent: no such row)."""
    app = web.Application()
    app[REMOTE_WRITE] = handler
    app.on_response_prepare.append(_server_header)
    pages = _Pages(handler, index, metrics, upstream_url, source, descriptions)
    if reload is not None:
        reload_view = _reload_view(reload) if lifecycle else _lifecycle_disabled
        app.router.add_post("/-/reload", reload_view)
        app.router.add_put("/-/reload", reload_view)
    for path in (*WRITE_PATHS, *TENANT_WRITE_PATHS):
        app.router.add_route("*", path, handler.handle, expect_handler=handler.expect)
    app.router.add_get("/metrics", pages.metrics_view)
    app.router.add_get("/-/healthy", _healthy)
    app.router.add_get("/-/ready", pages.ready)
    app.router.add_get("/", pages.landing)
    add_routes(app, index, explain)
    return app


async def _server_header(_: web.Request, response: web.StreamResponse) -> None:
    """Every answer a route makes names the product (``SERVER_HEADER``)."""
    response.headers["Server"] = SERVER_HEADER


async def _healthy(_: web.Request) -> web.Response:
    return web.Response(text="OK\n")


def _reload_view(
    reload: Callable[[], Awaitable[ReloadOutcome]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def reload_view(_: web.Request) -> web.Response:
        # as Prometheus' /-/reload: 200 once applied, 500 with the reason when the new
        # configuration was refused (the old one stays)
        outcome = await reload()
        if not outcome.ok:
            return web.Response(status=500, text=f"reload failed: {outcome.error}\n")
        text = "configuration reloaded\n"
        if outcome.restart_required:
            text += ("changed, applied at the next restart: "
                     f"{', '.join(outcome.restart_required)}\n")
        if outcome.kept_empty_files:
            text += ("description files found empty, their previous descriptions kept: "
                     f"{', '.join(outcome.kept_empty_files)}\n")
        return web.Response(text=text)

    return reload_view


#: the answer to POST /-/reload with server.enable_lifecycle off
LIFECYCLE_DISABLED = ("the lifecycle API is not enabled: POST /-/reload is served with "
                      "server.enable_lifecycle: true (--web.enable-lifecycle); SIGHUP "
                      "reloads either way\n")


async def _lifecycle_disabled(_: web.Request) -> web.Response:
    # Prometheus answers 403 too: the endpoint exists, the operator has not allowed it
    return web.Response(status=403, text=LIFECYCLE_DISABLED)


@dataclass(frozen=True)
class _Pages:
    """The views that read the proxy's live state (index, upstream, registry): one object
    so that each view is a small named method rather than a closure inside build_app."""

    handler: RemoteWriteHandler
    index: PodIndex
    metrics: ProxyMetrics
    upstream_url: str
    source: str
    #: the landing page's row on the descriptions in force and not taken
    descriptions: Callable[[], str] | None = None

    async def metrics_view(self, request: web.Request) -> web.StreamResponse:
        # Streamed a chunk at a time (proxy.exposition): the fact families are ~41 MB of
        # text at 37.5k pods, ~1.1 s of Python. Between chunks the page gives way to the
        # requests being relayed (proxy.yielding): with one turn of the loop there,
        # requests relayed during a scrape took 100-420 ms instead of ~5.
        # ``name[]=...`` (repeated) keeps only the series so named, as prometheus_client's
        # own handler does: a scrape of the operational series alone skips rendering the
        # fact families (exposition.restricted)
        names: Container[str] | None = frozenset(request.query.getall("name[]", ())) or None
        # ``facts=false``: the operational series only. Where the facts are remote-written
        # (the default), a scrape drops its copy of them anyway (the ServiceMonitor's
        # drop), and at 37.5k pods each replica rendered ~42 MB a scrape to keep 86 series
        facts = request.query.get("facts", "true").lower()
        if facts not in ("true", "false"):
            return web.Response(status=400, text=f"facts must be true or false, not {facts!r}\n")
        if facts == "false":
            names = exposition.AllBut(SCRAPED_FACTS, names)
        resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE_LATEST})
        pacer = Pacer(self.handler.relaying, page_defer_budget(request.headers))
        try:
            # the headers too: a scraper gone before them (its timeout while the loop was
            # held) logged an error with a traceback per scraper, a flood anyone could make
            await resp.prepare(request)
            for chunk in exposition.chunks(self.metrics.registry, names):
                if chunk:
                    await resp.write(chunk)
                await pacer.pause()
            await resp.write_eof()
        except ConnectionResetError:  # the scraper went away (its timeout): nothing to answer
            log.debug("/metrics scraper left before the page's end")
        return resp

    async def ready(self, _: web.Request) -> web.Response:
        # Readiness answers "will a remote write sent here be accepted?", because that is
        # what a Service routes on. A stale index (API server unreachable) still enriches
        # with the last known state, so it stays ready; before the first load it is ready
        # only when forward_before_ready says to forward unenriched meanwhile (otherwise
        # the Service would never send the traffic that setting is for).
        index = self.index
        if index.ready:
            if index.stale:
                return web.Response(text="ready (index stale: serving the last known state)\n")
            return web.Response(text="ready\n")
        if self.handler.settings.forward_before_ready:
            return web.Response(text="ready (index not loaded yet: forwarding unenriched)\n")
        return web.Response(status=503, text="index not ready\n")

    def _status_rows(self) -> list[tuple[str, str]]:
        index, upstream = self.index, self.handler.upstream
        return [
            ("version", __version__),
            ("contract version", CONTRACT_VERSION),
            ("upstream", self.upstream_url),
            *([("upstream proxy", upstream.egress.describe())]
              if upstream.egress is not None else []),
            ("index source", self.source),
            ("index ready", "yes" if index.ready else "no"),
            ("index stale", "yes" if index.stale else "no"),
            ("pods in index", pods_text(index)),
            ("workloads", str(len(index.workloads))),
            ("upstream protocol", "RW 1.0 only" if upstream.v1_only else "as received"),
            ("upstream check", upstream.probe.outcome
             if upstream.probe is not None else "pending"),
            ("splice", f"{SPLICE} ({self.handler.workers} worker threads)"),
            *([("descriptions", self.descriptions())] if self.descriptions is not None
              else []),
        ]

    async def landing(self, _: web.Request) -> web.Response:
        table = "\n".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
            for k, v in self._status_rows()
        )
        paths = ", ".join(f"<code>{p}</code>" for p in WRITE_PATHS)
        page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>karta-proxy</title></head>
<body>
<h1>karta-proxy</h1>
<p>Prometheus remote-write proxy stamping Karta workload attribution. Send remote write
(POST) to {paths}.</p>
<table>
{table}
</table>
<ul>
<li><a href="/attribution">/attribution</a>: why a pod has its workload labels, or none</li>
<li><a href="/metrics">/metrics</a></li>
<li><a href="/-/healthy">/-/healthy</a></li>
<li><a href="/-/ready">/-/ready</a></li>
</ul>
</body></html>
"""
        return web.Response(text=page, content_type="text/html")


async def start_site(
    app: web.Application, host: str, port: int, *, ssl_context: ContextSource | None = None,
    refusals: Refusals | None = None, connections: TLSConnections | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` (HTTPS with ``ssl_context``, its failed handshakes told to
    ``refusals``, its open connections listed in ``connections``); returns the runner and
    the bound port (port 0 picks a free one).
    ``ssl_context`` may be a callable giving the current context, asked per connection
    (a rotated certificate is a new context: proxy/tls.py)."""
    handler = app[REMOTE_WRITE]
    settings = handler.settings
    limit = ConnectionLimit(settings.max_connections, handler.connection_refused,
                            handler.idle_connection_closed)
    handler.metrics.open_connections.set_function(lambda: limit.open)
    runner = GuardedRunner(
        app, header_timeout=settings.header_read_timeout_seconds,
        on_timeout=handler.header_timed_out, shed=handler.shed,
        on_bad_http=handler.bad_http, limit=limit,
        max_header_bytes=settings.max_header_bytes,
        on_header_too_large=handler.header_too_large, on_ended=handler.ended_at_stop,
        send_timeout=settings.send_timeout_seconds, on_send_timeout=handler.send_timed_out,
        # aiohttp's default is an hour: an idle connection held a place in max_connections
        # that long (16 idle keep-alive clients locked a 16-connection proxy)
        keepalive_timeout=settings.keepalive_timeout_seconds,
        auto_decompress=False,
        access_log=None, handle_signals=False, shutdown_timeout=DRAIN_SECONDS,
        lingering_time=LINGER_SECONDS)
    await runner.setup()
    site: web.BaseSite
    if ssl_context is None:
        site = web.TCPSite(runner, host, port, reuse_address=True)
    else:
        # the handshake is a client's first bytes, as a request line would be: the same
        # deadline (asyncio's own is 60 s, long enough for an idle client to hold a slot)
        site = TLSSite(runner, host, port, ssl_context=ssl_context, reuse_address=True,
                       refusals=refusals if refusals is not None else Refusals(),
                       handshake_timeout=settings.header_read_timeout_seconds,
                       connections=connections)
    await site.start()
    # the runner's public view of its sockets: (host, port, ...) per bound address (two
    # for every interface: 0.0.0.0 and ::)
    sockets = [a for a in runner.addresses if isinstance(a, tuple)]
    bound = sockets[0][1] if sockets else port
    log.info("listening", extra={
        "host": host, "port": bound, "scheme": "https" if ssl_context is not None else "http",
        "addresses": ", ".join(join_host_port(a[0], a[1]) for a in sockets)})
    return runner, bound
