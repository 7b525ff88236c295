"""The real launcher on a headless worker pod of a vLLM multi-node group, end to end.

The sandbox's fake vLLM does not run `--nnodes` yet, so the engine here is a tiny child that
prints what vLLM 0.33's workers print on pod 1 of a TP2 x PP2 group over two pods of two GPUs
(global ranks 2 and 3, pipeline stage 1), given the group flags the operator renders. The agent
reads the group from that argv and must report, probe and name the failed rank by global rank,
without vLLM's HTTP server (a `--headless` pod runs none)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

from rankguard_agent.gpu.simfiles import write_device
from rankguard_agent.wire.termination import COMPLETED, CUDA_OOM
from tests.unit.agent.launched import (
    AGENT_ROOT,
    agent_port,
    launcher_cmd,
    message,
    py,
    report_when,
    start,
    stop,
)
from tests.unit.agent.test_probe import needs_torch

GIB = 1 << 30
GROUP_FLAGS = [
    "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
    "--nnodes", "2", "--node-rank", "1", "--master-addr", "leader.svc", "--master-port", "29501",
    "--headless",
]  # fmt: skip
MEMORY_REPORT = (
    "(Worker_PP1_TP1 pid=78) INFO 12-01 10:00:00 [gpu_worker.py:1045] Free memory on device (78.5/79.19 GiB) "
    "on startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 16.0 GiB for consumed "
    "memory (weights + non-torch), 3.0 GiB for peak activation, and 0.5 GiB for CUDAGraph memory. Replace "
    "gpu_memory_utilization config with `--kv-cache-memory=55534633369` (51.72 GiB) to fit into requested "
    "memory, or `--kv-cache-memory=62912306053` (58.59 GiB) to fully utilize gpu memory. Current kv cache "
    "memory in use is 51.77 GiB."
)
AVAILABLE = (
    "(Worker_PP1_TP0 pid=77) INFO 12-01 10:00:00 [gpu_worker.py:773] Available KV cache memory: 51.77 GiB"
)
OOM = (
    "(Worker_PP1_TP0 pid=77) ERROR 12-01 10:00:05 [multiproc_executor.py:1189] torch.OutOfMemoryError: CUDA "
    "out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "75.50 GiB is allocated by PyTorch, and 1.25 GiB is reserved by PyTorch but unallocated."
)


async def test_a_worker_pod_reports_and_fails_by_global_rank(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog, go = tmp_path / "tl", tmp_path / "go"
    child = py(
        f"""
        import os, sys, time
        print({AVAILABLE!r}, flush=True)
        print({MEMORY_REPORT!r}, flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        sys.stderr.write({OOM!r} + "\\n")
        sys.exit(1)
        """
    )
    proc = await start(launcher_cmd(tlog, [*child, *GROUP_FLAGS]), dict(sim_env, RANKGUARD_NODE_RANK="1"))
    try:
        port = await agent_port(proc, 30)
        report = await report_when(port, lambda r: any(s.engine_memory is not None for s in r.ranks))
        assert (report.nnodes, report.node_rank, report.local_world_size, report.tp_size, report.pp_size) == (
            2,
            1,
            2,
            2,
            2,
        )
        assert [(r.rank, r.local_rank, r.stage, r.tp_rank, r.uuid) for r in report.ranks] == [
            (2, 0, 1, 0, "GPU-0"),
            (3, 1, 1, 1, "GPU-1"),
        ]
        # Worker_PP1_TP1 is global rank 3, the pod's GPU 1
        assert [r.rank for r in report.ranks if r.engine_memory is not None] == [3]
        assert report.ranks[1].engine_memory is not None
        assert report.ranks[1].engine_memory.consumed_bytes == 16 * GIB
        assert report.unparsed_lines == {}
        go.touch()
        assert await asyncio.wait_for(proc.wait(), 30) == 1
        assert proc.stderr is not None
        logged = (await proc.stderr.read()).decode()
    finally:
        await stop(proc)
    m = message(tlog)
    assert (m.reason, m.rank, m.gpu_index, m.exit_code) == (CUDA_OOM, 2, 0, 1)
    assert (m.node_rank, m.nnodes, m.local_rank, m.stage, m.tp_rank) == (1, 2, 0, 1, 0)
    assert m.requested_bytes == 2 * GIB
    assert "rank 2" in logged and "RANKGUARD_NODE_RANK" not in logged


def test_a_malformed_node_rank_is_one_node_said_once(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "tl"
    flags = [f if f != "1" else "one" for f in GROUP_FLAGS]  # --node-rank one
    proc = subprocess.run(
        launcher_cmd(tlog, [*py("print('engine ran')"), *flags]),
        env=sim_env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout == b"engine ran\n"  # vLLM's start is never stopped
    assert proc.stderr.count(b"reporting ranks as a single node") == 1
    assert b"--node-rank 'one' is not a number" in proc.stderr
    m = message(tlog)
    assert (m.reason, m.node_rank, m.nnodes) == (COMPLETED, None, None)


@needs_torch
async def test_the_probe_runs_over_the_pods_gpus_and_reports_global_ranks(tmp_path: Path) -> None:
    root = tmp_path / "gpus"
    write_device(root, "GPU-r0", index=0, total_bytes=80 * GIB, comm_init_bytes=3 * GIB)
    write_device(root, "GPU-r1", index=1, total_bytes=80 * GIB, comm_init_bytes=GIB)
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": str(AGENT_ROOT),
            "RANKGUARD_SIM_GPU_ROOT": str(root),
            "NVIDIA_VISIBLE_DEVICES": "GPU-r0,GPU-r1",
            "OMP_NUM_THREADS": "1",
        }
    )
    go = tmp_path / "go"
    child = py(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)")
    probe = ["--probe", "--probe-device", "cpu", "--probe-hidden-size", "1024", "--probe-vocab-size", "32000"]
    # --probe-world-size above the pod's share: the probe keeps to the pod's own 2 ranks
    cmd = launcher_cmd(tmp_path / "tl", [*child, *GROUP_FLAGS], *probe, "--probe-world-size", "4")
    proc = await start(cmd, env)
    try:
        port = await agent_port(proc, 120)
        report = await report_when(port, lambda r: r.probe is not None)
        assert report.probe is not None and report.probe.ok, report.probe
        assert report.probe.world_size == 2
        assert [(p.rank, p.local_rank, p.comm_bytes) for p in report.probe.ranks] == [
            (2, 0, 3 * GIB),
            (3, 1, GIB),
        ]
        go.touch()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)
