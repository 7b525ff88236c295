"""`make demo` is the README's first command: it must tell its story and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.e2e


def _processes_with(marker: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _run_demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RANKGUARD_DEMO_DIR=str(tmp_path / "demo"), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "rankguard_sim", "demo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_demo_goes_from_a_rank0_oom_to_ready_and_stops_everything(tmp_path: Path) -> None:
    proc = _run_demo(tmp_path, "up")
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, out[-3000:]
    assert "kubectl get llmservice llama3-70b -w" in out
    assert "ShrinkKVCache: rank 0 ran out of GPU memory" in out
    assert "Running" in out.split("ShrinkKVCache", 1)[1]  # Ready again after the fix
    assert "Bottleneck: rank 0" in out
    assert out.rstrip().endswith("nothing left running.")
    demo_id = (tmp_path / "demo" / "state.json").exists()
    assert not demo_id  # the state file is gone with the demo
    assert _processes_with(b"RANKGUARD_DEMO_ID=") == []


def test_demo_down_stops_an_interrupted_demo(tmp_path: Path) -> None:
    proc = _run_demo(tmp_path, "up")
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "$ kubectl get llmservice" in line or time.monotonic() > deadline:
            break
    assert any("$ kubectl get llmservice" in line for line in seen), "".join(seen)[-2000:]
    env = dict(os.environ, RANKGUARD_DEMO_DIR=str(tmp_path / "demo"))
    down = subprocess.run(
        [sys.executable, "-m", "rankguard_sim", "demo", "down"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    assert "nothing left running" in down.stdout
    proc.wait(timeout=60)
    # the demo's children are reaped by then or moments later: wait on the thing asserted
    wait_for("the demo's processes gone", lambda: _processes_with(b"RANKGUARD_DEMO_ID=") == [], 30)
    assert not (tmp_path / "demo" / "state.json").exists()
