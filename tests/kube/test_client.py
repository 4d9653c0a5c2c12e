"""Connection helpers of proxy/kube/client.py that need no server."""

from __future__ import annotations

from pathlib import Path

from proxy.kube.client import default_namespace


def test_default_namespace_prefers_pod_namespace(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("from-sa\n")
    assert default_namespace({"POD_NAMESPACE": " karta-proxy "}, sa) == "karta-proxy"


def test_default_namespace_from_service_account_file(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("karta-proxy\n")
    assert default_namespace({}, sa) == "karta-proxy"
    assert default_namespace({"POD_NAMESPACE": ""}, sa) == "karta-proxy"


def test_default_namespace_outside_a_cluster(tmp_path: Path) -> None:
    assert default_namespace({}, tmp_path / "absent") == "default"
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    assert default_namespace({}, empty) == "default"
