"""The agent on a real NVIDIA GPU: NVML against the CUDA driver, the probe with NCCL, and a
real CUDA OOM under the launcher. Run with `bash tests/gpu/run.sh`; skips without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

AGENT_ROOT = Path(__file__).resolve().parents[2] / "agent"
MIB = 1 << 20
GIB = 1 << 30


def _why_no_gpu() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("pynvml") is None:
        return "nvidia-ml-py (pynvml) is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return None


_REASON = _why_no_gpu()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs an NVIDIA GPU: {_REASON}"),
]


def gpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANKGUARD_SIM_GPU_ROOT", None)  # the real thing, not the sandbox
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(AGENT_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def test_nvml_backend_agrees_with_the_cuda_driver() -> None:
    import torch

    from rankguard_agent.gpu.nvml import NvmlBackend

    env = gpu_env()
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    backend = NvmlBackend(env=env)
    try:
        ranks = backend.ranks()
        assert len(ranks) == torch.cuda.device_count()
        for i, dev in enumerate(ranks):
            free_t, total_t = torch.cuda.mem_get_info(i)
            reading = backend.read(i)
            assert reading.error is None, reading
            assert abs(reading.total_bytes - total_t) <= max(512 * MIB, total_t // 100), (reading, total_t)
            assert abs(reading.free_bytes - free_t) <= 256 * MIB, (reading, free_t)
            assert reading.used_bytes + reading.free_bytes == reading.total_bytes
            props = torch.cuda.get_device_properties(i)
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                assert dev.uuid.lower().endswith(str(uuid).lower()), (dev.uuid, uuid)
        # This process holds a context on every device now. NVML lists compute processes by
        # host pid (not ours inside a container), so check the shape, not our pid.
        for p in backend.processes(0) or []:
            assert p.pid > 0 and (p.used_bytes is None or p.used_bytes > 0), p
    finally:
        backend.close()


def test_probe_with_nccl_measures_every_rank_and_releases_everything() -> None:
    import torch

    from rankguard_agent.gpu.nvml import NvmlBackend
    from rankguard_agent.probe import ProbeConfig, run_probe

    env = gpu_env()
    n = torch.cuda.device_count()
    backend = NvmlBackend(env=env)
    try:
        before = [backend.read(i).free_bytes for i in range(n)]
        cfg = ProbeConfig(world_size=n, device="cuda", hidden_size=8192, vocab_size=128256, timeout_s=300)
        result = run_probe(cfg, env)
        assert result.ok, result
        assert (result.backend, result.world_size) == ("nccl", n)
        for r in result.ranks:
            # A CUDA context alone is hundreds of MiB; NCCL adds its buffers.
            assert r.comm_bytes > 64 * MIB, r
            assert r.free_after_bytes < r.free_before_bytes
        # The driver frees a dead process's memory asynchronously: wait until it has (a bound
        # only against hanging), then compare. (Only agent/ is on this tier's path: no sandbox.)
        deadline = time.monotonic() + 60
        while True:
            after = [backend.read(i).free_bytes for i in range(n)]
            if all(abs(a - b) <= 256 * MIB for b, a in zip(before, after, strict=True)):
                break
            assert time.monotonic() < deadline, (before, after)
            time.sleep(0.2)
        print("probe:", result)
    finally:
        backend.close()


def test_a_real_cuda_oom_under_the_launcher(tmp_path: Path) -> None:
    import torch

    from rankguard_agent.wire.termination import CUDA_OOM, parse_termination_message

    n = torch.cuda.device_count()
    last = n - 1  # the last GPU, so that the GPU index -> rank mapping is exercised when n > 1
    free, total = torch.cuda.mem_get_info(last)
    want = free + 2 * GIB
    child = (
        "import torch\n"
        f"torch.cuda.set_device({last})\n"
        f"x = torch.empty({want}, dtype=torch.uint8, device='cuda')\n"
    )
    tlog = tmp_path / "termination-log"
    cmd = [sys.executable, "-m", "rankguard_agent", "launch", "--backend", "nvml", "--host", "127.0.0.1",
           "--port", "0", "--termination-log", str(tlog), "--", sys.executable, "-c", child]  # fmt: skip
    proc = subprocess.run(cmd, env=gpu_env(), capture_output=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert b"CUDA out of memory" in proc.stderr  # passed through
    m = parse_termination_message(tlog.read_text())
    assert m.reason == CUDA_OOM, m
    assert (m.rank, m.gpu_index, m.exit_code) == (last, last, 1)
    assert m.requested_bytes is not None and abs(m.requested_bytes - want) <= want // 200
    assert m.free_bytes is not None and m.free_bytes < want
    assert m.total_bytes is not None and abs(m.total_bytes - total) <= total // 100
    print("termination message:", tlog.read_text())
