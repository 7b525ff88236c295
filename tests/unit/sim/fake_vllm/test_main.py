"""The fake `vllm serve`, run for real as a subprocess over a temporary GPU root.

(Over 450 lines because every test here starts the fake as a process through the one `Runner`
fixture; the pure pieces, its parser included, are in test_args.py.)
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_sim.fake_vllm.main import FAIL_STARTUP_ENV, HOST_MEMORY_FILE_ENV, PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.physics import gpus
from rankguard_sim.physics.engine_config import engine_config
from rankguard_sim.physics.engine_failures import KV_CACHE_TOO_SMALL
from rankguard_sim.physics.engine_memory import EngineMemoryModel, PureLedger, rank_memory
from rankguard_sim.physics.engine_outcome import outcome, true_max_safe_kv
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, load_scenario
from rankguard_sim.vllm_snapshot import format_gib, message, snapshot
from tests import REPO

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
GIB = 1 << 30
MIB = 1 << 20
OOM_LINE = re.compile(
    r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate (\d+\.\d\d) (MiB|GiB)\. "
    r"GPU (\d+) has a total capacity of (\d+\.\d\d) GiB of which (\d+\.\d\d) (MiB|GiB|KiB) is free\."
)


@dataclass
class World:
    root: Path
    uuids: list[str]
    scenario: Scenario
    logs: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO / "sim"),
            # the world's own home: a scenario with a model_config downloads into its HF cache
            "HOME": str(self.root / "home"),
            gpus.GPU_ROOT_ENV: str(self.root),
            VISIBLE_DEVICES_ENV: ",".join(self.uuids),
            SCENARIO_ENV: self.scenario.name,
            TIME_SCALE_ENV: "50",
            PEAK_HOLD_ENV: "0.05",
        }
        env.update(extra)
        return env

    def files(self) -> list[Path]:
        return sorted(self.root.glob("*/procs/*.json"))

    def used(self, rank: int) -> int:
        return gpus.used_bytes(self.root, self.uuids[rank])


class Runner:
    """Starts fake vLLM processes and never leaves one running."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def world(self, name: str, gpu_count: int | None = None) -> World:
        s = load_scenario(name)
        root = self.tmp_path / f"gpus-{name}"
        uuids = gpus.create_gpus(root, gpu_count or s.world_size, s.gpu.total_bytes, seed=name)
        for rank, uuid in enumerate(uuids[: s.world_size]):
            gpus.set_comm_init_bytes(root, uuid, s.comm_init_bytes(rank))
        return World(root=root, uuids=uuids, scenario=s, logs=self.tmp_path)

    def start(self, world: World, args: list[str], **env: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        n = len(self.procs)
        out, err = world.logs / f"out{n}.log", world.logs / f"err{n}.log"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen([str(SHIM), *args], stdout=o, stderr=e, env=world.env(**env))
        self.procs.append(proc)
        return proc, out, err

    def run(self, world: World, args: list[str], **env: str) -> tuple[int, str, str]:
        proc, out, err = self.start(world, args, **env)
        rc = proc.wait(timeout=60)
        return rc, out.read_text(), err.read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    r = Runner(tmp_path)
    try:
        yield r
    finally:
        r.close()


def wait_for(predicate: object, timeout: float = 20.0, every: float = 0.05) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def model_args(world: World, *flags: str) -> list[str]:
    s = world.scenario
    return [
        "serve",
        s.model.name,
        "--tensor-parallel-size",
        str(s.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(s.pipeline_parallel_size),
        *flags,
    ]


def the_oom(stderr: str) -> re.Match[str]:
    found = OOM_LINE.search(stderr)
    assert found, stderr[-3000:]
    return found


# -- serving ------------------------------------------------------------------------------------


def test_serves_health_and_metrics_with_a_safe_budget_and_releases_on_sigterm(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    expected = outcome(world.scenario, gpu_memory_utilization=0.87)
    assert not expected.crashes
    port = free_port()
    args = model_args(world, "--gpu_memory_utilization=0.87", "--port", str(port), "--host", "127.0.0.1")
    args += ["--served-model-name", "llama"]
    proc, out, _ = runner.start(world, args, **{PEAK_HOLD_ENV: "0.3"})
    wait_for(lambda: http_get(port, "/health")[0] == 200)

    # Every rank holds its allocation under this process's pid, the same on every rank; GPU 0
    # also holds the container's other processes (API server, engine core) under their own pids.
    mine = [p for p in world.files() if p.name.split("-", 1)[0] == str(proc.pid)]
    assert len(mine) == 4 and all(p.name.endswith("-vllm.json") for p in mine)
    others = [p for p in world.files() if p not in mine]
    assert others and {p.parent.parent.name for p in others} == {world.uuids[0]}
    assert len({p.name.split("-", 1)[0] for p in others}) == 2  # two processes: two pids
    own = [gpus.process_bytes(world.root, u, proc.pid) for u in world.uuids]
    assert own[0] == own[1] == own[2] == own[3] > 60 * GIB
    assert world.used(0) > world.used(1) == world.used(2) == world.used(3)

    # The transient peaks are held long enough for a 10 Hz sampler to see them: sampled at 10 Hz
    # until rank 0 shows two levels, waited for because a loaded machine may reach a peak later.
    seen = set()

    def peaked() -> bool:
        seen.add(world.used(0))
        return len(seen) >= 2

    wait_for(peaked, timeout=30, every=0.1)  # no transient peak observed on rank 0 otherwise

    status, metrics = http_get(port, "/metrics")
    assert status == 200
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert re.search(rf'^{re.escape(name)}{{engine="0",model_name="llama"}} ', metrics, re.M), name
    assert f'num_gpu_blocks="{expected.num_gpu_blocks}"' in metrics
    assert 'block_size="16"' in metrics
    assert json.loads(http_get(port, "/v1/models")[1])["data"][0]["id"] == "llama"

    log = out.read_text()
    # vLLM 0.33's one KV line, rendered from the snapshot's template (pool "GPU" on CUDA).
    kv_line = message(
        "kv_cache_size", "GPU", f"{expected.kv_tokens:,}", "8,192", expected.num_gpu_blocks / 512
    )
    assert kv_line.startswith("GPU KV cache size: ") and ", Maximum concurrency for 8,192" in kv_line
    assert log.count(kv_line) == 1
    assert log.count("Maximum concurrency") == 1  # no second line as vLLM <= 0.11 printed
    assert "[kv_cache_utils.py:1148] " + kv_line in log
    assert log.count("Available KV cache memory: ") == 4
    assert re.search(r"Model loading took 32\.85 GiB memory and \d+\.\d{6} seconds", log)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert world.files() == []
    assert all(world.used(r) == 0 for r in range(4))


def test_a_running_load_reports_running_and_waiting_requests(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    port = free_port()
    args = model_args(world, "--gpu-memory-utilization", "0.87", "--max-num-seqs", "64", "--port", str(port))
    proc, _, _ = runner.start(world, args, **{PEAK_HOLD_ENV: "0.2"})
    wait_for(lambda: http_get(port, "/health")[0] == 200)

    def busy() -> bool:
        body = http_get(port, "/metrics")[1]
        running = re.search(r"^vllm:num_requests_running\{.*\} (\S+)$", body, re.M)
        waiting = re.search(r"^vllm:num_requests_waiting\{.*\} (\S+)$", body, re.M)
        return bool(running and waiting and float(running.group(1)) == 64 and float(waiting.group(1)) > 0)

    wait_for(busy, timeout=20, every=0.05)  # the demand ramps to 256, the flag caps the batch at 64
    proc.terminate()
    assert proc.wait(timeout=10) == 0


# -- running out --------------------------------------------------------------------------------


def test_default_utilisation_ooms_on_rank0_with_the_real_torch_message(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    expected = outcome(world.scenario)
    assert expected.crashes and expected.rank == 0 and expected.requested_bytes is not None
    rc, out, err = runner.run(world, model_args(world, "--port", str(free_port())))
    assert rc == 1
    oom = the_oom(err)
    assert oom.group(3) == "0"  # GPU 0: rank 0 runs out, ranks 1-3 never do
    assert float(oom.group(1)) == pytest.approx(expected.requested_bytes / MIB)
    assert oom.group(4) == "79.14"
    assert "GPU 1 " not in err and "GPU 2 " not in err and "GPU 3 " not in err
    assert "Application startup complete." in out  # it failed while serving, not at start-up
    assert world.files() == []

    # The agent's recogniser (a different codebase) reads the same figures from these lines.
    from rankguard_agent.wire.recognisers import recognise_oom

    line = next(ln for ln in err.splitlines() if "torch.OutOfMemoryError" in ln)
    seen = recognise_oom(line)
    assert seen is not None and seen.gpu_index == 0
    assert seen.requested_bytes == expected.requested_bytes


def test_an_over_large_kv_budget_ooms_rank0_first(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    safe = true_max_safe_kv(world.scenario)
    block = rank_memory(world.scenario, engine_config(world.scenario))[0].block_bytes
    budget = (safe.num_gpu_blocks + 400) * block  # over rank 0's edge, under ranks 1-3's
    assert budget < min(safe.headroom_per_rank[1:])
    expected = outcome(world.scenario, kv_cache_memory_bytes=budget)
    assert expected.rank == 0
    rc, out, err = runner.run(
        world, model_args(world, "--kv-cache-memory-bytes", str(budget), "--port", str(free_port()))
    )
    assert rc == 1
    assert the_oom(err).group(3) == "0"
    assert "reserved " in out and "as specified by kv_cache_memory_bytes" in out
    assert world.files() == []


def test_the_pp_scenario_runs_out_on_a_pipeline_terminal_rank(runner: Runner) -> None:
    world = runner.world("tp2-pp2")
    rc, _, err = runner.run(world, model_args(world, "--port", str(free_port())))
    assert rc == 1
    gpu = int(the_oom(err).group(3))
    assert gpu in (2, 3) and gpu == outcome(world.scenario).rank
    assert f"(Worker_PP1_TP{gpu - 2} pid=" in err
    assert world.files() == []


def test_startup_refusal_when_free_memory_is_below_the_utilisation(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    stranger = gpus.Allocation(world.root, world.uuids[1], "other", pid=os.getppid())
    stranger.set(20 * GIB)
    try:
        rc, _, err = runner.run(world, model_args(world, "--port", str(free_port())))
    finally:
        stranger.release()
    assert rc == 1
    assert re.search(
        r"ValueError: Free memory on device cuda:1 \(\d+\.\d+/79\.14 GiB\) on startup is less than desired "
        r"GPU memory utilization \(0\.92, 72\.81 GiB\)",
        err,
    )
    assert "Engine core initialization failed" in err
    assert "CUDA out of memory" not in err


# -- failures that are not about memory ---------------------------------------------------------


def test_a_gpu_lost_while_serving_stops_the_engine_on_that_rank(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    port = free_port()
    proc, _, err = runner.start(
        world, model_args(world, "--gpu-memory-utilization", "0.87", "--port", str(port))
    )
    wait_for(lambda: http_get(port, "/health")[0] == 200)
    gpus.mark_lost(world.root, world.uuids[1])
    assert proc.wait(timeout=20) == 1
    text = err.read_text()
    assert "(Worker_TP1 pid=" in text and "RuntimeError: CUDA error" in text
    assert "CUDA out of memory" not in text
    assert world.files() == []


def test_unknown_flags_and_bad_choices_exit_2_like_argparse(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    rc, _, err = runner.run(world, [*model_args(world), "--frobnicate", "3"])
    assert rc == 2 and "unrecognized arguments: --frobnicate 3" in err
    rc, _, err = runner.run(world, model_args(world, "--dtype", "int3"))
    assert rc == 2 and "invalid choice: 'int3'" in err
    assert world.files() == []


def test_a_non_memory_startup_failure_exits_1_without_an_oom(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    rc, _, err = runner.run(world, model_args(world), **{FAIL_STARTUP_ENV: "weights are corrupt"})
    assert rc == 1
    assert "RuntimeError: weights are corrupt" in err and "Engine core initialization failed" in err
    assert "CUDA out of memory" not in err
    rc, _, err = runner.run(world, model_args(world, "--max-model-len", "16384"))
    assert rc == 1 and "max_model_len (16384) is greater than the derived max_model_len" in err
    assert world.files() == []


def test_too_few_gpus_is_an_engine_error(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4", gpu_count=4)
    world.uuids = world.uuids[:2]
    rc, _, err = runner.run(world, model_args(world))
    assert rc == 1 and "World size (4) is larger than the number of available GPUs (2)" in err


# -- host memory and shutdown -------------------------------------------------------------------


def test_host_memory_is_reported_and_sigterm_during_startup_exits_0(runner: Runner, tmp_path: Path) -> None:
    world = runner.world("host-oomkilled")
    host_file = tmp_path / "host" / "memory.json"
    proc, out, _ = runner.start(
        world,
        model_args(world),
        **{HOST_MEMORY_FILE_ENV: str(host_file), TIME_SCALE_ENV: "1"},
    )
    hm = world.scenario.host_memory
    assert hm is not None

    def loaded() -> bool:
        try:
            return bool(json.loads(host_file.read_text())["rss_bytes"] == hm.after_load_bytes)
        except (OSError, ValueError):
            return False

    wait_for(loaded, timeout=15)
    doc = json.loads(host_file.read_text())
    assert doc == {"pid": proc.pid, "rss_bytes": hm.after_load_bytes, "peak_rss_bytes": hm.after_load_bytes}
    assert world.files(), "weights should be on the GPU while loading"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    # Promptly, not after the start-up finishes (4.5 s more at this time scale): its log ends
    # with the shutdown, and the start-up's last lines never came.
    log = out.read_text()
    assert "INFO:     Shutting down" in log
    assert "init engine (profile, create kv cache, warmup model) took" not in log, log[-3000:]
    assert "Application startup complete." not in log
    assert world.files() == []


def test_vllm_version_is_the_snapshots(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    rc, out, _ = runner.run(world, ["--version"])
    assert rc == 0 and out.strip() == "0.33.0" == snapshot().cli["vllm_version"]


# -- the null block (vLLM 0.33 kv_cache_planning.check_enough_kv_cache_memory) ------------------

BLOCK_70B_TP4 = 16 * 81920  # one block across rank's 80 layers: 1,310,720 B


def test_the_null_block_is_held_back_before_the_one_request_check() -> None:
    s = load_scenario("llama3-70b-tp4")
    assert rank_memory(s, engine_config(s))[0].block_bytes == BLOCK_70B_TP4
    refused = outcome(s, kv_cache_memory_bytes=671_088_640)  # 512 blocks = exactly one 8,192 request
    assert refused.reason == KV_CACHE_TOO_SMALL and refused.phase == "kv-cache"
    # The snapshot's template, with the memory left once the null block is reserved (511 blocks).
    assert refused.message == message(
        "kv_too_small",
        8192,
        format_gib(512 * BLOCK_70B_TP4),
        format_gib(511 * BLOCK_70B_TP4),
        "Based on the available memory, the estimated maximum model length is 8176. ",
    )
    started = outcome(s, kv_cache_memory_bytes=672_399_360)  # 513 blocks: one request + the null block
    assert started.reason != KV_CACHE_TOO_SMALL and started.num_gpu_blocks == 513
    # BlockPool hands out 512 of them: eight 1,024-token sequences at most.
    assert started.peak_running_seqs <= 512 // (1024 // 16)


def test_the_fake_refuses_512_blocks_and_starts_with_513(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    flags = ["--max-model-len", "8192", "--block-size", "16", "--port", str(free_port())]
    rc, _, err = runner.run(world, model_args(world, "--kv-cache-memory-bytes", "671088640", *flags))
    assert rc == 1
    assert "ValueError: To serve at least one request with the model's max seq len (8192), (0.62 GiB" in err
    assert "[kv_cache_planning.py:" in err or "kv_cache_planning.py" in err
    port = free_port()
    proc, out, _ = runner.start(
        world,
        model_args(
            world, "--kv-cache-memory-bytes", "672399360", "--max-model-len", "8192", "--port", str(port)
        ),
    )
    wait_for(lambda: http_get(port, "/health")[0] == 200)
    assert 'num_gpu_blocks="513"' in http_get(port, "/metrics")[1]
    # 513 blocks / 512 per request, the pool's num_blocks as vLLM logs it
    assert message("kv_cache_size", "GPU", "8,208", "8,192", 513 / 512) in out.read_text()
    proc.terminate()
    assert proc.wait(timeout=10) == 0


# -- the per-worker memory report (gpu_worker.py:1045) -----------------------------------------


def expected_reports(s: Scenario, util: float) -> list[str]:
    engine = EngineMemoryModel(
        s, engine_config(s, gpu_memory_utilization=util), PureLedger([s.gpu.total_bytes] * 4)
    )
    engine.startup()
    out = []
    for rank in range(4):
        r = engine.memory_report(rank)
        assert r is not None
        out.append(
            message(
                "worker_memory_report",
                format_gib(r.init_free),
                format_gib(r.total),
                r.utilization,
                format_gib(r.requested),
                format_gib(r.total_consumed),
                format_gib(r.peak_activation),
                format_gib(r.cuda_graph),
                r.kv_to_requested_limit,
                format_gib(r.kv_to_requested_limit),
                r.kv_to_gpu_limit,
                format_gib(r.kv_to_gpu_limit),
                format_gib(r.available_kv),
            )
        )
    return out


def test_each_worker_prints_vllms_memory_report_in_utilisation_mode_only(runner: Runner) -> None:
    world = runner.world("llama3-70b-tp4")
    s = world.scenario
    reports = expected_reports(s, 0.87)
    # The figures are the rank's own: rank 0 starts with less free memory (the API server's and
    # the engine core's contexts on cuda:0), so its "fully utilize" suggestion is smaller.
    m = rank_memory(s, engine_config(s))[0]
    graphs = m.cuda_graph
    consumed = m.weights
    peak = m.profile_peak + graphs
    requested = math.ceil(s.gpu.total_bytes * 0.87)
    to_requested = requested - (consumed + peak + graphs) - 150 * MIB
    assert (
        f"`--kv-cache-memory={to_requested}`" in reports[0]
        and f"`--kv-cache-memory={to_requested}`" in reports[1]
    )
    assert reports[0] != reports[1] and reports[1] == reports[2] == reports[3]
    port = free_port()
    proc, out, _ = runner.start(
        world, model_args(world, "--gpu-memory-utilization", "0.87", "--port", str(port))
    )
    wait_for(lambda: http_get(port, "/health")[0] == 200)
    log = out.read_text()
    proc.terminate()
    assert proc.wait(timeout=10) == 0
    for rank, text in enumerate(reports):
        mine = [ln for ln in log.splitlines() if ln.startswith(f"(Worker_TP{rank} pid={proc.pid}) INFO ")]
        lines = [ln for ln in mine if "[gpu_worker.py:1045] " in ln]
        assert len(lines) == 1 and lines[0].endswith("] " + text), (rank, lines)
    assert log.count("CUDA graph pool memory: ") == 4

    # With an explicit budget vLLM skips profiling, and with it the report.
    port = free_port()
    budget = 30 * GIB
    proc, out, _ = runner.start(
        world, model_args(world, "--kv-cache-memory-bytes", str(budget), "--port", str(port))
    )
    wait_for(lambda: http_get(port, "/health")[0] == 200)
    log = out.read_text()
    proc.terminate()
    assert proc.wait(timeout=10) == 0
    assert "Replace gpu_memory_utilization config" not in log and "CUDA graph pool memory" not in log
    assert "as specified by kv_cache_memory_bytes" in log
