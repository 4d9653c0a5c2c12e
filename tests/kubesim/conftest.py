"""The simulator and a kubernetes-asyncio client on it (unpatched, as the proxy uses it),
for the simulator's own tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from tests.kubesim import KubeSim


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(bookmark_interval=0.2) as s:
        yield s


@pytest.fixture
async def api(sim: KubeSim) -> AsyncIterator[k8s.ApiClient]:
    cfg = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=str(sim.write_kubeconfig()),
                                      client_configuration=cfg, persist_config=False)
    client = k8s.ApiClient(configuration=cfg)
    yield client
    await client.close()
