"""The shipped recording and alerting rules: valid for promtool, unit-tested rule by rule,
documented.

``promtool test rules`` runs tests/rules/*.yaml (fixtures with cAdvisor sandbox and
pod-cgroup series, DCGM ``exported_*`` series, two clusters, a scale-up and a phase
change; dcgm-exporter series of whole, time-sliced and MIG GPUs; namespaces losing
attribution coverage); the checks below make sure no rule escapes a unit test or the
docs, no alert is only ever tested silent, and no GPU rule counts a shared GPU twice.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted((ROOT / "config" / "rules").glob("*.yaml"))
TEST_FILES = sorted((ROOT / "tests" / "rules").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


def rule_names(field: str) -> list[str]:
    """The names of the shipped rules of one type (``record`` or ``alert``), in file order,
    repeats kept so a test can tell a name defined twice."""
    names: list[str] = []
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            names.extend(r[field] for r in group["rules"] if field in r)
    return names


def alert_tests() -> dict[str, list[bool]]:
    """alertname -> for each alert_rule_test case of it: does it expect the alert to fire."""
    out: dict[str, list[bool]] = {}
    for f in TEST_FILES:
        for t in yaml.safe_load(f.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                out.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    return out


def exprs_under_test() -> set[str]:
    out: set[str] = set()
    for f in TEST_FILES:
        for t in yaml.safe_load(f.read_text())["tests"]:
            out.update(str(e["expr"]).strip() for e in t.get("promql_expr_test", []))
    return out


def test_there_are_rules_and_tests() -> None:
    assert RULE_FILES and TEST_FILES
    names = rule_names("record")
    assert len(names) == len(set(names)), "a rule name is recorded twice"
    for name in names:  # level:metric:operations, at a karta level
        level, metric, ops = name.split(":")
        assert level.startswith("karta_") and metric and ops, name


@needs_promtool
def test_promtool_check_rules() -> None:
    r = subprocess.run(
        [str(PROMTOOL), "check", "rules", *map(str, RULE_FILES)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(test_file: Path) -> None:
    r = subprocess.run(
        [str(PROMTOOL), "test", "rules", test_file.name],
        capture_output=True, text=True, timeout=120, cwd=test_file.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_rule_has_a_unit_test() -> None:
    missing = sorted(set(rule_names("record")) - exprs_under_test())
    assert not missing, f"rules without a promtool unit test: {missing}"


def test_every_alert_is_tested_firing_and_not() -> None:
    """An alert test that only ever expects silence passes for a rule that never fires."""
    names = rule_names("alert")
    assert len(names) == len(set(names)), "an alert name is used twice"
    assert {"KartaAttributionCoverageDropped", "KartaPodsUnattributed"} <= set(names)
    cases = alert_tests()
    for name in names:
        assert True in cases.get(name, []), f"{name}: no promtool test where it fires"
        assert False in cases.get(name, []), f"{name}: no promtool test where it does not"


def test_every_alert_is_documented_and_reads_contract_names() -> None:
    """Alerts read facts (contract names), the operational metrics the contract names
    (the fact writer's, the index's, the jq sandbox's, the relay's: docs/metrics.md) or
    recorded rules, nothing else of karta's."""
    from proxy import contract

    doc = (ROOT / "docs" / "recording-rules.md").read_text()
    known = (set(contract.FACT_SERIES) | set(contract.FACT_WRITER_METRICS)
             | set(contract.INDEX_METRICS) | set(contract.WATCH_METRICS)
             | set(contract.JQ_SANDBOX_METRICS) | set(contract.OPERATIONAL_ALERT_METRICS)
             | set(rule_names("record")))
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for r in group["rules"]:
                if "alert" not in r:
                    continue
                assert f"`{r['alert']}`" in doc, f"{r['alert']} missing from the docs"
                read = set(re.findall(r"\b(karta_[a-zA-Z0-9_:]+)\s*[{\[]", r["expr"]))
                # the one exception reads `up` alone (a target of the proxy's job down)
                assert read or "up{" in r["expr"], r["alert"]
                assert read <= known, (r["alert"], read - known)
                assert r["labels"]["severity"] and r["annotations"]["summary"], r["alert"]


def test_every_rule_is_documented() -> None:
    doc = (ROOT / "docs" / "recording-rules.md").read_text()
    missing = [n for n in rule_names("record") if f"`{n}`" not in doc]
    assert not missing, f"rules missing from docs/recording-rules.md: {missing}"


def test_rules_read_only_contract_names() -> None:
    """Rules group by stamped labels and read fact series by their contract names."""
    from proxy import contract

    text = "\n".join(f.read_text() for f in RULE_FILES)
    for label in contract.WORKLOAD_IDENTITY_LABELS:
        assert label in text
    used_facts = {n for n in contract.FACT_SERIES if n in text}
    assert {
        contract.FACT_COMPONENT_DESIRED_REPLICAS,
        contract.FACT_COMPONENT_OBSERVED_PODS,
        contract.FACT_WORKLOAD_PHASE,
        contract.FACT_WORKLOAD_PHASE_TRANSITION,
    } <= used_facts


def test_gpu_rules_split_shared_devices() -> None:
    """A DCGM rule over the raw series would count a time-sliced GPU once per pod sharing it.

    dcgm-exporter --kubernetes-virtual-gpus repeats the device's value on one series per
    allocation, so every rule must divide by the allocations of the same device (a GPU, or
    a MIG slice: UUID + GPU_I_ID) before it aggregates.
    """
    split = "/ on (cluster, Hostname, gpu, UUID, GPU_I_ID) group_left ()"
    count = "count by (cluster, Hostname, gpu, UUID, GPU_I_ID) ("
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for r in group["rules"]:
                if "record" in r and ":DCGM_" in r["record"]:
                    assert split in r["expr"] and count in r["expr"], r["record"]


def test_rules_select_no_series_by_a_stamped_label_being_set() -> None:
    """A stamped label is on every enriched series of every metric, and a matcher that asks
    for it set (``karta_workload!=""``, ``=~".+"``) makes Prometheus (2.42 measured) merge
    the postings of all its values: the whole TSDB's enriched series, for each selector.
    At 600k series that was ~0.2 s per selector, 8.7 s for the GPU group over a few hundred
    GPUs (docs/recording-rules.md, "Cost at scale"). The rules drop the unattributed group
    from their output instead (``unless on (karta_workload) vector(0)``)."""
    from proxy import contract

    labels = "|".join(contract.STAMPED_LABELS)
    set_matcher = re.compile(rf'\b({labels})\s*(!=\s*""|=~\s*"\.\+")')
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for r in group["rules"]:
                found = set_matcher.search(r["expr"])
                assert found is None, (r.get("record") or r.get("alert"), found.group(0))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but
    ``-`` and ``_`` dropped, spaces as ``-``."""
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)
    }


def test_every_alert_has_a_runbook_section() -> None:
    """Every alert's ``runbook`` annotation names a docs file and a heading in it (the
    project has no docs site: the path is relative to the repository)."""
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for r in group["rules"]:
                if "alert" not in r:
                    continue
                runbook = r["annotations"].get("runbook", "")
                m = re.fullmatch(r"(docs/[\w.-]+\.md)#([\w-]+)", runbook)
                assert m, (r["alert"], runbook)
                doc = ROOT / m.group(1)
                assert doc.is_file(), (r["alert"], runbook)
                assert m.group(2) in heading_anchors(doc.read_text()), (r["alert"], runbook)
                assert m.group(2) == r["alert"].lower(), (r["alert"], runbook)


def test_operational_alerts_read_what_the_proxy_serves() -> None:
    """The label values the operational alerts select are ones the proxy uses: the
    upstream check's, the refusals', the jq errors' and the fact writes' (a value
    misspelt in a matcher selects nothing, and the alert never fires)."""
    from proxy import contract
    from proxy.karta.results import JQ_ERROR_WHERE

    text = (ROOT / "config" / "rules" / "karta-proxy.alerts.yaml").read_text()
    checks = re.findall(r'karta_proxy_upstream_info\{check=~"([^"]+)"\}', text)
    assert checks and all(c.split("|") == list(contract.UPSTREAM_CHECKS_MISCONFIGURED)
                          for c in checks)
    upstream = (ROOT / "proxy" / "upstream.py").read_text()
    for check in contract.UPSTREAM_CHECKS_MISCONFIGURED:
        assert f'Probe("{check}"' in upstream, check
    handler = (ROOT / "proxy" / "handler.py").read_text()
    for reasons in re.findall(r'karta_proxy_requests_rejected_total\{reason=~?"([^"]+)"\}', text):
        for reason in reasons.split("|"):
            assert f'kind="{reason}"' in handler, reason
    assert set(JQ_ERROR_WHERE) == {"selector", "workload", "status"}
    assert 'karta_proxy_fact_writes_total{result="success"}' in text
