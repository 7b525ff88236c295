"""The fake vLLM playing vLLM 0.34 (RANKGUARD_SIM_VLLM_VERSION, set by the kubelet from the image
tag), run for real as a subprocess over a temporary GPU root: its V2 runner's phase markers, the
extensible KV cache's lines read back with the 0.34.0 snapshot's formats and checked against the
physics, a neighbour that grows, a driver without VMM, a pod without an IMEX channel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_sim.fake_vllm.main import PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.fake_vllm.startup import NO_VMM_REASON
from rankguard_sim.physics import gpus
from rankguard_sim.physics.engine_config import engine_config
from rankguard_sim.physics.engine_measured import MeasuredEngineModel, engine_model
from rankguard_sim.physics.engine_memory import PureLedger
from rankguard_sim.physics.neighbour import start_neighbour
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, load_scenario
from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, format_gib, message, message_pattern, playing
from tests import REPO

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
SCENARIO = "llama3-70b-tp4"
MODEL = ["serve", "meta-llama/Meta-Llama-3-70B-Instruct", "-tp", "4"]
GIB = 1 << 30
NIXL = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'


class World:
    def __init__(self, tmp: Path, vmm: bool = True) -> None:
        self.tmp = tmp
        self.s = load_scenario(SCENARIO)
        self.root = tmp / "gpus"
        self.uuids = gpus.create_gpus(self.root, 4, self.s.gpu.total_bytes, seed="w", vmm=vmm)
        for rank, uuid in enumerate(self.uuids):
            gpus.set_comm_init_bytes(self.root, uuid, self.s.comm_init_bytes(rank))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *flags: str, version: str = "0.34.0", **env: str) -> tuple[subprocess.Popen[bytes], Path]:
        full = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO / "sim"),
            "HOME": str(self.tmp / "home"),
            gpus.GPU_ROOT_ENV: str(self.root),
            VISIBLE_DEVICES_ENV: ",".join(self.uuids),
            SCENARIO_ENV: SCENARIO,
            TIME_SCALE_ENV: "50",
            PEAK_HOLD_ENV: "0.05",
            ENGINE_VERSION_ENV: version,
            gpus.IMEX_CHANNELS_GLOB_ENV: str(self.tmp / "imex" / "channel*"),
            **env,
        }
        log = self.tmp / f"out{len(self.procs)}.log"
        with log.open("wb") as out:
            argv = [str(SHIM), *MODEL, *flags]
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full)
        self.procs.append(proc)
        return proc, log

    def serve(self, *flags: str, **env: str) -> str:
        """Start it, wait until it serves (or ends), stop it; its output."""
        proc, log = self.start(*flags, **env)
        wait(lambda: "Application startup complete" in log.read_text() or proc.poll() is not None)
        proc.terminate()
        proc.wait(20)
        return log.read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def wait(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def after_warmup(log: str) -> dict[str, list[str]]:
    """Worker -> the values of its "Memory after warmup" line, read with 0.34.0's format."""
    with playing("0.34.0"):
        pattern = message_pattern("memory_after_warmup")
    found = {}
    for line in log.splitlines():
        m = pattern.search(line)
        if m:
            who = re.match(r"\((\w+) pid=\d+\)", line)
            assert who is not None
            found[who.group(1)] = list(m.groups())
    return found


def test_it_sizes_after_warmup_from_what_each_rank_measured(world: World) -> None:
    log = world.serve()
    assert "vLLM API server version 0.34.0" in log
    assert "Starting to load model" not in log and "Loading model from scratch..." in log
    assert "Capturing CUDA graphs (PIECEWISE)" in log  # the V2 runner's progress bar
    # the physics' own answer for these GPUs
    with playing("0.34.0"):
        s = world.s
        gpus4 = PureLedger([s.gpu.total_bytes] * 4)
        engine = engine_model(s, engine_config(s, extensible_kv_cache=True), gpus4)
        assert isinstance(engine, MeasuredEngineModel)
        plan = engine.startup()
        extended = message("extensible_kv_extended", plan.num_gpu_blocks, plan.kv_bytes[0] / GIB)
        tokens, length = f"{plan.num_tokens:,}", f"{plan.max_model_len:,}"
        size_line = message("kv_cache_size", "GPU", tokens, length, plan.max_concurrency)
    lines = after_warmup(log)
    assert sorted(lines) == [f"Worker_TP{r}" for r in range(4)]
    for m in engine.measurements:
        values = lines[f"Worker_TP{m.rank}"]
        assert values[0] == format_gib(m.free_bytes)
        assert int(values[5]) == m.blocks
        assert values[7] == format_gib(m.requested_bytes) == format_gib(s.gpu.total_bytes)  # 1.0 unset
        assert values[8] == format_gib(m.torch_cap_bytes)
    blocks = [int(v[5]) for v in lines.values()]
    assert plan.num_gpu_blocks == min(blocks) < max(blocks)  # rank 0 shares its GPU: the minimum
    assert log.count(extended) == 4
    # the KV cache size is logged once it is settled, after every worker measured
    assert log.index(size_line) > max(log.index(f"(Worker_TP{r} ") for r in range(4))
    assert log.index(size_line) > log.rindex("Memory after warmup")
    assert "caps this instance" not in log  # utilisation unset: no warning


def test_an_explicit_utilisation_just_under_one_is_warned_about(world: World) -> None:
    log = world.serve("--gpu-memory-utilization", "0.85")
    with playing("0.34.0"):
        warned = message_pattern("utilization_withholds")
    found = [warned.search(line) for line in log.splitlines()]
    got = [m.groups() for m in found if m]
    assert len(got) == 4 and all(g[0] == "0.85" for g in got)
    assert all(float(g[2]) >= 1.0 for g in got)


def test_a_neighbour_growing_into_the_margin_fails_the_next_step(world: World) -> None:
    neighbour = start_neighbour(world.root, world.uuids[2], 2 * GIB)
    try:
        proc, log = world.start()
        wait(lambda: "Application startup complete" in log.read_text())
        neighbour.grow(6 * GIB, timeout=None)
        assert proc.wait(30) == 1
        text = log.read_text()
        oom = r"\(Worker_TP2 pid=\d+\) ERROR .* torch\.OutOfMemoryError: CUDA out of memory\. Tried"
        assert re.search(oom, text)
        assert f"Process {neighbour.pid} has " in text  # named in torch's message, as NVML lists it
        wait(lambda: neighbour.held() == 8 * GIB)  # it gets the rest once the engine let go
    finally:
        neighbour.stop()


def test_a_neighbour_at_start_is_measured(world: World) -> None:
    clean = after_warmup(world.serve())
    neighbour = start_neighbour(world.root, world.uuids[1], 6 * GIB)
    try:
        crowded = after_warmup(world.serve())
    finally:
        neighbour.stop()
    assert int(crowded["Worker_TP1"][5]) < int(clean["Worker_TP1"][5])
    assert float(crowded["Worker_TP1"][0]) == pytest.approx(float(clean["Worker_TP1"][0]) - 6, abs=0.02)


def test_without_vmm_the_engine_falls_back_to_the_estimate(tmp_path: Path) -> None:
    w = World(tmp_path, vmm=False)
    try:
        log = w.serve("--gpu-memory-utilization", "0.88")
    finally:
        w.close()
    with playing("0.34.0"):
        disabled = message("extensible_kv_disabled", NO_VMM_REASON)
    assert re.search(rf"\(EngineCore_DP0 pid=\d+\) WARNING .* {re.escape(disabled)}$", log, re.M)
    assert "Memory after warmup" not in log and "Extended KV cache" not in log
    assert "Desired GPU memory utilization is (0.88," in log


def test_fabric_exports_without_an_imex_channel_keep_the_estimate(world: World) -> None:
    log = world.serve("--kv-transfer-config", NIXL)
    assert "Memory after warmup" not in log and "Desired GPU memory utilization is (0.92," in log
    (world.tmp / "imex").mkdir()
    (world.tmp / "imex" / "channel0").touch()  # the pod can open a channel
    assert "Memory after warmup" in world.serve("--kv-transfer-config", NIXL)


def test_asking_for_it_where_it_is_unsupported_is_vllms_error(world: World) -> None:
    proc, log = world.start("--enable-extensible-kv-cache", "--kv-cache-memory-bytes", str(20 * GIB))
    assert proc.wait(30) == 1
    refused = "ValueError: enable_extensible_kv_cache: it sizes the KV cache from measured memory"
    assert refused in log.read_text()


def test_older_releases_play_as_before(world: World) -> None:
    log = world.serve(version="0.31.0")
    assert "vLLM API server version 0.33.0" in log and "Starting to load model" in log
    assert "Memory after warmup" not in log
