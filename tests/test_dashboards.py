"""The Grafana dashboards in config/grafana/: dashboard JSON whose every panel query and
template-variable query evaluates in a real Prometheus 2.42.

The Prometheus receives what a Prometheus agent scraped (the fixture exporter's cAdvisor,
kubelet and DCGM series of the demo snapshot, and the proxy's own /metrics) and wrote
through karta-proxy, plus the proxy's remote-written facts, and evaluates the shipped
recording rules every second. Each query is run twice: with every template variable at
its "All" regex, and with concrete values picked through the variables' own queries. The
workload panels must return data both times; the few series that may be absent say why in
``MAY_BE_EMPTY``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy import contract
from proxy.config import Settings
from proxy.demo_exporter import FixtureExporter
from tests.peers.conftest import InProcessProxy, Peers, remote_write, scrape_configs
from tests.peers.conftest import exporter as exporter  # the shared fixtures, reused
from tests.peers.conftest import make_proxy as make_proxy
from tests.peers.conftest import peers as peers
from tests.test_rules import RULE_FILES, rule_names

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "config" / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
WORKLOADS = GRAFANA / "karta-workloads.json"
PROXY = GRAFANA / "karta-proxy.json"

#: Grafana's interval macros, as a dashboard over a 1 s scrape would resolve them
MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
#: the cluster label, as an agent's external_labels and facts.external_labels set it
CLUSTER = "demo"
#: the concrete selection: a RayJob with a GPU worker group (instances), a head and a
#: submitter, desired replicas for its worker group
CONCRETE = {"cluster": CLUSTER, "namespace": "ml", "kind": "RayJob", "workload": "llm-finetune",
            "job": "karta-proxy"}
#: series a query may find none of here, and why (the demo cluster has no such state); a
#: query reading one of them may return nothing, every other query must return data
MAY_BE_EMPTY = {
    contract.FACT_WORKLOAD_UNDEFINED_REASON_INFO: "present only while a workload's phase is "
    "Undefined for a known reason; every demo workload has a phase",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MIN: "needs a scaleDefinition.minReplicasPath (an "
    "autoscaler's bounds); no demo description has one",
    contract.FACT_COMPONENT_DESIRED_REPLICAS_MAX: "the same, maxReplicasPath",
}
#: the drop documented in docs/metrics.md for scraping /metrics beside the written facts
FACTS_DROP = "karta_(pod|workload|component|namespace|source)_.*"


# -- the dashboards as data -----------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def queries(path: Path) -> list[Query]:
    dash = load(path)
    return [Query(path.name, p["title"], t["refId"], t["expr"])
            for p in panels(dash) if p["type"] != "row" for t in p["targets"]]


def variables(path: Path) -> list[dict[str, Any]]:
    return list(load(path)["templating"]["list"])


def variable_query(var: dict[str, Any]) -> str:
    q = var["query"]
    return str(q["query"] if isinstance(q, dict) else q)


_LABEL_VALUES = re.compile(r"^label_values\((?P<sel>.+),\s*(?P<label>[a-zA-Z_]\w*)\)$", re.S)


def as_promql(grafana_query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` (Grafana's) as PromQL, and the label it lists."""
    m = _LABEL_VALUES.match(grafana_query.strip())
    assert m, f"not a label_values(selector, label) query: {grafana_query}"
    return f"group by ({m['label']}) ({m['sel']})", m["label"]


def substitute(expr: str, values: dict[str, str]) -> str:
    for macro, value in MACROS.items():
        expr = expr.replace(macro, value)
    for name in sorted(values, key=len, reverse=True):  # $kind before $k, were there one
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"a template variable or macro left unsubstituted: {expr}"
    return expr


def grafana_escape(value: str) -> str:
    """A value as Grafana puts it in a regex matcher: each regex metacharacter after a
    backslash, written twice in the PromQL string (``10\\\\.0\\\\.0\\\\.1:9091``)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


async def all_values(base: str, path: Path) -> dict[str, str]:
    """What "All" stands for, as Grafana substitutes it: a variable's ``allValue``, else
    the values its query lists (the earlier variables at "All"), as an alternation of
    regex-escaped values ("" while it lists none: the panels then read nothing)."""
    chosen: dict[str, str] = {}
    for var in variables(path)[1:]:
        if var.get("allValue") is not None:
            chosen[var["name"]] = var["allValue"]
            continue
        promql, label = as_promql(substitute(variable_query(var), chosen))
        result, error = await evaluate(base, promql)
        assert not error, (var["name"], error)
        listed = sorted(r["metric"][label] for r in result if label in r["metric"])
        chosen[var["name"]] = f"({'|'.join(map(grafana_escape, listed))})" if listed else ""
    return chosen


# -- static checks ----------------------------------------------------------------------------


def test_the_dashboards_are_there() -> None:
    assert sorted([PROXY, WORKLOADS]) == DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_json_is_importable(path: Path) -> None:
    """What Grafana needs to import the file as it is: a uid, a schema version, unique
    panel ids on a 24-column grid, every query on the datasource variable, refIds unique
    within a panel."""
    dash = load(path)
    assert dash["uid"] == path.stem and dash["title"] and dash["schemaVersion"] >= 36
    assert "id" not in dash or dash["id"] is None  # an id would clash on import
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in variables(path)]
    assert names[0] == "datasource" and variables(path)[0]["query"] == "prometheus"
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] and t["expr"].strip()
                   for t in p["targets"]), p["title"]
    for v in variables(path)[1:]:
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["includeAll"], v["name"]
        # the proxy dashboard's "All" is the proxies' jobs and instances the variable
        # found, not ".*": that read every job of the TSDB into "Targets up", CPU and
        # memory, and the remote-written karta_build_info (no job) into "Versions"; the
        # workloads' ".*" also matches facts written without a cluster label, and the
        # cluster's ".*" proxies scraped without one (job and instance still restrict)
        all_value = ".*" if path == WORKLOADS or v["name"] == "cluster" else None
        assert v.get("allValue") == all_value, v["name"]
        as_promql(variable_query(v))


def test_workload_dashboard_filters_by_the_template_variables() -> None:
    assert [v["name"] for v in variables(WORKLOADS)] == [
        "datasource", "cluster", "namespace", "kind", "workload"]
    for q in queries(WORKLOADS):
        # every workload series is selected by the identity; facts about pods and the
        # index by cluster, coverage (per namespace) by cluster and namespace; the proxy's
        # counters are not per workload
        if "karta_proxy_" in q.expr:
            continue
        assert '$cluster' in q.expr, q
        if contract.FACT_NAMESPACE_PODS in q.expr:
            assert "$namespace" in q.expr and "karta_pod_" not in q.expr, q
            continue
        if "karta_pod_" not in q.expr and "karta_source_" not in q.expr:
            for var in ("$namespace", "$kind", "$workload"):
                assert var in q.expr, (q, var)


def test_coverage_panels_read_the_coverage_fact_not_the_pod_facts() -> None:
    """Coverage from a few series per namespace, as the alerts read it; the per-pod facts
    only where the pods themselves are listed."""
    by_panel = {q.panel: q.expr for q in queries(WORKLOADS)}
    for title in ("Pods attributed", "Unattributed pods by reason",
                  "Attributed share per namespace"):
        assert contract.FACT_NAMESPACE_PODS in by_panel[title], title
    assert [p for p, e in by_panel.items() if "karta_pod_" in e] == ["Unattributed pods"]


def test_every_recording_rule_is_on_the_workload_dashboard() -> None:
    text = WORKLOADS.read_text()
    unused = [n for n in rule_names("record") if n not in text]
    assert not unused, f"recording rules no panel shows: {unused}"


def _operational_names() -> set[str]:
    doc = (ROOT / "docs" / "operations.md").read_text()
    names = set(re.findall(r"^\| `(karta_proxy_[a-z_]+)` \|", doc, re.M))
    out = set(names)
    for n in names:  # the histograms' series
        out |= {n + "_bucket", n + "_sum", n + "_count"}
    return out | set(contract.FACT_WRITER_METRICS)


def _known_series() -> set[str]:
    """The series a panel may read: recorded rules, facts, the proxy's own metrics."""
    return (set(rule_names("record")) | set(contract.FACT_SERIES) | _operational_names()
            | {"up", "process_cpu_seconds_total", "process_resident_memory_bytes",
               "process_open_fds", "process_max_fds", "python_info"})


def test_every_series_a_panel_reads_exists() -> None:
    """A misspelt name would only show as an empty panel; here it fails by name."""
    known = _known_series()
    for path in DASHBOARDS:
        exprs = [q.expr for q in queries(path)]
        exprs += [variable_query(v) for v in variables(path)[1:]]
        for expr in exprs:
            for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr):
                assert name in known, (path.name, name, expr)



_CLUSTER_FILTER = 'cluster=~"$cluster"'


def test_every_query_filters_by_cluster() -> None:
    """Several clusters in one TSDB (the audit of several clusters and tenants): a panel
    or variable query without the cluster filter sums every cluster's proxies (N fact
    writer leaders, the freshest cluster's last fact write hiding a dead one, pod IPs
    repeated across clusters merged). Every series a query reads (and every variable but
    ``cluster`` itself) is selected with ``cluster=~"$cluster"``; the variable lists the
    clusters from a series that carries the label, multi-value with "All"."""
    known = _known_series()
    for path in DASHBOARDS:
        cluster = next(v for v in variables(path) if v["name"] == "cluster")
        assert variables(path)[1]["name"] == "cluster"  # first: the others filter by it
        assert cluster["multi"] and cluster["includeAll"], path.name
        selector, label = as_promql(variable_query(cluster))
        assert label == "cluster" and "$" not in selector, (path.name, selector)
        exprs = [(q.panel, q.expr) for q in queries(path)]
        exprs += [(f"variable {v['name']}", variable_query(v))
                  for v in variables(path)[2:]]
        for where, expr in exprs:
            names = [m for m in re.finditer(r"(?<![\w:$])([a-zA-Z_:][a-zA-Z0-9_:]*)", expr)
                     if m.group(1) in known]
            assert names, (path.name, where, expr)
            for m in names:
                rest = expr[m.end():]
                body = re.match(r"\s*\{([^}]*)\}", rest)
                assert body and _CLUSTER_FILTER in body.group(1), (path.name, where, expr)


# -- against a real Prometheus ---------------------------------------------------------------


async def evaluate(base: str, promql: str) -> tuple[list[dict[str, Any]], str]:
    """Instant query: (result, error); a parse or evaluation error is returned, not raised."""
    async with aiohttp.ClientSession() as s, s.get(
        base + "/api/v1/query", params={"query": promql},
        timeout=aiohttp.ClientTimeout(total=10),
    ) as r:
        body = await r.json()
    if body.get("status") != "success":
        return [], f"{body.get('errorType')}: {body.get('error')}"
    if body.get("warnings"):
        return [], f"warnings: {body['warnings']}"
    result = body["data"]["result"]
    return (result if isinstance(result, list) else [result]), ""


async def pick_values(base: str, path: Path) -> dict[str, str]:
    """Walk the variables in order as Grafana does: each one's query with the earlier ones
    set; the concrete choice must be among the values it lists."""
    chosen: dict[str, str] = {}
    for var in variables(path)[1:]:
        promql, label = as_promql(substitute(variable_query(var), chosen))
        result, error = await evaluate(base, promql)
        assert not error, (var["name"], error)
        listed = sorted(r["metric"][label] for r in result if label in r["metric"])
        want = CONCRETE.get(var["name"])
        if want is None:  # no preference: the first listed (e.g. the proxy's instance)
            assert listed, f"variable {var['name']} lists nothing: {promql}"
            want = listed[0]
        assert want in listed, (var["name"], want, listed)
        chosen[var["name"]] = want
    return chosen


def may_be_empty(expr: str) -> bool:
    return bool(set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)) & MAY_BE_EMPTY.keys())


async def empty_or_failing(base: str, path: Path, values: dict[str, str]
                           ) -> tuple[list[str], list[str]]:
    failed, empty = [], []
    for q in queries(path):
        promql = substitute(q.expr, values)
        result, error = await evaluate(base, promql)
        if error:
            failed.append(f"{q.panel} [{q.ref}]: {error}\n    {promql}")
        elif not result and not may_be_empty(q.expr):
            empty.append(f"{q.panel} [{q.ref}]: {promql}")
    return failed, empty


async def _send_bad_requests(proxy: InProcessProxy) -> None:
    """One body that cannot be decoded and one refused media type: the refusal panels
    have something to show (and a test that they read the right counters)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.write_url, data=b"not snappy", headers={
                "Content-Type": "application/x-protobuf", "Content-Encoding": "snappy"}) as r:
            assert r.status == 400
        async with s.post(proxy.write_url, data=b"x", headers={
                "Content-Type": "text/plain", "Content-Encoding": "snappy"}) as r:
            assert r.status == 415


@pytest.mark.peers
async def test_every_panel_evaluates_in_prometheus_fed_through_the_proxy(
    peers: Peers, exporter: FixtureExporter,
    make_proxy: Callable[..., Awaitable[InProcessProxy]],
) -> None:
    started = time.monotonic()
    tsdb = await peers.prometheus_receiver(rule_files=RULE_FILES, evaluation_interval="1s")

    def facts_on(s: Settings) -> None:
        s.facts.enabled = True
        s.facts.interval_seconds = 1.0
        s.facts.external_labels = {"cluster": CLUSTER}

    proxy = await make_proxy(tsdb.base_url + "/api/v1/write", configure=facts_on)
    jobs = scrape_configs(exporter)
    jobs.append({
        "job_name": "karta-proxy", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [proxy.url.removeprefix("http://")]}],
        "metric_relabel_configs": [{"source_labels": ["__name__"], "regex": FACTS_DROP,
                                    "action": "drop"}],
    })
    agent = await peers.prometheus_agent({
        "global": {"scrape_interval": "1s", "external_labels": {"cluster": CLUSTER}},
        "scrape_configs": jobs,
        "remote_write": [remote_write(proxy.write_url)],
    })
    await _send_bad_requests(proxy)

    deadline = time.monotonic() + 45
    while True:  # until the rules have run over written series and the facts are in
        everything = {path: await all_values(tsdb.base_url, path) for path in DASHBOARDS}
        report = {p: await empty_or_failing(tsdb.base_url, p, v) for p, v in everything.items()}
        if not any(f or e for f, e in report.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    concrete = {p: await pick_values(tsdb.base_url, p) for p in DASHBOARDS}
    for p, v in concrete.items():
        failed, empty = await empty_or_failing(tsdb.base_url, p, v)
        report[p] = (report[p][0] + failed, report[p][1] + empty)
    problems = [f"{p.name}: {kind}: {line}" for p, (failed, empty) in report.items()
                for kind, lines in (("error", failed), ("no data", empty)) for line in lines]
    assert not problems, "\n".join(problems)
    assert concrete[PROXY]["instance"] == proxy.url.removeprefix("http://")
    # at "All" the proxy dashboard reads the proxies only: the agent's other jobs
    # (cadvisor, dcgm, ...) write their `up` too, which ".*" counted
    (up,), error = await evaluate(tsdb.base_url, substitute(
        'sum(up{job=~"$job", instance=~"$instance"})', everything[PROXY]))
    assert not error and float(up["value"][1]) == 1.0, (up, error)
    await _coverage_agrees_with_the_pod_facts(tsdb.base_url, proxy)
    assert time.monotonic() - started < 60
    # stopped while the proxy still answers: stopped after it (the fixtures' order), the
    # agent spent its 20 s stop bound retrying its last batch against a closed port
    await agent.astop()


async def _coverage_agrees_with_the_pod_facts(base: str, proxy: InProcessProxy) -> None:
    """What the coverage panels read, written through the proxy, is what counting the
    per-pod facts in the TSDB says (the query they replaced), namespace by namespace."""
    sel = f'cluster="{CLUSTER}"'
    coverage, error = await evaluate(
        base, f'sum by (karta_namespace, state, reason) (karta_namespace_pods{{{sel}}})')
    assert not error, error
    counted, error = await evaluate(base, f"""
        label_replace(label_replace(count by (namespace) (karta_pod_info{{{sel}}}),
          "state", "attributed", "", ""), "karta_namespace", "$1", "namespace", "(.*)")
        or label_replace(label_replace(
          count by (namespace, reason) (karta_pod_unattributed_info{{{sel}}}),
          "state", "unattributed", "", ""), "karta_namespace", "$1", "namespace", "(.*)")""")
    assert not error, error

    def as_dict(result: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
        return {(r["metric"]["karta_namespace"], r["metric"]["state"],
                 r["metric"].get("reason", "")): float(r["value"][1]) for r in result}

    # a namespace without attributed pods has a 0 there, and nothing to count here
    assert {k: v for k, v in as_dict(coverage).items() if v} == as_dict(counted)
    assert coverage
    states = {k[1] for k in as_dict(coverage)}
    assert states == {contract.STATE_ATTRIBUTED, contract.STATE_UNATTRIBUTED}
    assert sum(as_dict(coverage).values()) == len(proxy.proxy.index.pods)
