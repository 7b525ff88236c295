"""The launched agent's capacity series over the sandbox's fake vLLM (issue 52): the launcher
wires the engine's address from its argv, the engine prints its KV cache size and serves its own
/metrics on its --port, and the agent's /metrics carries `rankguard_kv_capacity_tokens` equal to
the engine's figure and `rankguard_kv_free_tokens` no more than it. Also as in a sandbox pod: the
operator's wildcard `--host`, which the fake engine binds on the pod's IP (RANKGUARD_SIM_POD_IP,
the sandbox's network namespace), read by the agent on `POD_IP`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_agent.wire.recognisers import KV_TOKENS
from rankguard_sim.fake_vllm.main import PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.fake_vllm.sandbox import POD_IP_ENV
from rankguard_sim.physics import gpus
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, builtin_dir
from rankguard_sim.waiting import wait_for
from tests import REPO
from tests.unit.agent.launched import AGENT_ROOT, agent_port, launcher_cmd, report_when, start, stop

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
SANDBOX_POD_IP = "127.0.0.93"  # a loopback address as the sandbox gives a pod; none reads 127.0.0.1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def capacity_series(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in ("rankguard_kv_capacity_tokens", "rankguard_kv_free_tokens")
    }


async def drain(stream: asyncio.StreamReader | None) -> None:
    """Read the launcher's passthrough, so a full pipe never stalls it."""
    while stream is not None and await stream.read(1 << 16):
        pass


@pytest.mark.parametrize("pod_ip", [None, SANDBOX_POD_IP], ids=["explicit-host", "sandbox-pod-ip"])
async def test_the_launched_agent_exports_the_fake_engines_capacity(
    sim_env: dict[str, str], tmp_path: Path, pod_ip: str | None
) -> None:
    root = tmp_path / "world-gpus"
    uuids = gpus.create_gpus(root, 2, round(23.58 * (1 << 30)), seed="capacity")
    env = dict(sim_env)
    env.update(
        {  # PATH: the shim runs `python3`, which must be this one (aiohttp)
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(AGENT_ROOT), str(REPO / "sim")]),
            "HOME": str(tmp_path / "home"),
            gpus.GPU_ROOT_ENV: str(root),
            VISIBLE_DEVICES_ENV: ",".join(uuids),
            SCENARIO_ENV: str(builtin_dir() / "llama3-8b-tp2-24gb.yaml"),
            TIME_SCALE_ENV: "50",
            PEAK_HOLD_ENV: "0.05",
        }
    )
    if pod_ip is None:
        engine = ["--host", "127.0.0.1", "--port", str(free_port())]
    else:  # what the operator renders, in the sandbox's stand-in for the pod's network
        env.update({"POD_IP": pod_ip, POD_IP_ENV: pod_ip})
        engine = ["--host", "0.0.0.0", "--port", str(free_port(pod_ip))]
    child = [str(SHIM), "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "-tp", "2", *engine]
    child += ["--gpu-memory-utilization", "0.85"]
    proc = await start(launcher_cmd(tmp_path / "tl", child), env)
    drains: list[asyncio.Task[None]] = []
    try:
        port = await agent_port(proc, 30)
        drains = [asyncio.ensure_future(drain(proc.stdout)), asyncio.ensure_future(drain(proc.stderr))]
        report = await report_when(port, lambda r: any(k.kind == KV_TOKENS for k in r.kv_lines), 120)
        printed = next(k.value for k in report.kv_lines if k.kind == KV_TOKENS)
        # the engine serves its HTTP a moment after it printed its KV cache size
        seen = await asyncio.to_thread(
            wait_for,
            "the agent's rankguard_kv_free_tokens",
            lambda: (s := capacity_series(port)) and "rankguard_kv_free_tokens" in s and s,
            120,
        )
    finally:
        await stop(proc)
        for task in drains:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert printed > 0
    assert seen["rankguard_kv_capacity_tokens"] == printed
    assert 0 <= seen["rankguard_kv_free_tokens"] <= seen["rankguard_kv_capacity_tokens"]
