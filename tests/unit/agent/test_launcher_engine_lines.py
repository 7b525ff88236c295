"""The agent's reading of vLLM 0.33's own lines (rendered from the recorded snapshot): per-rank
engine memory, tokens and concurrency from one line, the engine version, start-up refusals,
and what it cannot read."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from rankguard_agent.launcher import Observer, installed_engine_version
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig
from rankguard_agent.server import AgentState
from rankguard_agent.wire.termination import CUDA_OOM, TerminationMessage, parse_termination_message
from rankguard_agent.workers import WorkerRanks, parallel_sizes
from rankguard_operator import vllm_snapshots
from tests.unit.agent.launched import (
    AGENT_ROOT,
    agent_port,
    launcher_cmd,
    message,
    py,
    report_when,
    run,
    start,
    stop,
)

GIB = 1 << 30


# -- vLLM 0.33's lines, rendered from the recorded snapshot ---------------------------------

SNAP_FORMATS = vllm_snapshots.latest()


def snap_line(key: str, values: tuple[object, ...], who: str) -> str:
    msg = SNAP_FORMATS.messages(key)[0]
    text = msg["template"] % values if msg["style"] == "percent" else msg["template"].format(*values)
    return f"({who}) INFO 12-01 10:00:00 [{Path(msg['file']).name}:{msg['line']}] {text}"


def gib(b: int) -> float:
    return round(b / GIB, 2)  # vLLM's format_gib


def worker_report(who: str, consumed: int, to_gpu: int) -> str:
    return snap_line(
        "worker_memory_report",
        (
            gib(78 * GIB),
            gib(80 * GIB),
            0.9,
            gib(72 * GIB),
            gib(consumed),
            gib(3 * GIB),
            gib(GIB // 2),
            1_800_000_000,
            gib(1_800_000_000),
            to_gpu,
            gib(to_gpu),
            gib(40 * GIB),
        ),
        f"{who} pid=77",
    )


def sim_state(sim_env: dict[str, str]) -> AgentState:
    runtime = AgentRuntime(RuntimeConfig(backend="sim"), sim_env)
    runtime.sampler.sample_once()
    return runtime.state


def test_observer_records_tokens_and_concurrency_from_one_line(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state)
    line = snap_line("kv_cache_size", ("GPU", "1,234,560", "8,192", 150.7), "EngineCore_DP0 pid=9")
    obs.on_line(line)
    assert {k: v.value for k, v in state.kv_lines.items()} == {
        "kv_cache_tokens": 1234560.0,
        "max_concurrency": pytest.approx(150.7),
    }
    assert obs.last_kv is not None and obs.cause is None


def test_observer_gives_each_rank_its_own_engine_memory(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state, WorkerRanks(parallel_sizes(["vllm", "serve", "m", "-tp", "2"]), 2))
    obs.on_line(worker_report("Worker_TP1", 17 * GIB, 61_000_000_000))
    obs.on_line(worker_report("Worker_TP0", 16 * GIB, 60_000_000_000))
    graphs = snap_line("cuda_graph_pool", (gib(GIB), gib(GIB), 0.0, 0.0), "Worker_TP1 pid=78")
    obs.on_line(graphs)
    assert obs.cause is None
    mem = {r.rank: r.engine_memory for r in state.report().ranks}
    assert mem[0] is not None and mem[1] is not None
    assert (mem[0].consumed_bytes, mem[0].kv_to_gpu_bytes) == (16 * GIB, 60_000_000_000)
    assert (mem[1].consumed_bytes, mem[1].kv_to_gpu_bytes) == (17 * GIB, 61_000_000_000)
    assert mem[0].cuda_graph_bytes == GIB // 2 and mem[1].cuda_graph_bytes == GIB  # the latest line wins
    assert (mem[1].free_at_start_bytes, mem[1].total_bytes, mem[1].requested_bytes) == (
        78 * GIB,
        80 * GIB,
        72 * GIB,
    )
    assert mem[1].kv_in_use_bytes == 40 * GIB and mem[1].kv_to_requested_bytes == 1_800_000_000
    assert state.unparsed_lines == {}


def test_observer_counts_what_it_cannot_read_and_acts_on_none_of_it(sim_env: dict[str, str]) -> None:
    state = sim_state(sim_env)
    obs = Observer(state, WorkerRanks(parallel_sizes(["vllm", "serve", "m"]), 2))
    good = worker_report("Worker_TP1", 17 * GIB, 61_000_000_000)
    obs.on_line(good[: good.index("Current kv cache")])  # cut
    obs.on_line(good.replace("`--kv-cache-memory=61000000000`", "`--kv-cache-memory=6100000000`"))  # garbled
    obs.on_line(worker_report("Worker_PP1_TP1", GIB, 60_000_000_000))  # whose? TP size unknown
    obs.on_line(worker_report("Worker_TP7", GIB, 60_000_000_000))  # not a rank of this pod
    assert obs.cause is None and obs.last_error is None
    assert all(r.engine_memory is None for r in state.report().ranks)
    assert state.unparsed_lines == {"worker_memory_report": 2, "worker_prefix": 2}


def test_engine_version_comes_from_package_metadata(tmp_path: Path) -> None:
    assert installed_engine_version("rankguard-no-such-dist") is None
    dist = tmp_path / "vllm-0.33.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert installed_engine_version("vllm") == "0.33.0"
    finally:
        sys.path.remove(str(tmp_path))


async def test_report_carries_the_engine_version_and_each_ranks_engine_memory(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    site = tmp_path / "site"
    (site / "vllm-0.33.0.dist-info").mkdir(parents=True)
    (site / "vllm-0.33.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n"
    )
    env = dict(sim_env, PYTHONPATH=f"{AGENT_ROOT}{os.pathsep}{site}")
    tlog = tmp_path / "tl"
    lines = [
        worker_report("Worker_TP0", 16 * GIB, 60_000_000_000),
        worker_report("Worker_TP1", 17 * GIB, 61_000_000_000),
        worker_report("Worker_TP1", 17 * GIB, 61_000_000_000)[:300],
    ]
    child = py(
        f"""
        import signal, sys
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))  # the test's "done", forwarded
        for line in {lines!r}:
            print(line, file=sys.stderr, flush=True)
        while True:
            signal.pause()
        """
    )
    proc = await start(launcher_cmd(tlog, [*child, "--tensor-parallel-size", "2"]), env)
    try:
        port = await agent_port(proc, 30)
        report = await report_when(port, lambda r: all(x.engine_memory is not None for x in r.ranks))
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = (await r.read()).decode()
        assert report.engine_version == "0.33.0"
        assert [r.engine_memory.consumed_bytes if r.engine_memory else None for r in report.ranks] == [
            16 * GIB,
            17 * GIB,
        ]
        assert 'rankguard_agent_unparsed_lines_total{kind="worker_memory_report"} 1.0' in metrics
        proc.send_signal(signal.SIGUSR1)  # the launcher forwards it to the engine, which exits 0
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)


def test_a_start_up_refusal_is_marked_as_one(sim_env: dict[str, str], tmp_path: Path) -> None:
    """vLLM's start-up check is a CUDA OOM to the operator, but a different fix: the message says
    which it was, with the free memory and total vLLM measured."""
    from rankguard_operator import vllm_snapshots

    msg = vllm_snapshots.latest().messages("startup_free_too_low")[0]
    line = "ValueError: " + msg["template"].format("cuda:1", 20.64, 23.58, 0.92, 21.69)
    tlog = tmp_path / "termination-log"
    child = py(
        f"""
        import sys
        sys.stderr.write({line!r} + "\\n")
        sys.exit(1)
        """
    )
    assert run(sim_env, tlog, child).returncode == 1
    m = message(tlog)
    assert m.reason == CUDA_OOM and m.startup_check is True
    assert m.free_bytes == round(20.64 * GIB) and m.total_bytes == round(23.58 * GIB)
    assert parse_termination_message(m.to_json()) == m
    plain = TerminationMessage(CUDA_OOM, 1, free_bytes=1)
    assert parse_termination_message(plain.to_json()).startup_check is False


def test_an_external_weights_refusal_carries_the_weights_and_the_rank(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """vLLM 0.33's "Externally held weights on device cuda:N ... exceed the desired GPU memory
    utilization": a start-up refusal on rank N, with the weights held outside, no free figure."""
    from rankguard_operator import vllm_snapshots

    msg = vllm_snapshots.latest().messages("startup_external_weights")[0]
    line = "ValueError: " + msg["template"].format("cuda:1", 22.0, 23.58, 0.9, 21.23)
    tlog = tmp_path / "termination-log"
    child = py(
        f"""
        import sys
        sys.stderr.write("(Worker_TP1 pid=80) ERROR 12-01 10:00:00 [utils.py:732] " + {line!r} + "\\n")
        sys.exit(1)
        """
    )
    assert run(sim_env, tlog, child).returncode == 1
    m = message(tlog)
    assert (m.reason, m.rank, m.gpu_index, m.startup_check) == (CUDA_OOM, 1, 1, True)
    assert m.external_weight_bytes == round(22.0 * GIB) and m.free_bytes is None
    assert (m.total_bytes, m.requested_bytes) == (round(23.58 * GIB), round(21.23 * GIB))
    assert parse_termination_message(m.to_json()) == m
    # an older agent's message has no such key: nothing held outside is known
    older = (
        TerminationMessage(CUDA_OOM, 1, startup_check=True)
        .to_json()
        .replace(',"external_weight_bytes":null', "")
    )
    assert "external_weight_bytes" not in older
    assert parse_termination_message(older).external_weight_bytes is None
