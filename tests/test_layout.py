"""The layout shows the data path: the import graph of ``proxy`` has no cycles, and the
Karta engine and the wire layer stay free of the layers above them; docs/architecture.md's
module map names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "proxy"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports (module level and function level alike)."""
    files = {_module_name(p): p for p in PKG.rglob("*.py") if "pb" not in p.parts}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name in files and name != mod and name != "proxy":
                    graph[mod].add(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles() -> None:
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()) or [])


#: leaves (importing nothing of the project) that the engine and the wire layer share
SHARED_LEAVES = frozenset({"proxy.shared_values", "proxy.shown"})


def test_shared_leaves_are_leaves() -> None:
    """How a refusal shows bytes (``proxy.shown``) and the tables of shared values
    (``proxy.shared_values``) are one piece of code each for the wire layer, the index
    and the engine: leaves, or sharing them would tie those to what they import."""
    graph = import_graph()
    for mod in SHARED_LEAVES:
        assert graph[mod] == set(), (mod, graph[mod])


def test_engine_imports_nothing_of_the_rest() -> None:
    for mod, deps in import_graph().items():
        if mod.startswith("proxy.karta"):
            outside = {d for d in deps if not d.startswith("proxy.karta")} - SHARED_LEAVES
            assert not outside, (mod, outside)


def test_wire_layer_stays_below_enrichment() -> None:
    graph = import_graph()
    wire = {m for m in graph if m.startswith("proxy.wire")}
    assert {"proxy.wire.primitives", "proxy.wire.splice_v1", "proxy.wire.splice_v2",
            "proxy.wire.convert", "proxy.wire.native"} <= wire
    for mod in (*wire, "proxy.compression"):
        outside = {d for d in graph[mod] if d not in wire and d != "proxy.compression"
                   and d not in SHARED_LEAVES}
        assert not outside, (mod, outside)


def test_fact_layers_model_below_encoder_and_collectors_below_writer() -> None:
    """The fact model knows neither the encoder, the collectors nor the writer; the
    encoder and the collectors build on the model only; the writer on all three."""
    graph = import_graph()
    facts = {m for m in graph if m.startswith("proxy.facts.")}
    assert facts == {"proxy.facts.model", "proxy.facts.encoder", "proxy.facts.writer",
                     "proxy.facts.collectors"}
    below = {
        "proxy.facts.model": set(),
        "proxy.facts.encoder": {"proxy.facts.model"},
        "proxy.facts.collectors": {"proxy.facts.model"},
        "proxy.facts.writer": {"proxy.facts.model", "proxy.facts.encoder",
                               "proxy.facts.collectors"},
    }
    for mod, allowed in below.items():
        inside = {d for d in graph[mod] if d.startswith("proxy.facts")}
        assert inside <= allowed, (mod, inside - allowed)
        assert "proxy.facts" not in graph[mod], mod  # never through the re-exports


def test_tls_files_is_a_leaf() -> None:
    """The TLS builders and file stamps import nothing of the project: the settings'
    validation, the listener's TLS (which imports the settings) and the upstream's all
    build on them, and any project import there would close a cycle."""
    graph = import_graph()
    assert graph["proxy.tls_files"] == set()
    assert graph["proxy.upstream_tls"] <= {"proxy.config", "proxy.tls_files"}


def test_the_object_file_reader_stays_below_the_snapshot_source() -> None:
    """Reading files of Kubernetes objects needs the engine's pure parts only (and the
    collector pause of proxy.memory): the snapshot source and the demo exporter build on
    it, never the other way round."""
    graph = import_graph()
    outside = {d for d in graph["proxy.object_files"]
               if not d.startswith("proxy.karta") and d != "proxy.memory"}
    assert not outside, outside
    assert "proxy.object_files" in graph["proxy.snapshot"]


def test_the_demo_cluster_model_stays_below_its_exporter() -> None:
    """The cluster model and its pages build on the exposition writer only; reading
    objects, serving and the command line are the exporter's."""
    graph = import_graph()
    assert graph["proxy.demo_cluster"] <= {"proxy.exposition"}, graph["proxy.demo_cluster"]
    assert "proxy.demo_cluster" in graph["proxy.demo_exporter"]


def test_the_byte_budget_knows_no_request() -> None:
    """``proxy.budget`` counts bytes only: the handler (and, through ``Charge``, the
    forwarding) build on it, it on none of them, nor on what a refusal answers."""
    assert import_graph()["proxy.budget"] == set()


def test_enrichment_sits_on_the_wire_and_the_index_and_its_oracle_is_for_tests() -> None:
    """Enrichment builds on the wire layer, the index, the settings and the contract
    only; the protobuf-class oracle (``enrichment_reference``) builds on enrichment, and
    no module of the proxy imports it: the tests and benchmarks do."""
    graph = import_graph()
    allowed = {"proxy.index", "proxy.config", "proxy.contract"}
    outside = {d for d in graph["proxy.enrichment"]
               if d not in allowed and not d.startswith("proxy.wire")}
    assert not outside, outside
    assert "proxy.enrichment" in graph["proxy.enrichment_reference"]
    importers = {m for m, deps in graph.items() if "proxy.enrichment_reference" in deps}
    assert not importers, importers


def test_engine_parts_stay_below_the_engine() -> None:
    """The engine's parts know neither the engine nor each other beyond this table: the
    engine builds on them, and a source slims its pods without importing the engine."""
    graph = import_graph()
    below = {
        "proxy.karta.slim": {"proxy.karta.owners"},
        "proxy.karta.plans": {"proxy.karta.jqexpr", "proxy.karta.model", "proxy.karta.owners",
                              "proxy.karta.packed", "proxy.karta.results"},
        "proxy.karta.replicas": {"proxy.karta.jqexpr", "proxy.karta.model", "proxy.karta.packed",
                                 "proxy.karta.plans", "proxy.karta.results",
                                 "proxy.karta.status"},
    }
    for mod, allowed in below.items():
        inside = {d for d in graph[mod] if d.startswith("proxy.karta")}
        assert inside <= allowed, (mod, inside - allowed)
    assert set(below) <= graph["proxy.karta.engine"]


def test_every_module_has_a_row_in_the_module_map() -> None:
    """docs/architecture.md's module map is where a reader looks a module up: a module
    added without a row (six were: cpus, fd_limit, memory_limit, shown, kube/owner_fetch,
    wire/_convert.c) is missing from it, and a row whose module went is a dead end."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(proxy/[\w/.]+)` \|", doc, re.M))
    folders = {r for r in rows if r.endswith("/")}
    modules = {
        p.relative_to(PKG.parent).as_posix()
        for p in [*PKG.rglob("*.py"), *PKG.rglob("*.c")]
        if p.name not in ("__init__.py", "__main__.py")
    }
    unlisted = sorted(m for m in modules
                      if m not in rows and not any(m.startswith(f) for f in folders))
    assert not unlisted, f"modules without a row in docs/architecture.md: {unlisted}"
    gone = sorted(r for r in rows if not (PKG.parent / r).exists())
    assert not gone, f"docs/architecture.md rows of modules that do not exist: {gone}"
