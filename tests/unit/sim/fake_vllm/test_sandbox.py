"""The fake vLLM as a process in a pod: the weights' download costs time once per cache (and
prints vLLM's own line for it), a wildcard --host binds the pod IP, and it records where the
engine's pynvml came from. Run for real, as subprocesses over a temporary GPU root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_sim.fake_vllm.hf_download import checkpoint
from rankguard_sim.fake_vllm.main import PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.fake_vllm.sandbox import engine_pynvml, weight_downloads
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.kubelet.image import pynvml_file
from rankguard_sim.physics import gpus
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, builtin_dir, load_scenario
from rankguard_sim.vllm_snapshot import download_log_seconds, message, snapshot
from rankguard_sim.waiting import wait_for
from tests import REPO

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
POD_IP = "127.0.0.211"
TIME_SCALE = 50.0
RATE = 2_500_000_000  # 2.5 GB/s: 141 GB in 56 s unscaled, ~1.1 s at the time scale


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    """support-70b-tp4 (the built-in with a model_config) with a download rate of its own."""
    doc = yaml.safe_load((builtin_dir() / "support-70b-tp4.yaml").read_text())
    doc["model_config"] = str(builtin_dir() / doc["model_config"])
    doc["download"] = {"bytes_per_second": RATE, "source": "a test's rate"}
    path = tmp_path / "support-70b-tp4-download.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Pod:
    """A fake vLLM started the way the process kubelet starts the engine in a pod."""

    def __init__(self, tmp_path: Path, scenario: Path) -> None:
        self.s = load_scenario(scenario)
        self.root = tmp_path / "gpus"
        self.uuids = gpus.create_gpus(self.root, self.s.world_size, self.s.gpu.total_bytes, seed="pod")
        for rank, uuid in enumerate(self.uuids):
            gpus.set_comm_init_bytes(self.root, uuid, self.s.comm_init_bytes(rank))
        self.scenario = scenario
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.metrics = ""

    def env(self, hf_home: Path, **extra: str) -> dict[str, str]:
        return {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(self.tmp_path / "home"),
            "HF_HOME": str(hf_home),
            gpus.GPU_ROOT_ENV: str(self.root),
            VISIBLE_DEVICES_ENV: ",".join(self.uuids),
            SCENARIO_ENV: str(self.scenario),
            TIME_SCALE_ENV: str(TIME_SCALE),
            PEAK_HOLD_ENV: "0.05",
            **extra,
        }

    def serve(self, hf_home: Path, port: int, *flags: str, **env: str) -> str:
        """Start it, wait until it serves /health on the pod IP, read /metrics, stop it: its
        output (then self.metrics)."""
        log = self.tmp_path / f"vllm-{len(self.procs)}.log"
        argv = [str(SHIM), "serve", self.s.model.name, "-tp", "4", "--port", str(port), *flags]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(hf_home, **env))
        self.procs.append(proc)

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://{POD_IP}:{port}/health", timeout=1) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_for(
            "the fake vLLM to serve /health", healthy, 90, every=0.05, dump=lambda: log.read_text()[-3000:]
        )
        with urllib.request.urlopen(f"http://{POD_IP}:{port}/metrics", timeout=2) as r:
            self.metrics = r.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        return log.read_text()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def cache_files(repo: Path) -> dict[str, tuple[int, int]]:
    """Every blob and snapshot link of a cached repo: (inode, mtime) by path. A file fetched or
    stored again is written anew (os.replace), so it changes here."""
    return {
        str(p.relative_to(repo)): (p.lstat().st_ino, p.lstat().st_mtime_ns)
        for folder in ("blobs", "snapshots")
        for p in (repo / folder).rglob("*")
    }


@pytest.fixture
def pod(tmp_path: Path, scenario_file: Path) -> Iterator[Pod]:
    p = Pod(tmp_path, scenario_file)
    try:
        yield p
    finally:
        p.close()


def test_the_download_line_is_vllms_own_from_the_snapshot() -> None:
    entry = snapshot().messages("weights_download_time")[0]
    assert entry["file"] == "vllm/model_executor/model_loader/weight_utils.py"
    assert download_log_seconds() == 0.5  # vLLM logs it only above half a second
    line = f"(Worker_TP0 pid=7) INFO 01-02 03:04:05 [x.py:1] {message('weights_download_time', 'org/m', 1.5)}"
    assert weight_downloads(line) == [("org/m", 1.5)]


def test_weights_download_once_per_cache_in_time_and_a_wildcard_binds_the_pod_ip(
    pod: Pod, tmp_path: Path
) -> None:
    cache = tmp_path / "model-cache"  # a model-cache volume, shared by the pod's restarts
    config = pod.s.model_config
    assert config is not None
    weights = sum(f.nbytes for f in checkpoint(config) if f.weights)
    expected = weights / RATE / TIME_SCALE
    port = free_port()

    first = pod.serve(cache, port, "--host", "0.0.0.0", RANKGUARD_SIM_POD_IP=POD_IP)
    downloads = weight_downloads(first)
    assert [m for m, _ in downloads] == [pod.s.model.name] * 4  # one line per worker, as vLLM's
    # The time the fake says it spent is at least what the rate costs; how much more is up to
    # the machine (a loaded one stretches every pause), so nothing bounds it from above.
    assert all(secs >= expected * 0.9 for _, secs in downloads), (expected, downloads)
    # ... and it was spent before the engine served: every download line precedes the server's.
    lines = first.splitlines()
    started = message("api_server_start", "http://0.0.0.0:", file_suffix="api_server/entry.py")
    serving = [i for i, ln in enumerate(lines) if started in ln]
    assert serving, first[-3000:]  # vLLM says what it was asked
    assert max(i for i, ln in enumerate(lines) if weight_downloads(ln)) < serving[0]
    repo = cache / "hub" / "models--acme-corp--support-70b"
    snapshots = list(repo.glob("snapshots/*"))
    assert len(snapshots) == 1 and (snapshots[0] / "model-00030-of-00030.safetensors").exists()
    stored = cache_files(repo)

    pod.serve(cache, port, RANKGUARD_SIM_POD_IP=POD_IP)  # no --host at all
    # The files were there: nothing was fetched again, every blob and snapshot link is the one the
    # first start wrote. (Whether it prints a download line is vLLM's own 0.5 s rule on the time
    # the look-up took, which a loaded machine can stretch: not asserted.)
    assert cache_files(repo) == stored

    third = pod.serve(tmp_path / "another-cache", port, "--host", "::", RANKGUARD_SIM_POD_IP=POD_IP)
    assert len(weight_downloads(third)) == 4  # a new cache downloads again


def test_the_engine_pynvml_is_recorded_and_the_agent_bundle_copy_would_show(pod: Pod, tmp_path: Path) -> None:
    port = free_port()
    out = pod.serve(tmp_path / "c", port, RANKGUARD_SIM_POD_IP=POD_IP)
    assert engine_pynvml(out) == pynvml_file()
    assert f'rankguard_sim_engine_pynvml_info{{error="",file="{pynvml_file()}"}} 1.0' in pod.metrics
    bundle = tmp_path / "agent-bundle"
    bundle.mkdir()
    (bundle / "pynvml.py").write_text("# the agent's copy\n")
    leaked = pod.serve(tmp_path / "c", port, RANKGUARD_SIM_POD_IP=POD_IP, PYTHONPATH=str(bundle))
    assert engine_pynvml(leaked) == str(bundle / "pynvml.py")  # what an engine inheriting PYTHONPATH gets
    assert engine_pynvml("no such line") is None


def test_an_explicit_host_is_bound_as_given(pod: Pod, tmp_path: Path) -> None:
    port = free_port()
    # binding the pod IP explicitly ($(POD_IP)) works as before
    out = pod.serve(tmp_path / "c", port, "--host", POD_IP, RANKGUARD_SIM_POD_IP=POD_IP)
    assert f"on http://{POD_IP}:{port}" in out
