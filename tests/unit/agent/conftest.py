"""Fixtures shared by the unit tests that launch the agent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankguard_agent.gpu.simfiles import write_device
from tests.unit.agent.launched import AGENT_ROOT

GIB = 1 << 30


@pytest.fixture
def sim_env(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "gpus"
    for i in range(2):
        write_device(root, f"GPU-{i}", index=i, total_bytes=80 * GIB)
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": str(AGENT_ROOT),
            "RANKGUARD_SIM_GPU_ROOT": str(root),
            "NVIDIA_VISIBLE_DEVICES": "GPU-0,GPU-1",
        }
    )
    return env


@pytest.fixture
def neighbour() -> Iterator[int]:
    """A live process outside this process's tree (another pod's): started through a shell that
    exits at once, so that it is re-parented away from us."""
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        check=True,
        text=True,
    )
    pid = int(out.stdout)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
