"""Settings from YAML: every key maps to a field; typos and wrong types are precise errors."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from proxy.config import (
    ConfigError,
    PodLabelPair,
    PodLabelRule,
    Section,
    Settings,
    UpstreamSettings,
    first_kubeconfig,
    load_settings,
    never_forwarded,
    parse_host_port,
    schema,
    settings_from_dict,
    shown_url,
    url_credentials,
    validate,
    without_userinfo,
)
from proxy.config_docs import doc_tables, example_yaml
from proxy.config_docs import main as config_docs_main

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "karta-proxy.yaml"
    p.write_text(text)
    return p


def test_empty_file_gives_defaults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At start, with a warning naming the file: a file that should have held settings
    (a ConfigMap key rendered empty) started on every default without a word; ``{}``
    is every default said on purpose."""
    caplog.set_level(logging.WARNING, logger="karta.config")
    path = write(tmp_path, "# upstream:\n#   url: http://mimir:8080/api/v1/push\n")
    assert load_settings(path) == Settings()
    [record] = caplog.records
    assert record.getMessage().startswith("the config file holds no settings")
    assert record.__dict__["file"] == str(path)
    caplog.clear()
    assert load_settings(write(tmp_path, "{}\n")) == Settings()
    assert not caplog.records


def test_nested_values_and_types(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, """
server:
  listen_address: 127.0.0.1:9999
  max_body_bytes: 1024
  forward_before_ready: true
upstream:
  url: http://tsdb:9090/api/v1/write
  timeout_seconds: 3          # an int where a float is expected is fine
  headers: {X-Scope-OrgID: team-a}
  forward_headers: [Authorization]
enrich:
  pod_label_pairs:
    - [exported_namespace, exported_pod]
    - {namespace: namespace, pod: pod}
karta:
  description_paths: [/tmp]
log_level: debug
"""))
    assert s.server.listen_address == "127.0.0.1:9999"
    assert s.server.max_body_bytes == 1024
    assert s.server.forward_before_ready is True
    assert s.upstream.timeout_seconds == 3.0 and isinstance(s.upstream.timeout_seconds, float)
    assert s.upstream.headers == {"X-Scope-OrgID": "team-a"}
    assert s.upstream.forward_headers == ["Authorization"]
    assert s.enrich.pod_label_pairs == [
        ("exported_namespace", "exported_pod"), ("namespace", "pod"),
    ]
    assert s.karta.description_paths == ["/tmp"]
    assert s.log_level == "debug"
    # untouched sections keep their defaults
    assert s.facts == Settings().facts


def test_log_level_is_case_insensitive_in_the_file() -> None:
    assert settings_from_dict({"log_level": "WARNING"}).log_level == "warning"


def test_dashes_are_accepted_for_underscores() -> None:
    s = settings_from_dict({"server": {"listen-address": "127.0.0.1:1"}})
    assert s.server.listen_address == "127.0.0.1:1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("upstream:\n  urll: x\n", "unknown key 'upstream.urll'"),
        ("bogus: 1\n", "unknown key 'bogus'"),
        ("server:\n  max_body_bytes: lots\n", "server.max_body_bytes: expected an integer, "
         "got string 'lots'"),
        ("server:\n  max_body_bytes: 1.5\n", "server.max_body_bytes: expected an integer"),
        ("server:\n  forward_before_ready: 'yes'\n", "server.forward_before_ready: expected "
         "true or false"),
        ("upstream:\n  timeout_seconds: true\n", "upstream.timeout_seconds: expected a number"),
        ("upstream: [1, 2]\n", "upstream: expected a mapping, got list"),
        ("upstream:\n  forward_headers: Authorization\n", "upstream.forward_headers: expected "
         "a list"),
        ("upstream:\n  forward_headers: [1]\n", "upstream.forward_headers[0]: expected a "
         "string"),
        ("upstream:\n  headers: {a: 1}\n", "upstream.headers.a: expected a string, got "
         "number"),
        ("enrich:\n  pod_label_pairs: [[ns]]\n", "enrich.pod_label_pairs[0]: expected a pair"),
        ("enrich:\n  pod_label_pairs: [{ns: a, pod: b}]\n", "enrich.pod_label_pairs[0]: "
         "expected keys 'namespace' and 'pod'"),
        ("- a\n", "top level: expected a mapping, got list"),
        # bounds and choices come from the schema, with the same wording as validate's
        ("server:\n  max_body_bytes: 0\n", "server.max_body_bytes: must be 1 to 4294967296, "
         "got 0"),
        ("server:\n  worker_threads: 300\n", "server.worker_threads: must be 0 to 256, got 300"),
        ("karta:\n  max_owner_hops: 0\n", "karta.max_owner_hops: must be 1 to 100, got 0"),
        ("upstream:\n  timeout_seconds: 0\n", "upstream.timeout_seconds: must be more than "
         "0 and at most 600, got 0"),
        # milliseconds meant: each request held for 7 hours, with its memory
        ("upstream:\n  timeout_seconds: 25000\n", "upstream.timeout_seconds: must be more "
         "than 0 and at most 600, got 25000"),
        # the value itself, shortened, where only its type was said
        ("enrich:\n  pod_label_rules: [DCGM_]\n", "enrich.pod_label_rules[0]: expected a "
         "mapping, got string 'DCGM_'"),
        ("upstream: " + "x" * 200 + "\n", "upstream: expected a mapping, got string 'xxx"),
        # YAML 1.1 reads 1e3 as a string, yes / no as booleans: said how to write them
        ("upstream:\n  timeout_seconds: 1e3\n", "upstream.timeout_seconds: expected a "
         "number, got string '1e3' (YAML 1.1 reads it as a string: write a dot and a signed "
         "exponent, 1.0e+03, or 1000)"),
        ("server:\n  max_body_bytes: 1e6\n", "server.max_body_bytes: expected an integer, "
         "got string '1e6' (YAML 1.1 reads it as a string: write 1000000)"),
        ("upstream:\n  headers: {X-Flag: yes}\n", "upstream.headers.X-Flag: expected a "
         "string, got boolean (not shown: a header may be a credential); YAML reads yes, no, "
         "on, off, true and false unquoted as booleans: quote it"),
        ("facts:\n  external_labels: {cluster: yes}\n", "facts.external_labels: entries must "
         "be string: string, got 'cluster': True (YAML reads yes, no, on, off, true and false "
         "unquoted as booleans: quote it)"),
        # a key with nothing after it: said as such (it was "got null None")
        ("upstream:\n  url:\n", "upstream.url: expected a string, got null (nothing after "
         "the key: give a value, or remove the key for its default)"),
        ("log_level:\n", "log_level: expected one of debug, info, warning, error, critical; "
         "got null (nothing after the key"),
        # a section whose keys are all commented out: null too, said so ("got null None")
        ("server:\n  # listen_address: :9091\nupstream: {url: http://x:1}\n",
         "server: expected a mapping, got null (nothing after the key: give a value, or "
         "remove the key for its default)"),
        # a misspelt key, or one of another section: the key meant, said first
        ("upstream:\n  timeout_secnods: 5\n", "unknown key 'upstream.timeout_secnods': did "
         "you mean 'upstream.timeout_seconds'? (known keys here: "),
        ("url: http://x:1\n", "unknown key 'url': did you mean 'upstream.url'?"),
        ("upstream:\n  basic_auth_username: no\n", "upstream.basic_auth_username: expected a "
         "string, got boolean False (YAML reads yes, no, on, off"),
        ("upstream:\n  protocol: v3\n", "upstream.protocol: expected one of auto, v1, "
         "passthrough; got 'v3'"),
        ("log_level: loud\n", "log_level: expected one of"),
        ("enrich:\n  pod_label_pairs: []\n", "enrich.pod_label_pairs: must have at least one"),
        ("enrich:\n  pod_label_rules: [{pod_label_pairs: [[a, b]]}]\n",
         "enrich.pod_label_rules[0]: missing key 'metric_prefix'"),
        ("enrich:\n  pod_label_rules: [{metric_prefix: X, pod_label_pairs: "
         "[{namespace: a, pod: b, unless: {c: 1}}]}]\n",
         "enrich.pod_label_rules[0].pod_label_pairs[0].unless: entries must be string"),
        ("server: {listen_address: [\n", "invalid YAML: line 2, column 1"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert expected in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the audit's cli/c7.yaml and c10.yaml: the last one silently won
        ("server:\n  listen_address: 127.0.0.1:1\n  listen-address: 127.0.0.1:2\n",
         "server: 'listen_address' and 'listen-address' are the same key "
         "(server.listen_address): keep one"),
        ("server:\n  listen_address: 127.0.0.1:1\n  listen_address: 127.0.0.1:2\n",
         "server: key 'listen_address' is given more than once (again at line 3); keep one"),
        ("log_level: info\nlog-level: debug\n",
         "top level: 'log_level' and 'log-level' are the same key (log_level)"),
        ("server: {}\nserver: {worker_threads: 2}\n",
         "top level: key 'server' is given more than once (again at line 2)"),
        ("upstream:\n  headers:\n    X-A: a\n    X-A: b\n",
         "upstream.headers: key 'X-A' is given more than once (again at line 4)"),
        ("enrich:\n  pod_label_rules:\n  - metric_prefix: a\n    metric_prefix: b\n"
         "    pod_label_pairs: [[n, p]]\n",
         "enrich.pod_label_rules[0]: key 'metric_prefix' is given more than once"),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    """The file is strict (docs/configuration.md): a key given twice in one mapping, as
    written or as dashes for underscores, is an error naming the key and its section."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert expected in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("text", [
    "log_level: !!int abc\n",
    "server:\n  worker_threads: !!float x\n",
    "upstream:\n  timeout_seconds: !!timestamp 2026-13-45\n",
])
def test_a_value_its_tag_cannot_build_is_a_config_error(tmp_path: Path, text: str) -> None:
    """An explicit tag on a value it cannot be is a ConfigError naming the file, not a
    ValueError traceback out of PyYAML's constructor."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert "YAML tag cannot build" in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize(("text", "said"), [
    ("upstream:\n  headers: ['Authorization: Bearer s3cr3t-token']\n",
     "upstream.headers: expected a mapping, got list (not shown: it may hold a credential)"),
    ("upstream:\n  headers: 'Authorization: Bearer s3cr3t-token'\n",
     "upstream.headers: expected a mapping, got string (not shown: it may hold a credential)"),
    ("facts:\n  headers: [X-Api-Key, s3cr3t-token]\n",
     "facts.headers: expected a mapping, got list (not shown: it may hold a credential)"),
    ("upstream:\n  url: ['http://user:s3cr3t-token@tsdb/api/v1/write']\n",
     "upstream.url: expected a string, got list (not shown: it may hold a credential)"),
    ("upstream:\n  headers: {X-Api-Key: !!int s3cr3t-token}\n",
     "line 2, column 24: !!int: a value its YAML tag cannot build (ValueError; the value is "
     "not shown: it may be a credential)"),
], ids=["headers-list", "headers-string", "fact-headers-list", "url-list", "tagged"])
def test_a_credential_of_the_wrong_type_is_not_quoted(tmp_path: Path, text: str,
                                                      said: str) -> None:
    """A setting that may hold a credential given as another type (headers written as a
    list of ``Name: value`` lines, as curl takes them): the message, on stderr, in the log
    and in a reload's answer, quoted the value, token and all."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert str(e.value) == f"{path}: {said}"
    assert "s3cr3t" not in str(e.value)


def test_a_merge_key_overridden_is_no_duplicate(tmp_path: Path) -> None:
    """``<<`` merges a mapping, and a key of the mapping's own overrides it: no error."""
    path = write(tmp_path, "server:\n  <<: {listen_address: '127.0.0.1:1', worker_threads: 2}\n"
                           "  listen_address: 127.0.0.1:3\n")
    s = load_settings(path)
    assert (s.server.listen_address, s.server.worker_threads) == ("127.0.0.1:3", 2)


def test_aliases_are_the_operators_and_a_key_twice_under_one_is_refused(tmp_path: Path
                                                                        ) -> None:
    """Aliases and merge keys may be used in the config file; the check that refuses a key
    given twice (proxy.karta.yamltext.refusal) looks through what an alias names once, and
    into a merged mapping too."""
    path = write(tmp_path, "upstream:\n  headers: &h {X-A: a}\nfacts:\n  external_labels: *h\n")
    s = load_settings(path)
    assert s.upstream.headers == s.facts.external_labels == {"X-A": "a"}
    path = write(tmp_path, "upstream:\n  headers: &h {X-A: a, X-A: b}\nfacts:\n"
                           "  external_labels: *h\n")
    with pytest.raises(ConfigError, match=r"upstream\.headers: key 'X-A' is given more than "
                                          r"once \(again at line 2\); keep one"):
        load_settings(path)
    path = write(tmp_path, "server:\n  <<: {listen_address: '127.0.0.1:1', "
                           "listen_address: '127.0.0.1:2'}\n")
    with pytest.raises(ConfigError, match="server: key 'listen_address' is given more than once"):
        load_settings(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml")


def valid(**upstream: object) -> Settings:
    s = Settings()
    s.upstream.url = "http://127.0.0.1:9090/api/v1/write"
    for k, v in upstream.items():
        setattr(s.upstream, k, v)
    return s


def _node_mode_facts(s: Settings) -> None:
    """Node mode with facts allowed (and no election: the default)."""
    s.kube.node_name = "n1"
    s.facts.allow_in_node_mode = True


def test_validate_accepts_defaults_with_an_upstream() -> None:
    validate(valid())


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: setattr(s.upstream, "url", ""), "upstream.url: required"),
        (lambda s: setattr(s.upstream, "url", "tsdb:9090"), "upstream.url: expected an http"),
        (lambda s: setattr(s.upstream, "url", "http://vm/insert/{t}/prometheus"),
         "the only placeholder is {tenant}"),
        (lambda s: setattr(s.upstream, "default_tenant", "acme"), "upstream.default_tenant"),
        (lambda s: setattr(s.upstream, "protocol", "v3"), "upstream.protocol: expected one of"),
        (lambda s: setattr(s.upstream, "encoding", "gzip"), "upstream.encoding"),
        (lambda s: setattr(s.upstream, "timeout_seconds", 0), "upstream.timeout_seconds"),
        (lambda s: setattr(s.upstream, "tls_cert_file", "/etc/hostname"), "set both or neither"),
        (lambda s: setattr(s.upstream, "bearer_token_file", "/nonexistent/token"),
         "upstream.bearer_token_file: file '/nonexistent/token' does not exist"),
        (lambda s: setattr(s.upstream, "forward_headers", ["Bad Header"]),
         "upstream.forward_headers[0]"),
        (lambda s: setattr(s.server, "listen_address", "9091"), "expected HOST:PORT"),
        (lambda s: setattr(s.server, "listen_address", "h:70000"), "out of range"),
        (lambda s: setattr(s.server, "max_concurrent_requests", 0), "max_concurrent_requests"),
        (lambda s: setattr(s.server, "max_inflight_bytes", 10), "max_inflight_bytes: must be "
         "at least"),
        (lambda s: setattr(s.enrich, "conflict_policy", "merge"), "enrich.conflict_policy"),
        (lambda s: setattr(s.enrich, "pod_label_pairs", []), "enrich.pod_label_pairs"),
        (lambda s: setattr(s.enrich, "pod_label_pairs", [("karta_namespace", "pod")]),
         "may not read karta_* labels (the proxy's own): karta_namespace"),
        (lambda s: setattr(s.enrich, "pod_label_rules", [PodLabelRule(
            "karta_workload_", [PodLabelPair("namespace", "pod")])]),
         "enrich.pod_label_rules[0].metric_prefix"),
        (lambda s: setattr(s, "snapshot", "/nonexistent/snap.yaml"), "snapshot:"),
        (lambda s: setattr(s, "log_level", "loud"), "log_level"),
        (lambda s: setattr(s, "snapshot_reload_seconds", -1), "snapshot_reload_seconds"),
        (lambda s: setattr(s.karta, "description_paths", ["/nonexistent"]),
         "karta.description_paths[0]"),
        # every fact carries them: a name the TSDB refuses fails every fact request, and
        # a fact label (or karta_*) lands on the facts that lack it
        (lambda s: setattr(s.facts, "external_labels", {"bad-name": "x"}),
         "facts.external_labels.bad-name: 'bad-name' is not a label name"),
        (lambda s: setattr(s.facts, "external_labels", {"__meta": "x"}), "not a label name"),
        (lambda s: setattr(s.facts, "external_labels", {"karta_workload": "victim"}),
         "facts.external_labels.karta_workload: 'karta_workload' is a label of the fact"),
        (lambda s: setattr(s.facts, "external_labels", {"namespace": "x"}),
         "is a label of the fact series"),
        (lambda s: setattr(s.facts, "external_labels", {"cluster": ""}), "the value is empty"),
        # the cluster check's label: one no series can carry checks nothing, and karta_*
        # labels of a sender are the proxy's own (dropped)
        (lambda s: setattr(s.enrich, "cluster_label", "my-cluster"),
         "enrich.cluster_label: 'my-cluster' is not a label name"),
        (lambda s: setattr(s.enrich, "cluster_label", "__name__"), "is not a label name"),
        (lambda s: setattr(s.enrich, "cluster_label", "karta_cluster"),
         "enrich.cluster_label: 'karta_cluster' is a karta_* label"),
        # a namespace or node that no object can have: ready, nothing attributed, silent
        (lambda s: setattr(s.kube, "node_name", " "), "kube.node_name: ' ' has whitespace"),
        (lambda s: setattr(s.kube, "node_name", "node-1 "), "has whitespace around it"),
        (lambda s: setattr(s.kube, "node_name", "Node_1"), "kube.node_name: 'Node_1' is not "
         "a valid node name (an RFC 1123 DNS subdomain"),
        (lambda s: setattr(s.kube, "node_name", "a" * 254), "at most 253"),
        (lambda s: setattr(s.kube, "namespaces", ["web", "Bad_NS!"]),
         "kube.namespaces[1]: 'Bad_NS!' is not a valid namespace (an RFC 1123 DNS label"),
        (lambda s: setattr(s.kube, "namespaces", ["a.b"]), "is not a valid namespace"),
        (lambda s: setattr(s.kube, "namespaces", ["a" * 64]), "at most 63"),
        # the Lease: "" is the collection (every round a 405), the others refused by the API
        (lambda s: setattr(s.facts, "lease_name", ""), "facts.lease_name: empty"),
        (lambda s: setattr(s.facts, "lease_name", "Bad/Name"), "facts.lease_name: 'Bad/Name' "
         "is not a valid Lease name"),
        (lambda s: setattr(s.facts, "lease_namespace", "a b"), "facts.lease_namespace: 'a b' "
         "is not a valid namespace"),
        (lambda s: setattr(s.facts, "identity", " "), "facts.identity: ' ' is blank"),
        # node mode's facts without an election: every node's replica wrote every
        # workload's series under the same labels, each with its own node's pod counts
        (_node_mode_facts, "facts.allow_in_node_mode: true needs facts.leader_election: true"),
    ],
)
def test_validate_names_the_bad_key(change: Callable[[Settings], None], expected: str) -> None:
    s = valid()
    change(s)
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert expected in str(e.value)


def test_validate_without_upstream_for_the_demo() -> None:
    validate(Settings(), require_upstream=False)


@pytest.mark.parametrize(
    ("address", "expected"),
    # "": every interface of both families (asyncio binds 0.0.0.0 and ::)
    [("127.0.0.1:80", ("127.0.0.1", 80)), (":9091", ("", 9091)), ("[::]:9091", ("", 9091)),
     ("0.0.0.0:9091", ("0.0.0.0", 9091)), ("[::1]:9091", ("::1", 9091))],
)
def test_parse_host_port(address: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(address) == expected


def _keys(obj: object, prefix: str = "") -> set[str]:
    out: set[str] = set()
    assert isinstance(obj, Section)
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        key = f"{prefix}{name}"
        if isinstance(value, Section):
            out |= _keys(value, key + ".")
        else:
            out.add(key)
    return out


def _yaml_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in data.items():
        if isinstance(v, dict) and k not in ("headers", "external_labels",
                                             "proxy_connect_header", "endpoint_params"):
            out |= _yaml_keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_schema_lists_every_leaf_setting_once() -> None:
    keys = [i.key for i in schema()]
    assert len(keys) == len(set(keys)) and set(keys) == _keys(Settings())
    for info in schema():
        assert info.help, f"{info.key} has no help"
        assert info.example == info.default or info.key == "upstream.url", info.key


def test_example_config_is_generated_from_the_schema() -> None:
    """config/karta-proxy.yaml is what ``python -m proxy.config_docs --write`` writes."""
    path = REPO / "config" / "karta-proxy.yaml"
    assert path.read_text() == example_yaml(), (
        "config/karta-proxy.yaml differs from the schema: run python -m proxy.config_docs "
        "--write")


def test_example_config_has_every_key_with_its_default() -> None:
    path = REPO / "config" / "karta-proxy.yaml"
    example = load_settings(path)
    defaults = Settings()
    assert _yaml_keys(yaml.safe_load(path.read_text())) == _keys(defaults)
    # the example differs from the defaults only where it must (an upstream URL)
    example.upstream.url = defaults.upstream.url
    assert msgspec.to_builtins(example) == msgspec.to_builtins(defaults)
    assert example == defaults


def test_configuration_doc_tables_are_generated_from_the_schema() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert doc_tables(doc) == doc, (
        "docs/configuration.md's settings tables differ from the schema (keys, order or "
        "defaults): run python -m proxy.config_docs --write")
    missing = [k for k in sorted(_keys(Settings())) if f"| `{k}` |" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_doc_check_fails_on_a_drifted_default() -> None:
    """The check above can fail: a default edited by hand in the doc is put back."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    drifted = doc.replace("| `upstream.max_connections` | `64` |",
                          "| `upstream.max_connections` | `65` |")
    assert drifted != doc and doc_tables(drifted) == doc
    assert config_docs_main([]) == 0


def test_every_flag_is_in_the_configuration_doc() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    for info in schema():
        if info.flag is not None:
            for name in info.flag.names:
                assert f"`{name}" in doc, name


def test_a_removed_key_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="karta.config"):
        s = settings_from_dict({"enrich": {"cache-size": 1000, "conflict_policy": "keep"}})
    assert s.enrich.conflict_policy == "keep"
    (record,) = [r for r in caplog.records if r.getMessage() == "ignoring a removed setting"]
    assert record.__dict__["key"] == "enrich.cache_size"


def test_a_removed_key_beside_a_refused_one_says_only_the_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """The docs promise one line for a refused file: the removal's warning came first,
    two lines, for a file that did not load anyway."""
    with caplog.at_level("WARNING", logger="karta.config"), pytest.raises(ConfigError):
        settings_from_dict({"enrich": {"cache_size": 1000, "conflict_polcy": "keep"}})
    assert not [r for r in caplog.records if r.getMessage() == "ignoring a removed setting"]


def test_validate_checks_values_set_in_code_against_the_schema() -> None:
    """Flags and code assign attributes without decoding: validate applies the schema too."""
    s = valid()
    s.server.worker_threads = -1
    with pytest.raises(ConfigError, match=r"server.worker_threads: must be 0 to 256, got -1"):
        validate(s)
    s = valid()
    s.upstream.timeout_seconds = "soon"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"upstream.timeout_seconds: expected a number, got "
                       r"string 'soon'"):
        validate(s)


def test_choices_are_declared_once() -> None:
    """The modules that act on a choice take its values from the schema's Literal."""
    from proxy.enrichment import POLICIES, SENDER_KARTA_LABELS
    from proxy.tls_files import VERIFY_MODES

    by_key = {i.key: i for i in schema()}
    assert set(POLICIES) == set(by_key["enrich.conflict_policy"].choices)
    assert set(SENDER_KARTA_LABELS) == set(by_key["enrich.sender_karta_labels"].choices)
    assert set(VERIFY_MODES) == set(by_key["server.tls_client_auth_type"].choices)


# -- values that passed the checks and then failed every request ----------------------------


@pytest.mark.parametrize("key", ["timeout_seconds", "connect_timeout_seconds"])
@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan"])
def test_non_finite_floats_are_refused_in_the_file(tmp_path: Path, key: str,
                                                   text: str) -> None:
    path = write(tmp_path, f"upstream:\n  {key}: {text}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert f"upstream.{key}:" in str(e.value) and str(path) in str(e.value)


def test_non_finite_floats_are_refused_from_code_and_flags() -> None:
    s = valid()
    s.upstream.connect_timeout_seconds = float("inf")
    with pytest.raises(ConfigError,
                       match=r"upstream.connect_timeout_seconds: must be a finite number"):
        validate(s)
    s = valid(timeout_seconds=float("inf"))  # past its upper bound, as any value over it
    with pytest.raises(ConfigError, match=r"upstream.timeout_seconds: must be more than 0 "
                       r"and at most 600, got inf"):
        validate(s)
    s = valid()
    s.facts.interval_seconds = float("inf")
    with pytest.raises(ConfigError, match=r"facts.interval_seconds: must be a finite"):
        validate(s)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"bad header": "x"}, "upstream.headers.bad header: 'bad header' is not a header name"),
        ({"X-A:": "x"}, "is not a header name"),
        ({"": "x"}, "is not a header name"),
        ({"X-A": "a\nb"}, "upstream.headers.X-A: the value holds a control character"),
        ({"X-A": "a\rb"}, "control character"),
        ({"X-A": "a\x00b"}, "control character"),
        # one header twice: which value went out depended on dict order
        ({"X-Scope-OrgID": "a", "x-scope-orgid": "b"},
         "upstream.headers: 'X-Scope-OrgID' and 'x-scope-orgid' are one header"),
    ],
)
def test_upstream_headers_are_checked(headers: dict[str, str], expected: str) -> None:
    """Sent on every request: a bad one fails every write (the upstream's 400, or aiohttp's
    ValueError as a 500)."""
    with pytest.raises(ConfigError) as e:
        validate(valid(headers=headers))
    assert expected in str(e.value)


@pytest.mark.parametrize(("headers", "expected"), [
    ({"bad name": "x"}, "facts.headers.bad name: 'bad name' is not a header name"),
    ({"X-Scope-OrgID": "a", "x-scope-orgid": "b"}, "facts.headers: 'X-Scope-OrgID' and"),
    ({"X-Scope-OrgID": "a\r\nb"}, "facts.headers.X-Scope-OrgID: the value holds a control"),
])
def test_facts_headers_are_checked_as_upstream_headers_are(headers: dict[str, str],
                                                            expected: str) -> None:
    s = valid()
    s.facts.headers = headers
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert expected in str(e.value)


#: a credential the tests below put where a message could quote it
SECRET = "s3cr3t-Bearer-value"


@pytest.mark.parametrize(("section", "headers"), [
    ("upstream", {"Authorization": f"Bearer {SECRET}\r\nX-Injected: 1"}),
    ("facts", {"Authorization": f"Bearer {SECRET}\n"}),
    ("upstream", {"X-Api-Key": f"{SECRET}\x00"}),
])
def test_a_header_value_refused_is_not_quoted(section: str,
                                              headers: dict[str, str]) -> None:
    """A header set in the settings is often a credential: the refusal (stderr, the log, a
    reload's answer) names the header and the character, never the value (it quoted it
    whole: ``'Bearer s3cr3t...\\r\\nX-Injected: 1'``)."""
    s = valid()
    getattr(s, section).headers = headers
    with pytest.raises(ConfigError) as e:
        validate(s)
    name = next(iter(headers))
    assert str(e.value).startswith(f"{section}.headers.{name}: the value holds a control "
                                   "character"), e.value
    assert SECRET not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", [
    f"upstream:\n  headers:\n    Authorization: {12345678}\n",
    "facts:\n  headers:\n    X-Token: 12345678\n",
])
def test_a_header_value_of_the_wrong_type_is_named_not_quoted(tmp_path: Path,
                                                              text: str) -> None:
    """An unquoted numeric token is read as a number: the entry is named, its value not
    (``entries must be string: string, got 'Authorization': 12345678``)."""
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text))
    assert "12345678" not in str(e.value)
    assert re.search(r"(upstream|facts)\.headers\.(Authorization|X-Token): expected a "
                     r"string, got number \(not shown: a header may be a credential\); "
                     "quote it", str(e.value)), e.value


@pytest.mark.parametrize(("key", "content", "expected"), [
    # sent as it was, aiohttp refused every request: a 502 for every sender that named
    # neither the file nor the header
    ("bearer_token_file", f"{SECRET}\nsecond-line\n".encode(), "holds 2 lines after trimming"),
    ("bearer_token_file", f"{SECRET}\x1b".encode(), "holds a control character ('\\x1b')"),
    # a UnicodeDecodeError traceback at start, exit 1
    ("bearer_token_file", SECRET.encode() + b"\xff", f"is not UTF-8 text (byte {len(SECRET)}"),
    ("basic_auth_password_file", SECRET.encode() + b"\xfe", "is not UTF-8 text"),
])
def test_a_credential_file_that_cannot_be_sent_is_refused_unquoted(
        tmp_path: Path, key: str, content: bytes, expected: str) -> None:
    path = tmp_path / "credential"
    path.write_bytes(content)
    s = valid(**{key: str(path)})
    if key == "basic_auth_password_file":
        s.upstream.basic_auth_username = "proxy"
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith(f"upstream.{key}: {str(path)!r} "), e.value
    assert expected in str(e.value) and SECRET not in str(e.value), e.value


def test_a_password_with_a_line_break_is_its_own(tmp_path: Path) -> None:
    """Base64-encoded into its header, a password may hold any character."""
    path = tmp_path / "pw"
    path.write_text("pass\nword")
    validate(valid(basic_auth_username="u", basic_auth_password_file=str(path)))


def test_upstream_headers_that_are_fine() -> None:
    validate(valid(headers={"X-Scope-OrgID": "team-a", "X-Tab": "a\tb", "X-U": "é"}))


@pytest.mark.parametrize(("url", "detail"), [
    ("http://u:pw@127.0.0.1:99999/x", " (Port out of range 0-65535): 'http://127.0.0.1:99999/x'"),
    ("http://u:pw@127.0.0.1:9x/x", " (Port could not be cast to integer value as '9x'): "),
    # what is wrong is in the userinfo left out: nothing of it said
    ("http://u:p/w:9x@127.0.0.1:9/x", ": 'http://127.0.0.1:9/x'"),
])
def test_a_url_with_a_password_that_cannot_be_parsed_still_says_why(url: str,
                                                                     detail: str) -> None:
    """The reason was dropped whenever the URL held a userinfo (urlsplit's words could
    quote a piece of the password); it is now urlsplit's words on the URL without it."""
    with pytest.raises(ConfigError) as e:
        validate(valid(url=url))
    assert str(e.value).startswith("upstream.url: not a valid URL" + detail), e.value
    assert "pw" not in str(e.value) and "p/w" not in str(e.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://[::1/x", "upstream.url: not a valid URL"),
        ("http://127.0.0.1:99999/x", "upstream.url: not a valid URL"),
        ("http://127.0.0.1:abc/x", "upstream.url: not a valid URL"),
        # a space or a line break from a quoted value or a variable: a trailing one was
        # sent as %20 (every write a 404), a leading one or a tab dropped by urlsplit
        ("http://127.0.0.1:9090/api/v1/write ", "upstream.url: holds whitespace or a "
         "control character (a URL has none; a space is written %20): "
         "'http://127.0.0.1:9090/api/v1/write '"),
        (" http://127.0.0.1:9090/api/v1/write", "upstream.url: holds whitespace"),
        ("http://127.0.0.1:9090/api/v1/write\n", "upstream.url: holds whitespace"),
        ("http://127.0.0.1:9090/api/\tv1/write", "upstream.url: holds whitespace"),
        ("http://u:p w@127.0.0.1:9090/", "upstream.url: holds whitespace"),
        # a fragment, never sent: the key was cut at its '#' (a 401 at every write) and
        # its rest shown in the log; neither part is shown now
        ("http://127.0.0.1:9090/api/v1/write?api_key=hunter#2", "upstream.url: holds a "
         "'#': what follows it is a fragment, never sent, so a query value or a password "
         "with a '#' in it was cut there; write it %23: "
         "http://127.0.0.1:9090/api/v1/write?api_key=(hidden)#(hidden)"),
        ("http://127.0.0.1:9090/api/v1/write#", "upstream.url: holds a '#'"),
    ],
)
def test_upstream_url_that_cannot_be_parsed(url: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(valid(url=url))
    assert expected in str(e.value)
    assert "hunter" not in str(e.value)


def test_upstream_tls_files_are_loaded(tmp_path: Path) -> None:
    """A file that is not PEM was found only when the client context was built: exit 1,
    an SSLError naming no key."""
    from tests.tls_certs import Authority

    ca = Authority(tmp_path / "ca")
    client = ca.issue("client", server=False)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    https = "https://127.0.0.1:9090/api/v1/write"
    validate(valid(url=https, tls_ca_file=str(ca.ca_file), tls_cert_file=str(client.cert),
                   tls_key_file=str(client.key)))
    cases = [
        ({"tls_cert_file": str(garbage), "tls_key_file": str(garbage)},
         "upstream.tls_cert_file / upstream.tls_key_file: cannot load"),
        ({"tls_cert_file": str(client.cert), "tls_key_file": str(ca.ca_file)},
         "upstream.tls_cert_file / upstream.tls_key_file: cannot load"),
        ({"tls_ca_file": str(garbage)}, f"upstream.tls_ca_file: cannot load '{garbage}'"),
        ({"tls_ca_file": str(tmp_path)}, "upstream.tls_ca_file:"),
    ]
    for change, expected in cases:
        with pytest.raises(ConfigError) as e:
            validate(valid(url=https, **change))
        assert expected in str(e.value), change


@pytest.mark.parametrize("key", ["bearer_token_file", "basic_auth_password_file",
                                 "tls_ca_file"])
def test_file_settings_must_be_regular_files(tmp_path: Path, key: str) -> None:
    """A folder passed os.access, then every read of it failed: writes went out without
    credentials."""
    change: dict[str, object] = {key: str(tmp_path)}
    if key == "basic_auth_password_file":
        change["basic_auth_username"] = "u"
    with pytest.raises(ConfigError) as e:
        validate(valid(**change))
    assert f"upstream.{key}: '{tmp_path}' is not a regular file" in str(e.value)


def test_server_and_kube_files_must_be_regular_files(tmp_path: Path) -> None:
    s = valid()
    s.kube.kubeconfig = str(tmp_path)
    with pytest.raises(ConfigError, match=r"kube\.kubeconfig: .* is not a regular file"):
        validate(s)
    s = valid()
    s.server.tls_cert_file = s.server.tls_key_file = str(tmp_path)
    with pytest.raises(ConfigError, match=r"server\.tls_cert_file: .* is not a regular file"):
        validate(s)


def test_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: not UTF-8 text"):
        load_settings(path)


def test_kubeconfig_path_list_checks_its_first_file(tmp_path: Path) -> None:
    """kubectl's form, which the client reads as its first entry: it was refused as a
    whole ("file 'a:b' does not exist")."""
    first = tmp_path / "a.yaml"
    first.write_text("{}")
    s = valid()
    s.kube.kubeconfig = f"{first}{os.pathsep}{tmp_path / 'missing.yaml'}"
    validate(s)
    s.kube.kubeconfig = f"{tmp_path / 'missing.yaml'}{os.pathsep}{first}"
    with pytest.raises(ConfigError, match=r"kube\.kubeconfig: file .*missing\.yaml' does not"):
        validate(s)


@pytest.mark.parametrize("address", ["[::1:0", "[::1]]:0", "::1]:0"])
def test_parse_host_port_refuses_unbalanced_brackets(address: str) -> None:
    """'[::1:0' passed and failed only at the bind."""
    with pytest.raises(ConfigError, match=r"server\.listen_address: expected HOST:PORT"):
        parse_host_port(address)


@pytest.mark.parametrize("address", ["http://0.0.0.0:9091", "0.0.0.0:9091/", "//:9091"])
def test_parse_host_port_refuses_a_url(address: str) -> None:
    """A URL where HOST:PORT goes was told to put an IPv6 address in brackets."""
    with pytest.raises(ConfigError) as e:
        parse_host_port(address)
    assert str(e.value) == (f"server.listen_address: expected HOST:PORT, not a URL (no "
                            f"scheme, no path: e.g. :9091), got {address!r}")


def test_a_relative_path_not_found_names_the_directory_it_was_read_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths are read from the working directory, not from the config file's
    folder (Prometheus reads its rule files from there): the message named the path
    alone, which exists next to the config file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "descs").mkdir()
    where = (f"(a relative path, read from the working directory {tmp_path}, not from the "
             "config file's folder)")
    url = "upstream:\n  url: http://x:1\n"
    for text, said in [
        (url + "karta:\n  description_paths: [descs]\n",
         f"karta.description_paths[0]: 'descs' does not exist {where}"),
        (url + "snapshot: objects.yaml\n", f"snapshot: 'objects.yaml' does not exist {where}"),
        (url + "  bearer_token_file: token\n",
         f"upstream.bearer_token_file: file 'token' does not exist or is not readable {where}"),
        # a shell's '~', read as a folder of that name
        (url + "kube:\n  kubeconfig: ~/.kube/config\n",
         "kube.kubeconfig: file '~/.kube/config' does not exist or is not readable (a '~' "
         "is not expanded here: write the path out in full)"),
    ]:
        cfg = tmp_path / "etc" / "karta-proxy.yaml"
        cfg.write_text(text)
        with pytest.raises(ConfigError) as e:
            validate(load_settings(cfg))
        assert str(e.value) == said
    with pytest.raises(ConfigError) as e:  # an absolute path: nothing to add
        validate(load_settings(write(tmp_path, "upstream: {url: http://x:1}\n"
                                               f"snapshot: {tmp_path}/none.yaml\n")))
    assert str(e.value) == f"snapshot: '{tmp_path}/none.yaml' does not exist"


@pytest.mark.parametrize(
    "url",
    [
        "http://bob:PW2-SECRET@h:bad/x",  # a port that is not a number
        "http://bob:PW2-SECRET@127.0.0.1:99999/x",  # out of range
        "http://bob:PW2/SECRET@h:9/x",  # an unescaped "/" in the password
        "bob:PW2-SECRET@tsdb:9090/x",  # no scheme
        "http://bob:PW2-SECRET@h:9/x/{tenan}",  # a placeholder that is not {tenant}
    ],
)
def test_an_upstream_url_error_does_not_repeat_the_password(url: str) -> None:
    """The message reaches stderr at start, the reload log line and /-/reload's answer."""
    with pytest.raises(ConfigError) as e:
        validate(valid(url=url))
    assert "upstream.url" in str(e.value)
    assert "SECRET" not in str(e.value) and "bob" not in str(e.value), str(e.value)


@pytest.mark.parametrize("other", [
    {"bearer_token_file": "/etc/hostname"},
    {"basic_auth_username": "u", "basic_auth_password_file": "/etc/hostname"},
    {"headers": {"authorization": "Bearer x"}},
])
def test_url_userinfo_and_other_credentials_are_one_kind_too_many(
        other: dict[str, object]) -> None:
    # both went out as an Authorization header: aiohttp refused every request
    with pytest.raises(ConfigError, match="choose one kind of auth") as e:
        validate(valid(url="http://bob:SECRET@127.0.0.1:9090/api/v1/write", **other))
    assert "SECRET" not in str(e.value)


def test_url_credentials_are_the_userinfo_decoded() -> None:
    assert url_credentials("http://u:p%40ss@h:9/x?q=a@b") == ("u", "p@ss")
    assert url_credentials("https://u:p@ss@h/x") == ("u", "p@ss")  # the last "@" ends it
    assert url_credentials("http://u@h/x") == ("u", "")
    assert url_credentials("http://h/a@b") is None  # an "@" in a path
    assert url_credentials("http://h:9/x") is None


def test_tenants_are_ascii_digits() -> None:
    with pytest.raises(ConfigError, match=r"upstream\.default_tenant"):
        validate(valid(default_tenant="\u0661\u0662"))  # Arabic-Indic 12


@pytest.mark.parametrize("url", [
    "http://vminsert:8480/insert/0/prometheus/api/v1/write",  # a tenant written in it
    "http://mimir:8080/api/v1/push",
])
def test_a_default_tenant_with_no_place_in_the_url_is_refused(url: str) -> None:
    # upstream.default_tenant fills a {tenant} only: with none, the facts (and requests
    # naming no tenant) went to the URL's tenant 0 while the settings said 5
    with pytest.raises(ConfigError, match=r"upstream\.default_tenant: 5 .* no \{tenant\}"):
        validate(valid(url=url, default_tenant="5"))
    validate(valid(url=url))  # the default: nothing to put anywhere
    validate(valid(url=url.replace("/insert/0/", "/insert/{tenant}/"), default_tenant="5")
             if "/insert/" in url else valid(url=url + "?tenant={tenant}", default_tenant="5"))


@pytest.mark.parametrize(("upstream", "facts", "refused"), [
    ({"headers": {"X-Scope-OrgID": "team-a"}}, {"x-scope-orgid": "ops"}, "x-scope-orgid"),
    ({"bearer_token_file": "TOKEN"}, {"Authorization": "Bearer ops"}, "Authorization"),
    ({"url": "http://u:p@mimir:8080/api/v1/push"}, {"authorization": "Basic b3Bz"},
     "authorization"),
    ({"headers": {"X-Scope-OrgID": "team-a"}}, {"THANOS-TENANT": "ops"}, ""),
])
def test_a_fact_header_the_upstream_settings_replace_is_refused(
        tmp_path: Path, upstream: dict[str, object], facts: dict[str, str],
        refused: str) -> None:
    # upstream.headers and the proxy's credentials replace a fact write's header of the
    # same name: facts.headers {X-Scope-OrgID: ops} with upstream.headers {X-Scope-OrgID:
    # team-a} wrote the facts into team-a, where the settings said ops
    token = tmp_path / "token"
    token.write_text("t")
    s = valid(**{k: str(token) if v == "TOKEN" else v for k, v in upstream.items()})
    s.facts.headers = facts
    if not refused:
        validate(s)
        return
    with pytest.raises(ConfigError, match=rf"facts\.headers\.{refused}: never sent"):
        validate(s)


@pytest.mark.parametrize(("section", "upstream", "name", "why"), [
    # the proxy's credentials replace a configured Authorization on every request, so the
    # header was never sent, without a word (with the URL's userinfo it was refused)
    ("upstream", {"bearer_token_file": "TOKEN"}, "Authorization",
     "never sent, the proxy's credentials (upstream.bearer_token_file, basic_auth_* or oauth2) "
     "replace it on every upstream request: choose one kind of auth"),
    ("upstream", {"basic_auth_username": "u", "basic_auth_password_file": "TOKEN"},
     "authorization", "choose one kind of auth"),
    # the body's own headers: the proxy sets them after upstream.headers, on every request
    ("upstream", {}, "Content-Type", "never sent, the proxy sets it for the body it sends"),
    ("upstream", {}, "content-encoding", "never sent, the proxy sets it for the body"),
    ("upstream", {}, "X-Prometheus-Remote-Write-Version", "never sent, the proxy sets it"),
    # the body's framing: sent as set, a Content-Length cut every body to its length (the
    # rest read as the next request) and a Transfer-Encoding had every request refused (400)
    ("upstream", {}, "Content-Length", "the body's framing is the HTTP client's own"),
    ("upstream", {}, "transfer-encoding", "the body's framing is the HTTP client's own"),
    ("facts", {}, "Content-Length", "the body's framing is the HTTP client's own"),
    ("facts", {}, "Transfer-Encoding", "the body's framing is the HTTP client's own"),
])
def test_a_header_the_proxy_never_sends_as_set_is_refused(
        tmp_path: Path, section: str, upstream: dict[str, object], name: str,
        why: str) -> None:
    """A header set in the settings that never reaches the upstream as set was accepted
    and then replaced (Authorization beside a token file, the body's headers) or broke
    every request (the framing headers); the value is never quoted (a credential)."""
    token = tmp_path / "token"
    token.write_text("t")
    s = valid(**{k: str(token) if v == "TOKEN" else v for k, v in upstream.items()})
    getattr(s, section).headers = {name: SECRET}
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith(f"{section}.headers.{name}: "), e.value
    assert why in str(e.value) and SECRET not in str(e.value), e.value


def test_the_default_forward_headers_are_all_forwarded() -> None:
    """The default listed X-Prometheus-Remote-Write-Version, which is never forwarded (the
    proxy sets its own: it may convert the body): a default that says what is not done."""
    assert never_forwarded(UpstreamSettings().forward_headers) == []
    assert never_forwarded(["host", "X-Scope-OrgID", "Content-Type", "TE"]) == [
        "host", "Content-Type", "TE"]


def test_headers_the_proxy_sends_as_set_stay_allowed() -> None:
    """Host (a virtual host behind a shared address) and the rest go out as set."""
    validate(valid(headers={"Host": "tsdb.internal", "User-Agent": "a", "Connection": "close",
                            "Authorization": "Bearer t"}))


def test_shown_url_hides_a_credential_of_the_query_too() -> None:
    """A TSDB gateway that takes its key in the query (``?api_key=``) had it shown in
    every log line naming the upstream, /metrics' url labels and the landing page."""
    assert shown_url("https://u:pw@gw:9/push?api_key=K&tenant=a&X-Auth-Token=T#f") == \
        "https://gw:9/push?api_key=(hidden)&tenant=a&X-Auth-Token=(hidden)#f"
    assert shown_url("http://tsdb/api/v1/write?extra_label=cluster=prod") == \
        "http://tsdb/api/v1/write?extra_label=cluster=prod"
    assert shown_url("http://tsdb/x?token") == "http://tsdb/x?token"  # no value
    assert shown_url("http://bob:PW/S@h:9/x?key=1", broken=True) == "http://h:9/x?key=(hidden)"


def test_without_userinfo_keeps_everything_but_the_credentials() -> None:
    assert without_userinfo("https://u:p@ss@[::1]:9/x?q=a@b") == "https://[::1]:9/x?q=a@b"
    assert without_userinfo("http://tsdb/a@b") == "http://tsdb/a@b"  # an "@" in a path
    assert without_userinfo("http://bob:PW/S@h:9/x", broken=True) == "http://h:9/x"
    assert without_userinfo("https://u:secret@tsdb:9090/api/v1/write") == \
        "https://tsdb:9090/api/v1/write"
    assert without_userinfo("http://tsdb/api/v1/write") == "http://tsdb/api/v1/write"


def test_no_default_pair_reads_exported_labels_outside_their_exporters_rules() -> None:
    """exported_* are the scraped target's own labels under honor_labels false: a default
    pair reading them for every metric let any application name another namespace's pod.
    Only the per-prefix rules of the exporters that report on other pods read them."""
    enrich = Settings().enrich
    assert not any(ns.startswith("exported_") or pod.startswith("exported_")
                   for ns, pod in enrich.pod_label_pairs)
    readers = {r.metric_prefix for r in enrich.pod_label_rules
               if any(p.namespace.startswith("exported_") for p in r.pod_label_pairs)}
    assert readers == {"DCGM_", "kube_"}


# -- the settings audit: values that were accepted and meant nothing, or broke later ------


def test_integer_settings_that_reach_c_sizes_have_an_upper_bound() -> None:
    """upstream.max_labels_per_series: 2**63 was taken, then failed as an OverflowError
    where the native plan is compiled: a traceback and exit 1 at start, a 500 halfway
    through a reload. Every integer setting is bounded now (most reach C code or a
    C-sized value: the splice's Py_ssize_t, a snappy body's 32-bit length)."""
    from msgspec import inspect as mi

    unbounded = [i.key for i in schema()
                 if isinstance(i.type, mi.IntType) and i.type.le is None]
    assert unbounded == []
    with pytest.raises(ConfigError, match=r"^upstream\.max_labels_per_series: must be 0 to "
                       r"65536, got 9223372036854775808$"):
        settings_from_dict({"upstream": {"max_labels_per_series": 2**63}})
    for key in ("max_body_bytes", "max_decoded_bytes", "min_body_bytes_per_second"):
        with pytest.raises(ConfigError, match=f"server.{key}: must be 1 to 4294967296"):
            settings_from_dict({"server": {key: 2**32 + 1}})


def test_the_lease_duration_fits_the_leases_int32() -> None:
    """1e300 was taken and written as leaseDurationSeconds, a field the API holds in an
    int32: every round refused, no writer ever elected."""
    with pytest.raises(ConfigError, match=r"^facts\.lease_duration_seconds: must be .*2147483647"):
        settings_from_dict({"facts": {"lease_duration_seconds": 1e300}})
    s = settings_from_dict({"facts": {"lease_duration_seconds": 2**31 - 1}})
    assert s.facts.lease_duration_seconds == 2**31 - 1


@pytest.mark.parametrize(
    ("section", "key", "given", "taken"),
    [("", "log_format", "JSON", "json"), ("", "log_level", "Warning", "warning"),
     ("upstream", "encoding", "ZSTD", "zstd"), ("upstream", "protocol", "V1", "v1"),
     ("enrich", "conflict_policy", "Keep", "keep"),
     ("server", "tls_client_auth_type", "requireandverifyclientcert",
      "RequireAndVerifyClientCert")],
)
def test_every_choice_is_matched_without_regard_to_case(
        section: str, key: str, given: str, taken: str) -> None:
    """log_level alone was case-folded: log_format: JSON, encoding: ZSTD were refused."""
    s = settings_from_dict({section: {key: given}} if section else {key: given})
    assert getattr(getattr(s, section) if section else s, key) == taken


@pytest.mark.parametrize("text", ["", "# only a comment\n", "~\n", "\n\n"])
def test_a_file_with_no_settings_is_refused_at_a_reload_only(
        tmp_path: Path, text: str) -> None:
    """At a reload it reset enrich.*, karta.description_paths and log_level to their
    defaults with a 200: a file caught mid-save, most likely. At start: every default."""
    path = write(tmp_path, text)
    assert load_settings(path) == Settings()
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: the file holds no "
                       "settings .*the configuration in force stays"):
        load_settings(path, empty_ok=False)
    assert load_settings(write(tmp_path, "{}\n"), empty_ok=False) == Settings()


def test_valid_names_of_kubernetes_objects_pass() -> None:
    s = valid()
    s.kube.node_name = "ip-10-0-1-2.eu-west-1.compute.internal"
    s.kube.namespaces = ["web", "kube-system", "a1"]
    s.facts.lease_name, s.facts.lease_namespace = "karta.facts-1", "monitoring"
    s.facts.identity = "karta-proxy-0 on node 1"
    validate(s)


def test_node_mode_facts_pass_with_one_writer_or_none() -> None:
    """The refusal of node mode's facts without an election is of that one combination:
    an elected writer, no facts, facts not allowed in node mode, and a snapshot (which
    ignores kube.node_name) pass."""
    for change in (lambda s: setattr(s.facts, "leader_election", True),
                   lambda s: setattr(s.facts, "enabled", False),
                   lambda s: setattr(s.facts, "allow_in_node_mode", False),
                   lambda s: setattr(s, "snapshot", __file__)):
        s = valid()
        _node_mode_facts(s)
        change(s)
        validate(s)


def test_a_kubeconfig_for_the_lease_is_checked_with_a_snapshot_too(tmp_path: Path) -> None:
    """docs/operations.md: a file a setting names that does not exist is exit 2; with a
    snapshot the check was skipped, and the Lease's connection failed the start (1)."""
    snap = write(tmp_path, "{}")
    s = valid()
    s.snapshot, s.kube.kubeconfig = str(snap), "/nonexistent"
    validate(s)  # no Lease: the kubeconfig is not used
    s.facts.leader_election = True
    with pytest.raises(ConfigError, match=r"kube\.kubeconfig: file '/nonexistent' does not"):
        validate(s)
    s.facts.enabled = False  # no fact writer, no Lease
    validate(s)


def test_a_kubeconfig_path_list_is_read_from_its_first_non_empty_entry(
        tmp_path: Path) -> None:
    """As kubectl reads $KUBECONFIG: ':/path' was 'file ':/path' does not exist'."""
    kc = write(tmp_path, "{}")
    assert first_kubeconfig(f"{os.pathsep}{kc}") == str(kc)
    assert first_kubeconfig(f"{os.pathsep}{os.pathsep}{kc}{os.pathsep}/x") == str(kc)
    assert first_kubeconfig(os.pathsep) == os.pathsep
    s = valid()
    s.kube.kubeconfig = f"{os.pathsep}{kc}"
    validate(s)
    from proxy.kube.client import kubeconfig_path

    assert kubeconfig_path(s.kube) == str(kc)  # the file the client loads, the one checked


@pytest.mark.parametrize(("label", "external", "check", "said"), [
    ("cluster", {"cluster": "prod-1"}, ("cluster", "prod-1"), False),
    ("cluster", {}, None, True),  # no cluster of its own: off, said at the start
    ("cluster", {"region": "eu"}, None, True),
    ("region", {"cluster": "c", "region": "eu"}, ("region", "eu"), False),
    ("", {"cluster": "prod-1"}, None, False),  # turned off: nothing to say
])
def test_the_cluster_check_reads_the_facts_external_labels(
        label: str, external: dict[str, str], check: tuple[str, str] | None,
        said: bool) -> None:
    from proxy.config import cluster_check, cluster_check_off

    s = Settings()
    s.enrich.cluster_label = label
    s.facts.external_labels = external
    validate(s, require_upstream=False)
    assert cluster_check(s) == check
    line = cluster_check_off(s)
    assert bool(line) == said
    if said:
        assert f"facts.external_labels.{label}" in line and 'enrich.cluster_label' in line


#: the start of the refusal of an upstream.url storing every series under cluster=c2
_STORES_C2 = ("upstream.url: its extra_label sets cluster=c2 on every series VictoriaMetrics "
              "stores through it, but this proxy's cluster is cluster=c1 "
              "(facts.external_labels.cluster, checked by enrich.cluster_label): ")


@pytest.mark.parametrize(("url", "changes", "refused"), [
    ("/api/v1/write?extra_label=cluster=c2", None, _STORES_C2 + (
        "every relayed series would be forwarded unstamped (other_cluster), the fact "
        "series stored under cluster=c2; make the extra_label cluster=c1 (or remove it), "
        "or set facts.external_labels.cluster: c2 if this proxy is that cluster's; "
        "enrich.cluster_label: \"\" turns the check off")),
    ("/api/v1/write?extra_label=cluster=c1", None, ""),
    ("/api/v1/write?extra_label=cluster=c2&extra_label=cluster=c1", None, ""),  # the last
    ("/api/v1/write?extra_label=cluster=c1&extra_label=cluster=c2", None, _STORES_C2),
    ("/api/v1/write?extra_label=cluster=c2&extra_label=cluster=", None, _STORES_C2),
    ("/api/v1/write?extra%5Flabel=cluster%3Dc2", None, _STORES_C2),  # as Go decodes it
    ("/api/v1/write?extra_label=cluster=", None, ""),  # empty: the series' own
    ("/api/v1/write?extra_label=region=c2", None, ""),
    ("/api/v1/write?extra_label=cluster=c2;x=1", None, ""),  # a pair Go skips
    # read as the client sends it: the bad escape goes as %25zz, stored as c%zz
    ("/api/v1/write?extra_label=cluster=c%zz", None,
     "upstream.url: its extra_label sets cluster=c%zz on every series"),
    ("/insert/0/prometheus?extra_label=cluster=c2", None, _STORES_C2),
    # the check off: by the label, or no cluster of its own
    ("/api/v1/write?extra_label=cluster=c2", {"enrich.cluster_label": ""}, ""),
    ("/api/v1/write?extra_label=cluster=c2", {"facts.external_labels": {"region": "eu"}},
     ""),
    ("/api/v1/write?extra_label=region=us", {
        "enrich.cluster_label": "region",
        "facts.external_labels": {"cluster": "c1", "region": "eu"}},
     "upstream.url: its extra_label sets region=us on every series"),
    ("/api/v1/write?extra_label=cluster=c2", {"facts.enabled": False},
     _STORES_C2 + "every relayed series would be forwarded unstamped (other_cluster); "),
    # a {tenant} in the value: read where requests naming no tenant and the facts go
    ("/api/v1/write?extra_label=cluster=c{tenant}", None,
     "upstream.url (its {tenant} as upstream.default_tenant 0: where requests naming no "
     "tenant and the fact series go): its extra_label sets cluster=c0 on every series"),
    ("/api/v1/write?extra_label=cluster=c{tenant}", {"upstream.default_tenant": "1"}, ""),
    ("/insert/{tenant}/prometheus?extra_label=cluster=c2", None, "upstream.url: its "),
])
def test_an_upstream_url_storing_another_cluster_is_refused(
        url: str, changes: dict[str, Any] | None, refused: str) -> None:
    """VictoriaMetrics sets upstream.url's extra_label on every series it stores, over
    the series' own: one naming another cluster than facts.external_labels' made the
    cluster check relay every request unstamped (other_cluster), found a request at a
    time. The last non-empty one counts, read as VictoriaMetrics reads them; the message
    names both values and what to change, never the URL's password."""
    s = valid(url="http://user:secret@127.0.0.1:8428" + url)
    s.facts.external_labels = {"cluster": "c1"}
    for key, value in (changes or {}).items():
        section, name = key.split(".")
        setattr(getattr(s, section), name, value)
    if not refused:
        validate(s)
        return
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith(refused)
    assert "secret" not in str(e.value)


@pytest.mark.parametrize("address", ["127.0.0.1:\u00b2", "127.0.0.1:\u0669"])
def test_parse_host_port_refuses_digits_that_are_not_ascii(address: str) -> None:
    """'\u00b2' is a digit to str.isdigit(): int() raised a ValueError, a traceback at start."""
    with pytest.raises(ConfigError, match=r"server\.listen_address: expected HOST:PORT"):
        parse_host_port(address)


@pytest.mark.parametrize("address", ["::1:9091", "fd00::5:9091", "::1", "::9091"])
def test_parse_host_port_refuses_an_ipv6_host_without_brackets(address: str) -> None:
    """Which colon begins the port? '::1' was bound as host ':' port 1, 'fd00::5:9091' as
    host fd00::5 port 9091 (Go's SplitHostPort refuses both: too many colons)."""
    with pytest.raises(ConfigError, match=r"an IPv6 address goes in brackets, \[v6\]:PORT"):
        parse_host_port(address)


# -- upstream.oauth2 ---------------------------------------------------------------------------


#: a Prometheus remote_write's oauth2 block, as it moves behind the proxy
OAUTH2_YAML = """\
upstream:
  url: https://mimir.example/api/v1/push
  oauth2:
    client_id: karta
    client_secret_file: {secret}
    scopes: [metrics.write, openid]
    token_url: https://idp.example/realms/x/protocol/openid-connect/token
    endpoint_params:
      audience: mimir
"""


def _oauth2(tmp_path: Path, **oauth2: object) -> Settings:
    """Settings with ``upstream.oauth2`` set (its secret file written), then ``oauth2``'s
    keys over it ("" removes one)."""
    secret = tmp_path / "client-secret"
    secret.write_text(f"  {SECRET}\n")
    s = valid()
    o = s.upstream.oauth2
    o.client_id, o.client_secret_file = "karta", str(secret)
    o.token_url = "https://idp.example/oauth/token"
    for k, v in oauth2.items():
        setattr(o, k, v)
    return s


def test_an_oauth2_block_of_prometheus_is_taken_as_it_is(tmp_path: Path) -> None:
    """``remote_write``'s ``oauth2:`` (client_id, client_secret_file, scopes, token_url,
    endpoint_params) moves behind the proxy as ``upstream.oauth2``; it gives the proxy its
    own Authorization (which facts.headers may then not set)."""
    from proxy.config import oauth2_on, sets_authorization

    secret = tmp_path / "client-secret"
    secret.write_text(SECRET)
    path = tmp_path / "karta.yaml"
    path.write_text(OAUTH2_YAML.format(secret=secret))
    s = load_settings(path)
    validate(s)
    o = s.upstream.oauth2
    assert (o.client_id, o.client_secret_file, o.scopes, o.endpoint_params) == (
        "karta", str(secret), ["metrics.write", "openid"], {"audience": "mimir"})
    assert oauth2_on(s.upstream) and sets_authorization(s.upstream)
    assert not oauth2_on(Settings().upstream)


@pytest.mark.parametrize(("oauth2", "upstream", "starts"), [
    ({"token_url": ""}, {}, "upstream.oauth2.token_url: required with upstream.oauth2"),
    ({"token_url": "ftp://idp/token"}, {},
     "upstream.oauth2.token_url: expected an http:// or https:// URL"),
    ({"token_url": "idp.example/token"}, {},
     "upstream.oauth2.token_url: expected an http:// or https:// URL"),
    ({"token_url": f"https://karta:{SECRET}@idp/token"}, {},
     "upstream.oauth2.token_url: holds user:password@"),
    ({"token_url": "https://idp/token "}, {},
     "upstream.oauth2.token_url: holds whitespace"),
    ({"token_url": "https://idp:99999/token"}, {}, "upstream.oauth2.token_url: not a valid URL"),
    ({"client_id": ""}, {}, "upstream.oauth2.client_id: required with upstream.oauth2"),
    ({"client_secret_file": ""}, {},
     "upstream.oauth2.client_secret_file: required with upstream.oauth2"),
    ({"client_secret_file": "/nonexistent/secret"}, {},
     "upstream.oauth2.client_secret_file: file '/nonexistent/secret' does not exist"),
    ({}, {"bearer_token_file": "FILE"},
     "upstream.oauth2 and upstream.bearer_token_file: choose one kind of auth"),
    ({}, {"basic_auth_username": "u", "basic_auth_password_file": "FILE"},
     "upstream.oauth2 and upstream.basic_auth_*: choose one kind of auth"),
    ({}, {"url": f"http://u:{SECRET}@127.0.0.1:9090/api/v1/write"},
     "upstream.oauth2 and the user:password@ of upstream.url: choose one kind of auth"),
    ({"scopes": ["a"], "endpoint_params": {"scope": "b"}}, {},
     "upstream.oauth2.endpoint_params.scope: upstream.oauth2.scopes sets the scope"),
    ({"endpoint_params": {"client_secret": SECRET}}, {},
     "upstream.oauth2.endpoint_params.client_secret: the client's credentials are "
     "upstream.oauth2.client_secret_file"),
    ({"tls_cert_file": "FILE"}, {},
     "upstream.oauth2.tls_cert_file and upstream.oauth2.tls_key_file: set both or neither"),
    ({"tls_ca_file": "FILE"}, {}, "upstream.oauth2.tls_ca_file: cannot load"),
    ({"proxy_url": "ftp://proxy:3128"}, {},
     "upstream.oauth2.proxy_url: only http://, https:// and socks5:// proxies are supported"),
])
def test_oauth2_settings_errors_name_the_setting_and_no_secret(
        tmp_path: Path, oauth2: dict[str, object], upstream: dict[str, object],
        starts: str) -> None:
    """What Prometheus' ``OAuth2`` checks at load (client_id, token_url, a client secret;
    at most one of basic_auth, oauth2, bearer_token_file), and what it found only at each
    token request (a scope set twice: ``cannot overwrite parameter "scope"``), are one
    line at start naming the setting; the secret is in none (FILE: a file holding it, not
    PEM)."""
    secret_file = tmp_path / "some-file"
    secret_file.write_text(SECRET)
    s = _oauth2(tmp_path, **{k: str(secret_file) if v == "FILE" else v
                             for k, v in oauth2.items()})
    for k, v in upstream.items():
        setattr(s.upstream, k, str(secret_file) if v == "FILE" else v)
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith(starts), e.value
    assert SECRET not in str(e.value) and "\n" not in str(e.value)


def test_an_oauth2_secret_file_that_cannot_be_sent_is_said_without_its_text(
        tmp_path: Path) -> None:
    s = _oauth2(tmp_path)
    Path(s.upstream.oauth2.client_secret_file).write_bytes(SECRET.encode() + b"\xff")
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith("upstream.oauth2.client_secret_file: ")
    assert "not UTF-8" in str(e.value) and SECRET not in str(e.value)


@pytest.mark.parametrize("section", ["upstream", "facts"])
def test_an_authorization_header_beside_oauth2_is_refused(tmp_path: Path,
                                                          section: str) -> None:
    """The token replaces any other Authorization on every upstream request: one set in
    upstream.headers or facts.headers would never be sent."""
    s = _oauth2(tmp_path)
    getattr(s, section).headers = {"Authorization": f"Bearer {SECRET}"}
    with pytest.raises(ConfigError) as e:
        validate(s)
    assert str(e.value).startswith(f"{section}.headers.Authorization: never sent"), e.value
    assert "oauth2" in str(e.value) and SECRET not in str(e.value)


def test_an_inline_client_secret_is_an_unknown_key_not_quoted(tmp_path: Path) -> None:
    """Prometheus' inline ``client_secret`` is not taken (every credential of the proxy is
    a file): the error points at client_secret_file, and never quotes the value."""
    path = tmp_path / "karta.yaml"
    path.write_text("upstream:\n  url: http://tsdb/api/v1/write\n  oauth2:\n"
                    f"    client_id: karta\n    client_secret: {SECRET}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    assert "unknown key 'upstream.oauth2.client_secret': did you mean " \
           "'upstream.oauth2.client_secret_file'?" in str(e.value), e.value
    assert SECRET not in str(e.value)


def test_an_oauth2_grant_type_may_be_set_as_x_oauth2_lets_it_be(tmp_path: Path) -> None:
    s = _oauth2(tmp_path, endpoint_params={"grant_type": "urn:x", "audience": "a"},
                token_url="http://127.0.0.1:1/token")
    validate(s)
