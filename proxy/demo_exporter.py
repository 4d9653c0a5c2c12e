"""The demo exporter: the kubelet (cAdvisor, /metrics/resource) and DCGM text of a snapshot.

It lives in the package, not in ``tests/``, because the docker-compose demo and the README's
no-cluster walkthrough run it (``python -m proxy.demo_exporter --serve HOST:PORT``) to give
a Prometheus agent something cluster-like to scrape. Real-peer tests point a real
Prometheus agent (or vmagent) at it, so the series that reach karta-proxy look like a
cluster's. The figures and the text of each page are the cluster model's
(:mod:`proxy.demo_cluster`); this module reads the objects, serves the pages and records
the demo's batch.

Routes (``?node=NAME`` limits any of them to one node, as a per-node target would):

- ``/metrics/cadvisor``: ``container_cpu_usage_seconds_total``,
  ``container_memory_working_set_bytes`` with container/pod/namespace/id/image/name;
- ``/metrics/resource``: ``container_*`` and ``pod_cpu_usage_seconds_total``,
  ``pod_memory_working_set_bytes``, ``node_*``, all with explicit millisecond timestamps;
- ``/metrics``: DCGM ``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``,
  ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``, ``DCGM_FI_DEV_POWER_USAGE`` and the counter
  ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` with gpu/UUID/modelName/Hostname and the GPU's
  ``pod``/``namespace``/``container``, exactly as dcgm-exporter serves them. Scrape it with
  target labels ``namespace``/``pod`` (the exporter pod's) and ``honor_labels: false`` to
  get the ``exported_*`` labels Prometheus produces in a cluster.

Counters advance in real time (the exporter's clock). ``ClusterModel`` exposes the
expected figures so tests can check PromQL sums per workload.

Use::

    from proxy.demo_exporter import FixtureExporter

    async with FixtureExporter(snapshot_path_or_objects) as exp:
        exp.url            # "http://127.0.0.1:PORT"
        exp.model          # ClusterModel: pods, gpus, expected rates

``python -m proxy.demo_exporter --serve 0.0.0.0:9400`` serves the demo snapshot's metrics
(the docker-compose stack and the README's walkthrough run it); ``--demo-series`` regenerates
``proxy/demo_data/series.prom`` (the demo's recorded batch) from the demo snapshot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.aux_server import AuxServer
from proxy.config import ConfigError, join_host_port, parse_host_port
from proxy.demo import BUNDLED_SERIES, BUNDLED_SNAPSHOT
from proxy.demo_cluster import GPU_RESOURCE, ClusterModel
from proxy.object_files import ObjectStub, SkippedFile, SnapshotError, read_file, snapshot_files

# -- the HTTP exporter ----------------------------------------------------------------------


def load_objects(source: str | Path | Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The objects of a snapshot path (a file or folder), or of an iterable of dicts.

    A path is read as the snapshot source reads it (:mod:`proxy.object_files`: typed
    lists' items given their kind, aliases and keys given twice refused, timestamps the
    API's strings, uids derived where missing), pods whole: the model reads their
    containers' resources, which the source's slimmed pods leave out. What the reader
    sets aside (a file, an object) raises ``SnapshotError``: the exporter has no report to
    show it in, and metrics served without it would silently disagree with the file."""
    if not isinstance(source, str | Path):
        return list(source)
    files, skipped = snapshot_files(source)
    problems = [str(s) for s in skipped]
    out: list[Mapping[str, Any]] = []
    for f in files:
        got = read_file(f, slim_pods=False)
        if isinstance(got, SkippedFile):
            problems.append(str(got))
            continue
        problems.extend(got.invalid)
        # read unpacked, every object is a parsed one (ObjectStubs are a source's)
        out.extend(o for o in got.objects if not isinstance(o, ObjectStub))
    if problems:
        raise SnapshotError(f"snapshot {source}: " + "; ".join(problems))
    return out


class FixtureExporter(AuxServer):
    """The aiohttp exporter; ``async with`` or ``start()`` / ``stop()``."""

    def __init__(
        self,
        source: str | Path | Iterable[Mapping[str, Any]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.model = ClusterModel.from_objects(load_objects(source), t0=clock())
        self._host = host
        self._port = port
        self.url = ""
        #: scrapes served per route, for tests that wait for a scrape
        self.scrapes: dict[str, int] = {"cadvisor": 0, "resource": 0, "dcgm": 0}

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics/cadvisor", self._cadvisor)
        app.router.add_get("/metrics/resource", self._resource)
        app.router.add_get("/metrics", self._dcgm)
        port = await self.serve(app, self._host, self._port)
        self.url = f"http://{join_host_port(self._host, port)}"
        return self.url

    def _text(self, body: str) -> web.Response:
        return web.Response(
            text=body,
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def _cadvisor(self, request: web.Request) -> web.Response:
        self.scrapes["cadvisor"] += 1
        return self._text(self.model.cadvisor_text(self._clock(), node=request.query.get("node")))

    async def _resource(self, request: web.Request) -> web.Response:
        self.scrapes["resource"] += 1
        return self._text(self.model.resource_text(self._clock(), node=request.query.get("node")))

    async def _dcgm(self, request: web.Request) -> web.Response:
        self.scrapes["dcgm"] += 1
        return self._text(
            self.model.dcgm_text(node=request.query.get("node"), now=self._clock())
        )


# -- the demo's recorded batch --------------------------------------------------------------

DEMO_SNAPSHOT = BUNDLED_SNAPSHOT
DEMO_SERIES = BUNDLED_SERIES
#: a GPU pod that is gone from the snapshot (its series are left unattributed: pod_unknown)
DEMO_GONE_POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "notebook-5f7c9-zx2lq",
        "namespace": "research",
        "uid": "88c68018-e04f-5f41-b650-6db6e8cc6491",
    },
    "spec": {
        "nodeName": "gpu-node-2",
        "containers": [
            {
                "name": "notebook",
                "image": "jupyter/pytorch-notebook:2024-10-21",
                "resources": {
                    "requests": {"cpu": "1", "memory": "8Gi", GPU_RESOURCE: "1"},
                    "limits": {"memory": "8Gi", GPU_RESOURCE: "1"},
                },
            }
        ],
    },
}
DEMO_T0 = 1_730_016_000.0  # 2024-10-27T08:00:00Z
DEMO_SCRAPES = (DEMO_T0 + 3600.0, DEMO_T0 + 3615.0)
_DCGM_IPS = {"gpu-node-1": "10.42.1.17", "gpu-node-2": "10.42.2.23"}


def demo_series_text(objects: Sequence[Mapping[str, Any]]) -> str:
    """Two scrapes, 15 s apart, of every target, as a Prometheus agent remote-writes them."""
    model = ClusterModel.from_objects([*objects, DEMO_GONE_POD], t0=DEMO_T0)
    exporters = {
        p.node: p.name
        for p in model.pods
        if p.namespace == "gpu-monitoring" and p.name.startswith("dcgm-exporter")
    }

    def dcgm_target(node: str) -> dict[str, str]:
        return {
            "container": "dcgm-exporter",
            "endpoint": "gpu-metrics",
            "instance": f"{_DCGM_IPS.get(node, '10.42.0.1')}:9400",
            "job": "dcgm-exporter",
            "namespace": "gpu-monitoring",
            "pod": exporters.get(node, "dcgm-exporter"),
            "service": "dcgm-exporter",
        }

    blocks: list[str] = []
    header = (
        "# A recorded batch: two scrapes, 15 s apart, of the kubelets (/metrics/cadvisor and\n"
        "# /metrics/resource) and the dcgm-exporters of the demo cluster, as a Prometheus agent\n"
        "# remote-writes them: target labels added, DCGM's own pod labels renamed exported_*\n"
        "# (honor_labels: false), every sample with its scrape time. Series of the pod\n"
        "# research/notebook-5f7c9-zx2lq, gone from the snapshot, stay unattributed.\n"
        "# Generated by `python -m proxy.demo_exporter --demo-series`.\n"
    )
    for section in ("cadvisor", "resource", "dcgm"):
        for node in model.nodes:
            for at in DEMO_SCRAPES:
                if section == "dcgm":
                    if not any(g.node == node for g in model.gpus):
                        continue
                    text = model.dcgm_text(at, node=node, target=dcgm_target)
                else:
                    extra = (
                        f'instance="{node}",job="kubelet",'
                        f'metrics_path="/metrics/{section}",node="{node}"'
                    )
                    fn = model.cadvisor_text if section == "cadvisor" else model.resource_text
                    text = fn(at, node=node, extra=extra)
                blocks.append(text)
    return header + merge_families(blocks)


def merge_families(texts: Iterable[str]) -> str:
    """Concatenate exposition texts with one HELP/TYPE block per family, samples in order."""
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    current = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                meta.setdefault(current, [])
                if len(meta[current]) < 2 and line not in meta[current]:
                    meta[current].append(line)
                samples.setdefault(current, [])
            elif line and not line.startswith("#"):
                samples.setdefault(current, []).append(line)
    return "".join(
        "\n".join([*meta.get(name, []), *lines]) + "\n" for name, lines in samples.items()
    )


async def _serve(source: str, address: str) -> None:
    host, port = parse_host_port(address, "--serve")  # [::1]:9400 too
    exp = FixtureExporter(source, host=host or "127.0.0.1", port=port)
    await exp.start()
    print(
        f"fixture exporter on {exp.url} ({len(exp.model.pods)} pods, {len(exp.model.gpus)} GPUs)",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await exp.stop()


def build_parser() -> argparse.ArgumentParser:
    """The command line, apart from ``main`` so the compose test can parse compose's words."""
    ap = argparse.ArgumentParser(
        prog="python -m proxy.demo_exporter",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    ap.add_argument("--demo-series", action="store_true", help=f"rewrite {DEMO_SERIES}")
    ap.add_argument(
        "--serve",
        metavar="HOST:PORT",
        help="serve the routes until interrupted (the docker-compose demo uses it)",
    )
    ap.add_argument(
        "--snapshot",
        metavar="PATH",
        default=str(DEMO_SNAPSHOT),
        help="objects to serve metrics for (default: the demo snapshot)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.demo_series:
        DEMO_SERIES.write_text(demo_series_text(load_objects(DEMO_SNAPSHOT)))
        print(f"wrote {DEMO_SERIES}")
    if args.serve:
        try:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_serve(args.snapshot, args.serve))
        except ConfigError as e:  # --serve not HOST:PORT
            print(f"python -m proxy.demo_exporter: error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
