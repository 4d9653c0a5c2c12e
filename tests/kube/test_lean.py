"""kubernetes-asyncio loaded lean (proxy/kube/lean.py), in fresh interpreters: in this
test session the package may be imported whole already, and then the proxy keeps it so."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.kubesim import KubeSim

ROOT = Path(__file__).resolve().parents[2]

#: what the child reports: the generated modules loaded, by package
REPORT = """
import json, sys
def loaded(prefix):
    return sorted(m for m in sys.modules if m.startswith(prefix))
print(json.dumps({"api": loaded("kubernetes_asyncio.client.api."),
                  "models": loaded("kubernetes_asyncio.client.models.")}))
"""

#: the proxy's client against the simulator: a list of pods, and the Lease calls the fact
#: writer's election makes (the generated CoordinationV1Api, answers deserialized to V1Lease)
AGAINST_SIM = """
import asyncio, sys
from proxy.config import KubeSettings
from proxy.kube.client import KubeClient
from proxy.kube.lean import client as k8s

async def main():
    kube = await KubeClient.connect(KubeSettings(kubeconfig=sys.argv[1]))
    try:
        pods = await kube.request_json("/api/v1/namespaces/default/pods")
        assert pods["kind"] == "PodList", pods
        api = k8s.CoordinationV1Api(kube.api)
        await api.create_namespaced_lease("default", k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name="lean"),
            spec=k8s.V1LeaseSpec(holder_identity="me", lease_duration_seconds=15)))
        got = await api.read_namespaced_lease("lean", "default")
        assert isinstance(got, k8s.V1Lease) and got.spec.holder_identity == "me", got
    finally:
        await kube.close()

asyncio.run(main())
""" + REPORT


async def _child(code: str, *args: str) -> dict[str, list[str]]:
    """Run ``code`` in a fresh interpreter (the simulator, on this loop, answers it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    got: dict[str, list[str]] = json.loads(out.decode().splitlines()[-1])
    return got


async def test_the_proxy_client_loads_only_the_generated_modules_it_uses(sim: KubeSim) -> None:
    got = await _child(AGAINST_SIM, str(sim.write_kubeconfig()))
    # before: ~1,500 modules (every API and model class) with the first import
    assert got["api"] == ["kubernetes_asyncio.client.api.coordination_v1_api"]
    assert set(got["models"]) <= {f"kubernetes_asyncio.client.models.{m}" for m in (
        "v1_lease", "v1_lease_spec", "v1_object_meta", "v1_managed_fields_entry",
        "v1_owner_reference")}
    assert "kubernetes_asyncio.client.models.v1_lease" in got["models"]


async def test_a_name_outside_the_lean_set_gets_the_whole_package() -> None:
    got = await _child("""
import sys, proxy.kube.client
lean = [m for m in sys.modules if m.startswith("kubernetes_asyncio.client.models.")]
assert not lean, lean  # lean until then
from kubernetes_asyncio.client import V1Pod
assert V1Pod.__name__ == "V1Pod"
import kubernetes_asyncio
assert kubernetes_asyncio.__project__ == "kubernetes_asyncio"  # set, not imported: whole
import kubernetes_asyncio.watch
from kubernetes_asyncio.client.models import *  # the real __init__, run once
assert V1Deployment.__module__ == "kubernetes_asyncio.client.models.v1_deployment"
from kubernetes_asyncio.client import CoreV1Api
""" + REPORT)
    assert "kubernetes_asyncio.client.api.core_v1_api" in got["api"]
    assert len(got["models"]) > 500


async def test_nothing_of_kubernetes_asyncio_is_loaded_whole_by_the_proxy_at_start() -> None:
    """``python -m proxy``'s modules imported as a start imports them: none of the ~1,500."""
    got = await _child("import proxy.runtime, proxy.lease, proxy.kube.source" + REPORT)
    assert got == {"api": [], "models": []}
