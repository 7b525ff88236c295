"""The probe for real: torch.distributed with gloo on CPU, two ranks, memory from the sim
backend over a temporary GPU root (each rank pays its device's comm_init_bytes)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device
from rankguard_agent.probe import ProbeConfig, model_shape_from_config, run_probe, warmup_shapes
from rankguard_agent.wire.report import Report, parse_report
from rankguard_agent.wire.termination import parse_termination_message
from tests import REPO
from tests.unit.agent.launched import agent_port, stop

GIB = 1 << 30
AGENT_ROOT = REPO / "agent"

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not importable here; the probe needs it"
)


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "gpus"
    write_device(root, "GPU-r0", index=0, total_bytes=80 * GIB, reserved_bytes=GIB, comm_init_bytes=3 * GIB)
    write_device(root, "GPU-r1", index=1, total_bytes=80 * GIB, comm_init_bytes=GIB)
    env = dict(os.environ)
    env.update(
        {
            "RANKGUARD_SIM_GPU_ROOT": str(root),
            "NVIDIA_VISIBLE_DEVICES": "GPU-r0,GPU-r1",
            "OMP_NUM_THREADS": "1",
        }
    )
    return root, env


def cfg(**kw: object) -> ProbeConfig:
    base: dict[str, object] = {
        "world_size": 2,
        "device": "cpu",
        "hidden_size": 8192,
        "vocab_size": 128256,
        "timeout_s": 120.0,
        "failure_grace_s": 2.0,
        "gpu_backend": "sim",
    }
    base.update(kw)
    return ProbeConfig(**base)  # type: ignore[arg-type]


def no_probe_files(root: Path) -> bool:
    return not list(root.glob("*/procs/*-probe.json"))


@needs_torch
def test_two_ranks_measure_their_communicator_cost(world: tuple[Path, dict[str, str]]) -> None:
    root, env = world
    result = run_probe(cfg(), env)
    assert result.ok, result
    assert (result.backend, result.world_size, result.error) == ("gloo", 2, None)
    r0, r1 = result.ranks
    assert (r0.free_before_bytes, r0.free_after_bytes, r0.comm_bytes) == (79 * GIB, 76 * GIB, 3 * GIB)
    assert (r1.free_before_bytes, r1.free_after_bytes, r1.comm_bytes) == (80 * GIB, 79 * GIB, GIB)
    assert no_probe_files(root)  # everything released
    assert SimBackend(root, env).read(0).free_bytes == 79 * GIB
    doc = Report(version=1, agent_version="t", timestamp=1.0, ranks=[], probe=result).to_json()
    assert parse_report(doc).probe == result


@needs_torch
def test_a_failing_rank_is_reported_and_the_probe_does_not_hang(world: tuple[Path, dict[str, str]]) -> None:
    root, env = world
    write_device(root, "GPU-r1", index=1, total_bytes=80 * GIB, comm_init_bytes=GIB, lost=True)
    result = run_probe(cfg(timeout_s=120.0), env)
    assert not result.ok
    r0, r1 = result.ranks
    assert r1.error is not None and "GpuIsLost" in r1.error
    # The survivor was stopped soon after its peer failed, not at the deadline: it says "aborted
    # ... rank 1 failed" (the failure grace), where the deadline would have said "timed out".
    assert r0.error is not None and r0.error.startswith("aborted") and "rank 1 failed" in r0.error
    assert r0.free_before_bytes == 79 * GIB  # what it measured before it was stopped survives
    assert result.error is not None and result.error.startswith("rank 1 failed")
    assert no_probe_files(root)
    parse_report(Report(version=1, agent_version="t", timestamp=1.0, ranks=[], probe=result).to_json())


@needs_torch
def test_communicator_init_that_does_not_fit_is_an_oom(world: tuple[Path, dict[str, str]]) -> None:
    root, env = world
    write_device(root, "GPU-r0", index=0, total_bytes=2 * GIB, reserved_bytes=GIB, comm_init_bytes=3 * GIB)
    result = run_probe(cfg(), env)
    assert not result.ok
    err = result.ranks[0].error
    assert err is not None and "out of memory during communicator init" in err
    assert no_probe_files(root)


@needs_torch
def test_deadline_stops_everything(world: tuple[Path, dict[str, str]]) -> None:
    _, env = world
    t0 = time.monotonic()
    result = run_probe(cfg(timeout_s=0.3), env)  # far less than importing torch takes
    assert time.monotonic() - t0 < 30
    assert not result.ok and result.error == "probe timed out after 0.3s"
    assert all(r.error is not None and r.error.startswith("timed out") for r in result.ranks)


def test_cancel_stops_the_probe_at_once(world: tuple[Path, dict[str, str]]) -> None:
    root, env = world
    cancel = threading.Event()
    cancel.set()
    t0 = time.monotonic()
    result = run_probe(cfg(), env, cancel)
    assert time.monotonic() - t0 < 15
    assert not result.ok and result.error == "probe cancelled"
    assert all(r.error is not None and r.error.startswith("cancelled") for r in result.ranks)
    assert no_probe_files(root)


@needs_torch
def test_sigterm_during_the_probe_stops_the_launcher_before_the_engine(
    world: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    _, env = world
    env = dict(env, PYTHONPATH=str(AGENT_ROOT))
    marker, tlog = tmp_path / "engine-started", tmp_path / "tl"
    cmd = [sys.executable, "-m", "rankguard_agent", "launch", "--port", "0", "--host", "127.0.0.1",
           "--termination-log", str(tlog), "--probe", "--probe-device", "cpu", "--",
           sys.executable, "-c", f"open({str(marker)!r}, 'w')"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        seen = b""
        while b"probing 2 rank(s)" not in seen:
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        proc.send_signal(signal.SIGTERM)
        seen += proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    # the probe was stopped at once (cancelled), not run to its end first
    assert b"probe failed: probe cancelled" in seen, seen[-2000:]
    assert not marker.exists()
    m = parse_termination_message(tlog.read_text())
    assert (m.reason, m.signal) == ("Signaled", signal.SIGTERM)


@needs_torch
async def test_launcher_probes_first_and_reports_it(
    world: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    _, env = world
    env = dict(env, PYTHONPATH=str(AGENT_ROOT))
    go = tmp_path / "go"
    child = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rankguard_agent", "launch", "--port", "0", "--host", "127.0.0.1",
        "--termination-log", str(tmp_path / "tl"), "--probe", "--probe-device", "cpu",
        "--probe-hidden-size", "1024", "--probe-vocab-size", "32000", "--", sys.executable, "-c", child,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        port = await agent_port(proc, 120)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/report") as r:
            report = parse_report(await r.read())
        assert report.probe is not None and report.probe.ok
        assert [p.comm_bytes for p in report.probe.ranks] == [3 * GIB, GIB]
        go.touch()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)


def test_warmup_shapes_follow_the_model_and_stay_bounded() -> None:
    c = ProbeConfig(world_size=8, hidden_size=8192, vocab_size=128256, tokens=512, batch=256)
    (rows, hidden), (grows, shard) = warmup_shapes(c, 8, on_gpu=True)
    assert (rows, hidden) == (512, 8192)
    assert (grows, shard) == (256, 16032)
    # On CPU the rows shrink to stay within 256 Ki elements per collective.
    assert warmup_shapes(c, 8, on_gpu=False) == ((32, 8192), (2, 16032))
    huge = ProbeConfig(world_size=2, hidden_size=1 << 20, vocab_size=1 << 22)
    (rows, hidden), (grows, shard) = warmup_shapes(huge, 2, on_gpu=False)
    assert rows * hidden <= 256 << 10 and grows * shard * 2 <= 2 * (256 << 10) and min(rows, grows) == 1


def test_model_shape_from_config(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 8192, "vocab_size": 128256, "num_hidden_layers": 80}))
    assert model_shape_from_config(p) == (8192, 128256)
    p.write_text(json.dumps({"text_config": {"hidden_size": 5120, "vocab_size": 262208}}))
    assert model_shape_from_config(p) == (5120, 262208)
    p.write_text(json.dumps({"hidden_size": "big"}))
    with pytest.raises(ValueError, match="hidden_size"):
        model_shape_from_config(p)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ProbeConfig(world_size=65)
    with pytest.raises(ValueError):
        ProbeConfig(world_size=2, hidden_size=0)
    with pytest.raises(ValueError, match="world_size >= 1"):
        run_probe(ProbeConfig(world_size=0))
