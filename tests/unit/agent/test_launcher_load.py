"""The launcher on the weights' load start (lines rendered from the recorded 0.34.0 snapshot): each
rank's free memory and others' memory when its worker began loading weights, which is what vLLM
0.34's init memory snapshot saw (`free_at_load_bytes`, `others_at_load_bytes`), reset when the
engine starts over."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.launcher import Observer
from rankguard_agent.others import PodProcesses
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig
from rankguard_agent.server import AgentState
from rankguard_agent.verdict import termination_message
from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.recognisers import CudaOom
from rankguard_agent.wire.report import Report, parse_report
from rankguard_agent.workers import WorkerRanks, parallel_sizes
from rankguard_operator import vllm_snapshots
from tests.unit.agent.launched import agent_port, launcher_cmd, py, report_when, start, stop

GIB = 1 << 30
SNAP = vllm_snapshots.load("0.34.0")
SNAP_033 = vllm_snapshots.load("0.33.0")
RUNNER = "vllm/v1/worker/gpu/model_runner.py"  # 0.34's GPU model runner
TP2 = ["vllm", "serve", "m", "--tensor-parallel-size", "2"]


def line(key: str, values: tuple[object, ...], who: str, file: str | None = None) -> str:
    """vLLM's log line for snapshot message `key`, as the process `who` prints it."""
    msg = next(
        m
        for m in SNAP.messages(key)
        if (file is None or m["file"] == file) and m["template"].count("%") == len(values)
    )
    text = msg["template"] if msg["style"] == "plain" else msg["template"] % values
    return f"({who}) INFO 12-01 10:00:00 [{Path(msg['file']).name}:{msg['line']}] {text}"


def load_start(who: str = "Worker_TP0 pid=77") -> str:
    # info_once, scope "local": only the node's first rank prints it (vllm/logger.py)
    return line("model_load_start_v2", (), who, RUNNER)


def loaded(who: str) -> str:
    return line("model_loading", ("30.5", 12.5), who, RUNNER)


def engine_up() -> str:
    return line("init_engine_took", (41.0,), "EngineCore_DP0 pid=9", "vllm/v1/engine/core.py")


def pod_state(env: dict[str, str]) -> tuple[AgentRuntime, AgentState, Observer]:
    """An agent on the sim's two GPUs whose pod is this process, its observer of a TP2 engine."""
    runtime = AgentRuntime(RuntimeConfig(backend="sim"), env, pod=PodProcesses(os.getpid()))
    observer = Observer(runtime.state, WorkerRanks(parallel_sizes(TP2), 2))
    return runtime, runtime.state, observer


def tick(runtime: AgentRuntime) -> None:
    # two ticks: others' memory is shown once two readings in a row say it (others.py)
    runtime.sampler.sample_once()
    runtime.sampler.sample_once()


def at_load(report: Report) -> list[tuple[int | None, int | None]]:
    return [(r.free_at_load_bytes, r.others_at_load_bytes) for r in report.ranks]


def sim_free(runtime: AgentRuntime) -> list[int]:
    """What the sim devices say is free now (the backend's reading, not the sampler's)."""
    return [runtime.backend.read(r.rank).free_bytes for r in runtime.backend.ranks()]


def test_each_rank_keeps_its_free_memory_at_the_load_start_and_a_restart_resets_it(
    sim_env: dict[str, str],
) -> None:
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    neighbour = os.getppid()  # alive, and not of the pod (this process and its descendants)
    runtime, state, observer = pod_state(sim_env)
    # after init_device: each worker's CUDA context and NCCL, a neighbour's 5 GiB on GPU 1
    write_proc(root, "GPU-0", "ctx", GIB)
    write_proc(root, "GPU-1", "ctx", 2 * GIB)
    write_proc(root, "GPU-1", "cache", 5 * GIB, pid=neighbour)
    tick(runtime)
    assert at_load(state.report()) == [(None, None), (None, None)]  # nothing said yet
    at_marker = sim_free(runtime)
    assert at_marker == [79 * GIB, 73 * GIB]
    observer.on_line(load_start())
    # the weights come in; the figures of the load start stay
    write_proc(root, "GPU-0", "weights", 30 * GIB)
    write_proc(root, "GPU-1", "weights", 30 * GIB)
    tick(runtime)
    observer.on_line(loaded("Worker_TP0 pid=77"))
    observer.on_line(loaded("Worker_TP1 pid=78"))
    observer.on_line(engine_up())
    report = state.report()
    assert at_load(report) == [(at_marker[0], 0), (at_marker[1], 5 * GIB)]
    assert [r.free_bytes for r in report.ranks] == [49 * GIB, 43 * GIB]
    assert parse_report(report.to_json()).ranks == report.ranks  # and the operator reads them
    # the engine starts over (a new engine core) with the neighbour gone: new figures
    write_proc(root, "GPU-0", "weights", 0)
    write_proc(root, "GPU-1", "weights", 0)
    write_proc(root, "GPU-1", "cache", 0, pid=neighbour)
    tick(runtime)
    observer.on_line(load_start())
    assert at_load(state.report()) == [(79 * GIB, 0), (78 * GIB, 0)]


def test_the_launchers_new_engine_run_starts_unknown(sim_env: dict[str, str]) -> None:
    runtime, state, observer = pod_state(sim_env)
    tick(runtime)
    observer.on_line(load_start())
    assert at_load(state.report()) == [(80 * GIB, 0), (80 * GIB, 0)]
    runtime.sampler.reset_load()  # what the launcher does as it starts an engine
    assert at_load(state.report()) == [(None, None), (None, None)]


def test_a_second_marker_in_the_same_load_keeps_the_first(sim_env: dict[str, str]) -> None:
    """0.33's "Starting to load model" and 0.34's marker of another node's first rank say the same
    start again; by then some weights may be in: the first marker of the run stands."""
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    runtime, state, observer = pod_state(sim_env)
    tick(runtime)
    observer.on_line(load_start())
    write_proc(root, "GPU-0", "weights", 30 * GIB)
    tick(runtime)
    observer.on_line(load_start("Worker_TP1 pid=78"))
    assert at_load(state.report()) == [(80 * GIB, 0), (80 * GIB, 0)]


def test_a_rank_without_a_recent_reading_takes_its_next_one(tmp_path: Path, sim_env: dict[str, str]) -> None:
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    runtime, state, observer = pod_state(sim_env)
    observer.on_line(load_start())  # before the sampler's first tick
    assert at_load(state.report()) == [(None, None), (None, None)]
    write_proc(root, "GPU-0", "ctx", GIB)
    runtime.sampler.sample_once()
    # the next reading's free memory; others' memory is not known from one reading yet
    assert at_load(state.report()) == [(79 * GIB, None), (80 * GIB, None)]


def test_a_lost_gpu_at_the_marker_waits_for_a_good_reading(sim_env: dict[str, str]) -> None:
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    runtime, state, observer = pod_state(sim_env)
    tick(runtime)
    write_device(root, "GPU-1", index=1, total_bytes=80 * GIB, lost=True)
    tick(runtime)
    observer.on_line(load_start())
    assert at_load(state.report()) == [(80 * GIB, 0), (None, None)]
    write_device(root, "GPU-1", index=1, total_bytes=80 * GIB)
    write_proc(root, "GPU-1", "ctx", GIB)
    runtime.sampler.sample_once()
    # the first good reading's free memory; others' as the readings before the loss showed them
    assert at_load(state.report())[1] == (79 * GIB, 0)


def test_vllm_033s_load_start_marks_the_ranks_too(sim_env: dict[str, str]) -> None:
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    msg = next(m for m in SNAP_033.messages("model_load_start") if m["file"].endswith("gpu_model_runner.py"))
    marker = f"(Worker_TP0 pid=77) INFO 12-01 10:00:00 [gpu_model_runner.py:{msg['line']}] "
    runtime, state, observer = pod_state(sim_env)
    write_proc(root, "GPU-1", "ctx", 3 * GIB)
    tick(runtime)
    observer.on_line(marker + msg["template"] % "org/model")
    assert at_load(state.report()) == [(80 * GIB, 0), (77 * GIB, 0)]


async def test_the_launchers_report_has_each_ranks_free_memory_at_the_load_start(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """End to end: the engine holds its context, prints the marker, then loads 30 GiB a GPU; each
    step waits for the test's go (a file), so no sampler tick can fall between two of them."""
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    marked, loading = tmp_path / "marked", tmp_path / "loading"
    child = py(
        f"""
        import os, signal, sys, time
        from rankguard_agent.gpu.simfiles import write_proc
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
        def wait(flag):
            deadline = time.monotonic() + 60  # the test sets each flag; a lost one ends the child
            while not os.path.exists(flag):
                if time.monotonic() > deadline:
                    sys.exit(3)
                time.sleep(0.01)
        write_proc({root!r}, "GPU-0", "ctx", {GIB})
        write_proc({root!r}, "GPU-1", "ctx", {2 * GIB})
        wait({str(marked)!r})
        print({load_start()!r}, file=sys.stderr, flush=True)
        wait({str(loading)!r})
        write_proc({root!r}, "GPU-0", "weights", {30 * GIB})
        write_proc({root!r}, "GPU-1", "weights", {30 * GIB})
        while True:
            signal.pause()
        """
    )
    proc = await start(launcher_cmd(tmp_path / "tl", [*child, "--tensor-parallel-size", "2"]), sim_env)
    try:
        port = await agent_port(proc, 30)
        before = await report_when(port, lambda r: [x.used_bytes for x in r.ranks] == [GIB, 2 * GIB])
        assert at_load(before) == [(None, None), (None, None)]
        marked.touch()
        report = await report_when(port, lambda r: all(x.free_at_load_bytes is not None for x in r.ranks))
        assert at_load(report) == [(79 * GIB, 0), (78 * GIB, 0)]
        loading.touch()
        report = await report_when(port, lambda r: r.ranks[1].free_bytes == 48 * GIB)
        assert [x.free_bytes for x in report.ranks] == [49 * GIB, 48 * GIB]
        assert at_load(report) == [(79 * GIB, 0), (78 * GIB, 0)]
        proc.send_signal(signal.SIGUSR1)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)


def test_a_cuda_oom_carries_its_rank_s_load_start_and_others_peak(sim_env: dict[str, str]) -> None:
    """The termination message of a CUDA OOM says what the operator's reserve needs of the failed
    run even when no report of it was read: the rank's free memory and others' memory at the
    load start, and the most others held since (a neighbour that grew after vLLM measured)."""
    root = sim_env["RANKGUARD_SIM_GPU_ROOT"]
    neighbour = os.getppid()
    runtime, _, observer = pod_state(sim_env)
    write_proc(root, "GPU-1", "cache", 2 * GIB, pid=neighbour)
    tick(runtime)
    observer.on_line(load_start())
    write_proc(root, "GPU-1", "cache", 8 * GIB, pid=neighbour)  # grows while the engine serves
    tick(runtime)
    oom = CudaOom(
        "torch.OutOfMemoryError: CUDA out of memory.", gpu_index=1, requested_bytes=GIB, free_bytes=0
    )
    message = termination_message(1, oom, None, 2, at_load=runtime.sampler.at_load)
    assert message.reason == tm.CUDA_OOM and message.rank == 1
    assert (message.free_at_load_bytes, message.others_at_load_bytes, message.others_peak_bytes) == (
        78 * GIB,
        2 * GIB,
        8 * GIB,
    )
    # the operator reads them back; an engine error carries none
    assert tm.parse_termination_message(message.to_json()) == message
    # a growth between two ticks, right before the engine died, is read when the message is made
    write_proc(root, "GPU-1", "cache", 12 * GIB, pid=neighbour)
    late = termination_message(1, oom, None, 2, at_load=runtime.sampler.at_load)
    assert late.others_peak_bytes == 12 * GIB
    error = termination_message(1, None, None, 2, at_load=runtime.sampler.at_load)
    assert error.free_at_load_bytes is None and error.others_peak_bytes is None
