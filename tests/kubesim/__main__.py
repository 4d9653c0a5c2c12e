"""The API simulator from the command line: a snapshot's objects served as a cluster's,
to try Kubernetes mode (watches, discovery, Karta objects read from the cluster) on a
machine with none. A test double, not a cluster: no controllers run, nothing changes
unless a client writes it.

    python -m tests.kubesim --kubeconfig /tmp/kubesim.kubeconfig   # the demo snapshot
    karta-proxy --kubeconfig /tmp/kubesim.kubeconfig --upstream-url ...
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from proxy.object_files import snapshot_files
from tests.kubesim.resources import CORE_TYPES, CRD_TYPES, NAMESPACE, ResourceType
from tests.kubesim.server import KubeSim
from tests.kubesim.store import ApiError

DEMO_SNAPSHOT = Path(__file__).resolve().parents[2] / "proxy" / "demo_data" / "snapshot.yaml"
NODE = ResourceType("", "v1", "Node", "nodes", namespaced=False, builtin=True)


def objects(path: Path) -> list[dict[str, Any]]:
    """Every object in the snapshot's files (YAML or JSON, ``kind: List`` unpacked)."""
    files, skipped = snapshot_files(path)
    for s in skipped:
        print(f"kubesim: skipped {s.path}: {s.reason}", file=sys.stderr)
    out: list[dict[str, Any]] = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if isinstance(doc, Mapping):
                items = doc.get("items") if doc.get("kind") == "List" else [doc]
                out.extend(dict(o) for o in items or () if isinstance(o, Mapping))
    return out


def kinds_to_serve(objs: Iterable[Mapping[str, Any]]) -> list[ResourceType]:
    """A resource for each kind the snapshot has that a bare cluster does not serve: as
    if its CRD were installed (the simulator's own where it has one; else the plural is
    made up: clients find it by discovery)."""
    known = {(rt.group, rt.kind) for rt in (*CORE_TYPES, NAMESPACE, NODE)}
    crds = {(rt.group, rt.kind): rt for rt in CRD_TYPES}
    extra: dict[tuple[str, str], ResourceType] = {}
    for o in objs:
        group, _, version = str(o.get("apiVersion", "")).rpartition("/")
        kind = str(o.get("kind", ""))
        if (group, kind) in crds:
            extra[(group, kind)] = crds[(group, kind)]
        elif kind and (group, kind) not in known and (group, kind) not in extra:
            namespaced = bool((o.get("metadata") or {}).get("namespace"))
            extra[(group, kind)] = ResourceType(group, version, kind, kind.lower() + "s",
                                                namespaced=namespaced)
    return list(extra.values())


async def serve(snapshot: Path, port: int, kubeconfig: Path) -> int:
    objs = objects(snapshot)
    sim = KubeSim((*CORE_TYPES, NAMESPACE, NODE, *kinds_to_serve(objs)), port=port)
    await sim.start()
    created = 0
    for o in objs:
        try:
            sim.create(o)
            created += 1
        except ApiError as e:
            print(f"kubesim: {o.get('kind')} {(o.get('metadata') or {}).get('name')}: "
                  f"not created: {e}", file=sys.stderr)
    sim.write_kubeconfig(kubeconfig)
    print(f"kubesim: {created} objects of {snapshot} served at {sim.url}; kubeconfig "
          f"{kubeconfig}; Ctrl-C stops it", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.kubesim",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot", type=Path, default=DEMO_SNAPSHOT,
                   help="a snapshot file or folder (default: the demo's)")
    p.add_argument("--port", type=int, default=0, help="on 127.0.0.1 (default: a free one)")
    p.add_argument("--kubeconfig", type=Path, required=True,
                   help="where to write a kubeconfig for it (bearer token, plain HTTP)")
    args = p.parse_args(argv)
    return asyncio.run(serve(args.snapshot, args.port, args.kubeconfig))


if __name__ == "__main__":
    sys.exit(main())
