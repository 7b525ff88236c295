"""The launcher on vLLM 0.34's extensible KV cache (lines rendered from the recorded 0.34.0
snapshot): each worker's "Memory after warmup" filed under its own rank, the engine's reason for
turning the mode off, the KV size printed after warm-up, and, end to end, what the engine cannot
see: a neighbour's memory on the GPU, the driver's VMM and the pod's IMEX channel in /report."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from rankguard_agent.launcher import Observer
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig
from rankguard_agent.server import AgentState
from rankguard_agent.wire.group import GroupPlace
from rankguard_agent.wire.recognisers_extensible import MEMORY_AFTER_WARMUP
from rankguard_agent.wire.report_memory import WarmupMemory
from rankguard_agent.workers import WorkerRanks, parallel_sizes
from rankguard_operator import vllm_snapshots
from tests.unit.agent.launched import agent_port, launcher_cmd, py, report_when, start, stop

GIB = 1 << 30
SNAP = vllm_snapshots.load("0.34.0")


def line(key: str, values: tuple[object, ...], who: str) -> str:
    msg = SNAP.messages(key)[0]
    assert msg["style"] == "percent"
    return f"({who}) INFO 12-01 10:00:00 [{Path(msg['file']).name}:{msg['line']}] {msg['template'] % values}"


def gib(b: int) -> str:
    return f"{round(b / GIB, 2)}"  # vLLM's format_gib


def warmup(who: str, free: int, blocks: int) -> str:
    values = (gib(free), gib(2 * GIB), gib(3 * GIB), gib(3 * GIB), gib(GIB), blocks, gib(60 * GIB))
    return line("memory_after_warmup", (*values, gib(79 * GIB), gib(14 * GIB)), f"{who} pid=77")


def expected(free: int, blocks: int) -> WarmupMemory:
    return WarmupMemory(free, 2 * GIB, 3 * GIB, 3 * GIB, GIB, blocks, 60 * GIB, 79 * GIB, 14 * GIB)


DISABLED = "GPU driver error 801: operation not supported"


def sim_state(sim_env: dict[str, str]) -> AgentState:
    runtime = AgentRuntime(RuntimeConfig(backend="sim"), sim_env)
    runtime.sampler.sample_once()
    return runtime.state


def test_each_ranks_warmup_line_is_its_own(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state, WorkerRanks(parallel_sizes(["vllm", "serve", "m", "-tp", "2"]), 2))
    obs.on_line(warmup("Worker_TP1", 11 * GIB, 40_000))
    obs.on_line(warmup("Worker_TP0", 12 * GIB, 41_000))
    obs.on_line(
        line("kv_cache_size", ("GPU", f"{2_560_000:,}", f"{131_072:,}", 19.53), "EngineCore_DP0 pid=9")
    )
    report = state.report()
    assert [r.warmup for r in report.ranks] == [expected(12 * GIB, 41_000), expected(11 * GIB, 40_000)]
    assert state.kv_lines["kv_cache_tokens"].value == 2_560_000  # still read after warm-up
    assert obs.cause is None and state.unparsed_lines == {}
    obs.on_line(warmup("Worker_TP1", 9 * GIB, 39_000))  # a later line replaces the rank's figures
    assert state.report().ranks[1].warmup == expected(9 * GIB, 39_000)


def test_on_a_pod_of_a_group_the_warmup_line_is_the_global_ranks(sim_env: dict[str, str]) -> None:
    """Pod 1 of TP2 x PP2 over two pods: its workers are global ranks 2 and 3 (its GPUs 0, 1)."""
    state = sim_state(sim_env)
    state.place = GroupPlace(nnodes=2, node_rank=1, tp=2, pp=2, local_world=2)
    obs = Observer(state, WorkerRanks(parallel_sizes([]), 2, state.place))
    obs.on_line(warmup("Worker_PP1_TP1", 11 * GIB, 40_000))
    report = state.report()
    assert [(r.rank, r.local_rank, r.warmup) for r in report.ranks] == [
        (2, 0, None),
        (3, 1, expected(11 * GIB, 40_000)),
    ]


def test_a_warmup_line_of_no_known_rank_or_cut_is_counted_never_filed(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state, WorkerRanks(parallel_sizes(["vllm", "serve", "m"]), 2))
    obs.on_line(warmup("Worker_PP1_TP1", GIB, 1))  # whose? the TP size is not on the command line
    obs.on_line(warmup("Worker_TP7", GIB, 1))  # not a rank of this pod
    cut = warmup("Worker_TP1", GIB, 1)
    obs.on_line(cut[: cut.index("fit within")])
    assert all(r.warmup is None for r in state.report().ranks)
    assert state.unparsed_lines == {"worker_prefix": 2, MEMORY_AFTER_WARMUP: 1}


def test_the_engines_reason_for_estimate_sizing_is_the_pods(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state)
    text = SNAP.messages("extensible_kv_disabled")[0]["template"] % DISABLED
    obs.on_line(f"(EngineCore_DP0 pid=9) WARNING 12-01 10:00:00 [abstract.py:176] {text}")
    assert state.report().extensible_disabled == DISABLED
    assert obs.cause is None and obs.last_error is None


@pytest.fixture
def neighbour() -> Iterator[subprocess.Popen[bytes]]:
    """Another pod's process: this test's child, so none of the launcher's tree."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


async def test_report_says_what_the_engine_cannot_see(
    sim_env: dict[str, str], tmp_path: Path, neighbour: subprocess.Popen[bytes]
) -> None:
    """The launcher's /report: the neighbour on GPU 0 (a process outside the pod) by name and
    size, nothing for the engine's own memory, each rank's warm-up line, the engine's reason,
    the sim driver's VMM and the pod's IMEX channel (the sandbox's glob)."""
    channels = tmp_path / "imex"
    channels.mkdir()
    (channels / "channel0").write_bytes(b"")
    env = dict(sim_env, RANKGUARD_IMEX_CHANNELS_GLOB=str(channels / "channel*"))
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    lines = [
        warmup("Worker_TP0", 12 * GIB, 41_000),
        warmup("Worker_TP1", 11 * GIB, 40_000),
        "(EngineCore_DP0 pid=9) WARNING 12-01 10:00:00 [abstract.py:176] "
        + SNAP.messages("extensible_kv_disabled")[0]["template"] % DISABLED,
    ]
    child = py(
        f"""
        import signal, sys
        from rankguard_agent.gpu.simfiles import write_proc
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
        write_proc({root!r}, "GPU-0", "vllm", {40 * GIB})  # the engine's own memory
        write_proc({root!r}, "GPU-0", "cache", {6 * GIB}, pid={neighbour.pid})  # another pod's
        for line in {lines!r}:
            print(line, file=sys.stderr, flush=True)
        while True:
            signal.pause()
        """
    )
    proc = await start(launcher_cmd(tmp_path / "tl", [*child, "--tensor-parallel-size", "2"]), env)
    try:
        port = await agent_port(proc, 30)
        report = await report_when(
            port,
            lambda r: (
                r.ranks[0].others_bytes == 6 * GIB
                and r.vmm is not None
                and r.extensible_disabled is not None
                and all(x.warmup is not None for x in r.ranks)
            ),
        )
        first, second = report.ranks
        assert (first.others_bytes, first.others_peak_bytes) == (6 * GIB, 6 * GIB)
        assert [(o.pid, o.bytes) for o in first.others] == [(neighbour.pid, 6 * GIB)]
        assert first.used_bytes == 46 * GIB and second.others_bytes == 0
        assert [r.warmup for r in report.ranks] == [expected(12 * GIB, 41_000), expected(11 * GIB, 40_000)]
        assert (report.vmm, report.imex_channel, report.extensible_disabled) == (True, True, DISABLED)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = (await r.read()).decode()
        found = re.search(r'^rankguard_gpu_others_bytes\{gpu_uuid="GPU-0",rank="0"\} (\S+)$', metrics, re.M)
        assert found is not None and float(found.group(1)) == 6 * GIB, metrics
        proc.send_signal(signal.SIGUSR1)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)
