"""Who else holds memory on the pod's GPUs (rankguard_agent.others), measured from the simulated
GPU's files with real processes: this test process as the agent, a child of it as the engine,
and a process outside its tree as a neighbour."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankguard_agent.gpu import GpuReading, ProcessMemory
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.others import (
    OthersTick,
    OthersTrack,
    PodProcesses,
    measure_others,
    read_stat,
)
from rankguard_agent.wire.report_memory import OtherProcess

GIB = 1 << 30
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def engine() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this process: the engine the agent (this process) started."""
    proc = subprocess.Popen(SLEEP)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def worker() -> Iterator[int]:
    """A grandchild, as vLLM's workers are (its engine core spawns them): a shell that stays
    is the middle generation."""
    middle = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' & wait"])
    grandchild = _child_of(middle.pid)
    try:
        yield grandchild
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
        middle.kill()
        middle.wait()


def _child_of(pid: int) -> int:
    """The one child of `pid`, waited for (the shell starts it at once)."""
    for _ in range(500):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = read_stat(int(entry))
                if stat is not None and stat.ppid == pid:
                    return int(entry)
        time.sleep(0.01)
    raise AssertionError(f"{pid} started no child")


def test_the_pod_is_the_agent_and_its_descendants(
    engine: subprocess.Popen[bytes], worker: int, neighbour: int
) -> None:
    pod = PodProcesses()
    assert pod.identify(os.getpid())[0] is True
    assert pod.identify(engine.pid) == (True, read_stat(engine.pid).comm)  # type: ignore[union-attr]
    assert pod.identify(worker)[0] is True
    ours, name = pod.identify(neighbour)
    assert ours is False and name == read_stat(neighbour).comm  # type: ignore[union-attr]
    assert name and not name.startswith("pid ")
    # A pid that is not visible (gone, or another pid namespace's) is someone else's, by number.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert pod.identify(gone.pid) == (False, f"pid {gone.pid}")


def test_a_reused_pid_is_looked_up_again(tmp_path: Path) -> None:
    """The answer is kept per process (pid and start time), not per pid number."""
    proc = tmp_path / "proc"
    (proc / "500").mkdir(parents=True)
    (proc / "9").mkdir()
    (proc / "9" / "stat").write_text("9 (agent) S 1 9 9 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n")
    stat = proc / "500" / "stat"
    stat.write_text("500 (vllm (core)) S 9 500 500 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 200 0 0\n")
    pod = PodProcesses(9, str(proc))
    assert pod.identify(500) == (True, "vllm (core)")  # a name with spaces and parentheses
    stat.write_text("500 (intruder) S 1 500 500 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 900 0 0\n")
    assert pod.identify(500) == (False, "intruder")


def reading(used: int, reserved: int = 0, error: str | None = None) -> GpuReading:
    return GpuReading(0, "GPU-0", 80 * GIB, used, 80 * GIB - used, reserved, error)


def test_others_from_the_sim_files_count_the_neighbour_not_the_pod(
    tmp_path: Path, engine: subprocess.Popen[bytes], worker: int, neighbour: int
) -> None:
    write_device(tmp_path, "GPU-0", index=0, total_bytes=80 * GIB, reserved_bytes=GIB // 2)
    write_proc(tmp_path, "GPU-0", "vllm", 30 * GIB, pid=engine.pid)
    write_proc(tmp_path, "GPU-0", "vllm", 20 * GIB, pid=worker)
    write_proc(tmp_path, "GPU-0", "probe", GIB)  # the agent's own (a probe rank's communicator)
    write_proc(tmp_path, "GPU-0", "cache", 6 * GIB, pid=neighbour)
    write_proc(tmp_path, "GPU-0", "more", GIB, pid=neighbour)  # a second allocation, same process
    backend = SimBackend(tmp_path, {})
    tick = measure_others(backend.read(0), backend.processes(0), PodProcesses())
    name = read_stat(neighbour).comm  # type: ignore[union-attr]
    assert tick == OthersTick(7 * GIB, (OtherProcess(neighbour, name, 7 * GIB),))


def test_memory_no_listed_process_holds_is_someone_elses() -> None:
    """On a real GPU the driver lists only the pod's own pid namespace: another pod's memory is
    what the listed processes do not account for (the driver's reserve left out)."""
    me = os.getpid()
    tick = measure_others(reading(50 * GIB, GIB), [ProcessMemory(me, 40 * GIB)], PodProcesses())
    assert tick == OthersTick(9 * GIB)
    # the list says more than the reading (read a moment apart): nothing is someone else's
    assert measure_others(reading(30 * GIB), [ProcessMemory(me, 40 * GIB)], PodProcesses()).bytes == 0


def test_others_are_unknown_when_the_pods_own_figure_or_the_list_is() -> None:
    pod = PodProcesses()
    assert measure_others(reading(50 * GIB), None, pod) == OthersTick(None)
    assert measure_others(reading(50 * GIB, error="GpuIsLost"), [], pod) == OthersTick(None)
    # NVML_VALUE_NOT_AVAILABLE for the pod's own process: its memory would pass for another's
    assert measure_others(reading(50 * GIB), [ProcessMemory(os.getpid(), None)], pod).bytes is None


def test_the_largest_four_are_named_the_rest_still_counted() -> None:
    gone = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(5)]
    for p in gone:
        p.wait()
    procs = [ProcessMemory(p.pid, (i + 1) * GIB) for i, p in enumerate(gone)]
    tick = measure_others(reading(15 * GIB), procs, PodProcesses())
    assert tick.bytes == 15 * GIB
    assert [o.bytes for o in tick.top] == [5 * GIB, 4 * GIB, 3 * GIB, 2 * GIB]
    assert all(o.name == f"pid {o.pid}" for o in tick.top)


def test_a_one_tick_blip_never_counts_and_the_peak_keeps_the_most() -> None:
    track = OthersTrack()
    track.push(OthersTick(2 * GIB))
    assert (track.shown.bytes, track.peak) == (None, None)  # one reading is not enough
    track.push(OthersTick(3 * GIB))
    assert (track.shown.bytes, track.peak) == (2 * GIB, 2 * GIB)
    track.push(OthersTick(60 * GIB))  # an engine allocating between the two calls
    track.push(OthersTick(3 * GIB))
    assert (track.shown.bytes, track.peak) == (3 * GIB, 3 * GIB)
    track.push(OthersTick(8 * GIB))
    track.push(OthersTick(9 * GIB))  # a neighbour that stays
    assert (track.shown.bytes, track.peak) == (8 * GIB, 8 * GIB)
    track.push(OthersTick(GIB))
    track.push(OthersTick(GIB))
    assert (track.shown.bytes, track.peak) == (GIB, 8 * GIB)
    track.push(OthersTick(None, (OtherProcess(5, "x", 1),)))
    assert track.shown == OthersTick(None, (OtherProcess(5, "x", 1),)) and track.peak == 8 * GIB


def test_a_growing_neighbour_first_seen_unnamed_is_named_from_the_next_tick() -> None:
    """A process that starts between a tick's list and its reading is memory no listed process
    accounts for that tick; while it keeps growing that tick is the lesser one, and its name
    comes from the next tick's list (the Event names the neighbour by pid)."""
    neighbour = OtherProcess(4242, "python3", 5 * GIB)
    track = OthersTrack()
    track.push(OthersTick(0))
    track.push(OthersTick(4 * GIB))  # listed before it started, read after: unnamed
    track.push(OthersTick(5 * GIB, (neighbour,)))  # listed now, and still growing
    assert track.shown == OthersTick(4 * GIB, (neighbour,))
    # gone: the newer tick is the lesser one and has no name to borrow from the older
    track.push(OthersTick(0))
    assert track.shown == OthersTick(0)
