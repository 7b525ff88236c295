"""A neighbour process on a simulated GPU: a live process with its own allocation file, holding
from its start, growing on schedule and on command, never past what is free, gone with its process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankguard_agent.gpu import simfiles
from rankguard_sim.physics import gpus
from rankguard_sim.physics.neighbour import TAG, Growth, parse_growth, start_neighbour

GIB = 1 << 30
CLI = ("--hold", "1GiB", "--grow", "2GiB@0.2", "--no-commands")


def _polled_again(root: Path, uuid: str, pid: int) -> None:
    """The neighbour rewrote its allocation file twice more: a whole `take` ran after this call
    (each writes the file anew, atomically: a new inode)."""
    path = simfiles.proc_path(root, uuid, pid, TAG)
    for _ in range(2):
        seen = path.stat().st_ino
        _wait(lambda seen=seen: path.stat().st_ino != seen)


def _wait(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def gpu(tmp_path: Path) -> tuple[Path, str]:
    return tmp_path, gpus.create_gpus(tmp_path, 1, 80 * GIB, seed="n")[0]


def test_it_holds_from_the_start_and_grows_at_its_time(gpu: tuple[Path, str]) -> None:
    root, uuid = gpu
    started = time.monotonic()
    n = start_neighbour(root, uuid, 2 * GIB, [Growth(0.6, 6 * GIB)])
    try:
        procs = gpus.live_allocations(root, uuid)
        assert [(p.pid, p.tag, p.bytes) for p in procs] == [(n.pid, TAG, 2 * GIB)]
        assert n.pid != os.getpid()  # its own process, as NVML would list it
        assert gpus.used_bytes(root, uuid) == 2 * GIB  # the device's used memory counts it
        _wait(lambda: n.held() == 8 * GIB)
        assert time.monotonic() - started >= 0.6
        n.grow(GIB)
        assert gpus.used_bytes(root, uuid) == 9 * GIB
    finally:
        n.stop()
    assert gpus.used_bytes(root, uuid) == 0 and not gpus.all_allocations(root, uuid)


def test_it_takes_only_what_is_free_and_the_rest_once_freed(gpu: tuple[Path, str]) -> None:
    root, uuid = gpu
    engine = gpus.Allocation(root, uuid, "vllm")
    engine.set(75 * GIB)
    n = start_neighbour(root, uuid, 2 * GIB)
    try:
        n.grow(6 * GIB, timeout=None)
        _wait(lambda: n.held() == 5 * GIB)  # all that was free
        _polled_again(root, uuid, n.pid)  # and it asked again, and got nothing more
        assert n.held() == 5 * GIB and gpus.free_bytes(root, uuid) == 0
        engine.release()  # the engine dies
        _wait(lambda: n.held() == 8 * GIB)
    finally:
        n.stop()
        engine.release()


def test_it_dies_with_whoever_started_it(gpu: tuple[Path, str]) -> None:
    root, uuid = gpu
    n = start_neighbour(root, uuid, GIB)
    assert n.proc.stdin is not None
    n.proc.stdin.close()  # its parent gone
    n.proc.wait(10)
    assert n.proc.returncode == 0 and not gpus.all_allocations(root, uuid)


def test_the_command_line(gpu: tuple[Path, str]) -> None:
    root, uuid = gpu
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankguard_sim.physics.neighbour", "--root", str(root), "--gpu", uuid, *CLI],
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[4] / "sim")},
    )
    try:
        _wait(lambda: gpus.process_bytes(root, uuid, proc.pid) == 3 * GIB)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0 and not gpus.all_allocations(root, uuid)


def test_growth_specs() -> None:
    assert parse_growth("6GiB@30") == Growth(30.0, 6 * GIB)
    with pytest.raises(ValueError, match="BYTES@SECONDS"):
        parse_growth("6GiB")
    with pytest.raises(ValueError):
        parse_growth("lots@3")


def test_no_such_gpu(tmp_path: Path) -> None:
    with pytest.raises(gpus.SimGpuError):
        start_neighbour(tmp_path, "GPU-missing", GIB)
