"""config/image: the image builds with buildah on a Debian base made by mmdebstrap (no image
registry), is what the Containerfile promises (entrypoint, non-root, no compiler, the
native splice), and relays a Prometheus agent's writes into a real Prometheus.

Skipped cleanly without root, buildah, mmdebstrap or prometheus; .ci/run installs them.
The build is config/image/build.sh, the same script a user without a registry runs; its
base tarball and wheels are cached under ~/.cache/karta-proxy/image (per day / per
dependency list), so only the first run of a day pays for mmdebstrap.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from proxy.config import Settings
from proxy.demo_exporter import DEMO_SNAPSHOT, FixtureExporter
from proxy.runtime import Proxy
from tests.peers.conftest import (
    WORKLOAD_KEY,
    Peers,
    close,
    expected_by_workload,
    free_port,
    query,
    remote_write,
    scalar_by,
    scrape_configs,
    wait_until,
)

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "config" / "image" / "build.sh"
TAG = "localhost/karta-proxy:test"
#: where the Containerfile links the bundled demo data
IMAGE_SNAPSHOT = "/opt/karta-proxy/demo/snapshot.yaml"
ISOLATION = ("--isolation", "chroot")
BUILD_TIMEOUT = 1200.0


def _need_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("building an image with buildah here needs root")
    for binary, package in (("buildah", "buildah"), ("mmdebstrap", "mmdebstrap"),
                            ("prometheus", "prometheus")):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} not installed (Debian package: {package})")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    _need_tools()
    log = tmp_path_factory.mktemp("image") / "build.log"
    t0 = time.monotonic()
    with open(log, "wb") as err:
        done = subprocess.run([str(BUILD), TAG], stdout=subprocess.PIPE, stderr=err,
                              timeout=BUILD_TIMEOUT, check=False)
    if done.returncode != 0:
        raise AssertionError(f"build.sh failed ({done.returncode}):\n"
                             f"{log.read_text(errors='replace')[-4000:]}")
    assert done.stdout.decode().strip().splitlines()[-1] == TAG
    print(f"image built in {time.monotonic() - t0:.0f}s")
    return TAG


@pytest.fixture
def container(image: str) -> Iterator[str]:
    """A working container of the image, removed afterwards."""
    name = subprocess.run(["buildah", "from", "-q", image], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def run_in(container: str, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``argv`` in the container, as the image's user (``buildah run`` takes the USER, not
    the ENTRYPOINT: the entrypoint is checked in the image's config)."""
    return subprocess.run(["buildah", "run", *ISOLATION, container, "--", *argv],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_image_config_is_what_the_containerfile_promises(image: str, container: str) -> None:
    inspect = subprocess.run(["buildah", "inspect", "--type", "image", image],
                             capture_output=True, text=True, check=True)
    config = json.loads(inspect.stdout)["OCIv1"]["config"]
    assert config["Entrypoint"] == ["karta-proxy"]
    assert config["User"] == "10001:10001"
    assert "9091/tcp" in config["ExposedPorts"]

    ident = run_in(container, "id", "-u")
    assert ident.returncode == 0 and ident.stdout.strip() == "10001", ident
    # the final stage has the interpreter and the virtualenv, and no compiler
    compilers = run_in(container, "sh", "-c",
                       "for c in gcc cc c99 x86_64-linux-gnu-gcc; do command -v $c; done; "
                       "ls /usr/include/python3*/Python.h 2>/dev/null; true")
    assert compilers.returncode == 0 and compilers.stdout.strip() == "", compilers
    version = run_in(container, "karta-proxy", "--version")
    assert version.returncode == 0, version
    assert "native splice" in version.stdout, version.stdout
    venv = run_in(container, "/opt/karta-proxy/bin/python", "-c",
                  "import proxy.wire._splice as m; print(m.__file__)")
    assert venv.returncode == 0 and venv.stdout.startswith("/opt/karta-proxy/"), venv


@dataclass
class ImageProxy:
    """karta-proxy running in the image through ``buildah run`` (host network)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def inner_pid(self) -> int | None:
        """The proxy's own process under buildah's chain (chroot isolation has no PID
        namespace), so SIGTERM reaches it directly and its graceful stop is observed."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        todo, found = [self.proc.pid], None
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[0] == b"/opt/karta-proxy/bin/python" and not any(
                    a.endswith(b"jq_child.py") for a in cmd):
                found = pid  # the proxy, not its jq sandbox child (a python below it)
            todo.extend(children.get(pid, []))
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            pid = self.inner_pid()
            os.kill(pid if pid is not None else self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


async def test_agent_through_the_image_into_prometheus(container: str, tmp_path: Path) -> None:
    peers = Peers(tmp_path)
    index: Proxy | None = None
    running: ImageProxy | None = None
    try:
        async with FixtureExporter(DEMO_SNAPSHOT) as exporter:
            receiver = await peers.prometheus_receiver()
            port = free_port()
            log_path = tmp_path / "image-proxy.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    ["buildah", "run", *ISOLATION, container, "--", "karta-proxy",
                     "--listen-address", f"127.0.0.1:{port}",
                     "--upstream-url", receiver.base_url + "/api/v1/write",
                     "--snapshot", IMAGE_SNAPSHOT, "--no-facts", "--log-format", "json"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            running = ImageProxy(proc, log_path, f"http://127.0.0.1:{port}")

            async def ready() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"the image's proxy exited: {running.log_tail()}")
                async with aiohttp.ClientSession() as s, s.get(
                    running.url + "/-/ready", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    return r.status == 200

            await wait_until(ready, timeout=60, what="the image's karta-proxy ready")

            # the same snapshot in this process, only to know what each pod must get
            s = Settings()
            s.snapshot = str(DEMO_SNAPSHOT)
            s.upstream.url = receiver.base_url + "/api/v1/write"
            s.server.listen_address = "127.0.0.1:0"
            s.facts.enabled = False
            index = Proxy(s)
            await index.start()
            expected = expected_by_workload(exporter, index)
            assert expected.memory, "the demo snapshot attributes some pods"

            await peers.prometheus_agent({
                "global": {"scrape_interval": "1s"},
                "scrape_configs": scrape_configs(exporter),
                "remote_write": [remote_write(running.url + "/api/v1/write")],
            })
            n_pods = len(exporter.model.pods)

            n_gpus = len(exporter.model.gpus)

            async def landed() -> bool:
                # both scrape jobs' series: the kubelet's and DCGM's land independently
                pods = await query(receiver.base_url, "count(pod_memory_working_set_bytes)")
                gpus = await query(receiver.base_url, "count(DCGM_FI_DEV_GPU_UTIL)")
                return (bool(pods) and int(float(pods[0]["value"][1])) == n_pods
                        and bool(gpus) and int(float(gpus[0]["value"][1])) == n_gpus)

            await wait_until(landed, timeout=60,
                             what="pod and GPU series in the receiving Prometheus")
            mem = await scalar_by(
                receiver.base_url, "sum by (karta_namespace, karta_kind, karta_workload) "
                "(pod_memory_working_set_bytes{karta_workload!=''})", WORKLOAD_KEY)
            assert mem.keys() == expected.memory.keys()
            for k, v in expected.memory.items():
                assert close(mem[k], v), (k, mem[k], v)
            util = await scalar_by(
                receiver.base_url, "sum by (karta_namespace, karta_kind, karta_workload) "
                "(DCGM_FI_DEV_GPU_UTIL{karta_workload!=''})", WORKLOAD_KEY)
            assert util.keys() == expected.gpu_util.keys()
            async with aiohttp.ClientSession() as session, session.get(
                running.url + "/"
            ) as r:
                assert "native" in await r.text()
            # the descriptions' jq ran in the sandbox child inside the image (its Python,
            # its package): none failed, no child failed to start
            async with aiohttp.ClientSession() as session, session.get(
                running.url + "/metrics"
            ) as r:
                page = await r.text()
            assert 'karta_proxy_jq_sandbox_restarts_total{reason="start_failed"} 0.0' in page
            jq_errors = [line for line in page.splitlines()
                         if line.startswith("karta_proxy_jq_errors_total{")]
            assert jq_errors and all(line.endswith(" 0.0") for line in jq_errors), jq_errors
            peers.stop_all()
            # SIGTERM to the proxy inside: a clean stop is exit 0 through buildah run
            assert running.stop() == 0, running.log_tail()
            assert "karta-proxy stopped" in running.log_tail()
    finally:
        if running is not None:
            running.stop()
        if index is not None:
            await index.stop()
        peers.stop_all()
